"""Where the training loop of :func:`gdn_jax.recall.run` loses time against its jitted step.

One model, one compiled step, several loops over it, each timed over ``--steps`` steps after a
warm-up (synchronised at both ends), one table::

    loop                         what each step does besides ``train_step(state, batch)``
    step, one batch              nothing (``benchmarks/bench_train_step.py``'s loop)
    + device gather              ``DeviceFixedLoader.batch(s)`` (the fixed set on the device)
    + gather + metrics           the run's metric book-keeping too (append, stage every
                                 ``log_every`` steps, fetch one interval late)
    + host batches (prefetch)    ``prefetch_batches(loader.batch)``: made on the host, copied
    stream data gen (host only)  the stream loader's ``batch(s)`` alone, no device work
    _Run.train (fixed|stream)    the run's own loop (``recall._Run.train``; no evaluation inside)

For each: steps/s, its ratio to the first row, and the mean host time of one ``train_step`` call
(dispatch: when it approaches the step time the loop is host-bound)::

    python benchmarks/bench_loop.py                   # the H200 MQAR shape (d 128), gdn and attention
    python benchmarks/bench_loop.py --quick           # CPU smoke test
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)


def _timed(label, n, body, warm=20):
    """Run ``body(i, call)`` for ``i`` in ``range(warm + n)``, timing the last ``n`` (the first
    ``warm`` compile whatever this loop's inputs need); returns (label, steps/s, mean host s of one
    ``call(train_step, ...)``)."""
    import jax

    host = [0.0]
    out = [None]

    def call(fn, *a):
        t = time.perf_counter()
        r = fn(*a)
        host[0] += time.perf_counter() - t
        return r

    for i in range(warm):
        out[0] = body(i, call)
    jax.block_until_ready(out[0])
    host[0] = 0.0
    t0 = time.perf_counter()
    for i in range(warm, warm + n):
        out[0] = body(i, call)
    jax.block_until_ready(out[0])
    dt = time.perf_counter() - t0
    return label, n / dt, host[0] / n


def bench(mixer, args):
    import jax

    from gdn_jax import recall as R
    from gdn_jax import training as T

    base = R.RecallConfig(task="mqar", mixer=mixer, d_model=args.d_model, num_heads=2, seq_len=args.seq_len,
                          num_kv_pairs=args.num_kv_pairs, vocab_size=args.vocab_size, batch_size=args.batch_size,
                          random_non_queries=False, data_mode="fixed", train_examples=args.train_examples,
                          test_examples=200, steps=10 ** 6, warmup=10, eval_every=10 ** 9, progress=False,
                          out=tempfile.mkdtemp(prefix="bench_loop_"))
    r = R._Run(base)
    r.restore_or_init()
    step, N = r.train_step, args.steps
    dl = T.DeviceFixedLoader(r.loader, r.mesh)
    batch0 = dl.batch(0)
    state = [r.state]

    def run_step(i, call, batch):
        state[0], m = call(step, state[0], batch)
        return m

    t = time.perf_counter()
    jax.block_until_ready(run_step(0, lambda f, *a: f(*a), batch0))
    compile_s = time.perf_counter() - t
    for i in range(10):  # warm-up
        run_step(i, lambda f, *a: f(*a), dl.batch(i))
    jax.block_until_ready(state[0])
    rows = [_timed("step, one batch", N, lambda i, c: run_step(i, c, batch0))]
    rows.append(_timed("+ device gather", N, lambda i, c: run_step(i, c, dl.batch(i))))

    pend, staged = [], []

    def with_metrics(i, c):
        m = run_step(i, c, dl.batch(i))
        pend.append(m)
        if (i + 1) % base.log_every == 0:
            staged.append({k: jax.numpy.stack([p[k] for p in pend]) for k in ("loss", "accuracy")})
            pend.clear()
            if len(staged) > 1:
                jax.device_get(staged.pop(0))
        return m

    rows.append(_timed("+ gather + metrics", N, with_metrics))
    it = T.prefetch_batches(r.loader.batch, range(N + 20), r.mesh)
    rows.append(_timed("+ host batches (prefetch)", N, lambda i, c: run_step(i, c, next(it)[1])))
    it.close()
    # stream data has no fixed training set: its size left at the default (a set one is refused)
    stream_cfg = dataclasses.replace(base, data_mode="stream", train_examples=R.RecallConfig.train_examples)
    stream = R.build(stream_cfg)[1]
    t = time.perf_counter()
    for i in range(min(N, 200)):
        stream.batch(i)
    gen = min(N, 200) / (time.perf_counter() - t)
    rows.append(("stream data gen (host only)", gen, None))
    for mode in ("fixed", "stream"):
        r.cfg = base if mode == "fixed" else stream_cfg
        if mode == "stream":
            r.loader = stream
        for n in (20, N):  # the first, short, run compiles what the loop's data path needs
            r.state = state[0]
            r.start = r.step = int(jax.device_get(r.state.step))
            r.stop = r.start + n
            r.pending, r.staged = [], []
            r.data_wait_s = 0.0
            r.first_step_s = 0.0  # already compiled
            r.train()
            jax.block_until_ready(r.state)
            dt = time.perf_counter() - r.t0  # the run's own clock: from after its data setup, as recall.run
            state[0] = r.state
        rows.append((f"_Run.train ({mode}; data wait {r.data_wait_s:.2f} s)", N / dt, None))
    if args.trace:
        r.loader = dl.loader
        rows.append(_traced(r, args.trace))
    r.ckpt.close()
    return compile_s, rows


def _traced(r, n):
    """``n`` steps of ``_Run.train`` (fixed data) under ``jax.profiler.trace``: the device's busy share
    of the window (union of its kernels, first start to last end) and its idle gaps."""
    import glob

    import jax
    import numpy as np

    d = tempfile.mkdtemp(prefix="bench_loop_trace_")
    r.cfg = dataclasses.replace(r.cfg, data_mode="fixed")
    r.start = r.step = int(jax.device_get(r.state.step))
    r.stop, r.pending, r.staged = r.start + n, [], []
    with jax.profiler.trace(d):
        r.train()
        jax.block_until_ready(r.state)
    try:
        prof = jax.profiler.ProfileData.from_file(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0])
        iv = []
        for plane in prof.planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            lines = [ln for ln in plane.lines if "stream" in ln.name.lower()] or list(plane.lines)
            iv += [(e.start_ns, e.start_ns + e.duration_ns) for ln in lines for e in ln.events]
        if not iv:
            return ("trace: no GPU kernels found", None, None)
        iv.sort()
        busy, gaps, (cs, ce) = 0.0, [], iv[0]
        for a, b in iv[1:]:
            if a > ce:
                busy += ce - cs
                gaps.append(a - ce)
                cs, ce = a, b
            else:
                ce = max(ce, b)
        busy += ce - cs
        window = ce - iv[0][0]
        g = np.asarray(gaps) / 1e3
        big = g[g > 50]
        return (f"trace {n} steps: device busy {busy / window:.0%} of {window / 1e9:.2f} s; gaps > 50 us: "
                f"{len(big)} ({big.sum() / 1e3:.1f} ms, max {g.max() if len(g) else 0:.0f} us)", n / (window / 1e9), None)
    except Exception as e:  # noqa: BLE001 -- the profile is a diagnostic: report, do not fail the table
        return (f"trace: not read ({type(e).__name__}: {e})"[:120], None, None)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mixers", nargs="+", default=["gdn", "attention"])
    ap.add_argument("--d_model", type=int, default=128)
    ap.add_argument("--seq_len", type=int, default=512)
    ap.add_argument("--num_kv_pairs", type=int, default=64)
    ap.add_argument("--vocab_size", type=int, default=8192)
    ap.add_argument("--batch_size", type=int, default=128)
    ap.add_argument("--train_examples", type=int, default=100_000)
    ap.add_argument("--steps", type=int, default=None, help="steps per timed loop (default 1000; --quick: 20)")
    ap.add_argument("--trace", type=int, default=0, help="also profile this many steps of the run's loop")
    ap.add_argument("--quick", action="store_true", help="tiny shapes for the flags not given (CPU smoke test)")
    args = ap.parse_args(argv)
    from gdn_jax.models import MIXERS

    bad = [m for m in args.mixers if m not in MIXERS]
    if bad:
        ap.error(f"--mixers must be among {sorted(MIXERS)}, got {bad}")
    if args.quick:  # tiny shapes for the flags not given (an explicit flag wins)
        given = {a.split("=", 1)[0] for a in (sys.argv[1:] if argv is None else argv) if a.startswith("--")}
        for k, v in dict(d_model=16, seq_len=32, num_kv_pairs=4, vocab_size=64, batch_size=4,
                         train_examples=64).items():
            if f"--{k}" not in given:
                setattr(args, k, v)
    if args.steps is None:
        args.steps = 20 if args.quick else 1000
    if args.steps < 1 or args.trace < 0:
        ap.error(f"--steps must be >= 1 and --trace >= 0, got --steps {args.steps} --trace {args.trace}")
    import jax

    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; MQAR L {args.seq_len}, pairs "
          f"{args.num_kv_pairs}, vocab {args.vocab_size}, batch {args.batch_size}, d {args.d_model}, "
          f"{args.steps} steps per loop", flush=True)
    table = []
    for m in args.mixers:
        compile_s, rows = bench(m, args)
        print(f"  {m}: first step {compile_s:.1f} s", flush=True)
        for label, sps, host in rows:
            print(f"    {label:<44} {_num(sps, 1)} steps/s  host {_num(_ms(host), 2, 6)} ms/call", flush=True)
        table.append((m, rows))
    print("\nmixer      loop                                         steps/s  vs step  host ms/step-call")
    for m, rows in table:
        ref = rows[0][1]
        for label, sps, host in rows:
            print(f"{m:<10} {label:<44} {_num(sps, 1)} {_num(None if sps is None else sps / ref, 2)} "
                  f"{_num(_ms(host), 2)}")


def _ms(seconds):
    return None if seconds is None else seconds * 1e3


def _num(x, digits, width=8):
    """A table cell: ``x`` with ``digits`` decimals, or '-' where the loop does not measure it."""
    return f"{'-':>{width}}" if x is None else f"{x:{width}.{digits}f}"


if __name__ == "__main__":
    main()
