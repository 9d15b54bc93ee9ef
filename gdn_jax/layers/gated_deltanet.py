"""Gated DeltaNet layer (Flax NNX), with the paper's parameterisation, and the Mamba2 decay that
the baseline mixers share (:func:`mamba2_log_decay`, :func:`mamba2_decay_init`, :func:`head_dims`)."""
from __future__ import annotations

import functools
import math
import numbers
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from ..ops import gated_delta_rule, gated_delta_rule_step
from ..ops import backends
from ..ops._warnings import internal_call
from ..ops.context_parallel import context_parallel_gated_delta_rule
from . import _checks
from ._rows import apply_rows
from .recurrent import GDNCache, RecurrentMixer

# Whether decode_backend="auto" takes the fused layer kernel on a one-device GPU process (on since its
# GPU check against the per-op path: results/decode_h100/NOTE.md); False keeps the per-op decode.
AUTO_FUSED_LAYER = True

DECAY_KINDS = ("mamba2", "sigmoid", "none")


def inverse_softplus(x):
    """softplus^-1(x) = x + log(-expm1(-x)), exact for x > 0."""
    return x + jnp.log(-jnp.expm1(-x))


# Cap on the per-token decay rate -g of the mamba2 parameterisation: exp(-1e4) is 0 in every float
# dtype and the ops floor g far above it anyway, while the cap keeps exp(A_log) * softplus(.)
# from overflowing to inf (whose gradient through the floor is 0 * inf = NaN).
MAX_DECAY_RATE = 1e4


def mamba2_log_decay(A_log, z):
    """Log decay ``g = -exp(A_log) * softplus(z)`` (Mamba2 / GDN paper / FLA / Qwen3-Next), float32.

    Computed in log space, ``-g = exp(min(A_log + log softplus(z), log 1e4))`` with
    ``log softplus(z) = z`` for ``z < -20`` (exact to float32 there), so that a huge ``A_log``
    (``exp`` overflows from 89 on) or a very negative ``z`` (softplus underflows to 0, and
    ``inf * 0 = NaN``) give a finite g and finite gradients. ``-g`` is capped at
    :data:`MAX_DECAY_RATE` = 1e4 (a full reset; the gradient through the cap is 0).

    Args:
      A_log: ``[H]`` (per head) or ``[H, 1]`` (broadcast over key channels), any float dtype.
      z: ``W_a x + dt_bias``, ``[..., H]`` or ``[..., H, K]``.
    Returns: g, z's shape, float32, in [-1e4, 0].
    """
    z = jnp.asarray(z, jnp.float32)
    small = z < -20.0
    log_sp = jnp.where(small, z, jnp.log(jax.nn.softplus(jnp.where(small, 0.0, z))))
    return -jnp.exp(jnp.minimum(jnp.asarray(A_log, jnp.float32) + log_sp, math.log(MAX_DECAY_RATE)))


def head_dims(hidden_size: int, num_heads: int, head_dim: Optional[int], value_head_dim: Optional[int]):
    """``(H, K, V)`` of a linear-attention layer: K defaults to ``hidden_size // num_heads`` and V to K.
    ``TypeError`` for non-integer sizes, ``ValueError`` for non-positive sizes or an indivisible
    ``hidden_size`` without ``head_dim``."""
    _checks.positive_int("hidden_size", hidden_size)
    _checks.positive_int("num_heads", num_heads)
    if head_dim is not None:
        _checks.positive_int("head_dim", head_dim)
    if value_head_dim is not None:
        _checks.positive_int("value_head_dim", value_head_dim)
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}; pass head_dim")
        head_dim = hidden_size // num_heads
    return num_heads, head_dim, head_dim if value_head_dim is None else value_head_dim


