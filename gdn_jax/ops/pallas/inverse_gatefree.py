"""The gate-free in-chunk inverse as a Pallas kernel, and the rule for which calls may use it.

Per (batch, value head, chunk of C tokens), with A0 = strictly_lower(diag(beta) K K^T) (no decay)::

    T0 = (I + A0)^-1                                         float32, unit lower triangular

The gated inverse of the chunked form (``gdn_jax/ops/chunk.py``, REFERENCE §2) follows from it
elementwise: with gamma the in-chunk cumulative log decay, E = diag(e^gamma) and the decay mask
D_ij = e^{gamma_i - gamma_j} for i >= j (0 above), A = A0 * D = E A0 E^-1, hence
T = (I + A)^-1 = E T0 E^-1 = T0 * D. T0 depends on k and beta only, so it is computed once per
chunk and the consumers apply the decay as a mask whose every factor is <= 1
(:mod:`gdn_jax.ops.gatefree` has the plain-JAX algebra and the forward built on it).

The kernel (one program per (batch x value head, chunk), Triton on GPU, ``interpret=True`` on the
CPU): K is read as C/16 row blocks of 16 tokens; the Gram blocks K_b K_c^T (c <= b) are 16 x 16
dots (bf16 / f16 operands exact, float32 accumulation; float32 operands at ``f32_dot``'s
precision); each 16 x 16 diagonal block of I + A0 is inverted by forward substitution in registers
(15 row steps, each a masked column reduction and a row update); the blocks are then merged
16 -> 32 -> 64 with the block inverse [[X11, 0], [M21, X22]]^-1 = [[X11^-1, 0], [-X22^-1 M21
X11^-1, X22^-1]] as 16 x 16 products (C = 64: 16 of them), and the C/16 x C/16 blocks of T0 are
stored one by one (the upper ones as zeros).

When T0 may replace the gated inverse (:func:`gatefree_covers`): T0 is the ungated DeltaNet's
inverse and is bounded only when the keys are unit-norm and beta lies in [0, 2] (then every
transition I - beta k k^T has eigenvalues in [-1, 1]); with raw keys its entries grow like
|1 - beta |k|^2|^C (keys of norm 3, near-repeated, beta 0.9: ~7^63 ~ 1e53, which overflows
float32) while the gated inverse, damped by the decay, stays finite. The identity also needs
one decay per head (a per-key-channel decay does not factor out of A).

Source: REFERENCE §10 (the fastest Hopper implementations' gate-free inverse); GDN paper §3.3 and
DeltaNet paper §3 for the chunked form.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from .. import packing as _packing
from .._common import GateForms
from . import platform as _plat
from . import tiles as _t
from .layout import hm_spec, run, sds, token_spec

__all__ = ["gatefree_inverse", "gatefree_covers", "t0_and_aqk", "GATEFREE_CHUNK", "GATEFREE_DTYPES", "SUB"]

F32 = jnp.float32
SUB = 16  # the diagonal blocks inverted by forward substitution
GATEFREE_CHUNK = 64  # the chunk the gate-free path is built for
GATEFREE_DTYPES = ("float32", "bfloat16", "float16")  # q, k, v dtypes the kernel reads
_CHUNKS = (16, 32, 64, 128)  # chunk sizes the kernel itself takes (C/16 blocks, a power of two)
_MAX_K = 256
_F32_DOTS = ("tf32", "tf32x3", "ieee")
_OUT_DTYPES = ("float32", "bfloat16")
_DIAGS = ("substitution", "products")


def gatefree_covers(forms: GateForms, *, chunk_size: int, dtype, use_qk_l2norm: bool,
                    keys_unit_norm: bool = False) -> Optional[str]:
    """None when the gate-free inverse (T = T0 * D) may serve a ``gated_delta_rule`` call, else
    the reason it may not (a pure function of static facts; every other call keeps the gated
    inverse).

    Args:
      forms: the call's gate layouts (:class:`gdn_jax.ops._common.GateForms`).
      chunk_size: the kernel chunk of the call (the gate-free path is built for 64).
      dtype: the dtype the kernels read q, k, v in.
      use_qk_l2norm: the op normalises q and k itself (unit-norm keys).
      keys_unit_norm: the caller promises keys of norm 1 (it normalised them, e.g. the layer with
        its own L2 norm, or the benchmarks).

    Rules: unit-norm keys (``use_qk_l2norm`` or ``keys_unit_norm``) -- T0 is bounded only then
    (with beta in [0, 2], which the layer's sigmoid / 2 sigmoid parameterisations give; not
    checked: beta may be traced); one decay per head (per-key-channel g does not factor as
    T0 * D); one beta per head (per-value-channel beta needs one inverse per value column);
    ``chunk_size`` 64; float32, bfloat16 or float16 inputs (float64 calls run the chunk backend).
    """
    if forms.g_per_channel:
        return ("per-key-channel g [B,T,H,K] (Kimi Delta Attention) does not factor as T0 * D: the gate-free "
                "inverse needs one decay per head")
    if forms.beta_per_channel:
        return "per-value-channel beta [B,T,H,V] needs one inverse per value column (not a single T0 per chunk)"
    if not (use_qk_l2norm or keys_unit_norm):
        return ("keys are not known to be unit-norm (use_qk_l2norm=False and no unit-norm promise): T0 = "
                "(I + strictly_lower(diag(beta) K K^T))^-1 is bounded only for unit-norm keys and can "
                "overflow float32 for raw keys, where the gated inverse stays finite")
    if int(chunk_size) != GATEFREE_CHUNK:
        return f"chunk_size={chunk_size}: the gate-free path is built for chunk_size={GATEFREE_CHUNK}"
    dt = jnp.dtype(dtype)
    if dt.name not in GATEFREE_DTYPES:
        return f"dtype {dt.name}: the gate-free kernel reads {', '.join(GATEFREE_DTYPES)}"
    return None


def _pow2(d: int) -> int:
    return 1 << (int(d) - 1).bit_length()


def _iotas(n):
    return lax.broadcasted_iota(jnp.int32, (n, n), 0), lax.broadcasted_iota(jnp.int32, (n, n), 1)


def _substitute(nt):
    """(I + N)^-1 of one 16 x 16 diagonal block by forward substitution, given its transpose
    ``nt`` = N^T (N strictly lower, float32). Row i of the inverse is e_i - sum_{j<i} N_ij X_j:
    column i of N^T picked by a masked reduction, then one row update; rows below i are still
    e_i, rows above it are final."""
    r, c = _iotas(SUB)
    x = jnp.where(r == c, 1.0, 0.0).astype(F32)
    for i in range(1, SUB):
        a = jnp.sum(jnp.where(c == i, nt, 0.0), axis=1, keepdims=True)  # [16, 1]: N_ij over j
        row = jnp.sum(a * x, axis=0, keepdims=True)  # [1, 16]: sum_j N_ij X_j
        x = jnp.where(r == i, x - row, x)
    return x


def _products(n, mm):
    """(I + N)^-1 of one 16 x 16 diagonal block (N strictly lower, float32) by the recursive block
    formula T_2s = T_s - (T_s L_s) T_s of :func:`gdn_jax.ops.pallas.tiles.inv_unit_lower` (L_s: the
    entries of N in the sub-diagonal s-blocks of each 2s-block): T_2 exact, then three rounds of
    two 16 x 16 products each -- tensor-core work instead of the substitution's 15 dependent row
    steps (``diag="products"``)."""
    r, c = _iotas(SUB)
    t = jnp.where(r == c, 1.0, 0.0).astype(F32) - jnp.where(((r & 1) == 1) & (c == r - 1), n, 0.0)
    s = 2
    while s < SUB:
        lg = s.bit_length() - 1
        bi = r >> lg
        low = jnp.where(((bi & 1) == 1) & ((c >> lg) == bi - 1), n, 0.0)
        t = t - mm(mm(t, low), t)
        s *= 2
    return t


def _kernel(k_ref, bcol_ref, brow_ref, t_ref, *, nb, prec_kk, prec_f32, diag):
    """One chunk: T0 from k [C, K] (input dtype) and beta as a column [C, 1] and a row [1, C]."""
    _store(t_ref, _t0_blocks(k_ref, bcol_ref, brow_ref, nb=nb, prec_kk=prec_kk, prec_f32=prec_f32, diag=diag), nb)


def _t0_blocks(k_ref, bcol_ref, brow_ref, *, nb, prec_kk, prec_f32, diag):
    """The 16 x 16 blocks X[i, j] (j <= i) of one chunk's T0, float32."""
    dims_t = (((1,), (1,)), ((), ()))  # a @ b^T
    dims = (((1,), (0,)), ((), ()))
    kb = [k_ref[SUB * b:SUB * (b + 1), :] for b in range(nb)]

    def gram(b, c):  # K_b K_c^T [16, 16], float32 accumulation
        return lax.dot_general(kb[b], kb[c], dims_t, precision=prec_kk, preferred_element_type=F32)

    def mm(a, b):
        return lax.dot_general(a, b, dims, precision=prec_f32, preferred_element_type=F32)

    r, c = _iotas(SUB)
    X = {}
    for b in range(nb):
        if diag == "substitution":
            # diagonal block of A0, transposed: (A0_bb)^T_ji = beta_i k_i . k_j for i > j (the Gram is symmetric)
            X[b, b] = _substitute(jnp.where(c > r, gram(b, b) * brow_ref[:, SUB * b:SUB * (b + 1)], 0.0))
        else:
            X[b, b] = _products(jnp.where(r > c, gram(b, b) * bcol_ref[SUB * b:SUB * (b + 1), :], 0.0), mm)
    A = {(b, c_): gram(b, c_) * bcol_ref[SUB * b:SUB * (b + 1), :] for b in range(nb) for c_ in range(b)}

    m = 1  # merge groups of m blocks pairwise: X21 = -X22 (A21 X11)
    while m < nb:
        for p in range(0, nb, 2 * m):
            top, bot = range(p, p + m), range(p + m, p + 2 * m)
            Y = {}
            for i in bot:
                for j in top:
                    terms = [mm(A[i, l], X[l, j]) for l in top if l >= j]
                    Y[i, j] = sum(terms[1:], terms[0])
            for i in bot:
                for j in top:
                    terms = [mm(X[i, l], Y[l, j]) for l in bot if l <= i]
                    X[i, j] = -sum(terms[1:], terms[0])
        m *= 2
    return X


