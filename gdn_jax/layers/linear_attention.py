"""Baseline token mixers without the delta rule (Flax NNX): linear attention, Mamba2-style
per-head decay and GLA per-key-channel decay, all through :func:`gdn_jax.ops.gated_linear_attention`
(docs/baselines.md)."""
from __future__ import annotations

import functools

import warnings
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from ..ops import gated_linear_attention
from ..ops._warnings import internal_call
from ..ops.context_parallel import context_parallel_linear_attention
from ..ops.linear_attention import LA_BACKENDS
from . import _checks
from .gated_deltanet import check_decay_init, head_dims, mamba2_decay_init, mamba2_log_decay
from .recurrent import GDNCache, RecurrentMixer

LA_DECAY_KINDS = ("mamba2", "gla", "none")


class GatedLinearAttention(RecurrentMixer):
    """Gated linear attention mixer: GatedDeltaNet's projections, short conv, per-head output
    RMSNorm and SiLU output gate, with the state update ``S <- diag(exp(g)) S + k v^T`` (no delta rule).

    ``x [B, T, hidden_size] -> [B, T, hidden_size]``::

        q, k, v = silu(conv(W_q x)), silu(conv(W_k x)), silu(conv(W_v x))
        g = -exp(A_log) * softplus(W_a x + dt_bias)   [B,T,H]    decay="mamba2" (Dao & Gu 2024), q,k L2-normalised
            log sigmoid(W_2 W_1 x + b) / 16           [B,T,H,K]  decay="gla" (Yang et al. 2023; FLA's
                                                                 low-rank gate, rank 16, normaliser 16), no L2 norm
            none                                                 decay="none" (Katharopoulos et al. 2020), q,k
                                                                 L2-normalised for stability
        o = gated_linear_attention(q, k, v, g)        # q scaled by K^-1/2
        y = W_o (RMSNorm(o) * silu(W_g x))

    The mamba2 init (A ~ U(0, 16), dt log-uniform in [1e-3, 0.1]) is GatedDeltaNet's.

    Options for the published forms (defaults keep the layer above):

    * ``use_short_conv=False``: q, k, v straight from their projections (no conv, no SiLU) -- the
      GLA paper's layer (Yang et al. 2023, "Gated Linear Attention Transformers with
      Hardware-Efficient Training", eq. for q/k/v; FLA's ``GatedLinearAttention`` default
      ``use_short_conv=False``). The GLA gate ``log sigmoid(W_2 W_1 x + b) / 16`` with rank 16 is
      already that paper's ``alpha = sigmoid(.)^(1/tau)``, tau = 16; ``gate_low_rank`` and
      ``gate_logit_normalizer`` set rank and tau (decay="gla" only, default 16 and 16; ``dt_min``,
      ``dt_max``, ``A_init_range`` are decay="mamba2"'s, default 1e-3, 0.1, (0, 16): given with
      another decay, any of them is a ValueError).
    * ``use_qk_l2norm`` (the op's name; ``qk_l2norm`` is its deprecated old name): None (default:
      on for mamba2 / none, off for gla), True or False. Mamba2
      (Dao & Gu 2024, SSD: ``y = C h``, ``h <- exp(dt A) h + dt B x^T``) has no L2 norm on C, B (q, k).
    * ``dt_input`` (decay="mamba2" only): scale the input of the state update by the step size,
      ``v_t <- dt_t v_t`` with ``dt_t = softplus(W_a x + dt_bias)`` per head, the discretised
      Mamba2 update ``dt B x^T`` (the same outer product as scaling B); off: ``k v^T`` as in FLA's
      simplified form.

    Decoding
    (``init_cache`` / ``prefill`` / ``decode``) keeps the same fixed-size cache as GatedDeltaNet
    (:class:`gdn_jax.layers.GDNCache`: float32 state ``[B,H,K,V]`` + short-conv states); the three
    paths share the projections, short conv, decay and output, and a decode step is the op's scan
    backend on one token.

    Args:
      hidden_size, num_heads: d and H (one value head per key head).
      head_dim: K (default ``hidden_size // num_heads``). value_head_dim: V (default K).
      decay: ``"gla"`` (default), ``"mamba2"`` or ``"none"`` (the forms above).
      use_short_conv, conv_size: the short causal conv on q, k, v (on, kernel 4).
      backend: the op's, ``"auto"`` / ``"scan"`` / ``"chunk"``
        (:func:`gdn_jax.ops.gated_linear_attention`). chunk_size: the chunked form's chunk (64).
      norm_eps: the output RMSNorm's epsilon.
      gate_low_rank, gate_logit_normalizer, use_qk_l2norm, dt_input, dt_min, dt_max, A_init_range: the
        options above (None: the decay's default; another decay's option is a ValueError).
      dtype, param_dtype: compute and parameter dtypes. rngs: ``nnx.Rngs``.

    Raises:
      ValueError / TypeError: a bad argument, named (sizes, dtypes, an unknown decay or backend,
        a non-bool flag, an option of another decay).
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: Optional[int] = None,
                 value_head_dim: Optional[int] = None, *, decay: str = "gla", use_short_conv: bool = True,
                 conv_size: int = 4, backend: str = "auto", chunk_size: int = 64, norm_eps: float = 1e-6,
                 gate_low_rank: Optional[int] = None, gate_logit_normalizer: Optional[float] = None,
                 use_qk_l2norm: Optional[bool] = None, dt_input: bool = False,
                 dt_min: Optional[float] = None, dt_max: Optional[float] = None, A_init_range=None,
                 dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs, qk_l2norm: Optional[bool] = None):
        _checks.rngs(rngs)
        if qk_l2norm is not None:  # the layer's former name; the op's name is use_qk_l2norm
            if use_qk_l2norm is not None:
                raise ValueError("give use_qk_l2norm or its old name qk_l2norm, not both")
            warnings.warn("GatedLinearAttention(qk_l2norm=...) is renamed use_qk_l2norm (the op's name)",
                          DeprecationWarning, stacklevel=2)
            use_qk_l2norm = qk_l2norm
        _checks.one_of("decay", decay, LA_DECAY_KINDS)
        _checks.flag("use_short_conv", use_short_conv)
        # each decay's own options: given with another decay they are an error, never silently ignored
        for name, value, owner in (("gate_low_rank", gate_low_rank, "gla"),
                                   ("gate_logit_normalizer", gate_logit_normalizer, "gla")):
            if value is not None and decay != owner:
                raise ValueError(f"{name} is an option of decay={owner!r}; decay={decay!r} does not use it")
        gate_low_rank = 16 if gate_low_rank is None else gate_low_rank
        gate_logit_normalizer = 16.0 if gate_logit_normalizer is None else gate_logit_normalizer
        dt_min, dt_max, A_init_range = check_decay_init(dt_min, dt_max, A_init_range, decay=decay)
        _checks.one_of("backend", backend, LA_BACKENDS)
        _checks.positive_int("chunk_size", chunk_size)
        _checks.positive_int("conv_size", conv_size)
        _checks.positive_int("gate_low_rank", gate_low_rank)
        _checks.positive_float("norm_eps", norm_eps)
        _checks.positive_float("gate_logit_normalizer", gate_logit_normalizer)
        dtype = _checks.float_dtype("dtype", dtype)
        param_dtype = _checks.float_dtype("param_dtype", param_dtype)
        H, K, V = head_dims(hidden_size, num_heads, head_dim, value_head_dim)
        self.hidden_size, self.num_heads, self.head_dim, self.value_head_dim = hidden_size, H, K, V
        self.num_v_heads = H
        self.decay, self.use_short_conv, self.backend, self.chunk_size = decay, use_short_conv, backend, chunk_size
        self.conv_size = conv_size
        self.gate_logit_normalizer = gate_logit_normalizer
        if use_qk_l2norm is not None:
            use_qk_l2norm = _checks.flag("use_qk_l2norm", use_qk_l2norm)
        dt_input = _checks.flag("dt_input", dt_input)
        if dt_input and decay != "mamba2":
            raise ValueError(f"dt_input=True (Mamba2's dt-scaled input) needs decay='mamba2', got decay={decay!r}")
        self.use_qk_l2norm = (decay != "gla") if use_qk_l2norm is None else use_qk_l2norm
        self.dt_input = dt_input
        self.dtype = dtype
        lin = lambda i, o, bias=False: nnx.Linear(i, o, use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = lin(hidden_size, H * K)
        self.k_proj = lin(hidden_size, H * K)
        self.v_proj = lin(hidden_size, H * V)
        self.g_proj = lin(hidden_size, H * V)
        self.o_proj = lin(H * V, hidden_size)
        if use_short_conv:
            self._short_convs(param_dtype, rngs)
        if decay == "mamba2":
            self.a_proj = lin(hidden_size, H)
            self.A_log, self.dt_bias = mamba2_decay_init(rngs, H, H, dt_min=dt_min, dt_max=dt_max,
                                                         A_init_range=A_init_range, param_dtype=param_dtype)
        elif decay == "gla":
            self.gk_proj1 = lin(hidden_size, gate_low_rank)
            self.gk_proj2 = lin(gate_low_rank, H * K, bias=True)
        self.o_norm = nnx.RMSNorm(V, epsilon=norm_eps, dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs)

    def log_decay(self, x):
        """g ``[B,T,H]`` (mamba2), ``[B,T,H,K]`` (gla) in float32, or ``None`` (none)."""
        B, T, _ = x.shape
        if self.decay == "none":
            return None
        if self.decay == "mamba2":
            a = self.a_proj(x).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
            return mamba2_log_decay(self.A_log[...], a)
        a = self.gk_proj2(self.gk_proj1(x)).astype(jnp.float32)
        return (jax.nn.log_sigmoid(a) / self.gate_logit_normalizer).reshape(B, T, self.num_heads, self.head_dim)

    def _run(self, x, *, cu_seqlens=None, cache: Optional[GDNCache] = None, backend: Optional[str] = None,
             context_axis=None):
        """The op over x: ``y``, or ``(y, cache after x)`` when starting from ``cache``."""
        q, k, v, convs = self._qkv(x, cu_seqlens=cu_seqlens, cache=cache, context_axis=context_axis)
        if self.dt_input:  # Mamba2's discretised input dt_t * x_t (dt per head)
            dt = jax.nn.softplus(self.a_proj(x).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
            v = (v.astype(jnp.float32) * dt[..., None]).astype(v.dtype)
        op = gated_linear_attention if context_axis is None else functools.partial(
            context_parallel_linear_attention, axis_name=context_axis)
        with internal_call():  # [B, T, H, D] by construction: no head-first layout warning (a short prompt)
            o, state = op(
                q, k, v, self.log_decay(x), cu_seqlens=cu_seqlens,
                initial_state=None if cache is None else cache.state, output_final_state=cache is not None,
                use_qk_l2norm=self.use_qk_l2norm, chunk_size=self.chunk_size, backend=backend or self.backend,
            )
        y = self._output(o, x)
        return y if cache is None else (y, GDNCache(state.astype(jnp.float32), *convs))

    def __call__(self, x, *, cu_seqlens=None, context_axis=None):
        """``x [B, T, hidden_size]`` -> ``[B, T, hidden_size]``; ``cu_seqlens`` (B = 1) restarts the
        recurrence and the short conv at every packed-sequence boundary.

        ``context_axis``: inside ``jax.shard_map`` with T split over that mesh axis, x is this
        shard's block and ``cu_seqlens`` the global boundaries (context parallelism, exact:
        :func:`gdn_jax.ops.context_parallel.context_parallel_linear_attention`, a conv halo)."""
        _checks.mixer_input(x, self.hidden_size, None if context_axis is not None else cu_seqlens)
        return self._run(x, cu_seqlens=cu_seqlens, context_axis=context_axis)

    def prefill(self, x, *, max_len=None):
        """Prompt ``x [B, T, hidden_size]`` -> ``(y [B, T, hidden_size], cache)``; ``y == self(x)``
        (``max_len`` ignored: the cache has a fixed size)."""
        _checks.mixer_input(x, self.hidden_size)
        return self._run(x, cache=self.init_cache(x.shape[0]))

    def decode(self, x_t, cache: GDNCache):
        """One token ``x_t [B, 1, hidden_size]`` -> ``(y_t [B, 1, hidden_size], new cache)``. Jit-able."""
        _checks.step_input(x_t, self.hidden_size, cache, GDNCache)
        self._check_cache_state(cache, x_t.shape[0])
        return self._run(x_t, cache=cache, backend="scan")
