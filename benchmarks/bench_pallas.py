"""Benchmark of ``backend="pallas"`` against ``backend="chunk"``, FLA and jax-linear-attention.

One invocation does everything device minutes allow: for each anchor shape
(B, T, H, D), bf16 inputs made as the anchors were measured (k L2-normalised, g = logsigmoid(N(0,1))/4,
beta = sigmoid(N(0,1)); q ~ N(0,1), default scale D^-1/2):

1. numerics: pallas vs chunk (rel. rms of o and of dq, dk, dv, dg, dbeta) and vs FLA's o;
2. timings, forward and forward+backward (a scalar function of o: sum(o * do), through
   ``jax.value_and_grad``: with ``jax.grad`` alone the loss value is dead, XLA drops the
   custom_vjp's forward kernels and "fwd+bwd" times the backward only -- as the pallas and
   jax-linear-attention rows of the results/bench_pallas_h200 files up to bench_d256_ksplit
   did; FLA's row always ran its forward), jitted,
   ``block_until_ready``, warm-up, median of ``--reps`` (>= 20) runs, for pallas, chunk, and
   when importable FLA (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, torch,
   ``torch.cuda.synchronize``) and jax-linear-attention (``jla.ops.linear_attention``);
3. a per-kernel breakdown of pallas (each ``pallas_call`` timed alone on its real inputs,
   with its HBM bytes and achieved GB/s) -- to see where the time goes;
4. ``--variants``: the same pallas timings under other kernel settings, e.g.
   ``--variants bv_state=64 warps_grad=4,bv_grad=128 chunk=32`` (keys: the fields of
   ``gdn_jax.ops.KernelConfig`` and ``chunk``; one variant per argument,
   ``,``-separated settings; timed after FLA / jax-linear-attention and the breakdown, so that a
   run cut short by a time limit still has those).

The compact table (ms and ratios vs chunk, vs the anchors, vs FLA) is the LAST output.

Usage:  python benchmarks/bench_pallas.py [--quick] [--shapes 0,2 | 4x4096x16x128,...]
        [--reps 25] [--variants ...] [--no-fla] [--no-jla] [--no-breakdown]
On a machine without a GPU it runs tiny shapes in interpret mode (a smoke test of the script).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# leave GPU memory for torch (FLA) next to JAX's preallocation
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from gdn_jax.ops import KernelConfig, gated_delta_rule  # noqa: E402
from gdn_jax.ops import pallas as P  # noqa: E402
from gdn_jax.ops.pallas.config import FLAT_NAMES, from_flat_names  # noqa: E402
from gdn_jax.ops.pallas.hopper import grads as HG, state_bwd as HR, state_fwd as HS, wy as HW  # noqa: E402
from gdn_jax.ops.pallas.grads import chunk_grads  # noqa: E402
from gdn_jax.ops.pallas.state_bwd import reverse_states  # noqa: E402
from gdn_jax.ops.pallas.state_fwd import forward_states, forward_states_and_output, output  # noqa: E402
from gdn_jax.ops.pallas.wy import wy_repr  # noqa: E402

# Measured anchors (H200, bf16, medians; results/hopper_h200/HISTORY.md "GPU numbers"):
# shape -> {impl: (fwd ms, fwd+bwd ms)}
ANCHORS = {
    (4, 4096, 16, 128): {"fla": (0.725, 2.643), "jla": (0.324, 1.233), "chunk": (4.260, 12.581)},
    (8, 2048, 16, 128): {"fla": (0.599, 2.619), "jla": (0.302, 1.088), "chunk": (3.606, 11.021)},
    (1, 16384, 16, 128): {"fla": (0.917, 3.386), "jla": (0.446, 1.570), "chunk": (6.661, 24.322)},
    (2, 8192, 16, 64): {"fla": (0.523, 2.262), "jla": (0.364, 0.837), "chunk": (3.537, 12.297)},
    (2, 8192, 8, 256): {"fla": (0.773, 3.922), "jla": (0.572, 2.543), "chunk": (4.915, 17.061)},
}
SHAPES = list(ANCHORS)
TINY = [(1, 80, 2, 32), (2, 64, 2, 16)]  # CPU smoke test


def log(*a):
    print(*a, flush=True)


def rel_rms(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    d = np.sqrt(np.mean(b**2))
    return float(np.sqrt(np.mean((a - b) ** 2)) / d) if d > 0 else float("nan")


def to_np(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


# ---------------------------------------------------------------------------
# inputs and timing
# ---------------------------------------------------------------------------


def make_inputs(shape, seed=0):
    B, T, H, D = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, D), np.float32)
    k = rng.standard_normal((B, T, H, D), np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, H, D), np.float32)
    g = (-np.logaddexp(0.0, -rng.standard_normal((B, T, H)))).astype(np.float32) / 4.0
    beta = (1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H))))).astype(np.float32)
    do = rng.standard_normal((B, T, H, D), np.float32)
    bf = jnp.bfloat16
    return dict(q=jnp.asarray(q, bf), k=jnp.asarray(k, bf), v=jnp.asarray(v, bf), g=jnp.asarray(g, jnp.float32),
                beta=jnp.asarray(beta, bf), do=jnp.asarray(do, bf))


def time_fn(fn, reps, warmup=3, sync=None):
    """Median wall time (ms) of fn() over reps runs after warm-up; fn's result is synchronised."""
    sync = sync or jax.block_until_ready
    for _ in range(warmup):
        sync(fn())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sync(fn())
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def time_fn_pipelined(fn, reps, warmup=3, sync=None):
    """ms per call of ``reps`` back-to-back launches and one synchronisation (median of 5): the
    device time when a launch is shorter than the work, without the per-call dispatch + sync
    latency that :func:`time_fn` includes."""
    sync = sync or jax.block_until_ready
    for _ in range(warmup):
        sync(fn())
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            r = fn()
        sync(r)
        ts.append((time.perf_counter() - t0) * 1e3 / reps)
    return statistics.median(ts)


