"""Decode memory and latency: the cache-size table of the source notes (textbook §6.6.6), then per-token decode latency measured here.

(a) Prints the exact cache sizes of that setting (emb 2048, 16 x 128 heads, 48 layers, bf16,
    batch 1): full-attention KV cache at 4K / 32K / 128K against the GDN state (the notes' bf16
    figure and what gdn_jax keeps: its state + bf16 short-conv cache), and a 3:1 hybrid (formulas
    in :mod:`gdn_jax.inference.memory`), once for each decode-state dtype (float32, the default,
    and bfloat16: ``LMConfig.state_dtype``).
(b) Measures, on this machine, the per-token decode latency (jitted ``LM.decode_step``, batch 1,
    median of ``--reps`` calls) and the cache bytes of a GDN model, an attention model and a 3:1
    hybrid (every 4th layer gated attention) at each context of ``--contexts``. The attention
    KV cache has exactly ``context`` slots, filled with random keys/values (the cost does not depend on
    the values) up to ``context - reps - 2``; the compile step and each timed step write the next
    slot (the last one writes slot ``context - 2``), with the cache donated as a serving loop would. A masked
    attention over the static ``context`` slots costs the same at every position. ``--state_dtype``
    and ``--decode_backend`` set the GDN layers' decode-state dtype and step backend. (The per-token
    cost inside ``generate``'s on-device loop, against its floor: ``benchmarks/bench_decode.py``.)

    python experiments/memory.py                                  # CPU: contexts 1K..8K
    python experiments/memory.py --contexts 1024,4096,16384,32768 --out runs/memory_gpu

Writes ``results.json``, ``latency.png`` and ``seed_table.md`` under ``--out`` (default runs/memory).
"""
from __future__ import annotations

import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn_jax.cli import ArgumentParser, ListAction
from gdn_jax.inference import KVCache, cache_nbytes
from gdn_jax.inference.memory import model_cache_bytes, seed_table, seed_table_markdown
from gdn_jax.models import LM, LMConfig


def model_configs(args):
    base = dict(vocab_size=args.vocab, d_model=args.d_model, num_layers=args.layers, num_heads=args.heads,
                dtype=args.dtype, param_dtype=args.dtype)
    gdn = dict(state_dtype=args.state_dtype, decode_backend=args.decode_backend)
    return {
        "gdn": LMConfig(**base, **gdn, mixer="gdn"),
        "attention": LMConfig(**base, mixer="attention"),
        "hybrid_3to1": LMConfig(**base, **gdn, mixer="gdn", hybrid_every=4, hybrid_mixer="gated_attention"),
    }


@jax.jit
def _noop(x):
    return x


def measure(cfg: LMConfig, context: int, reps: int, seed: int = 0):
    model = LM(cfg, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)

    # the cache is donated, as in a serving loop (and as XLA does inside generate's lax.scan):
    # without donation every step would also copy the whole KV cache
    step = jax.jit(lambda state, tok, cache: nnx.merge(graphdef, state).decode_step(tok, cache), donate_argnums=2)

    cache = model.init_cache(1, context)
    key = jax.random.key(seed)
    filled = []
    for c in cache:  # an attention cache nearly full: the step attends over all its static slots
        if isinstance(c, KVCache):
            k1, k2, key = jax.random.split(key, 3)
            c = KVCache(jax.random.normal(k1, c.k.shape, c.k.dtype), jax.random.normal(k2, c.v.shape, c.v.dtype),
                        jnp.asarray(max(context - reps - 2, 0), jnp.int32))
        filled.append(c)
    cache = tuple(filled)
    nbytes = cache_nbytes(cache)
    tok = jnp.zeros((1,), jnp.int32)
    _, cache = jax.block_until_ready(step(state, tok, cache))  # compile
    times = []
    for _ in range(reps):  # the last rep writes slot context - 2
        t0 = time.perf_counter()
        logits, cache = jax.block_until_ready(step(state, tok, cache))
        times.append(time.perf_counter() - t0)
    assert bool(jnp.all(jnp.isfinite(logits)))
    times = np.asarray(times) * 1e3
    assert nbytes == model_cache_bytes(cfg, 1, context), (nbytes, model_cache_bytes(cfg, 1, context))
    return dict(context=context, latency_ms_median=float(np.median(times)), latency_ms_p10=float(np.percentile(times, 10)),
                latency_ms_p90=float(np.percentile(times, 90)), cache_bytes=nbytes)


