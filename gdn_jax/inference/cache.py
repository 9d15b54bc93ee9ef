"""Decode caches: small pytrees (NamedTuples of arrays) carried between decode steps.

* :class:`GDNCache` — a Gated DeltaNet layer: the recurrent state ``[B, H, K, V]`` (float32) and the
  short-conv states, the last ``conv_size - 1`` inputs of the q, k and v convolutions
  (``[B, W-1, H*K]`` / ``[B, W-1, H*V]`` in the layer's compute dtype; ``None`` without short conv).
* :class:`KVCache` — an attention layer: keys and values ``[B, max_len, N, D]`` (compute dtype) of a
  static maximum length, and ``pos`` (int32 scalar), the number of positions written so far
  (positions ``>= pos`` are masked out).

A model's cache is a tuple with one entry per layer.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp


class GDNCache(NamedTuple):
    """Gated DeltaNet layer cache (fixed size, independent of the context length)."""

    state: jax.Array  # [B, H, K, V] float32
    conv_q: Optional[jax.Array] = None  # [B, W-1, H*K]
    conv_k: Optional[jax.Array] = None  # [B, W-1, H*K]
    conv_v: Optional[jax.Array] = None  # [B, W-1, H*V]


class KVCache(NamedTuple):
    """Attention layer cache of static maximum length ``max_len``."""

    k: jax.Array  # [B, max_len, N, D]
    v: jax.Array  # [B, max_len, N, D]
    pos: jax.Array  # int32 scalar: tokens written so far

    @property
    def max_len(self) -> int:
        return self.k.shape[1]


def cache_nbytes(cache) -> int:
    """Total bytes of every array in a cache pytree (exact, from shapes and dtypes)."""
    return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(cache)))
