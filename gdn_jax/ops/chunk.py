"""``backend="chunk"``: the chunked WY/UT form, matmuls inside a chunk, ``lax.scan`` across chunks.

DeltaNet paper §3 and GDN paper §3.3. Within a chunk of C tokens with local
cumulative log decay gamma_i = sum_{j<=i} g_j (per head, or per key channel)::

    Gamma_ij = exp(gamma_i - gamma_j) for i >= j, else 0   (exponent masked BEFORE exp)
    A        = strictly_lower((beta K) K^T * Gamma);   T = (I + A)^-1
    W        = T ((beta K) * exp(gamma));              U = T (beta V)
    per chunk, with S the state entering it:
      V_new = U - W S
      O     = (Q * exp(gamma)) S + tril(Q K^T * Gamma) V_new
      S    <- exp(gamma_C) S + (K * exp(gamma_C - gamma))^T V_new

Per-key-channel decay (Kimi Delta Attention) cannot factor
(K e^gamma)(K e^-gamma)^T without overflow, so the Gram matrices are built in
8-token sub-blocks: a diagonal sub-block as a masked [8, 8, K] exponential,
an off-diagonal one through the sub-block boundary r, exp(gamma_i - gamma_r) *
exp(gamma_r - gamma_j), both factors <= 1 when g <= 0.

Any T: the sequence is padded at the end with g = 0, beta = 0, k = v = q = 0,
which leaves the state untouched and creates no exponentials of padding.
Packed sequences (``cu_seqlens``) are re-laid so that every sequence starts on a
chunk boundary (at most N*(C-1) extra tokens); the state is reset to the
sequence's initial state at its first chunk and read out after its last one.

Per-value-channel beta is declined (``NotImplementedError``): use ``backend="scan"``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .packing import chunk_resets, from_chunk_layout, n_seq, scan_with_resets, to_chunk_layout

_HI = jax.lax.Precision.HIGHEST


def mm(a, b):
    return jnp.matmul(a, b, precision=_HI)


def _tril_mask(C, strict: bool):
    i = jnp.arange(C)[:, None]
    j = jnp.arange(C)[None, :]
    return (i > j) if strict else (i >= j)


def decay_gram_head(a, b, gc):
    """M_ij = (a_i . b_j) exp(gc_i - gc_j) for i >= j, else 0. a,b [...,C,D]; gc [...,C].

    The diagonal factor is the constant 1 (not exp(gc_i - gc_i)): an exponent that is zero by
    construction must carry no gradient, or its +x / -x cotangents, O(1) each, cancel in float
    arithmetic into the (under strong decay tiny) gradient of g with an O(eps) error.
    """
    C = gc.shape[-1]
    strict = _tril_mask(C, strict=True)
    diff = gc[..., :, None] - gc[..., None, :]
    gamma = jnp.where(strict, jnp.exp(jnp.where(strict, diff, 0.0)), jnp.eye(C, dtype=gc.dtype))
    return mm(a, jnp.swapaxes(b, -1, -2)) * gamma


def reverse_exclusive_cumsum(g, axis):
    """sum_{j > i} g_j along ``axis`` (gamma_C - gamma_i inside a chunk), summed directly: not a
    difference of two large cumulative sums, and the last entry is the constant 0 (no gradient)."""
    g = jnp.moveaxis(g, axis, -1)
    nxt = jnp.concatenate([g[..., 1:], jnp.zeros_like(g[..., :1])], axis=-1)
    out = jnp.flip(jnp.cumsum(jnp.flip(nxt, -1), axis=-1), -1)
    return jnp.moveaxis(out, -1, axis)


def decay_gram_channel(a, b, gc, sub: int = 8):
    """M_ij = sum_c a_ic b_jc exp(gc_ic - gc_jc) for i >= j, else 0; a,b,gc [...,C,K].

    ``sub`` is the sub-block size (any size gives the same values to float32 rounding; the decay
    factors take C s K + C^2 K / s numbers, least at s = sqrt(C), 8 at C = 64, the default: on an
    H200 gla's fwd+bwd at d 64's training shape ran 1.08x faster at 8 than at 16, 1.887 -> 1.751 ms,
    timed with ``sub=8`` passed). On the same
    H200 the diagonal sub-blocks as one elementwise product reduced over K, placed on the block
    diagonal by broadcasting, ran it 1.19x faster at 16 (1.887 -> 1.579 ms;
    ``benchmarks/bench_gla_gram.py``, results/bench_train_step_h200/) --
    but XLA:CPU (jaxlib 0.10.2) segfaults in that form's backward at C = 32 (two sub-blocks), so it
    is not the library's; the benchmark times it beside CPU-safe variants (``elementwise``,
    ``padded``) for the next GPU check.

    ``a`` may be a tuple of arrays (e.g. ``(beta K, Q)`` against the same ``b = K``): the decay
    factors are then computed once and a tuple of Grams is returned. Overflow-free for g <= 0: see
    the module docstring. Exponents that are zero by construction (the diagonal, a sub-block's
    first row against its boundary) are constants, so they carry no gradient (see
    :func:`decay_gram_head`).
    """
    if not isinstance(a, tuple):
        return decay_gram_channel((a,), b, gc, sub=sub)[0]
    C, K = gc.shape[-2:]
    s = sub if (C % sub == 0 and C > sub) else C
    nb = C // s
    lead = gc.shape[:-2]
    bb = b.reshape(lead + (nb, s, K))
    gb = gc.reshape(lead + (nb, s, K))
    # diagonal sub-blocks: masked [s, s, K] exponential (exp(-inf) = 0 above the diagonal, whose
    # gradient is 0), constant 1 on the diagonal
    m = _tril_mask(s, strict=True)[..., None]
    d = jnp.where(m, gb[..., :, None, :] - gb[..., None, :, :], -jnp.inf)
    e = jnp.exp(d) + jnp.eye(s, dtype=gc.dtype)[..., None]
    eye = jnp.eye(nb, dtype=gc.dtype)
    if nb > 1:
        # off-diagonal: rows of sub-block r against columns j < r*s, through gamma at position r*s
        # (the sub-block's first row has the constant exponent 0)
        gref = gb[..., :, 0, :]  # [..., nb, K]
        ea = jnp.exp(jnp.concatenate([jnp.zeros_like(gb[..., :1, :]), gb[..., 1:, :] - gref[..., :, None, :]], axis=-2))
        col = jnp.arange(C)[None, :, None]
        start = (jnp.arange(nb) * s)[:, None, None]
        cm = col < start  # [nb, C, 1]
        ex = jnp.where(cm, gref[..., :, None, :] - gc[..., None, :, :], -jnp.inf)  # [..., nb, C, K], < 0 where cm
        b_s = b[..., None, :, :] * jnp.exp(ex)
    out = []
    for ai in a:
        ab = ai.reshape(lead + (nb, s, K))
        diag = jnp.einsum("...ic,...jc,...ijc->...ij", ab, bb, e, precision=_HI)  # [..., nb, s, s]
        full = jnp.einsum("...rij,rq->...riqj", diag, eye).reshape(lead + (C, C))
        if nb > 1:
            off = jnp.einsum("...rik,...rjk->...rij", ab * ea, b_s, precision=_HI)  # [..., nb, s, C]
            full = full + off.reshape(lead + (C, C))
        out.append(full)
    return tuple(out)


def _diag_blocks(M, s: int):
    """Diagonal s x s blocks of M [..., C, C] -> [..., C/s, s, s]."""
    C = M.shape[-1]
    nb = C // s
    Mb = M.reshape(M.shape[:-2] + (nb, s, nb, s))
    return jnp.einsum("...piqj,pq->...pij", Mb, jnp.eye(nb, dtype=M.dtype), precision=_HI)


def unit_lower_inverse(A):
    """(I + A)^-1 for strictly lower-triangular A [..., C, C], with matmuls only.

    Diagonal 16 x 16 blocks are inverted by forward substitution (16 unrolled row steps);
    blocks are then merged pairwise, [[X11, 0], [X21, X22]] with X21 = -X22 M21 X11, doubling
    the block size up to C. No LAPACK call: XLA:CPU's batched triangular solve runs its batch on
    the intra-op pool and was seen to deadlock on 2-core machines (jaxlib 0.10.2), and the same
    scheme maps onto Pallas kernels.
    """
    C = A.shape[-1]
    s = 16
    if C % s or (C // s) & (C // s - 1):
        s = C  # not 16 * 2^m: plain forward substitution over the whole chunk
    nb = C // s
    N = _diag_blocks(A, s) if nb > 1 else A[..., None, :, :]
    X = jnp.zeros_like(N)
    eye = jnp.eye(s, dtype=A.dtype)
    for i in range(s):  # row i of (I + N)^-1 = e_i - N[i, :i] X[:i]
        row = eye[i] - jnp.einsum("...j,...jk->...k", N[..., i, :], X, precision=_HI)
        X = X.at[..., i, :].set(row)
    M = A
    while s < C:
        D2 = _diag_blocks(M, 2 * s)  # [..., nb/2, 2s, 2s]
        M21 = D2[..., s:, :s]
        X11, X22 = X[..., 0::2, :, :], X[..., 1::2, :, :]
        X21 = -mm(mm(X22, M21), X11)
        top = jnp.concatenate([X11, jnp.zeros_like(X11)], axis=-1)
        bot = jnp.concatenate([X21, X22], axis=-1)
        X = jnp.concatenate([top, bot], axis=-2)
        s *= 2
    return X[..., 0, :, :]


def to_chunks(xs, cu_seqlens, C: int):
    """Lay the ``[B,T,H,*]`` arrays ``xs`` onto whole chunks (:func:`~gdn_jax.ops.packing.to_chunk_layout`)
    head-major: returns ``(chunks [B,H,n,C,*], T_pad, packing, valid)``."""
    xs, T_pad, packing, valid = to_chunk_layout(xs, cu_seqlens, C)
    n = T_pad // C

    def hm(x):
        B, T, H = x.shape[:3]
        x = jnp.moveaxis(x, 2, 1)  # [B,H,T,*]
        return x.reshape((B, H, n, C) + x.shape[3:])

    return tuple(map(hm, xs)), T_pad, packing, valid


def from_chunks(o, T: int, packing):
    """Chunks ``[B,H,n,C,V]`` back to ``[B,T,H,V]`` (inverse of :func:`to_chunks`)."""
    B, H, n, C, V = o.shape
    o = jnp.moveaxis(o.reshape(B, H, n * C, V), 1, 2)
    return from_chunk_layout(o, T, packing)


def decay_factors(g, g_pc: bool):
    """In-chunk decay terms from chunked log decays g ``[B,H,n,C]`` (per head) or ``[B,H,n,C,K]``
    (per key channel): ``(gamma, e^gamma, e^{gamma_C - gamma}, e^{gamma_C})`` with gamma the
    in-chunk cumulative sum; the two exponentials per token broadcast against ``[..., C, K]``
    rows, e^{gamma_C} against the state ``[..., K, V]``. gamma_C - gamma is an exclusive reverse
    cumsum (:func:`reverse_exclusive_cumsum`)."""
    gam = jnp.cumsum(g, axis=3)
    to_end = reverse_exclusive_cumsum(g, 3)
    if g_pc:
        return gam, jnp.exp(gam), jnp.exp(to_end), jnp.exp(gam[..., -1, :])[..., :, None]  # dec [B,H,n,K,1]
    return gam, jnp.exp(gam)[..., None], jnp.exp(to_end)[..., None], jnp.exp(gam[..., -1])[..., None, None]


def chunk_forward(q, k, v, g, beta, initial_state, cu_seqlens, *, chunk_size: int, g_pc: bool, b_pc: bool):
    """Chunked forward. Inputs [B,T,H,*] in the accumulation dtype, q pre-scaled.

    Returns (o [B,T,H,V], final_state [B,H,K,V] or [N,H,K,V], valid flag).
    """
    if b_pc:
        raise NotImplementedError(
            "backend='chunk' does not take per-value-channel beta [B,T,H,V]; use backend='scan' "
            "(or backend='auto', which picks it)"
        )
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = int(chunk_size)
    dt = q.dtype
    (qc, kc, vc, gcc, bc), T_pad, packing, valid = to_chunks((q, k, v, g, beta), cu_seqlens, C)
    gam, eg, ekd, dec = decay_factors(gcc, g_pc)
    kb = kc * bc[..., None]
    strict = _tril_mask(C, strict=True)
    if g_pc:
        A, Aqk = decay_gram_channel((kb, qc), kc, gam)
    else:
        A = decay_gram_head(kb, kc, gam)
        Aqk = decay_gram_head(qc, kc, gam)
    kd = kc * ekd
    Tinv = unit_lower_inverse(jnp.where(strict, A, 0.0))  # (I + A)^-1
    W = mm(Tinv, kb * eg)  # [B,H,n,C,K]
    U = mm(Tinv, vc * bc[..., None])  # [B,H,n,C,V]
    qg = qc * eg

    tm = lambda x: jnp.moveaxis(x, 2, 0)  # chunk axis first for the scan
    xs = tuple(map(tm, (W, U, qg, Aqk, kd, dec)))

    def chunk_step(S, x):
        W, U, qg, Aqk, kd, dec = x
        vn = U - mm(W, S)
        o = mm(qg, S) + mm(Aqk, vn)
        S = dec * S + mm(jnp.swapaxes(kd, -1, -2), vn)
        return S, o

    fin, o = scan_with_resets(chunk_step, xs, initial_state, state_shape=(B, H, K, V), dtype=dt,
                              resets=chunk_resets(packing), n_seq=n_seq(cu_seqlens))
    return from_chunks(jnp.moveaxis(o, 0, 2), T, packing), fin, valid
