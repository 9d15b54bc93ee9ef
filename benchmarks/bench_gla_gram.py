"""The per-key-channel decay Gram of the GLA chunk form (``gdn_jax.ops.chunk.decay_gram_channel``),
timed inside ``gated_linear_attention``'s forward+backward at the Zoology MQAR shape, against
other formulations of its diagonal sub-blocks -- to find out on a GPU whether the
library's einsum over a materialised [s, s, K] decay tensor is what makes the ``gla`` training step
~4x slower than gdn's (the GLA cells dominate the Zoology grid's GPU time).

    python benchmarks/bench_gla_gram.py                 # B 128, T 512, H 2, K = V = 64, float32
    python benchmarks/bench_gla_gram.py --shape 2x128x2x16 --reps 2    # CPU smoke test
    python benchmarks/bench_gla_gram.py --shape 128x512x2x32 --subs 8 4   # d 64's heads, other sub-block sizes

Variants (the same values; each checked against the library's to 1e-5 relative):
  library   the library's (the diagonal sub-blocks as an einsum "ic,jc,ijc->ij", precision HIGHEST,
            against the materialised [s, s, K] decay tensor, the block diagonal by an einsum with I;
            its default sub-block size, 8)
  sub s     the library's with sub-block size s (``--subs``)
  <form> s  ``form_gram``'s formulations of the diagonal blocks (``--forms``), at the default and
            each ``--subs`` size. Measured on an H200 at 128x512x2x32 (library sub 16 then):
            library 1.887 ms, sub 8 1.751, sub 4 1.863, fused 16 1.579
            (results/bench_train_step_h200/, where "fused" is fused 16)
One line per variant: ms per fwd+bwd call (pipelined) and the ratio to the library's.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


FORMS = ("elementwise", "fused", "padded")


def form_gram(a, b, gc, sub: int = 8, form: str = "elementwise"):
    """``decay_gram_channel`` with its diagonal sub-blocks built another way (same values):

    elementwise  the diagonal blocks as one elementwise product reduced over K (no [s, s, K]
                 operand of a dot), placed on the block diagonal by the library's einsum with I
    fused        the same product, placed by broadcasting against I (on an H200 at 4fe6ab4's
                 sub-block 16: 1.579 ms against the library's 1.887; XLA:CPU of jaxlib 0.10.2
                 segfaults in its backward at C = 32, two sub-blocks)
    padded       the same product, each block padded to its place in the row band (backward:
                 slices) and added to the off-diagonal part
    """
    import jax.numpy as jnp
    from gdn_jax.ops import chunk as C_

    if not isinstance(a, tuple):
        return form_gram((a,), b, gc, sub, form)[0]
    C, K = gc.shape[-2:]
    s = sub if (C % sub == 0 and C > sub) else C
    nb = C // s
    lead = gc.shape[:-2]
    bb = b.reshape(lead + (nb, s, K))
    gb = gc.reshape(lead + (nb, s, K))
    m = C_._tril_mask(s, strict=True)[..., None]
    d = jnp.where(m, gb[..., :, None, :] - gb[..., None, :, :], -jnp.inf)
    e = jnp.exp(d) + jnp.eye(s, dtype=gc.dtype)[..., None]
    eye = jnp.eye(nb, dtype=gc.dtype)
    if nb > 1:
        gref = gb[..., :, 0, :]
        ea = jnp.exp(jnp.concatenate([jnp.zeros_like(gb[..., :1, :]), gb[..., 1:, :] - gref[..., :, None, :]], axis=-2))
        col = jnp.arange(C)[None, :, None]
        start = (jnp.arange(nb) * s)[:, None, None]
        ex = jnp.where(col < start, gref[..., :, None, :] - gc[..., None, :, :], -jnp.inf)
        b_s = b[..., None, :, :] * jnp.exp(ex)
    out = []
    for ai in a:
        ab = ai.reshape(lead + (nb, s, K))
        diag = jnp.sum(ab[..., :, None, :] * bb[..., None, :, :] * e, axis=-1)  # [..., nb, s, s]
        if form == "padded":
            nd = diag.ndim - 3
            band = jnp.stack([jnp.pad(diag[..., r, :, :], [(0, 0)] * nd + [(0, 0), (r * s, C - (r + 1) * s)])
                              for r in range(nb)], axis=-3)  # [..., nb, s, C]
        elif form == "fused":
            band = (diag[..., :, :, None, :] * eye[:, None, :, None]).reshape(lead + (nb, s, C))
        else:
            band = jnp.einsum("...rij,rq->...riqj", diag, eye).reshape(lead + (nb, s, C))
        if nb > 1:
            band = band + jnp.einsum("...rik,...rjk->...rij", ab * ea, b_s, precision=C_._HI)
        out.append(band.reshape(lead + (C, C)))
    return tuple(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="128x512x2x64", help="BxTxHxD (K = V = D)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--subs", type=int, nargs="*", default=[], help="sub-block sizes to time beside the default")
    ap.add_argument("--forms", nargs="*", default=list(FORMS), choices=FORMS,
                    help="other formulations of the diagonal sub-blocks (form_gram), at each sub-block size")
    args = ap.parse_args(argv)
    if args.reps is not None and args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from gdn_jax.ops import chunk as C_
    from gdn_jax.ops import gated_linear_attention

    B, T, H, D = (int(x) for x in args.shape.split("x"))
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32) for _ in range(3))
    g = jnp.asarray(np.log(1 / (1 + np.exp(-rng.standard_normal((B, T, H, D))))) / 16, jnp.float32)
    do = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)

    def make(gram):
        def loss(q, k, v, g):
            real = C_.decay_gram_channel
            C_.decay_gram_channel = gram  # traced once, inside this jit
            try:
                o, _ = gated_linear_attention(q, k, v, g, backend="chunk", chunk_size=64)
            finally:
                C_.decay_gram_channel = real
            return jnp.sum(o * do)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))

    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; B, T, H, D = {B, T, H, D}, float32", flush=True)
    ref = None
    base_ms = None
    import functools
    import inspect

    sub0 = inspect.signature(C_.decay_gram_channel).parameters["sub"].default
    variants = [("library", C_.decay_gram_channel)]
    variants += [(f"sub {s}", functools.partial(C_.decay_gram_channel, sub=s)) for s in args.subs]
    for s in [sub0, *args.subs]:
        variants += [(f"{f} {s}", functools.partial(form_gram, sub=s, form=f)) for f in args.forms]
    for name, gram in variants:
        fn = make(gram)
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(q, k, v, g))
        compile_s = time.perf_counter() - t0
        if ref is None:
            ref = out
        else:
            for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
                err = float(jnp.sqrt(jnp.mean((a - b) ** 2) / jnp.mean(b ** 2)))
                assert err <= 1e-5, (name, err)
        for _ in range(2):
            jax.block_until_ready(fn(q, k, v, g))
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(args.reps):
                out = fn(q, k, v, g)
            jax.block_until_ready(out)
            ts.append((time.perf_counter() - t0) * 1e3 / args.reps)
        ms = sorted(ts)[1]
        base_ms = base_ms or ms
        print(f"  {name:<14} fwd+bwd {ms:8.3f} ms   x{ms / base_ms:.2f} of library   (first call {compile_s:.1f} s)",
              flush=True)


if __name__ == "__main__":
    main()
