"""How XLA runs a one-token projection (a vector times a weight matrix) on this device, and how fast.

At batch 1 a decode step multiplies one row ``x [1, d]`` by each weight. XLA's GPU algebraic
simplifier rewrites a dot whose one operand is a vector (after dropping size-1 dimensions) into a
multiply and a reduction when the operands hold fewer than 10^7 elements in all (OpenXLA,
``gpu/transforms/algebraic_simplifier.cc``, ``ShouldStrengthReduceDotToReduce``), so the seed model's
output projection (2048 x 2048) and LM head (2048 x 1024) take that path while its fused input
projection (2048 x 8224) stays a GEMM. On one H100 the decode profile showed 6-7 µs fusions, one
multiply and one reduction per layer, where the byte floor of an 8 MB weight is ~3 µs
(``docs/inference.md``). This script times each way of writing the product, in a jitted loop of
``--steps`` calls, and names the kernels XLA compiled for it (from the optimized HLO):

  vector        ``x [1, d] @ W`` (what the layers write)
  rows3         ``x [1, 1, d] @ W`` as ``nnx.Linear`` applies it
  pad2          two rows, ``concat([x, 0]) @ W``, the first row kept (no vector operand)
  pad2_barrier  the same with the padded rows behind ``lax.optimization_barrier``
  f32_out       ``x @ W`` with ``preferred_element_type=float32``

    python benchmarks/study_gemv.py                      # GPU, ~1 min
    python benchmarks/study_gemv.py --tiny               # CPU smoke test

On one H100 (``results/decode_h100/gemv_3c48042/``) the kernels confirm the rewrite: ``vector``,
``rows3`` and ``f32_out`` of 2048 x 2048 and 2048 x 1024 compile to ``loop_multiply_fusion`` +
``input_reduce_fusion``, both ``pad2`` forms to a ``gemm_fusion_dot``, and 2048 x 8224 is a GEMM in
every form. The times here do not separate them (20-26 µs per call for every form and shape: this
loop's own per-iteration work dominates); inside the decode loop the two-row form took the
output projection from 13 to 5 µs per layer (+1.1 µs for the pad) (``docs/inference.md``), hence
``gdn_jax.layers._rows.apply_rows``.

Prints a table (µs per call, × the weight's byte floor at the copy bandwidth measured in the run,
the compiled kernels) and writes ``<out>/gemv.json`` (a new file; an existing one is an error).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/hbm.py

VARIANTS = ("vector", "rows3", "pad2", "pad2_barrier", "f32_out")


def product(name):
    """The one-token projection written as ``name``: ``f(x [1, d], W [d, n]) -> [1, n]``."""
    import jax
    import jax.numpy as jnp

    if name == "vector":
        return lambda x, w: jnp.dot(x, w)
    if name == "rows3":
        return lambda x, w: jax.lax.dot_general(x[:, None], w, (((2,), (0,)), ((), ())))[:, 0]
    if name == "pad2":
        return lambda x, w: jnp.dot(jnp.concatenate([x, jnp.zeros_like(x)]), w)[:1]
    if name == "pad2_barrier":
        return lambda x, w: jnp.dot(jax.lax.optimization_barrier(jnp.concatenate([x, jnp.zeros_like(x)])), w)[:1]
    if name == "f32_out":
        return lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    raise ValueError(f"unknown variant {name!r}; one of {VARIANTS}")


def kernels_of(text):
    """Counter of what runs as a kernel in an optimized HLO module's entry and loop bodies: fusion
    kinds with their root opcode name (``fusion kLoop``...), custom-call targets, other opcodes."""
    out = Counter()
    for line in text.splitlines():
        line = line.strip()
        if " = " not in line or line.startswith("ROOT tuple") or "parameter(" in line:
            continue
        rhs = line.split(" = ", 1)[1]
        m = re.search(r"\b(fusion|custom-call|copy|reduce|dot|while)\(", rhs)
        if not m:
            continue
        op = m.group(1)
        if op == "fusion":
            kind = re.search(r"kind=(\w+)", rhs)
            name = line.split(" = ", 1)[0].split()[-1].lstrip("%")
            out[f"fusion {kind.group(1) if kind else '?'} ({re.sub(r'[._]?[0-9]+$', '', name)})"] += 1
        elif op == "custom-call":
            tgt = re.search(r'custom_call_target="([^"]+)"', rhs)
            out[f"custom-call {tgt.group(1) if tgt else '?'}"] += 1
        else:
            out[op] += 1
    return out


def time_variant(name, d, n, steps, reps, dtype):
    import jax
    import jax.numpy as jnp
    import numpy as np

    f = product(name)
    w = jax.random.normal(jax.random.key(1), (d, n), dtype) * (d ** -0.5)
    x0 = jax.random.normal(jax.random.key(0), (1, d), dtype)

    def loop(x, w):
        def body(i, acc):  # each call's input depends on the step, so none is hoisted out of the loop
            return acc + f(x + i.astype(dtype), w)[:, :1].astype(jnp.float32)
        return jax.lax.fori_loop(0, steps, body, jnp.zeros((1, 1), jnp.float32))

    run = jax.jit(loop)
    text = run.lower(x0, w).compile().as_text()
    jax.block_until_ready(run(x0, w))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(run(x0, w))
        times.append(time.perf_counter() - t0)
    ref = np.asarray(jnp.dot(x0.astype(jnp.float32), w.astype(jnp.float32)))
    got = np.asarray(f(x0, w).astype(jnp.float32))
    err = float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref ** 2)))
    return float(np.median(times)) / steps, kernels_of(text), err


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="2048x2048,2048x1024,2048x8224",
                    help="comma-separated d x n weights (default: the seed model's o_proj, LM head, fused in-proj)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--copy_bytes", type=int, default=1 << 30)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: one small shape, 2 steps, 1 rep")
    ap.add_argument("--out", default="results/study_gemv")
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        product(v)  # unknown names fail before any work
    try:
        shapes = [tuple(int(p) for p in s.lower().split("x")) for s in args.shapes.split(",") if s]
        assert shapes and all(len(s) == 2 and min(s) > 0 for s in shapes)
    except (ValueError, AssertionError):
        raise SystemExit(f"--shapes: comma-separated d x n pairs expected, got {args.shapes!r}")
    if args.tiny:
        shapes, args.steps, args.reps = [(64, 32)], 2, 1
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gemv.json")
    if os.path.exists(path):
        raise SystemExit(f"{path} exists: pass another --out (a run never writes over another's)")
    dtype = jnp.dtype(args.dtype)
    if args.tiny:
        bw = None
    else:
        from hbm import measure_copy_bandwidth

        bw = measure_copy_bandwidth(args.copy_bytes)["bandwidth"]
    dev = jax.devices()[0]
    print(f"{getattr(dev, 'device_kind', dev.platform)}, jax {jax.__version__}, {dtype.name}; {args.steps} calls per "
          f"loop, median of {args.reps}; copy bandwidth " + (f"{bw / 1e12:.3f} TB/s" if bw else "not measured"))
    print("| d x n | variant | µs per call | x floor | rel. err | kernels (optimized HLO) |\n|---|---|---|---|---|---|")
    rows = []
    for d, n in shapes:
        floor = d * n * dtype.itemsize / bw if bw else None
        for v in variants:
            per, kern, err = time_variant(v, d, n, args.steps, args.reps, dtype)
            rows.append(dict(d=d, n=n, variant=v, us=per * 1e6, floor_us=floor and floor * 1e6,
                             ratio=floor and per / floor, rel_err=err, kernels=dict(kern)))
            ks = ", ".join(f"{k} x{c}" for k, c in sorted(kern.items()))
            print(f"| {d}x{n} | {v} | {per * 1e6:.2f} | {f'{per / floor:.1f}x' if floor else '-'} | {err:.1e} | {ks} |",
                  flush=True)
    with open(path, "x") as fh:
        json.dump(dict(device=str(getattr(dev, "device_kind", dev.platform)), jax=jax.__version__, dtype=dtype.name,
                       bandwidth=bw, steps=args.steps, reps=args.reps, rows=rows), fh, indent=1)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
