"""Each Hopper (Mosaic GPU) kernel of ``backend="pallas"`` timed alone on its real inputs, pipelined
device time and per synchronised call, plus the whole op and (when importable) jax-linear-attention
at the same shape. GPU (sm_90); ``--interpret`` runs every kernel in Mosaic GPU's interpret mode
on CPU (a smoke test of this script: its times mean nothing there).

    python benchmarks/bench_hopper_stages.py --shapes 0,3 --reps 20 [--blocks 64,32,16] [--no-jla]
    python benchmarks/bench_hopper_stages.py --interpret --shapes 1x70x1x64 --reps 1 --only "own dVl"

Also times the forward WY with ``HopperTuning(wy_inverse="dense")`` (the default is "blocked"), with
each ``wy_precision`` ("<precision> rounds"; whole op "wy bf16x3", ...; the default is "bf16"),
``wy_compact=True`` against the separate tiles (the default is compact), ``approx_math=True`` (the
forward WY, the gradient kernel, the whole op: "approx" lines), ``auto_barriers`` False against True
(each kernel with its own barriers and with Pallas' automatic ones: the forward WY with and without
T, the forward state pass with and without h, Vn, the reverse pass ("bwd reverse own / auto
barriers", the default's form) and the gradient kernel ("bwd grads own / auto barriers"), with
their outputs' bit-equality; whole op "own barriers" / "auto barriers"; the default, None, is own
barriers for all but the reverse pass), ``wy_chunks_per_cta=m`` (the forward
WY at m = 2, 4, 8, "per CTA" lines; whole op at 4), ``late_o_store=True`` ("late o" lines; whole op
with all three of these options: "approx, wy 4, late o"), ``fwd_form="t"``'s WY kernel
and state pass ("T-form" lines; whole op "fwd form t"), ``save_wy``'s kernels (the
forward WY + T, the backward's WY from the saved Aqk and T), and the whole op by default, with the
dense inverse, without ``save_wy``, with the one-warpgroup gradient kernel
(``HopperTuning(grad_warpgroups=1)``, also timed alone; the default is 2) and without ``save_states``
("no save states": the backward recomputes h_n and Vn and runs its WY stage; the default's forward
state pass also writes h_n and Vn, timed alone as "fwd state pass + h, Vn", and its reverse pass
forms dVl from the saved Aqk, "bwd reverse, own dVl"), and the persistent gradient kernel
(``HopperVariants(grad_chunks_per_cta=m)``: "bwd grads m per CTA" alone, "grads m per CTA" whole, at
the m of :func:`grad_chunks_per_cta`), and the warp-specialised state passes
(``HopperTuning(state_producer=True, variants=HopperVariants(state_warpgroups=N, state_slots=D))``:
"ws NxD" lines, the forward's checked bit for bit against the one-warpgroup pass; whole op "producer NxD"), and the
warp-specialised reverse pass (``HopperTuning.reverse_producer``, the default: "bwd reverse pass";
the one-warpgroup pass "bwd reverse pass 1 WG" alone, checked bit for bit against it, "reverse 1 WG"
whole; "fwd state pass 1 WG" and "no producers" likewise for the forward's state pass). ``--timeline N`` traces N synchronised whole-op fwd+bwd calls
(each selected whole-op line, and jla) and prints where a call's time goes: kernels, the idle gaps
between them, and the host's time outside them (per call we pay ~0.41 ms above the pipelined time at
4x4096x16x128, jla ~0.27).

Shapes are ``bench_pallas.SHAPES`` indices or BxTxHxD. ``--only`` times just the lines whose
name contains one of its comma-separated substrings (semicolon-separated if it has a ";": labels
such as "bwd grads, 1 WG" contain commas). ``--blocks`` times the forward state pass at each value
block (``KernelCall.bv_mosaic``) besides the default. One line per kernel, flushed as it goes (a
device call's time limit keeps what was printed), with the bytes the stage must move at least
(:func:`stage_bytes`) and its pipelined time as a multiple of that HBM floor at the card's copy
bandwidth measured at the start of the run (``--bandwidth measure``, the default: a donated ``x + 1``
over 1 GiB, ``hbm.measure_copy_bandwidth``, as bench_decode.py's floor) or at ``--bandwidth`` bytes/s,
and at 4.3 TB/s (an H200's data-sheet figure, the floor of the earlier stage files) beside it (not in
interpret mode). Used for
results/hopper_h200/stages_*.txt.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


HBM_BYTES_PER_S = 4.3e12  # REFERENCE.md section 5's H200 figure: the second floor printed


def stage_bytes(shape, C=64):
    """HBM bytes each stage must move at least (every input read once, every output written once;
    bf16 tensors, the f32 gate rows left out), by stage name, for ``shape`` = (B, T, H, D) with
    K = V = D: Xk / Xv the size of q (k) / v, CC of one [C, C] tile per chunk and head (Aqk, T_hi,
    T_lo), HS of the per-chunk states h_n (or dh_n). Used for the "x floor" column."""
    B, T, H, D = shape
    n = -(-T // C)
    Xk = Xv = B * n * C * H * D * 2
    CC = B * H * n * C * C * 2
    HS = B * H * n * D * D * 2
    return {
        "fwd WY": 3 * Xk + 2 * Xv + CC,  # q, k, v -> w, u, aqk
        "fwd WY, dense inv.": 3 * Xk + 2 * Xv + CC,
        "fwd WY + T (save_wy)": 3 * Xk + 2 * Xv + 3 * CC,  # + t_hi, t_lo
        "fwd state pass": 3 * Xk + 2 * Xv + CC,  # q, k, w, u, aqk -> o
        "fwd state pass + h, Vn": 3 * Xk + 3 * Xv + CC + HS,  # + h, vn
        "fwd state pass late o": 3 * Xk + 2 * Xv + CC,
        "fwd state pass own barriers": 3 * Xk + 2 * Xv + CC,
        "fwd state pass + h, Vn own barriers": 3 * Xk + 3 * Xv + CC + HS,
        "fwd state pass + h, Vn late o": 3 * Xk + 3 * Xv + CC + HS,
        "fwd WY T-form": 2 * Xk + 3 * CC,  # q, k -> aqk, t_hi, t_lo (HopperTuning.fwd_form="t")
        "fwd WY T-form + W": 3 * Xk + 3 * CC,  # + w
        "fwd state T-form": 2 * Xk + 2 * Xv + 3 * CC,  # q, k, v, t_hi, t_lo, aqk -> o
        "fwd state T-form + h, Vn": 2 * Xk + 3 * Xv + 3 * CC + HS,  # + h, vn
        "bwd WY": 3 * Xk + 4 * Xv + 2 * CC,  # q, k, v, do -> w, u, dvl, t_hi, t_lo
        "bwd WY from saved": 2 * Xk + 4 * Xv + 3 * CC,  # k, v, do, aqk, t_hi, t_lo -> w, u, dvl
        "bwd WY from saved own barriers": 2 * Xk + 4 * Xv + 3 * CC,
        "bwd reverse, own dVl": 3 * Xk + 2 * Xv + CC + 2 * HS,  # q, k, w, do, aqk, h -> dh, dvn
        "bwd recompute": 2 * Xk + 2 * Xv + HS,  # k, w, u -> h, vn
        "bwd reverse pass": 3 * Xk + 3 * Xv + 2 * HS,  # q, k, w, dvl, do, h -> dh, dvn
        "bwd reverse own barriers": 3 * Xk + 2 * Xv + CC + 2 * HS,  # as "bwd reverse, own dVl"
        "bwd grads own barriers": 4 * Xk + 5 * Xv + 2 * HS + 2 * CC,
        "bwd gradient kernel": 4 * Xk + 5 * Xv + 2 * HS + 2 * CC,  # q, k, v, do, h, dh, vn, dvn, t -> dq, dk, dv
        "bwd grads, 1 WG": 4 * Xk + 5 * Xv + 2 * HS + 2 * CC,
        "bwd grads, bf16 T phase": 4 * Xk + 5 * Xv + 2 * HS + 2 * CC,
        "bwd grads approx": 4 * Xk + 5 * Xv + 2 * HS + 2 * CC,
        "fwd WY approx": 3 * Xk + 2 * Xv + CC,
        "fwd WY own barriers": 3 * Xk + 2 * Xv + CC,
        "fwd WY + T own barriers": 3 * Xk + 2 * Xv + 3 * CC,
        **{f"fwd WY {m} per CTA": 3 * Xk + 2 * Xv + CC for m in (2, 4, 8)},
        **{f"fwd WY T-form {m} per CTA": 2 * Xk + 3 * CC for m in (2, 4, 8)},
        "bwd grads m per CTA": 4 * Xk + 5 * Xv + 2 * HS + 2 * CC,
    }


def grad_chunks_per_cta(n: int, BH: int, sms: int = 132) -> list:
    """Chunks per CTA to time for the persistent gradient kernel (``HopperVariants.grad_chunks_per_cta``)
    at ``n`` chunks and ``BH`` rows: 2, 4 and the count that makes one wave of about ``sms`` CTAs
    (an H200 has 132 SMs; the kernel fits one CTA per SM), those below ``n`` and above 1."""
    wave = -(-(BH * n) // sms)
    return sorted({m for m in (2, 4, wave) if 1 < m <= n})


def floor_note(name, shape, ms, bandwidth=None):
    """'  [N MB, HBM floor F ms, R x; at 4.3 TB/s F' ms, R' x]' for a stage line (empty for names
    without a byte count): the floor at ``bandwidth`` bytes/s (the measured copy bandwidth; None:
    4.3 TB/s only)."""
    key = "fwd state pass" if name.startswith("fwd state pass bv") else name
    key = "bwd grads m per CTA" if name.startswith("bwd grads ") and name.endswith(" per CTA") else key
    nbytes = stage_bytes(shape).get(key)
    if nbytes is None:
        return ""
    nominal = nbytes / HBM_BYTES_PER_S * 1e3
    if bandwidth is None:
        return f"  [{nbytes / 1e6:.0f} MB, HBM floor {nominal:.3f} ms, {ms / nominal:.1f}x]"
    floor = nbytes / bandwidth * 1e3
    return (f"  [{nbytes / 1e6:.0f} MB, HBM floor {floor:.3f} ms, {ms / floor:.2f}x; at 4.3 TB/s {nominal:.3f} ms, "
            f"{ms / nominal:.1f}x]")


def timeline(call, n, top=8):
    """Where a synchronised call's time goes: trace ``n`` calls of ``call`` (each waited for) under
    ``jax.profiler.trace`` and, from the device's kernel events, per call: host wall time, the span
    from the first kernel's start to the last one's end, the kernels' summed time, their number, the
    idle gaps between them inside the span (the launch path), and what the host spends outside the
    span (dispatch before the first kernel, the wait after the last). Medians over the calls, then
    the median call's kernels in order (gap before each, duration). A line of text; on a machine
    without device kernels (CPU, interpret mode) it says so."""
    import glob
    import tempfile
    import time

    import jax

    jax.block_until_ready(call())
    d = tempfile.mkdtemp(prefix="bench_hopper_timeline_")
    walls = []
    with jax.profiler.trace(d):
        for _ in range(n):
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            walls.append(time.perf_counter() - t0)
            time.sleep(0.002)  # a clear gap between calls in the trace
    files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    if not files:
        return "no trace written"
    prof = jax.profiler.ProfileData.from_file(files[0])
    ev = []
    for plane in prof.planes:
        if not plane.name.startswith("/device:"):
            continue
        lines = [ln for ln in plane.lines if "stream" in ln.name.lower()] or list(plane.lines)
        for ln in lines:
            ev += [(e.start_ns, e.end_ns, e.name) for e in ln.events]
    return summarize_timeline(ev, walls)


def summarize_timeline(ev, walls):
    """:func:`timeline`'s text from the device's kernel events ``ev`` ((start_ns, end_ns, name),
    calls >= 1 ms apart) and the calls' host wall times ``walls`` (s)."""
    import statistics

    if not ev:
        return "no device kernels in the trace (CPU / interpret mode)"
    ev = sorted(ev)
    calls, cur = [], [ev[0]]
    for e in ev[1:]:  # calls are >= 2 ms apart (the sleep); kernels of one call are not
        if e[0] - max(x[1] for x in cur) > 1_000_000:
            calls.append(cur)
            cur = []
        cur.append(e)
    calls.append(cur)
    rows = []
    for c in calls:
        span = max(x[1] for x in c) - c[0][0]
        busy = sum(x[1] - x[0] for x in c)
        rows.append((span / 1e6, busy / 1e6, len(c), c))
    med = lambda i: statistics.median(r[i] for r in rows)
    wall = statistics.median(walls) * 1e3
    out = [f"{len(calls)} calls: wall {wall:.3f} ms, kernel span {med(0):.3f}, kernels busy {med(1):.3f} "
           f"({med(2):.0f} kernels), idle inside the span {med(0) - med(1):.3f}, host outside it "
           f"{wall - med(0):.3f} ms"]
    mid = sorted(rows, key=lambda r: r[0])[len(rows) // 2][3]
    prev = mid[0][0]
    for s0, e0, name in mid[:64]:
        out.append(f"      gap {max(0, s0 - prev) / 1e3:7.1f} us  {(e0 - s0) / 1e3:8.1f} us  {name[:70]}")
        prev = max(prev, e0)
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="0", help="comma-separated bench_pallas.SHAPES indices or BxTxHxD")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--blocks", default="", help="extra value blocks of the forward state pass, e.g. 32,16")
    ap.add_argument("--no-jla", action="store_true")
    ap.add_argument("--once", action="store_true",
                    help="run each selected stage once after compiling it, no timing (for a profiler such as "
                         "ncu: run_h200.sh's ncu step)")
    ap.add_argument("--interpret", action="store_true",
                    help="CPU smoke test: every kernel in Mosaic GPU's interpret mode (timings meaningless; "
                         "no jla), e.g. --interpret --shapes 1x128x1x64 --reps 1")
    ap.add_argument("--timeline", type=int, default=0,
                    help="also trace this many synchronised whole-op fwd+bwd calls of each selected whole-op "
                         "line (and jla) and print where each call's time goes: kernels, gaps, host")
    ap.add_argument("--only", default="",
                    help="comma-separated substrings (semicolon-separated when it has a ';', for labels "
                         "with commas): time only the lines whose name contains one, e.g. 'kernel,WG,pallas' "
                         "or 'bwd grads, 1 WG;pallas'; an item starting with '=' matches a whole name only, "
                         "e.g. '=fwd WY' (default: every line)")
    ap.add_argument("--bandwidth", default="measure",
                    help="bytes/s of the HBM floors: 'measure' (default: the card's copy bandwidth, measured "
                         "at the start of the run) or a number, e.g. 3.35e12; 4.3 TB/s is printed beside it")
    args = ap.parse_args(argv)
    if args.bandwidth != "measure":
        try:
            args.bandwidth = float(args.bandwidth)
        except ValueError:
            ap.error(f"--bandwidth must be 'measure' or a number of bytes/s, got {args.bandwidth!r}")
        if not args.bandwidth > 0:
            ap.error(f"--bandwidth must be > 0, got {args.bandwidth}")
    if args.reps is not None and args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    only = [o.strip() for o in args.only.split(";" if ";" in args.only else ",") if o.strip()]

    t_only = [False]  # a shape only fwd_form "t" takes (K = 256): its stages, the whole op, jla

    def wanted(name):
        if t_only[0] and not ("T-form" in name or "K256" in name or "[triton]" in name
                              or name in ("pallas", "fwd form t", "fwd form wu", "wide hopper_xla", "wide hopper", "jla")):
            return False
        return not only or any(name == o[1:] if o.startswith("=") else o in name for o in only)

    import jax
    import jax.numpy as jnp

    import bench_pallas as bp
    from gdn_jax.ops import KernelConfig
    from gdn_jax.ops.pallas.config import FLAT_NAMES, from_flat_names
    from gdn_jax.ops.pallas import vjp as V
    from gdn_jax.ops.pallas.hopper import grads as HG, plan as HP, state_bwd as HR, state_fwd as HS, wy as HW

    print(jax.__version__, jax.devices()[0].device_kind, flush=True)
    if args.interpret or args.once:
        args.bandwidth = None
    elif args.bandwidth == "measure":
        from hbm import measure_copy_bandwidth

        args.bandwidth = measure_copy_bandwidth(1 << 30)["bandwidth"]
        print(f"copy bandwidth measured in this run: {args.bandwidth / 1e12:.2f} TB/s (the HBM floors' bandwidth)",
              flush=True)

    def t(f, arrays=None):
        """Pipelined and per-call ms of ``f(arrays)`` jitted (the arrays as arguments: closed-over
        arrays would be baked into the executable as constants, which XLA then folds for seconds),
        or of ``f()`` as given when ``arrays`` is None (already a call of a jitted function)."""
        if arrays is None:
            call = f
        else:
            jf = jax.jit(f)
            call = lambda: jf(arrays)
        jax.block_until_ready(call())
        if args.once:
            return "ran once"
        ms = bp.time_fn_pipelined(call, args.reps)
        return f"{ms:.3f} (per call {bp.time_fn(call, args.reps):.3f})"

    def line(name, f, arrays):
        text = t(f, arrays)
        if args.once:
            print(f"  {name:<22} {text}", flush=True)
            return
        note = "" if args.interpret else floor_note(name, shape, float(text.split()[0]), args.bandwidth)
        print(f"  {name:<22} {text} ms{note}", flush=True)

    base = dict(platform="interpret", gpu_kernels="mosaic") if args.interpret else {}
    KC = lambda **kw: from_flat_names(**base, **kw)
    # options that an older tree's gdn_jax lacks (the ab step runs this script beside other commits'
    # gdn_jax/) are skipped there rather than failing the whole run
    has = lambda field: field in KernelConfig.__dataclass_fields__ or field in FLAT_NAMES

    def barriers(c, own):
        """KernelCall ``c`` with every Hopper kernel that can place its own barriers doing so (own) or
        keeping Pallas' automatic barriers (HopperTuning.auto_barriers False / True); None where the
        tree has no such option (an older ab tree: there it was a bool on KernelCall)."""
        fields = type(c).__dataclass_fields__
        if "own_barriers" in fields:
            from gdn_jax.ops.pallas.hopper.tuning import OWN_BARRIER_KERNELS
            return dataclasses.replace(c, own_barriers=OWN_BARRIER_KERNELS if own else ())
        return dataclasses.replace(c, auto_barriers=not own) if "auto_barriers" in fields else None

    def bit_equal(f, g, A):
        """Whether jitted f and g give the same arrays on A, bit for bit (every output)."""
        a, b = jax.jit(f)(A), jax.jit(g)(A)
        return all(bool(jnp.array_equal(a[key], b[key])) for key in b)
    failed = []
    for shape in bp.parse_shapes(args.shapes, on_gpu=True):
        try:
            x = bp.make_inputs(shape)
            prep = V.to_kernel_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=64, config=KC())
            names = ("q", "k", "v", "beta", "gc", "gr", "eg", "ekd", "dec", "h0", "fl")
            cf, fargs = prep.kernel_args("fwd")
            F = dict(zip(names, fargs))
            print(shape, "fwd: mosaic", prep.paths[0].startswith("hopper"), "C", cf.C, "value block", cf.bv_mosaic, flush=True)
            if not prep.paths[0].startswith("hopper"):
                print("  not on the Hopper kernels:", HP.fwd_covers(cf) or "not an sm_90 GPU", flush=True)
                continue
            wy_fwd = lambda c, A, **kw: HW.wy_forward(c, A["q"], A["k"], A["v"], A["beta"], A["gc"], A["eg"], **kw)
            wu = HP.fwd_covers(dataclasses.replace(cf, fwd_form="wu")) is None  # K = 256: the T-form lines alone
            t_only[0] = not wu
            if not wu:
                print("  fwd_form 'wu' does not take this shape: the T-form stages and the whole op only", flush=True)
            else:
                F.update(jax.jit(lambda A: wy_fwd(cf, A))(F))  # w, u, aqk
            if wanted("fwd WY"):
                line("fwd WY", lambda A: wy_fwd(cf, A), F)
            if wanted("fwd WY approx") and wu:  # HopperTuning.approx_math
                line("fwd WY approx", lambda A: wy_fwd(dataclasses.replace(cf, approx_math=True), A), F)
            cnb, cab = barriers(cf, True), barriers(cf, False)  # HopperTuning.auto_barriers False / True
            for label, kw in (("fwd WY own barriers", {}), ("fwd WY + T own barriers", dict(save_t=True))):
                if wanted(label) and wu and cnb is not None:
                    line(label, lambda A, kw=kw: wy_fwd(cnb, A, **kw), F)
                    line(label.replace("own", "auto"), lambda A, kw=kw: wy_fwd(cab, A, **kw), F)
                    # the same values as with Pallas' automatic barriers, bit for bit (every output array)
                    same = bit_equal(lambda A, kw=kw: wy_fwd(cnb, A, **kw), lambda A, kw=kw: wy_fwd(cab, A, **kw), F)
                    print(f"    {label}: outputs equal to the automatic barriers': {same}", flush=True)
            for m in (2, 4, 8):  # HopperVariants.wy_chunks_per_cta: the persistent WY kernel
                cm = dataclasses.replace(cf, wy_per_cta=m)
                for label, c1, kw in ((f"fwd WY {m} per CTA", cm, {}),
                                      (f"fwd WY T-form {m} per CTA", dataclasses.replace(cm, fwd_form="t"),
                                       dict(t_form=True))):
                    if not wanted(label) or (not kw and not (wu and HP.wy_compact(cm))):
                        continue
                    line(label, lambda A, c1=c1, kw=kw: wy_fwd(c1, A, **kw), F)
                    # the same values as one chunk per CTA, bit for bit (every output array)
                    c0 = dataclasses.replace(c1, wy_per_cta=1)
                    same = bit_equal(lambda A, kw=kw: wy_fwd(c1, A, **kw), lambda A, kw=kw: wy_fwd(c0, A, **kw), F)
                    print(f"    {label}: outputs equal to one chunk per CTA: {same}", flush=True)
            cfd = dataclasses.replace(cf, wy_inverse="dense")  # HopperTuning.wy_inverse="dense"
            if wanted("fwd WY, dense inv."):
                line("fwd WY, dense inv.", lambda A: wy_fwd(cfd, A), F)
            for prec in ("bf16x3", "bf16", "bf16_blocks"):  # HopperTuning.wy_precision
                cfp = dataclasses.replace(cf, wy_precision=prec)
                for label, kw in ((f"fwd WY {prec} rounds", {}), (f"fwd WY + T {prec} rounds", dict(save_t=True))):
                    if wanted(label):
                        line(label, lambda A, kw=kw, cfp=cfp: wy_fwd(cfp, A, **kw), F)
            cfc = dataclasses.replace(cf, wy_compact=True)  # HopperTuning.wy_compact=True
            for label, kw in (("fwd WY compact", {}), ("fwd WY + T compact", dict(save_t=True))):
                if wanted(label) and HP.wy_compact(cfc):
                    line(label, lambda A, kw=kw: wy_fwd(cfc, A, **kw), F)
                    # the same values as the separate layout, bit for bit (every output array)
                    cs = dataclasses.replace(cf, wy_compact=False)
                    same = bit_equal(lambda A, kw=kw: wy_fwd(cfc, A, **kw), lambda A, kw=kw: wy_fwd(cs, A, **kw), F)
                    print(f"    {label}: outputs equal to the separate layout's: {same}", flush=True)

            def state_pass(c, A, **kw):
                return HS.forward_states_and_output(c, A["w"], A["u"], A["k"], A["ekd"], A["dec"], A["h0"], A["fl"],
                                                    A["q"], A["eg"], A["aqk"], **kw)

            blocks = [cf.bv_mosaic] + [int(b) for b in args.blocks.split(",") if b and int(b) != cf.bv_mosaic]
            for bv in blocks:
                c2 = dataclasses.replace(cf, bv_mosaic=bv)
                if wanted(f"fwd state pass bv{bv}"):
                    line(f"fwd state pass bv{bv}", lambda A, c2=c2: state_pass(c2, A), F)
            cf1 = dataclasses.replace(cf, state_prod=False)  # the one-warpgroup pass (state_producer=False)
            if wanted("fwd state pass 1 WG") and cf.state_prod and HP.fwd_covers(cf1) is None:
                line("fwd state pass 1 WG", lambda A: state_pass(cf1, A), F)
            if wanted("fwd state pass + h, Vn"):  # HopperTuning.save_states
                line("fwd state pass + h, Vn", lambda A: state_pass(cf, A, save_states=True), F)
            for label, kw in (("fwd state pass own barriers", {}), ("fwd state pass + h, Vn own barriers",
                                                                     dict(save_states=True))):
                if wanted(label) and wu and cnb is not None:
                    line(label, lambda A, kw=kw: state_pass(cnb, A, **kw), F)
                    line(label.replace("own", "auto"), lambda A, kw=kw: state_pass(cab, A, **kw), F)
                    same = bit_equal(lambda A, kw=kw: state_pass(cnb, A, **kw),
                                     lambda A, kw=kw: state_pass(cab, A, **kw), F)
                    print(f"    {label}: outputs equal to the automatic barriers': {same}", flush=True)
            cl = dataclasses.replace(cf, late_o=True)  # HopperTuning.late_o_store
            for label, kw in (("fwd state pass late o", {}), ("fwd state pass + h, Vn late o", dict(save_states=True))):
                if wanted(label) and wu:
                    line(label, lambda A, kw=kw: state_pass(cl, A, **kw), F)
            # HopperTuning.state_producer / state_warpgroups / state_slots: the warp-specialised state
            # pass ("ws NxD": N compute warpgroups, D TMA slots), against the one-warpgroup pass's values
            for nc, D in ((1, 2), (1, 3), (2, 2)):
                for label, kw in ((f"fwd state pass ws {nc}x{D}", {}),
                                  (f"fwd state pass + h, Vn ws {nc}x{D}", dict(save_states=True))):
                    cw = dataclasses.replace(cf, state_prod=True, state_wgs=nc, state_slots=D)
                    if not wanted(label) or not wu or HP.fwd_covers(cw) is not None:
                        continue
                    line(label, lambda A, cw=cw, kw=kw: state_pass(cw, A, **kw), F)
                    same = bit_equal(lambda A, cw=cw, kw=kw: state_pass(cw, A, **kw),
                                     lambda A, kw=kw: state_pass(cf1, A, **kw), F)
                    print(f"    {label}: outputs equal to the one-warpgroup pass: {same}", flush=True)
            # HopperTuning.fwd_form="transition" (K = 64): the state chain as one wgmma group per chunk
            # (S' = e^{gamma_C} S + K~^T U + M S, M formed a chunk ahead in the pass); against the pass above
            ctr = dataclasses.replace(cf, fwd_form="transition", state_prod=False)
            if (any(wanted(lb) for lb in ("fwd state transition", "fwd state transition + h, Vn"))
                    and wu and importlib.util.find_spec("gdn_jax.ops.pallas.hopper.transition")
                    and HP.fwd_covers(ctr) is None):
                from gdn_jax.ops.pallas.hopper import transition as HT

                def state_tr(A, **kw):
                    return HT.forward_states_transition(ctr, A["w"], A["u"], A["k"], A["ekd"], A["dec"], A["h0"],
                                                        A["fl"], A["q"], A["eg"], A["aqk"], **kw)

                for label, kw in (("fwd state transition", {}), ("fwd state transition + h, Vn", dict(save_states=True))):
                    if wanted(label):
                        line(label, lambda A, kw=kw: state_tr(A, **kw), F)
                a, b_ = jax.jit(state_tr)(F), jax.jit(lambda A: state_pass(cf, A))(F)
                rel = {key: float(jnp.sqrt(jnp.mean((a[key].astype(jnp.float32) - b_[key].astype(jnp.float32)) ** 2)
                                           / jnp.mean(b_[key].astype(jnp.float32) ** 2))) for key in ("o", "final")}
                print(f"    transition vs default pass rel_rms: o {rel['o']:.1e}  final {rel['final']:.1e}", flush=True)
            # HopperTuning.fwd_form="t": the WY kernel writes T (no v read, no U), the state pass forms Vn
            ct = dataclasses.replace(cf, fwd_form="t")
            extra_t = [f"fwd state T-form bv{b}" for b in args.blocks.split(",") if b]
            if any(wanted(lb) for lb in ["fwd WY T-form", "fwd WY T-form + W", "fwd state T-form",
                                         "fwd state T-form + h, Vn"] + extra_t):
                Ft = dict(F, **{"t_" + key: val for key, val in jax.jit(
                    lambda A: wy_fwd(ct, A, t_form=True))(F).items()})
                for label, kw in (("fwd WY T-form", {}), ("fwd WY T-form + W", dict(with_w=True))):
                    if wanted(label):
                        line(label, lambda A, kw=kw: wy_fwd(ct, A, t_form=True, **kw), F)

                def state_t(A, **kw):
                    return HS.forward_states_and_output(ct, None, None, A["k"], A["ekd"], A["dec"], A["h0"], A["fl"],
                                                        A["q"], A["eg"], A["t_aqk"], v=A["v"],
                                                        t=(A["t_t_hi"], A["t_t_lo"]), beta=A["beta"], **kw)

                for label, kw in (("fwd state T-form", {}), ("fwd state T-form + h, Vn", dict(save_states=True))):
                    if wanted(label):
                        line(label, lambda A, kw=kw: state_t(A, **kw), Ft)
                for bv in [int(b) for b in args.blocks.split(",") if b and int(b) != ct.bv_mosaic]:
                    cbv = dataclasses.replace(ct, bv_mosaic=bv)
                    if wanted(f"fwd state T-form bv{bv}") and HP.smem_bytes(cbv, bv) <= HP.SMEM_BYTES:
                        line(f"fwd state T-form bv{bv}", lambda A, cbv=cbv: HS.forward_states_and_output(
                            cbv, None, None, A["k"], A["ekd"], A["dec"], A["h0"], A["fl"], A["q"], A["eg"], A["t_aqk"],
                            v=A["v"], t=(A["t_t_hi"], A["t_t_lo"]), beta=A["beta"]), Ft)
            cb, bargs = prep.kernel_args("bwd")
            Bk = dict(zip(names, bargs))
            if prep.paths[1] == "hopper":
                pad = cb.Tp - x["do"].shape[1]  # the kernels' time axis: T padded to whole chunks
                Bk.update(do=jnp.pad(x["do"], ((0, 0), (0, pad), (0, 0), (0, 0))),
                          dfin=jnp.zeros(Bk["h0"].shape, jnp.float32))
                wy_bwd = lambda A: HW.wy_backward(cb, A["q"], A["k"], A["v"], A["do"], A["beta"], A["gc"], A["eg"])
                recompute_c = lambda c, A: HS.recompute_states(c, A["w"], A["u"], A["k"], A["ekd"], A["dec"], A["h0"],
                                                               A["fl"])
                recompute = lambda A: recompute_c(cb, A)
                reverse = lambda A: HR.reverse_states(cb, A["q"], A["k"], A["w"], A["dvl"], A["do"], A["eg"],
                                                      A["ekd"], A["dec"], A["dfin"], A["h"], A["fl"])

                def grads(c, A):
                    return HG.chunk_grads(c, A["q"], A["k"], A["v"], A["do"], A["beta"], A["gc"], A["eg"], A["ekd"],
                                          A["h"], A["dh"], A["vn"], A["dvn"], A["t_hi"], A["t_lo"])

                Bk.update(jax.jit(wy_bwd)(Bk))  # w, u, dvl, t_hi, t_lo
                Bk.update(jax.jit(recompute)(Bk))  # h, vn
                Bk.update(jax.jit(reverse)(Bk))  # dh, dvn, dh0, de_gam_last
                c1w = dataclasses.replace(cb, grad_wgs=1)  # HopperTuning.grad_warpgroups=1 (the default is 2)
                cgp = dataclasses.replace(cb, grad_precision="bf16x3")  # HopperTuning.grad_precision="bf16x3" (the default is bf16)
                steps = [("bwd WY", wy_bwd), ("bwd recompute", recompute), ("bwd reverse pass", reverse),
                         ("bwd gradient kernel", lambda A: grads(cb, A)), ("bwd grads, 1 WG", lambda A: grads(c1w, A)),
                         ("bwd grads bf16x3 T phase", lambda A: grads(cgp, A)),
                         ("bwd grads approx", lambda A: grads(dataclasses.replace(cb, approx_math=True), A)),
                         ("bwd grads chain dA", lambda A: grads(dataclasses.replace(cb, grad_tp="chain"), A))]
                cr1 = dataclasses.replace(cb, rev_prod=False)  # HopperTuning.reverse_producer=False (default True)
                steps.append(("bwd reverse pass 1 WG", lambda A: HR.reverse_states(
                    cr1, A["q"], A["k"], A["w"], A["dvl"], A["do"], A["eg"], A["ekd"], A["dec"], A["dfin"], A["h"],
                    A["fl"])))
                for nc, D in ((1, 2), (1, 3), (2, 2)):  # HopperTuning.state_producer: the recompute warp-specialised
                    cw = dataclasses.replace(cb, state_prod=True, state_wgs=nc, state_slots=D)
                    if HP.fwd_covers(cw) is None:
                        steps.append((f"bwd recompute ws {nc}x{D}", lambda A, cw=cw: recompute_c(cw, A)))
                for m in grad_chunks_per_cta(cb.n, cb.BH):  # HopperVariants.grad_chunks_per_cta: the persistent gradient kernel
                    cm = dataclasses.replace(cb, grad_per_cta=m)
                    steps.append((f"bwd grads {m} per CTA", lambda A, cm=cm: grads(cm, A)))
                if cb.C == cf.C:  # HopperTuning.save_wy: the backward's WY from the forward's Aqk and T
                    sv = jax.jit(lambda A: wy_fwd(cb, A, save_t=True))(Bk)
                    Bk.update(aqk=sv["aqk"], sv_t_hi=sv["t_hi"], sv_t_lo=sv["t_lo"])
                    steps[1:1] = [
                        ("bwd WY from saved", lambda A: HW.wy_from_saved(cb, A["k"], A["v"], A["do"], A["beta"],
                                                                         A["eg"], A["aqk"], A["sv_t_hi"],
                                                                         A["sv_t_lo"])),
                        ("bwd reverse, own dVl", lambda A: HR.reverse_states(  # HopperTuning.save_states
                            cb, A["q"], A["k"], A["w"], None, A["do"], A["eg"], A["ekd"], A["dec"], A["dfin"], A["h"],
                            A["fl"], aqk=A["aqk"]))]
                    steps.insert(0, ("fwd WY + T (save_wy)", lambda A: wy_fwd(cb, A, save_t=True)))
                for name, fn in [s for s in steps if wanted(s[0])]:
                    line(name, fn, Bk)
                cnbg, cabg = barriers(cb, True), barriers(cb, False)  # HopperTuning.auto_barriers False / True
                if wanted("bwd grads own barriers") and cnbg is not None:
                    line("bwd grads own barriers", lambda A: grads(cnbg, A), Bk)
                    line("bwd grads auto barriers", lambda A: grads(cabg, A), Bk)
                    same = bit_equal(lambda A: grads(cnbg, A), lambda A: grads(cabg, A), Bk)
                    print(f"    bwd grads own barriers: outputs equal to the automatic barriers': {same}", flush=True)
                if wanted("bwd WY from saved own barriers") and cnbg is not None and "aqk" in Bk:
                    def saved_of(c):
                        return lambda A: HW.wy_from_saved(c, A["k"], A["v"], A["do"], A["beta"], A["eg"], A["aqk"],
                                                          A["sv_t_hi"], A["sv_t_lo"])
                    line("bwd WY from saved own barriers", saved_of(cnbg), Bk)
                    line("bwd WY from saved auto barriers", saved_of(cabg), Bk)
                    same = bit_equal(saved_of(cnbg), saved_of(cabg), Bk)
                    print(f"    bwd WY from saved own barriers: outputs equal to the automatic barriers': {same}",
                          flush=True)
                if wanted("bwd reverse own barriers") and cnbg is not None:  # the default's form
                    own = "aqk" in Bk  # save_states: the reverse pass forms dVl itself

                    def rev_of(c):
                        return lambda A: HR.reverse_states(c, A["q"], A["k"], A["w"], None if own else A["dvl"],
                                                           A["do"], A["eg"], A["ekd"], A["dec"], A["dfin"], A["h"],
                                                           A["fl"], aqk=A["aqk"] if own else None)
                    line("bwd reverse own barriers", rev_of(cnbg), Bk)
                    line("bwd reverse auto barriers", rev_of(cabg), Bk)
                    same = bit_equal(rev_of(cnbg), rev_of(cabg), Bk)
                    print(f"    bwd reverse own barriers: outputs equal to the automatic barriers': {same}", flush=True)
                if wanted("bwd reverse pass 1 WG") and cb.rev_prod:  # the same values, bit for bit
                    same = bit_equal(reverse, dict(steps)["bwd reverse pass 1 WG"], Bk)
                    print(f"    bwd reverse pass (warp-specialised): outputs equal to the one-warpgroup pass: {same}",
                          flush=True)
            else:
                print("  backward not on the Hopper kernels:", HP.bwd_covers(cb) or "not an sm_90 GPU", flush=True)
                if prep.paths[0].startswith("hopper") and cf.K > 128:
                    # K = 256: the Triton backward's stages at its own chunk, and the Hopper reverse
                    # pass at K = 256 (single q, k, W tiles; built, not wired) on the Hopper forward's
                    # residuals at chunk 64 -- what a D = 256 Hopper backward would replace
                    pad_b = cb.Tp - x["do"].shape[1]
                    do_b = jnp.pad(x["do"], ((0, 0), (0, pad_b), (0, 0), (0, 0)))
                    if cb.layout != "bthd":
                        do_b = jnp.moveaxis(do_b, 2, 1).reshape(cb.BH, -1, cb.V)
                    if any(wanted(f"{nm} [triton]") for nm in ("bwd WY (+dVl)", "bwd local grads")):
                        print(f"  the Triton backward's kernels at its chunk {cb.C} (each printed as it is timed):",
                              flush=True)

                        def row(nm, ms, mb, gbs):
                            if wanted(f"{nm} [triton]"):
                                print(f"  {nm + ' [triton]':<22} {ms:.3f} ms  [{mb:.0f} MB, {gbs:.0f} GB/s]", flush=True)
                        bp._bwd_steps(prep, do_b, args.reps, on_row=row)
                    if any(wanted(nm) for nm in ("bwd reverse K256 [hopper]", "bwd grads K256 [xla]",
                                                 "bwd grads K256 [hopper blocks]")):
                        fa = (F["q"], F["k"], F["v"], F["beta"], F["gc"], F["gr"], F["eg"], F["ekd"], F["dec"],
                              F["h0"], F["fl"])
                        _, _, sv = jax.jit(lambda *a: V.forward(cf, *a, save_wy=True, save_states=True, path=prep.paths[0]))(*fa)
                        pad_f = cf.Tp - x["do"].shape[1]
                        R = dict(F, **sv, do=jnp.pad(x["do"], ((0, 0), (0, pad_f), (0, 0), (0, 0))),
                                 dfin=jnp.zeros(F["h0"].shape, jnp.float32))
                        rev = lambda A: HR.reverse_states(cf, A["q"], A["k"], A["w"], None, A["do"], A["eg"], A["ekd"],
                                                          A["dec"], A["dfin"], A["h"], A["fl"], aqk=A["aqk"])
                        if wanted("bwd reverse K256 [hopper]"):  # HopperTuning.wide_backward="hopper_xla"'s two stages
                            line("bwd reverse K256 [hopper]", rev, R)
                        if wanted("bwd grads K256 [xla]") or wanted("bwd grads K256 [hopper blocks]"):
                            from gdn_jax.ops.pallas.grads_xla import chunk_grads_xla

                            R.update({key: val for key, val in jax.jit(rev)(R).items() if key in ("dh", "dvn")})
                            ga = lambda A: (A["q"], A["k"], A["v"], A["do"], A["beta"], A["gc"], A["eg"], A["ekd"],
                                            A["h"], A["dh"], A["vn"], A["dvn"], A["t_hi"], A["t_lo"])
                            if wanted("bwd grads K256 [xla]"):  # HopperTuning.wide_backward="hopper_xla"
                                line("bwd grads K256 [xla]", lambda A: chunk_grads_xla(cf, *ga(A)), R)
                            if wanted("bwd grads K256 [hopper blocks]") and hasattr(HG, "chunk_grads_blocks"):
                                line("bwd grads K256 [hopper blocks]",  # wide_backward="hopper"
                                     lambda A: HG.chunk_grads_blocks(cf, *ga(A)), R)
            whole = [("pallas", KC()), ("dense inv", KC(wy_inverse="dense")), ("wy compact", KC(wy_compact=True)), ("wy separate", KC(wy_compact=False)),
                     ("wy bf16x3", KC(wy_precision="bf16x3")),
                     ("wy bf16", KC(wy_precision="bf16")), ("wy bf16 compact", KC(wy_precision="bf16", wy_compact=True)),
                     ("wy bf16_blocks compact", KC(wy_precision="bf16_blocks", wy_compact=True)),
                     ("grads bf16x3", KC(grad_precision="bf16x3")), ("fwd form t", KC(fwd_form="t")), ("fwd form wu", KC(fwd_form="wu")),
                     *([("fwd form transition", KC(fwd_form="transition", state_producer=False))]
                       if importlib.util.find_spec("gdn_jax.ops.pallas.hopper.transition") else []),
                     ("approx math", KC(approx_math=True)),
                     *([("wide hopper_xla", KC(wide_backward="hopper_xla")), ("wide hopper", KC(wide_backward="hopper"))]
                       if has("wide_backward") else []),
                     *([("own barriers", KC(auto_barriers=False)), ("auto barriers", KC(auto_barriers=True))]
                       if has("auto_barriers") else []),
                     ("wy 4 per CTA", KC(wy_chunks_per_cta=4)),
                     ("late o", KC(late_o_store=True)),
                     ("approx, wy 4, late o", KC(approx_math=True, wy_chunks_per_cta=4, late_o_store=True)),
                     ("no save_wy", KC(save_wy=False)),
                     ("producer 1x2", KC(state_producer=True)), ("producer 1x3", KC(state_producer=True, state_slots=3)),
                     ("producer 2x2", KC(state_producer=True, state_warpgroups=2)),
                     ("reverse 1 WG", KC(reverse_producer=False)),
                     ("no producers", KC(state_producer=False, reverse_producer=False)),
                     ("grads 1 WG", KC(grad_warpgroups=1)), ("grads chain dA", KC(grad_t_phase="chain")), ("no save states", KC(save_states=False))]
            whole += [(f"grads {m} per CTA", KC(grad_chunks_per_cta=m)) for m in grad_chunks_per_cta(cb.n, cb.BH)]
            for label, kc in whole:
                if not wanted(label):
                    continue
                f, fb = bp.jax_fns("pallas", x, 64, kc)
                print(f"  {label:<10} fwd {t(f)}  fwd+bwd {t(fb)}{'' if args.once else ' ms'}", flush=True)
                if args.timeline:
                    print(f"    timeline {label} fwd+bwd: {timeline(fb, args.timeline)}", flush=True)
            if not (args.no_jla or args.interpret) and wanted("jla"):
                try:
                    jf, jfb, _ = bp.jla_fns(x)
                    print(f"  jla    fwd {t(jf)}  fwd+bwd {t(jfb)} ms", flush=True)
                    if args.timeline:
                        print(f"    timeline jla fwd+bwd: {timeline(jfb, args.timeline)}", flush=True)
                except Exception as e:  # not installed / fails: say so, keep going
                    print(f"  jla: {type(e).__name__}: {str(e)[:200]}", flush=True)
        except Exception:  # one shape failing does not stop the others; the exit status says so
            traceback.print_exc()
            failed.append(shape)
    if failed:
        raise SystemExit(f"bench_hopper_stages.py: {len(failed)} shape(s) failed (tracebacks above): {failed}")


if __name__ == "__main__":
    main()