def check_decay_init(dt_min=None, dt_max=None, A_init_range=None, *, decay: str = "mamba2"):
    """The mamba2 decay's init arguments (:func:`mamba2_decay_init`): ``(dt_min, dt_max, (lo, hi))``
    as floats, None taking the defaults ``1e-3``, ``0.1``, ``(0, 16)``; ValueError / TypeError naming
    the argument if a value is bad, or if any of them is given (not None) while the layer's ``decay``
    is not ``"mamba2"`` (it would be silently ignored)."""
    if decay != "mamba2":
        for name, value in (("dt_min", dt_min), ("dt_max", dt_max), ("A_init_range", A_init_range)):
            if value is not None:
                raise ValueError(f"{name} is an option of decay='mamba2'; decay={decay!r} does not use it")
    dt_min = 1e-3 if dt_min is None else dt_min
    dt_max = 0.1 if dt_max is None else dt_max
    A_init_range = (0.0, 16.0) if A_init_range is None else A_init_range
    dt_min, dt_max = _checks.positive_float("dt_min", dt_min), _checks.positive_float("dt_max", dt_max)
    if dt_min > dt_max:
        raise ValueError(f"dt_min must be <= dt_max, got dt_min={dt_min}, dt_max={dt_max}")
    if not (isinstance(A_init_range, (tuple, list)) and len(A_init_range) == 2):
        raise TypeError(f"A_init_range must be a pair (lo, hi), got {A_init_range!r}")
    lo, hi = A_init_range
    for name, x in (("A_init_range[0]", lo), ("A_init_range[1]", hi)):
        if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x) or x < 0:
            raise ValueError(f"{name} must be a finite number >= 0 (A = exp(A_log) > 0), got {x!r}")
    if lo > hi:
        raise ValueError(f"A_init_range must have lo <= hi, got {tuple(A_init_range)}")
    return dt_min, dt_max, (float(lo), float(hi))


def mamba2_decay_init(rngs: nnx.Rngs, num_heads: int, n_dt: int, *, dt_min: float = 1e-3,
                      dt_max: float = 0.1, A_init_range=(0.0, 16.0), param_dtype=jnp.float32):
    """``(A_log [num_heads], dt_bias [n_dt])`` Params of the decay ``-exp(A_log) softplus(W x + dt_bias)``:
    A ~ U(A_init_range) sampled in float32 and clipped to >= 1e-4; dt log-uniform in
    [dt_min, dt_max] (>= 1e-4) and dt_bias = softplus^-1(dt) (Mamba2 / FLA init).

    Raises ValueError / TypeError unless ``0 < dt_min <= dt_max`` (finite) and ``A_init_range`` is
    a pair ``0 <= lo <= hi`` (finite; A = 0 gives no decay, clipped to 1e-4)."""
    dt_min, dt_max, (lo, hi) = check_decay_init(dt_min, dt_max, A_init_range)
    A = jax.random.uniform(rngs.params(), (num_heads,), jnp.float32, lo, hi)
    A_log = nnx.Param(jnp.log(jnp.maximum(A, 1e-4)).astype(param_dtype))
    u = jax.random.uniform(rngs.params(), (n_dt,), jnp.float32)
    dt = jnp.maximum(jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)), 1e-4)
    return A_log, nnx.Param(inverse_softplus(dt).astype(param_dtype))


