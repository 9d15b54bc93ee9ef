"""Inference: decode caches (:mod:`.cache`), prefill + decode sampling (:mod:`.generate`:
``from gdn_jax.inference.generate import generate``) and memory accounting (:mod:`.memory`)."""
from .cache import GDNCache, KVCache, cache_nbytes

__all__ = ["GDNCache", "KVCache", "cache_nbytes"]
