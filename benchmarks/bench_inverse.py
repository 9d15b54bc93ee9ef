"""The gate-free inverse kernel (``gdn_jax.ops.pallas.inverse_gatefree``) timed against the
inverse / WY stage kernels of our forward, at the five shapes of ``bench_pallas.py``.

Per shape (bf16 inputs made as ``bench_pallas.make_inputs`` makes them: unit-norm k, beta =
sigmoid(N(0, 1))), each stage alone on its real inputs, jitted with its arrays as arguments,
pipelined (``bench_pallas.time_fn_pipelined``: warm-up, then 20 calls back to back and one sync,
median of 5 rounds), printing ms, the HBM bytes it reads and writes (inputs as passed + outputs),
GB/s, its time over the HBM floor of those bytes, and its time over the T0 kernel's:

* ``T0 kernel`` in the settings of :data:`T0_VARIANTS` (``--all-variants``: all of them):
  num_warps 1 / 2 / 4 / 8, the diagonal blocks by substitution (default) or by products
  (``diag``), 3-pass or 1-pass TF32 merges (``f32_dot``), a float32 or bfloat16 T0
  (``out_dtype``);
* ``T0 XLA``: the same T0 from plain JAX (:func:`gdn_jax.ops.gatefree.gatefree_t0`, float32);
* ours: the Hopper forward WY kernel (``hopper.wy.wy_forward``: A, T = (I + A)^-1, W, U, Aqk), also
  with ``save_t`` (the forward of a differentiated call also writes T) and in ``fwd_form="t"``
  (T and Aqk, no W, U: the closest to the T0 kernel's work), marked "<- default" where the default
  forward runs that form; and the Triton forward WY (``wy.wy_repr`` with q: W, U, Aqk) at its own
  chunk. A stage that does not take the shape (or whose module moved) prints why and is skipped.

Correctness: every T0 line's output against float64 numpy T0 (numpy's inverse of I + A0 on the
bf16-rounded inputs) on up to ``--check-chunks`` (b, h, chunk) triples, the first and last
included: max |err| and RMS-relative error ("LARGE" above 1e-2: the bf16 T0's rounding is ~4e-3).
On a Hopper GPU also the identity T = T0 * D on the device: the T0 kernel's output masked by D
against the gated T our Hopper WY kernel saves for the backward.

    python benchmarks/bench_inverse.py          # GPU: the five shapes (sized for < 3 min on an H100; not yet run there)
    python benchmarks/bench_inverse.py --shapes 0,3 --reps 20
    python benchmarks/bench_inverse.py --interpret --shapes tiny   # CPU smoke test (times meaningless)
    python benchmarks/bench_inverse.py --interpret --shapes 1x70x2x32 --quick
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_pallas as bp  # noqa: E402  (sets the memory fraction before jax starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from gdn_jax.ops import KernelConfig  # noqa: E402
from gdn_jax.ops.gatefree import gatefree_t0  # noqa: E402
from gdn_jax.ops.pallas.inverse_gatefree import gatefree_inverse  # noqa: E402

# HBM bandwidth by device kind (bytes/s): an H100 SXM's HBM3 (REFERENCE §10's 3.35 TB/s), an H200's
# (bench_hopper_stages' figure)
HBM = {"H100": 3.35e12, "H200": 4.3e12}
C = 64
# the T0 kernel's settings timed (name, gatefree_inverse keywords); the first is the default, the
# ones marked False only with --all-variants (the whole list keeps the five shapes within ~3 min)
T0_VARIANTS = [
    ("T0 kernel w4", {}, True),
    ("T0 kernel w2", dict(num_warps=2), True),
    ("T0 kernel w2 diag products", dict(num_warps=2, diag="products"), True),
    ("T0 kernel w4 diag products", dict(diag="products"), True),
    ("T0 kernel w4 tf32 merges", dict(f32_dot="tf32"), True),
    ("T0 kernel w4 bf16 out", dict(out_dtype=jnp.bfloat16), True),
    ("T0 kernel w1", dict(num_warps=1), False),
    ("T0 kernel w8", dict(num_warps=8), False),
    ("T0 kernel w2 bf16 out", dict(num_warps=2, out_dtype=jnp.bfloat16), False),
]


def log(*a):
    print(*a, flush=True)


def nbytes(tree):
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(tree)
               if hasattr(a, "shape"))


def t0_float64(k, beta, idx):
    """float64 T0 of the chunks ``idx`` [(b, h, chunk)] from k [B, T, H, K], beta [B, T, H] (numpy;
    the chunk's tail past T is zero padding)."""
    k = np.asarray(jnp.asarray(k).astype(jnp.float32), np.float64)
    beta = np.asarray(jnp.asarray(beta).astype(jnp.float32), np.float64)
    T = k.shape[1]
    out = []
    for b, h, c in idx:
        kc = np.zeros((C, k.shape[-1]))
        bc = np.zeros(C)
        s, e = c * C, min(T, (c + 1) * C)
        kc[:e - s] = k[b, s:e, h]
        bc[:e - s] = beta[b, s:e, h]
        out.append(np.linalg.inv(np.eye(C) + np.tril(bc[:, None] * (kc @ kc.T), -1)))
    return np.stack(out)


def sample(shape, max_chunks, seed=0):
    """(b, h, chunk) triples to check: the first, the last and up to ``max_chunks`` random ones."""
    B, T, H, _ = shape
    dims = (B, H, -(-T // C))
    total = int(np.prod(dims))
    rng = np.random.default_rng(seed)
    flat = np.unique(np.concatenate([[0, total - 1], rng.choice(total, min(total, max_chunks), replace=False)]))
    return np.stack(np.unravel_index(flat, dims), axis=1)


def check(t0, idx, ref):
    """(max |err|, rel rms) of T0 [B, H, n, C, C] on the chunks ``idx`` against ``ref``."""
    got = np.asarray(t0[idx[:, 0], idx[:, 1], idx[:, 2]].astype(jnp.float32), np.float64)
    err = np.abs(got - ref)
    return float(err.max()), float(np.sqrt(np.mean(err ** 2) / np.mean(ref ** 2)))


def stages(x, platform, interpret, quick=False, all_variants=False):
    """[(name, fn, arrays)]: ``fn(*arrays)`` runs one stage (jit-able, the arrays as arguments);
    ``quick``: the T0 kernel in its default settings only; ``all_variants``: every T0 setting."""
    k, beta = x["k"], x["beta"]
    out = []
    variants = T0_VARIANTS[:1] if quick else [v for v in T0_VARIANTS if v[2] or all_variants]
    for name, kw, _ in variants:
        out.append((name, lambda k, b, kw=kw: gatefree_inverse(k, b, platform=platform, **kw), (k, beta)))
    out.append(("T0 XLA (plain JAX)", lambda k, b: gatefree_t0(k, b, chunk_size=C), (k, beta)))
    base = dict(platform="interpret") if interpret else {}
    try:  # ours, Hopper: the forward's WY kernel in each form
        from gdn_jax.ops.pallas import paths as PT
        from gdn_jax.ops.pallas.hopper import plan as HP, wy as HW
        from gdn_jax.ops.pallas import vjp as V

        prep = V.to_kernel_inputs(x["q"], k, x["v"], x["g"], beta, chunk_size=C, config=KernelConfig(**base))
        _, a = prep.kernel_args("fwd")
        cf = prep.route[0].call
        q_, k_, v_, b_, gc, gr, eg = a[:7]
        if not PT.FORWARD_BY_NAME[prep.route[0].path].hopper:
            log(f"  (no Hopper forward here: {HP.fwd_covers(cf) if platform == 'gpu' else 'not a GPU'})")
        else:
            for form in ("wu", "t"):
                c2 = dataclasses.replace(cf, fwd_form=form)
                why = HP.fwd_covers(c2)
                mark = " <- default" if cf.fwd_form == form else ""
                if why is not None:
                    log(f"  ours hopper WY fwd_form={form}: does not take this shape ({why})")
                    continue
                if form == "wu":
                    out.append((f"ours hopper WY (T,W,U,Aqk){mark}",
                                lambda q, k, v, b, gc, eg, c2=c2: HW.wy_forward(c2, q, k, v, b, gc, eg),
                                (q_, k_, v_, b_, gc, eg)))
                    out.append((f"ours hopper WY +T save_wy{mark}",
                                lambda q, k, v, b, gc, eg, c2=c2: HW.wy_forward(c2, q, k, v, b, gc, eg, save_t=True),
                                (q_, k_, v_, b_, gc, eg)))
                else:
                    out.append((f"ours hopper WY T-form (T,Aqk){mark}",
                                lambda q, k, b, gc, eg, c2=c2: HW.wy_forward(c2, q, k, None, b, gc, eg, t_form=True),
                                (q_, k_, b_, gc, eg)))
    except Exception as e:  # the module layout of an older / newer tree
        log(f"  ours hopper WY: skipped ({type(e).__name__}: {str(e)[:200]})")
    try:  # ours, Triton: the forward WY at the Triton forward's chunk
        from gdn_jax.ops.pallas import vjp as V
        from gdn_jax.ops.pallas.wy import wy_repr

        prep = V.to_kernel_inputs(x["q"], k, x["v"], x["g"], beta, chunk_size=C,
                                  config=KernelConfig(gpu_kernels="triton", **base))
        ct, a = prep.kernel_args("fwd")
        q_, k_, v_, b_, gc, gr, eg = a[:7]
        out.append((f"ours triton WY (W,U,Aqk) C={ct.C}",
                    lambda q, k, v, b, gc, gr, eg: wy_repr(ct, k, v, b, gc, gr, eg, q=q), (q_, k_, v_, b_, gc, gr, eg)))
    except Exception as e:
        log(f"  ours triton WY: skipped ({type(e).__name__}: {str(e)[:200]})")
    return out


def identity_on_device(x, platform, interpret):
    """The identity on the device: the T0 kernel's output masked by D (:func:`gdn_jax.ops.gatefree.
    decay_mask`) against the gated T that our Hopper forward WY kernel saves for the backward
    (``save_t``, or the T-form's T where "wu" does not take the shape; a bf16 hi + lo pair). A line
    of text (max |err|, RMS-relative error), or why it was skipped."""
    from gdn_jax.ops.gatefree import decay_mask
    from gdn_jax.ops.pallas import paths as PT
    from gdn_jax.ops.pallas.hopper import plan as HP, wy as HW
    from gdn_jax.ops.pallas import vjp as V

    base = dict(platform="interpret") if interpret else {}
    prep = V.to_kernel_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=C, config=KernelConfig(**base))
    _, a = prep.kernel_args("fwd")
    cf = prep.route[0].call
    if not PT.FORWARD_BY_NAME[prep.route[0].path].hopper:
        return "skipped: no Hopper forward here"
    q_, k_, v_, b_, gc, gr, eg = a[:7]
    cw = dataclasses.replace(cf, fwd_form="wu")
    if HP.fwd_covers(cw) is None:
        wy = jax.jit(lambda q, k, v, b, gc, eg: HW.wy_forward(cw, q, k, v, b, gc, eg, save_t=True))(q_, k_, v_, b_, gc, eg)
    else:
        ct = dataclasses.replace(cf, fwd_form="t")
        wy = jax.jit(lambda q, k, b, gc, eg: HW.wy_forward(ct, q, k, None, b, gc, eg, t_form=True))(q_, k_, b_, gc, eg)
    t = wy["t_hi"].astype(jnp.float32) + wy["t_lo"].astype(jnp.float32)  # [B*H, n, C, C]
    t0 = jax.jit(lambda k, b: gatefree_inverse(k, b, platform=platform))(x["k"], x["beta"])
    td = (t0 * decay_mask(x["g"], chunk_size=C)).reshape(t.shape)
    err = jnp.abs(td - t)
    rr = jnp.sqrt(jnp.mean(err ** 2) / jnp.mean(t ** 2))
    return f"T0 kernel * D vs our Hopper WY's T (wy_precision {cf.wy_precision}): max |err| {float(err.max()):.2e}, " \
           f"rel rms {float(rr):.2e}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="all",
                    help="'all' (bench_pallas' five), 'tiny' (its CPU smoke shapes), or comma-separated indices / BxTxHxD")
    ap.add_argument("--reps", type=int, default=None, help="calls per pipelined round (default 20; 1 with --interpret)")
    ap.add_argument("--interpret", action="store_true", help="CPU: every Pallas kernel in interpret mode")
    ap.add_argument("--quick", action="store_true", help="the T0 kernel in its default settings only")
    ap.add_argument("--all-variants", action="store_true", help="every T0 kernel setting of T0_VARIANTS")
    ap.add_argument("--budget-s", type=float, default=165.0,
                    help="stop starting new stages after this many seconds (the device run's 3 min limit)")
    ap.add_argument("--check-chunks", type=int, default=512, help="chunks checked against float64 per shape")
    args = ap.parse_args(argv)
    reps = args.reps or (1 if args.interpret else 20)
    if reps < 1:
        ap.error(f"--reps must be >= 1, got {reps}")
    platform = "interpret" if args.interpret else "gpu"
    if not args.interpret and jax.default_backend() != "gpu":
        ap.error("no GPU here: pass --interpret (and --shapes tiny) for a CPU smoke test")
    shapes = (bp.TINY if args.shapes == "tiny" else bp.SHAPES if args.shapes == "all"
              else bp.parse_shapes(args.shapes, on_gpu=not args.interpret))
    kind = jax.devices()[0].device_kind
    bw = next((v for key, v in HBM.items() if key in kind), None)
    log(f"jax {jax.__version__}, {kind}, platform {platform}, reps {reps}"
        + (f", HBM floor at {bw / 1e12:.2f} TB/s" if bw else ""))
    t_start = time.time()
    for shape in shapes:
        log(f"\n=== B,T,H,D = {shape}  (elapsed {time.time() - t_start:.0f} s)")
        if time.time() - t_start > args.budget_s:
            log(f"  skipped: --budget-s {args.budget_s:.0f} reached")
            continue
        x = bp.make_inputs(shape)
        idx = sample(shape, args.check_chunks)
        ref = t0_float64(x["k"], x["beta"], idx)
        log(f"  T0 lines: max |err| and rel rms against float64 numpy T0 on {len(idx)} chunks")
        try:
            log("  identity: " + identity_on_device(x, platform, args.interpret))
        except Exception as e:  # the module layout of an older / newer tree
            log(f"  identity: skipped ({type(e).__name__}: {str(e)[:300]})")
        rows = []
        for name, fn, arrays in stages(x, platform, args.interpret, args.quick, args.all_variants):
            if time.time() - t_start > args.budget_s:
                log(f"  {name:<40} skipped: --budget-s {args.budget_s:.0f} reached")
                continue
            try:
                jf = jax.jit(fn)
                res = jax.block_until_ready(jf(*arrays))
                ms = bp.time_fn_pipelined(lambda: jf(*arrays), reps, warmup=1 if args.interpret else 3)
                mb = (nbytes(arrays) + nbytes(res)) / 1e6
                rows.append((name, ms, mb))
                floor = f"  {ms / (mb * 1e6 / bw * 1e3):5.2f}x floor" if bw else ""
                err = ""
                if name.startswith("T0"):
                    mx, rr = check(res, idx, ref)
                    err = f"  err {mx:.1e} / {rr:.1e}" + ("" if mx <= 1e-2 else "  LARGE")
                log(f"  {name:<40} {ms:8.4f} ms  {mb:8.1f} MB  {mb / ms:8.1f} GB/s{floor}{err}")
            except Exception as e:
                log(f"  {name:<40} FAILED: {type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc(limit=3)
        best = min((r for r in rows if r[0].startswith("T0 kernel w") and "bf16" not in r[0]),
                   key=lambda r: r[1], default=None)
        if best is not None:
            log(f"  time over the fastest float32 T0 kernel ({best[0]}, {best[1]:.4f} ms):")
            for name, ms, _ in rows:
                log(f"    {name:<40} {ms / best[1]:6.2f}x")
    log(f"\ndone in {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
