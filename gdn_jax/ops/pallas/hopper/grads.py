"""The Hopper (sm_90, Mosaic GPU) gradient kernel of the backward: the twin of
:func:`gdn_jax.ops.pallas.grads.chunk_grads` at a kernel chunk of C = 64. With S = h_n the state
entering chunk n and dS = dh_n the gradient of the state leaving it:

* :func:`chunk_grads` (one CTA per chunk): every local gradient, ordered to keep at most two
  [C, K] float32 accumulators live and the masks / decay matrices recomputed per phase; dA =
  -strict((T^T dVn) Vn^T) by default (``grad_t_phase="chain"``: dT = (dVn Vn^T)(I + A)^T, over V
  only, see :func:`gdn_jax.ops.pallas.grads._grad_kernel_ksplit`, then T^T dT T^T); dX = T^T dW formed as
  -(T^T dVn) S^T (:func:`_dx`); products with T and T^T dVn as bf16x3 or bf16x2 (hi, lo pairs),
  the T phase's last products per ``grad_precision``, the rest bf16 with float32 accumulation, as
  the Triton kernel's intermediates.

* :func:`chunk_grads_blocks`: K > 128 (``wide_backward="hopper"``): the same kernel on
  (key block, value block) tiles of h_n and dh_n, summed.

Interpret mode: see :mod:`.common`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..._vma import varying_kernel
from ..call import KernelCall
from .common import (BF16, F32, Transposed, hi_lo_terms, i32, iota, kernel_kw, load_tile, mmas, plgpu_api, smem, split_hi_lo, sync_own_barriers, zero_acc)
from .plan import block_call


def _grad_gates(call: KernelCall, beta, gam, e_gam, e_gam_end):
    """The gradient kernels' per-chunk gate rows [BH, n, 5, C] f32: beta, gamma (row use), gamma
    (column use), e^gamma, e^{gamma_C - gamma} (one register layout per row)."""
    rs = lambda x: x.reshape(call.BH // (call.grad_blocks[0] * call.grad_blocks[1]), call.n, call.C)
    return jnp.stack([rs(beta), rs(gam), rs(gam), rs(e_gam), rs(e_gam_end)], axis=2).astype(F32)


def _grad_sources(call: KernelCall, bh, c, q_ref, k_ref, v_ref, do_ref, g_ref, h_ref, dh_ref, vn_ref, dvn_ref,
                  th_ref, tl_ref):
    """(batch, value head, the chunk's token rows, the eleven GMEM sources of the gradient kernels'
    TMA copies in their SMEM order: q, k, v, dO, gates, h, dh, Vn, dVn, T hi, T lo) of CTA (bh, c)."""
    H, G, C = call.H, call.group, call.C
    b, hh = lax.div(bh, i32(H)), lax.rem(bh, i32(H))
    rows = pl.ds(c * C, C)
    nk, nv = call.grad_blocks
    if (nk, nv) != (1, 1):  # chunk_grads_blocks: virtual head hh = (head, key block, value block)
        K, V = call.K, call.V
        head = lax.div(hh, i32(nk * nv))
        kb, vb = lax.rem(lax.div(hh, i32(nv)), i32(nk)), lax.rem(hh, i32(nv))
        bhr = b * i32(H // (nk * nv)) + head  # the real batch x head row of the per-head arrays
        hk = lax.div(head, i32(G)) if G > 1 else head
        ks, vs = pl.ds(kb * K, K), pl.ds(vb * V, V)
        srcs = (q_ref.at[b, rows, hk, ks], k_ref.at[b, rows, hk, ks], v_ref.at[b, rows, head, vs],
                do_ref.at[b, rows, head, vs], g_ref.at[bhr, c], h_ref.at[bhr, c, ks, vs], dh_ref.at[bhr, c, ks, vs],
                vn_ref.at[bhr, rows, vs], dvn_ref.at[bhr, rows, vs], th_ref.at[bhr, c], tl_ref.at[bhr, c])
        return b, hh, rows, srcs
    hk = lax.div(hh, i32(G)) if G > 1 else hh
    srcs = (q_ref.at[b, rows, hk], k_ref.at[b, rows, hk], v_ref.at[b, rows, hh], do_ref.at[b, rows, hh],
            g_ref.at[bh, c], h_ref.at[bh, c], dh_ref.at[bh, c], vn_ref.at[bh, rows], dvn_ref.at[bh, rows],
            th_ref.at[bh, c], tl_ref.at[bh, c])
    return b, hh, rows, srcs


def _t_phase(C, k_s, vn_s, dvn_s, th_s, tl_s, x_hi, x_lo, dkk_s, beta_r, masks, gamma, interp, hp=True,
             direct=False, y=None, V=None):
    """The gradient kernels' T phase (both :func:`chunk_grads` variants): T = (I + A)^-1 with
    A = strict(beta K K^T * Gamma); dT = (dVn Vn^T)(I + A)^T, dA = -strict(T^T dT T^T),
    dKK = dA * Gamma. Writes dKK (bf16) into ``dkk_s`` and beta * dKK into ``x_lo`` (the operand of
    dk += (beta dKK)^T K), committed; returns M = dA * A [C, C] float32 (its row / column sums are
    gate gradients). ``x_hi`` / ``x_lo``: two [C, C] bf16 scratch tiles; ``masks()`` and
    ``gamma(mask)`` are the kernel's (strict, inclusive, diagonal) masks and masked decay matrix;
    ``hp``: the three C x C x C products as bf16x3 (else one bf16 wgmma each, T as its hi part:
    ``HopperTuning.grad_precision="bf16"``).

    ``direct`` (``HopperTuning.grad_t_phase="direct"``): since T (I + A) = I, (I + A)^T T^T = I and
    dA = -strict(T^T (dVn Vn^T) (I + A)^T T^T) = -strict((T^T dVn) Vn^T): two products instead of
    three chained ones, Y = T^T dVn [C, V] (T's hi / lo pair against dVn; ``y``, when the caller
    has it already, skips it) and Y Vn^T (Y as a bf16 hi / lo pair; with ``hp`` False T's and Y's hi
    parts alone); ``x_hi`` is not used. The identity holds for the T that the forward used to the
    accuracy of its inverse (~1.7e-4 with the default bf16 rounds), below the kernels' bf16
    rounding."""
    plgpu = plgpu_api()
    bc_r = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])

    def finish(dar, a, gs):  # dA = -strict(dar); M = dA * A, dKK = dA * Gamma (and beta dKK) to SMEM
        strict, _, _ = masks()
        da = jnp.where(strict, -dar, 0.0)
        dkk = da * gs
        dkk_s[...] = dkk.astype(BF16)
        x_lo[...] = (dkk * bc_r(beta_r, (C, C))).astype(BF16)
        plgpu.commit_smem()
        return da * a

    if direct:
        kk_spec = ((C, C), k_s, Transposed(k_s))
        dar_spec = lambda yh, yl: ((C, C), (yh, yl) if hp else (yh,), (Transposed(vn_s), Transposed(vn_s)) if hp else (Transposed(vn_s),))
        if y is None:
            kk, y = mmas([kk_spec, ((C, V), (Transposed(th_s), Transposed(tl_s)) if hp else (Transposed(th_s),),
                                     (dvn_s, dvn_s) if hp else (dvn_s,))], interp)
            (dar,) = mmas([dar_spec(*split_hi_lo(y, hp))], interp)
        else:  # K K^T and Y Vn^T in one round (y: float32, or its (hi, lo) pair)
            kk, dar = mmas([kk_spec, dar_spec(*(y if isinstance(y, tuple) else split_hi_lo(y, hp)))], interp)
        strict, _, _ = masks()
        gs = gamma(strict)
        return finish(dar, kk * bc_r(beta_r, (C, C)) * gs, gs)
    kk, p = mmas([((C, C), k_s, Transposed(k_s)), ((C, C), dvn_s, Transposed(vn_s))], interp)
    strict, _, diag = masks()
    gs = gamma(strict)
    a = kk * bc_r(beta_r, (C, C)) * gs
    ia_hi, ia_lo = split_hi_lo(a + jnp.where(diag, 1.0, 0.0), hp)
    x_hi[...] = ia_hi
    if hp:
        x_lo[...] = ia_lo
    plgpu.commit_smem()
    (dt,) = mmas([((C, C), *hi_lo_terms(split_hi_lo(p, hp), (Transposed(x_hi), Transposed(x_lo)), hp))], interp)
    dth, dtl = split_hi_lo(dt, hp)
    x_hi[...] = dth  # the wgmma above has completed: its operands are free
    if hp:
        x_lo[...] = dtl
    plgpu.commit_smem()
    (r,) = mmas([((C, C), *hi_lo_terms((Transposed(th_s), Transposed(tl_s)), (x_hi, x_lo), hp))], interp)
    (ra,) = mmas([((C, C), *hi_lo_terms(split_hi_lo(r, hp), (Transposed(th_s), Transposed(tl_s)), hp))], interp)
    return finish(ra, a, gs)


def _dx(y, h_s, C, K, interp):
    """dX = T^T dW of the gradient kernels' W phase (W = T X, Vn = U - W S, dW = -dVn S^T) as
    -(T^T dVn) S^T: ``y`` = T^T dVn [C, V] float32 (the dv product's) as a bf16 hi / lo register
    pair against the stored bf16 state ``h_s`` [K, V] (S^T from SMEM), two wgmmas in one round.
    Exact by associativity; against the former dW = -dVn S^T then T^T dW, one round and a [C, K]
    SMEM round trip less, and dW is never rounded to bf16 -- where Vn cancels (repeated keys, the
    state predicting v) the two-warpgroup kernel's single-bf16 dW made dbeta 2-7x less accurate
    (K = V = 128, four draws: 1.1-1.8e-1 against 2.4-5.8e-2 vs float64). ``y`` may be given as
    its (hi, lo) pair already (the two-warpgroup kernel splits it once, before its T phase)."""
    yh, yl = y if isinstance(y, tuple) else split_hi_lo(y)
    (dx,) = mmas([((C, K), (yh, yl), (Transposed(h_s), Transposed(h_s)))], interp)
    return -dx


def chunk_grads(call: KernelCall, q, k, v, do, beta, gam, e_gam, e_gam_end, h, dh, vn, dvn, t_hi, t_lo):
    """The gradient kernel on Hopper (the twin of :func:`gdn_jax.ops.pallas.grads.chunk_grads`
    without the d e^{gamma_C} output, which :func:`reverse_states` computes): grid (B*H, chunks).

    Args: q, k, v, dO in the token layout (input dtype); beta, gamma, e^gamma, e^{gamma_C - gamma}
      columns [BH, T, 1] f32; h, dh [BH, n, K, V] bf16; vn, dvn [BH, T, V] bf16; T = t_hi + t_lo
      [BH, n, C, C] bf16.
    Returns a dict: ``dq, dk`` (per VALUE head) and ``dv`` in the token layout (input dtype);
      ``dbeta, dgam, de_gam, de_gam_end`` [BH, T, 1] and ``dgam_row`` [BH, n, 1, C], f32.
    """
    if call.grad_wgs == 2:
        return _chunk_grads_2wg(call, q, k, v, do, beta, gam, e_gam, e_gam_end, h, dh, vn, dvn, t_hi, t_lo)
    plgpu = plgpu_api()
    interp = call.platform == "interpret"
    C, K, V, BH, H, n, Tp = call.C, call.K, call.V, call.BH, call.H, call.n, call.Tp
    B = BH // H
    in_dt = jnp.dtype(call.in_dt)
    scale = call.scale
    gates = _grad_gates(call, beta, gam, e_gam, e_gam_end)
    WG = plgpu.Layout.WGMMA
    ROW, COL = WG.reduce(1), WG.reduce(0)

    def body(q_ref, k_ref, v_ref, do_ref, g_ref, h_ref, dh_ref, vn_ref, dvn_ref, th_ref, tl_ref,
             dq_ref, dk_ref, dv_ref, sc_ref,
             q_s, k_s, v_s, do_s, g_s, h_s, dh_s, vn_s, dvn_s, th_s, tl_s, sc_s, bars):
        bh, c = lax.axis_index("bh"), lax.axis_index("c")
        b, hh, rows, srcs = _grad_sources(call, bh, c, q_ref, k_ref, v_ref, do_ref, g_ref, h_ref, dh_ref, vn_ref,
                                          dvn_ref, th_ref, tl_ref)
        dsts = (q_s, k_s, v_s, do_s, g_s, h_s, dh_s, vn_s, dvn_s, th_s, tl_s)
        for i, (src, dst) in enumerate(zip(srcs, dsts)):
            plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
        wait = lambda *ix: [plgpu.barrier_wait(bars.at[i]) for i in ix]
        ld = lambda ref, lay=WG: load_tile(ref, lay, interp)
        bc_r = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])  # a per-row vector across columns
        wait(0, 1, 3, 4, 5, 7)
        beta_r, gam_r, eg_r, ee_r = (ld(g_s.at[r], ROW) for r in (0, 1, 3, 4))

        # masks and decay matrices are recomputed in each phase rather than kept live: each is a
        # [C, C] register tile, and the phases' accumulators need the registers
        def masks():
            i_, j_ = iota((C, C), 0, interp), iota((C, C), 1, interp)
            return i_ > j_, i_ >= j_, i_ == j_

        def gamma(m):  # Gamma_ij = exp(gamma_i - gamma_j) on the mask m, exponent masked first
            dgm = bc_r(gam_r, (C, C)) - lax.broadcast_in_dim(ld(g_s.at[2], COL), (C, C), [1])
            return jnp.where(m, jnp.exp(jnp.where(m, dgm, 0.0)), 0.0)

        # 1. the Q path: O = (Q e^gamma scale) S + Aqk Vn, Aqk = scale tril(Q K^T * Gamma)
        dqg, dAqk, qk = mmas([((C, K), do_s, Transposed(h_s)), ((C, C), do_s, Transposed(vn_s)), ((C, C), q_s, Transposed(k_s))], interp)
        strict, incl, _ = masks()
        gi = gamma(incl)
        m_q = jnp.where(strict, dAqk * qk * gi * scale, 0.0)
        dgam = jnp.sum(m_q, axis=1)
        cgam = jnp.sum(m_q, axis=0)
        dqk = dAqk * gi
        de_gam = jnp.sum(dqg * ld(q_s).astype(F32), axis=1) * scale

        def q_phase(dqk_s):
            dqk_s[...] = dqk.astype(BF16)
            plgpu.commit_smem()
            return mmas([(dqg * bc_r(eg_r, (C, K)), dqk.astype(BF16), k_s), (zero_acc((C, K), interp), Transposed(dqk_s), q_s)],
                         interp)

        dq, dk = pl.run_scoped(q_phase, smem((C, C), BF16))
        q_s[...] = (dq * scale).astype(q_s.dtype)  # q_s is free: dq leaves through it
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_s, dq_ref.at[b, rows, hh])
        dk = dk * scale

        # 2. S' = e^{gamma_C} S + (K e^{gamma_C - gamma})^T Vn: dK += (Vn dS^T) e^{gamma_C - gamma}
        wait(6, 8, 9, 10, 2)
        # 3. U = T (beta V): dv = beta * (T^T dVn), dbeta += rowsum(T^T dVn * v) (issued with step 2's)
        dkd, dvb = mmas([((C, K), vn_s, Transposed(dh_s)), ((C, V), (Transposed(th_s), Transposed(tl_s)), (dvn_s, dvn_s))], interp)
        de_end = jnp.sum(dkd * ld(k_s).astype(F32), axis=1)
        dk = dk + dkd * bc_r(ee_r, (C, K))
        dbeta = jnp.sum(dvb * ld(v_s).astype(F32), axis=1)
        v_s[...] = (dvb * bc_r(beta_r, (C, V))).astype(v_s.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(v_s, dv_ref.at[b, rows, hh])

        def tw_phases(dkk_s):
            # 4. T = (I + A)^-1, A = strict(beta K K^T * Gamma): dT = (dVn Vn^T)(I + A)^T,
            #    dA = -strict(T^T dT T^T), M = dA * A (+ the Q path's), dKK = dA * Gamma;
            #    dk += (beta dKK)^T K = dKK^T (beta K); dKK stays in SMEM for step 5
            def t_phase(x_hi, x_lo):
                m = _t_phase(C, k_s, vn_s, dvn_s, th_s, tl_s, x_hi, x_lo, dkk_s, beta_r, masks, gamma, interp,
                             hp=call.grad_precision == "bf16x3", direct=call.grad_tp == "direct", y=dvb, V=V)
                (dk2,) = mmas([(dk, Transposed(x_lo), k_s)], interp)
                return jnp.sum(m, axis=1), jnp.sum(m, axis=0), dk2

            dg, cg, dk2 = pl.run_scoped(t_phase, smem((C, C), BF16), smem((C, C), BF16))

            # 5. Vn = U - W S, W = T X (X = beta e^gamma K): dX = T^T dW with dW = -dVn S^T, formed as
            #    -(T^T dVn) S^T from dv's T^T dVn (see _dx); d(beta K) = dX e^gamma + dKK K
            dx = _dx(dvb, h_s, C, K, interp)
            deg = jnp.sum(dx * ld(k_s).astype(F32), axis=1) * beta_r
            (dkb,) = mmas([(dx * bc_r(eg_r, (C, K)), dkk_s, k_s)], interp)
            return dg, cg, dk2, deg, dkb

        dg, cg, dk, deg, dkb = pl.run_scoped(tw_phases, smem((C, C), BF16))
        dgam = dgam + dg
        cgam = cgam + cg
        de_gam = de_gam + deg
        dk = dk + dkb * bc_r(beta_r, (C, K))
        dbeta = dbeta + jnp.sum(dkb * ld(k_s).astype(F32), axis=1)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        k_s[...] = dk.astype(k_s.dtype)
        sc_s[0] = dbeta
        sc_s[1] = dgam
        sc_s[2] = -cgam
        sc_s[3] = de_gam
        sc_s[4] = de_end
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_s, dk_ref.at[b, rows, hh])
        plgpu.copy_smem_to_gmem(sc_s, sc_ref.at[bh, c])
        plgpu.wait_smem_to_gmem(0)

    scratch = [smem((C, K), in_dt), smem((C, K), in_dt), smem((C, V), in_dt), smem((C, V), in_dt),
               plgpu.SMEM((5, C), F32), smem((K, V), BF16), smem((K, V), BF16), smem((C, V), BF16),
               smem((C, V), BF16), smem((C, C), BF16), smem((C, C), BF16), plgpu.SMEM((5, C), F32),
               plgpu.Barrier(num_barriers=11)]
    out_type = (jax.ShapeDtypeStruct((B, Tp, H, K), in_dt), jax.ShapeDtypeStruct((B, Tp, H, K), in_dt),
                jax.ShapeDtypeStruct((B, Tp, H, V), in_dt), jax.ShapeDtypeStruct((BH, n, 5, C), F32))
    kw = kernel_kw(call)
    fn = varying_kernel(plgpu.kernel, body, out_type=out_type, scratch_types=scratch, grid=(BH, n), grid_names=("bh", "c"), **kw)
    dq, dk, dv, sc = fn(q, k, v, do, gates, h.astype(BF16), dh.astype(BF16), vn.astype(BF16), dvn.astype(BF16),
                        t_hi, t_lo)
    col = lambda r: sc[:, :, r].reshape(BH, Tp, 1)
    return dict(dq=dq, dk=dk, dv=dv, dbeta=col(0), dgam=col(1), dgam_row=sc[:, :, 2].reshape(BH, n, 1, C),
                de_gam=col(3), de_gam_end=col(4))


def _chunk_grads_2wg(call: KernelCall, q, k, v, do, beta, gam, e_gam, e_gam_end, h, dh, vn, dvn, t_hi, t_lo):
    """:func:`chunk_grads` with two warpgroups per CTA (``HopperTuning.grad_warpgroups=2``): the
    same gradients, the work split so that the two wgmma chains run side by side and meet once.

    * warpgroup 0: the Q path (dq; dk, d gamma, d e^gamma terms), with ``grad_t_phase="chain"``
      the T phase (dA, dKK, see :func:`_t_phase`), then dk += (beta dKK)^T K and dKK K (dk += beta
      dKK K, its dbeta term);
    * warpgroup 1: dv = beta T^T dVn (dbeta), dKd = Vn dS^T (dk += e^{gamma_C - gamma} dKd,
      d e^{gamma_C - gamma}), with ``grad_t_phase="direct"`` (the default) the T phase from the
      T^T dVn it has (dA = -strict((T^T dVn) Vn^T); dKK and beta dKK go to warpgroup 0 through
      shared memory and a barrier), the W phase's dX = T^T dW = -(T^T dVn) S^T (:func:`_dx`; dk +=
      beta e^gamma dX, its dbeta and d e^gamma terms), then its dk partial (bf16) into shared
      memory and one barrier arrival; warpgroup 0 adds it and writes dk.

    Against the one-warpgroup kernel: the dk partial is a single bf16 operand; the scalar rows
    come out as seven (nine with the T phase in warpgroup 1) partial rows, summed here.
    Shared memory: :func:`grads_smem_bytes` (219 KB at K = V = 128). Interpret mode runs the two
    warpgroups' work in turn in one thread (see the comment at the end of the body)."""
    plgpu = plgpu_api()
    interp = call.platform == "interpret"
    C, K, V, BH, H, n, Tp = call.C, call.K, call.V, call.BH, call.H, call.n, call.Tp
    B = BH // H
    in_dt = jnp.dtype(call.in_dt)
    scale = call.scale
    gates = _grad_gates(call, beta, gam, e_gam, e_gam_end)
    WG = plgpu.Layout.WGMMA
    ROW, COL = WG.reduce(1), WG.reduce(0)
    # grad_t_phase="direct": the T phase runs in warpgroup 1, which has T^T dVn from its dv product
    # (warpgroup 0 would form it again), and hands dKK / beta dKK to warpgroup 0 through x_hi / x_lo
    tp1 = call.grad_tp == "direct"
    # output rows: dbeta (wg 0), dgam, -cgam, de_gam (wg 0), de_gam_end, dbeta (wg 1), de_gam (wg 1)
    # (+ with tp1: the T phase's dgam and -cgam terms, wg 1)
    NSC = 9 if tp1 else 7

    per_cta = call.grad_per_cta  # chunks per CTA: > 1 runs the persistent, prefetching kernel
    pf = per_cta > 1

    def body(q_ref, k_ref, v_ref, do_ref, g_ref, h_ref, dh_ref, vn_ref, dvn_ref, th_ref, tl_ref,
             dq_ref, dk_ref, dv_ref, sc_ref,
             q_s, k_s, v_s, do_s, g_s, h_s, dh_s, vn_s, dvn_s, th_s, tl_s, sc_s, dkk_s, x_hi, x_lo, dw_s,
             bars, dk_bar, *sync):
        bh = lax.axis_index("bh")
        c0 = lax.axis_index("c") * i32(per_cta) if pf else lax.axis_index("c")
        dsts = (q_s, k_s, v_s, do_s, g_s, h_s, dh_s, vn_s, dvn_s, th_s, tl_s)
        # the persistent kernel's two in-CTA barriers: h_s free (both warpgroups done with it) and
        # warpgroup 1 done with Vn, dVn and T (after its T phase); with tp1: dKK in x_hi / x_lo
        # (warpgroup 1 -> 0) and, persistent kernel, x_hi / x_lo read (warpgroup 0 -> 1)
        sync = list(sync)
        dkk_bar = sync.pop(0) if tp1 else None
        x_free = sync.pop(0) if tp1 and pf else None
        h_free, t_free = sync if pf else (None, None)

        def sources(c):
            return _grad_sources(call, bh, c, q_ref, k_ref, v_ref, do_ref, g_ref, h_ref, dh_ref, vn_ref, dvn_ref,
                                 th_ref, tl_ref)

        if not pf:  # one chunk: its sources once
            src0 = sources(c0)
            sources = lambda c: src0  # noqa: E731

        def issue(c, which=range(11)):
            srcs = sources(c)[3]
            for i in which:
                plgpu.copy_gmem_to_smem(srcs[i], dsts[i], bars.at[i])

        def prefetch(nxt, c, which):  # the next chunk's tiles (persistent kernel only)
            if pf:
                pl.when(nxt)(lambda: issue(c + 1, which))

        waited = set()  # interpret mode runs both warpgroups in one thread: each barrier waited once

        def wait(*ix):
            for i in ix:
                if not (interp and i in waited):
                    plgpu.barrier_wait(bars.at[i])
                    waited.add(i)
        ld = lambda ref, lay=WG: load_tile(ref, lay, interp)
        bc_r = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])  # a per-row vector across columns
        store_wait = (lambda: plgpu.wait_smem_to_gmem(0, wait_read_only=True)) if pf else (
            lambda: plgpu.wait_smem_to_gmem(0))

        def masks():
            i_, j_ = iota((C, C), 0, interp), iota((C, C), 1, interp)
            return i_ > j_, i_ >= j_, i_ == j_

        def gamma(m_, gam_r):  # Gamma_ij = exp(gamma_i - gamma_j) on the mask m_, exponent masked first
            dgm = bc_r(gam_r, (C, C)) - lax.broadcast_in_dim(ld(g_s.at[2], COL), (C, C), [1])
            return jnp.where(m_, jnp.exp(jnp.where(m_, dgm, 0.0)), 0.0)

        def wg0(c, nxt):
            b, hh, rows, _ = sources(c)
            wait(0, 1, 3, 4, 5, 7)
            beta_r, gam_r, eg_r = (ld(g_s.at[r], ROW) for r in (0, 1, 3))
            # 1. the Q path: O = (Q e^gamma scale) S + Aqk Vn, Aqk = scale tril(Q K^T * Gamma)
            dqg, dAqk, qk = mmas([((C, K), do_s, Transposed(h_s)), ((C, C), do_s, Transposed(vn_s)), ((C, C), q_s, Transposed(k_s))],
                                  interp)
            if pf:  # dO is free; h_s once warpgroup 1 is done with it too
                if not interp:
                    plgpu.barrier_arrive(h_free)
                prefetch(nxt, c, (3,))
            strict, incl, _ = masks()
            gi = gamma(incl, gam_r)
            m_q = jnp.where(strict, dAqk * qk * gi * scale, 0.0)
            dgam = jnp.sum(m_q, axis=1)
            cgam = jnp.sum(m_q, axis=0)
            dqk = dAqk * gi
            de_gam = jnp.sum(dqg * ld(q_s).astype(F32), axis=1) * scale
            dkk_s[...] = dqk.astype(BF16)  # dkk_s holds dQK here, dKK in the T phase
            plgpu.commit_smem()
            dq, dk = mmas([(dqg * bc_r(eg_r, (C, K)), dqk.astype(BF16), k_s), (zero_acc((C, K), interp), Transposed(dkk_s), q_s)],
                           interp)
            q_s[...] = (dq * scale).astype(q_s.dtype)  # q_s is free: dq leaves through it
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_s, dq_ref.at[b, rows, hh])
            dk = dk * scale
            if tp1:  # dKK (x_hi) and beta dKK (x_lo) from warpgroup 1's T phase
                if not interp:
                    plgpu.barrier_wait(dkk_bar)
                dk, dkb = mmas([(dk, Transposed(x_lo), k_s), (zero_acc((C, K), interp), x_hi, k_s)], interp)
                if pf and not interp:
                    plgpu.barrier_arrive(x_free)
                m = None
            else:
                # 4. T = (I + A)^-1, A = strict(beta K K^T * Gamma): dT = (dVn Vn^T)(I + A)^T,
                #    dA = -strict(T^T dT T^T), M = dA * A (+ the Q path's), dKK = dA * Gamma
                wait(8, 9, 10)
                m = _t_phase(C, k_s, vn_s, dvn_s, th_s, tl_s, x_hi, x_lo, dkk_s, beta_r, masks,
                             lambda mask: gamma(mask, gam_r), interp, hp=call.grad_precision == "bf16x3", V=V)
                # dk += (beta dKK)^T K (the A path), and beta * dKK K (the W path's dKK term)
                dk, dkb = mmas([(dk, Transposed(x_lo), k_s), (zero_acc((C, K), interp), dkk_s, k_s)], interp)
            if pf:  # q (dq has left), Vn, dVn and T (once warpgroup 1 is done with them) are free
                if not interp:
                    plgpu.barrier_wait(t_free)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                prefetch(nxt, c, (0, 7, 8, 9, 10))
            dk = dk + dkb * bc_r(beta_r, (C, K))
            sc_s[0] = jnp.sum(dkb * ld(k_s).astype(F32), axis=1)
            sc_s[1] = dgam if tp1 else dgam + jnp.sum(m, axis=1)
            sc_s[2] = -cgam if tp1 else -(cgam + jnp.sum(m, axis=0))
            sc_s[3] = de_gam
            # warpgroup 1's dk partial, then dk leaves through k_s (both warpgroups are done with it)
            if not interp:
                plgpu.barrier_wait(dk_bar)
            dk = dk + ld(dw_s).astype(F32)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            k_s[...] = dk.astype(k_s.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_s, dk_ref.at[b, rows, hh])
            plgpu.copy_smem_to_gmem(sc_s, sc_ref.at[bh, c])
            store_wait()
            # k and the gates: warpgroup 1 read them at its start, before its dk_bar arrival
            prefetch(nxt, c, (1, 4))

        def wg1(c, nxt):
            b, hh, rows, _ = sources(c)
            rows_ = (0, 3, 4, 1) if tp1 else (0, 3, 4)  # beta, e^gamma, e^{gamma_C - gamma} (, gamma)
            if not pf:
                wait(1, 2, 4, 6, 7, 8, 9, 10)
                beta_r, eg_r, ee_r, *gam_r = (ld(g_s.at[r], ROW) for r in rows_)
            else:  # the first products need neither k, v nor the gates (the tiles that land last)
                wait(6, 7, 8, 9, 10)
            # 2. S' = e^{gamma_C} S + (K e^{gamma_C - gamma})^T Vn: dK += (Vn dS^T) e^{gamma_C - gamma}
            # 3. U = T (beta V): dv = beta * (T^T dVn), dbeta += rowsum(T^T dVn * v)
            dkd, dvb = mmas([((C, K), vn_s, Transposed(dh_s)), ((C, V), (Transposed(th_s), Transposed(tl_s)), (dvn_s, dvn_s))], interp)
            prefetch(nxt, c, (6,))  # dh is free
            if pf:
                wait(1, 2, 4)
                beta_r, eg_r, ee_r, *gam_r = (ld(g_s.at[r], ROW) for r in rows_)
            # k is read from its tile where needed (k_s holds it until this warpgroup's dk_bar
            # arrival): a float32 copy live through the T phase and dX cost 64 registers, and
            # T^T dVn is split into its bf16 (hi, lo) pair once, for the T phase and _dx (H200,
            # 4x4096x16x128: with dvb and k live through _dx the kernel spilled 740 bytes per
            # thread and took 0.532 ms against 0.395 before, results/hopper_h200/)
            kf = lambda: ld(k_s).astype(F32)
            de_end = jnp.sum(dkd * kf(), axis=1)
            dk1 = dkd * bc_r(ee_r, (C, K))
            dbeta = jnp.sum(dvb * ld(v_s).astype(F32), axis=1)
            if call.grad_blocks[0] > 1:  # chunk_grads_blocks: this term once per value block (key block 0)
                kb = lax.rem(lax.div(hh, i32(call.grad_blocks[1])), i32(call.grad_blocks[0]))
                dbeta = dbeta * jnp.where(kb == 0, 1.0, 0.0).astype(F32)
            sync_own_barriers(call, "grads")  # every thread has read v before dv overwrites it (the same layout: insurance)
            v_s[...] = (dvb * bc_r(beta_r, (C, V))).astype(v_s.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(v_s, dv_ref.at[b, rows, hh])
            y = split_hi_lo(dvb)
            if tp1:
                # 4. the T phase, grad_t_phase="direct": dA = -strict((T^T dVn) Vn^T), M = dA * A,
                #    dKK = dA * Gamma into x_hi, beta dKK into x_lo, then dkk_bar
                if pf and not interp:  # warpgroup 0 has read the previous chunk's
                    plgpu.barrier_wait(x_free)
                m = _t_phase(C, k_s, vn_s, dvn_s, th_s, tl_s, None, x_lo, x_hi, beta_r, masks,
                             lambda mask: gamma(mask, gam_r[0]), interp, hp=call.grad_precision == "bf16x3",
                             direct=True, y=y, V=V)
                if not interp:
                    plgpu.barrier_arrive(dkk_bar)
                sc_s[7] = jnp.sum(m, axis=1)
                sc_s[8] = -jnp.sum(m, axis=0)
            if pf and not interp:  # done with Vn, dVn and T
                plgpu.barrier_arrive(t_free)
            # 5. Vn = U - W S, W = T X (X = beta e^gamma K): dX = T^T dW with dW = -dVn S^T, formed as
            #    -(T^T dVn) S^T from the dv product's T^T dVn (see _dx); d(beta K) = dX e^gamma
            #    (+ dKK K, warpgroup 0)
            wait(5)
            dx = _dx(y, h_s, C, K, interp)
            if pf and not interp:  # h_s is free once warpgroup 0's first products are done too
                plgpu.barrier_arrive(h_free)
                plgpu.barrier_wait(h_free)
                prefetch(nxt, c, (5,))
            deg = jnp.sum(dx * kf(), axis=1) * beta_r
            dxe = dx * bc_r(eg_r, (C, K))
            dk1 = dk1 + dxe * bc_r(beta_r, (C, K))
            sc_s[4] = de_end
            sc_s[5] = dbeta + jnp.sum(dxe * kf(), axis=1)
            sc_s[6] = deg
            dw_s[...] = dk1.astype(BF16)  # the dk partial (warpgroup 0 read the previous one: h_free)
            plgpu.commit_smem()
            if not interp:
                plgpu.barrier_arrive(dk_bar)
            store_wait()
            prefetch(nxt, c, (2,))  # v_s (dv's staging tile) is free

        def chunk(wg_fn):  # (chunk index, whether a next chunk of this CTA follows) -> wg_fn
            if not pf:
                return lambda: wg_fn(c0, None)

            def loop():
                def step(j, carry):
                    c = c0 + j
                    nxt = (j + 1 < per_cta) & (c + 1 < n)
                    pl.when(c < n)(lambda: wg_fn(c, nxt))
                    return carry

                lax.fori_loop(i32(0), i32(per_cta), step, i32(0))
                plgpu.wait_smem_to_gmem(0)
            return loop

        if interp:
            # Mosaic GPU's interpreter runs each warpgroup as a CPU computation of its own, and on a
            # 2-core machine one blocked in a barrier wait starved the other (hangs, seen in most
            # runs with several CTAs): in interpret mode the two warpgroups' work runs in turn in one
            # thread, warpgroup 1 first (its dk partial is what warpgroup 0 waits for). That checks
            # the split's arithmetic and its shared-memory hand-off, not its synchronisation (the
            # CUDA lowering and the GPU do). The persistent kernel's h prefetch waits for warpgroup
            # 0 here (on the GPU it follows warpgroup 1's dX product and the h_free barrier).
            def both(c, nxt):
                waited.clear()
                wg1(c, nxt)
                wg0(c, nxt)
                if pf:
                    prefetch(nxt, c, (5,))

            issue(c0)
            chunk(both)()
        else:
            wg = lax.axis_index("wg")
            pl.when(wg == 0)(lambda: issue(c0))
            if tp1 and pf:  # x_hi / x_lo start free: warpgroup 1's first x_free wait passes
                pl.when(wg == 0)(lambda: plgpu.barrier_arrive(x_free))
            pl.when(wg == 0)(chunk(wg0))
            pl.when(wg == 1)(chunk(wg1))

    scratch = [smem((C, K), in_dt), smem((C, K), in_dt), smem((C, V), in_dt), smem((C, V), in_dt),
               plgpu.SMEM((5, C), F32), smem((K, V), BF16), smem((K, V), BF16), smem((C, V), BF16),
               smem((C, V), BF16), smem((C, C), BF16), smem((C, C), BF16), plgpu.SMEM((NSC, C), F32),
               smem((C, C), BF16), smem((C, C), BF16), smem((C, C), BF16), smem((C, K), BF16),
               plgpu.Barrier(num_barriers=11), plgpu.Barrier(num_arrivals=1)]
    if tp1:  # dkk_bar (and, persistent kernel, x_free)
        scratch += [plgpu.Barrier(num_arrivals=1)] * (2 if pf else 1)
    if pf:
        scratch += [plgpu.Barrier(num_arrivals=2), plgpu.Barrier(num_arrivals=1)]
    out_type = (jax.ShapeDtypeStruct((B, Tp, H, K), in_dt), jax.ShapeDtypeStruct((B, Tp, H, K), in_dt),
                jax.ShapeDtypeStruct((B, Tp, H, V), in_dt), jax.ShapeDtypeStruct((BH, n, NSC, C), F32))
    kw = kernel_kw(call, "grads")  # HopperTuning.auto_barriers (see hopper.common.sync_own_barriers)
    threads = {} if interp else dict(num_threads=2, thread_name="wg")
    grid = (BH, pl.cdiv(n, per_cta)) if pf else (BH, n)
    fn = varying_kernel(plgpu.kernel, body, out_type=out_type, scratch_types=scratch, grid=grid, grid_names=("bh", "c"),
                        **threads, **kw)
    dq, dk, dv, sc = fn(q, k, v, do, gates, h.astype(BF16), dh.astype(BF16), vn.astype(BF16), dvn.astype(BF16),
                        t_hi, t_lo)
    col = lambda x: x.reshape(BH, Tp, 1)
    dgam, dgam_row = (sc[:, :, 1] + sc[:, :, 7], sc[:, :, 2] + sc[:, :, 8]) if tp1 else (sc[:, :, 1], sc[:, :, 2])
    return dict(dq=dq, dk=dk, dv=dv, dbeta=col(sc[:, :, 0] + sc[:, :, 5]), dgam=col(dgam),
                dgam_row=dgam_row.reshape(BH, n, 1, C), de_gam=col(sc[:, :, 3] + sc[:, :, 6]),
                de_gam_end=col(sc[:, :, 4]))


def chunk_grads_blocks(call: KernelCall, q, k, v, do, beta, gam, e_gam, e_gam_end, h, dh, vn, dvn, t_hi, t_lo):
    """:func:`chunk_grads` for K > 128 (``HopperTuning.wide_backward="hopper"``): the two-warpgroup
    gradient kernel on every (key block, value block) pair of 128 columns (:func:`block_call`: q, k
    and h_n, dh_n rows of its key block, v, dO, Vn, dVn and h_n, dh_n columns of its value block, all
    by TMA from the whole arrays), and the blocks' outputs summed. Exact by linearity: every local
    gradient is a sum of terms with one contraction over V (whose value-block parts add up) times
    at most one over K (A, Q K^T, or a key block's own columns; with ``grad_t_phase="direct"``, dA
    = -strict((T^T dVn) Vn^T) has none), so the blocks' partial dq, dk
    (their key block's columns), d gamma, d e^gamma, d e^{gamma_C - gamma} and dbeta add up to the
    whole; dv = beta T^T dVn is its value block's columns (the same in every key block: key block
    0's is kept), and dbeta's K-free term sum(T^T dVn * v) is counted in key block 0 only. The
    C x C work (Q K^T, the T phase) runs once per block pair. Arguments and results as
    :func:`chunk_grads`."""
    sub = block_call(call)
    if sub is None:
        raise ValueError(f"chunk_grads_blocks: the Hopper gradient kernel does not take K={call.K}, V={call.V} in "
                         f"blocks of 128 with this call's options")
    nk, nv = sub.grad_blocks
    out = _chunk_grads_2wg(sub, q, k, v, do, beta, gam, e_gam, e_gam_end, h, dh, vn, dvn, t_hi, t_lo)
    B, Tp, H = call.BH // call.H, call.Tp, call.H
    in_dt = jnp.dtype(call.in_dt)

    def tokens(x, sum_v):  # [B, Tp, H * nk * nv, blk] -> [B, Tp, H, D]
        x = x.reshape(B, Tp, H, nk, nv, x.shape[-1])
        x = x.astype(F32).sum(4).astype(in_dt) if sum_v else x[:, :, :, 0]
        return x.reshape(B, Tp, H, -1)

    per_head = lambda x: x.reshape((call.BH, nk * nv) + x.shape[1:]).sum(1)
    return dict(dq=tokens(out["dq"], True), dk=tokens(out["dk"], True), dv=tokens(out["dv"], False),
                **{name: per_head(out[name]) for name in ("dbeta", "dgam", "dgam_row", "de_gam", "de_gam_end")})
