"""Per-token decode latency of ``generate``'s token loop against its memory-traffic floor.

For the seed-sized model (d_model 2048, 16 heads x 128, 8 layers, no MLP, bf16 weights and
activations, vocab 1024, tied head) it times the decode loop that :func:`gdn_jax.inference.generate.generate`
runs after prefill — one jitted call whose ``lax`` loop runs every token on the device, the cache
donated — for GDN, attention and the 3:1 hybrid (every 4th layer gated attention), at each batch and
context. The attention KV cache has exactly ``context`` slots (its masked attention reads all of
them every step); GDN's state has a fixed size.

Timing (:func:`gdn_jax.inference.generate.time_decode_loop`): loops of static step count n =
``--tokens`` and 2n (as ``generate`` runs them; ``--traced_count``: one loop of 2n slots whose count
is traced, the earlier protocol), a warm-up call of each, then ``--reps`` pairs of synchronised
calls of n and 2n steps. GDN's decode path: ``--decode_backend`` (default auto: the fused layer
kernel on one GPU).
``ms/token`` = median of (2n-step call time) / 2n (total loop time over its tokens, one dispatch
included); ``slope`` = median of (t(2n) - t(n)) / n (the cost of one more step, dispatch cancelled).

Floor: ``bytes / bandwidth``, with ``bytes`` the bytes one token must move at least: every weight
read once (the tied embedding once, as the LM head), each GDN layer's state and conv cache read and
written, each attention layer's full KV cache read and one slot written (activations, logits and
the sampled tokens are not counted). ``bandwidth``: by default the device's copy bandwidth measured
at the start of the same run (``hbm.measure_copy_bandwidth``: a jitted, donated ``x + 1`` over a
1 GiB float32 array, read + write, the fastest of 10: on one H100 the median of the 10 moved between
2.05 and 2.35 TB/s from run to run of one lease while the fastest stayed at 2.37-2.49, and a slower
copy only makes the floor easier to meet), or ``--bandwidth`` bytes/s; the floor at the
fixed H200 figure of 4.3e12 B/s (the benchmark's former floor) is reported beside it
(``floor@4.3T``). ``ratio`` = ms/token / floor.

``--check`` compares, per GDN model at the smallest batch and context, one decode step's logits and
states with the same model decoding through plain XLA ops (``decode_backend="scan"``).

``--unroll`` (comma-separated) sets the decode loop's steps per iteration (default the library's,
``gdn_jax.inference.generate.default_unroll``: 2 on an accelerator). ``--profile`` adds, per model at the smallest batch and context, the
kernels of one decode step: from the compiled (optimized) HLO of the loop bodies (every
instruction that runs as a kernel, by opcode / custom-call target / fusion kind, divided by the
steps per iteration) and from a ``jax.profiler`` trace of one call of ``--tokens`` steps (the
device's kernels by name: launches and microseconds per step, against the loop's measured slope
per step; no device kernels on a CPU), and writes the compiled module's text beside the JSON
(``compiled_loop_<mixer>_<backend>_<state>_u<unroll>_b<batch>.hlo.txt``, not over an existing one):
what each fusion named in the trace computes.

Cache contents: by default (``--fill random``) the caches are filled with random values of the
right shapes and dtypes instead of prefilling a prompt (prefilling 128K-token prompts would take far
longer than the decode being measured; attention's O(T^2) prefill does not fit at all): decode cost
does not depend on the cache contents. ``--fill prefill`` prefills a random prompt instead (short
contexts only). Cells whose cache does not fit ``--mem_fraction`` of the device's memory are
skipped and listed; ``--max_seconds`` skips the cells left once that much time has passed, so that
the JSON and plot still come back from a time-limited run.

    python benchmarks/bench_decode.py --max_seconds 400 --profile --out results/decode_h100
    python benchmarks/bench_decode.py --mixers gdn --decode_backend pallas,fused_layer --unroll 1,4 --contexts 1024 --profile
    python benchmarks/bench_decode.py --mixers gdn --decode_backend scan,pallas --state_dtype float32,bfloat16
    python benchmarks/bench_decode.py --tiny --out /tmp/bench_decode          # CPU smoke test (seconds)

``--decode_backend`` (auto, scan, pallas, fused_layer) and ``--state_dtype`` take comma-separated
lists: each combination is one row per cell for the mixers with GDN layers (attention has neither). Writes ``results.json`` (after every
row) and ``latency.png`` (ms/token and floor against context, log x, one panel per batch) under
``--out`` (default runs/bench_decode).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

SEED_MODEL = dict(vocab_size=1024, d_model=2048, num_heads=16, head_dim=128, num_layers=8)
TINY_MODEL = dict(vocab_size=64, d_model=32, num_heads=2, head_dim=16, num_layers=4)
MIXERS = {
    "gdn": dict(mixer="gdn"),
    "attention": dict(mixer="attention"),
    "hybrid": dict(mixer="gdn", hybrid_every=4, hybrid_mixer="gated_attention"),
}
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo's gdn_jax, uninstalled too
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/hbm.py

NOMINAL_BANDWIDTH = 4.3e12  # an H200's attainable HBM bandwidth (B/s): the floor's former fixed figure
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
    ap.add_argument("--decode_backend", default="auto",
                    help="comma-separated: auto, scan, pallas, fused_layer (GDN layers; auto: fused_layer on one GPU)")
    ap.add_argument("--unroll", default=None,
                    help="comma-separated decode steps per loop iteration (default: the library's, 4 on an accelerator)")
    ap.add_argument("--state_dtype", default="float32", help="comma-separated: float32, bfloat16 (GDN layers)")
    ap.add_argument("--tokens", type=int, default=None, help="n: steps of the short timed call (default 32; --tiny 2)")
    ap.add_argument("--reps", type=int, default=None, help="timed call pairs per cell (default 3; --tiny 1)")
    ap.add_argument("--dtype", default="bfloat16", help="weights and activations")
    ap.add_argument("--fill", default="random", choices=("random", "prefill"))
    ap.add_argument("--bandwidth", default="measure",
                    help="bytes/s of the floor: 'measure' (default: the device's copy bandwidth, measured in this run "
                         "by a large device-to-device copy) or a number (an H200's HBM: 4.3e12)")
    ap.add_argument("--copy_bytes", type=float, default=None,
                    help="bytes of the bandwidth measurement's array (default 1 GiB; --tiny 16 MiB)")
    ap.add_argument("--traced_count", action="store_true",
                    help="time loops whose step count is traced (one compile of 2n slots, the earlier protocol; on a "
                         "GPU a host read of the loop condition per iteration) instead of static counts")
    ap.add_argument("--check", action="store_true",
                    help="per GDN model at the smallest batch and context: one decode step's logits and new state "
                         "against the same model decoding with decode_backend='scan' (plain XLA ops), same cache")
    ap.add_argument("--profile", action="store_true",
                    help="per (model, batch) at the smallest context: the compiled decode loop's kernels per step "
                         "(XLA's optimized HLO of the loop bodies) and a jax.profiler trace of one call, its device "
                         "kernels per step (count, us each)")
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
    args.decode_backend = _names("--decode_backend", args.decode_backend, ("auto", "scan", "pallas", "fused_layer"))
    args.unroll = [None] if args.unroll is None else _ints("--unroll", args.unroll)
    if args.bandwidth != "measure":
        try:
            args.bandwidth = float(args.bandwidth)
        except ValueError:
            raise SystemExit(f"--bandwidth must be 'measure' or a number of bytes/s, got {args.bandwidth!r}")
        if not args.bandwidth > 0:
            raise SystemExit("--bandwidth must be > 0")
    args.copy_bytes = int(args.copy_bytes or (16 * 2 ** 20 if tiny else 2 ** 30))
    args.state_dtype = _names("--state_dtype", args.state_dtype, ("float32", "bfloat16"))
    args.tokens = args.tokens if args.tokens is not None else (2 if tiny else 32)
    args.reps = args.reps if args.reps is not None else (1 if tiny else 3)
    if args.tokens < 1 or args.reps < 1:
        raise SystemExit(f"--tokens and --reps must be >= 1, got {args.tokens}, {args.reps}")
    if not (0 < args.mem_fraction <= 1) or args.max_seconds < 0 or args.copy_bytes < 2 ** 20:
        raise SystemExit("--mem_fraction must be in (0, 1], --max_seconds >= 0, --copy_bytes >= 1 MiB")
    need = slots_needed(args.tokens, args.reps, args.traced_count) + (2 * args.tokens if args.profile else 0)
    if min(args.contexts) <= need:
        raise SystemExit(f"--contexts: the smallest context ({min(args.contexts)}) must exceed the "
                         f"{need} slots the timed calls write (--tokens {args.tokens} x "
                         f"({1 if args.traced_count else 3} + 3 x --reps {args.reps})"
                         f"{', + 2 x --tokens for --profile' if args.profile else ''})")
    return args


def slots_needed(tokens: int, reps: int, traced_count: bool = False) -> int:
    """KV slots the timing writes: warm-up calls of n and 2n steps (one of n with ``traced_count``),
    then reps x (n + 2n)."""
    return tokens * ((1 if traced_count else 3) + 3 * reps)


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
    """What a GDN layer of these head dims (``K`` x ``V``, 16 heads, conv 4, mamba2 decay) decodes
    with on this machine: ``"auto"`` is the fused layer kernel on a one-device GPU process where it
    applies, else the step op's auto (its fused step kernel on a GPU where it applies, scan
    elsewhere): the rules of ``GatedDeltaNet.uses_fused_decode`` and ``gated_delta_rule_step``."""
    import jax
    import jax.numpy as jnp

    from gdn_jax.ops.pallas import decode, decode_layer
    from gdn_jax.ops.pallas.platform import default_platform

    if decode_backend != "auto":
        return decode_backend
    gpu = default_platform() == "gpu"
    spec = decode_layer.LayerSpec(Hk=16, H=16, K=K, V=V, W=4)
    if gpu and jax.device_count() == 1 and decode_layer.covers(spec, jnp.dtype(dtype), jnp.dtype(state_dtype)) is None:
        return "fused_layer"
    reason = decode.covers(K, V, jnp.promote_types(jnp.dtype(dtype), jnp.float32), jnp.dtype(state_dtype))
    return "pallas" if reason is None and gpu else "scan"


def variants(mixer, args):
    """(decode_backend, state_dtype, unroll) rows of a mixer: every combination where there are GDN
    layers (attention: every unroll)."""
    if mixer == "attention":
        return [("-", "-", u) for u in args.unroll]
    return [(b, s, u) for b in args.decode_backend for s in args.state_dtype for u in args.unroll]


NOT_KERNELS = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id",
               "replica-id", "opt-barrier", "add-dependency", "domain"}


def _hlo_computations(text):
    """{name: [instruction lines]} of an HLO module's text (the entry computation also as "ENTRY")."""
    comps, name = {}, None
    for line in text.splitlines():
        if not line.startswith((" ", "\t")) and line.rstrip().endswith("{") and not line.startswith("HloModule"):
            head = line.split("(")[0].split("{")[0].split()
            name = head[-1].lstrip("%") if head else None
            comps[name] = []
            if head and head[0] == "ENTRY":
                comps["ENTRY"] = comps[name]
        elif line.startswith("}"):
            name = None
        elif name is not None and " = " in line:
            comps[name].append(line.strip())
    return comps


