"""Hopper (sm_90) backward kernels through Pallas' Mosaic GPU backend: the twins of the Triton
backward's stages at a kernel chunk of C = 64 (one warpgroup per CTA, wgmma with float32
accumulators, operands in swizzled shared memory by TMA). With S = h_n the state entering chunk n
and dS = dh_n the gradient of the state leaving it (notation of :mod:`gdn_jax.ops.pallas.grads`):

* :func:`wy_backward` (one CTA per chunk): W, U and dVl = Aqk^T dO, and T = (I + A)^-1 as a bf16
  (hi, lo) pair for the gradient kernel (the same bf16x3 inverse as :func:`.hopper.wy_forward`).
* :func:`recompute_states` (:func:`.hopper.forward_states_and_output` in its recompute mode):
  h_n and Vn per chunk.
* :func:`reverse_states` (one CTA per head and ``bv`` value channels, dS [K, bv] float32 in
  registers, the chunks walked backwards with the previous chunk's tiles arriving by TMA)::

      dh_n = dS;   dVn = dVl + e^{gamma_C - gamma} * (K dS)
      dS  <- e^{gamma_C} dS + Q^T (e^gamma scale * dO) - W^T dVn

  and d e^{gamma_C} = sum(h_n * dS) (float32 dS), d initial_state.
* :func:`chunk_grads` (one CTA per chunk): every local gradient, ordered to keep at most two
  [C, K] float32 accumulators live and the masks / decay matrices recomputed per phase; dA =
  -strict((T^T dVn) Vn^T) by default (``grad_t_phase="chain"``: dT = (dVn Vn^T)(I + A)^T, over V
  only, see :func:`.grads._grad_kernel_ksplit`, then T^T dT T^T); dX = T^T dW formed as
  -(T^T dVn) S^T (:func:`_dx`); products with T and T^T dVn as bf16x3 or bf16x2 (hi, lo pairs),
  the T phase's last products per ``grad_precision``, the rest bf16 with float32 accumulation, as
  the Triton kernel's intermediates.

Interpret mode (CPU) runs the same bodies with ``jnp`` matmuls (see :mod:`.hopper`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .._vma import varying_kernel
from .config import KernelCall
from .hopper import (F32, BF16, _T, _i32, _iota, _kernel_kw, _load, _sync, _mmas, _plgpu, _slot_flags, _smem, _split, _terms,
                     _wait_slot, chunk_last_row, scaled_t, tile_in, tile_out, write_w_u)
from .hopper_plan import (SMEM_BYTES, block_call, grads_smem_bytes, reverse_block, reverse_single_tiles,  # noqa: F401
                          reverse_smem_bytes)
from .hopper_plan import bwd_covers as covers  # noqa: F401  (the planning module's; re-exported)


def _zeros(shape, interp):
    z = jnp.zeros(shape, F32)
    return z if interp else _plgpu().layout_cast(z, _plgpu().Layout.WGMMA)


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
    b, hh = lax.div(bh, _i32(H)), lax.rem(bh, _i32(H))
    rows = pl.ds(c * C, C)
    nk, nv = call.grad_blocks
    if (nk, nv) != (1, 1):  # chunk_grads_blocks: virtual head hh = (head, key block, value block)
        K, V = call.K, call.V
        head = lax.div(hh, _i32(nk * nv))
        kb, vb = lax.rem(lax.div(hh, _i32(nv)), _i32(nk)), lax.rem(hh, _i32(nv))
        bhr = b * _i32(H // (nk * nv)) + head  # the real batch x head row of the per-head arrays
        hk = lax.div(head, _i32(G)) if G > 1 else head
        ks, vs = pl.ds(kb * K, K), pl.ds(vb * V, V)
        srcs = (q_ref.at[b, rows, hk, ks], k_ref.at[b, rows, hk, ks], v_ref.at[b, rows, head, vs],
                do_ref.at[b, rows, head, vs], g_ref.at[bhr, c], h_ref.at[bhr, c, ks, vs], dh_ref.at[bhr, c, ks, vs],
                vn_ref.at[bhr, rows, vs], dvn_ref.at[bhr, rows, vs], th_ref.at[bhr, c], tl_ref.at[bhr, c])
        return b, hh, rows, srcs
    hk = lax.div(hh, _i32(G)) if G > 1 else hh
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
    ``KernelConfig.grad_precision="bf16"``).

    ``direct`` (``KernelConfig.grad_t_phase="direct"``): since T (I + A) = I, (I + A)^T T^T = I and
    dA = -strict(T^T (dVn Vn^T) (I + A)^T T^T) = -strict((T^T dVn) Vn^T): two products instead of
    three chained ones, Y = T^T dVn [C, V] (T's hi / lo pair against dVn; ``y``, when the caller
    has it already, skips it) and Y Vn^T (Y as a bf16 hi / lo pair; with ``hp`` False T's and Y's hi
    parts alone); ``x_hi`` is not used. The identity holds for the T that the forward used to the
    accuracy of its inverse (~1.7e-4 with the default bf16 rounds), below the kernels' bf16
    rounding."""
    plgpu = _plgpu()
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
        kk_spec = ((C, C), k_s, _T(k_s))
        dar_spec = lambda yh, yl: ((C, C), (yh, yl) if hp else (yh,), (_T(vn_s), _T(vn_s)) if hp else (_T(vn_s),))
        if y is None:
            kk, y = _mmas([kk_spec, ((C, V), (_T(th_s), _T(tl_s)) if hp else (_T(th_s),),
                                     (dvn_s, dvn_s) if hp else (dvn_s,))], interp)
            (dar,) = _mmas([dar_spec(*_split(y, hp))], interp)
        else:  # K K^T and Y Vn^T in one round (y: float32, or its (hi, lo) pair)
            kk, dar = _mmas([kk_spec, dar_spec(*(y if isinstance(y, tuple) else _split(y, hp)))], interp)
        strict, _, _ = masks()
        gs = gamma(strict)
        return finish(dar, kk * bc_r(beta_r, (C, C)) * gs, gs)
    kk, p = _mmas([((C, C), k_s, _T(k_s)), ((C, C), dvn_s, _T(vn_s))], interp)
    strict, _, diag = masks()
    gs = gamma(strict)
    a = kk * bc_r(beta_r, (C, C)) * gs
    ia_hi, ia_lo = _split(a + jnp.where(diag, 1.0, 0.0), hp)
    x_hi[...] = ia_hi
    if hp:
        x_lo[...] = ia_lo
    plgpu.commit_smem()
    (dt,) = _mmas([((C, C), *_terms(_split(p, hp), (_T(x_hi), _T(x_lo)), hp))], interp)
    dth, dtl = _split(dt, hp)
    x_hi[...] = dth  # the wgmma above has completed: its operands are free
    if hp:
        x_lo[...] = dtl
    plgpu.commit_smem()
    (r,) = _mmas([((C, C), *_terms((_T(th_s), _T(tl_s)), (x_hi, x_lo), hp))], interp)
    (ra,) = _mmas([((C, C), *_terms(_split(r, hp), (_T(th_s), _T(tl_s)), hp))], interp)
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
    yh, yl = y if isinstance(y, tuple) else _split(y)
    (dx,) = _mmas([((C, K), (yh, yl), (_T(h_s), _T(h_s)))], interp)
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
    plgpu = _plgpu()
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
        ld = lambda ref, lay=WG: _load(ref, lay, interp)
        bc_r = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])  # a per-row vector across columns
        wait(0, 1, 3, 4, 5, 7)
        beta_r, gam_r, eg_r, ee_r = (ld(g_s.at[r], ROW) for r in (0, 1, 3, 4))

        # masks and decay matrices are recomputed in each phase rather than kept live: each is a
        # [C, C] register tile, and the phases' accumulators need the registers
        def masks():
            i_, j_ = _iota((C, C), 0, interp), _iota((C, C), 1, interp)
            return i_ > j_, i_ >= j_, i_ == j_

        def gamma(m):  # Gamma_ij = exp(gamma_i - gamma_j) on the mask m, exponent masked first
            dgm = bc_r(gam_r, (C, C)) - lax.broadcast_in_dim(ld(g_s.at[2], COL), (C, C), [1])
            return jnp.where(m, jnp.exp(jnp.where(m, dgm, 0.0)), 0.0)

        # 1. the Q path: O = (Q e^gamma scale) S + Aqk Vn, Aqk = scale tril(Q K^T * Gamma)
        dqg, dAqk, qk = _mmas([((C, K), do_s, _T(h_s)), ((C, C), do_s, _T(vn_s)), ((C, C), q_s, _T(k_s))], interp)
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
            return _mmas([(dqg * bc_r(eg_r, (C, K)), dqk.astype(BF16), k_s), (_zeros((C, K), interp), _T(dqk_s), q_s)],
                         interp)

        dq, dk = pl.run_scoped(q_phase, _smem((C, C), BF16))
        q_s[...] = (dq * scale).astype(q_s.dtype)  # q_s is free: dq leaves through it
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_s, dq_ref.at[b, rows, hh])
        dk = dk * scale

        # 2. S' = e^{gamma_C} S + (K e^{gamma_C - gamma})^T Vn: dK += (Vn dS^T) e^{gamma_C - gamma}
        wait(6, 8, 9, 10, 2)
        # 3. U = T (beta V): dv = beta * (T^T dVn), dbeta += rowsum(T^T dVn * v) (issued with step 2's)
        dkd, dvb = _mmas([((C, K), vn_s, _T(dh_s)), ((C, V), (_T(th_s), _T(tl_s)), (dvn_s, dvn_s))], interp)
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
                (dk2,) = _mmas([(dk, _T(x_lo), k_s)], interp)
                return jnp.sum(m, axis=1), jnp.sum(m, axis=0), dk2

            dg, cg, dk2 = pl.run_scoped(t_phase, _smem((C, C), BF16), _smem((C, C), BF16))

            # 5. Vn = U - W S, W = T X (X = beta e^gamma K): dX = T^T dW with dW = -dVn S^T, formed as
            #    -(T^T dVn) S^T from dv's T^T dVn (see _dx); d(beta K) = dX e^gamma + dKK K
            dx = _dx(dvb, h_s, C, K, interp)
            deg = jnp.sum(dx * ld(k_s).astype(F32), axis=1) * beta_r
            (dkb,) = _mmas([(dx * bc_r(eg_r, (C, K)), dkk_s, k_s)], interp)
            return dg, cg, dk2, deg, dkb

        dg, cg, dk, deg, dkb = pl.run_scoped(tw_phases, _smem((C, C), BF16))
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

    scratch = [_smem((C, K), in_dt), _smem((C, K), in_dt), _smem((C, V), in_dt), _smem((C, V), in_dt),
               plgpu.SMEM((5, C), F32), _smem((K, V), BF16), _smem((K, V), BF16), _smem((C, V), BF16),
               _smem((C, V), BF16), _smem((C, C), BF16), _smem((C, C), BF16), plgpu.SMEM((5, C), F32),
               plgpu.Barrier(num_barriers=11)]
    out_type = (jax.ShapeDtypeStruct((B, Tp, H, K), in_dt), jax.ShapeDtypeStruct((B, Tp, H, K), in_dt),
                jax.ShapeDtypeStruct((B, Tp, H, V), in_dt), jax.ShapeDtypeStruct((BH, n, 5, C), F32))
    kw = _kernel_kw(call)
    fn = varying_kernel(plgpu.kernel, body, out_type=out_type,
                        scratch_types=scratch, grid=(BH, n), grid_names=("bh", "c"), **kw)
    dq, dk, dv, sc = fn(q, k, v, do, gates, h.astype(BF16), dh.astype(BF16), vn.astype(BF16), dvn.astype(BF16),
                        t_hi, t_lo)
    col = lambda r: sc[:, :, r].reshape(BH, Tp, 1)
    return dict(dq=dq, dk=dk, dv=dv, dbeta=col(0), dgam=col(1), dgam_row=sc[:, :, 2].reshape(BH, n, 1, C),
                de_gam=col(3), de_gam_end=col(4))