def fwd_flops(shape, C=64):
    """Forward FLOP by REFERENCE §5's count (4.72e10 at B4 T4096 H16 D128): per chunk and head,
    K K^T, Q K^T, W = T K, U = T V, Aqk Vn (2 C^2 D each) and W S, Q S, K^T Vn (2 C D^2 each);
    the triangular inverse is not counted."""
    B, T, H, D = shape
    return B * H * (T // C) * (5 * 2 * C * C * D + 3 * 2 * C * D * D)


def floor_ms(shape, direction):
    """Lower bound in ms: max(matmul FLOP at 790 TFLOP/s, HBM bytes at 4.3 TB/s); forward: q, k, v
    read, o written (bf16); forward+backward: 3x the forward FLOP, q, k, v, do read and o, dq,
    dk, dv written."""
    B, T, H, D = shape
    fl = fwd_flops(shape) * (1 if direction == "fwd" else 3)
    by = (4 if direction == "fwd" else 8) * B * T * H * D * 2
    return max(fl / 790e12, by / 4.3e12) * 1e3


def jax_fns(backend, x, chunk, kernel_config=None):
    """(fwd, fwd+bwd) jitted closures for a gdn_jax backend (pallas: with ``kernel_config``)."""
    def fwd(q, k, v, g, beta):
        return gated_delta_rule(q, k, v, g, beta, backend=backend, chunk_size=chunk, kernel_config=kernel_config)[0]

    def loss(q, k, v, g, beta, do):
        return jnp.sum(fwd(q, k, v, g, beta).astype(jnp.float32) * do.astype(jnp.float32))

    f = jax.jit(fwd)
    fb = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    a = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    return (lambda: f(*a)), (lambda: fb(*a, x["do"]))


# ---------------------------------------------------------------------------
# external implementations (black boxes)
# ---------------------------------------------------------------------------


def fla_fns(x):
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    dev = "cuda"
    t = lambda a, dt: torch.from_numpy(np.asarray(jnp.asarray(a).astype(jnp.float32))).to(dev, dt)
    q, k, v = (t(x[n], torch.bfloat16) for n in ("q", "k", "v"))
    g = t(x["g"], torch.float32)
    beta = t(x["beta"], torch.bfloat16)
    do = t(x["do"], torch.bfloat16)

    def fwd():
        with torch.no_grad():
            return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False)[0]

    leaves = [a.detach().clone().requires_grad_(True) for a in (q, k, v, g, beta)]

    def fb():
        for a in leaves:
            a.grad = None
        o = chunk_gated_delta_rule(*leaves, initial_state=None, output_final_state=False)[0]
        o.backward(do)
        return o

    note = ""
    try:
        fb()
    except Exception as e:  # FLA 0.6.0 refuses its gated backward on Hopper with Triton < 3.7.1
        try:
            import fla.ops.common.chunk_o as co

            co.TRITON_ABOVE_3_7_1 = True
            fb()
            note = "bwd guard overridden (grads unverified)"
        except Exception:
            note = f"bwd failed: {type(e).__name__}: {str(e)[:80]}"
            fb = None
    sync = lambda r: torch.cuda.synchronize()
    o = fwd().float().cpu().numpy()
    return fwd, fb, sync, o, note


