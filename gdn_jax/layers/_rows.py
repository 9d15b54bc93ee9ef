"""One-row projections written so that XLA runs them as GEMMs (the decode step at batch 1).

At batch 1 a decode step multiplies one row by each weight. XLA's GPU algebraic simplifier rewrites a
dot with a vector operand into an elementwise multiply and a reduction when its operands hold fewer
than 10^7 elements (OpenXLA, ``ShouldStrengthReduceDotToReduce``): in the seed-sized model
(d 2048) that takes the output projection (2048 x 2048: two kernels of 6-7 µs per layer on one
H100, where the weight's byte floor is ~3 µs) and the tied LM head (2048 x 1024, once per step)
(``benchmarks/study_gemv.py`` names the kernels XLA compiles for each form of the product).
:func:`apply_rows` runs the projection on two rows instead (the second zero) and keeps the first; the
padded operand goes through ``lax.optimization_barrier`` so that the simplifier cannot slice the zero
row away again, and the product compiles to a GEMM fusion. Measured in the decode loop
(``docs/inference.md``): 0.387 -> 0.335 ms per token at batch 1 on one H100.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rows(fn, x):
    """``fn(x)`` for ``x [B, ..., d]``, with a single row run as two.

    Where every leading size of ``x`` is 1 (one row: a decode token at batch 1), ``fn`` runs on
    ``concat([x, zeros_like(x)], axis=0)`` behind an optimization barrier and the first row of its
    result is returned; otherwise ``fn(x)``. The result equals ``fn(x)`` exactly when ``fn`` acts on
    each row independently (a linear map such as ``nnx.Linear``, an embedding's ``attend``), which is
    the caller's contract; nothing is checked. Costs one zero row of compute."""
    if x.ndim < 2 or any(s != 1 for s in x.shape[:-1]):
        return fn(x)
    pair = jax.lax.optimization_barrier(jnp.concatenate([x, jnp.zeros_like(x)], axis=0))
    return fn(pair)[:1]
