"""Short causal depthwise convolution (kernel 4 + SiLU), as in Mamba2, FLA and Qwen3-Next."""
from __future__ import annotations

from typing import Optional

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..ops.context_parallel import axis_size
from ..ops.packing import seq_info
from . import _checks


class ShortConv(nnx.Module):
    """Causal depthwise 1-D convolution over time, followed by SiLU.

    ``y_t = silu(sum_{s=0}^{W-1} w[W-1-s] * x_{t-s})`` per channel, with ``x_{t-s}`` taken as zero
    before the start of the sequence (or of the packed sequence holding t, with ``cu_seqlens``).

    Init: near identity — the last tap (the current token) is 1, the earlier taps N(0, init_std)
    — so that the layer starts close to the plain projections of ``use_short_conv=False``.

    Args:
      channels: number of channels D.
      kernel_size: W (4 by default).
      activation: apply SiLU after the convolution (default True).
      init_std: std of the earlier taps at init (0.2).
      param_dtype: dtype of the weight ``[W, D]``.
      rngs: ``nnx.Rngs``.

    Shapes: ``x [B, T, D]`` -> ``[B, T, D]`` in x's dtype. ``cache``, when given, is the last W-1
    inputs ``[B, W-1, D]`` preceding x (decode); the call then also returns the new cache.

    Raises:
      ValueError / TypeError: ``channels`` or ``kernel_size`` not a positive integer, ``init_std``
        not a finite number >= 0, ``activation`` not a bool, ``rngs`` not an ``nnx.Rngs``.
    """

    def __init__(self, channels: int, kernel_size: int = 4, *, activation: bool = True,
                 init_std: float = 0.2, param_dtype=jnp.float32, rngs: nnx.Rngs):
        _checks.rngs(rngs)
        _checks.positive_int("channels", channels)
        _checks.positive_int("kernel_size", kernel_size)
        _checks.flag("activation", activation)
        if isinstance(init_std, bool) or not isinstance(init_std, (int, float, np.integer, np.floating)) or not (
                math.isfinite(init_std) and init_std >= 0):
            raise ValueError(f"init_std must be a finite number >= 0, got {init_std!r}")
        param_dtype = _checks.float_dtype("param_dtype", param_dtype)
        w = init_std * jax.random.normal(rngs.params(), (kernel_size, channels), param_dtype)
        w = w.at[-1].set(1.0)
        self.weight = nnx.Param(w)  # [W, D]; weight[-1] multiplies the current token
        self.kernel_size = kernel_size
        self.activation = activation

    def __call__(self, x, *, cu_seqlens=None, cache: Optional[jax.Array] = None, context_axis=None):
        """``context_axis`` (inside ``jax.shard_map``, T split over that mesh axis): x is this
        shard's ``[B, T_s, D]``; the last W-1 inputs of the previous shard arrive by ``ppermute``
        (the halo, zeros on the first shard) and ``cu_seqlens`` holds the GLOBAL boundaries."""
        W = self.kernel_size
        B, T, D = x.shape
        w = self.weight[...].astype(x.dtype)
        if context_axis is not None:
            if cache is not None:
                raise ValueError("ShortConv: cache (decode) and context_axis (a sharded sequence) do not go together")
            return self._sharded(x, w, cu_seqlens, context_axis)
        if cache is not None:
            if cache.shape != (B, W - 1, D):
                raise ValueError(f"conv cache must have shape [B, W-1, D] = {(B, W - 1, D)}, got {cache.shape}")
            xx = jnp.concatenate([cache.astype(x.dtype), x], axis=1)
        else:
            xx = jnp.pad(x, ((0, 0), (W - 1, 0), (0, 0)))
        if cu_seqlens is not None:
            seq_id, _, _, _ = seq_info(cu_seqlens, T)
            start = jnp.asarray(cu_seqlens).astype(jnp.int32)[seq_id]
            pos_in_seq = jnp.arange(T) - start  # taps further back than this cross a boundary
        y = jnp.zeros_like(x)
        for s in range(W):  # tap s looks s tokens back
            xs = jax.lax.dynamic_slice_in_dim(xx, W - 1 - s, T, axis=1)
            if cu_seqlens is not None and s > 0:
                xs = jnp.where((pos_in_seq >= s)[None, :, None], xs, 0)
            y = y + xs * w[W - 1 - s]
        if self.activation:
            y = jax.nn.silu(y)
        if cache is not None:
            return y, xx[:, -(W - 1):] if W > 1 else xx[:, :0]
        return y

    def _sharded(self, x, w, cu_seqlens, axis):
        """The convolution of this shard of a sequence split over mesh axis ``axis`` (halo exchange)."""
        W = self.kernel_size
        B, T, D = x.shape
        n_dev = axis_size(axis, "context_axis")
        me = jax.lax.axis_index(axis)
        if W > 1 and W - 1 > T:
            raise ValueError(f"ShortConv: each shard of context_axis={axis!r} needs at least kernel_size - 1 = {W - 1} "
                             f"tokens (the halo of the layer's conv_size = {W}, taken from the previous shard only), "
                             f"got {T}: use fewer devices, longer sequences or use_short_conv=False")
        halo = jax.lax.ppermute(x[:, T - (W - 1):], axis, [(i, i + 1) for i in range(n_dev - 1)]) if W > 1 \
            else x[:, :0]
        xx = jnp.concatenate([halo, x], axis=1)  # the first shard receives zeros: the sequence start
        if cu_seqlens is not None:
            cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
            t = me * T + jnp.arange(T, dtype=jnp.int32)  # global positions
            seq_id = jnp.minimum(jnp.searchsorted(cu[1:], t, side="right"), cu.shape[0] - 2)
            pos_in_seq = t - cu[seq_id]
        y = jnp.zeros_like(x)
        for s in range(W):
            xs = jax.lax.dynamic_slice_in_dim(xx, W - 1 - s, T, axis=1)
            if cu_seqlens is not None and s > 0:
                xs = jnp.where((pos_in_seq >= s)[None, :, None], xs, 0)
            y = y + xs * w[W - 1 - s]
        return jax.nn.silu(y) if self.activation else y