def _chunk_grads_2wg(call: KernelCall, q, k, v, do, beta, gam, e_gam, e_gam_end, h, dh, vn, dvn, t_hi, t_lo):
    """:func:`chunk_grads` with two warpgroups per CTA (``KernelConfig.grad_warpgroups=2``): the
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
    plgpu = _plgpu()
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
        c0 = lax.axis_index("c") * _i32(per_cta) if pf else lax.axis_index("c")
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
        ld = lambda ref, lay=WG: _load(ref, lay, interp)
        bc_r = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])  # a per-row vector across columns
        store_wait = (lambda: plgpu.wait_smem_to_gmem(0, wait_read_only=True)) if pf else (
            lambda: plgpu.wait_smem_to_gmem(0))

        def masks():
            i_, j_ = _iota((C, C), 0, interp), _iota((C, C), 1, interp)
            return i_ > j_, i_ >= j_, i_ == j_

        def gamma(m_, gam_r):  # Gamma_ij = exp(gamma_i - gamma_j) on the mask m_, exponent masked first
            dgm = bc_r(gam_r, (C, C)) - lax.broadcast_in_dim(ld(g_s.at[2], COL), (C, C), [1])
            return jnp.where(m_, jnp.exp(jnp.where(m_, dgm, 0.0)), 0.0)

        def wg0(c, nxt):
            b, hh, rows, _ = sources(c)
            wait(0, 1, 3, 4, 5, 7)
            beta_r, gam_r, eg_r = (ld(g_s.at[r], ROW) for r in (0, 1, 3))
            # 1. the Q path: O = (Q e^gamma scale) S + Aqk Vn, Aqk = scale tril(Q K^T * Gamma)
            dqg, dAqk, qk = _mmas([((C, K), do_s, _T(h_s)), ((C, C), do_s, _T(vn_s)), ((C, C), q_s, _T(k_s))],
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
            dq, dk = _mmas([(dqg * bc_r(eg_r, (C, K)), dqk.astype(BF16), k_s), (_zeros((C, K), interp), _T(dkk_s), q_s)],
                           interp)
            q_s[...] = (dq * scale).astype(q_s.dtype)  # q_s is free: dq leaves through it
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_s, dq_ref.at[b, rows, hh])
            dk = dk * scale
            if tp1:  # dKK (x_hi) and beta dKK (x_lo) from warpgroup 1's T phase
                if not interp:
                    plgpu.barrier_wait(dkk_bar)
                dk, dkb = _mmas([(dk, _T(x_lo), k_s), (_zeros((C, K), interp), x_hi, k_s)], interp)
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
                dk, dkb = _mmas([(dk, _T(x_lo), k_s), (_zeros((C, K), interp), dkk_s, k_s)], interp)
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
            dkd, dvb = _mmas([((C, K), vn_s, _T(dh_s)), ((C, V), (_T(th_s), _T(tl_s)), (dvn_s, dvn_s))], interp)
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
                kb = lax.rem(lax.div(hh, _i32(call.grad_blocks[1])), _i32(call.grad_blocks[0]))
                dbeta = dbeta * jnp.where(kb == 0, 1.0, 0.0).astype(F32)
            _sync(call, "grads")  # every thread has read v before dv overwrites it (the same layout: insurance)
            v_s[...] = (dvb * bc_r(beta_r, (C, V))).astype(v_s.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(v_s, dv_ref.at[b, rows, hh])
            y = _split(dvb)
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

                lax.fori_loop(_i32(0), _i32(per_cta), step, _i32(0))
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

    scratch = [_smem((C, K), in_dt), _smem((C, K), in_dt), _smem((C, V), in_dt), _smem((C, V), in_dt),
               plgpu.SMEM((5, C), F32), _smem((K, V), BF16), _smem((K, V), BF16), _smem((C, V), BF16),
               _smem((C, V), BF16), _smem((C, C), BF16), _smem((C, C), BF16), plgpu.SMEM((NSC, C), F32),
               _smem((C, C), BF16), _smem((C, C), BF16), _smem((C, C), BF16), _smem((C, K), BF16),
               plgpu.Barrier(num_barriers=11), plgpu.Barrier(num_arrivals=1)]
    if tp1:  # dkk_bar (and, persistent kernel, x_free)
        scratch += [plgpu.Barrier(num_arrivals=1)] * (2 if pf else 1)
    if pf:
        scratch += [plgpu.Barrier(num_arrivals=2), plgpu.Barrier(num_arrivals=1)]
    out_type = (jax.ShapeDtypeStruct((B, Tp, H, K), in_dt), jax.ShapeDtypeStruct((B, Tp, H, K), in_dt),
                jax.ShapeDtypeStruct((B, Tp, H, V), in_dt), jax.ShapeDtypeStruct((BH, n, NSC, C), F32))
    kw = _kernel_kw(call, "grads")  # KernelConfig.auto_barriers (see hopper._sync)
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
    """:func:`chunk_grads` for K > 128 (``KernelConfig.wide_backward="hopper"``): the two-warpgroup
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


