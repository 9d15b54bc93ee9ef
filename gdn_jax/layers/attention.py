"""Causal softmax attention mixer with RoPE (optionally Qwen3-Next's gated variant) and its KV cache."""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..ops._common import poison_if_invalid
from ..ops.context_parallel import axis_size
from ..ops.packing import seq_info
from . import _checks
from .norm import NORM_STYLES, rms_norm


def _sdpa(q, k, v, **kw):
    """``jax.nn.dot_product_attention``; float16 on CPU runs in float32 and returns float16 (XLA:CPU
    has no float16 dot with float32 accumulation under ``jit``: "The precision 'F16_F16_F32' is not
    supported by dot_general on CPU", JAX 0.10.2)."""
    if q.dtype == jnp.float16 and jax.default_backend() == "cpu":
        f32 = lambda x: x.astype(jnp.float32)
        return jax.nn.dot_product_attention(f32(q), f32(k), f32(v), **kw).astype(jnp.float16)
    return jax.nn.dot_product_attention(q, k, v, **kw)


class KVCache(NamedTuple):
    """Attention layer cache of static maximum length ``max_len``: keys and values
    ``[B, max_len, N_kv, D]`` (compute dtype; N_kv = ``num_kv_heads``) and ``pos`` (int32 scalar), the number of positions
    written so far (slots ``>= pos`` are masked out)."""

    k: jax.Array  # [B, max_len, N_kv, D]
    v: jax.Array  # [B, max_len, N_kv, D]
    pos: jax.Array  # int32 scalar: tokens written so far

    @property
    def max_len(self) -> int:
        return self.k.shape[1]

    def write(self, k, v) -> "KVCache":
        """Keys and values ``[B, T, N, D]`` written at slots ``pos .. pos + T - 1``; ``pos`` advances by T."""
        put = lambda buf, new: jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), self.pos, axis=1)
        return KVCache(put(self.k, k), put(self.v, v), self.pos + k.shape[1])


