"""In-kernel building blocks shared by the kernels: dots with the call's precision, the decay
matrix, the triangular inverse, reductions and packed-sequence flags."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .config import KernelCall
from .platform import dot_precision

F32 = jnp.float32


def mm(call: KernelCall, a, b, ta=False, tb=False, dt=None, role="mm"):
    """2-D dot ``a @ b`` (``ta`` / ``tb``: transpose an operand) with float32 accumulation;
    operands cast to ``dt`` (default: the intermediates' dtype); ``role`` "inv" (the triangular
    inverse) or "mm" picks the float32 precision on GPU."""
    dt = jnp.dtype(dt or call.mid_dt)
    a = a.astype(dt)
    b = b.astype(dt)
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    prec = dot_precision(call.platform, dt, call.f32_inv if role == "inv" else call.f32_mm)
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=F32)


def iotas(C):
    return lax.broadcasted_iota(jnp.int32, (C, C), 0), lax.broadcasted_iota(jnp.int32, (C, C), 1)


def decay_matrix(gam, gam_row, incl):
    """Gamma_ij = exp(gamma_i - gamma_j) on i >= j (i > j if not ``incl``), 0 elsewhere, from
    gamma as a column [C, 1] and as a row [1, C]; the exponent is masked BEFORE the exp."""
    C = gam.shape[0]
    i, j = iotas(C)
    m = (i >= j) if incl else (i > j)
    return jnp.where(m, jnp.exp(jnp.where(m, gam - gam_row, 0.0)), 0.0)


def strict_lower(C):
    """The strictly lower-triangular mask [C, C] as float32 ones."""
    i, j = iotas(C)
    return jnp.where(i > j, 1.0, 0.0).astype(F32)


def inv_unit_lower(call: KernelCall, A):
    """(I + A)^-1 for strictly lower-triangular A [C, C] (float32), matmuls only.

    Recursive block formula: with T_s the inverse of the block-diagonal part of I + A in blocks
    of s (T_1 = I), ``T_2s = T_s - T_s L_s T_s`` where L_s keeps the entries of A in the
    sub-diagonal s-blocks of each 2s-block: 2 log2(C) - 2 matmuls of C x C, as stable as forward
    substitution. (The "doubling product" prod_k (I + (-A)^(2^k)) uses as many matmuls but sums a
    Neumann series with huge cancelling terms: 6e2 relative error at C = 64 for weakly gated,
    correlated keys, against 3e-7 for this form.)
    """
    C = A.shape[0]
    i, j = iotas(C)
    # s = 1: T_2 = I - L_1 (the inverse of a unit 2x2 lower block is exact without matmuls)
    T = jnp.where(i == j, 1.0, 0.0).astype(F32) - jnp.where(((i & 1) == 1) & (j == i - 1), A, 0.0)
    s = 2
    while s < C:
        lg = s.bit_length() - 1  # s == 1 << lg
        bi = i >> lg
        L = jnp.where(((bi & 1) == 1) & ((j >> lg) == bi - 1), A, 0.0)
        TL = mm(call, T, L, dt=F32, role="inv")
        T = T - mm(call, TL, T, dt=F32, role="inv")
        s *= 2
    return T


def rowsum(x):
    return jnp.sum(x, axis=1, keepdims=True)


def colsum(x):
    return jnp.sum(x, axis=0, keepdims=True)


def load_f32(ref, *idx):
    """``ref[idx]`` (the whole block without ``idx``) as float32."""
    return (ref[idx] if idx else ref[...]).astype(F32)


def chunk_flags(flags_ref, i):
    """(sequence id, first chunk of it, last chunk of it) of chunk ``i``, decoded from
    :func:`gdn_jax.ops.packing.chunk_flags`' encoding ``seq * 4 + first + 2 * last``."""
    f = flags_ref[i]
    return f >> 2, (f & 1) != 0, (f & 2) != 0
