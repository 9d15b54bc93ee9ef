"""Fused decode step of the gated delta rule: one Pallas kernel per batch of single tokens.

Per (batch x value head, block of ``bv`` value channels), in one pass over the state block
S [K, bv] (read once in its dtype, accumulated in float32, written once in ``state_dtype``)::

    q, k  <- L2-normalised (``use_qk_l2norm``), q * scale
    S     <- exp(g) * S                        (g per head, or per key channel: one row each)
    S     <- S + k (beta * (v - S^T k))^T       (beta per head, or per value channel)
    o      = S^T q

the same order and formulas as :func:`gdn_jax.ops.gated_delta_rule_step` (decay first, the
prediction from the decayed state). Grouped value heads read their key head through the index
maps. The products S^T k and S^T q are reductions over K (a vector against a matrix: no tensor
cores needed; the step is bound by reading and writing S). GPU through the Triton lowering, CPU in
interpret mode; on TPU (``platform`` "tpu" / "tpu_interpret") one program per batch row takes
every head (blocks of full head dims satisfy the (8, 128) rule), grouped heads repeated in-kernel.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._common import L2NORM_EPS
from .._vma import varying_struct
from . import platform as _plat
from . import partition as _partition

F32 = jnp.float32


def covers(K: int, V: int, dtype, state_dtype) -> Optional[str]:
    """None when the decode kernel takes these head dims and dtypes, else the reason."""
    for name, d in (("K", K), ("V", V)):
        if d < 16 or d > 256 or d & (d - 1):
            return f"head dim {name}={d} (needs a power of two from 16 to 256)"
    for name, dt in (("inputs", dtype), ("state", state_dtype)):
        if jnp.dtype(dt) not in (jnp.dtype(F32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            return f"{name} dtype {jnp.dtype(dt)} (needs float32, bfloat16 or float16)"
    return None


def _kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, o_ref, ns_ref, *, scale, l2norm):
    q = q_ref[...].astype(F32)
    k = k_ref[...].astype(F32)
    if l2norm:
        q = q * jax.lax.rsqrt(jnp.sum(q * q) + L2NORM_EPS)
        k = k * jax.lax.rsqrt(jnp.sum(k * k) + L2NORM_EPS)
    q = q * scale
    S = s_ref[...].astype(F32) * jnp.exp(g_ref[...].astype(F32))[:, None]  # g: [1] or [K]
    pred = jnp.sum(S * k[:, None], axis=0)
    delta = b_ref[...].astype(F32) * (v_ref[...].astype(F32) - pred)  # beta: [1] or [bv]
    S = S + k[:, None] * delta[None, :]
    o_ref[...] = jnp.sum(S * q[:, None], axis=0).astype(o_ref.dtype)
    ns_ref[...] = S.astype(ns_ref.dtype)


def _kernel_heads(q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, o_ref, ns_ref, *, scale, l2norm, group):
    """TPU: every head of one batch row per program (blocks obey the (8, 128) rule as full
    dims): q, k [Hk, K], v [H, V], g [H, 1 | K], beta [H, 1 | V], S [H, K, V]."""
    q = q_ref[...].astype(F32)
    k = k_ref[...].astype(F32)
    if l2norm:
        q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=-1, keepdims=True) + L2NORM_EPS)
        k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=-1, keepdims=True) + L2NORM_EPS)
    q = q * scale
    if group > 1:  # value head j reads key head j // group
        Hk, K = q.shape
        q, k = (jnp.broadcast_to(x[:, None, :], (Hk, group, K)).reshape(Hk * group, K) for x in (q, k))
    S = s_ref[...].astype(F32) * jnp.exp(g_ref[...].astype(F32))[:, :, None]  # g: [H, 1] or [H, K]
    pred = jnp.sum(S * k[:, :, None], axis=1)
    delta = b_ref[...].astype(F32) * (v_ref[...].astype(F32) - pred)  # beta: [H, 1] or [H, V]
    S = S + k[:, :, None] * delta[:, None, :]
    o_ref[...] = jnp.sum(S * q[:, :, None], axis=1).astype(o_ref.dtype)
    ns_ref[...] = S.astype(ns_ref.dtype)


def _tpu_call(p, q, k, v, g3, b3, state, *, scale, use_qk_l2norm, state_dtype):
    B, Hk, K = q.shape
    H, V = v.shape[1], v.shape[2]
    full = lambda *shape: pl.BlockSpec((None,) + shape, lambda b: (b,) + (0,) * len(shape))
    specs = [full(Hk, K), full(Hk, K), full(H, V), full(H, g3.shape[-1]), full(H, b3.shape[-1]), full(H, K, V)]
    out_specs = [full(H, V), full(H, K, V)]
    out_shape = [varying_struct(jax.ShapeDtypeStruct(s, d), q, k, v, g3, b3, state)  # typed for shard_map
                 for s, d in (((B, H, V), v.dtype), ((B, H, K, V), jnp.dtype(state_dtype)))]
    aliases = {5: 1} if jnp.dtype(state.dtype) == jnp.dtype(state_dtype) else {}
    blocks = [(specs[5], state.dtype), (out_specs[1], state_dtype), (specs[2], v.dtype), (out_specs[0], v.dtype)]
    fn = pl.pallas_call(
        functools.partial(_kernel_heads, scale=float(scale), l2norm=bool(use_qk_l2norm), group=H // Hk),
        out_shape=out_shape, grid=(B,), in_specs=specs, out_specs=out_specs, input_output_aliases=aliases,
        name="gdn_decode_step_tpu", **_plat.call_kwargs(p, num_warps=4, num_stages=1, n_grid=1, blocks=blocks))
    return _plat.invoke(p, fn, q, k, v, g3, b3, state)


def decode_step(q, k, v, g, beta, state, *, scale, use_qk_l2norm: bool, state_dtype, g_per_channel: bool,
                beta_per_channel: bool, platform: Optional[str] = None, bv: Optional[int] = None,
                num_warps: int = 4):
    """The fused step (arguments validated by the caller, shapes as
    :func:`gdn_jax.ops.gated_delta_rule_step`): q, k [B, Hk, K]; v [B, H, V]; g [B, H] or
    [B, H, K]; beta [B, H] or [B, H, V]; state [B, H, K, V]; ``scale`` a Python float (a traced
    scale is folded into q by the caller). Returns (o [B, H, V] in v.dtype, new state in
    ``state_dtype``). The state buffer is aliased to the new state when the dtypes agree (donate it
    under ``jax.jit`` to update in place). ``platform``: the kernel platform (None: that of
    ``jax.default_backend()``)."""
    p = platform or _plat.default_platform()
    g3 = g if g_per_channel else g[..., None]
    b3 = beta if beta_per_channel else beta[..., None]
    static = (p, float(scale), bool(use_qk_l2norm), jnp.dtype(state_dtype).name, bv, num_warps)
    # partitioned over batch rows and heads under jit (see .partition)
    return _partition.run_sharded(_step_block, static, (q, k, v, g3, b3, state), ("bh.", "bh.", "bv.", "bv.", "bv.", "bv.."),
                       ("bv.", "bv.."), group=v.shape[1] // q.shape[1], interpreted=_plat.interpreted(p))


def _step_block(static, q, k, v, g3, b3, state):
    """The fused step on one block of batch rows and heads: g3 [B, H, 1 | K], b3 [B, H, 1 | V]."""
    p, scale, use_qk_l2norm, state_dtype, bv, num_warps = static
    B, Hk, K = q.shape
    H, V = v.shape[1], v.shape[2]
    G = H // Hk
    bv = bv or min(V, 64)
    if _plat.is_tpu_layout(p):
        return _tpu_call(p, q, k, v, g3, b3, state, scale=scale, use_qk_l2norm=use_qk_l2norm, state_dtype=state_dtype)
    gk, bw = g3.shape[-1], b3.shape[-1]
    key = pl.BlockSpec((None, None, K), lambda i, j: (i // H, (i % H) // G, 0))
    specs = [key, key, pl.BlockSpec((None, None, bv), lambda i, j: (i // H, i % H, j)),
             pl.BlockSpec((None, None, gk), lambda i, j: (i // H, i % H, 0)),
             pl.BlockSpec((None, None, bw if bw == 1 else bv), lambda i, j: (i // H, i % H, 0 if bw == 1 else j)),
             pl.BlockSpec((None, None, K, bv), lambda i, j: (i // H, i % H, 0, j))]
    out_specs = [pl.BlockSpec((None, None, bv), lambda i, j: (i // H, i % H, j)),
                 pl.BlockSpec((None, None, K, bv), lambda i, j: (i // H, i % H, 0, j))]
    out_shape = [varying_struct(jax.ShapeDtypeStruct(s, d), q, k, v, g3, b3, state)  # typed for shard_map
                 for s, d in (((B, H, V), v.dtype), ((B, H, K, V), jnp.dtype(state_dtype)))]
    aliases = {5: 1} if jnp.dtype(state.dtype) == jnp.dtype(state_dtype) else {}
    fn = pl.pallas_call(
        functools.partial(_kernel, scale=float(scale), l2norm=bool(use_qk_l2norm)),
        out_shape=out_shape, grid=(B * H, V // bv), in_specs=specs, out_specs=out_specs,
        input_output_aliases=aliases, name="gdn_decode_step",
        **_plat.call_kwargs(p, num_warps=num_warps, num_stages=1, n_grid=2))
    o, ns = _plat.invoke(p, fn, q, k, v, g3, b3, state)
    return o, ns