def jla_fns(x):
    from jla import ops

    def fwd(q, k, v, g, beta):
        return ops.linear_attention("gated_deltanet", q, k, v, g=g, beta=beta, impl="auto")[0]

    def loss(q, k, v, g, beta, do):
        return jnp.sum(fwd(q, k, v, g, beta).astype(jnp.float32) * do.astype(jnp.float32))

    f = jax.jit(fwd)
    fb = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    a = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    return (lambda: f(*a)), (lambda: fb(*a, x["do"])), np.asarray(f(*a).astype(jnp.float32))


# ---------------------------------------------------------------------------
# per-kernel breakdown of backend="pallas"
# ---------------------------------------------------------------------------


def _nbytes(*xs):
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(xs))


def kernel_breakdown(x, chunk, reps, config=KernelConfig()):
    """Time each pallas_call of forward and backward alone (the Hopper kernels where ``config``
    takes them). Returns ((forward call, backward call), rows (name, ms, MB, GB/s), number of
    forward rows)."""
    prep = P.to_kernel_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=chunk, config=config)
    cf = prep.calls[0]
    do_l = x["do"] if cf.layout == "bthd" else jnp.moveaxis(x["do"], 2, 1).reshape(cf.BH, -1, cf.V)
    pad = cf.Tp - x["do"].shape[1]
    if pad:
        do_l = jnp.pad(do_l, [(0, 0), (0, pad)] + [(0, 0)] * (do_l.ndim - 2))
    fwd = _fwd_steps(prep, reps)
    return prep.calls, fwd + _bwd_steps(prep, do_l, reps), len(fwd)