def main(argv=None):
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", action=ListAction, elem_type=int, default=[1024, 2048, 4096, 8192],
                    help="contexts (GPU: up to 32768)")
    ap.add_argument("--out", default="runs/memory")
    ap.add_argument("--d_model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--state_dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the measured GDN layers' decode-state dtype (the seed table is printed for both)")
    ap.add_argument("--decode_backend", default="auto", choices=("auto", "scan", "pallas"))
    args = ap.parse_args(argv)
    contexts = list(args.contexts)
    for flag, value in (("--reps", args.reps), ("--layers", args.layers), ("--heads", args.heads),
                        ("--d_model", args.d_model), ("--vocab", args.vocab)):
        if value < 1:
            ap.error(f"{flag} must be >= 1, got {value}")
    if min(contexts) < args.reps + 2:  # the timed steps write slots up to context - 2 of the attention cache
        ap.error(f"--contexts must each be >= --reps + 2 = {args.reps + 2} (the timed decode steps fill the "
                 f"attention cache), got {contexts}")
    try:
        model_configs(args)
    except (ValueError, TypeError) as e:  # LMConfig's message names the field
        ap.error(str(e))
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        ap.error(f"--out {args.out!r} is a file, not a folder")
    os.makedirs(args.out, exist_ok=True)

    table = "\n\n".join(seed_table_markdown(state_dtype=sdt) for sdt in ("float32", "bfloat16"))
    print(table)
    with open(os.path.join(args.out, "seed_table.md"), "w") as f:
        f.write(table + "\n")

    results = dict(device=str(jax.devices()[0]), platform=jax.default_backend(), jax=jax.__version__,
                   machine=platform.machine(), cpu_count=os.cpu_count(), args=vars(args),
                   seed_table=seed_table(), seed_table_bf16_state=seed_table(state_dtype="bfloat16"), measured={})
    print(f"\nMeasured on {results['device']} (jax {jax.__version__}): d_model {args.d_model}, {args.layers} layers, "
          f"{args.heads} heads, {args.dtype}, GDN state {args.state_dtype}, decode backend {args.decode_backend}, batch 1; "
          f"per-token decode latency (median of {args.reps}) and cache bytes")
    print("| model | context | latency ms (median) | p10-p90 ms | cache bytes |")
    print("|---|---|---|---|---|")
    for name, cfg in model_configs(args).items():
        rows = []
        for n in contexts:
            r = measure(cfg, n, args.reps)
            rows.append(r)
            print(f"| {name} | {n:,} | {r['latency_ms_median']:.3f} | {r['latency_ms_p10']:.3f}-{r['latency_ms_p90']:.3f} "
                  f"| {r['cache_bytes']:,} |", flush=True)
        results["measured"][name] = rows
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in results["measured"].items():
        xs = [r["context"] for r in rows]
        axes[0].plot(xs, [r["latency_ms_median"] for r in rows], "o-", label=name)
        axes[1].plot(xs, [r["cache_bytes"] / 2 ** 20 for r in rows], "o-", label=name)
    for ax, yl in zip(axes, ("per-token decode latency (ms, median)", "decode cache (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(yl)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"{results['device']}: d {args.d_model}, {args.layers} layers, {args.heads} heads, {args.dtype}, batch 1")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "latency.png"), dpi=100)
    print(f"wrote {args.out}/results.json, latency.png, seed_table.md")


if __name__ == "__main__":
    main()
