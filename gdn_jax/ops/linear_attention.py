"""Gated linear attention without the delta rule: linear attention, per-head decay (Mamba2's SSD
core / RetNet; FLA's "simple GLA") and per-key-channel decay (GLA), with the backend switch of
:func:`gdn_jax.ops.gated_delta_rule` (``"scan"``, ``"chunk"``, ``"auto"`` -> chunk).

Sources: Katharopoulos et al. 2020, "Transformers are RNNs" (linear attention); Yang et al. 2023,
"Gated Linear Attention Transformers with Hardware-Efficient Training" (GLA, per-key-channel
decay, chunked form); Dao & Gu 2024, "Transformers are SSMs" (Mamba2 / SSD, scalar decay per head).

Per batch element and head, state S in R^{K x V}::

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T       # g_t scalar (per head) or [K] (per key channel)
    o_t = S_t^T (scale * q_t)

Chunked form (C tokens per chunk, gamma_i = sum_{j<=i} g_j within the chunk)::

    O  = (Q * exp(gamma)) S + (tril(Q K^T * Gamma)) V,   Gamma_ij = exp(gamma_i - gamma_j), i >= j
    S <- exp(gamma_C) S + (K * exp(gamma_C - gamma))^T V

No triangular inverse is needed (there is no delta-rule write). The decay mask is masked before
the exponential; per-key-channel decay uses ``chunk.decay_gram_channel``'s overflow-free
8-token sub-block factoring. The state recurrence across chunks is a ``lax.scan``, except up to
``PARALLEL_MAX_CHUNKS`` chunks without ``cu_seqlens`` (T <= 1024 at chunk_size 64): there every
chunk's entering state is one masked decay matrix times the chunks' contributions
(:func:`_parallel_states`), so a short sequence's forward and backward have no sequential loop.
"""
from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from . import chunk as _chunk
from ._common import (acc_dtype, check_flags, check_inputs, chunk_for, clamp_log_decay, finish_outputs,
                      nonfinite_guard, prepare, repeat_key_heads, value_group)
from ._warnings import warn_head_first
from .packing import chunk_resets, n_seq, scan_with_resets, token_resets

LA_BACKENDS = ("auto", "scan", "chunk")
PARALLEL_MAX_CHUNKS = 16  # chunk backend: up to this many chunks (and no cu_seqlens) no scan across chunks
_HI = jax.lax.Precision.HIGHEST


def _scan_forward(q, k, v, g, initial_state, cu_seqlens, *, g_pc: bool):
    """Token-by-token recurrence. Inputs [B,T,H,*] in the accumulation dtype, q pre-scaled."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = q.dtype
    tm = lambda x: jnp.moveaxis(x, 1, 0)

    def step(S, q, k, v, g):
        d = jnp.exp(g)
        S = S * (d[..., :, None] if g_pc else d[..., None, None]) + k[..., :, None] * v[..., None, :]
        return S, jnp.einsum("bhkv,bhk->bhv", S, q, precision=_HI)

    xs = tuple(map(tm, (q, k, v, g)))
    resets, N, valid = token_resets(cu_seqlens, T)
    fin, o = scan_with_resets(lambda S, x: step(S, *x), xs, initial_state, state_shape=(B, H, K, V), dtype=dt,
                              resets=resets, n_seq=N)
    return tm(o), fin, valid


def _chunk_forward(q, k, v, g, initial_state, cu_seqlens, *, chunk_size: int, g_pc: bool):
    """Chunked form. Inputs [B,T,H,*] in the accumulation dtype, q pre-scaled."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = int(chunk_size)
    dt = q.dtype
    (qc, kc, vc, gcc), T_pad, packing, valid = _chunk.to_chunks((q, k, v, g), cu_seqlens, C)
    gam, eg, ekd, dec = _chunk.decay_factors(gcc, g_pc)
    Aqk = (_chunk.decay_gram_channel if g_pc else _chunk.decay_gram_head)(qc, kc, gam)
    qg, kd = qc * eg, kc * ekd
    o_intra = _chunk.mm(Aqk, vc)  # [B,H,n,C,V]
    kv = _chunk.mm(jnp.swapaxes(kd, -1, -2), vc)  # [B,H,n,K,V]
    n = kv.shape[2]
    if cu_seqlens is None and n <= PARALLEL_MAX_CHUNKS:
        lc = gam[..., -1, :] if g_pc else gam[..., -1][..., None]  # log decay of each whole chunk
        S_in, fin = _parallel_states(kv, lc, initial_state, g_pc=g_pc)
        return _chunk.from_chunks(_chunk.mm(qg, S_in) + o_intra, T, packing), fin, valid
    tm = lambda x: jnp.moveaxis(x, 2, 0)
    xs = tuple(map(tm, (qg, kv, dec)))

    def chunk_step(S, x):
        qg, kv, dec = x
        return dec * S + kv, _chunk.mm(qg, S)

    fin, o_inter = scan_with_resets(chunk_step, xs, initial_state, state_shape=(B, H, K, V), dtype=dt,
                                    resets=chunk_resets(packing), n_seq=n_seq(cu_seqlens))
    return _chunk.from_chunks(jnp.moveaxis(o_inter, 0, 2) + o_intra, T, packing), fin, valid