def rope(x, positions, *, rot_dim: int, theta: float = 10000.0):
    """Rotary position embedding (rotate-half form) on the first ``rot_dim`` channels.

    x ``[B, T, N, D]``, positions ``[B, T]`` or ``[T]`` (integer) -> x's shape and dtype. Su et al.
    2021 (RoFormer), with the two halves of the rotated channels paired (GPT-NeoX / Qwen).

    Raises:
      ValueError: ``rot_dim`` not an even integer in ``[0, D]``, or ``theta`` not a positive finite number
        (TypeError if it is not a number).
    """
    D = x.shape[-1]
    if isinstance(rot_dim, bool) or not isinstance(rot_dim, (int, np.integer)) or not 0 <= rot_dim <= D or rot_dim % 2:
        raise ValueError(f"rope: rot_dim must be an even integer in [0, D={D}], got {rot_dim!r}")
    _checks.positive_float("theta", theta)
    if rot_dim == 0:
        return x
    half = rot_dim // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    ang = jnp.asarray(positions, jnp.float32)[..., None] * freq  # [.., T, half]
    if ang.ndim == 2:
        ang = ang[None]
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    xr, xp = x[..., :rot_dim].astype(jnp.float32), x[..., rot_dim:]
    x1, x2 = xr[..., :half], xr[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return jnp.concatenate([out, xp], axis=-1)


class Attention(nnx.Module):
    """Causal multi-head softmax attention through ``jax.nn.dot_product_attention``, with RoPE.

    ``x [B, T, hidden_size] -> [B, T, hidden_size]``. With ``qk_norm`` (per-head RMSNorm on q and
    k), ``output_gate`` (``o * sigmoid(W_g x)``) and ``rope_fraction`` < 1 (partial RoPE) it is the
    gated attention of Qwen3-Next's hybrid layers.

    Args:
      hidden_size, num_heads, head_dim (default ``hidden_size // num_heads``; may differ from it,
        as in Qwen3.5's attention layers).
      num_kv_heads: key/value heads (grouped-query attention: query head n reads key/value head
        ``n // (num_heads // num_kv_heads)``, HF's ``repeat_kv`` order); default ``num_heads``.
      rope_theta: RoPE base. rope_fraction: share of each head's channels that are rotated, as a
        count rounded down to an even number: ``int(head_dim * rope_fraction) // 2 * 2`` (``rot_dim``).
      qk_norm, output_gate: Qwen3-Next's gated-attention options (off by default).
      norm_eps: epsilon of the q/k RMSNorm.
      norm_style: ``"standard"`` (``x/rms * w``) or ``"zero_centered"`` (Qwen's ``x/rms * (1 + w)``)
        for the q/k RMSNorm.
      bias: the projections that get a bias (zero-initialised), a string of letters from ``"qkvo"``
        (default ``""``: none). ``"qkvo"`` is Zoology's MHA (Arora et al. 2023, paper-era code:
        fused Wqkv with bias, out_proj with bias); ``"k"`` alone is the key bias of
        ``experiments/attention_fillers.py`` (added before RoPE).
      dtype, param_dtype, rngs: as usual in NNX.

    ``cu_seqlens`` (B = 1): packed sequences; attention is masked to each sequence and RoPE
    positions restart at each boundary. Decoding (``init_cache`` / ``prefill`` / ``decode``) keeps
    a :class:`KVCache` of static length; the three paths share :meth:`qkv` and :meth:`output`.
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: Optional[int] = None, *,
                 num_kv_heads: Optional[int] = None, rope_theta: float = 10000.0, rope_fraction: float = 1.0,
                 qk_norm: bool = False, output_gate: bool = False, norm_eps: float = 1e-6,
                 norm_style: str = "standard", bias: str = "", dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        _checks.rngs(rngs)
        _checks.positive_int("hidden_size", hidden_size)
        for name, value in (("qk_norm", qk_norm), ("output_gate", output_gate)):
            _checks.flag(name, value)
        if not isinstance(bias, str) or set(bias) - set("qkvo") or len(set(bias)) != len(bias):
            raise ValueError(f"bias must be a string of distinct letters from 'qkvo' (the projections with a bias), "
                             f"got {bias!r}")
        self.bias = "".join(c for c in "qkvo" if c in bias)
        _checks.positive_int("num_heads", num_heads)
        _checks.positive_float("norm_eps", norm_eps)
        _checks.positive_float("rope_theta", rope_theta)
        _checks.one_of("norm_style", norm_style, NORM_STYLES)
        if num_kv_heads is None:
            num_kv_heads = num_heads
        _checks.positive_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        dtype = _checks.float_dtype("dtype", dtype)
        param_dtype = _checks.float_dtype("param_dtype", param_dtype)
        if not (isinstance(rope_fraction, (int, float)) and 0.0 <= rope_fraction <= 1.0):
            raise ValueError(f"rope_fraction must be a number in [0, 1], got {rope_fraction!r}")
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}; pass head_dim")
            head_dim = hidden_size // num_heads
        _checks.positive_int("head_dim", head_dim)
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.num_kv_heads = num_kv_heads
        self.rot_dim = int(head_dim * rope_fraction) // 2 * 2
        self.rope_theta, self.dtype = rope_theta, dtype
        lin = lambda i, o, b=False: nnx.Linear(i, o, use_bias=b, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = lin(hidden_size, num_heads * head_dim, "q" in bias)
        self.k_proj = lin(hidden_size, num_kv_heads * head_dim, "k" in bias)
        self.v_proj = lin(hidden_size, num_kv_heads * head_dim, "v" in bias)
        self.o_proj = lin(num_heads * head_dim, hidden_size, "o" in bias)
        self.qk_norm, self.output_gate = qk_norm, output_gate
        if qk_norm:
            norm = lambda: rms_norm(norm_style, head_dim, epsilon=norm_eps, dtype=dtype, param_dtype=param_dtype,
                                    rngs=rngs)
            self.q_norm, self.k_norm = norm(), norm()
        if output_gate:
            self.g_proj = lin(hidden_size, num_heads * head_dim)

    def qkv(self, x, positions):
        """q ``[B, T, N, D]``, k, v ``[B, T, N_kv, D]`` of x: projections, the optional q/k RMSNorm, and RoPE at
        ``positions`` (``[T]``, or ``[B, T]``) on q and k."""
        B, T, _ = x.shape
        N, D, Nkv = self.num_heads, self.head_dim, self.num_kv_heads
        q = self.q_proj(x).reshape(B, T, N, D)
        k = self.k_proj(x).reshape(B, T, Nkv, D)
        v = self.v_proj(x).reshape(B, T, Nkv, D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rope(q, positions, rot_dim=self.rot_dim, theta=self.rope_theta)
        k = rope(k, positions, rot_dim=self.rot_dim, theta=self.rope_theta)
        return q, k, v

    def output(self, o, x):
        """Attention output ``o [B, T, N, D]`` -> ``W_o (o * sigmoid(W_g x))`` (gate with ``output_gate``)."""
        B, T = x.shape[:2]
        o = o.reshape(B, T, -1)
        if self.output_gate:
            o = o * jax.nn.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def _sequence(self, x, *, cu_seqlens=None):
        """Causal attention over the whole of x: ``(y, k, v)`` (k, v after RoPE, for a cache).
        ``cu_seqlens`` masks attention to each packed sequence and restarts the RoPE positions."""
        T = x.shape[1]
        mask = None
        positions = jnp.arange(T)
        valid = None
        if cu_seqlens is not None:
            seq_id, _, _, valid = seq_info(cu_seqlens, T)
            positions = positions - jnp.asarray(cu_seqlens).astype(jnp.int32)[seq_id]
            mask = (seq_id[:, None] == seq_id[None, :])[None, None]
        q, k, v = self.qkv(x, positions)
        o = _sdpa(q, k, v, mask=mask, is_causal=True)
        y = self.output(o, x)
        if valid is not None:  # a malformed traced cu_seqlens: NaN, never a silent answer
            y = poison_if_invalid(y, valid)
        return y, k, v

    def __call__(self, x, *, cu_seqlens=None, context_axis=None):
        """``x [B, T, hidden_size]`` -> ``[B, T, hidden_size]``; ``cu_seqlens`` (B = 1): packed
        sequences (attention within each, RoPE positions restart).

        ``context_axis``: inside ``jax.shard_map`` with T split over that mesh axis, x is this
        shard's ``[B, T_s, hidden_size]`` and ``cu_seqlens`` the global boundaries: the keys and
        values are all-gathered over the axis (each device then holds all T of them; exact, the
        plain version of ring attention: docs/context_parallel.md) and the causal mask and RoPE
        use global positions."""
        if context_axis is not None:
            _checks.mixer_input(x, self.hidden_size)
            return self._sharded_sequence(x, cu_seqlens, context_axis)
        _checks.mixer_input(x, self.hidden_size, cu_seqlens)
        return self._sequence(x, cu_seqlens=cu_seqlens)[0]

    def _sharded_sequence(self, x, cu_seqlens, axis):
        """This shard's causal attention over the keys / values of every shard (all-gathered)."""
        Ts = x.shape[1]
        n_dev = axis_size(axis, "context_axis")
        T = n_dev * Ts
        t = jax.lax.axis_index(axis) * Ts + jnp.arange(Ts)  # global positions of this shard's queries
        s = jnp.arange(T)
        mask = s[None, :] <= t[:, None]
        positions, valid = t, None
        if cu_seqlens is not None:
            seq_id, _, _, valid = seq_info(cu_seqlens, T)
            positions = t - jnp.asarray(cu_seqlens).astype(jnp.int32)[seq_id[t]]
            mask = mask & (seq_id[t][:, None] == seq_id[None, :])
        q, k, v = self.qkv(x, positions)
        k_all, v_all = (jax.lax.all_gather(a, axis, axis=1, tiled=True) for a in (k, v))
        y = self.output(_sdpa(q, k_all, v_all, mask=mask[None, None]), x)
        return y if valid is None else poison_if_invalid(y, valid)

    def attention_weights(self, x):
        """The causal softmax weights ``[B, N, T, T]`` (float32; row t: query t over keys <= t) that
        ``self(x)`` applies, for diagnostics (``experiments/attention_fillers.py``)."""
        _checks.mixer_input(x, self.hidden_size)
        T = x.shape[1]
        q, k, _ = self.qkv(x, jnp.arange(T))
        rep = self.num_heads // self.num_kv_heads
        k = jnp.repeat(k, rep, axis=2)
        s = jnp.einsum("btnd,bsnd->bnts", q.astype(jnp.float32), k.astype(jnp.float32)) / jnp.sqrt(
            jnp.float32(self.head_dim))
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
        return jax.nn.softmax(s, axis=-1)

    # ------------------------------------------------------------------ inference (decode) path
    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty KV cache: k, v ``[batch, max_len, N_kv, D]`` in ``self.dtype``, ``pos = 0``."""
        batch, max_len = _checks.positive_int("batch", batch), _checks.positive_int("max_len", max_len)
        shape = (batch, max_len, self.num_kv_heads, self.head_dim)
        return KVCache(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype), jnp.zeros((), jnp.int32))

    def prefill(self, x, *, max_len: int):
        """Attend over the prompt ``x [B, T, hidden_size]`` (causal, as ``self(x)``) and write its
        keys/values into a new cache of static length ``max_len``. Returns ``(y, cache)``.

        Raises ValueError if T > max_len (the prompt does not fit the cache)."""
        _checks.mixer_input(x, self.hidden_size)
        B, T, _ = x.shape
        if max_len is None or T > max_len:
            raise ValueError(f"prompt of {T} tokens does not fit an attention KV cache of max_len = {max_len}")
        y, k, v = self._sequence(x)
        return y, self.init_cache(B, max_len).write(k, v)

    def decode(self, x_t, cache: KVCache):
        """One token ``x_t [B, 1, hidden_size]`` at position ``cache.pos``: write its key/value at
        that slot (``dynamic_update_slice``), attend over slots ``<= pos`` and advance ``pos``.
        Jit-able. A step past ``max_len`` cannot raise under jit: it returns NaN instead."""
        _checks.step_input(x_t, self.hidden_size, cache, KVCache)
        pos = cache.pos
        q, k, v = self.qkv(x_t, pos[None])
        new = cache.write(k, v)
        mask = (jnp.arange(new.max_len) <= pos)[None, None, None, :]
        o = _sdpa(q, new.k, new.v, mask=mask)
        y = self.output(o, x_t)
        return jnp.where(pos < new.max_len, y, jnp.asarray(jnp.nan, y.dtype)), new
