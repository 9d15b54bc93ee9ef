"""Training-step speed of every mixer at one task shape: steps/s and compile time, one table.

Run this before a long sweep to see which mixers are slow on the device (the first H200 MQAR sweep,
L 512 / 64 pairs / vocab 8192 / batch 128, ran deltanet and gla at d >= 128 at 5-8 steps/s against
22-95 for the others). Each cell builds the LM of :func:`gdn_jax.recall.build` with the loss that
:func:`gdn_jax.recall.run` uses (sparse head for MQAR), compiles the jitted step, then times ``--reps``
steps on one fixed batch (synchronised)::

    python benchmarks/bench_train_step.py                                   # the H200 MQAR shape
    python benchmarks/bench_train_step.py --mixers gla --d_models 128 --env XLA_FLAGS=--xla_gpu_autotune_level=0
    python benchmarks/bench_train_step.py --quick                           # tiny CPU smoke test
    python benchmarks/bench_train_step.py --mixers gdn --backend pallas --kernel_config f32_inputs=bf16
    python benchmarks/bench_train_step.py --mixers gdn attention --d_models 64 --population 1 2 4   # P runs vmapped

``--kernel_config`` takes ``field=value`` items of :class:`gdn_jax.ops.KernelConfig` (several
``--kernel_config`` groups, ``;``-separated, give one row each: ``"f32_inputs=bf16;gpu_f32_mm=tf32,gpu_f32_inv=tf32"``).

``--env K=V`` sets environment variables (XLA / JAX flags) before JAX is imported; gdn_jax itself
reads none (its kernel options are the explicit ``gdn_jax.ops.KernelConfig``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mixers", nargs="+", default=["gdn", "deltanet", "mamba2", "gla", "linear", "attention"])
    ap.add_argument("--d_models", nargs="+", type=int, default=[64, 128, 256])
    ap.add_argument("--seq_len", type=int, default=512)
    ap.add_argument("--num_kv_pairs", type=int, default=64)
    ap.add_argument("--vocab_size", type=int, default=8192)
    ap.add_argument("--batch_size", type=int, default=128)
    ap.add_argument("--num_heads", type=int, default=2)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--kernel_config", default="", help="KernelConfig field=value items (',' within one, ';' between rows)")
    ap.add_argument("--env", nargs="*", default=[], help="KEY=VALUE switches set before tracing")
    ap.add_argument("--quick", action="store_true", help="tiny shapes for the flags not given (CPU smoke test)")
    ap.add_argument("--population", nargs="+", type=int, default=[1],
                    help="also time P independent runs trained together: the step vmapped over P stacked train "
                         "states on the same batch (one row per P; 'run-steps/s' = P x steps/s). Says whether a "
                         "sweep could train several learning rates of a cell in one process faster than one by one")
    ap.add_argument("--profile", type=int, default=0,
                    help="also trace this many steps (jax.profiler) and print the device's top kernels by time")
    args = ap.parse_args(argv)
    if args.reps is not None and args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    if args.profile < 0:
        ap.error(f"--profile must be >= 0 (steps to trace; 0: no profile), got {args.profile}")
    for kv in args.env:
        k, _, v = kv.partition("=")
        os.environ[k] = v
    if args.quick:  # tiny shapes for the flags not given (an explicit flag wins)
        given = {a.split("=", 1)[0] for a in (sys.argv[1:] if argv is None else argv) if a.startswith("--")}
        for k, v in dict(d_models=[16], seq_len=32, num_kv_pairs=4, vocab_size=64, batch_size=4, reps=2).items():
            if f"--{k}" not in given:
                setattr(args, k, v)

    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from gdn_jax import training as T
    from gdn_jax.cli import parse_kernel_config
    from gdn_jax.models import LM
    from gdn_jax.recall import RecallConfig, build, max_labels

    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; L {args.seq_len}, pairs {args.num_kv_pairs}, "
          f"vocab {args.vocab_size}, batch {args.batch_size}, backend {args.backend}, env {args.env or '-'}", flush=True)
    kcs = [None] if not args.kernel_config else [
        parse_kernel_config([x for x in grp.split(",") if x]) for grp in args.kernel_config.split(";")]
    if any(p < 1 for p in args.population):
        ap.error(f"--population takes sizes >= 1, got {args.population}")
    rows = []
    for d, m, kc, P in [(d, m, kc, P) for d in args.d_models for m in args.mixers for kc in kcs
                        for P in args.population]:
        if True:
            cfg = RecallConfig(mixer=m, d_model=d, num_heads=args.num_heads, seq_len=args.seq_len,
                               num_kv_pairs=args.num_kv_pairs, vocab_size=args.vocab_size,
                               batch_size=args.batch_size, backend=args.backend)
            task, loader, lm_cfg, model_fn, tx = build(cfg)
            if kc is not None:
                lm_cfg = dataclasses.replace(lm_cfg, kernel_config=kc)
                model_fn = lambda lm_cfg=lm_cfg: LM(lm_cfg, rngs=nnx.Rngs(cfg.seed))
            mesh = T.make_mesh()
            graphdef, state = T.create_train_state(model_fn(), tx, seed=0, mesh=mesh)
            step = T.make_train_step(graphdef, tx, mesh, loss_fn=T.make_lm_loss(max_labels(task)))
            batch = T.shard_batch(loader.batch(0), mesh)
            if P > 1:  # P runs in one step: the train state stacked on a leading axis, the batch shared
                state = jax.tree.map(lambda *x: jnp.stack(x), *[T.create_train_state(model_fn(), tx, seed=i)[1]
                                                                 for i in range(P)])
                state = jax.device_put(state, T.replicated(mesh))  # as the step returns it: no second compile
                one = T.make_train_step(graphdef, tx, None, loss_fn=T.make_lm_loss(max_labels(task)))
                step = jax.jit(jax.vmap(one, in_axes=(0, None)))
            t0 = time.perf_counter()
            state, met = step(state, batch)
            jax.block_until_ready(met)
            compile_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(args.reps):
                state, met = step(state, batch)
            jax.block_until_ready(met)
            ms = (time.perf_counter() - t0) / args.reps * 1e3
            tag = "-" if kc is None else ",".join(f"{f.name}={getattr(kc, f.name)}" for f in dataclasses.fields(kc)
                                                  if getattr(kc, f.name) != f.default)
            tag += f" pop {P}" if P > 1 else ""
            rows.append((m, d, ms, compile_s, tag, P))
            if args.profile:
                print(top_kernels(lambda st: step(st, batch), state, args.profile), flush=True)
            print(f"  {m:<10} d {d:<4} {tag}  {ms:8.2f} ms/step  {1e3 / ms:7.1f} steps/s  "
                  f"{P * 1e3 / ms:7.1f} run-steps/s  first step {compile_s:5.1f} s", flush=True)
    print("\nmixer       d     ms/step  steps/s  run-steps/s  first-step s  kernel_config")
    for m, d, ms, c, tag, P in rows:
        print(f"{m:<10} {d:<5} {ms:8.2f} {1e3 / ms:8.1f} {P * 1e3 / ms:12.1f} {c:13.1f}  {tag}")


def top_kernels(step, state, n, top=12):
    """Trace ``n`` steps under ``jax.profiler.trace`` and list the device kernels that took the most
    time (summed over the steps, grouped by name), with their share of the device's busy time."""
    import collections
    import glob
    import tempfile

    import jax

    d = tempfile.mkdtemp(prefix="bench_train_step_trace_")
    with jax.profiler.trace(d):
        for _ in range(n):
            state, met = step(state)
        jax.block_until_ready(met)
    files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    if not files:
        return "  profile: no trace written"
    prof = jax.profiler.ProfileData.from_file(files[0])
    tot, cnt = collections.Counter(), collections.Counter()
    for plane in prof.planes:
        if not plane.name.startswith("/device:"):
            continue
        lines = [ln for ln in plane.lines if "stream" in ln.name.lower()] or list(plane.lines)
        for ln in lines:
            for e in ln.events:
                tot[e.name] += e.duration_ns
                cnt[e.name] += 1
    if not tot:
        return "  profile: no device kernels in the trace (CPU?)"
    busy = sum(tot.values())
    out = [f"  profile of {n} steps: {busy / n / 1e6:.2f} ms of kernels per step, {len(tot)} kernel names, "
           f"{sum(cnt.values()) / n:.0f} launches per step; top {top}:"]
    for name, ns in tot.most_common(top):
        out.append(f"    {ns / n / 1e3:9.1f} us/step {ns / busy:6.1%}  x{cnt[name] / n:<5.0f} {name[:90]}")
    return "\n".join(out)


if __name__ == "__main__":
    main()
