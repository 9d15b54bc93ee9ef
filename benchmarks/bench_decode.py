"""Per-token decode latency of ``generate``'s token loop against its memory-traffic floor.

For the seed-sized model (d_model 2048, 16 heads x 128, 8 layers, no MLP, bf16 weights and
activations, vocab 1024, tied head) it times the decode loop that :func:`gdn_jax.inference.generate.generate`
runs after prefill — one jitted call whose ``lax`` loop runs every token on the device, the cache
donated — for GDN, attention and the 3:1 hybrid (every 4th layer gated attention), at each batch and
context. The attention KV cache has exactly ``context`` slots (its masked attention reads all of
them every step); GDN's state has a fixed size.

Timing (:func:`gdn_jax.inference.generate.time_decode_loop`): one compile per cell shape, a warm-up
call, then ``--reps`` pairs of synchronised calls of n = ``--tokens`` and 2n steps.
``ms/token`` = median of (2n-step call time) / 2n (total loop time over its tokens, one dispatch
included); ``slope`` = median of (t(2n) - t(n)) / n (the cost of one more step, dispatch cancelled).

Floor: ``bytes / --bandwidth`` (4.3e12 B/s: an H200's attainable HBM bandwidth), with ``bytes`` the
bytes one token must move at least: every weight read once (the tied embedding once, as the LM
head), each GDN layer's state and conv cache read and written, each attention layer's full KV
cache read and one slot written (activations, logits and the sampled tokens are not counted).
``ratio`` = ms/token / floor.

Cache contents: by default (``--fill random``) the caches are filled with random values of the
right shapes and dtypes instead of prefilling a prompt (prefilling 128K-token prompts would take far
longer than the decode being measured; attention's O(T^2) prefill does not fit at all): decode cost
does not depend on the cache contents. ``--fill prefill`` prefills a random prompt instead (short
contexts only). Cells whose cache does not fit ``--mem_fraction`` of the device's memory are
skipped and listed; ``--max_seconds`` skips the cells left once that much time has passed, so that
the JSON and plot still come back from a time-limited run.

    python benchmarks/bench_decode.py --decode_backend pallas --max_seconds 210 --out results/decode_h200
    python benchmarks/bench_decode.py --mixers gdn --decode_backend scan,pallas --state_dtype float32,bfloat16
    python benchmarks/bench_decode.py --tiny --out /tmp/bench_decode          # CPU smoke test (seconds)

``--decode_backend`` and ``--state_dtype`` take comma-separated lists: each combination is one row
per cell for the mixers with GDN layers (attention has neither). Writes ``results.json`` (after every
row) and ``latency.png`` (ms/token and floor against context, log x, one panel per batch) under
``--out`` (default runs/bench_decode).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

SEED_MODEL = dict(vocab_size=1024, d_model=2048, num_heads=16, head_dim=128, num_layers=8)
TINY_MODEL = dict(vocab_size=64, d_model=32, num_heads=2, head_dim=16, num_layers=4)
MIXERS = {
    "gdn": dict(mixer="gdn"),
    "attention": dict(mixer="attention"),
    "hybrid": dict(mixer="gdn", hybrid_every=4, hybrid_mixer="gated_attention"),
}
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo's gdn_jax, uninstalled too

FILL_NOTE = ("caches filled with random values of the right shapes (no prefill; one random batch row broadcast "
             "over the batch): decode cost does not depend on the cache contents")


def _ints(name, text):
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{name} must be comma-separated integers, got {text!r}")
    if not vals or min(vals) < 1:
        raise SystemExit(f"{name} must be positive integers, got {text!r}")
    return vals


def _names(name, text, allowed):
    vals = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in vals if v not in allowed]
    if not vals or bad:
        raise SystemExit(f"{name} must be a comma-separated subset of {sorted(allowed)}, got {text!r}")
    return vals


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default=None, help="comma-separated contexts (default 1024,2048,...,131072; --tiny 64,128)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,64; --tiny 1,2)")
    ap.add_argument("--mixers", default="gdn,attention,hybrid", help="comma-separated: gdn, attention, hybrid")
    ap.add_argument("--decode_backend", default="auto", help="comma-separated: auto, scan, pallas (GDN layers)")
    ap.add_argument("--state_dtype", default="float32", help="comma-separated: float32, bfloat16 (GDN layers)")
    ap.add_argument("--tokens", type=int, default=None, help="n: steps of the short timed call (default 32; --tiny 2)")
    ap.add_argument("--reps", type=int, default=None, help="timed call pairs per cell (default 3; --tiny 1)")
    ap.add_argument("--dtype", default="bfloat16", help="weights and activations")
    ap.add_argument("--fill", default="random", choices=("random", "prefill"))
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s of the floor (H200 HBM: 4.3e12)")
    ap.add_argument("--mem_fraction", type=float, default=0.6,
                    help="skip cells whose cache exceeds this share of the device memory limit")
    ap.add_argument("--max_seconds", type=float, default=0.0, help="skip the cells left after this long (0: no limit)")
    ap.add_argument("--tiny", action="store_true", help="tiny model and grid (CPU smoke test)")
    ap.add_argument("--out", default="runs/bench_decode")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.reps is not None and args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    tiny = args.tiny
    args.contexts = _ints("--contexts", args.contexts or ("64,128" if tiny else
                                                          ",".join(str(1024 << i) for i in range(8))))
    args.batches = _ints("--batches", args.batches or ("1,2" if tiny else "1,64"))
    args.mixers = _names("--mixers", args.mixers, MIXERS)
    args.decode_backend = _names("--decode_backend", args.decode_backend, ("auto", "scan", "pallas"))
    args.state_dtype = _names("--state_dtype", args.state_dtype, ("float32", "bfloat16"))
    args.tokens = args.tokens if args.tokens is not None else (2 if tiny else 32)
    args.reps = args.reps if args.reps is not None else (1 if tiny else 3)
    if args.tokens < 1 or args.reps < 1:
        raise SystemExit(f"--tokens and --reps must be >= 1, got {args.tokens}, {args.reps}")
    if not (0 < args.mem_fraction <= 1) or args.bandwidth <= 0 or args.max_seconds < 0:
        raise SystemExit("--mem_fraction must be in (0, 1], --bandwidth > 0, --max_seconds >= 0")
    need = slots_needed(args.tokens, args.reps)
    if min(args.contexts) <= need:
        raise SystemExit(f"--contexts: the smallest context ({min(args.contexts)}) must exceed the "
                         f"{need} slots the timed calls write (--tokens {args.tokens} x (1 + 3 x --reps {args.reps}))")
    return args


def slots_needed(tokens: int, reps: int) -> int:
    """KV slots the timing writes: a warm-up call of n steps, then reps x (n + 2n)."""
    return tokens * (1 + 3 * reps)


def coarse_first(xs):
    """``xs`` (sorted) in the order smallest, largest, then midpoints breadth first, so that a run cut
    short by ``--max_seconds`` still spans the whole range: 1K, 128K, 8K, 2K, 32K, 4K, 16K, 64K."""
    xs = sorted(set(xs))
    if len(xs) <= 2:
        return xs
    out, spans = [xs[0], xs[-1]], [(0, len(xs) - 1)]
    while spans:
        nxt = []
        for lo, hi in spans:
            if hi - lo > 1:
                mid = (lo + hi) // 2
                out.append(xs[mid])
                nxt += [(lo, mid), (mid, hi)]
        spans = nxt
    return out


def resolved_backend(decode_backend, K, V, dtype, state_dtype):
    """What ``gated_delta_rule_step(backend=decode_backend)`` runs for these shapes on this machine
    (``"auto"``: the fused kernel on a GPU where it applies, scan elsewhere; the op's rule)."""
    import jax.numpy as jnp

    from gdn_jax.ops.pallas import decode
    from gdn_jax.ops.pallas.platform import default_platform

    if decode_backend != "auto":
        return decode_backend
    reason = decode.covers(K, V, jnp.promote_types(jnp.dtype(dtype), jnp.float32), jnp.dtype(state_dtype))
    return "pallas" if reason is None and default_platform() == "gpu" else "scan"


def variants(mixer, args):
    """(decode_backend, state_dtype) rows of a mixer: every combination where there are GDN layers."""
    if mixer == "attention":
        return [("-", "-")]
    return [(b, s) for b in args.decode_backend for s in args.state_dtype]


def traffic_bytes(cache):
    """Bytes one decode step reads and writes in the caches: GDN state and conv caches read and
    written; an attention KV cache read in full (static slots) and one slot written."""
    import jax

    from gdn_jax.inference import KVCache

    total = 0
    for c in cache:
        if isinstance(c, KVCache):
            B, _, N, D = c.k.shape
            total += c.k.nbytes + c.v.nbytes + 2 * B * N * D * c.k.dtype.itemsize
        else:
            total += 2 * sum(x.nbytes for x in jax.tree_util.tree_leaves(c))
    return total


_NORMAL = {}


def _normal(key, shape, dtype, scale):
    """``scale * N(0, 1)`` in ``dtype``, drawn for one batch row (``shape[1:]``) and broadcast over
    the batch (no draw of more than one row: a KV cache of 64 x 32K x 2048 would be 2^32 values);
    one compiled function per shape and dtype."""
    import jax
    import jax.numpy as jnp

    if (shape, dtype, scale) not in _NORMAL:
        _NORMAL[shape, dtype, scale] = jax.jit(lambda k: jnp.broadcast_to(
            jax.random.normal(k, shape[1:], dtype) * dtype.type(scale), shape))
    return _NORMAL[shape, dtype, scale](key)


def random_cache(model, batch, context, pos, key):
    """``model.init_cache(batch, context)`` with every array replaced by random values of its shape
    and dtype (GDN states ~ N(0, 0.1^2), conv states and keys / values ~ N(0, 1); one random batch
    row broadcast over the batch); attention ``pos`` = ``pos``. Drawn one leaf at a time in the
    leaf's dtype."""
    import jax
    import jax.numpy as jnp

    from gdn_jax.inference import KVCache

    shapes = jax.eval_shape(lambda: model.init_cache(batch, context))
    rnd = lambda k, sd, scale: _normal(k, tuple(sd.shape), jnp.dtype(sd.dtype), scale)
    out = []
    for c in shapes:
        key, *ks = jax.random.split(key, 5)
        if isinstance(c, KVCache):
            out.append(KVCache(rnd(ks[0], c.k, 1.0), rnd(ks[1], c.v, 1.0), jnp.asarray(pos, jnp.int32)))
        else:
            out.append(type(c)(*(None if sd is None else rnd(k, sd, 0.1 if i == 0 else 1.0)
                                 for i, (k, sd) in enumerate(zip(ks, c)))))
    return tuple(out)


def memory_limit():
    import jax

    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - CPU and older backends have none
        stats = {}
    return stats.get("bytes_limit")


def _delete(tree):
    import jax

    for x in jax.tree_util.tree_leaves(tree):
        try:
            x.delete()
        except Exception:  # noqa: BLE001 - already donated / deleted
            pass


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if r.get("ms_per_token")]
    batches = sorted({r["batch"] for r in results["rows"]})
    if not batches:
        return
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
    for ax, B in zip(axes[0], batches):
        labels = sorted({r["label"] for r in rows if r["batch"] == B})
        for i, lab in enumerate(labels):
            rs = sorted((r for r in rows if r["batch"] == B and r["label"] == lab), key=lambda r: r["context"])
            col = f"C{i}"
            ax.plot([r["context"] for r in rs], [r["ms_per_token"] for r in rs], "o-", color=col, label=lab)
            ax.plot([r["context"] for r in rs], [r["floor_ms"] for r in rs], ":", color=col, lw=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms / token (dotted: floor)")
        ax.set_title(f"batch {B}")
        ax.grid(alpha=0.3, which="both")
        if labels:
            ax.legend(fontsize=8)
    m = results["model"]
    fig.suptitle(f"{results['device']}: decode loop, d {m['d_model']}, {m['num_layers']} layers, "
                 f"{m['num_heads']}x{m['head_dim']} heads, {m['dtype']}, floor at {results['bandwidth']:.2g} B/s",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from gdn_jax.inference.cache import cache_nbytes
    from gdn_jax.inference.generate import time_decode_loop
    from gdn_jax.models import LM, LMConfig

    os.makedirs(args.out, exist_ok=True)
    size = TINY_MODEL if args.tiny else SEED_MODEL
    need = slots_needed(args.tokens, args.reps)
    limit = memory_limit()
    budget = None if limit is None else args.mem_fraction * limit
    results = dict(device=str(jax.devices()[0].device_kind), platform=jax.default_backend(), jax=jax.__version__,
                   python=sys.version.split()[0], machine=platform.machine(), argv=sys.argv[1:] if argv is None else argv,
                   model=dict(size, dtype=args.dtype, mlp=False, tie_embeddings=True), bandwidth=args.bandwidth,
                   tokens=args.tokens, reps=args.reps, fill=args.fill,
                   fill_note=FILL_NOTE if args.fill == "random" else "caches from prefilling a random prompt",
                   memory_limit=limit, cache_budget=budget, rows=[])
    json_path, png_path = os.path.join(args.out, "results.json"), os.path.join(args.out, "latency.png")

    def save():
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)

    print(f"{results['device']} ({results['platform']}), jax {jax.__version__}; model d {size['d_model']}, "
          f"{size['num_layers']} layers, {size['num_heads']} heads x {size['head_dim']}, no MLP, {args.dtype}, "
          f"vocab {size['vocab_size']}; n = {args.tokens} / 2n steps per timed call, {args.reps} reps", flush=True)
    print(f"fill: {results['fill_note']}; attention caches hold context - {need} tokens before the timed calls", flush=True)
    print(f"floor = (weights + cache bytes read and written per token) / {args.bandwidth:.3g} B/s"
          + ("" if budget is None else f"; cells with caches over {budget / 1e9:.1f} GB are skipped"), flush=True)

    models = {}
    for mixer in args.mixers:
        for be, sdt in variants(mixer, args):
            kw = {} if mixer == "attention" else dict(decode_backend=be, state_dtype=sdt)
            cfg = LMConfig(**size, **MIXERS[mixer], mlp_ratio=0.0, dtype=args.dtype, param_dtype=args.dtype, **kw)
            if be == "auto":
                be = f"auto={resolved_backend(be, size['head_dim'], size['head_dim'], args.dtype, sdt)}"
            label = mixer if mixer == "attention" else f"{mixer} ({be}, {sdt} state)"
            models[label] = (mixer, be, sdt, cfg)
    built = {}

    hdr = ("| mixer | decode backend | state | batch | context | ms/token | slope ms | tokens/s | floor µs | ratio "
           "| cache bytes | first call s |")
    print("\n" + hdr + "\n" + "|---" * 12 + "|", flush=True)
    for ctx in coarse_first(args.contexts):
        for B in args.batches:
            for label, (mixer, be, sdt, cfg) in models.items():
                row = dict(label=label, mixer=mixer, decode_backend=be, state_dtype=sdt, batch=B, context=ctx)
                results["rows"].append(row)
                if args.max_seconds and time.perf_counter() - t_start > args.max_seconds:
                    row["skipped"] = f"time budget ({args.max_seconds:g} s) spent"
                    print(f"| {mixer} | {be} | {sdt} | {B} | {ctx:,} | skipped: {row['skipped']} |", flush=True)
                    continue
                if label not in built:
                    built[label] = LM(cfg, rngs=nnx.Rngs(args.seed))
                model = built[label]
                shapes = jax.eval_shape(lambda: model.init_cache(B, ctx))
                nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(shapes))
                row["cache_bytes"] = int(nbytes)
                if budget is not None and nbytes > budget:
                    row["skipped"] = f"cache {nbytes / 1e9:.1f} GB > {budget / 1e9:.1f} GB"
                    print(f"| {mixer} | {be} | {sdt} | {B} | {ctx:,} | skipped: {row['skipped']} |", flush=True)
                    save()
                    continue
                cache = None
                try:
                    t0 = time.perf_counter()
                    if args.fill == "random":
                        cache = random_cache(model, B, ctx, ctx - need, jax.random.key(args.seed + ctx))
                    else:
                        prompt = jax.random.randint(jax.random.key(args.seed), (B, ctx - need), 0, size["vocab_size"])
                        gd, st = nnx.split(model)
                        cache = jax.jit(lambda st, p: nnx.merge(gd, st).prefill(p, ctx)[1])(st, prompt)
                    jax.block_until_ready(cache)
                    row["fill_s"] = time.perf_counter() - t0
                    assert cache_nbytes(cache) == nbytes
                    weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
                    moved = weights + traffic_bytes(cache)
                    r = time_decode_loop(model, cache, jnp.zeros((B,), jnp.int32), args.tokens, reps=args.reps)
                    cache = r.pop("cache")
                    ms = r["per_token_s"] * 1e3
                    floor = moved / args.bandwidth * 1e3
                    row.update(ms_per_token=ms, slope_ms=r["slope_s"] * 1e3, tokens_per_s=B / r["per_token_s"],
                               floor_ms=floor, ratio=ms / floor, weight_bytes=int(weights), bytes_per_token=int(moved),
                               first_call_s=r["first_call_s"], call_s=r["call_s"], call2_s=r["call2_s"])
                    print(f"| {mixer} | {be} | {sdt} | {B} | {ctx:,} | {ms:.3f} | {row['slope_ms']:.3f} | "
                          f"{row['tokens_per_s']:,.0f} | {floor * 1e3:.1f} | {row['ratio']:.1f}x | {nbytes:,} | "
                          f"{r['first_call_s']:.1f} |", flush=True)
                except Exception as e:  # noqa: BLE001 - one failed cell (e.g. out of memory) must not lose the rest
                    row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                    print(f"| {mixer} | {be} | {sdt} | {B} | {ctx:,} | error: {row['error'][:200]} |", flush=True)
                finally:
                    _delete(cache)
                save()
        plot(results, png_path)
    results["wall_s"] = time.perf_counter() - t_start
    save()
    plot(results, png_path)
    print(f"\nsorted by batch, context:\n{hdr}\n" + "|---" * 12 + "|")
    for r in sorted(results["rows"], key=lambda r: (r["batch"], r["context"], r["label"])):
        cells = [r["mixer"], r["decode_backend"], r["state_dtype"], str(r["batch"]), f"{r['context']:,}"]
        if "ms_per_token" in r:
            cells += [f"{r['ms_per_token']:.3f}", f"{r['slope_ms']:.3f}", f"{r['tokens_per_s']:,.0f}",
                      f"{r['floor_ms'] * 1e3:.1f}", f"{r['ratio']:.1f}x", f"{r['cache_bytes']:,}", f"{r['first_call_s']:.1f}"]
        else:
            cells.append(f"{'skipped: ' + r['skipped'] if 'skipped' in r else 'error: ' + r.get('error', '')[:120]}")
        print("| " + " | ".join(cells) + " |")
    done = sum("ms_per_token" in r for r in results["rows"])
    skipped = [r for r in results["rows"] if "skipped" in r or "error" in r]
    print(f"\n{done} cells timed, {len(skipped)} skipped or failed; {results['wall_s']:.0f} s in all; "
          f"wrote {json_path}, {png_path}", flush=True)


if __name__ == "__main__":
    main()
