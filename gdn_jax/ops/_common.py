"""Shared pieces of the gated delta rule backends: argument checking, dtypes,
L2 normalisation and packed-sequence (``cu_seqlens``) bookkeeping.

Everything here is backend-agnostic; the backends live in ``scan.py``, ``chunk.py`` and the
``pallas`` package, packed-sequence bookkeeping in ``packing.py``.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .packing import seq_info

L2NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class GateForms:
    """Which gate layouts a call uses (static information for dispatch)."""

    g_per_channel: bool  # g is [B,T,H,K] (Kimi Delta Attention) instead of [B,T,H]
    beta_per_channel: bool  # beta is [B,T,H,V] (one write strength per value channel) instead of [B,T,H]


def _shape(x) -> tuple:
    return tuple(np.shape(x))


def _check_arrays(named):
    for name, x in named:
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must have a floating dtype (float16/bfloat16/float32/float64), got {x.dtype}")


def _gate_forms(g, beta, lead, K, V, lead_names):
    """Per-head or per-channel g / beta on the leading dims ``lead`` (named ``lead_names``)."""
    L = ", ".join(lead_names)
    per_channel = []
    for name, x, what, ch, ch_what in (("g", g, "g (log-space decay)", ("K", K), "key"),
                                       ("beta", beta, "beta", ("V", V), "value")):
        if x.shape not in (lead, lead + (ch[1],)):
            raise ValueError(f"{what} must have shape [{L}] = {lead} (per head) or [{L}, {ch[0]}] = "
                             f"{lead + (ch[1],)} (per {ch_what} channel), got shape {_shape(x)}")
        per_channel.append(x.shape != lead)
    return GateForms(g_per_channel=per_channel[0], beta_per_channel=per_channel[1])


def finish_outputs(o, fin, out_dtype, *, guard_finish, valid, packed, output_final_state):
    """The ops' last step: o to ``out_dtype``; the non-finite guard's NaNs (``guard_finish`` from
    :func:`nonfinite_guard`, or None); NaNs for a malformed traced ``cu_seqlens``; the final state
    only if asked for."""
    o = o.astype(out_dtype)
    if guard_finish is not None:
        o, fin = guard_finish(o, fin)
    if packed:
        o = poison_if_invalid(o, valid)
        fin = poison_if_invalid(fin, valid)
    return o, (fin if output_final_state else None)


def _check_qkv(q, k, v, lead_names):
    """q, k ``[*lead, Hk, K]`` and v ``[*lead, Hv, V]`` with Hv a multiple of Hk (grouped value
    heads); returns (lead with Hv as the head dim, K, V) -- the gates and states live on the value
    heads."""
    n = len(lead_names)
    L = ", ".join(lead_names)
    if q.ndim != n + 1:
        raise ValueError(f"q must have shape [{L}, K] (rank {n + 1}), got shape {_shape(q)}")
    lead, K = tuple(q.shape[:n]), q.shape[n]
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q [{L}, K] = {lead + (K,)}, got shape {_shape(k)}")
    Lv = ", ".join(lead_names[:-1] + ("Hv",))
    if v.ndim != n + 1 or tuple(v.shape[:n - 1]) != lead[:-1]:
        raise ValueError(f"v must have shape [{Lv}, V] = {lead[:-1]} + (Hv, V), got shape {_shape(v)}")
    Hk, Hv = lead[-1], v.shape[n - 1]
    if min(Hk, Hv, K, v.shape[n]) == 0:
        raise ValueError(f"q, k and v need at least one head and one channel, got q of shape {_shape(q)}, v of "
                         f"shape {_shape(v)}")
    if Hv % Hk:
        raise ValueError(f"v has {Hv} heads, q and k have {Hk}: the value heads must be a multiple of the key "
                         f"heads (grouped value heads: value head j reads key head j // (Hv // Hk)); got v of "
                         f"shape {_shape(v)}, q of shape {_shape(q)}")
    return lead[:-1] + (Hv,), K, v.shape[n]


def value_group(q, v) -> int:
    """Value heads per key head, Hv // Hk (1 without grouped value heads)."""
    return v.shape[-2] // q.shape[-2]


def repeat_key_heads(x, group: int):
    """q or k ``[..., Hk, K]`` repeated to the value heads ``[..., Hk * group, K]`` in HF's
    ``repeat_interleave`` order (value head j reads key head j // group); gradients sum over each
    group."""
    return x if group == 1 else jnp.repeat(x, group, axis=-2)


def check_flags(**flags) -> None:
    """Each keyword must be a bool (TypeError naming it: ``"no"`` or ``1`` would read as True)."""
    for name, flag in flags.items():
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__} {flag!r}")


