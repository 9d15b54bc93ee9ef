"""The Hopper (sm_90, Mosaic GPU) WY stage: the twin of :func:`gdn_jax.ops.pallas.wy.wy_repr`.

* :func:`wy_forward`: the WY representation of every chunk, one CTA per chunk (or
  ``wy_chunks_per_cta`` chunks), the triangular inverse T = (I + A)^-1 by doubling rounds as wgmmas
  (``wy_inverse``, ``wy_precision``); W, U and Aqk, or, in the "t" form, T as a bf16 (hi, lo) pair
  for the state pass; in its backward mode (``do``) also dVl = Aqk^T dO and T.
* :func:`wy_backward`: the backward's WY stage (:func:`wy_forward` with dO).
* :func:`wy_from_saved`: the backward's WY stage from the forward's saved Aqk and T
  (``save_wy``): W, U and dVl, no inverse.

Interpret mode: see :mod:`.common`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..._vma import varying_kernel
from ..call import KernelCall
from .common import (BF16, F32, Transposed, hi_lo_terms, i32, iota, kernel_kw, load_tile, mmas, plgpu_api, smem, split_hi_lo)
from .plan import wy_compact


def scaled_t(t, col, C):
    """A zero-argument function giving T diag(s) as a bf16 (hi, lo) register pair (to ~2^-16) for
    :func:`write_w_u`: ``t`` the float32 [C, C] T in the wgmma layout, ``col`` the [C] scales s in
    the column-broadcast layout (``Layout.WGMMA.reduce(0)``)."""
    return lambda: split_hi_lo(t * lax.broadcast_in_dim(col, (C, C), [1]))


def write_w_u(tw, tu, k_s, v_s, w_s, w_dst, u_dst, C, K, V, interp, sequential=False):
    """W = T diag(beta e^gamma) K and U = T diag(beta) V as bf16x2 products (float32 accumulation):
    ``tw`` / ``tu`` zero-argument functions giving the A operands' (hi, lo) pairs, :func:`scaled_t`
    (the scales on T's columns in registers; ``k_s`` / ``v_s`` the unscaled K and V tiles: no
    rounding of a scaled K or V, no SMEM round trip of the tiles; called when their product is
    issued, so that one pair is live at a time in the sequential form). Written to ``w_dst`` /
    ``u_dst`` by TMA through ``w_s`` and ``v_s``; waits for every copy of the CTA to land. ``sequential``: W first, then U, each in column blocks of at most 128
    (one [C, <= 128] accumulator and one pair live at a time; ``w_s`` may be ``k_s``)."""
    plgpu = plgpu_api()
    if sequential:
        for pair_fn, x_s, dst_s, N, dst in ((tw, k_s, w_s, K, w_dst), (tu, v_s, v_s, V, u_dst)):
            pair = pair_fn()
            # in column blocks of at most 128 (a [C, 128] float32 accumulator: 64 registers)
            for c0 in range(0, N, 128):
                cols = pl.ds(c0, min(128, N))
                xc = x_s if N <= 128 else x_s.at[:, cols]
                (Xm,) = mmas([((C, min(128, N)), pair, (xc, xc))], interp)
                # the wgmma has completed: these columns of x_s are free (W leaves through K's tile)
                (dst_s if N <= 128 else dst_s.at[:, cols])[...] = Xm.astype(dst_s.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dst_s, dst)
        plgpu.wait_smem_to_gmem(0)
        return
    Wm, Um = mmas([((C, K), tw(), (k_s, k_s)), ((C, V), tu(), (v_s, v_s))], interp)
    w_s[...] = Wm.astype(w_s.dtype)
    v_s[...] = Um.astype(v_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(w_s, w_dst)
    plgpu.copy_smem_to_gmem(v_s, u_dst)
    plgpu.wait_smem_to_gmem(0)




def _k_slices(a_hi, a_lo, b_hi, b_lo, slices):
    """bf16x3 terms of ``A @ B`` contracted over the row / column ``slices`` ((start, size) pairs)
    only, where A (registers, hi / lo) and B (SMEM, hi / lo) may be nonzero: (As, Bs) for
    :func:`mmas`; with ``a_lo`` None (``wy_precision="bf16"``) the hi terms alone."""
    As, Bs = (), ()
    for a, n in slices:
        lo = None if a_lo is None else a_lo[:, a:a + n]
        b_lo_ = None if a_lo is None else b_lo.at[pl.ds(a, n)]
        A_, B_ = hi_lo_terms((a_hi[:, a:a + n], lo), (b_hi.at[pl.ds(a, n)], b_lo_), a_lo is not None)
        As, Bs = As + A_, Bs + B_
    return As, Bs


def _round_tiles(hp, pairs):
    """Store each (hi, lo) register pair of a doubling round into its (hi_ref, lo_ref) SMEM tiles
    (the lo tiles only with bf16x3 products, ``hp``), then make the stores visible to wgmma."""
    for (hi, lo), (hi_ref, lo_ref) in pairs:
        hi_ref[...] = hi
        if hp:
            lo_ref[...] = lo
    plgpu_api().commit_smem()


def _blocked_rounds(A, T2, i, j, C, interp, eye_s, tc_hi, tc_lo, lc_hi, lc_lo, hp=True):
    """The doubling rounds of T = (I + A)^-1 that stay inside the 16 x 16 diagonal blocks
    (T_2 -> T_4 -> T_8 -> T_16), computed on those blocks alone (``HopperTuning.wy_inverse="blocked"``).

    A block-diagonal X is kept compressed, ``Xc[r, m] = X[r, 16 (r // 16) + m]`` ([C, 16]); for
    block-diagonal X, Y, ``(X Y)c = sum_b mask_b(Xc) @ Yc[16 b : 16 b + 16]`` with ``mask_b`` the rows
    of block b: one m64n16k16 wgmma per block (bf16x3 as the dense rounds), a quarter of a dense
    round's FLOPs. A's diagonal blocks go to shared memory once (``Ac``, as L's tiles); each round
    ``Pc = (T_s L_s)c`` is ``(T_s A)c`` masked to L_s's blocks (rows of the odd s-blocks, columns of
    the s-block before theirs): T_s is block diagonal, so a row r of an odd s-block meets A only in
    the rows of its own s-block, where L_s = A on those columns -- the same products, so the same
    values as forming and storing L_s per round, without it (one [C, C] where, split and store
    less per round). Then ``Tc <- Tc - (P T)c``, and T_16 is expanded to [C, C] exactly:
    ``T = sum_b mask_b(Tc_hi + Tc_lo) @ I[16 b : 16 b + 16]`` (the identity in ``eye_s``, T_hi's
    tile, in a 32-byte swizzle as a K = 16 wgmma operand needs; the next round overwrites it).
    ``A``: the strictly lower [C, C] matrix; ``T2``: T_2 (full); ``hp``: bf16x3 products (else one
    bf16 wgmma per block, ``HopperTuning.wy_precision="bf16"``). Returns T_16 as a float32 [C, C]
    array."""
    plgpu = plgpu_api()
    nb = C // 16
    rb = iota((C, 16), 0, interp) >> 4
    rl = iota((C, 16), 0, interp) & 15  # the row within its 16-block
    m = iota((C, 16), 1, interp)  # the compressed column: global column 16 (r // 16) + m

    def compress(X):
        out = jnp.where(rb == 0, X[:, 0:16], 0.0)
        for b in range(1, nb):
            out = jnp.where(rb == b, X[:, 16 * b:16 * b + 16], out)
        return out

    def masked(x, b):
        return jnp.where(rb == b, x, jnp.zeros_like(x))

    def terms(hi, lo, b_hi, b_lo):  # bf16x3: hi*B_hi + lo*B_hi + hi*B_lo per block (bf16: hi*B_hi)
        As, Bs = (), ()
        for b in range(nb):
            rows = pl.ds(16 * b, 16)
            A_, B_ = hi_lo_terms((masked(hi, b), masked(lo, b) if hp else None),
                            (b_hi.at[rows], b_lo.at[rows] if hp else None), hp)
            As, Bs = As + A_, Bs + B_
        return As, Bs

    ah, al = split_hi_lo(compress(A), hp)
    lc_hi[...] = ah
    if hp:
        lc_lo[...] = al
    Tc = compress(T2)
    for lg in (1, 2, 3):
        bi = rl >> lg
        th, tl = split_hi_lo(Tc, hp)
        _round_tiles(hp, [((th, tl), (tc_hi, tc_lo))])
        (P,) = mmas([((C, 16), *terms(th, tl, lc_hi, lc_lo))], interp)
        P = jnp.where(((bi & 1) == 1) & ((m >> lg) == bi - 1), P, 0.0)
        ph, pl_ = split_hi_lo(-P, hp)
        (Tc,) = mmas([(Tc, *terms(ph, pl_, tc_hi, tc_lo))], interp)
    eye_s[...] = jnp.where(i == j, 1.0, 0.0).astype(BF16)
    plgpu.commit_smem()
    th, tl = split_hi_lo(Tc)
    As, Bs = [], []
    for b in range(nb):
        As += [masked(th, b), masked(tl, b)]
        Bs += [eye_s.at[pl.ds(16 * b, 16)]] * 2
    (T,) = mmas([((C, C), tuple(As), tuple(Bs))], interp)
    return T


def wy_forward(call: KernelCall, q, k, v, beta, gam, e_gam, do=None, save_t=False, t_form=False, with_w=False):
    """The forward's WY representation on Hopper (the Mosaic GPU twin of
    :func:`gdn_jax.ops.pallas.wy.wy_repr` with ``q``): one CTA per (batch x value head, chunk).

    In SMEM / registers (gamma the in-chunk cumulative log decay, masks applied to exponents)::

        QK, then (Aqk stored) KK = Q K^T, K K^T                wgmma (K transposed in SMEM)
        A   = strictly_lower(beta_i KK_ij e^{gamma_i - gamma_j});  Aqk = tril(scale QK_ij e^{..})
        T   = (I + A)^-1   recursive blocks T_2s = T_s - (T_s L_s) T_s, s = 1 .. C/2
        W   = T diag(beta e^gamma) K,  U = T diag(beta) V      the scales on T's columns (write_w_u)

    The inverse's products can run as bf16x3 (T = T_hi + T_lo in registers, the SMEM operand split
    the same way; three wgmmas, ~2^-16 relative: finer than the TF32 of the Triton kernel); W and U
    as bf16x2 (T diag(s) as a register hi / lo pair against the unscaled bf16 K / V tile); with
    ``HopperTuning.wy_precision="bf16"`` the doubling rounds' products take bf16 operands (one
    wgmma each, float32 accumulation), with ``"bf16_blocks"`` only the rounds inside the 16 x 16
    diagonal blocks (T_2 -> T_16); W, U and T's outputs keep the hi / lo pair.
    Returns ``w`` [BH, T, K], ``u`` [BH, T, V] (bf16) and ``aqk`` [BH, n, C, C] (bf16); with ``do``
    (the backward, :func:`gdn_jax.ops.pallas.hopper.wy.wy_backward`) ``dvl`` = Aqk^T dO [BH, T, V]
    and T as ``t_hi``, ``t_lo`` [BH, n, C, C] (bf16, T = t_hi + t_lo to ~2^-16) instead of ``aqk``;
    with ``save_t`` (the forward of ``HopperTuning.save_wy``) ``t_hi``, ``t_lo`` besides ``aqk``.
    With ``t_form`` (``HopperTuning.fwd_form="t"``: the state pass forms Vn from T, v and the
    state; ``v`` is not read and may be None) ``aqk``, ``t_hi``, ``t_lo`` and, with ``with_w``,
    ``w`` (for the backward), no U. With ``q`` None (the final-state-only forward, whose state pass
    reads no Aqk; not with ``do``) no Q K^T and no ``aqk``: the same results without it.
    """
    plgpu = plgpu_api()
    interp = call.platform == "interpret"
    C, K, V, BH, H, G, n, Tp = call.C, call.K, call.V, call.BH, call.H, call.group, call.n, call.Tp
    in_dt = jnp.dtype(call.in_dt)
    rs = lambda x: x.reshape(BH, n, C)
    # rows: beta, gamma (row-broadcast layout), beta e^gamma, gamma, beta (column-broadcast: W's and
    # U's scales on T's columns) -- an SMEM row is read in one register layout only: JAX 0.11's
    # layout inference finds no solution when one row feeds both layouts
    gates = jnp.stack([rs(beta), rs(gam), rs(beta) * rs(e_gam), rs(gam), rs(beta)], axis=2).astype(F32)
    scale = call.scale

    backward = do is not None
    noq = q is None  # no Aqk (the final-state-only forward)
    if noq and backward:
        raise ValueError("wy_forward: the backward's WY stage (do) needs q")
    blocked = call.wy_inverse == "blocked" and C % 16 == 0 and C >= 32
    # HopperTuning.wy_compact (the forward only): q's tile takes v once Q K^T has read q, Aqk's
    # staging tile is L's hi tile of the inverse's rounds once Aqk has left
    compact = (wy_compact(call) or t_form) and not backward
    has_v = not t_form  # fwd_form="t": no v (compact layout: q, k and the [C, C] tiles)
    # HopperTuning.wy_precision: bf16x3 products (else bf16) in the rounds inside the 16x16 diagonal
    # blocks (T_2 -> T_16) and in the rounds across them (T_16 -> T_64)
    hp_in, hp_across = call.wy_precision == "bf16x3", call.wy_precision != "bf16"

    # scratch tiles by name (T and L as bf16 hi / lo pairs; the lo tiles only where a product
    # uses them: with wy_precision="bf16" the rounds read none, and T's lo part leaves through L
    # hi's tile -- 20 KB less shared memory at C = 64)
    lo_in, lo_any = hp_in, hp_in or hp_across
    # T and L tiles with the blocked inverse in a 32-byte swizzle, so that a wgmma can contract over
    # 16-row slices of them (K = 16)
    sw = 32 if blocked else None
    cc = lambda: smem((C, C), BF16, sw)
    # HopperVariants.wy_chunks_per_cta (the compact forward): m consecutive chunks per CTA, the next
    # chunk's q, k and gates arriving by TMA in a second slot while this one computes
    per = call.wy_per_cta if compact else 1
    S = 2 if per > 1 else 1  # TMA slots of q, k (and v), gates
    if compact:  # q's tile takes v, Aqk's staging tile is L hi's
        scratch = dict(q_s=smem((S, C, K), in_dt), k_s=smem((S, C, K), in_dt), l_hi=cc(), t_hi=cc())
    else:
        scratch = dict(q_s=smem((S, C, K), in_dt), k_s=smem((S, C, K), in_dt), v_s=smem((S, C, V), in_dt),
                       a_s=smem((C, C), BF16), l_hi=cc(), t_hi=cc())
    if lo_any:
        scratch.update(t_lo=cc(), l_lo=cc())
    scratch["g_s"] = plgpu.SMEM((S, 5, C), F32)
    if backward:
        scratch["do_s"] = smem((C, V), in_dt)
    if blocked:  # the compressed rounds' T and L (hi, lo)
        scratch.update(tc_hi=smem((C, 16), BF16), lc_hi=smem((C, 16), BF16))
        if lo_in:
            scratch.update(tc_lo=smem((C, 16), BF16), lc_lo=smem((C, 16), BF16))
    scratch["bars"] = [plgpu.Barrier(num_barriers=S) for _ in range(5 if backward else 4)]  # one per source
    in_names = ([] if noq else ["q_ref"]) + ["k_ref"] + (["v_ref"] if has_v else []) + ["g_ref"]
    in_names += ["do_ref"] if backward else []
    a_out = [] if noq else ["a_ref"]
    if t_form:
        out_names = a_out + ["thi_ref", "tlo_ref"] + (["w_ref"] if with_w else [])
    else:
        out_names = ["w_ref", "u_ref"] + (["dvl_ref", "thi_ref", "tlo_ref"] if backward else
                                          a_out + (["thi_ref", "tlo_ref"] if save_t else []))

    def body(*refs):
        r = dict(zip(in_names + out_names + list(scratch), refs))
        r.setdefault("v_s", r["q_s"])  # compact
        r.setdefault("a_s", r["l_hi"])
        q_ref, k_ref, v_ref, g_ref, do_ref = (r.get(x) for x in ("q_ref", "k_ref", "v_ref", "g_ref", "do_ref"))
        q_s, k_s, v_s, g_s, do_s, bars = (r.get(x) for x in ("q_s", "k_s", "v_s", "g_s", "do_s", "bars"))
        bh = lax.axis_index("bh")
        b, h = lax.div(bh, i32(H)), lax.rem(bh, i32(H))
        hk = lax.div(h, i32(G)) if G > 1 else h
        slot_refs = (q_s, k_s, v_s, g_s)

        def sources(c):
            rows = pl.ds(c * C, C)
            srcs = [None if noq else q_ref.at[b, rows, hk], k_ref.at[b, rows, hk],
                    v_ref.at[b, rows, h] if has_v else None, g_ref.at[bh, c]]
            return srcs + ([do_ref.at[b, rows, h]] if backward else [])

        def issue(c, slot):  # the chunk's first copies (compact: v after Q K^T, into q's tile)
            srcs = sources(c)
            dsts = [x.at[slot] for x in slot_refs] + ([do_s] if backward else [])
            for i in (0, 1, 3) if compact else range(len(srcs)):
                if srcs[i] is not None:  # no q without Aqk
                    plgpu.copy_gmem_to_smem(srcs[i], dsts[i], bars[i].at[slot])

        if per == 1:
            c = lax.axis_index("c")
            issue(c, 0)
            chunk_body(r, bh, c, 0, sources(c))
            return
        c0 = lax.axis_index("c") * i32(per)
        issue(c0, 0)

        def step(t, carry):
            c, slot = c0 + t, lax.rem(t, i32(2))

            @pl.when(c < n)
            def _():
                # the previous chunk's stores have read their tiles (its slot is the next one's)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                pl.when((t + 1 < per) & (c + 1 < n))(lambda: issue(c + 1, 1 - slot))
                chunk_body(r, bh, c, slot, sources(c))
            return carry

        lax.fori_loop(i32(0), i32(per), step, i32(0))
        plgpu.wait_smem_to_gmem(0)

    def chunk_body(r, bh, c, slot, srcs):
        """One chunk of the WY kernel (``r``: the kernel's refs by name), its q, k (v) and gates
        tiles in ``slot``, ``srcs`` its GMEM sources."""
        w_ref, u_ref, a_ref, dvl_ref, thi_ref, tlo_ref, do_s, bars = (r.get(x) for x in (
            "w_ref", "u_ref", "a_ref", "dvl_ref", "thi_ref", "tlo_ref", "do_s", "bars"))
        a_s, t_hi, t_lo, l_hi, l_lo = (r.get(x) for x in ("a_s", "t_hi", "t_lo", "l_hi", "l_lo"))
        small = tuple(r.get(x) for x in ("tc_hi", "tc_lo", "lc_hi", "lc_lo"))
        rows = pl.ds(c * C, C)
        q_s, k_s, g_s = r["q_s"].at[slot], r["k_s"].at[slot], r["g_s"].at[slot]
        v_s = q_s if compact else r["v_s"].at[slot]
        bar = lambda i: bars[i].at[slot] if i < 4 else bars[i].at[0]
        for i in (0, 1, 3) if compact else range(4):
            if not (noq and i == 0):
                plgpu.barrier_wait(bar(i))
        # Q K^T first, Aqk formed and stored, then K K^T: one [C, C] accumulator live at a time (185
        # registers instead of 196; H200 whole forward 0.274 -> 0.265 ms at 4x4096x16x128, 0.475 ->
        # 0.461 at 1x16384x16x128, results/hopper_h200/, measured
        # before W and U took T as t_hi + t_lo, a change not yet timed or checked on the GPU)
        if not noq:
            (qk,) = mmas([((C, C), q_s, Transposed(k_s))], interp)
        if compact and has_v:  # the wgmmas reading q have completed: v lands in its tile during the inverse
            plgpu.copy_gmem_to_smem(srcs[2], v_s, bar(2))
        i, j = iota((C, C), 0, interp), iota((C, C), 1, interp)
        row, col = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
        bcast_r = lambda x: lax.broadcast_in_dim(x, (C, C), [0])
        gam_r = load_tile(g_s.at[1], row, interp)
        dg = (bcast_r(gam_r) - lax.broadcast_in_dim(load_tile(g_s.at[3], col, interp), (C, C), [1]))
        lower, incl = i > j, i >= j
        beta_r = load_tile(g_s.at[0], row, interp)
        e = jnp.exp(jnp.where(incl, dg, 0.0))  # one exp for both: the strict lower part is A's
        if not noq:
            aqk = jnp.where(incl, qk * (scale * e), 0.0)
            a_s[...] = aqk.astype(BF16)
            plgpu.commit_smem()
        if backward:  # dVl = Aqk^T dO; dO's tile then carries dVl out
            plgpu.barrier_wait(bar(4))
            (dvl,) = mmas([((C, V), Transposed(a_s), do_s)], interp)
            do_s[...] = dvl.astype(do_s.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(do_s, dvl_ref.at[bh, rows])
        elif not noq:
            plgpu.copy_smem_to_gmem(a_s, a_ref.at[bh, c])
        (kk,) = mmas([((C, C), k_s, Transposed(k_s))], interp)
        A = jnp.where(lower, kk * bcast_r(beta_r) * e, 0.0)
        # T = (I + A)^-1: T_2 exact, then T_2s = T_s - (T_s L_s) T_s with L_s the sub-diagonal s-blocks
        eye = jnp.where(i == j, 1.0, 0.0)
        T = eye - jnp.where(((i & 1) == 1) & (j == i - 1), A, 0.0)
        lg = 1
        if blocked:  # the rounds inside the 16x16 diagonal blocks on those blocks alone
            T = _blocked_rounds(A, T, i, j, C, interp, t_hi, *small, hp=hp_in)
            lg = 4
        if compact:  # l_hi is Aqk's staging tile: its store must have read it
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        if blocked and (1 << lg) < C:  # A to L's tiles once: each round masks T_s A instead of forming L_s
            ah, al = split_hi_lo(A, hp_across)
            _round_tiles(hp_across, [((ah, al), (l_hi, l_lo))])
        while (1 << lg) < C:
            bi = i >> lg
            mask = ((bi & 1) == 1) & ((j >> lg) == bi - 1)  # L_s's blocks
            hp = hp_in if lg < 4 else hp_across
            th, tl = split_hi_lo(T, hp)
            if blocked:  # contract only where the operand is nonzero: A's odd s-blocks of rows, P's even columns
                _round_tiles(hp, [((th, tl), (t_hi, t_lo))])
                sz = 1 << lg
                odd = [(sz * (2 * t + 1), sz) for t in range(C // (2 * sz))]
                even = [(2 * t * sz, sz) for t in range(C // (2 * sz))]
                # (T_s A) on the odd s-blocks' rows of A = T_s L_s on L_s's blocks (see _blocked_rounds)
                (P,) = mmas([((C, C), *_k_slices(th, tl, l_hi, l_lo, odd))], interp)
                ph, pl_ = split_hi_lo(-jnp.where(mask, P, 0.0), hp)
                (T,) = mmas([(T, *_k_slices(ph, pl_, t_hi, t_lo, even))], interp)
            else:
                lh, ll = split_hi_lo(jnp.where(mask, A, 0.0), hp)
                _round_tiles(hp, [((th, tl), (t_hi, t_lo)), ((lh, ll), (l_hi, l_lo))])
                (P,) = mmas([((C, C), *hi_lo_terms((th, tl), (l_hi, l_lo), hp))], interp)
                ph, pl_ = split_hi_lo(-P, hp)
                (T,) = mmas([(T, *hi_lo_terms((ph, pl_), (t_hi, t_lo), hp))], interp)
            lg += 1
        if t_form:  # T (hi, lo) for the state pass (and the backward); W only where the backward reuses it
            th, tl = split_hi_lo(T)
            tlo_s = l_hi if t_lo is None else t_lo  # the rounds' last wgmma reading L hi has completed
            t_hi[...], tlo_s[...] = th, tl
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(t_hi, thi_ref.at[bh, c])
            plgpu.copy_smem_to_gmem(tlo_s, tlo_ref.at[bh, c])
            if with_w:  # W = T diag(beta e^gamma) K, the scales on T's columns (see write_w_u)
                (Wm,) = mmas([((C, K), scaled_t(T, load_tile(g_s.at[2], col, interp), C)(), (k_s, k_s))], interp)
                k_s[...] = Wm.astype(k_s.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(k_s, w_ref.at[bh, rows])
            plgpu.wait_smem_to_gmem(0)
            return
        # W = T diag(beta e^gamma) K, U = T diag(beta) V: the scales on T's columns (write_w_u), T
        # taken as its (hi, lo) pair's sum -- the T that the gradient kernel and wy_from_saved read
        th, tl = split_hi_lo(T)
        T = th.astype(F32) + tl.astype(F32)
        if backward or save_t:  # T for the gradient kernel (and the backward's WY), as its (hi, lo) pair
            tlo_s = l_hi if t_lo is None else t_lo  # the rounds' last wgmma reading L hi has completed
            t_hi[...], tlo_s[...] = th, tl
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(t_hi, thi_ref.at[bh, c])
            plgpu.copy_smem_to_gmem(tlo_s, tlo_ref.at[bh, c])
        tw, tu = scaled_t(T, load_tile(g_s.at[2], col, interp), C), scaled_t(T, load_tile(g_s.at[4], col, interp), C)
        if compact:  # W leaves through K's tile, U through v's (q's), one after the other
            plgpu.barrier_wait(bar(2))
            write_w_u(tw, tu, k_s, v_s, k_s, w_ref.at[bh, rows], u_ref.at[bh, rows], C, K, V, interp,
                      sequential=True)
        else:
            write_w_u(tw, tu, k_s, v_s, q_s, w_ref.at[bh, rows], u_ref.at[bh, rows], C, K, V, interp,
                      sequential=max(K, V) > 128)  # K or V = 256: one [C, 128] accumulator at a time

    kw = kernel_kw(call, "wy")  # HopperTuning.auto_barriers (see sync_own_barriers)
    qa = () if noq else (q,)
    if t_form:
        out_type = [jax.ShapeDtypeStruct((BH, n, C, C), BF16)] * (2 if noq else 3)
        out_type += [jax.ShapeDtypeStruct((BH, Tp, K), in_dt)] if with_w else []
        fn = varying_kernel(plgpu.kernel, body, out_type=tuple(out_type), scratch_types=list(scratch.values()),
                            grid=(BH, pl.cdiv(n, per)), grid_names=("bh", "c"), **kw)
        return dict(zip((() if noq else ("aqk",)) + ("t_hi", "t_lo", "w"), fn(*qa, k, gates)))
    out_type = [jax.ShapeDtypeStruct((BH, Tp, K), in_dt), jax.ShapeDtypeStruct((BH, Tp, V), in_dt)]
    if backward:
        out_type += [jax.ShapeDtypeStruct((BH, Tp, V), in_dt)] + [jax.ShapeDtypeStruct((BH, n, C, C), BF16)] * 2
    else:
        out_type += [jax.ShapeDtypeStruct((BH, n, C, C), BF16)] * ((2 if save_t else 0) + (0 if noq else 1))
    fn = varying_kernel(plgpu.kernel, body, out_type=tuple(out_type), scratch_types=list(scratch.values()),
                        grid=(BH, pl.cdiv(n, per)), grid_names=("bh", "c"), **kw)
    if backward:
        w, u, dvl, t_hi, t_lo = fn(q, k, v, gates, do)
        return dict(w=w, u=u, dvl=dvl, t_hi=t_hi, t_lo=t_lo)
    names = ("w", "u") + (() if noq else ("aqk",)) + (("t_hi", "t_lo") if save_t else ())
    return dict(zip(names, fn(*qa, k, v, gates)))


def wy_from_saved(call: KernelCall, k, v, do, beta, e_gam, aqk, t_hi, t_lo):
    """The backward's WY stage from the forward's saved Aqk and T (``HopperTuning.save_wy``): one
    CTA per (batch x value head, chunk)::

        W = T diag(beta e^gamma) K,  U = T diag(beta) V   bf16x2 (T = t_hi + t_lo in registers, the
                                                          scales on its columns: hopper.wy.write_w_u)
        dVl = Aqk^T dO                               Aqk transposed in SMEM

    No K K^T / Q K^T and no inverse (the dependent chain of :func:`wy_backward`). Arguments: k, v,
    dO in the token layout; beta, e^gamma [BH, T, 1] f32; ``aqk``, ``t_hi``, ``t_lo`` [BH, n, C, C]
    bf16 from :func:`gdn_jax.ops.pallas.hopper.wy.wy_forward` (``save_t=True``). Returns ``w``, ``u``,
    ``dvl`` as :func:`wy_backward` ([BH, Tp, *]: T padded to whole chunks; T is the caller's)."""
    plgpu = plgpu_api()
    interp = call.platform == "interpret"
    C, K, V, BH, H, G, n, Tp = call.C, call.K, call.V, call.BH, call.H, call.group, call.n, call.Tp
    in_dt = jnp.dtype(call.in_dt)
    rs = lambda x: x.reshape(BH, n, C)
    gates = jnp.stack([rs(beta), rs(beta) * rs(e_gam)], axis=2).astype(F32)
    WG = plgpu.Layout.WGMMA
    COL = WG.reduce(0)

    def body(k_ref, v_ref, do_ref, g_ref, a_ref, th_ref, tl_ref, w_ref, u_ref, dvl_ref,
             k_s, v_s, do_s, g_s, a_s, th_s, tl_s, bars):
        bh, c = lax.axis_index("bh"), lax.axis_index("c")
        b, h = lax.div(bh, i32(H)), lax.rem(bh, i32(H))
        hk = lax.div(h, i32(G)) if G > 1 else h
        rows = pl.ds(c * C, C)
        srcs = (k_ref.at[b, rows, hk], v_ref.at[b, rows, h], do_ref.at[b, rows, h], g_ref.at[bh, c],
                a_ref.at[bh, c], th_ref.at[bh, c], tl_ref.at[bh, c])
        for i, (src, dst) in enumerate(zip(srcs, (k_s, v_s, do_s, g_s, a_s, th_s, tl_s))):
            plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
        for i in (3, 4, 2):  # gates, Aqk, dO: dVl first (its operands arrive first)
            plgpu.barrier_wait(bars.at[i])
        (dvl,) = mmas([((C, V), Transposed(a_s), do_s)], interp)
        for i in (0, 1, 5, 6):
            plgpu.barrier_wait(bars.at[i])
        do_s[...] = dvl.astype(do_s.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(do_s, dvl_ref.at[bh, rows])
        # T = t_hi + t_lo in registers, the scales on its columns: the same operands as the forward's
        # (H200 4x4096x16x128: 0.140-0.153 ms, row-scaled K / V tiles 0.145-0.146: the same)
        t = load_tile(th_s, WG, interp).astype(F32) + load_tile(tl_s, WG, interp).astype(F32)
        write_w_u(scaled_t(t, load_tile(g_s.at[1], COL, interp), C), scaled_t(t, load_tile(g_s.at[0], COL, interp), C),
                  k_s, v_s, k_s, w_ref.at[bh, rows], u_ref.at[bh, rows], C, K, V, interp)

    scratch = [smem((C, K), in_dt), smem((C, V), in_dt), smem((C, V), in_dt), plgpu.SMEM((2, C), F32),
               smem((C, C), BF16), smem((C, C), BF16), smem((C, C), BF16), plgpu.Barrier(num_barriers=7)]
    out_type = (jax.ShapeDtypeStruct((BH, Tp, K), in_dt), jax.ShapeDtypeStruct((BH, Tp, V), in_dt),
                jax.ShapeDtypeStruct((BH, Tp, V), in_dt))
    # HopperTuning.auto_barriers: one of the "wy" kernels (no thread load of a tile it overwrites:
    # dVl and W / U land in tiles that only a completed wgmma has read, as in the forward WY)
    kw = kernel_kw(call, "wy")
    fn = varying_kernel(plgpu.kernel, body, out_type=out_type, scratch_types=scratch, grid=(BH, n), grid_names=("bh", "c"), **kw)
    w, u, dvl = fn(k, v, do, gates, aqk.astype(BF16), t_hi, t_lo)
    return dict(w=w, u=u, dvl=dvl)


def wy_backward(call: KernelCall, q, k, v, do, beta, gam, e_gam):
    """The backward's WY stage on Hopper: :func:`wy_forward` with dO. Returns ``w``, ``u``,
    ``dvl`` = Aqk^T dO [BH, T, *] and T = ``t_hi`` + ``t_lo`` [BH, n, C, C] (bf16)."""
    return wy_forward(call, q, k, v, beta, gam, e_gam, do=do)