def _parallel_states(kv, lc, initial_state, *, g_pc: bool):
    """The states entering every chunk and the final state, all at once (no scan across chunks).

    With ``S_{c+1} = exp(lc_c) S_c + kv_c`` (the scan's step; kv_c the chunk's contribution at its
    end), ``S_{c+1} = sum_{d <= c} exp(sum_{d < j <= c} lc_j) kv_d + exp(sum_{j <= c} lc_j) S_0``.
    The exponents are masked cumulative sums of same-sign terms (no difference of two large
    cumsums, so no cancellation when early chunks decay strongly) taken before the exponential
    (the masked-out ones are never exponentiated). Cost ``n^2 K V`` per batch element and head
    (the scan: ``n K V``), so the chunk backend uses it up to ``PARALLEL_MAX_CHUNKS`` chunks.

    Args: kv ``[B,H,n,K,V]``; lc ``[B,H,n,1]`` (per head) or ``[B,H,n,K]`` (per key channel) log
    decay of each whole chunk; initial_state ``[B,H,K,V]`` or None. Returns ``(S_in [B,H,n,K,V],
    final [B,H,K,V])``.
    """
    n = kv.shape[2]
    d_idx = jnp.arange(n)
    upper = d_idx[None, :] > d_idx[:, None]  # [d, j]: j > d
    Y = jnp.cumsum(jnp.where(upper[..., None], lc[:, :, None, :, :], 0.0), axis=3)  # [B,H,d,j,K]: sum_{d<j'<=j}
    Y = jnp.swapaxes(Y, 2, 3)  # [B,H,c,d,K]: sum_{d<j<=c}
    keep = (d_idx[:, None] >= d_idx[None, :])[..., None]  # [c, d]: d <= c
    M = jnp.where(keep, jnp.exp(jnp.where(keep, Y, 0.0)), 0.0)
    if g_pc:
        S_out = jnp.einsum("bhcdk,bhdkv->bhckv", M, kv, precision=_HI)
    else:
        S_out = jnp.einsum("bhcd,bhdkv->bhckv", M[..., 0], kv, precision=_HI)
    if initial_state is not None:
        S0 = initial_state.astype(kv.dtype)[:, :, None]  # [B,H,1,K,V]
        S_out = S_out + jnp.exp(jnp.cumsum(lc, axis=2))[..., None] * S0
    else:
        S0 = jnp.zeros_like(kv[:, :, :1])
    S_in = jnp.concatenate([S0, S_out[:, :, :-1]], axis=2)
    return S_in, S_out[:, :, -1]


