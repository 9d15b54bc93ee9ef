"""Kimi Delta Attention (KDA), the linear-attention layer of Kimi Linear (Moonshot AI, 2025), as a
gdn_jax layer whose output equals transformers' ``KimiLinearDeltaAttention`` given its weights
(``gdn_jax.hf.kda_from_hf``)."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from ..ops import backends
from . import _checks
from .gated_deltanet import GatedDeltaNet, head_dims, mamba2_decay_init, mamba2_log_decay


class KimiDeltaAttention(GatedDeltaNet):
    """Kimi Delta Attention: the gated delta rule with a per-key-channel decay.

    ``x [B, T, hidden_size] -> [B, T, hidden_size]``::

        q, k, v = silu(conv(W_q x)), silu(conv(W_k x)), silu(conv(W_v x))  # depthwise conv, kernel 4
        g       = -exp(A_log[h]) * softplus(W_fb W_fa x + dt_bias)          # [B,T,H,K]: low-rank forget gate
        beta    = sigmoid(W_b x)                                            # [B,T,H]
        o       = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
        y       = W_o (RMSNorm(o) * sigmoid(W_gb W_ga x))                   # low-rank output gate, sigmoid

    Differences from :class:`GatedDeltaNet` with ``decay_per_channel=True``: the forget gate
    (``f_a_proj [d -> r]``, ``f_b_proj [r -> H*K]``) and the output gate (``g_a_proj [d -> r]``,
    ``g_b_proj [r -> H*V]``) are low-rank pairs (Kimi: r = head_dim), the output gate is a sigmoid
    (GDN: SiLU), and ``A_log`` is per head (``[H]``) with ``dt_bias`` per key channel (``[H*K]``).
    The sequence call, ``prefill`` and ``decode`` are GatedDeltaNet's (the op runs with per-channel g).

    Args:
      hidden_size, num_heads: d and H.
      head_dim: K = V (default ``hidden_size // num_heads``).
      gate_rank: r of the two low-rank gates (default head_dim, as in Kimi Linear).
      dt_min, dt_max, A_init_range: the decay's init (:func:`~gdn_jax.layers.gated_deltanet.mamba2_decay_init`):
        ``dt = softplus(dt_bias)`` log-uniform in ``[dt_min, dt_max]`` (default 1e-3, 0.1, as in
        GatedDeltaNet) and ``A = exp(A_log) ~ U(A_init_range)``, default ``(1, 16)`` (GatedDeltaNet's:
        ``(0, 16)``).
      use_short_conv, conv_size, backend, chunk_size, kernel_config, norm_eps, dtype, param_dtype,
      decode_backend, state_dtype, rngs: as in :class:`GatedDeltaNet`; ``decode_backend="fused_layer"``
      is a ValueError (:meth:`fused_decode_reason`), ``"auto"`` keeps the per-op decode.
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: Optional[int] = None, *,
                 gate_rank: Optional[int] = None, use_short_conv: bool = True, conv_size: int = 4,
                 backend: str = "auto", chunk_size: int = 64, kernel_config=None, norm_eps: float = 1e-6,
                 dt_min: float = 1e-3, dt_max: float = 0.1, A_init_range=(1.0, 16.0),
                 dtype=jnp.float32, param_dtype=jnp.float32, decode_backend: str = "auto",
                 state_dtype=jnp.float32, rngs: nnx.Rngs):
        _checks.rngs(rngs)
        backends.check_name(backend)
        backends.check_kernel_config(kernel_config, backend)
        for name, value in (("chunk_size", chunk_size), ("conv_size", conv_size)):
            _checks.positive_int(name, value)
        _checks.positive_float("norm_eps", norm_eps)
        dtype, param_dtype = (_checks.float_dtype(n, v) for n, v in (("dtype", dtype), ("param_dtype", param_dtype)))
        _checks.flag("use_short_conv", use_short_conv)
        H, K, V = head_dims(hidden_size, num_heads, head_dim, None)
        backends.check_options(backend, chunk_size=chunk_size, K=K, V=V, decay_per_channel=True, beta_per_channel=False,
                               dtype=dtype, owner="KimiDeltaAttention: ")
        self.state_dtype = _checks.decode_options(decode_backend, state_dtype, K=K, V=V, dtype=dtype,
                                                  owner="KimiDeltaAttention: ")
        self.decode_backend = decode_backend
        r = K if gate_rank is None else _checks.positive_int("gate_rank", gate_rank)
        self.hidden_size, self.num_heads, self.head_dim, self.value_head_dim = hidden_size, H, K, V
        self.num_v_heads = H
        self.gate_rank = r
        self.decay, self.decay_per_channel = "mamba2", True
        self.beta_per_channel, self.allow_neg_eigval = False, False
        self.use_short_conv, self.backend, self.chunk_size = use_short_conv, backend, chunk_size
        self.kernel_config, self.conv_size, self.dtype = kernel_config, conv_size, dtype

        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = lin(hidden_size, H * K)
        self.k_proj = lin(hidden_size, H * K)
        self.v_proj = lin(hidden_size, H * V)
        self.f_a_proj, self.f_b_proj = lin(hidden_size, r), lin(r, H * K)
        self.b_proj = lin(hidden_size, H)
        self.g_a_proj, self.g_b_proj = lin(hidden_size, r), lin(r, H * V)
        self.o_proj = lin(H * V, hidden_size)
        if use_short_conv:
            self._short_convs(param_dtype, rngs)
        self.A_log, self.dt_bias = mamba2_decay_init(rngs, H, H * K, dt_min=dt_min, dt_max=dt_max,
                                                     A_init_range=A_init_range, param_dtype=param_dtype)
        self.o_norm = nnx.RMSNorm(V, epsilon=norm_eps, dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs)
        self._check_fused_decode()

    def fused_decode_reason(self):
        """Always a reason: the fused decode layer kernel declines Kimi Delta Attention (its low-rank
        forget and output gates need a second matmul between the input projection and the kernel, and
        its output gate is a sigmoid); ``decode_backend="auto"`` keeps the per-op decode."""
        return ("Kimi Delta Attention (its low-rank forget and output gates need a second matmul between the "
                "projection and the kernel)")

    def gates(self, x):
        """Per-key-channel log decay g ``[B,T,H,K]`` and beta ``[B,T,H]``, float32."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        f = self.f_b_proj(self.f_a_proj(x)).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        g = mamba2_log_decay(self.A_log[...][:, None], f.reshape(B, T, H, K))
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
        return g, beta

    def _output(self, o, x):
        """``W_o (RMSNorm(o) * sigmoid(W_gb W_ga x))`` in ``self.dtype``."""
        B, T = x.shape[:2]
        gate = self.g_b_proj(self.g_a_proj(x)).reshape(B, T, self.num_heads, self.value_head_dim)
        o = self.o_norm(o.astype(jnp.float32)) * jax.nn.sigmoid(gate.astype(jnp.float32))
        return self.o_proj(o.reshape(B, T, -1).astype(self.dtype))
