"""The device's measured copy bandwidth, the bandwidth of the benchmarks' HBM floors
(``bench_decode.py``, ``bench_hopper_stages.py``). No side effects at import (no JAX flags set)."""
from __future__ import annotations

import time


def measure_copy_bandwidth(nbytes: int, reps: int = 10):
    """The device's copy bandwidth (bytes/s): a jitted ``x + 1`` over a float32 array of ``nbytes``
    (donated: read once, written once in place, 2 x nbytes moved), synchronised and timed ``reps``
    times after a warm-up. Returns dict(bandwidth = 2 nbytes / median time, best = 2 nbytes / min
    time, times_s, nbytes). Shared by bench_decode.py (its floor) and bench_hopper_stages.py (its
    kernels' HBM floors)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    n = nbytes // 4
    f = jax.jit(lambda x: x + jnp.float32(1), donate_argnums=0)
    x = jax.block_until_ready(f(jnp.zeros((n,), jnp.float32)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x = jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t0)
    x.delete()
    t = np.asarray(times)
    return dict(bandwidth=float(2 * 4 * n / np.median(t)), best=float(2 * 4 * n / t.min()), times_s=t.tolist(),
                nbytes=4 * n)
