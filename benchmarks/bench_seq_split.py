"""Benchmark of the sequence split (``KernelConfig.seq_split``) of ``backend="pallas"``: the op unsplit
against split into P in {2, 4, 8} pieces and ``"auto"``, forward and forward+backward, with the
numerics of each split against the unsplit op.

Shapes (B, T, H, D; K = V = D, bf16, the inputs of ``benchmarks/bench_pallas.py``: k L2-normalised,
g = logsigmoid(N(0, 1)) / 4, beta = sigmoid(N(0, 1))): the five of bench_pallas.py, then
1x32768x16x128 and 1x16384x8x128 (few heads: where the split should help most); the shapes the
planner splits come first, so that a run cut short by ``--budget`` still has them.

Timing: pipelined (``--reps`` calls back to back, one sync, median of 5 rounds, after warm-up; what
a training step sees), jitted, forward (o) and forward+backward (``jax.value_and_grad`` of
sum(o * do) over q, k, v, g, beta). Numerics: rel. rms of o and of every gradient against the
unsplit op's (from the timed functions' own outputs: no extra compile). "auto" reuses the row of
the piece count it picks. Each shape prints its rows as it finishes; the table is the last output.

Usage (one H100 / H200, JAX 0.11.2; at most ~3.5 minutes: no new shape starts after ``--budget`` s)::

    python benchmarks/bench_seq_split.py [--shapes 1x16384x16x128,...] [--pieces 2,4,8,auto]
        [--reps 20] [--budget 180]

``--interpret --shapes tiny``: a CPU smoke test of the script (interpret mode, chunk 16; its timings
mean nothing).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_pallas import jax_fns, make_inputs, rel_rms, time_fn_pipelined, to_np  # noqa: E402  (also sets the repo path)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from gdn_jax.ops import KernelConfig  # noqa: E402
from gdn_jax.ops.pallas import forward_kernels, split_plan  # noqa: E402
from gdn_jax.ops.pallas.platform import default_platform  # noqa: E402

SHAPES = [(1, 16384, 16, 128), (1, 32768, 16, 128), (1, 16384, 8, 128), (2, 8192, 16, 64),
          (4, 4096, 16, 128), (8, 2048, 16, 128), (2, 8192, 8, 256)]
TINY = [(1, 128, 1, 16)]
GRADS = ("dq", "dk", "dv", "dg", "dbeta")


def log(*a):
    print(*a, flush=True)


def fns(x, chunk, cfg):
    """(fwd, fwd+bwd) closures of the Pallas op with ``cfg``, jitted (bench_pallas' ``jax_fns``)."""
    return jax_fns("pallas", x, chunk, kernel_config=cfg)


def measure(x, chunk, cfg, reps, warmup):
    """ms fwd, ms fwd+bwd, o, grads (float32 numpy)."""
    f, fb = fns(x, chunk, cfg)
    o = to_np(f())
    _, grads = fb()
    grads = [to_np(gr) for gr in grads]
    return time_fn_pipelined(f, reps, warmup), time_fn_pipelined(fb, reps, warmup), o, grads


def maps_paths(x, chunk, platform, pieces):
    """The kernel paths of the split's two calls (traced on shapes): the pieces' call (B P rows of
    T / P tokens) and the maps' call (B (P - 1) rows at value width K + V)."""
    from gdn_jax.ops.pallas import backward_kernels

    B, T, H, D = x["v"].shape
    L = split_plan.piece_length(T, pieces, chunk)
    cfg = KernelConfig(platform=platform)
    out = []
    for name, rows, width in (("pieces", B * pieces, D), ("maps", B * (pieces - 1), 2 * D)):
        sds = lambda *s, dt=x["q"].dtype: jax.ShapeDtypeStruct(s, dt)
        a = (sds(rows, L, H, D), sds(rows, L, H, D), sds(rows, L, H, width), sds(rows, L, H, dt=jnp.float32),
             sds(rows, L, H))
        rep = []
        try:
            jax.eval_shape(lambda *a: rep.extend(f(*a, chunk_size=chunk, kernel_config=cfg)
                                                 for f in (forward_kernels, backward_kernels)) or 0, *a)
            out.append(f"{name} call {rows}x{L}x{H}x{width}: fwd {rep[0].path} bwd {rep[1].path}")
        except Exception as e:  # noqa: BLE001  (a report, not the timing)
            out.append(f"{name} call: no report ({type(e).__name__}: {str(e)[:120]})")
    return "; ".join(out)


def parse_shapes(s):
    if s == "all":
        return SHAPES
    if s == "tiny":
        return TINY
    return [tuple(int(d) for d in part.split("x")) for part in s.split(",")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="all", help="'all', 'tiny' or BxTxHxD,...")
    ap.add_argument("--pieces", default="2,4,8,auto", help="piece counts to time (ints, 'auto')")
    ap.add_argument("--reps", type=int, default=None, help="calls per pipelined round (default 20; interpret 1)")
    ap.add_argument("--chunk", type=int, default=None, help="chunk_size (default 64; interpret 16)")
    ap.add_argument("--budget", type=float, default=180.0, help="seconds: no new shape starts after this")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke test (interpret mode)")
    args = ap.parse_args(argv)
    platform = "interpret" if args.interpret else None
    reps = args.reps or (1 if args.interpret else 20)
    warmup = 1 if args.interpret else 3
    chunk = args.chunk or (16 if args.interpret else 64)
    pieces = [p if p == "auto" else int(p) for p in args.pieces.split(",")]
    plat = platform or default_platform()
    sms = split_plan.sm_count(plat)
    log(f"bench_seq_split: jax {jax.__version__}, device {jax.devices()[0].device_kind}, platform {plat}, "
        f"{sms} SMs, chunk {chunk}, pipelined reps {reps} (median of 5 rounds)")
    t_start = time.time()
    rows = []
    for shape in parse_shapes(args.shapes):
        if time.time() - t_start > args.budget:
            log(f"{shape}: skipped (--budget {args.budget:.0f} s spent)")
            continue
        B, T, H, D = shape
        x = make_inputs(shape)
        auto = split_plan.auto_pieces(B, H, D, D, T, chunk, sms)
        log(f"\n{'x'.join(map(str, shape))}: auto -> {auto} piece(s)")
        try:
            base = measure(x, chunk, KernelConfig(platform=platform), reps, warmup)
        except Exception as e:  # noqa: BLE001  (a failing shape must not lose the others)
            log(f"  unsplit FAILED: {type(e).__name__}: {str(e)[:300]}")
            continue
        rows.append((shape, "unsplit", 1, base[0], base[1], 0.0, 0.0))
        log(f"  unsplit      fwd {base[0]:8.3f} ms  fwd+bwd {base[1]:8.3f} ms")
        done = {1: rows[-1]}
        for p in pieces:
            n = auto if p == "auto" else p
            if n in done:  # "auto" picks a count already timed (or 1: the unsplit row)
                r = done[n]
                rows.append((shape, "auto", n) + r[3:])
                log(f"  auto (= {n}) fwd {r[3]:8.3f} ms  fwd+bwd {r[4]:8.3f} ms")
                continue
            cfg = KernelConfig(platform=platform, seq_split=n)
            got = []
            jax.eval_shape(lambda *a: got.append(forward_kernels(*a, chunk_size=chunk, kernel_config=cfg)) or 0,
                           x["q"], x["k"], x["v"], x["g"], x["beta"])
            if got[0].pieces != n:
                log(f"  P={n}: declined ({got[0].split_reason})")
                continue
            log(f"  P={n}: {maps_paths(x, chunk, platform, n)}")
            try:
                res = measure(x, chunk, cfg, reps, warmup)
            except Exception as e:  # noqa: BLE001
                log(f"  P={n} FAILED: {type(e).__name__}: {str(e)[:300]}")
                continue
            err_o = rel_rms(res[2], base[2])
            err_g = max(rel_rms(a, b) for a, b in zip(res[3], base[3]))
            row = (shape, f"P={n}", n, res[0], res[1], err_o, err_g)
            rows.append(row)
            done[n] = row
            log(f"  P={n:<3d} ({got[0].path:>9s}) fwd {res[0]:8.3f} ms  fwd+bwd {res[1]:8.3f} ms  "
                f"x{base[0] / res[0]:.2f} / x{base[1] / res[1]:.2f}  rel.rms vs unsplit o {err_o:.1e} "
                f"grads (max of {', '.join(GRADS)}) {err_g:.1e}")
    log(f"\n=== sequence split, pipelined ms ({jax.devices()[0].device_kind}, jax {jax.__version__}); "
        f"speed-up = unsplit / split; {time.time() - t_start:.0f} s")
    log(f"{'shape':>18s} {'config':>9s} {'P':>3s} {'fwd':>8s} {'fwd+bwd':>8s} {'xfwd':>5s} {'xf+b':>5s} "
        f"{'err o':>8s} {'err grad':>8s}")
    base = {}
    for shape, name, n, f, fb, eo, eg in rows:
        if name == "unsplit":
            base[shape] = (f, fb)
        bf, bfb = base[shape]
        log(f"{'x'.join(map(str, shape)):>18s} {name:>9s} {n:>3d} {f:8.3f} {fb:8.3f} {bf / f:5.2f} {bfb / fb:5.2f} "
            f"{eo:8.1e} {eg:8.1e}")


if __name__ == "__main__":
    main()