def _store(t_ref, X, nb):
    """Write the blocks of :func:`_t0_blocks` into ``t_ref`` [C, C] (the upper ones as zeros)."""
    zero = jnp.zeros((SUB, SUB), t_ref.dtype)
    for i in range(nb):
        for j in range(nb):
            t_ref[SUB * i:SUB * (i + 1), SUB * j:SUB * (j + 1)] = X[i, j].astype(t_ref.dtype) if j <= i else zero


def gatefree_inverse(k, beta, *, chunk_size: int = GATEFREE_CHUNK, cu_seqlens=None, platform: Optional[str] = None,
                     out_dtype=jnp.float32, f32_dot: str = "tf32x3", diag: str = "substitution", num_warps: int = 4,
                     num_stages: int = 2):
    """T0 = (I + strictly_lower(diag(beta) K K^T))^-1 of every chunk, as a Pallas kernel.

    Args:
      k: keys [B, T, Hk, K] (float32, bfloat16 or float16), as the consumer uses them (already
        L2-normalised where the call normalises: the kernel does not normalise).
      beta: write strengths [B, T, H] (H a multiple of Hk: value head h reads key head
        h // (H // Hk)), any floating dtype (read as float32).
      chunk_size: C, one of 16, 32, 64, 128 (the gate-free path uses 64).
      cu_seqlens: int [N + 1] packed-sequence boundaries (B = 1) or None. The chunks are those of
        :func:`gdn_jax.ops.packing.to_chunk_layout`, as every chunked backend lays them out:
        each sequence starts on a chunk boundary, the tail of its last chunk is padding.
      platform: "gpu" (Triton lowering) or "interpret" (CPU); None: that of
        ``jax.default_backend()``. The TPU layouts are not taken.
      out_dtype: float32 (default) or bfloat16 (half the bytes written; ~2^-9 relative).
      f32_dot: Triton precision of float32 operand dots on GPU: "tf32", "tf32x3" (default; ~float32
        accurate) or "ieee" (elsewhere float32 dots are exact to float32: HIGHEST).
      diag: how the 16 x 16 diagonal blocks are inverted: "substitution" (forward substitution, 15
        row steps in registers; default) or "products" (the recursive block formula, six 16 x 16
        products; :func:`_products`). Same T0 to float32 rounding; the benchmark times both.
      num_warps, num_stages: Triton launch settings.

    Returns:
      T0 [B, H, NT, C, C] in ``out_dtype``, NT = ceil(T / C) chunks (with ``cu_seqlens``: the
      chunks of the packed layout). Zero-padded tokens (beta = 0, k = 0) give identity rows.

    Raises:
      TypeError: k or beta not a floating array, k of an unsupported dtype, or a non-integer
        ``cu_seqlens``.
      ValueError: k not [B, T, Hk, K], beta not [B, T, H] with H a multiple of Hk, T = 0, a
        ``cu_seqlens`` that is not [N + 1] or is given with B != 1, an unknown ``out_dtype``,
        ``f32_dot``, ``diag``, ``chunk_size`` or ``platform``, ``num_warps`` not a power of two up to
        32, ``num_stages`` below 1 (TypeError where either is not an int).
      NotImplementedError: K above 256, or a TPU platform.

    Source: REFERENCE §10 (gate-free inverse); the block inverse is the merge of
    :func:`gdn_jax.ops.chunk.unit_lower_inverse`.
    """
    for name, x in (("k", k), ("beta", beta)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
    if k.ndim != 4:
        raise ValueError(f"k must have shape [B, T, Hk, K] (rank 4), got shape {tuple(k.shape)}")
    B, T, Hk, K0 = k.shape
    if beta.ndim != 3 or tuple(beta.shape[:2]) != (B, T):
        raise ValueError(f"beta must have shape [B, T, H] with (B, T) = {(B, T)} of k, got shape {tuple(beta.shape)}")
    H = beta.shape[2]
    if min(T, Hk, K0, H) == 0:
        raise ValueError(f"k and beta need T >= 1, one head and one channel, got k {tuple(k.shape)}, beta "
                         f"{tuple(beta.shape)}")
    if H % Hk:
        raise ValueError(f"beta has {H} heads, k has {Hk}: the value heads must be a multiple of the key heads "
                         f"(value head h reads key head h // (H // Hk))")
    if jnp.dtype(k.dtype).name not in GATEFREE_DTYPES:
        raise TypeError(f"k must be {', '.join(GATEFREE_DTYPES)}, got {k.dtype} (use gdn_jax.ops.gatefree."
                        f"gatefree_t0 for float64)")
    if K0 > _MAX_K:
        raise NotImplementedError(f"the gate-free kernel takes head dims K up to {_MAX_K}, got K={K0}")
    if isinstance(chunk_size, bool) or chunk_size not in _CHUNKS:
        raise ValueError(f"chunk_size must be one of {_CHUNKS}, got {chunk_size!r}")
    if jnp.dtype(out_dtype).name not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {_OUT_DTYPES}, got {jnp.dtype(out_dtype).name}")
    if f32_dot not in _F32_DOTS:
        raise ValueError(f"f32_dot must be one of {_F32_DOTS}, got {f32_dot!r}")
    if diag not in _DIAGS:
        raise ValueError(f"diag must be one of {_DIAGS}, got {diag!r}")
    for name, val in (("num_warps", num_warps), ("num_stages", num_stages)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(val).__name__} {val!r}")
    if num_warps < 1 or num_warps > 32 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps must be a power of two <= 32 (Triton's num_warps: at most 1024 threads), "
                         f"got {num_warps}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages}")
    p = platform or _plat.default_platform()
    if p not in _plat.PLATFORMS:
        raise ValueError(f"platform must be one of {_plat.PLATFORMS} or None, got {platform!r}")
    if _plat.is_tpu_layout(p):
        raise NotImplementedError(f"the gate-free kernel has no TPU layout (platform {p!r}); use 'gpu' or "
                                  f"'interpret'")
    if cu_seqlens is not None:
        if not hasattr(cu_seqlens, "dtype"):
            cu_seqlens = jnp.asarray(cu_seqlens)
        if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
            raise TypeError(f"cu_seqlens must be an integer array, got dtype {cu_seqlens.dtype}")
        if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must have shape [N + 1] with N >= 1, got shape {tuple(cu_seqlens.shape)}")
        if B != 1:
            raise ValueError(f"cu_seqlens (packed sequences) needs batch size B = 1, got k of shape {tuple(k.shape)}")
    if p == "gpu":
        _plat.silence_triton_deprecation_at_lowering()

    C, G = int(chunk_size), H // Hk
    Kp = max(SUB, _pow2(K0))
    if Kp != K0:  # zero channels add nothing to K K^T
        k = jnp.pad(k, [(0, 0)] * 3 + [(0, Kp - K0)])
    (k, beta), Tp, _, _ = _packing.to_chunk_layout((k, beta.astype(F32)), cu_seqlens, C)
    n = Tp // C
    BH = B * H
    b_hm = jnp.moveaxis(beta, 2, 1)  # [B, H, Tp]: tiny, head-major as the kernels' scalar columns
    bcol = b_hm.reshape(BH, Tp, 1)
    brow = b_hm.reshape(BH, n, 1, C)

    def k_map(bh, ci):
        return bh // H, ci, (bh % H) // G, 0

    kdt = jnp.dtype(k.dtype)
    kernel = lambda *refs: _kernel(*refs, nb=C // SUB, prec_kk=_plat.dot_precision(p, kdt, f32_dot),
                                   prec_f32=_plat.dot_precision(p, F32, f32_dot), diag=diag)
    fn = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((BH, n, C, C), jnp.dtype(out_dtype)),
        grid=(BH, n),
        in_specs=[pl.BlockSpec((None, C, None, Kp), k_map),
                  pl.BlockSpec((None, C, 1), lambda bh, ci: (bh, ci, 0)),
                  pl.BlockSpec((None, None, 1, C), lambda bh, ci: (bh, ci, 0, 0))],
        out_specs=pl.BlockSpec((None, None, C, C), lambda bh, ci: (bh, ci, 0, 0)),
        name="gdn_inverse_gatefree",
        **_plat.call_kwargs(p, num_warps=num_warps, num_stages=num_stages, n_grid=2),
    )
    t0 = _plat.invoke(p, fn, k, bcol, brow)
    return t0.reshape(B, H, n, C, C)