def chunk_for(chunk_size: int, T: int) -> int:
    """The chunk the chunked forms run: ``chunk_size``, or the power of two that covers T when that
    is smaller (one chunk either way; a huge ``chunk_size`` must not pad T to it)."""
    return min(chunk_size, 1 << max(T - 1, 0).bit_length())


def check_scale(scale) -> None:
    """``scale``: None, a real Python / NumPy number or a scalar (0-d) array, finite where concrete
    (TypeError / ValueError otherwise; zero and negative scales are allowed)."""
    if scale is None:
        return
    if isinstance(scale, (bool, np.bool_)) or not (
            isinstance(scale, (int, float, np.floating, np.integer))
            or (hasattr(scale, "shape") and hasattr(scale, "dtype") and _shape(scale) == ())):
        raise TypeError(f"scale must be a Python or scalar (0-d) real number or None, got {type(scale).__name__} "
                        f"{_shape(scale) if hasattr(scale, 'shape') else ''}".rstrip())
    if hasattr(scale, "dtype") and not (jnp.issubdtype(scale.dtype, jnp.floating)
                                        or jnp.issubdtype(scale.dtype, jnp.integer)):
        raise TypeError(f"scale must be a real number, got dtype {scale.dtype}")
    if not isinstance(scale, jax.core.Tracer) and not np.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {float(scale)}")


