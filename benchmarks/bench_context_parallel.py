"""Overhead of the context-parallel path on ONE device: a 1-device mesh with the path forced
(``shard_gated_delta_rule``: the augmented state-map pass of width K + V, the all-gather of a
single map, the float32 composition, then the ordinary pass) against the plain op, at the five
shapes of ``benchmarks/bench_pallas.py``, forward and forward+backward, bf16, the default
backend ("auto": pallas on a GPU). Also times ``state_map`` alone (the extra pass).

Both sides return the final state and the loss of forward+backward reads it (sum(o w) + sum(S w_S)):
on one device the state entering the shard is the given one, so without the final state XLA would
drop the map pass as dead code and the "overhead" would leave out the very pass a shard past the
first pays for. The shard_map runs with ``shard_gated_delta_rule``'s default ``check_vma`` (on
where the kernels compile: a GPU run also checks that the compiled kernels type-check under it);
``max_abs_diff_o`` / ``rel_rms_state`` / ``rel_rms_grads`` compare the context path with the plain op.

Timing: "pipelined" as bench_pallas.py (20 calls back to back, one sync; median of 5 rounds), ms.

Usage:  python benchmarks/bench_context_parallel.py [--shapes 0,2] [--out results/context_parallel_gpu]
        python benchmarks/bench_context_parallel.py --tiny    # CPU smoke test (interpret mode, tiny shapes)
Writes ``<out>/overhead_<device>.json`` and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_pallas import rel_rms, to_np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from gdn_jax.ops import gated_delta_rule  # noqa: E402
from gdn_jax.ops.context_parallel import shard_gated_delta_rule  # noqa: E402
from gdn_jax.ops.state_maps import state_map  # noqa: E402

# the five anchor shapes of benchmarks/bench_pallas.py (B, T, H, D)
SHAPES = [(4, 4096, 16, 128), (8, 2048, 16, 128), (1, 16384, 16, 128), (2, 8192, 16, 64), (2, 8192, 8, 256)]
TINY = [(1, 64, 2, 16), (2, 32, 2, 32)]


def pipelined_ms(fn, args, reps=20, rounds=5):
    jax.block_until_ready(fn(*args))  # compile + warm
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) * 1e3 / reps)
    return statistics.median(ts)


def inputs(B, T, H, D, dtype, seed=0):
    r = np.random.default_rng(seed)
    q, k, v = (r.standard_normal((B, T, H, D)) for _ in range(3))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    g = -r.uniform(0.01, 0.1, (B, T, H))
    beta = r.uniform(0.1, 0.9, (B, T, H))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v)) + tuple(jnp.asarray(x, jnp.float32) for x in (g, beta))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="", help="indices into the five shapes, e.g. 0,2 (default all)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shapes, float32, pallas interpret")
    p.add_argument("--backend", default="auto")
    p.add_argument("--out", default="results/context_parallel_gpu")
    a = p.parse_args(argv)
    shapes = TINY if a.tiny else [SHAPES[int(i)] for i in a.shapes.split(",")] if a.shapes else SHAPES
    dtype = jnp.float32 if a.tiny else jnp.bfloat16
    reps, rounds = (2, 2) if a.tiny else (20, 5)
    dev = jax.devices()[0]
    mesh = Mesh(np.array([dev]), ("seq",))
    kw = dict(backend=a.backend, chunk_size=64 if not a.tiny else 16)
    rows = []
    for B, T, H, D in shapes:
        x = inputs(B, T, H, D, dtype)
        w = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, H, D)), dtype)
        ws = jnp.asarray(np.random.default_rng(2).standard_normal((B, H, D, D)), jnp.float32)
        plain = lambda q, k, v, g, b: gated_delta_rule(q, k, v, g, b, output_final_state=True, **kw)
        cp = lambda q, k, v, g, b: shard_gated_delta_rule(q, k, v, g, b, mesh=mesh, axis="seq",
                                                          output_final_state=True, **kw)
        maps = lambda q, k, v, g, b: state_map(k, v, g, b, **kw)
        loss = lambda o, S: jnp.sum((o * w).astype(jnp.float32)) + jnp.sum(S.astype(jnp.float32) * ws)
        grad = lambda f: jax.jit(jax.value_and_grad(lambda *z: loss(*f(*z)), argnums=(0, 1, 2, 3, 4)))
        row = dict(shape=[B, T, H, D], device=dev.device_kind, dtype=str(jnp.dtype(dtype)), backend=a.backend)
        # one compile per function: the numerics read the outputs of the functions that are timed
        fwd = {name: jax.jit(f) for name, f in (("plain", plain), ("cp", cp), ("state_map", maps))}
        bwd = {name: grad(f) for name, f in (("plain", plain), ("cp", cp))}
        (o0, s0), (o1, s1) = fwd["plain"](*x), fwd["cp"](*x)
        row["max_abs_diff_o"] = float(jnp.max(jnp.abs(o0.astype(jnp.float32) - o1.astype(jnp.float32))))
        row["rel_rms_state"] = rel_rms(to_np(s1), to_np(s0))
        g0, g1 = bwd["plain"](*x)[1], bwd["cp"](*x)[1]
        row["rel_rms_grads"] = max(rel_rms(to_np(b), to_np(a)) for a, b in zip(g0, g1))
        for name in fwd:
            row[name + "_fwd_ms"] = pipelined_ms(fwd[name], x, reps, rounds)
            if name in bwd:
                row[name + "_fwdbwd_ms"] = pipelined_ms(bwd[name], x, reps, rounds)
        row["overhead_fwd"] = row["cp_fwd_ms"] / row["plain_fwd_ms"]
        row["overhead_fwdbwd"] = row["cp_fwdbwd_ms"] / row["plain_fwdbwd_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| B,T,H,D | plain fwd / fwd+bwd ms | context path (1 device) | state_map fwd | overhead fwd / fwd+bwd "
          "| o max diff / S, grads rel. rms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {','.join(map(str, r['shape']))} | {r['plain_fwd_ms']:.3f} / {r['plain_fwdbwd_ms']:.3f} | "
              f"{r['cp_fwd_ms']:.3f} / {r['cp_fwdbwd_ms']:.3f} | {r['state_map_fwd_ms']:.3f} | "
              f"{r['overhead_fwd']:.2f}x / {r['overhead_fwdbwd']:.2f}x | {r['max_abs_diff_o']:.1e} / "
              f"{r['rel_rms_state']:.1e}, {r['rel_rms_grads']:.1e} |")
    os.makedirs(a.out, exist_ok=True)
    name = "overhead_" + ("cpu_tiny" if a.tiny else dev.device_kind.replace(" ", "_")) + ".json"
    with open(os.path.join(a.out, name), "w") as f:
        json.dump(dict(jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
