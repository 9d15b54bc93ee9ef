"""What the two recurrent mixers share: their decode cache and the q/k/v + output halves of the layer.

:class:`GatedDeltaNet` (delta rule) and :class:`~gdn_jax.layers.linear_attention.GatedLinearAttention`
(no delta rule) wrap the same projections around different state updates (GDN paper, Yang, Kautz &
Hatamizadeh, ICLR 2025; FLA's layers; README "Layer and models", docs/baselines.md)::

    q, k, v = silu(conv(W_q x)), silu(conv(W_k x)), silu(conv(W_v x))   # short conv optional
    o       = <the mixer's recurrence over q, k, v and its gates>        # [B, T, H, V]
    y       = W_o (RMSNorm(o) * silu(W_g x))                             # per-head RMSNorm over V

:class:`RecurrentMixer` writes the first and last lines once (``_qkv``, ``_output``) for the
full-sequence call, prefill and the decode step, and builds the fixed-size :class:`GDNCache`.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from . import _checks
from .conv import ShortConv


class GDNCache(NamedTuple):
    """Decode cache of a recurrent mixer (fixed size, independent of the context length).

    ``state`` is the recurrent state ``[B, H, K, V]`` in the layer's ``state_dtype`` (float32 by
    default; bfloat16 with ``GatedDeltaNet(state_dtype=jnp.bfloat16)``: half the bytes, accumulation
    stays float32); ``conv_q``, ``conv_k``,
    ``conv_v`` are the short-conv states, the last ``conv_size - 1`` inputs of the q, k and v
    convolutions (``[B, W-1, H*K]`` / ``[B, W-1, H*V]`` in the layer's compute dtype; ``None``
    without short conv)."""

    state: jax.Array  # [B, H, K, V] float32 (or the layer's state_dtype)
    conv_q: Optional[jax.Array] = None  # [B, W-1, H*K]
    conv_k: Optional[jax.Array] = None  # [B, W-1, H*K]
    conv_v: Optional[jax.Array] = None  # [B, W-1, H*V]


class RecurrentMixer(nnx.Module):
    """Base of the recurrent mixers (no parameters of its own).

    A subclass builds ``q_proj``, ``k_proj``, ``v_proj``, ``g_proj``, ``o_proj``, ``o_norm`` and,
    with ``use_short_conv``, ``q_conv``, ``k_conv``, ``v_conv`` (:meth:`_short_convs`), and sets
    ``hidden_size``, ``num_heads`` (query / key heads), ``num_v_heads`` (value heads: the state's
    heads; a multiple of ``num_heads`` with grouped value heads), ``head_dim``, ``value_head_dim``,
    ``use_short_conv``, ``conv_size`` and ``dtype``; a subclass whose decode keeps a state in
    another dtype sets ``state_dtype`` (default float32).
    """

    state_dtype = jnp.dtype(jnp.float32)  # the cache state's dtype (GatedDeltaNet: an option)

    def _check_cache_state(self, cache, batch: int):
        """``cache.state`` must be ``[batch, Hv, K, V]`` in ``self.state_dtype`` (ValueError /
        TypeError naming ``cache.state``: a decode loop carries the cache, so neither may change)."""
        want = (batch, self.num_v_heads, self.head_dim, self.value_head_dim)
        st = cache.state
        if not hasattr(st, "shape") or tuple(st.shape) != want:
            raise ValueError(f"cache.state must have shape [B, Hv, K, V] = {want}, got "
                             f"{tuple(st.shape) if hasattr(st, 'shape') else type(st).__name__}")
        if jnp.dtype(st.dtype) != self.state_dtype:
            raise TypeError(f"cache.state is {jnp.dtype(st.dtype).name} but the layer's state_dtype is "
                            f"{self.state_dtype.name} (build the cache with this layer's init_cache or prefill)")

    def _short_convs(self, param_dtype, rngs: nnx.Rngs):
        """The causal depthwise convs on q, k and v (kernel ``self.conv_size``, SiLU)."""
        HK, HV = self.num_heads * self.head_dim, self.num_v_heads * self.value_head_dim
        self.q_conv = ShortConv(HK, self.conv_size, param_dtype=param_dtype, rngs=rngs)
        self.k_conv = ShortConv(HK, self.conv_size, param_dtype=param_dtype, rngs=rngs)
        self.v_conv = ShortConv(HV, self.conv_size, param_dtype=param_dtype, rngs=rngs)

    def init_cache(self, batch: int, max_len=None) -> GDNCache:
        """An empty cache (``max_len`` ignored: the size does not depend on the context): zero state
        ``[batch, Hv, K, V]`` in ``self.state_dtype`` (float32 by default; value heads) and zero conv
        states ``[batch, conv_size-1, Hk*K]`` (q, k) / ``[batch, conv_size-1, Hv*V]`` (v) in
        ``self.dtype``."""
        batch = _checks.positive_int("batch", batch)
        Hk, Hv, K, V = self.num_heads, self.num_v_heads, self.head_dim, self.value_head_dim
        state = jnp.zeros((batch, Hv, K, V), self.state_dtype)
        if not self.use_short_conv:
            return GDNCache(state)
        z = lambda d: jnp.zeros((batch, self.conv_size - 1, d), self.dtype)
        return GDNCache(state, z(Hk * K), z(Hk * K), z(Hv * V))

    def _qkv(self, x, *, cu_seqlens=None, cache: Optional[GDNCache] = None, context_axis=None):
        """Projections and short conv: ``(q, k [B,T,Hk,K], v [B,T,Hv,V], convs)``.

        Without ``cache`` the convs see zeros before the start of x (or of each packed sequence,
        ``cu_seqlens``) and ``convs`` is ``()``; with it they continue from its conv states and
        ``convs`` holds the new ones (``self.dtype``; ``()`` without short conv), so that
        ``GDNCache(state, *convs)`` is the next cache."""
        B, T, _ = x.shape
        Hk, Hv, K, V = self.num_heads, self.num_v_heads, self.head_dim, self.value_head_dim
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        convs = ()
        if self.use_short_conv:
            layers = (self.q_conv, self.k_conv, self.v_conv)
            if cache is None:
                q, k, v = (conv(a, cu_seqlens=cu_seqlens, context_axis=context_axis)
                           for conv, a in zip(layers, (q, k, v)))
            else:
                if any(c is None for c in (cache.conv_q, cache.conv_k, cache.conv_v)):
                    raise ValueError("cache has no short-conv states (conv_q / conv_k / conv_v None) but the layer "
                                     "has a short conv: make the cache with this layer's init_cache / prefill")
                (q, cq), (k, ck), (v, cv) = (conv(a, cache=c) for conv, a, c in
                                             zip(layers, (q, k, v), (cache.conv_q, cache.conv_k, cache.conv_v)))
                convs = tuple(c.astype(self.dtype) for c in (cq, ck, cv))
        return q.reshape(B, T, Hk, K), k.reshape(B, T, Hk, K), v.reshape(B, T, Hv, V), convs

    def _output(self, o, x):
        """``o [B, T, Hv, V]`` (the recurrence's output) -> ``W_o (RMSNorm(o) * silu(W_g x))`` in ``self.dtype``."""
        B, T = x.shape[:2]
        gate = self.g_proj(x).reshape(B, T, self.num_v_heads, self.value_head_dim)
        o = self.o_norm(o.astype(jnp.float32)) * jax.nn.silu(gate.astype(jnp.float32))
        return self.o_proj(o.reshape(B, T, -1).astype(self.dtype))