# ---------------------------------------------------------------------------------------------
# the kernel-path stage (paths.py "gatefree"): T0 and Aqk on the kernels' own layout


def _t0_aqk_kernel(call, *, k_ref, beta_ref, beta_row_ref, gam_ref, gam_row_ref, t0_ref, q_ref=None, aqk_ref=None):
    """One chunk of the ``gatefree`` forward path: T0 [C, C] (float32) and, with q,
    Aqk = tril(scale Q K^T * Gamma) [C, C] (``call.out_dt``)."""
    kdt = jnp.dtype(call.in_dt)
    prec_kk = _plat.dot_precision(call.platform, kdt, call.f32_inv)
    prec_f32 = _plat.dot_precision(call.platform, F32, call.f32_inv)
    nb = call.C // SUB
    _store(t0_ref, _t0_blocks(k_ref, beta_ref, beta_row_ref, nb=nb, prec_kk=prec_kk, prec_f32=prec_f32,
                              diag="substitution"), nb)
    if q_ref is None:
        return
    q = _t.load_f32(q_ref) * call.scale
    aqk = _t.mm(call, q, k_ref[...], tb=True) * _t.decay_matrix(gam_ref[...], gam_row_ref[...], incl=True)
    aqk_ref[...] = aqk.astype(aqk_ref.dtype)


