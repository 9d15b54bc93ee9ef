"""Numerics study for a shorter forward state chain (CPU; no kernel): the "transition" form.

Today's Hopper state pass runs two dependent wgmmas per chunk on its sequential chain (the "wu" form,
C = 64; gamma the in-chunk cumulative log decay, K~ = diag(e^{gamma_C - gamma}) K)::

    Vn = U - W bf16(S)                     # wgmma 1, Vn rounded to bf16 for the next product
    S  = e^{gamma_C} S + K^T bf16(diag(e^{gamma_C - gamma}) Vn)          # wgmma 2 (float32 S)

The transition form moves the chunk's K x K transition off the chain (computed a chunk ahead, e.g.
by another warpgroup or the WY kernel), leaving one dependent wgmma per chunk::

    M  = K~^T W          (K x K, independent of S)      B = K~^T U   (K x V, independent of S)
    S  = e^{gamma_C} S + B - M bf16(S)     # one wgmma on the chain; the decay stays float32
    Vn = U - W bf16(S_prev), o = ... as today, off the chain

This script emulates both on the CPU with the kernels' roundings (bf16 inputs, W, U, Aqk, Vn, the
bf16 S operand; float32 accumulation; T exact) and prints rel. RMS errors of o and the final state
against the float64 reference (``tests/reference.py``), for M as one bf16 operand and as a bf16
(hi, lo) pair, at the issue's gates and the suite's strong / weak ones::

    python benchmarks/study_transition_form.py --T 4096 16384
"""
from __future__ import annotations

import argparse
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (_ROOT, os.path.join(_ROOT, "tests")):
    sys.path.insert(0, p)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from conftest import make_inputs  # noqa: E402
from reference import reference, rel_rms, to_f64  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
HI = lax.Precision.HIGHEST


def bf(x):
    """Round to bf16 and back to float32 (a kernel's bf16 tile)."""
    return x.astype(BF16).astype(F32)


def mm(a, b):
    return jnp.matmul(a, b, precision=HI)


def emulate(q, k, v, g, beta, *, form, C=64, m_split=False):
    """One head's sequence, chunk by chunk ([T, K] / [T, V] / [T]; T a multiple of C).
    form: "wu" (today's chain) or "transition". Returns o [T, V] and the final state [K, V]."""
    T, K = k.shape
    V = v.shape[1]
    n = T // C
    scale = K ** -0.5
    rs = lambda x: x.reshape(n, C, *x.shape[1:])
    qc, kc, vc, gc, bc = (rs(x.astype(jnp.float64)) for x in (q, k, v, g, beta))

    def prep(qi, ki, vi, gi, bi):  # the WY kernel's outputs (float64 maths, then its roundings)
        gam = jnp.cumsum(gi)
        i, j = jnp.arange(C)[:, None], jnp.arange(C)[None, :]
        dgm = jnp.where(i >= j, gam[:, None] - gam[None, :], -jnp.inf)
        A = jnp.where(i > j, bi[:, None] * (ki @ ki.T) * jnp.exp(dgm), 0.0)
        Tm = jnp.linalg.inv(jnp.eye(C) + A)
        W = bf((Tm * (bi * jnp.exp(gam))[None, :]) @ ki)
        U = bf((Tm * bi[None, :]) @ vi)
        aqk = bf(jnp.where(i >= j, scale * (qi @ ki.T) * jnp.exp(dgm), 0.0))
        dec = jnp.exp(gam[-1] - gam).astype(F32)  # e^{gamma_C - gamma}
        qd = bf((scale * jnp.exp(gam))[:, None] * qi)
        kt = bf(dec[:, None] * ki).astype(F32)  # K~ (bf16 tile)
        M = mm(kt.T, W)  # float32 accumulation from bf16 tiles
        Bm = mm(kt.T, U)
        return (W, U, aqk, dec, qd, ki.astype(F32), jnp.exp(gam[-1]).astype(F32), M, Bm)

    pre = jax.vmap(prep)(qc, kc, vc, gc, bc)

    def step(S, x):
        W, U, aqk, dec, qd, kf, eC, M, Bm = x
        Sb = bf(S)
        Vn = bf(U - mm(W, Sb))
        o = mm(qd, Sb) + mm(aqk, Vn)
        if form == "wu":
            S = eC * S + mm(kf.T, bf(dec[:, None] * Vn))
        else:
            Mop = bf(M) + (bf(M - bf(M)) if m_split else 0.0)
            S = eC * S + Bm - mm(Mop, Sb)
        return S, o

    S, o = lax.scan(step, jnp.zeros((K, V), F32), pre)
    return o.reshape(T, V), S


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, nargs="+", default=[4096])
    ap.add_argument("--D", type=int, nargs="+", default=[128])
    ap.add_argument("--heads", type=int, default=2)
    args = ap.parse_args(argv)
    if any(t < 64 or t % 64 for t in args.T):
        ap.error(f"--T: positive multiples of the chunk size 64, got {args.T}")
    if any(d < 1 for d in args.D) or args.heads < 1:
        ap.error(f"--D and --heads must be >= 1, got --D {args.D} --heads {args.heads}")
    jax.config.update("jax_enable_x64", True)  # the WY maths in float64 (T exact), as the reference
    gates = {"issue logsigmoid(N(0,1))/4": ("logsigmoid", 0.0, 0.25), "strong": "strong", "weak": "weak"}
    print(f"{'T':>6} {'D':>4} {'gates':<28} {'form':<22} {'o':>9} {'S':>9}   (rel. RMS vs float64)")
    for T in args.T:
        for D in args.D:
            for gname, gspec in gates.items():
                x = make_inputs(1000 + T + D, 1, T, args.heads, D, D, gates=gspec, dtype=BF16)
                ro, rS = reference(x.q, x.k, x.v, x.g, x.beta)
                for form, split in (("wu", False), ("transition", False), ("transition", True)):
                    fn = jax.jit(jax.vmap(lambda *a: emulate(*a, form=form, m_split=split), in_axes=1, out_axes=(1, 0)))
                    o, S = fn(x.q[0], x.k[0], x.v[0], x.g[0], x.beta[0])
                    label = form + (" (M hi+lo)" if split else " (M bf16)" if form == "transition" else "")
                    print(f"{T:>6} {D:>4} {gname:<28} {label:<22} {rel_rms(to_f64(o), ro[0]):9.2e} "
                          f"{rel_rms(to_f64(S), rS[0]):9.2e}", flush=True)


if __name__ == "__main__":
    main()
