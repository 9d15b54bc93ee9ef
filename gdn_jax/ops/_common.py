"""Shared pieces of the gated delta rule backends: argument checking, dtypes,
L2 normalisation and packed-sequence (``cu_seqlens``) bookkeeping.

Everything here is backend-agnostic; the backends themselves live in
``scan.py``, ``chunk.py`` and ``pallas.py``.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

L2NORM_EPS = 1e-6
SUPPORTED_CHUNK_SIZES = (16, 32, 64, 128)


@dataclasses.dataclass(frozen=True)
class GateForms:
    """Which gate layouts a call uses (static information for dispatch)."""

    g_per_channel: bool  # g is [B,T,H,K] (Kimi Delta Attention) instead of [B,T,H]
    beta_per_channel: bool  # beta is [B,T,H,V] (seed 004) instead of [B,T,H]


def _shape(x) -> tuple:
    return tuple(np.shape(x))


def _is_floating(x) -> bool:
    return jnp.issubdtype(jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype, jnp.floating)


def check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, scale) -> GateForms:
    """Validate shapes and dtypes of a ``gated_delta_rule`` call.

    Raises:
      TypeError: an array argument is not floating point (``cu_seqlens`` not integer).
      ValueError: a rank or dimension disagrees with the layout
        q, k ``[B,T,H,K]``, v ``[B,T,H,V]``, g ``[B,T,H]`` or ``[B,T,H,K]``,
        beta ``[B,T,H]`` or ``[B,T,H,V]``, initial_state ``[B,H,K,V]``
        (``[N,H,K,V]`` with ``cu_seqlens`` of length N+1), or ``chunk_size`` <= 0.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must have a floating dtype (float16/bfloat16/float32/float64), got {x.dtype}")
    if q.ndim != 4:
        raise ValueError(f"q must have shape [B, T, H, K] (rank 4), got shape {_shape(q)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q [B, T, H, K] = {(B, T, H, K)}, got shape {_shape(k)}")
    if v.ndim != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must have shape [B, T, H, V] = {(B, T, H)} + (V,), got shape {_shape(v)}")
    V = v.shape[3]
    if T == 0:
        raise ValueError(f"q has T = 0 tokens (shape {_shape(q)}); need T >= 1")
    if g.shape == (B, T, H):
        g_pc = False
    elif g.shape == (B, T, H, K):
        g_pc = True
    else:
        raise ValueError(
            f"g (log-space decay) must have shape [B, T, H] = {(B, T, H)} (per head) or "
            f"[B, T, H, K] = {(B, T, H, K)} (per key channel), got shape {_shape(g)}"
        )
    if beta.shape == (B, T, H):
        b_pc = False
    elif beta.shape == (B, T, H, V):
        b_pc = True
    else:
        raise ValueError(
            f"beta must have shape [B, T, H] = {(B, T, H)} (per head) or "
            f"[B, T, H, V] = {(B, T, H, V)} (per value channel), got shape {_shape(beta)}"
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if scale is not None and not isinstance(scale, (int, float, np.floating, np.integer)):
        if not (hasattr(scale, "shape") and _shape(scale) == ()):
            raise TypeError(f"scale must be a Python or scalar number, got {type(scale).__name__}")

    n_states = B
    if cu_seqlens is not None:
        if not hasattr(cu_seqlens, "dtype"):
            cu_seqlens = np.asarray(cu_seqlens)
        if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
            raise TypeError(f"cu_seqlens must be an integer array, got dtype {cu_seqlens.dtype}")
        if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must have shape [N + 1] with N >= 1, got shape {_shape(cu_seqlens)}")
        if B != 1:
            raise ValueError(f"cu_seqlens (packed sequences) needs batch size B = 1, got q of shape {_shape(q)}")
        n_states = cu_seqlens.shape[0] - 1
        if not isinstance(cu_seqlens, jax.core.Tracer):
            cu = np.asarray(cu_seqlens)
            if cu[0] != 0 or cu[-1] != T:
                raise ValueError(f"cu_seqlens must start at 0 and end at T = {T}, got {cu.tolist()}")
            if np.any(np.diff(cu) < 0):
                raise ValueError(f"cu_seqlens must be non-decreasing, got {cu.tolist()}")

    if initial_state is not None:
        if not hasattr(initial_state, "dtype"):
            raise TypeError(f"initial_state must be an array, got {type(initial_state).__name__}")
        if not jnp.issubdtype(initial_state.dtype, jnp.floating):
            raise TypeError(f"initial_state must have a floating dtype, got {initial_state.dtype}")
        want = (n_states, H, K, V)
        if tuple(initial_state.shape) != want:
            what = "[N, H, K, V] (N = len(cu_seqlens) - 1)" if cu_seqlens is not None else "[B, H, K, V]"
            raise ValueError(f"initial_state must have shape {what} = {want}, got shape {_shape(initial_state)}")
    return GateForms(g_per_channel=g_pc, beta_per_channel=b_pc)


def acc_dtype(*xs):
    """float64 if any input is float64 (x64 on), else float32."""
    for x in xs:
        if x is not None and x.dtype == jnp.float64:
            return jnp.float64
    return jnp.float32


def l2norm(x, eps: float = L2NORM_EPS):
    """x / sqrt(sum(x**2, -1) + eps), computed in x's dtype (call on upcast values)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def prepare(q, k, v, g, beta, scale, use_qk_l2norm, dtype):
    """Upcast to the accumulation dtype, normalise q/k if asked and fold the scale into q."""
    q, k, v, g, beta = (x.astype(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = l2norm(q)
        k = l2norm(k)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    q = q * jnp.asarray(scale, dtype)
    return q, k, v, g, beta


def seq_info(cu_seqlens, T: int):
    """Per-token sequence ids and start flags for packed sequences.

    Returns (seq_id [T] int32, is_start [T] bool, is_last [T] bool, valid scalar bool).
    ``valid`` is False when the (possibly traced) cu_seqlens is malformed.
    """
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    t = jnp.arange(T, dtype=jnp.int32)
    # index n of the sequence holding token t: number of ends <= t.
    seq_id = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
    seq_id = jnp.minimum(seq_id, cu.shape[0] - 2)
    is_start = t == cu[seq_id]
    is_last = t == cu[seq_id + 1] - 1
    valid = (cu[0] == 0) & (cu[-1] == T) & jnp.all(jnp.diff(cu) >= 0)
    return seq_id, is_start, is_last, valid


def poison_if_invalid(x, valid):
    """Multiply ``x`` by NaN when a traced ``cu_seqlens`` turned out malformed (never a silent
    answer): the values AND the gradients flowing through them become NaN."""
    return x * jnp.where(valid, 1.0, jnp.nan).astype(x.dtype)


# Floor of the per-token log decay in float32. exp(-60) ~ 8.8e-27: the state is zeroed to
# float32 precision either way, while the chunked backends never difference cumulative decays
# of order 1e4 and beyond (whose rounding would be amplified by exp), and g = -inf gives no NaN.
G_MIN_F32 = -60.0


def clamp_log_decay(g, acc_dtype):
    """``max(g, -60)`` for float32 accumulation (no clamp in float64)."""
    if jnp.dtype(acc_dtype) == jnp.float64:
        return g
    return jnp.maximum(g, jnp.asarray(G_MIN_F32, g.dtype))