def _fwd_steps(prep, reps):
    """Forward kernels at the forward chunking (each stage's inputs computed once, untimed)."""
    cfg, (q, k, v, beta, gc, gr, eg, ekd, dec, h0, info) = prep.kernel_args("fwd")
    if prep.paths[0].startswith("hopper"):  # a Hopper (Mosaic GPU) forward path
        names = ["fwd WY (W, U, Aqk) [hopper]", "fwd state pass + output [hopper]"]
        wy = jax.jit(lambda: HW.wy_forward(cfg, q, k, v, beta, gc, eg))()
        fns = [lambda: HW.wy_forward(cfg, q, k, v, beta, gc, eg),
               lambda: HS.forward_states_and_output(cfg, wy["w"], wy["u"], k, ekd, dec, h0, info, q, eg, wy["aqk"])]
    elif cfg.fuse_output:
        names = ["fwd WY (W, U, Aqk)", "fwd state pass + output"]
        wy = jax.jit(lambda: wy_repr(cfg, k, v, beta, gc, gr, eg, q=q))()
        fns = [lambda: wy_repr(cfg, k, v, beta, gc, gr, eg, q=q),
               lambda: forward_states_and_output(cfg, wy["w"], wy["u"], k, ekd, dec, h0, info, q, eg, wy["aqk"])]
    else:
        names = ["fwd WY (A, T, W, U)", "fwd state pass", "fwd output"]
        wy = jax.jit(lambda: wy_repr(cfg, k, v, beta, gc, gr, eg))()
        st = jax.jit(lambda: forward_states(cfg, wy["w"], wy["u"], k, ekd, dec, h0, info))()
        fns = [lambda: wy_repr(cfg, k, v, beta, gc, gr, eg),
               lambda: forward_states(cfg, wy["w"], wy["u"], k, ekd, dec, h0, info),
               lambda: output(cfg, q, k, gc, gr, eg, st["h"], st["vn"])]
    return _time_steps(cfg, list(zip(names, fns)), reps)


def _bwd_steps(prep, do_l, reps, on_row=None):
    """Backward kernels at the backward chunking (``on_row(name, ms, mb, gbs)`` as each is timed)."""
    cfg, (q, k, v, beta, gc, gr, eg, ekd, dec, h0, info) = prep.kernel_args("bwd")
    dfin = jnp.zeros(h0.shape, jnp.float32)
    if prep.paths[1] == "hopper":  # the Hopper (Mosaic GPU) backward
        wy = jax.jit(lambda: HW.wy_backward(cfg, q, k, v, do_l, beta, gc, eg))()
        st = jax.jit(lambda: HS.recompute_states(cfg, wy["w"], wy["u"], k, ekd, dec, h0, info))()
        rs = jax.jit(lambda: HR.reverse_states(cfg, q, k, wy["w"], wy["dvl"], do_l, eg, ekd, dec, dfin, st["h"],
                                               info))()
        steps = [
            ("bwd WY (+dVl, T) [hopper]", lambda: HW.wy_backward(cfg, q, k, v, do_l, beta, gc, eg)),
            ("bwd recompute h [hopper]", lambda: HS.recompute_states(cfg, wy["w"], wy["u"], k, ekd, dec, h0, info)),
            ("bwd reverse state pass [hopper]", lambda: HR.reverse_states(cfg, q, k, wy["w"], wy["dvl"], do_l, eg, ekd,
                                                                         dec, dfin, st["h"], info)),
            ("bwd local grads [hopper]", lambda: HG.chunk_grads(cfg, q, k, v, do_l, beta, gc, eg, ekd, st["h"], rs["dh"],
                                                                st["vn"], rs["dvn"], wy["t_hi"], wy["t_lo"])),
        ]
        return _time_steps(cfg, steps, reps, on_row)
    wy = jax.jit(lambda: wy_repr(cfg, k, v, beta, gc, gr, eg, q=q, do=do_l))()
    w, u, dvl, t = wy["w"], wy["u"], wy["dvl"], wy.get("t")
    st = jax.jit(lambda: forward_states(cfg, w, u, k, ekd, dec, h0, info))()
    rs = jax.jit(lambda: reverse_states(cfg, q, k, w, dvl, do_l, eg, ekd, dec, dfin, info))()
    steps = [
        ("bwd WY (+dVl)", lambda: wy_repr(cfg, k, v, beta, gc, gr, eg, q=q, do=do_l)),
        ("bwd state pass (recompute h)", lambda: forward_states(cfg, w, u, k, ekd, dec, h0, info)),
        ("bwd reverse state pass", lambda: reverse_states(cfg, q, k, w, dvl, do_l, eg, ekd, dec, dfin, info)),
        ("bwd local grads", lambda: chunk_grads(cfg, q, k, v, do_l, beta, gc, gr, eg, ekd, st["h"], rs["dh"], st["vn"],
                                                rs["dvn"], t)),
    ]
    return _time_steps(cfg, steps, reps, on_row)


