"""The fused GDN decode-layer kernel alone (``gdn_jax.ops.pallas.decode_layer``): microseconds per
call at the seed model's layer (16 heads x 128, conv 4, mamba2 decay, bf16 projection, float32
state) for each GPU program shape (``num_warps`` x ``bv``, the state's column chunk), at batch 1
and 64, against its byte floor (the state read and written, the projection and conv states read,
y and the conv states written) at the copy bandwidth measured in the same run.

Each timed call is a jitted ``lax.fori_loop`` of ``--steps`` kernel calls that carries the state and
conv states (donated, updated in place as a decode loop does); µs per call = median over ``--reps``
of the loop's time over its steps. The kernel is one program per (batch row, value head): 16
programs at batch 1 on a GPU of 132 SMs, which is what this benchmark looks at.

    python benchmarks/bench_decode_layer.py                       # GPU: the grid below, ~1 min
    python benchmarks/bench_decode_layer.py --tiny                # CPU smoke test (interpret mode)

Writes ``<out>/decode_layer.json`` (a new file; an existing one is an error) and prints the table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo's gdn_jax
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/hbm.py, bench_decode.py

from bench_decode import _ints  # noqa: E402  (the decode benchmark's list parser)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64", help="comma-separated batch sizes (default 1,64)")
    ap.add_argument("--num_warps", default="2,4,8", help="GPU warps per program (default 2,4,8; 4 is the library's)")
    ap.add_argument("--bv", default="32,64,128", help="state column chunks (default 32,64,128; 64 is the library's)")
    ap.add_argument("--steps", type=int, default=64, help="kernel calls per timed loop (default 64)")
    ap.add_argument("--reps", type=int, default=5, help="timed loops per cell (default 5)")
    ap.add_argument("--copy_bytes", type=int, default=1 << 30, help="bytes of the copy-bandwidth measurement")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: 2 heads x 16, interpret mode")
    ap.add_argument("--out", default="results/decode_layer_bench", help="folder of decode_layer.json")
    args = ap.parse_args(argv)
    args.batches, args.num_warps, args.bv = (_ints(n, getattr(args, n)) for n in ("batches", "num_warps", "bv"))
    if args.steps < 1 or args.reps < 1:
        raise SystemExit("--steps and --reps must be >= 1")
    return args


def inputs(spec, B, key):
    import jax
    import jax.numpy as jnp

    from gdn_jax.ops.pallas import decode_layer as DL

    ks = jax.random.split(key, 8)
    n = (spec.Hk * spec.K, spec.Hk * spec.K, spec.H * spec.V)
    proj = jax.random.normal(ks[0], (B, DL.proj_width(spec)), jnp.bfloat16)
    convs = tuple(jax.random.normal(ks[1 + i], (B, spec.W - 1, m), jnp.bfloat16) for i, m in enumerate(n))
    conv_w = tuple(0.3 * jax.random.normal(ks[4 + i], (spec.W, m), jnp.float32) for i, m in enumerate(n))
    A_log = jnp.zeros((spec.H,), jnp.float32)
    dt_bias = jnp.zeros((spec.H * spec.ga,), jnp.float32)
    norm_w = jnp.ones((spec.V,), jnp.float32)
    state = 0.1 * jax.random.normal(ks[7], (B, spec.H, spec.K, spec.V), jnp.float32)
    return proj, convs, conv_w, A_log, dt_bias, norm_w, state


def floor_bytes(spec, B):
    """Bytes one call must move: the float32 state read and written, the projection row and conv
    states read (bf16), y and the conv states written (bf16); weights (conv, norm, gates) once."""
    state = B * spec.H * spec.K * spec.V * 4
    conv = B * (spec.W - 1) * (2 * spec.Hk * spec.K + spec.H * spec.V) * 2
    from gdn_jax.ops.pallas import decode_layer as DL

    return 2 * state + 2 * conv + B * DL.proj_width(spec) * 2 + B * spec.H * spec.V * 2


def time_cell(spec, B, num_warps, bv, steps, reps, platform):
    import jax
    import numpy as np

    from gdn_jax.ops.pallas import decode_layer as DL

    proj, convs, conv_w, A_log, dt_bias, norm_w, state = inputs(spec, B, jax.random.key(0))

    def loop(state, convs):
        def body(_, carry):
            s, c = carry
            y, s, c = DL.decode_layer(proj, c, conv_w, A_log, dt_bias, norm_w, s, spec=spec, state_dtype="float32",
                                      platform=platform, num_warps=num_warps, bv=bv)
            return s, tuple(c)
        return jax.lax.fori_loop(0, steps, body, (state, tuple(convs)))

    run = jax.jit(loop, donate_argnums=(0, 1))
    t0 = time.perf_counter()
    carry = jax.block_until_ready(run(state, convs))
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        carry = jax.block_until_ready(run(*carry))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / steps, first


def main(argv=None):
    args = parse(argv)
    import jax

    from gdn_jax.ops.pallas import decode_layer as DL

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "decode_layer.json")
    if os.path.exists(path):
        raise SystemExit(f"{path} exists: pass another --out (a run never writes over another's)")
    platform = "interpret" if args.tiny else None
    spec = (DL.LayerSpec(Hk=2, H=2, K=16, V=16, W=4, scale=0.25) if args.tiny
            else DL.LayerSpec(Hk=16, H=16, K=128, V=128, W=4, scale=128 ** -0.5))
    if args.tiny:
        args.batches, args.bv, args.num_warps = [1], [8, 16], [4]
        args.steps, args.reps = 2, 1
        bw = dict(bandwidth=None, note="not measured (--tiny)")
    else:
        from hbm import measure_copy_bandwidth

        bw = measure_copy_bandwidth(args.copy_bytes)
    dev = jax.devices()[0]
    print(f"{getattr(dev, 'device_kind', dev.platform)}, jax {jax.__version__}; decode layer H {spec.H} x K {spec.K} x "
          f"V {spec.V}, conv {spec.W}, mamba2 decay, bf16 proj, float32 state; {args.steps} calls per loop, median of "
          f"{args.reps}; copy bandwidth " + (f"{bw['bandwidth'] / 1e12:.3f} TB/s" if bw["bandwidth"] else "not measured"),
          flush=True)
    rows = []
    print("| batch | num_warps | bv | programs | µs per call | floor µs | x floor | first call s |\n|---|---|---|---|---|---|---|---|")
    for B in args.batches:
        nbytes = floor_bytes(spec, B)
        for nw in args.num_warps:
            for bv in args.bv:
                if spec.V % bv:
                    continue
                row = dict(batch=B, num_warps=nw, bv=bv, programs=B * spec.H, floor_bytes=nbytes)
                try:
                    per, first = time_cell(spec, B, nw, bv, args.steps, args.reps, platform)
                    floor = nbytes / bw["bandwidth"] if bw["bandwidth"] else None
                    row.update(us=per * 1e6, floor_us=floor and floor * 1e6, ratio=floor and per / floor,
                               first_call_s=first)
                    fl = f"{floor * 1e6:.2f} | {per / floor:.1f}x" if floor else "- | -"
                    print(f"| {B} | {nw} | {bv} | {B * spec.H} | {per * 1e6:.2f} | {fl} | {first:.1f} |", flush=True)
                except Exception as e:  # noqa: BLE001 - a program shape that does not compile must not lose the rest
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(f"| {B} | {nw} | {bv} | {B * spec.H} | error: {row['error'][:120]} |", flush=True)
                rows.append(row)
    with open(path, "x") as f:
        json.dump(dict(device=str(getattr(dev, "device_kind", dev.platform)), jax=jax.__version__, argv=sys.argv[1:],
                       spec=dict(H=spec.H, K=spec.K, V=spec.V, W=spec.W), copy=bw, steps=args.steps, reps=args.reps,
                       rows=rows), f, indent=1)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