def t0_and_aqk(call, q, k, beta, gam, gam_row):
    """The inverse stage of the ``gatefree`` forward path (:mod:`.paths`): per (batch x value head,
    chunk) T0 = (I + strictly_lower(diag(beta) K K^T))^-1 and Aqk = tril(scale Q K^T * Gamma); grid
    (B*H, chunks), one chunk per program.

    Args: ``call`` a :class:`~gdn_jax.ops.pallas.call.KernelCall` with the GPU / interpret layout
      ("bthd") and ``C`` a multiple of 16; q, k in the token layout [B, Tp, Hk, K] (K a power of
      two >= 16, as :func:`gdn_jax.ops.pallas.vjp.to_kernel_inputs` pads it); beta, gamma columns
      [BH, Tp, 1] f32; gamma row [BH, n, 1, C].
    Returns ``{"t0": [BH, n, C, C] f32, "aqk": [BH, n, C, C] out_dt}``; with ``q`` None (the
    final-state-only forward) ``{"t0": ...}`` alone.
    """
    C, BH, n = call.C, call.BH, call.n
    if call.layout != "bthd" or C % SUB:
        raise ValueError(f"t0_and_aqk needs the 'bthd' layout and a chunk that is a multiple of {SUB}, got "
                         f"layout {call.layout!r}, C={C}")
    tk = token_spec(call, C, call.K, lambda b, c: (b, c, 0), key=True)
    col = hm_spec(C, 1, lambda b, c: (b, c, 0))
    row = pl.BlockSpec((None, None, 1, C), lambda b, c: (b, c, 0, 0))
    tile = pl.BlockSpec((None, None, C, C), lambda b, c: (b, c, 0, 0))
    inputs = dict(q=None if q is None else (q, tk), k=(k, tk), beta=(beta, col),
                  beta_row=(beta.reshape(BH, n, 1, C), row), gam=(gam, col), gam_row=(gam_row, row))
    outputs = dict(t0=(sds((BH, n, C, C), F32), tile), aqk=(sds((BH, n, C, C), call.out_dt), tile))
    if q is None:
        del outputs["aqk"]
    return run(call, functools.partial(_t0_aqk_kernel, call),
               name="gdn_inverse_gatefree_aqk" if q is not None else "gdn_inverse_gatefree", grid=(BH, n),
               inputs=inputs, outputs=outputs, warps=call.warps_wy)