def _time_steps(cfg, steps, reps, on_row=None):
    rows = []
    for name, fn in steps:
        jf = jax.jit(fn)
        out = jf()
        ms = time_fn(jf, reps)
        # bytes: inputs as closed over + outputs (state passes re-read K-wide inputs per V block: not counted)
        mb = (_nbytes(out) + _in_bytes(name, cfg)) / 1e6
        rows.append((name, ms, mb, mb / ms if ms > 0 else float("nan")))
        if on_row is not None:  # as soon as it is timed (a step limit may cut the rest)
            on_row(*rows[-1])
    return rows


def _in_bytes(name, cfg):
    """Rough HBM bytes read by each kernel (token arrays at their dtypes, scalars f32)."""
    BH, Tp, K, V, n = cfg.BH, cfg.Tp, cfg.K, cfg.V, cfg.n
    i = jnp.dtype(cfg.in_dt).itemsize
    m = jnp.dtype(cfg.mid_dt).itemsize
    u = jnp.dtype(cfg.u_dt).itemsize
    tok = lambda d, s: BH * Tp * d * s
    sc = BH * Tp * 4
    hb = BH * n * K * V * m
    o = jnp.dtype(cfg.out_dt).itemsize
    aq = BH * n * cfg.C * cfg.C * o
    name = name.replace(" [hopper]", "").replace("(+dVl, T)", "(+dVl)").replace("bwd recompute h",
                                                                                 "bwd state pass (recompute h)")
    return {
        "fwd WY (W, U, Aqk)": 2 * tok(K, i) + tok(V, i) + 4 * sc,
        "fwd state pass + output": tok(K, m) + tok(V, u) + 2 * tok(K, i) + 3 * sc + aq,
        "fwd WY (A, T, W, U)": tok(K, i) + tok(V, i) + 4 * sc,
        "fwd state pass": tok(K, m) + tok(V, u) + tok(K, i) + 2 * sc,
        "fwd output": 2 * tok(K, i) + 3 * sc + hb + tok(V, m),
        "bwd WY (+dVl)": 2 * tok(K, i) + 2 * tok(V, i) + 4 * sc,
        "bwd state pass (recompute h)": tok(K, m) + tok(V, u) + tok(K, i) + 2 * sc,
        "bwd reverse state pass": 2 * tok(K, i) + tok(K, m) + tok(V, m) + tok(V, i) + 3 * sc,
        "bwd local grads": 2 * tok(K, i) + 2 * tok(V, i) + 6 * sc + 2 * hb + 2 * tok(V, m)
        + (BH * n * cfg.C * cfg.C * 4 if cfg.save_t else 0),
    }[name]


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def parse_shapes(s, on_gpu, flag="--shapes"):
    if not s:
        return SHAPES if on_gpu else TINY
    table = SHAPES if on_gpu else TINY
    out = []
    for tok in s.split(","):
        tok = tok.strip()
        try:
            shape = tuple(int(a) for a in tok.split("x")) if "x" in tok else table[int(tok)]
        except (ValueError, IndexError):
            shape = None
        if shape is None or len(shape) != 4 or min(shape) < 1:
            raise SystemExit(f"{flag}: expected comma-separated BxTxHxD (four positive ints) or an index into "
                             f"the {len(table)} default shapes, got {tok!r}")
        out.append(shape)
    return out


def parse_variant(s):
    kw = {}
    for item in s.split(","):
        key, val = item.split("=")
        key = key.strip()
        val = val.strip()
        try:
            val = int(val)
        except ValueError:
            val = {"none": None, "true": True, "false": False}.get(val.lower(), val)
        kw[key] = val
    fields = {f.name for f in dataclasses.fields(KernelConfig)} | set(FLAT_NAMES) | {"chunk"}
    bad = set(kw) - fields
    if bad:
        raise SystemExit(f"unknown variant keys {sorted(bad)}; known: {sorted(fields)}")
    return kw