def gated_linear_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: Optional[jax.Array] = None,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[jax.Array] = None, output_final_state: bool = False,
    cu_seqlens: Optional[jax.Array] = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64, backend: str = "auto",
    mask_nonfinite: bool = False,
) -> Tuple[jax.Array, Optional[jax.Array]]:
    """Gated linear attention (no delta rule): ``S <- diag(exp(g_t)) S + k_t v_t^T``, ``o_t = S^T (scale q_t)``.

    * ``g=None``: plain linear attention (Katharopoulos et al. 2020), no decay.
    * g ``[B, T, H]``: one decay per head (Mamba2's SSD core, Dao & Gu 2024; RetNet with constant g;
      FLA's "simple GLA").
    * g ``[B, T, H, K]``: one decay per key channel (GLA, Yang et al. 2023): row c of S is scaled by
      ``exp(g[..., c])``.

    Args:
      q, k: ``[B, T, Hk, K]`` queries and keys, any float dtype.
      v: ``[B, T, H, V]`` values; ``o`` is returned in ``v.dtype`` (H a multiple of Hk: grouped
        value heads, as in :func:`gdn_jax.ops.gated_delta_rule`).
      g: optional LOG-space decay (g <= 0, dimensionless, natural log of the per-token multiplier;
        ``-inf`` allowed); the chunked form floors it at -87 (float32) / -1000 (float64), as
        :func:`gdn_jax.ops.gated_delta_rule` does. A concrete g with a positive finite entry is a
        ``ValueError``; a traced one cannot be checked: there a positive g is a growing state, and
        large ones overflow to inf on every backend.
      scale: query scale; ``None`` means ``K ** -0.5``.
      initial_state: ``[B, H, K, V]`` (``[N, H, K, V]`` with ``cu_seqlens``), default zeros.
      output_final_state: also return the final state.
      cu_seqlens: integer ``[N + 1]`` boundaries of packed sequences (B = 1), as in
        :func:`gdn_jax.ops.gated_delta_rule` (a malformed traced one gives NaN outputs).
      use_qk_l2norm: L2-normalise q and k over the last axis (before the scale).
      chunk_size: tokens per chunk for ``backend="chunk"``.
      backend: ``"scan"`` (token-by-token ``lax.scan``), ``"chunk"`` (chunked matmuls plus a
        ``lax.scan`` over chunks; up to ``PARALLEL_MAX_CHUNKS`` = 16 chunks without cu_seqlens, the
        chunks' states all at once instead, see the module docstring), ``"auto"`` (= ``"chunk"``).
      mask_nonfinite: as :func:`gdn_jax.ops.gated_delta_rule` (a non-finite k, v or g at t
        then poisons only t and later; default off: then the chunk form lets it make earlier
        outputs NaN too — those of its own chunk and, in the parallel state pass, those of every
        chunk after the first).

    Returns:
      ``(o, final_state)``: o ``[B, T, H, V]`` in ``v.dtype``; final_state ``[B, H, K, V]``
      (``[N, H, K, V]`` with cu_seqlens) in float32 (float64 for float64 inputs), or ``None``
      unless ``output_final_state``. The state is accumulated in float32 (float64 for float64 inputs).

    Warns:
      HeadFirstLayoutWarning: as :func:`gdn_jax.ops.gated_delta_rule` (``1 < T < H`` in a direct call).

    Raises:
      TypeError / ValueError: as :func:`gdn_jax.ops.gated_delta_rule` (wrong dtypes, shapes,
        cu_seqlens, initial_state, chunk_size, a positive concrete g); ValueError for an unknown
        backend.
    """
    if backend not in LA_BACKENDS:
        raise ValueError(f"backend must be one of {LA_BACKENDS}, got {backend!r}")
    check_flags(use_qk_l2norm=use_qk_l2norm, output_final_state=output_final_state, mask_nonfinite=mask_nonfinite)
    lead = tuple(v.shape[:3]) if hasattr(v, "shape") and len(v.shape) == 4 else (1, 1, 1)
    g_chk = jax.ShapeDtypeStruct(lead, jnp.float32) if g is None else g
    beta_dummy = jax.ShapeDtypeStruct(lead, jnp.float32)  # no delta rule: a per-head beta of ones
    forms = check_inputs(q, k, v, g_chk, beta_dummy, initial_state, cu_seqlens, chunk_size, scale)
    warn_head_first("gated_linear_attention", q)  # direct calls only (layers call inside _warnings.internal_call)
    dt = acc_dtype(q, k, v, g, initial_state)
    if cu_seqlens is not None:
        cu_seqlens = jnp.asarray(cu_seqlens)
    out_dtype = v.dtype
    group = value_group(q, v)
    q, k = repeat_key_heads(q, group), repeat_key_heads(k, group)
    if g is None:
        g = jnp.zeros(v.shape[:3], dt)
    if mask_nonfinite:
        (q, k, v, g, _), guard_finish = nonfinite_guard(q, k, v, g, None, cu_seqlens, g_pc=forms.g_per_channel,
                                                        b_pc=False)
    q, k, v, g, _ = prepare(q, k, v, g, None, scale, use_qk_l2norm, dt)
    if backend != "scan":  # the chunked form floors g (see clamp_log_decay)
        g = clamp_log_decay(g, dt)
    h0 = None if initial_state is None else initial_state.astype(dt)
    if backend == "scan":
        o, fin, valid = _scan_forward(q, k, v, g, h0, cu_seqlens, g_pc=forms.g_per_channel)
    else:
        o, fin, valid = _chunk_forward(q, k, v, g, h0, cu_seqlens, chunk_size=chunk_for(chunk_size, q.shape[1]),
                                       g_pc=forms.g_per_channel)
    return finish_outputs(o, fin, out_dtype, guard_finish=guard_finish if mask_nonfinite else None, valid=valid,
                          packed=cu_seqlens is not None, output_final_state=output_final_state)