def _opcode(line):
    """(opcode, detail) of one HLO instruction line: detail the custom-call target or fusion kind."""
    import re

    rhs = line.split(" = ", 1)[1]
    if rhs.startswith("("):  # a tuple type: skip its balanced parentheses
        depth = 0
        for i, c in enumerate(rhs):
            depth += c == "("
            depth -= c == ")"
            if depth == 0:
                rhs = rhs[i + 1:]
                break
    else:
        rhs = rhs.split(" ", 1)[1] if " " in rhs else rhs
    m = re.match(r"\s*([\w\-]+)\(", rhs)
    op = m.group(1) if m else "?"
    detail = ""
    if op == "custom-call":
        t = re.search(r'custom_call_target="([^"]+)"', line)
        detail = t.group(1) if t else ""
    elif op == "fusion":
        t = re.search(r"kind=(k\w+)", line)
        detail = t.group(1) if t else ""
        c = re.search(r'"name":"([^"]+)"', line)  # a Pallas / Triton kernel's name
        detail += f" {c.group(1)}" if c and "__triton" in line else ""
    return op, detail


def _count_kernels(comps, name, ops, seen=None):
    """Add the kernel-running instructions of computation ``name`` to the Counter ``ops``, looking
    through ``call`` instructions (XLA:GPU outlines command-buffer sequences into called computations)."""
    import re

    seen = set() if seen is None else seen
    for line in comps.get(name, []):
        op, detail = _opcode(line)
        if op == "call":
            m = re.search(r"to_apply=%?([\w.\-]+)", line)
            if m and m.group(1) not in seen:
                seen.add(m.group(1))
                _count_kernels(comps, m.group(1), ops, seen)
                continue
        if op not in NOT_KERNELS:
            ops[f"{op} {detail}".strip()] += 1


