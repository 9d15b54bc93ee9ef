"""Test configuration: a persistent JAX compilation cache (nothing else global;
x64 is NOT enabled globally -- the float64 reference uses jax.enable_x64 locally)."""

import os
import sys

import jax

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # make `gdn_jax` importable however pytest is invoked
    sys.path.insert(0, _REPO)

jax.config.update("jax_compilation_cache_dir", os.path.join(_REPO, ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
