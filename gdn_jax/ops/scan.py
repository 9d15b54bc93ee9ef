"""``backend="scan"``: the token-by-token recurrence as a ``lax.scan``, the oracle.

Per (batch, head), with state S in R^{K x V} (GDN paper, eq. 10, K x V layout)::

    S   <- exp(g_t) * S                          # decay first (per head, or per key row)
    S   <- S + k_t (beta_t * (v_t - S^T k_t))^T  # delta-rule write, prediction from the decayed state
    o_t  = S^T q_t                               # q already scaled

Takes every gate form: g ``[B,T,H]`` or ``[B,T,H,K]``; beta ``[B,T,H]`` or ``[B,T,H,V]``.
Arguments arrive validated, upcast and scaled (see ``gated_delta_rule``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .packing import scan_with_resets, token_resets

_HI = jax.lax.Precision.HIGHEST


def _step(S, q, k, v, g, beta, g_pc: bool, b_pc: bool):
    """One token for all (batch, head): S [B,H,K,V]; q,k [B,H,K]; v [B,H,V]; g [B,H](K); beta [B,H](V)."""
    decay = jnp.exp(g)
    S = S * (decay[..., :, None] if g_pc else decay[..., None, None])
    pred = jnp.einsum("bhkv,bhk->bhv", S, k, precision=_HI)
    b = beta if b_pc else beta[..., None]
    delta = b * (v - pred)
    S = S + k[..., :, None] * delta[..., None, :]
    o = jnp.einsum("bhkv,bhk->bhv", S, q, precision=_HI)
    return S, o


def scan_forward(q, k, v, g, beta, initial_state, cu_seqlens, *, g_pc: bool, b_pc: bool):
    """Run the recurrence. Inputs [B,T,H,*] in the accumulation dtype, q pre-scaled.

    Returns (o [B,T,H,V] in the accumulation dtype, final_state [B,H,K,V] or [N,H,K,V], valid flag).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    tm = lambda x: jnp.moveaxis(x, 1, 0)  # [B,T,...] -> [T,B,...]
    xs = tuple(map(tm, (q, k, v, g, beta)))
    step = lambda S, x: _step(S, *x, g_pc, b_pc)
    resets, N, valid = token_resets(cu_seqlens, T)
    fin, o = scan_with_resets(step, xs, initial_state, state_shape=(B, H, K, V), dtype=q.dtype, resets=resets,
                              n_seq=N)
    return tm(o), fin, valid