def wy_from_saved(call: KernelCall, k, v, do, beta, e_gam, aqk, t_hi, t_lo):
    """The backward's WY stage from the forward's saved Aqk and T (``KernelConfig.save_wy``): one
    CTA per (batch x value head, chunk)::

        W = T diag(beta e^gamma) K,  U = T diag(beta) V   bf16x2 (T = t_hi + t_lo in registers, the
                                                          scales on its columns: hopper.write_w_u)
        dVl = Aqk^T dO                               Aqk transposed in SMEM

    No K K^T / Q K^T and no inverse (the dependent chain of :func:`wy_backward`). Arguments: k, v,
    dO in the token layout; beta, e^gamma [BH, T, 1] f32; ``aqk``, ``t_hi``, ``t_lo`` [BH, n, C, C]
    bf16 from :func:`gdn_jax.ops.pallas.hopper.wy_forward` (``save_t=True``). Returns ``w``, ``u``,
    ``dvl`` as :func:`wy_backward` ([BH, Tp, *]: T padded to whole chunks; T is the caller's)."""
    plgpu = _plgpu()
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
        b, h = lax.div(bh, _i32(H)), lax.rem(bh, _i32(H))
        hk = lax.div(h, _i32(G)) if G > 1 else h
        rows = pl.ds(c * C, C)
        srcs = (k_ref.at[b, rows, hk], v_ref.at[b, rows, h], do_ref.at[b, rows, h], g_ref.at[bh, c],
                a_ref.at[bh, c], th_ref.at[bh, c], tl_ref.at[bh, c])
        for i, (src, dst) in enumerate(zip(srcs, (k_s, v_s, do_s, g_s, a_s, th_s, tl_s))):
            plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
        for i in (3, 4, 2):  # gates, Aqk, dO: dVl first (its operands arrive first)
            plgpu.barrier_wait(bars.at[i])
        (dvl,) = _mmas([((C, V), _T(a_s), do_s)], interp)
        for i in (0, 1, 5, 6):
            plgpu.barrier_wait(bars.at[i])
        do_s[...] = dvl.astype(do_s.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(do_s, dvl_ref.at[bh, rows])
        # T = t_hi + t_lo in registers, the scales on its columns: the same operands as the forward's
        # (H200 4x4096x16x128: 0.140-0.153 ms, row-scaled K / V tiles 0.145-0.146: the same)
        t = _load(th_s, WG, interp).astype(F32) + _load(tl_s, WG, interp).astype(F32)
        write_w_u(scaled_t(t, _load(g_s.at[1], COL, interp), C), scaled_t(t, _load(g_s.at[0], COL, interp), C),
                  k_s, v_s, k_s, w_ref.at[bh, rows], u_ref.at[bh, rows], C, K, V, interp)

    scratch = [_smem((C, K), in_dt), _smem((C, V), in_dt), _smem((C, V), in_dt), plgpu.SMEM((2, C), F32),
               _smem((C, C), BF16), _smem((C, C), BF16), _smem((C, C), BF16), plgpu.Barrier(num_barriers=7)]
    out_type = (jax.ShapeDtypeStruct((BH, Tp, K), in_dt), jax.ShapeDtypeStruct((BH, Tp, V), in_dt),
                jax.ShapeDtypeStruct((BH, Tp, V), in_dt))
    # KernelConfig.auto_barriers: one of the "wy" kernels (no thread load of a tile it overwrites:
    # dVl and W / U land in tiles that only a completed wgmma has read, as in the forward WY)
    kw = _kernel_kw(call, "wy")
    fn = varying_kernel(plgpu.kernel, body, out_type=out_type,
                        scratch_types=scratch, grid=(BH, n), grid_names=("bh", "c"), **kw)
    w, u, dvl = fn(k, v, do, gates, aqk.astype(BF16), t_hi, t_lo)
    return dict(w=w, u=u, dvl=dvl)


def wy_backward(call: KernelCall, q, k, v, do, beta, gam, e_gam):
    """The backward's WY stage on Hopper: :func:`.hopper.wy_forward` with dO. Returns ``w``, ``u``,
    ``dvl`` = Aqk^T dO [BH, T, *] and T = ``t_hi`` + ``t_lo`` [BH, n, C, C] (bf16)."""
    from .hopper import wy_forward

    return wy_forward(call, q, k, v, beta, gam, e_gam, do=do)


def recompute_states(call: KernelCall, w, u, k, e_gam_end, e_gam_last, h0, flags):
    """The backward's forward recompute on Hopper: ``h`` [BH, n, K, V] (the state entering each
    chunk) and ``vn`` [BH, T, V], bf16 (:func:`.hopper.forward_states_and_output` without q)."""
    from .hopper import forward_states_and_output

    return forward_states_and_output(call, w, u, k, e_gam_end, e_gam_last, h0, flags)


def reverse_states(call: KernelCall, q, k, w, dvl, do, e_gam, e_gam_end, e_gam_last, dfinal, h, flags, aqk=None):
    """The reverse state pass on Hopper (the twin of :func:`gdn_jax.ops.pallas.state_bwd.reverse_states`
    plus d e^{gamma_C}): grid (B*H, V / bv), dS [K, bv] float32 in registers, the chunks from the
    last, the previous chunk's q, k, W, dVl, dO and gates arriving by TMA while this one runs (h_n,
    which only feeds d e^{gamma_C}, in one buffer loaded at the start of its step). With
    ``KernelConfig.reverse_producer`` at K <= 128 a second, producer warpgroup issues the slots'
    copies and the consumer releases each slot after its step's last wgmma (h_n is still copied by
    the consumer). At K > 128
    (:func:`reverse_single_tiles`) q, k and W have one tile each, refilled as soon as this chunk's
    wgmmas have read them.
    With ``cu_seqlens`` dS restarts from ``dfinal[seq]`` at a sequence's last chunk and
    ``dh0[seq]`` is written after its first.

    With ``aqk`` (the forward's [BH, n, C, C] bf16 Aqk, ``KernelConfig.save_states`` with
    ``save_wy``) and ``dvl=None`` the kernel forms dVl = Aqk^T dO itself (one more wgmma per chunk,
    off the dS chain, issued with K dS): no dVl round trip through HBM and no WY stage in the
    backward.

    Returns ``dh`` [BH, n, K, V], ``dvn`` [BH, T, V] (bf16), ``dh0`` (``dfinal``'s shape, f32) and
    ``de_gam_last`` [BH, n, 1, 1] f32 (sum(h_n * dS) over the value blocks)."""
    if (aqk is None) == (dvl is None):
        raise ValueError("reverse_states: pass exactly one of dvl and aqk")
    own_dvl = aqk is not None
    one = reverse_single_tiles(call)
    prod = call.rev_prod and not one  # KernelConfig.reverse_producer (K <= 128)
    plgpu = _plgpu()
    interp = call.platform == "interpret"
    C, K, V, BH, H, G, n, Tp = call.C, call.K, call.V, call.BH, call.H, call.group, call.n, call.Tp
    bv = reverse_block(call, own_dvl)
    nvb = V // bv
    in_dt = jnp.dtype(call.in_dt)
    last_row = chunk_last_row(call, e_gam_last, flags)
    gates = jnp.stack([e_gam.reshape(BH, n, C) * call.scale, e_gam_end.reshape(BH, n, C), last_row],
                      axis=2).astype(F32)
    WG = plgpu.Layout.WGMMA

    def body(q_ref, k_ref, w_ref, dvl_ref, do_ref, g_ref, df_ref, h_ref, dh_ref, dvn_ref, dh0_ref, dd_ref,
             q_s, k_s, w_s, dvl_s, do_s, g_s, hs_s, ds_s, dvn_s, ndvn_s, dos_s, f_s, dd_s, bars, f_bar, h_bar,
             *extra):
        single_bars, free = (extra, None) if not prod else ((), extra[0])
        bh = lax.axis_index("bh")
        vb = lax.axis_index("vb")
        vsl = pl.ds(vb * bv, bv)
        b, hh = lax.div(bh, _i32(H)), lax.rem(bh, _i32(H))
        hk = lax.div(hh, _i32(G)) if G > 1 else hh
        # the K-wide tiles: one per TMA slot, or (single tiles) one each with a barrier of its own
        tile = (lambda ref, slot: ref) if one else (lambda ref, slot: ref.at[slot])

        def kw_sources(i):
            rows = pl.ds(i * C, C)
            return q_ref.at[b, rows, hk], k_ref.at[b, rows, hk], w_ref.at[bh, rows]

        def fetch(i, slot):
            rows = pl.ds(i * C, C)
            srcs = (dvl_ref.at[bh, i] if own_dvl else dvl_ref.at[bh, rows, vsl],  # Aqk or dVl
                    do_ref.at[b, rows, hh, vsl], g_ref.at[bh, i])
            dsts = (dvl_s, do_s, g_s)
            if not one:
                srcs, dsts = kw_sources(i) + srcs, (q_s, k_s, w_s) + dsts
            for src, dst, bar in zip(srcs, dsts, bars):
                plgpu.copy_gmem_to_smem(src, dst.at[slot], bar.at[slot])

        def fetch_single(i, which):  # single tiles: 0 = q, 1 = k, 2 = W
            srcs = kw_sources(i)
            for x in which:
                plgpu.copy_gmem_to_smem(srcs[x], (q_s, k_s, w_s)[x], single_bars[x])

        load_state = lambda seq: tile_in(df_ref.at[bh, seq, :, vsl], f_s, f_bar, interp)
        store_state = lambda dS, seq: tile_out(dS, f_s, dh0_ref.at[bh, seq, :, vsl])

        def consume():
            if not prod:  # (with the producer warpgroup, it fetches every chunk)
                fetch(n - 1, 0)
            if one:
                fetch_single(n - 1, (0, 1, 2))
            dS0 = _zeros((K, bv), interp) if call.packed else load_state(0)

            def step(jj, dS):
                i = n - 1 - jj
                slot = lax.rem(jj, _i32(2))
                # h_n only feeds d e^{gamma_C} (off the dS chain): one buffer, waited for when needed
                plgpu.copy_gmem_to_smem(h_ref.at[bh, i, :, vsl], hs_s, h_bar)

                if not prod:
                    pl.when(i > 0)(lambda: fetch(i - 1, 1 - slot))

                _wait_slot(bars, slot)
                if one:
                    plgpu.barrier_wait(single_bars[1])  # k (q and W are waited for before the last wgmma)
                if call.packed:
                    seq, first, last = _slot_flags(g_s, slot)
                    dS = lax.cond(last, lambda: load_state(seq), lambda: dS)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # ds_s, dvn_s, dd_s may feed last chunk's stores
                ds_s[...] = dS.astype(BF16)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(ds_s, dh_ref.at[bh, i, :, vsl])
                if own_dvl:  # dVl = Aqk^T dO with K dS (dvl_s holds this chunk's Aqk)
                    kd, dvl = _mmas([((C, bv), tile(k_s, slot), ds_s), ((C, bv), _T(dvl_s.at[slot]), do_s.at[slot])],
                                    interp)
                else:
                    (kd,) = _mmas([((C, bv), tile(k_s, slot), ds_s)], interp)
                    dvl = _load(dvl_s.at[slot], WG, interp).astype(F32)
                if one:  # K dS has read k: the previous chunk's lands during the rest of this step
                    pl.when(i > 0)(lambda: fetch_single(i - 1, (1,)))
                row = WG.reduce(1)
                e_end = _load(g_s.at[slot, 1], row, interp)
                e_o = _load(g_s.at[slot, 0], row, interp)
                # the slot's last gate read before the commit below (see hopper.forward_states_and_output)
                g_end = g_s[slot, 2, 0]
                dvn = dvl + kd * lax.broadcast_in_dim(e_end, kd.shape, [0])
                dvn_s[...] = dvn.astype(BF16)
                ndvn_s[...] = (-dvn).astype(BF16)
                dos_s[...] = (_load(do_s.at[slot], WG, interp).astype(F32)
                              * lax.broadcast_in_dim(e_o, kd.shape, [0])).astype(BF16)
                plgpu.barrier_wait(h_bar)
                dd_s[...] = jnp.sum(_load(hs_s, WG, interp).astype(F32) * dS, axis=1)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(dvn_s, dvn_ref.at[bh, pl.ds(i * C, C), vsl])
                plgpu.copy_smem_to_gmem(dd_s, dd_ref.at[bh, vb, i])
                if one:
                    plgpu.barrier_wait(single_bars[0])
                    plgpu.barrier_wait(single_bars[2])
                (dS,) = _mmas([(dS * g_end, (_T(tile(q_s, slot)), _T(tile(w_s, slot))), (dos_s, ndvn_s))],
                              interp)
                if prod:  # the slot's last read: the producer may refill it
                    plgpu.barrier_arrive(free.at[slot])
                if one:  # the last wgmma has read q and W: the previous chunk's land during its next step
                    pl.when(i > 0)(lambda: fetch_single(i - 1, (0, 2)))
                if call.packed:
                    pl.when(first)(lambda: store_state(dS, seq))
                return dS

            dS = lax.fori_loop(_i32(0), _i32(n), step, dS0)
            if not call.packed:
                store_state(dS, 0)
            plgpu.wait_smem_to_gmem(0)

        if not prod:
            consume()
            return
        wg = lax.axis_index("wg")

        @pl.when(wg == 1)
        def _producer():  # the chunks from the last, chunk n-1-jj into slot jj mod 2 once released
            def issue(jj, carry):
                pl.when(jj >= 2)(lambda: plgpu.barrier_wait(free.at[lax.rem(jj, _i32(2))]))
                fetch(n - 1 - jj, lax.rem(jj, _i32(2)))
                return carry

            lax.fori_loop(_i32(0), _i32(n), issue, None)
            # every release of every slot observed (Mosaic GPU's interpreter checks it)
            lax.fori_loop(_i32(max(n - 2, 0)), _i32(n),
                          lambda jj, c: (plgpu.barrier_wait(free.at[lax.rem(jj, _i32(2))]), c)[1], None)

        pl.when(wg == 0)(consume)

    sw = min(128, 2 * bv)
    lead = () if one else (2,)  # the K-wide tiles' leading slot axis (none: single tiles)
    scratch = [_smem(lead + (C, K), in_dt, sw), _smem(lead + (C, K), in_dt, sw), _smem(lead + (C, K), BF16, sw),
               _smem((2, C, C if own_dvl else bv), BF16, sw), _smem((2, C, bv), in_dt, sw),
               plgpu.SMEM((2, 3, C), F32),
               _smem((K, bv), BF16, sw), _smem((K, bv), BF16, sw), _smem((C, bv), BF16, sw),
               _smem((C, bv), BF16, sw), _smem((C, bv), BF16, sw), _smem((K, bv), F32), plgpu.SMEM((K,), F32),
               [plgpu.Barrier(num_barriers=2) for _ in range(3 if one else 6)], plgpu.Barrier(num_barriers=1),
               plgpu.Barrier(num_barriers=1)]
    if one:
        scratch += [plgpu.Barrier(num_barriers=1) for _ in range(3)]  # q, k, W
    if prod:  # a slot is free again once the consumer has read it
        scratch += [plgpu.Barrier(num_arrivals=1, num_barriers=2)]
    out_type = (jax.ShapeDtypeStruct((BH, n, K, V), BF16), jax.ShapeDtypeStruct((BH, Tp, V), BF16),
                jax.ShapeDtypeStruct(dfinal.shape, F32), jax.ShapeDtypeStruct((BH, nvb, n, K), F32))
    kw = _kernel_kw(call, "reverse")  # KernelConfig.auto_barriers (see hopper._sync)
    if prod:
        kw.update(num_threads=2, thread_name="wg")
    fn = varying_kernel(plgpu.kernel, body, out_type=out_type,
                        scratch_types=scratch, grid=(BH, nvb), grid_names=("bh", "vb"), **kw)
    dh, dvn, dh0, dd = fn(q, k, w.astype(BF16), (aqk if own_dvl else dvl).astype(BF16), do, gates,
                          dfinal.astype(F32), h.astype(BF16))
    return dict(dh=dh, dvn=dvn, dh0=dh0, de_gam_last=dd.sum((1, 3)).reshape(BH, n, 1, 1))
