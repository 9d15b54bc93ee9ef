"""Test configuration: a persistent JAX compilation cache (nothing else global;
x64 is NOT enabled globally -- the float64 reference uses jax.enable_x64 locally)."""

import os
import sys

import jax

_TESTS = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_TESTS)
for _p in (_REPO, _TESTS):  # `gdn_jax`, and the tests' shared `reference` / `conftest` modules
    if _p not in sys.path:
        sys.path.insert(0, _p)

jax.config.update("jax_compilation_cache_dir", os.path.join(_REPO, ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
