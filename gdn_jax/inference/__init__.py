"""Inference: decode caches (defined beside their layers in :mod:`gdn_jax.layers`, re-exported by
:mod:`.cache`), prefill + decode sampling (:mod:`.generate`: ``from gdn_jax.inference.generate import
generate``) and memory accounting (:mod:`.memory`)."""
from .cache import GDNCache, KVCache, cache_nbytes

__all__ = ["GDNCache", "KVCache", "cache_nbytes"]