def loop_kernels(compiled_text, unroll, traced_count=False, n=None):
    """The kernels each decode step launches, from the compiled (optimized) HLO of a decode loop of
    ``n`` steps, ``unroll`` per iteration: the body of its ``while`` (found in the entry computation
    or a computation it calls; loops nested in the body count as one instruction each: on a GPU
    there are none, on a CPU the Pallas interpreter's), i.e. its instructions that run as a kernel
    (everything but parameters, tuples, constants, bitcasts, ...; ``call`` instructions looked
    through), grouped by opcode (custom calls by target, fusions by kind), divided by the steps per
    iteration. A static count: the largest loop body, ``unroll`` steps. A traced count: the two
    largest (``unroll`` steps, then the single-step loop). A static loop of one iteration (XLA
    drops it): the entry computation's kernels over the ``n`` steps. Returns a list of dict(body,
    steps, kernels, per_step, ops {label: count})."""
    import re
    from collections import Counter

    comps = _hlo_computations(compiled_text)
    u = max(1, min(unroll, n or unroll))
    bodies, todo, seen = [], ["ENTRY"], set()
    while todo:
        name = todo.pop(0)
        for line in comps.get(name, []):
            m = re.search(r"body=%?([\w.\-]+)", line) if " while(" in line else None
            if m:
                bodies.append(m.group(1))
            c = re.search(r"to_apply=%?([\w.\-]+)", line) if " call(" in line else None
            if c and c.group(1) not in seen:
                seen.add(c.group(1))
                todo.append(c.group(1))
    counted = []
    for b in bodies:
        ops = Counter()
        _count_kernels(comps, b, ops)
        counted.append((sum(ops.values()), b, ops))
    counted.sort(key=lambda t: -t[0])
    if (not traced_count and n and n // u <= 1) or not counted:
        ops = Counter()
        _count_kernels(comps, "ENTRY", ops)
        k = sum(ops.values())
        return [dict(body="ENTRY (no loop)", steps=n or 1, kernels=k, per_step=k / (n or 1), ops=dict(ops.most_common()))]
    keep = counted[:2] if (traced_count and u > 1) else counted[:1]
    return [dict(body=b, steps=u if i == 0 else 1, kernels=k, per_step=k / (u if i == 0 else 1),
                 ops=dict(ops.most_common())) for i, (k, b, ops) in enumerate(keep)]


def trace_kernels(fn, steps, out_dir):
    """Run ``fn()`` under ``jax.profiler.trace`` and sum the device's kernels (the events of every
    device plane's stream lines; a TPU's "XLA Ops" line) by name: list of dict(name, count,
    per_step, us_total, us_per_step), by total time; [] where the trace has no device plane (CPU)."""
    import glob
    from collections import defaultdict

    import jax
    from jax.profiler import ProfileData

    with jax.profiler.trace(out_dir):
        jax.block_until_ready(fn())
    files = sorted(glob.glob(os.path.join(out_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        return []
    count, ns = defaultdict(int), defaultdict(float)
    for plane in ProfileData.from_file(files[-1]).planes:
        if not plane.name.startswith("/device:"):
            continue
        lines = list(plane.lines)
        use = ([ln for ln in lines if ln.name.startswith("Stream")] or [ln for ln in lines if ln.name == "XLA Ops"]
               or [ln for ln in lines if not any(w in ln.name for w in ("Module", "Step", "Launch"))])
        for ln in use:
            for e in ln.events:
                count[e.name] += 1
                ns[e.name] += e.duration_ns
    rows = [dict(name=k, count=count[k], per_step=count[k] / steps, us_total=ns[k] / 1e3, us_per_step=ns[k] / 1e3 / steps)
            for k in count]
    return sorted(rows, key=lambda r: -r["us_total"])


def profile_cell(model, cache, B, n, unroll, traced_count, out_dir, hlo_path=None):
    """The ``--profile`` report of one cell: loop_kernels of the compiled decode loop (n steps,
    greedy, the count static or traced as timed) and trace_kernels of one call of n steps; with
    ``hlo_path`` the compiled module's text is written there too (what each fusion of the trace
    computes). Returns (dict, the cache after the traced call: the loop donates it)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from gdn_jax.inference.generate import _decode_loop, _check_unroll

    u = _check_unroll(unroll, traced_count)
    graphdef, state = nnx.split(model)
    tok = jnp.zeros((B,), jnp.int32)
    keys = jax.random.split(jax.random.key(0), n)
    temp, steps = jnp.asarray(0.0, jnp.float32), jnp.asarray(n, jnp.int32) if traced_count else None
    sds = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), cache)
    text = _decode_loop.lower(graphdef, state, sds, tok, keys, temp, steps, top_k=None, greedy=True,
                              unroll=u).compile().as_text()
    hlo = loop_kernels(text, u, traced_count, n)
    if hlo_path is not None:
        with open(hlo_path, "x") as f:  # a new file: never over another run's
            f.write(text)
    holder = {"cache": cache}

    def run():
        out, holder["cache"] = _decode_loop(graphdef, state, holder["cache"], tok, keys, temp, steps, top_k=None,
                                            greedy=True, unroll=u)
        return out

    run()  # compiled and warm before the trace
    out = dict(unroll=u, traced_count=bool(traced_count), hlo_loops=hlo, trace=[])
    try:
        out["trace"] = trace_kernels(run, n, out_dir)
    except Exception as e:  # noqa: BLE001 - no profiler plugin / CUPTI: the HLO count still stands
        out["trace_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out, holder["cache"]


def check_against_scan(model, cfg, cache, B, seed):
    """One decode step of ``model`` and of the same model built with ``decode_backend="scan"`` (the
    same parameters: the same config and seed) from ``cache`` (not donated): RMS-relative
    differences of the logits and of the GDN states (float64 on the host)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from gdn_jax.inference import GDNCache
    from gdn_jax.models import LM

    ref = LM(dataclasses.replace(cfg, decode_backend="scan"), rngs=nnx.Rngs(seed))
    tok = jnp.zeros((B,), jnp.int32)
    outs = []
    for m in (model, ref):
        gd, st = nnx.split(m)
        outs.append(jax.jit(lambda st, t, c, gd=gd: nnx.merge(gd, st).decode_step(t, c))(st, tok, cache))
    rel = lambda a, b: float(np.sqrt(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)
                                     / np.mean(np.asarray(b, np.float64) ** 2)))
    states = [(a.state, b.state) for a, b in zip(outs[0][1], outs[1][1]) if isinstance(a, GDNCache)]
    return dict(logits=rel(outs[0][0], outs[1][0]), state=max(rel(a, b) for a, b in states))


def print_profile(label, B, ctx, prof, wall_ms=None):
    print(f"\n### profile: {label}, batch {B}, context {ctx:,} (unroll {prof['unroll']})")
    for lp in prof["hlo_loops"]:
        ops = ", ".join(f"{k} x{v}" for k, v in lp["ops"].items())
        print(f"compiled loop body {lp['body']}: {lp['kernels']} kernels for {lp['steps']} step(s) = "
              f"{lp['per_step']:.1f} per step: {ops}")
    tr = prof["trace"]
    if not tr:
        print(f"trace failed: {prof['trace_error']}" if prof.get("trace_error") else
              "trace: no device kernels recorded (no GPU/TPU plane in the trace, e.g. on CPU)")
        return
    tot_n = sum(r["per_step"] for r in tr)
    tot_us = sum(r["us_per_step"] for r in tr)
    print(f"trace: {tot_n:.1f} device kernels per step, {tot_us:.1f} us of kernel time per step"
          + ("" if wall_ms is None else f" (the loop's wall time per step: {wall_ms * 1e3:.1f} us)"))
    print("| kernel | per step | us per step | us each |")
    print("|---|---|---|---|")
    for r in tr[:30]:
        each = r["us_total"] / r["count"] if r["count"] else 0.0
        print(f"| {r['name'][:90]} | {r['per_step']:.2f} | {r['us_per_step']:.2f} | {each:.2f} |")


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
    from gdn_jax.inference.generate import _check_unroll, time_decode_loop
    from gdn_jax.models import LM, LMConfig

    os.makedirs(args.out, exist_ok=True)
    size = TINY_MODEL if args.tiny else SEED_MODEL
    need = slots_needed(args.tokens, args.reps, args.traced_count) + (2 * args.tokens if args.profile else 0)
    copy = None
    if args.bandwidth == "measure":
        from hbm import measure_copy_bandwidth

        copy = measure_copy_bandwidth(args.copy_bytes)
        args.bandwidth = copy["best"]
    limit = memory_limit()
    budget = None if limit is None else args.mem_fraction * limit
    results = dict(device=str(jax.devices()[0].device_kind), platform=jax.default_backend(), jax=jax.__version__,
                   python=sys.version.split()[0], machine=platform.machine(), argv=sys.argv[1:] if argv is None else argv,
                   model=dict(size, dtype=args.dtype, mlp=False, tie_embeddings=True), bandwidth=args.bandwidth,
                   bandwidth_source="measured copy bandwidth" if copy else "--bandwidth", copy=copy,
                   bandwidth_nominal=NOMINAL_BANDWIDTH, profiles=[],
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
    if copy:
        print(f"copy bandwidth measured in this run: {copy['best'] / 1e12:.3f} TB/s (the fastest of {len(copy['times_s'])}; "
              f"median {copy['bandwidth'] / 1e12:.3f} TB/s; x + 1 over {copy['nbytes'] / 2 ** 30:.2f} GiB, read + write), "
              f"used for the floor; the fixed H200 figure is {NOMINAL_BANDWIDTH / 1e12:.2f} TB/s "
              f"(column 'floor@4.3T µs')", flush=True)
    print(f"floor = (weights + cache bytes read and written per token) / {args.bandwidth:.3g} B/s"
          + ("" if budget is None else f"; cells with caches over {budget / 1e9:.1f} GB are skipped"), flush=True)

    models = {}
    for mixer in args.mixers:
        for be, sdt, unroll in variants(mixer, args):
            kw = {} if mixer == "attention" else dict(decode_backend=be, state_dtype=sdt)
            cfg = LMConfig(**size, **MIXERS[mixer], mlp_ratio=0.0, dtype=args.dtype, param_dtype=args.dtype, **kw)
            if be == "auto":
                be = f"auto={resolved_backend(be, size['head_dim'], size['head_dim'], args.dtype, sdt)}"
            label = mixer if mixer == "attention" else f"{mixer} ({be}, {sdt} state)"
            if unroll is not None:
                label += f" unroll {unroll}"
            models[label] = (mixer, be, sdt, _check_unroll(unroll, args.traced_count), cfg)
    built = {}

    hdr = ("| mixer | decode backend | state | unroll | batch | context | ms/token | slope ms | tokens/s | floor µs | ratio "
           "| floor@4.3T µs | cache bytes | first call s |")
    print("\n" + hdr + "\n" + "|---" * 14 + "|", flush=True)
    for ctx in coarse_first(args.contexts):
        for B in args.batches:
            for label, (mixer, be, sdt, unroll, cfg) in models.items():
                row = dict(label=label, mixer=mixer, decode_backend=be, state_dtype=sdt, unroll=unroll, batch=B,
                           context=ctx)
                results["rows"].append(row)
                if args.max_seconds and time.perf_counter() - t_start > args.max_seconds:
                    row["skipped"] = f"time budget ({args.max_seconds:g} s) spent"
                    print(f"| {mixer} | {be} | {sdt} | {unroll} | {B} | {ctx:,} | skipped: {row['skipped']} |", flush=True)
                    continue
                if label not in built:
                    built[label] = LM(cfg, rngs=nnx.Rngs(args.seed))
                model = built[label]
                shapes = jax.eval_shape(lambda: model.init_cache(B, ctx))
                nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(shapes))
                row["cache_bytes"] = int(nbytes)
                if budget is not None and nbytes > budget:
                    row["skipped"] = f"cache {nbytes / 1e9:.1f} GB > {budget / 1e9:.1f} GB"
                    print(f"| {mixer} | {be} | {sdt} | {unroll} | {B} | {ctx:,} | skipped: {row['skipped']} |", flush=True)
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
                    if args.check and mixer != "attention" and ctx == min(args.contexts) and B == min(args.batches):
                        row["check"] = check_against_scan(model, cfg, cache, B, args.seed)  # before the loop's
                        print(f"check: {label}: one step against decode_backend='scan': logits rel. RMS "  # slots
                              f"{row['check']['logits']:.2e}, GDN states {row['check']['state']:.2e}", flush=True)
                    r = time_decode_loop(model, cache, jnp.zeros((B,), jnp.int32), args.tokens, reps=args.reps,
                                         unroll=unroll, traced_count=args.traced_count)
                    cache = r.pop("cache")
                    ms = r["per_token_s"] * 1e3
                    floor = moved / args.bandwidth * 1e3
                    row.update(ms_per_token=ms, slope_ms=r["slope_s"] * 1e3, tokens_per_s=B / r["per_token_s"],
                               floor_ms=floor, ratio=ms / floor, floor_ms_nominal=moved / NOMINAL_BANDWIDTH * 1e3,
                               weight_bytes=int(weights), bytes_per_token=int(moved),
                               first_call_s=r["first_call_s"], call_s=r["call_s"], call2_s=r["call2_s"])
                    print(f"| {mixer} | {be} | {sdt} | {unroll} | {B} | {ctx:,} | {ms:.3f} | {row['slope_ms']:.3f} | "
                          f"{row['tokens_per_s']:,.0f} | {floor * 1e3:.1f} | {row['ratio']:.1f}x | "
                          f"{row['floor_ms_nominal'] * 1e3:.1f} | {nbytes:,} | {r['first_call_s']:.1f} |", flush=True)
                    if args.profile and ctx == min(args.contexts) and B == min(args.batches):
                        hlo_path = os.path.join(args.out, f"compiled_loop_{mixer}_{be}_{sdt}_u{unroll}_b{B}.hlo.txt"
                                                .replace("=", "-").replace("/", "-"))
                        prof, cache = profile_cell(model, cache, B, args.tokens, unroll, args.traced_count,
                                                   tempfile.mkdtemp(prefix="bench_decode_trace_"),
                                                   None if os.path.exists(hlo_path) else hlo_path)
                        results["profiles"].append(dict(prof, label=label, batch=B, context=ctx))
                        print_profile(label, B, ctx, prof, r["slope_s"] * 1e3)
                        print("\n" + hdr + "\n" + "|---" * 14 + "|", flush=True)
                except Exception as e:  # noqa: BLE001 - one failed cell (e.g. out of memory) must not lose the rest
                    row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                    print(f"| {mixer} | {be} | {sdt} | {unroll} | {B} | {ctx:,} | error: {row['error'][:200]} |", flush=True)
                finally:
                    _delete(cache)
                save()
        plot(results, png_path)
    results["wall_s"] = time.perf_counter() - t_start
    save()
    plot(results, png_path)
    print(f"\nsorted by batch, context:\n{hdr}\n" + "|---" * 14 + "|")
    for r in sorted(results["rows"], key=lambda r: (r["batch"], r["context"], r["label"])):
        cells = [r["mixer"], r["decode_backend"], r["state_dtype"], str(r["unroll"]), str(r["batch"]), f"{r['context']:,}"]
        if "ms_per_token" in r:
            cells += [f"{r['ms_per_token']:.3f}", f"{r['slope_ms']:.3f}", f"{r['tokens_per_s']:,.0f}",
                      f"{r['floor_ms'] * 1e3:.1f}", f"{r['ratio']:.1f}x", f"{r['floor_ms_nominal'] * 1e3:.1f}",
                      f"{r['cache_bytes']:,}", f"{r['first_call_s']:.1f}"]
        else:
            cells.append(f"{'skipped: ' + r['skipped'] if 'skipped' in r else 'error: ' + r.get('error', '')[:120]}")
        print("| " + " | ".join(cells) + " |")
    done = sum("ms_per_token" in r for r in results["rows"])
    skipped = [r for r in results["rows"] if "skipped" in r or "error" in r]
    print(f"\n{done} cells timed, {len(skipped)} skipped or failed; {results['wall_s']:.0f} s in all; "
          f"wrote {json_path}, {png_path}", flush=True)


if __name__ == "__main__":
    main()