class GatedDeltaNet(RecurrentMixer):
    """Gated DeltaNet token mixer (Yang, Kautz & Hatamizadeh, ICLR 2025; FLA layer; Qwen3-Next).

    ``x [B, T, hidden_size] -> [B, T, hidden_size]``::

        q, k, v = silu(conv(W_q x)), silu(conv(W_k x)), silu(conv(W_v x))   # short conv, optional
        g       = -exp(A_log) * softplus(W_a x + dt_bias)    # log decay, per head  (decay="mamba2";
                                                              # Mamba2's; see mamba2_log_decay)
                  log sigmoid(W_a x)                          # sigmoid forget gate  (decay="sigmoid")
                  0                                           # DeltaNet, no decay   (decay="none")
        beta    = sigmoid(W_b x)  (x2 with allow_neg_eigval)  # per head, or per value channel
        o       = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)  # GDN paper eq. 10; q,k
                                                                          # L2-normalised and q
                                                                          # scaled by K^-1/2, once
        y       = W_o (RMSNorm(o) * silu(W_g x))              # per-head RMSNorm over V

    The three paths share the projections, short conv, gates and output (:meth:`_qkv`,
    :meth:`gates`, :meth:`_output`): ``self(x)`` and :meth:`prefill` run the chunked / Pallas /
    scan op over the sequence, :meth:`decode` one token of the recurrence
    (:func:`gdn_jax.ops.gated_delta_rule_step` with ``decode_backend``, e.g. the fused Pallas
    decode kernel) on a :class:`GDNCache` whose state is kept in ``state_dtype``.

    Init (Mamba2, Dao & Gu 2024, as in FLA): ``A ~ U(0, 16)`` sampled in float32 and clipped to
    >= 1e-4 (a bf16 sample can be exactly 0 and give A_log = -inf); ``dt`` log-uniform in
    [1e-3, 0.1] and ``dt_bias = softplus^-1(dt)`` — a constant ``dt_bias = 1`` makes the decay so
    strong, g ~ -1.3*A per token, that the model keeps almost no memory, and ``dt_bias = 0`` was
    measured to leave a tiny MQAR model at chance (README "Layer and models"). The short conv
    starts near identity.

    Args:
      hidden_size: model width d.
      num_heads: query / key heads Hk.
      head_dim: key head dim K (default ``hidden_size // num_heads``).
      num_v_heads: value heads H (default ``num_heads``): a multiple of ``num_heads`` gives grouped
        value heads (Qwen3-Next / Qwen3.5), value head j reading key head ``j // (H // Hk)``; the
        state, decay, beta, output gate and norm are per value head.
      value_head_dim: V (default K).
      decay: ``"mamba2"`` (default), ``"sigmoid"`` or ``"none"`` (g = 0: DeltaNet, Yang et al. 2024;
        no a_proj / A_log / dt_bias parameters).
      decay_per_channel: one decay per key channel (Kimi Delta Attention, g ``[B,T,H,K]``).
      beta_per_channel: one beta per value channel (beta ``[B,T,H,V]``; the scan backend takes it,
        ``backend="auto"`` picks it).
      allow_neg_eigval: beta = 2 sigmoid(.) in (0, 2) (negative eigenvalues; Grazzi et al. 2024).
      use_short_conv, conv_size: the causal depthwise conv on q, k, v (on by default).
      backend, chunk_size: passed to :func:`gdn_jax.ops.gated_delta_rule` (the full-sequence call
        and prefill).
      decode_backend: how :meth:`decode` runs a token: ``"fused_layer"`` (the whole layer between the
        input and output projections in one kernel, :mod:`gdn_jax.ops.pallas.decode_layer`; needs the
        short conv; ValueError naming why where it does not apply), ``"auto"`` (default: the fused
        layer on a one-device GPU process where it applies, else the step op's auto: its fused step
        kernel on a GPU where it applies, the plain XLA step elsewhere), or the single-token step's
        backend passed to :func:`gdn_jax.ops.gated_delta_rule_step` with the other ops around it:
        ``"scan"`` or
        ``"pallas"`` (the fused decode kernel: q/k L2
        norm and scale, decay, delta-rule write and read in one pass over the state; K and V powers
        of two from 16 to 256, checked when the layer is built).
      state_dtype: dtype of the decode cache's recurrent state, float32 (default) or bfloat16
        (half the state bytes read and written per step; the step accumulates in float32 and rounds
        the state once per token). :meth:`init_cache` and :meth:`prefill` build the cache in it.
      kernel_config: a :class:`gdn_jax.ops.KernelConfig` for the Pallas kernels (backend "pallas"
        or "auto"), passed to the op; None: the defaults.
      norm_eps: RMSNorm epsilon.
      dt_min, dt_max, A_init_range: the mamba2 decay's init (see :func:`mamba2_decay_init`; None:
        1e-3, 0.1, (0, 16)); decay="mamba2" only: given with another decay, a ValueError.
      dtype: computation dtype of the projections (the recurrence accumulates in float32).
      param_dtype: parameter dtype.
      rngs: ``nnx.Rngs``.
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: Optional[int] = None,
                 value_head_dim: Optional[int] = None, *, num_v_heads: Optional[int] = None, decay: str = "mamba2",
                 decay_per_channel: bool = False, beta_per_channel: bool = False,
                 allow_neg_eigval: bool = False, use_short_conv: bool = True, conv_size: int = 4,
                 backend: str = "auto", chunk_size: int = 64, kernel_config=None, norm_eps: float = 1e-6,
                 dt_min: Optional[float] = None, dt_max: Optional[float] = None, A_init_range=None,
                 dtype=jnp.float32, param_dtype=jnp.float32, decode_backend: str = "auto",
                 state_dtype=jnp.float32, rngs: nnx.Rngs):
        _checks.rngs(rngs)
        _checks.one_of("decay", decay, DECAY_KINDS)
        for name, value in (("decay_per_channel", decay_per_channel), ("beta_per_channel", beta_per_channel),
                            ("allow_neg_eigval", allow_neg_eigval), ("use_short_conv", use_short_conv)):
            _checks.flag(name, value)
        if decay == "none" and decay_per_channel:
            raise ValueError("decay_per_channel=True needs a decay (decay='mamba2' or 'sigmoid'), got decay='none'")
        # decay="mamba2"'s init (None: its defaults); given with another decay, a ValueError
        dt_min, dt_max, A_init_range = check_decay_init(dt_min, dt_max, A_init_range, decay=decay)
        backends.check_name(backend)
        _checks.positive_int("chunk_size", chunk_size)
        backends.check_kernel_config(kernel_config, backend)
        _checks.positive_int("conv_size", conv_size)
        _checks.positive_float("norm_eps", norm_eps)
        dtype = _checks.float_dtype("dtype", dtype)
        param_dtype = _checks.float_dtype("param_dtype", param_dtype)
        Hk, K, V = head_dims(hidden_size, num_heads, head_dim, value_head_dim)
        if num_v_heads is not None:
            _checks.positive_int("num_v_heads", num_v_heads)
            if num_v_heads % Hk:
                raise ValueError(f"num_v_heads must be a multiple of num_heads (the key heads, {Hk}) for grouped "
                                 f"value heads, got {num_v_heads}")
        H = Hk if num_v_heads is None else num_v_heads
        backends.check_options(backend, chunk_size=chunk_size, K=K, V=V, decay_per_channel=decay_per_channel,
                               beta_per_channel=beta_per_channel, dtype=dtype, owner="GatedDeltaNet: ")
        self.state_dtype = _checks.decode_options(decode_backend, state_dtype, K=K, V=V, dtype=dtype,
                                                  owner="GatedDeltaNet: ")
        self.decode_backend = decode_backend
        self.hidden_size, self.num_heads, self.head_dim, self.value_head_dim = hidden_size, Hk, K, V
        self.num_v_heads = H
        self.decay, self.decay_per_channel = decay, decay_per_channel
        self.beta_per_channel, self.allow_neg_eigval = beta_per_channel, allow_neg_eigval
        self.use_short_conv, self.backend, self.chunk_size = use_short_conv, backend, chunk_size
        self.kernel_config = kernel_config
        self.conv_size = conv_size
        self.dtype = dtype

        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = lin(hidden_size, Hk * K)
        self.k_proj = lin(hidden_size, Hk * K)
        self.v_proj = lin(hidden_size, H * V)
        n_decay = H * K if decay_per_channel else H
        if decay != "none":
            self.a_proj = lin(hidden_size, n_decay)
        self.b_proj = lin(hidden_size, H * V if beta_per_channel else H)
        self.g_proj = lin(hidden_size, H * V)
        self.o_proj = lin(H * V, hidden_size)
        if use_short_conv:
            self._short_convs(param_dtype, rngs)
        if decay == "mamba2":
            self.A_log, self.dt_bias = mamba2_decay_init(rngs, H, n_decay, dt_min=dt_min, dt_max=dt_max,
                                                         A_init_range=A_init_range, param_dtype=param_dtype)
        self.o_norm = nnx.RMSNorm(V, epsilon=norm_eps, dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs)
        self._check_fused_decode()

    def gates(self, x):
        """Log decay g ``[B,T,H]`` / ``[B,T,H,K]`` and beta ``[B,T,H]`` / ``[B,T,H,V]`` in float32
        (H = the value heads)."""
        B, T, _ = x.shape
        H, K, V = self.num_v_heads, self.head_dim, self.value_head_dim
        if self.decay == "none":
            # behind a barrier: a literal zero g lets XLA:GPU constant-fold the op's decay math over the
            # whole batch (compile-time "constant folding" warnings on the H200 for f32[B,H,N,4,16])
            g = jax.lax.optimization_barrier(jnp.zeros((B, T, H), jnp.float32))
        elif self.decay == "mamba2":
            a = self.a_proj(x).astype(jnp.float32)
            a = a + self.dt_bias[...].astype(jnp.float32)
            A_log = self.A_log[...]
            if self.decay_per_channel:
                g = mamba2_log_decay(A_log[:, None], a.reshape(B, T, H, K))
            else:
                g = mamba2_log_decay(A_log, a)
        else:
            g = jax.nn.log_sigmoid(self.a_proj(x).astype(jnp.float32))
            if self.decay_per_channel:
                g = g.reshape(B, T, H, K)
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
        if self.allow_neg_eigval:
            beta = 2.0 * beta
        if self.beta_per_channel:
            beta = beta.reshape(B, T, H, V)
        return g, beta

    def _sequence(self, x, *, cu_seqlens=None, with_cache: bool = False, context_axis=None):
        """The op over the whole of x: ``y``, or ``(y, cache after x)`` with ``with_cache``."""
        cache = self.init_cache(x.shape[0]) if with_cache else None
        q, k, v, convs = self._qkv(x, cu_seqlens=cu_seqlens, cache=cache, context_axis=context_axis)
        g, beta = self.gates(x)
        op = gated_delta_rule if context_axis is None else functools.partial(context_parallel_gated_delta_rule,
                                                                               axis_name=context_axis)
        with internal_call():  # [B, T, H, D] by construction: no head-first layout warning (a short prompt)
            o, state = op(
                q, k, v, g, beta, cu_seqlens=cu_seqlens, output_final_state=with_cache, use_qk_l2norm=True,
                chunk_size=self.chunk_size, backend=self.backend, kernel_config=self.kernel_config,
            )
        y = self._output(o, x)
        return (y, GDNCache(state.astype(self.state_dtype), *convs)) if with_cache else y

    def __call__(self, x, *, cu_seqlens=None, context_axis=None):
        """``x [B, T, hidden_size]`` -> ``[B, T, hidden_size]`` (dtype ``self.dtype``).

        ``cu_seqlens`` (B = 1): packed sequences; the recurrence and the short conv restart at
        every boundary.

        ``context_axis`` (context parallelism, docs/context_parallel.md): called inside
        ``jax.shard_map`` with T split over that mesh axis, x is this shard's ``[B, T_s,
        hidden_size]`` and ``cu_seqlens`` the GLOBAL boundaries; the short conv exchanges a halo of
        ``conv_size - 1`` tokens with the previous shard and the op composes the shards' state
        maps (:func:`gdn_jax.ops.context_parallel.context_parallel_gated_delta_rule`); the result
        equals the unsharded layer's to float32 rounding. Per-value-channel beta is a ValueError.
        """
        _checks.mixer_input(x, self.hidden_size, None if context_axis is not None else cu_seqlens)
        if context_axis is not None and self.beta_per_channel:
            raise ValueError(f"{type(self).__name__}: context_axis does not take beta_per_channel=True (one state "
                             "map per value column)")
        return self._sequence(x, cu_seqlens=cu_seqlens, context_axis=context_axis)

    def prefill(self, x, *, max_len=None):
        """Run the prompt ``x [B, T, hidden_size]`` with the layer's backend (chunk / pallas / scan)
        and return ``(y [B, T, hidden_size], cache)``; ``y`` equals ``self(x)``. ``max_len`` is
        accepted for a uniform mixer interface and ignored (the cache has a fixed size)."""
        _checks.mixer_input(x, self.hidden_size)
        return self._sequence(x, with_cache=True)

    # ------------------------------------------------------------------ decode
    def fused_decode_reason(self) -> Optional[str]:
        """None when the fused decode layer kernel (:mod:`gdn_jax.ops.pallas.decode_layer`) takes this
        layer, else the reason (a phrase): no short conv, head dims or head counts it does not tile,
        unsupported dtypes."""
        from ..ops.pallas import decode_layer as _dl

        if not self.use_short_conv:
            return "a layer without short conv (use_short_conv=False)"
        return _dl.covers(self._decode_spec(), self.dtype, self.state_dtype)

    def _decode_spec(self):
        from ..ops.pallas.decode_layer import LayerSpec

        return LayerSpec(Hk=self.num_heads, H=self.num_v_heads, K=self.head_dim, V=self.value_head_dim,
                         W=self.conv_size, decay=self.decay, g_per_channel=self.decay_per_channel,
                         beta_per_channel=self.beta_per_channel, neg_eigval=self.allow_neg_eigval,
                         scale=float(self.head_dim) ** -0.5, norm_eps=float(self.o_norm.epsilon))

    def _check_fused_decode(self):
        """decode_backend='fused_layer' on a layer the kernel does not take: ValueError naming why."""
        if self.decode_backend == "fused_layer":
            reason = self.fused_decode_reason()
            if reason is not None:
                raise ValueError(f"{type(self).__name__}: decode_backend='fused_layer' does not take {reason}; use "
                                 "decode_backend='auto' (falls back to the per-op decode there) or 'pallas'")

    def uses_fused_decode(self) -> bool:
        """Whether :meth:`decode` runs the fused layer kernel: ``decode_backend="fused_layer"``, or
        ``"auto"`` on a one-device GPU process for a layer the kernel takes (the kernel is not
        partitioned over devices; with several, ``"auto"`` keeps the per-op path whose step kernel is)
        while :data:`AUTO_FUSED_LAYER` is on (docs/inference.md)."""
        if self.decode_backend == "fused_layer":
            return True
        if not AUTO_FUSED_LAYER or self.decode_backend != "auto" or self.fused_decode_reason() is not None:
            return False
        from ..ops.pallas.platform import default_platform

        return default_platform() == "gpu" and jax.device_count() == 1

    def _fused_in_projections(self):
        """The input projections in the fused kernel's column order (q, k, v, z, a, b)."""
        names = ["q_proj", "k_proj", "v_proj", "g_proj"] + (["a_proj"] if self.decay != "none" else []) + ["b_proj"]
        return [getattr(self, n) for n in names]

    def _fused_in_weight(self):
        return jnp.concatenate([p.kernel[...].astype(self.dtype) for p in self._fused_in_projections()], axis=1)

    def decode_view(self):
        """The decode-time weight view of the fused path, or None when :meth:`decode` does not use it.

        ``{"w_in": [hidden_size, N]}``: the q, k, v, output-gate, decay and beta projections' kernels
        side by side (:func:`gdn_jax.ops.pallas.decode_layer.segments`) in the compute dtype, so that
        one matmul projects the token. Built from the parameters (which keep their names, shapes and
        checkpoints); a decode loop builds it once before its first token and passes it to every
        step (``decode(..., view=...)``); it holds a second copy of those kernels meanwhile."""
        return dict(w_in=self._fused_in_weight()) if self.uses_fused_decode() else None

    def _fused_decode(self, x_t, cache: GDNCache, view):
        from ..ops.pallas.decode_layer import decode_layer

        x = x_t[:, 0].astype(self.dtype)
        if view is not None:  # one matmul through the view
            proj = jnp.dot(x, view["w_in"].astype(self.dtype))
        else:  # no view (a lone step): the six projections, their [B, N] outputs side by side (no weight copy)
            proj = jnp.concatenate([p(x) for p in self._fused_in_projections()], axis=-1)
        A_log = self.A_log[...] if self.decay == "mamba2" else None
        dt_bias = self.dt_bias[...] if self.decay == "mamba2" else None
        convs = (cache.conv_q, cache.conv_k, cache.conv_v)
        if any(c is None for c in convs):
            raise ValueError("cache has no short-conv states (conv_q / conv_k / conv_v None) but the layer has a "
                             "short conv: make the cache with this layer's init_cache / prefill")
        y, state, convs = decode_layer(proj, tuple(c.astype(self.dtype) for c in convs),
                                       (self.q_conv.weight[...], self.k_conv.weight[...], self.v_conv.weight[...]),
                                       A_log, dt_bias, self.o_norm.scale[...], cache.state, spec=self._decode_spec(),
                                       state_dtype=self.state_dtype)
        return apply_rows(self.o_proj, y[:, None]), GDNCache(state, *convs)

    def decode(self, x_t, cache: GDNCache, *, view=None):
        """One token: ``x_t [B, 1, hidden_size]`` -> ``(y_t [B, 1, hidden_size], new cache)``. Jit-able.

        Where :meth:`uses_fused_decode` (``decode_backend="fused_layer"``; ``"auto"`` on a GPU): one
        matmul for the six input projections through ``view`` (from :meth:`decode_view`; None: the six
        projections, their outputs side by side), the fused layer kernel (:mod:`gdn_jax.ops.pallas.decode_layer`: conv update, SiLU, q/k
        L2 norms, decay and beta, state update and read, gated RMSNorm), the output projection.

        Otherwise the per-op path: the projections of the one token, the short-conv update (conv
        states shifted by one), the gates, then :func:`gdn_jax.ops.gated_delta_rule_step` with
        ``backend=self.decode_backend`` and ``state_dtype=self.state_dtype`` (``"pallas"``: one fused
        kernel for q/k norm, decay, write and read; the state buffer is updated in place when the
        cache is donated to the enclosing ``jax.jit``), then the gated RMSNorm and the output
        projection.

        ``cache.state`` must be in the layer's ``state_dtype`` (``TypeError`` otherwise: a decode
        loop carries the cache, so its dtype may not change between steps)."""
        _checks.step_input(x_t, self.hidden_size, cache, GDNCache)
        self._check_cache_state(cache, x_t.shape[0])
        if self.uses_fused_decode():
            return self._fused_decode(x_t, cache, view)
        q, k, v, convs = self._qkv(x_t, cache=cache)
        g, beta = self.gates(x_t)
        o, state = gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], cache.state,
                                         use_qk_l2norm=True, backend=self.decode_backend,
                                         state_dtype=self.state_dtype)
        return self._output(o[:, None], x_t), GDNCache(state, *convs)
