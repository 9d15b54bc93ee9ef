"""Study: how fast does XLA form the pieces of the forward's WY representation at a benchmark
shape, against our Hopper WY kernel? (NOTE.md item 29: the WY inverse's latency is the forward's
remaining cost; jla forms its inverse in ~0.05 ms at 4x4096x16x128.)

Times, pipelined (``reps`` calls, one sync), at a ``bench_pallas.SHAPES`` shape:

- ``kkt``: A = strictly_lower(beta_i (K K^T)_ij e^{gamma_i - gamma_j}) and
  Aqk = tril(scale (Q K^T)_ij e^{gamma_i - gamma_j}) as batched einsums (bf16 in, f32 out);
- ``trsm``: T = (I + A)^-1 by ``jax.lax.linalg.triangular_solve`` (f32, unit lower);
- ``doubling``: T by the doubling rounds T_2s = T_s - (T_s L_s) T_s as batched f32 matmuls;
- ``W, U``: W = T diag(beta e^gamma) K, U = T diag(beta) V (bf16 out);
- ``xla WY``: kkt + trsm + W, U in one jit (compare ``bench_hopper_stages.py --only "fwd WY"``);
and the relative RMS error of T from trsm / doubling against float64 numpy on a few chunks.

    python benchmarks/study_wy_xla.py --shapes 0,2 --reps 20
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16


def timed(fn, args, reps):
    out = fn(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps * 1e3


def inputs(B, T, H, D, C=64, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (B, T, H, D), F32)
    k = jax.random.normal(ks[1], (B, T, H, D), F32)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[2], (B, T, H, D), F32)
    g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (B, T, H), F32)) / 4
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H), F32))
    n = T // C
    # head-major chunks [B*H, n, C, .]
    hm = lambda x: jnp.moveaxis(x, 2, 1).reshape(B * H, n, C, *x.shape[3:])
    return hm(q).astype(BF16), hm(k).astype(BF16), hm(v).astype(BF16), hm(g), hm(beta)


def kkt(q, k, g, beta, scale):
    gam = jnp.cumsum(g, axis=-1)
    C = g.shape[-1]
    i, j = jnp.arange(C)[:, None], jnp.arange(C)[None, :]
    dg = gam[..., :, None] - gam[..., None, :]
    e = jnp.exp(jnp.where(i >= j, dg, 0.0))
    kk = jnp.einsum("bnik,bnjk->bnij", k, k, preferred_element_type=F32)
    qk = jnp.einsum("bnik,bnjk->bnij", q, k, preferred_element_type=F32)
    A = jnp.where(i > j, beta[..., :, None] * kk * e, 0.0)
    aqk = jnp.where(i >= j, scale * qk * e, 0.0).astype(BF16)
    return A, aqk, gam


def trsm(A):
    C = A.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(C, dtype=F32), A.shape)
    return jax.lax.linalg.triangular_solve(eye + A, eye, left_side=True, lower=True, unit_diagonal=True)


def doubling(A):
    C = A.shape[-1]
    i, j = jnp.arange(C)[:, None], jnp.arange(C)[None, :]
    T = jnp.eye(C, dtype=F32) - jnp.where(((i & 1) == 1) & (j == i - 1), A, 0.0)
    lg = 1
    hi = jax.lax.Precision.HIGHEST
    while (1 << lg) < C:
        bi = i >> lg
        mask = ((bi & 1) == 1) & ((j >> lg) == bi - 1)
        L = jnp.where(mask, A, 0.0)
        T = T - jnp.matmul(jnp.matmul(T, L, precision=hi), T, precision=hi)
        lg += 1
    return T


def w_u(T, k, v, gam, beta):
    sw = (beta * jnp.exp(gam))[..., None, :]
    W = jnp.einsum("bnij,bnjk->bnik", T * sw, k.astype(F32)).astype(BF16)
    U = jnp.einsum("bnij,bnjk->bnik", T * beta[..., None, :], v.astype(F32)).astype(BF16)
    return W, U


def main(argv=None):
    from bench_pallas import SHAPES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="0")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    if args.reps is not None and args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    print(jax.__version__, jax.devices()[0].device_kind, flush=True)
    rows = []
    for s in args.shapes.split(","):
        B, T, H, D = SHAPES[int(s)] if s.isdigit() else tuple(int(x) for x in s.split("x"))
        q, k, v, g, beta = inputs(B, T, H, D)
        scale = D ** -0.5
        A, aqk, gam = jax.jit(kkt, static_argnums=4)(q, k, g, beta, scale)
        res = {}
        res["kkt"] = timed(jax.jit(kkt, static_argnums=4), (q, k, g, beta, scale), args.reps)
        res["trsm"] = timed(jax.jit(trsm), (A,), args.reps)
        res["doubling"] = timed(jax.jit(doubling), (A,), args.reps)
        Tm = jax.jit(trsm)(A)
        res["W, U"] = timed(jax.jit(w_u), (Tm, k, v, gam, beta), args.reps)

        def xla_wy(q, k, v, g, beta):
            A, aqk, gam = kkt(q, k, g, beta, scale)
            W, U = w_u(trsm(A), k, v, gam, beta)
            return W, U, aqk

        res["xla WY"] = timed(jax.jit(xla_wy), (q, k, v, g, beta), args.reps)
        # T's accuracy against float64 numpy on a few chunks
        An = np.asarray(A[:4, :4], np.float64)
        Tref = np.linalg.inv(np.eye(An.shape[-1]) + An)
        rel = lambda X: float(np.sqrt(np.mean((np.asarray(X[:4, :4], np.float64) - Tref) ** 2)
                                      / np.mean(Tref ** 2)))
        err = dict(trsm=rel(Tm), doubling=rel(jax.jit(doubling)(A)))
        for name, ms in res.items():
            print(f"  {B}x{T}x{H}x{D} {name:<10} {ms:.3f} ms", flush=True)
        print(f"  T rel rms vs float64: trsm {err['trsm']:.1e}  doubling {err['doubling']:.1e}", flush=True)
        rows.append(((B, T, H, D), res, err))
    print("\nshape              " + "  ".join(f"{n:>10}" for n in rows[0][1]))
    for shp, res, _ in rows:
        print(f"{'x'.join(map(str, shp)):<18} " + "  ".join(f"{v:10.3f}" for v in res.values()))


if __name__ == "__main__":
    sys.exit(main())