def check_step_inputs(q, k, v, g, beta, state) -> GateForms:
    """Validate a ``gated_delta_rule_step`` call: q, k ``[B,Hk,K]``, v ``[B,H,V]`` (H a multiple
    of Hk), g ``[B,H]`` or ``[B,H,K]``, beta ``[B,H]`` or ``[B,H,V]``, state ``[B,H,K,V]`` (the
    rules of :func:`check_inputs` without the token axis).

    Raises:
      TypeError: an argument is not a floating-point array. ValueError: a shape that does not fit.
    """
    _check_arrays((("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state)))
    lead, K, V = _check_qkv(q, k, v, ("B", "Hk"))
    forms = _gate_forms(g, beta, lead, K, V, ("B", "H"))
    if tuple(state.shape) != lead + (K, V):
        raise ValueError(f"state must have shape [B, H, K, V] = {lead + (K, V)}, got shape {_shape(state)}")
    check_log_decay_values(g)
    return forms


def check_cu_values(cu_seqlens, T: int) -> None:
    """Concrete ``cu_seqlens`` (traced ones are checked on the device, :func:`~gdn_jax.ops.packing.seq_info`):
    ValueError unless they start at 0, end at ``T`` and never decrease (compared as signed integers:
    an unsigned array's decrease would wrap around in ``np.diff``)."""
    if isinstance(cu_seqlens, jax.core.Tracer):
        return
    cu = np.asarray(cu_seqlens).astype(np.int64)
    if cu[0] != 0 or cu[-1] != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {T}, got {cu.tolist()}")
    if np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu.tolist()}")


def check_log_decay_values(g) -> None:
    """Concrete ``g`` (an array outside ``jit`` / ``grad``; traced values cannot be checked): ValueError
    if a finite entry is positive. g is a LOG-space decay, ``S <- exp(g) S``, so g <= 0; a positive g
    grows the state, which the chunked forms (cumulative decays inside a chunk) and the scan overflow
    at different points -- backends that disagree rather than one clear answer. ``-inf`` (a full
    reset) passes; NaN and ``+inf`` pass too (non-finite inputs: ``mask_nonfinite``'s business)."""
    if g is None or isinstance(g, (jax.core.Tracer, jax.ShapeDtypeStruct)) or not hasattr(g, "dtype"):
        return
    g = np.asarray(jax.device_get(g), np.float64)  # NumPy: no traced value even inside another jit's trace
    bad = (g > 0) & np.isfinite(g)
    if bad.any():
        raise ValueError(f"g is a log-space decay and must be <= 0 (the state is multiplied by exp(g)); "
                         f"got {int(bad.sum())} positive entries, the largest {float(g[bad].max()):g}")


def check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, scale) -> GateForms:
    """Validate shapes and dtypes of a ``gated_delta_rule`` call.

    Raises:
      TypeError: an array argument is not floating point (``cu_seqlens`` not integer).
      ValueError: a rank or dimension disagrees with the layout
        q, k ``[B,T,Hk,K]``, v ``[B,T,H,V]`` (H a multiple of Hk), g ``[B,T,H]`` or ``[B,T,H,K]``,
        beta ``[B,T,H]`` or ``[B,T,H,V]``, initial_state ``[B,H,K,V]``
        (``[N,H,K,V]`` with ``cu_seqlens`` of length N+1), or ``chunk_size`` <= 0.
    """
    _check_arrays((("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)))
    (B, T, H), K, V = _check_qkv(q, k, v, ("B", "T", "Hk"))
    if T == 0:
        raise ValueError(f"q has T = 0 tokens (shape {_shape(q)}); need T >= 1")
    forms = _gate_forms(g, beta, (B, T, H), K, V, ("B", "T", "H"))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    check_scale(scale)

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
        check_cu_values(cu_seqlens, T)

    if initial_state is not None:
        if not hasattr(initial_state, "dtype"):
            raise TypeError(f"initial_state must be an array, got {type(initial_state).__name__}")
        if not jnp.issubdtype(initial_state.dtype, jnp.floating):
            raise TypeError(f"initial_state must have a floating dtype, got {initial_state.dtype}")
        want = (n_states, H, K, V)
        if tuple(initial_state.shape) != want:
            what = "[N, H, K, V] (N = len(cu_seqlens) - 1)" if cu_seqlens is not None else "[B, H, K, V]"
            raise ValueError(f"initial_state must have shape {what} = {want}, got shape {_shape(initial_state)}")
    check_log_decay_values(g)
    return forms


def acc_dtype(*xs):
    """float64 if any input is float64 (x64 on), else float32."""
    for x in xs:
        if x is not None and x.dtype == jnp.float64:
            return jnp.float64
    return jnp.float32


def l2norm(x, eps: float = L2NORM_EPS):
    """x / sqrt(sum(x**2, -1) + eps), computed in x's dtype (call on upcast values).

    Where the sum of squares overflows (|x| beyond ~1.8e19 in float32) but x is finite, x is first
    divided by its largest magnitude (eps is negligible there): the unit vector, not the zeros that
    x * rsqrt(inf) would give. Elsewhere the formula is the one above, FLA's and transformers'."""
    ss = jnp.sum(x * x, axis=-1, keepdims=True)
    m = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    big = ~jnp.isfinite(ss) & jnp.isfinite(m) & (m > 0)
    out = x * jax.lax.rsqrt(jnp.where(big, 1.0, ss) + eps)
    # |y| <= 1 with an entry of 1 where big; the other rows see a 1 under the rsqrt, so that neither branch
    # gives autodiff an inf or a NaN to multiply by the zero cotangent of the branch not taken
    y = x / jnp.where(big, m, 1.0)
    return jnp.where(big, y * jax.lax.rsqrt(jnp.where(big, jnp.sum(y * y, axis=-1, keepdims=True), 1.0)), out)


def prepare(q, k, v, g, beta, scale, use_qk_l2norm, dtype, *, qkv_dtype=None, fold_scale=True):
    """The op's input transform, shared by every backend and the step: g and beta (None allowed)
    to ``dtype``; q and k L2-normalised in ``dtype`` if ``use_qk_l2norm``; the scale (None: K^-1/2)
    folded into q in ``dtype`` if ``fold_scale`` (the Pallas kernels apply a static scale
    in-kernel); q, k, v returned in ``qkv_dtype`` (default ``dtype``)."""
    qkv_dtype = dtype if qkv_dtype is None else qkv_dtype
    g = g.astype(dtype)
    beta = None if beta is None else beta.astype(dtype)
    if use_qk_l2norm:
        q = l2norm(q.astype(dtype))
        k = l2norm(k.astype(dtype))
    if fold_scale:
        q = q.astype(dtype) * jnp.asarray(q.shape[-1] ** -0.5 if scale is None else scale, dtype)
    q, k, v = (x.astype(qkv_dtype) for x in (q, k, v))
    return q, k, v, g, beta


def poison_if_invalid(x, valid):
    """Multiply ``x`` by NaN when a traced ``cu_seqlens`` turned out malformed (never a silent
    answer): the values AND the gradients flowing through them become NaN."""
    return x * jnp.where(valid, 1.0, jnp.nan).astype(x.dtype)


@jax.custom_vjp
def _poison(x, p):
    """``where(p, nan, x)`` whose gradient is NaN everywhere when a loss reads a poisoned entry
    (a nonzero cotangent where ``p``): a loss that touched a NaN output gets NaN gradients, not
    silently finite ones; entries not poisoned pass their cotangent through unchanged."""
    return jnp.where(p, jnp.asarray(jnp.nan, x.dtype), x)


def _poison_fwd(x, p):
    return _poison(x, p), p


def _poison_bwd(p, ct):
    touched = jnp.any(p & (ct != 0))
    dx = jnp.where(p, jnp.zeros((), ct.dtype), ct) + jnp.where(touched, jnp.nan, 0.0).astype(ct.dtype)
    return dx, None


_poison.defvjp(_poison_fwd, _poison_bwd)


def nonfinite_guard(q, k, v, g, beta, cu_seqlens, *, g_pc: bool, b_pc: bool):
    """Make a non-finite input poison only its own token and the future, never the past.

    The chunked backends mix the tokens of a chunk through matmuls, where a zero weight times a
    NaN is still NaN, so one NaN at position t would reach every output and gradient of its chunk
    and, through the backward state pass, every earlier chunk (and, in ``gated_linear_attention``'s
    parallel state pass of at most 16 chunks, the forward outputs of every chunk after the first:
    its chunk-by-chunk decay matrix multiplies later chunks by exact zeros). Contract (all backends, per batch
    element, head and packed sequence): a token whose k, v, g or beta holds a NaN or +inf (g = -inf
    is a valid full reset) poisons the outputs at and after it and the final state; a NaN/inf in
    q_t poisons o_t only (q never enters the state). Outputs before the token, and the gradients of
    a loss that reads only those outputs, are those of the sequence without it. A loss that reads a
    poisoned output gets NaN gradients.

    Args: as ``gated_delta_rule`` (validated; ``beta`` may be None for the no-delta op).
    Returns: ``((q, k, v, g, beta), finish)`` with the offending tokens zeroed (g = 0, beta = 0
      leave the state unchanged) and ``finish(o, final_state)`` writing the NaNs.
    """
    B, T, H = q.shape[:3]
    nonfin = lambda x, pc: ~jnp.all(jnp.isfinite(x), axis=-1) if pc else ~jnp.isfinite(x)
    bad_q = nonfin(q, True)  # [B,T,H]
    bad_w = nonfin(k, True) | nonfin(v, True)
    bad_w = bad_w | (jnp.any(jnp.isnan(g) | (g == jnp.inf), axis=-1) if g_pc else (jnp.isnan(g) | (g == jnp.inf)))
    if beta is not None:
        bad_w = bad_w | nonfin(beta, b_pc)
    zero = lambda x, bad: jnp.where(bad.reshape(bad.shape + (1,) * (x.ndim - 3)), jnp.zeros((), x.dtype), x)
    q = zero(q, bad_q)
    k, v, g = (zero(x, bad_w) for x in (k, v, g))
    beta = None if beta is None else zero(beta, bad_w)

    t = jnp.arange(T, dtype=jnp.int32)
    at = jnp.where(bad_w, t[None, :, None], T)  # position of each bad write, T elsewhere
    if cu_seqlens is None:
        first_bad = jnp.min(at, axis=1)  # [B, H]: the first bad write of each sequence
        poisoned = bad_q | (t[None, :, None] >= first_bad[:, None, :])
    else:
        seq_id = seq_info(cu_seqlens, T)[0]
        N = cu_seqlens.shape[0] - 1
        first_bad = jnp.minimum(jax.ops.segment_min(at[0], seq_id, num_segments=N), T)  # [N, H]
        poisoned = bad_q | (t[None, :, None] >= first_bad[seq_id][None])
    seq_bad = first_bad < T

    def finish(o, fin):
        return _poison(o, poisoned[..., None]), _poison(fin, seq_bad[..., None, None])

    return (q, k, v, g, beta), finish


# Floor of the per-token log decay applied by the chunked backends (not by the scan, which never
# differences cumulative decays). Below the floor exp(g) underflows the accumulation dtype's normal
# range anyway (float32: exp(-87) ~ 1.6e-38, the smallest normal is 1.2e-38; float64: exp(-1000) = 0),
# so the state is zeroed to working precision either way, while in-chunk cumulative decays stay
# bounded (|gamma| <= 87 C: float32 differences of them keep ~7e-4 absolute accuracy at C = 128) and
# g = -inf gives no inf - inf. Gradients with respect to g below the floor are 0: the true values
# are below exp(floor) times O(1) and underflow the dtype's normal range.
G_MIN_F32 = -87.0
G_MIN_F64 = -1000.0


def log_decay_floor(acc_dtype) -> float:
    """The floor of :func:`clamp_log_decay` for an accumulation dtype."""
    return G_MIN_F64 if jnp.dtype(acc_dtype) == jnp.float64 else G_MIN_F32


def clamp_log_decay(g, acc_dtype):
    """``max(g, floor)`` with floor -87 for float32 accumulation and -1000 for float64; NaN stays NaN."""
    return jnp.maximum(g, jnp.asarray(log_decay_floor(acc_dtype), g.dtype))
