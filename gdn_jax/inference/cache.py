"""Decode caches: small pytrees (NamedTuples of arrays) carried between decode steps.

Each is defined beside the layer that owns it and re-exported here:

* :class:`~gdn_jax.layers.GDNCache` (``gdn_jax/layers/recurrent.py``) — a recurrent layer
  (GatedDeltaNet, GatedLinearAttention): the state ``[B, H, K, V]`` (the layer's ``state_dtype``,
  float32 by default; bfloat16 possible for the delta-rule layers) and the short-conv
  states, the last ``conv_size - 1`` inputs of the q, k and v convolutions (``[B, W-1, H*K]`` /
  ``[B, W-1, H*V]`` in the layer's compute dtype; ``None`` without short conv).
* :class:`~gdn_jax.layers.KVCache` (``gdn_jax/layers/attention.py``) — an attention layer: keys and
  values ``[B, max_len, N_kv, D]`` (compute dtype; N_kv the key/value heads under grouped-query attention) of a static maximum length, and ``pos`` (int32
  scalar), the number of positions written so far (positions ``>= pos`` are masked out).

A model's cache is a tuple with one entry per layer.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..layers.attention import KVCache
from ..layers.recurrent import GDNCache

__all__ = ["GDNCache", "KVCache", "cache_nbytes"]


def cache_nbytes(cache) -> int:
    """Total bytes of every array in a cache pytree (exact, from shapes and dtypes)."""
    return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(cache)))