def fmt(x, w=7, p=3):
    return f"{x:{w}.{p}f}" if isinstance(x, float) and np.isfinite(x) else f"{'-':>{w}}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="first selected shape only, fewer reps, no breakdown")
    ap.add_argument("--shapes", default="", help="indices into the anchor list or BxTxHxD, comma-separated")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--variants", nargs="*", default=[], help="pallas settings to time too, e.g. bv_state=64,warps_grad=4")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--no-jla", action="store_true")
    ap.add_argument("--no-chunk", action="store_true", help="skip timing backend='chunk' (still used for numerics)")
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--variants-first", action="store_true",
                    help="time the variants right after pallas, before FLA / jla / breakdown (FLA's first "
                         "Triton compile can take minutes on a fresh machine)")
    args = ap.parse_args(argv)
    if args.reps is not None and args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")

    on_gpu = jax.default_backend() == "gpu"
    shapes = parse_shapes(args.shapes, on_gpu)
    reps = args.reps
    if args.quick:
        shapes = shapes[:1]
        reps = min(reps, 10)
    if not on_gpu:
        reps = min(reps, 2)
        args.no_fla = True
    variants = [parse_variant(v) for v in args.variants]
    log(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
    log(f"shapes {shapes}, reps {reps}, chunk {args.chunk}, variants {variants}")

    results = {}  # shape -> list of (label, fwd, fb, note)
    numerics = {}
    breakdowns = {}
    t_start = time.time()
    for shape in shapes:
        log(f"\n=== B,T,H,D = {shape}   (elapsed {time.time() - t_start:.0f} s)")
        x = make_inputs(shape)
        rows = results.setdefault(shape, [])

        def measure(label, mk, sync=None):
            try:
                f, fb = mk()
                tf = time_fn(f, reps, sync=sync)
                tfb = time_fn(fb, reps, sync=sync) if fb is not None else float("nan")
                df = time_fn_pipelined(f, reps, sync=sync)
                dfb = time_fn_pipelined(fb, reps, sync=sync) if fb is not None else float("nan")
                rows.append((label, tf, tfb, "", df, dfb))
                log(f"  {label:<28} fwd {tf:8.3f} ms   fwd+bwd {tfb:8.3f} ms   (pipelined: {df:.3f} / {dfb:.3f} ms)")
            except Exception as e:  # keep going: device minutes are scarce
                rows.append((label, float("nan"), float("nan"), f"{type(e).__name__}", float("nan"), float("nan")))
                log(f"  {label:<28} FAILED: {type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc(limit=3)

        # numerics: pallas vs chunk
        try:
            fp, fbp = jax_fns("pallas", x, args.chunk)
            fc, fbc = jax_fns("chunk", x, args.chunk)
            op, (_, gp) = fp(), fbp()
            oc, (_, gc) = fc(), fbc()
            errs = {"o": rel_rms(to_np(op), to_np(oc))}
            for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), gp, gc):
                errs[n] = rel_rms(to_np(a), to_np(b))
            numerics[shape] = errs
            log("  pallas vs chunk rel_rms: " + "  ".join(f"{k} {v:.1e}" for k, v in errs.items()))
        except Exception as e:
            log(f"  numerics FAILED: {type(e).__name__}: {str(e)[:500]}")
            traceback.print_exc(limit=5)
            op = None

        def time_variants():
            for kw in variants:
                kw = dict(kw)
                explicit = "chunk" in kw
                c = kw.pop("chunk", args.chunk)
                label = "pallas[" + ",".join([f"{k}={v}" for k, v in kw.items()] + ([f"C={c}"] if c != args.chunk else [])) + "]"

                def mk(kw=kw, c=c, explicit=explicit):
                    if explicit:  # an explicit chunk=... variant runs at that chunk, past the per-D caps
                        kw = dict(dict(fwd_chunk=c, bwd_chunk=c), **kw)
                    f, fb = jax_fns("pallas", x, c, kernel_config=from_flat_names(**kw))
                    ov = jax.block_until_ready(f())
                    _, gv = jax.block_until_ready(fb())
                    if shape in numerics:  # the variant's own numerics against chunk, as for pallas
                        e = {"o": rel_rms(to_np(ov), to_np(oc))}
                        e.update({n: rel_rms(to_np(a), to_np(b)) for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), gv, gc)})
                        log(f"  {label} vs chunk rel_rms: " + "  ".join(f"{k} {v:.1e}" for k, v in e.items()))
                    return f, fb

                measure(label, mk)

        measure("pallas", lambda: jax_fns("pallas", x, args.chunk))
        if args.variants_first:
            time_variants()
        if not args.no_chunk:
            measure("chunk (XLA)", lambda: jax_fns("chunk", x, args.chunk))
        if not args.no_fla:
            try:
                ffwd, ffb, fsync, fo, note = fla_fns(x)
                if op is not None:
                    log(f"  FLA o vs pallas o rel_rms {rel_rms(fo, to_np(op)):.1e}")
                measure("FLA" + (f" ({note})" if note else ""), lambda: (ffwd, ffb), sync=fsync)
            except ImportError as e:
                log(f"  FLA not importable: {e}")
            except Exception as e:
                log(f"  FLA FAILED: {type(e).__name__}: {str(e)[:300]}")
        if not args.no_jla:
            try:
                jf, jfb, jo = jla_fns(x)
                if op is not None:
                    log(f"  jla o vs pallas o rel_rms {rel_rms(jo, to_np(op)):.1e}")
                measure("jax-linear-attention", lambda: (jf, jfb))
            except ImportError as e:
                log(f"  jax-linear-attention not importable: {e}")
            except Exception as e:
                log(f"  jax-linear-attention FAILED: {type(e).__name__}: {str(e)[:300]}")
        if not args.no_breakdown and not args.quick:
            try:
                (cfgf, cfg), brows, nfwd = kernel_breakdown(x, args.chunk, reps)
                breakdowns[shape] = brows
                log(f"  per-kernel (cfg: layout {cfg.layout}, C fwd {cfgf.C} / bwd {cfg.C}, bv state/out/grad "
                    f"{cfg.bv_state}/{cfg.bv_out}/{cfg.bv_grad}, grad K blocks {cfg.grad_nk}, mid {cfg.mid_dt}, "
                    f"U {cfg.u_dt}, merged state passes {cfg.merge_state}):")
                for name, ms, mb, gbs in brows:
                    log(f"    {name:<30} {ms:8.3f} ms  {mb:9.1f} MB  {gbs:7.0f} GB/s")
                log(f"    {'sum fwd / bwd kernels':<30} {sum(r[1] for r in brows[:nfwd]):8.3f} / "
                    f"{sum(r[1] for r in brows[nfwd:]):.3f} ms")
            except Exception as e:
                log(f"  breakdown FAILED: {type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc(limit=5)

        if not args.variants_first:
            time_variants()

    # ------------------------------------------------------------------ summary table (last output)
    log("\n" + "=" * 100)
    log("SUMMARY  (ms = median; 'x chunk' = chunk_ms / ms, >1 is faster than the plain XLA chunk;"
        " 'vs FLA' = FLA_ms / ms; anchors = measured H200 numbers, results/hopper_h200/HISTORY.md)")
    log(f"{'shape':<16} {'impl':<40} {'fwd':>7} {'f+b':>7} {'fwd x chunk':>11} {'f+b x chunk':>11} "
        f"{'fwd vs FLA':>10} {'f+b vs FLA':>10}")
    for shape, rows in results.items():
        d = {r[0]: r for r in rows}
        ch = d.get("chunk (XLA)")
        fla = next((r for r in rows if r[0].startswith("FLA")), None)
        anc = ANCHORS.get(shape, {})
        ref_ch = (ch[1], ch[2]) if ch else anc.get("chunk", (float("nan"),) * 2)
        ref_fla = (fla[1], fla[2]) if fla else anc.get("fla", (float("nan"),) * 2)
        sname = "x".join(map(str, shape))
        for label, tf, tfb, note, *_ in rows:
            r = lambda a, b: a / b if (np.isfinite(a) and np.isfinite(b) and b > 0) else float("nan")
            log(f"{sname:<16} {label[:40]:<40} {fmt(tf)} {fmt(tfb)} {fmt(r(ref_ch[0], tf), 11, 2)} "
                f"{fmt(r(ref_ch[1], tfb), 11, 2)} {fmt(r(ref_fla[0], tf), 10, 2)} {fmt(r(ref_fla[1], tfb), 10, 2)}"
                + (f"  {note}" if note else ""))
            sname = ""
        if anc:
            pal = d.get("pallas")
            a = "  ".join(f"{k} {v[0]:.3f}/{v[1]:.3f}" for k, v in anc.items())
            extra = ""
            if pal and np.isfinite(pal[2]):
                extra = "   pallas/anchor f+b: " + "  ".join(f"{k} {pal[2] / v[1]:.2f}" for k, v in anc.items())
            log(f"{'':<16} anchors fwd/f+b: {a}{extra}")
        if shape in numerics:
            log(f"{'':<16} pallas vs chunk rel_rms: " + "  ".join(f"{k} {v:.1e}" for k, v in numerics[shape].items()))
        if "fla" in anc and "pallas" in d:  # the bar: fwd+bwd within 1.5x of FLA's anchor
            bar = 1.5 * anc["fla"][1]
            ok = d["pallas"][2] <= bar
            log(f"{'':<16} BAR fwd+bwd <= 1.5 x FLA anchor = {bar:.2f} ms: {'MET' if ok else 'NOT MET'} "
                f"({d['pallas'][2]:.3f} ms)")
    log("\nDEVICE TIME (pipelined launches), TFLOP/s by REFERENCE §5's count (fwd; fwd+bwd = 3x) and x floor "
        "(max(FLOP / 790 TFLOP/s, bytes / 4.3 TB/s))")
    log(f"{'shape':<16} {'impl':<32} {'fwd ms':>7} {'f+b ms':>7} {'fwd TF/s':>8} {'f+b TF/s':>8} {'fwd xfl':>7} "
        f"{'f+b xfl':>7} {'fwd/jla':>7} {'f+b/jla':>7}")
    for shape, rows in results.items():
        sname = "x".join(map(str, shape))
        fl = fwd_flops(shape)
        jla = next((r for r in rows if r[0].startswith("jax-linear")), None)
        for label, _, _, _, df, dfb in rows:
            q = lambda a, b: a / b if (np.isfinite(a) and np.isfinite(b) and b > 0) else float("nan")
            log(f"{sname:<16} {label[:32]:<32} {fmt(df)} {fmt(dfb)} {fmt(fl / df / 1e9 if df > 0 else float('nan'), 8, 1)} "
                f"{fmt(3 * fl / dfb / 1e9 if dfb > 0 else float('nan'), 8, 1)} {fmt(q(df, floor_ms(shape, 'fwd')), 7, 1)} "
                f"{fmt(q(dfb, floor_ms(shape, 'fb')), 7, 1)} {fmt(q(df, jla[4]) if jla else float('nan'), 7, 2)} "
                f"{fmt(q(dfb, jla[5]) if jla else float('nan'), 7, 2)}")
            sname = ""
    log(f"(total {time.time() - t_start:.0f} s)")
    log("=" * 100)


if __name__ == "__main__":
    main()
