"""The gradient kernel: per chunk, the local gradients of the chunked form (the backward of
:mod:`.wy` and of the output / state updates), given the states h_n, their gradients dh_n, Vn
and dVn from the state passes.

Per chunk, with S = h_n, dS = dh_n (the state leaving the chunk), q scaled::

    O  = (Q e^gamma) S + Aqk Vn        ->  dQg = dO S^T,  dAqk = dO Vn^T
    Vn = U - W S                       ->  dW = -dVn S^T
    S' = e^{gamma_C} S + Kd^T Vn       ->  dKd = Vn dS^T, d e^{gamma_C} = sum(S * dS)
    U  = T (beta V), W = T (beta K e^gamma), T = (I + A)^-1, A = strict((beta K) K^T * Gamma)
                                       ->  dT, dA = -T^T dT T^T (strictly lower), dv, dbeta, dk
                                           (grad_t_phase="direct": dA = -strict((T^T dVn) Vn^T))
    Gamma_ij = exp(gamma_i - gamma_j)  ->  d gamma as row / column sums of M = dA * A + dAqk * Aqk

Outputs: dq, dk, dv (token layout, input dtype); dbeta, d gamma (column and row views, whose sum
is the gradient of gamma), d e^gamma, d e^{gamma_C - gamma}, d e^{gamma_C}, all f32. The chain
rule from these to g runs outside in plain JAX (:func:`gdn_jax.ops.pallas.vjp.gate_terms`).
"""
from __future__ import annotations

import functools

from jax.experimental import pallas as pl

from . import tiles as _t
from .config import KernelCall
from .layout import hm_spec, run, sds, token_shape, token_spec

F32 = _t.F32


def _value_loop(call: KernelCall, h_ref, dh_ref, vn_ref, dvn_ref, do_ref, more, load=lambda sl: None, dw=True):
    """Sum over value blocks of bv_grad columns the terms that contract over V: dQg, dAqk, dW
    (unless ``dw`` is False), dKd, plus whatever ``more(sl, S, dS, vn, dvn, x, add)`` adds with
    ``add(name, term)``, where ``x = load(sl)`` is read with the block's other inputs."""
    acc = {}

    def add(name, x):
        acc[name] = x if name not in acc else acc[name] + x

    bv = call.bv_grad
    for jb in range(call.V // bv):  # static loop
        sl = slice(jb * bv, (jb + 1) * bv)
        S, dS = h_ref[:, sl], dh_ref[:, sl]
        vn, dvn, do = vn_ref[:, sl], dvn_ref[:, sl], do_ref[:, sl]
        x = load(sl)
        add("dQg", _t.mm(call, do, S, tb=True))  # o = Qg S + Aqk vn
        add("dAqk", _t.mm(call, do, vn, tb=True))
        if dw:
            add("dW", -_t.mm(call, dvn, S, tb=True))  # vn = U - W S
        add("dKd", _t.mm(call, vn, dS, tb=True))  # S' = dec S + Kd^T vn
        more(sl, S, dS, vn, dvn, x, add)
    return acc


def _ddec(S, dS):
    return _t.colsum(_t.rowsum(S.astype(F32) * dS.astype(F32)))


def _wy_backward(call: KernelCall, T, A, Gs, strict, dT, dW, k, e_gam, dA=None, dX=None):
    """Through W = T X (X = beta K e^gamma), T = (I + A)^-1, A = strict((beta K) K^T * Gamma),
    for the K columns ``k``: returns (M = dA * A, dKK = dA * Gamma, d(beta K), dX). ``dA`` given
    (``HopperTuning.grad_t_phase="direct"``): dT is not used; ``dX`` given (= T^T dW, formed by the
    caller as -(T^T dVn) S^T): dW is not used."""
    if dX is None:
        dX = _t.mm(call, T, dW, ta=True, dt=F32)
    if dA is None:
        dA = -_t.mm(call, _t.mm(call, T, dT, ta=True, dt=F32, role="inv"), T, tb=True, dt=F32, role="inv") * strict
    # gamma enters A and Aqk through Gamma_ij = exp(gamma_i - gamma_j): +M_ij to gamma_i, -M_ij to
    # gamma_j. The diagonal (Gamma_ii = 1) does not depend on gamma: leaving it out of M avoids a
    # large +x/-x pair whose f32 rounding would dominate tiny gate gradients under strong decay.
    M = dA * A
    dKK = dA * Gs
    dkb = _t.mm(call, dKK, k) + dX * e_gam
    return M, dKK, dkb, dX


def _qk_grads_and_write(call: KernelCall, q, k, qs, ks, gam, gam_row, e_gam, dAqk, dQg, M, strict, dk, dbeta, deg,
                        dq_ref, dk_ref, dbeta_ref, dgam_ref, dgam_row_ref, de_gam_ref):
    """The last step, through O's intra-chunk term tril(Q K^T * Gamma) Vn and Q e^gamma, and the
    writes. ``q, k``: all K channels (Aqk contracts over K); ``qs, ks``: the program's K columns
    (the same arrays in the whole-K kernel); ``q``, ``qs`` already scaled."""
    Gi = _t.decay_matrix(gam, gam_row, incl=True)
    Aqk = _t.mm(call, q, k, tb=True) * Gi
    M = M + dAqk * Aqk * strict
    dQK = dAqk * Gi
    dqs = _t.mm(call, dQK, ks) + dQg * e_gam
    dk = dk + _t.mm(call, dQK, qs, ta=True)
    deg = deg + _t.rowsum(dQg * qs)

    dq_ref[...] = (dqs * call.scale).astype(dq_ref.dtype)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dbeta_ref[...] = dbeta
    dgam_ref[...] = _t.rowsum(M)
    dgam_row_ref[...] = -_t.colsum(M)
    de_gam_ref[...] = deg


def _grad_kernel(call: KernelCall, *, q_ref, k_ref, v_ref, do_ref, beta_ref, gam_ref, gam_row_ref, e_gam_ref,
                 e_gam_end_ref, h_ref, dh_ref, vn_ref, dvn_ref, dq_ref, dk_ref, dv_ref, dbeta_ref, dgam_ref,
                 dgam_row_ref, de_gam_ref, de_gam_end_ref, de_gam_last_ref, t_ref=None):
    """Local gradients of one chunk, all K channels. Ordered to keep few [C, K] / [C, C] f32
    values live at once (register pressure on GPU): the V loop, then the T / A path, then the
    Q K^T path. T comes from the backward WY kernel (``save_t``) or is recomputed."""
    k = _t.load_f32(k_ref)
    beta, gam, gam_row, e_gam = beta_ref[...], gam_ref[...], gam_row_ref[...], e_gam_ref[...]
    strict = _t.strict_lower(call.C)
    kb = k * beta
    Gs = _t.decay_matrix(gam, gam_row, incl=False)
    A = _t.mm(call, kb, k, tb=True) * Gs
    T = t_ref[...] if t_ref is not None else _t.inv_unit_lower(call, A)

    # HopperTuning.grad_t_phase="direct" here only with float32 intermediates: the chain reads v, X
    # and h, the direct form the stored Vn, whose bf16 rounding is relative to |U| + |W S|, not to
    # |Vn| -- where Vn cancels (the state already predicts v) dbeta came out 1.2-2x less accurate
    # (found in a review: repeated keys, bf16 intermediates). The K-split kernel's chain already
    # reads Vn (dvn Vn^T), so there "direct" changes nothing but the product count.
    direct = call.grad_tp == "direct" and call.mid_dt == "float32"

    def more(sl, S, dS, vn, dvn, v, add):  # everything else that runs over V
        add("ddec", _ddec(S, dS))
        dvb = _t.mm(call, T, dvn, ta=True, dt=F32)
        if direct:  # HopperTuning.grad_t_phase="direct": dA = -strict((T^T dVn) Vn^T), since (I + A)^T T^T = I
            add("dAd", _t.mm(call, dvb, vn, tb=True, dt=F32))
            # and dX = T^T dW = -(T^T dVn) S^T from the same T^T dVn (no dW, no T^T dW product)
            add("dX", -_t.mm(call, dvb, S, tb=True, dt=F32))
        else:
            add("dT", _t.mm(call, dvn, v * beta, tb=True, dt=F32))  # U = T (beta V)
        dv_ref[:, sl] = (dvb * beta).astype(dv_ref.dtype)
        add("dbeta", _t.rowsum(dvb * v))

    acc = _value_loop(call, h_ref, dh_ref, vn_ref, dvn_ref, do_ref, more,
                      load=lambda sl: _t.load_f32(v_ref, slice(None), sl), dw=not direct)
    de_gam_last_ref[...] = acc["ddec"]
    de_gam_end_ref[...] = _t.rowsum(acc["dKd"] * k)  # Kd = K e^{gamma_C - gamma}
    dk = acc["dKd"] * e_gam_end_ref[...]

    X = kb * e_gam
    if direct:
        M, dKK, dkb, dX = _wy_backward(call, T, A, Gs, strict, None, None, k, e_gam, dA=-acc["dAd"] * strict,
                                       dX=acc["dX"])
    else:
        dT = acc["dT"] + _t.mm(call, acc["dW"], X, tb=True, dt=F32)
        M, dKK, dkb, dX = _wy_backward(call, T, A, Gs, strict, dT, acc["dW"], k, e_gam)
    dk = dk + _t.mm(call, dKK, kb, ta=True) + dkb * beta
    dbeta = acc["dbeta"] + _t.rowsum(dkb * k)
    deg = _t.rowsum(dX * kb)

    q = _t.load_f32(q_ref) * call.scale
    _qk_grads_and_write(call, q, k, q, k, gam, gam_row, e_gam, acc["dAqk"], acc["dQg"], M, strict, dk, dbeta, deg,
                        dq_ref, dk_ref, dbeta_ref, dgam_ref, dgam_row_ref, de_gam_ref)


def _grad_kernel_ksplit(call: KernelCall, *, q_ref, k_ref, q_cols_ref, k_cols_ref, v_cols_ref, do_ref, beta_ref,
                        gam_ref, gam_row_ref, e_gam_ref, e_gam_end_ref, h_ref, dh_ref, vn_ref, dvn_ref,
                        dvn_cols_ref, dq_ref, dk_ref, dv_ref, dbeta_ref, dgam_ref, dgam_row_ref, de_gam_ref,
                        de_gam_end_ref, de_gam_last_ref, t_ref=None):
    """:func:`_grad_kernel` for one block of bk key channels (grid (B*H, chunks, K/bk)).

    Each program reads the chunk's q, k (all K: A and Aqk contract over K), its K rows of h_n and
    dh_n, and Vn, dVn, dO (all V); it writes dq, dk for its K columns, dv for its share of the V
    columns (V/nk of them) and partial per-token scalar gradients (summed over the K blocks by the
    caller). The whole-K kernel's only K contraction, dW X^T in dT, is rewritten with
    X S = (I + A) W S = (I + A)(U - Vn) = beta V - (I + A) Vn: dT = dvn (beta v)^T + dW X^T =
    dvn Vn^T (I + A)^T, which contracts over V only (and avoids cancelling two O(|v|) terms)."""
    k = _t.load_f32(k_ref)
    beta, gam, gam_row, e_gam = beta_ref[...], gam_ref[...], gam_row_ref[...], e_gam_ref[...]
    strict = _t.strict_lower(call.C)
    Gs = _t.decay_matrix(gam, gam_row, incl=False)
    A = _t.mm(call, k * beta, k, tb=True) * Gs
    T = t_ref[...] if t_ref is not None else _t.inv_unit_lower(call, A)

    def more(sl, S, dS, vn, dvn, _, add):
        add("dVV", _t.mm(call, dvn, vn, tb=True))
        add("ddec", _ddec(S, dS))

    acc = _value_loop(call, h_ref, dh_ref, vn_ref, dvn_ref, do_ref, more)
    de_gam_last_ref[...] = acc["ddec"]

    # this program's share of the value channels: dv, and dbeta through U = T (beta V)
    dvb = _t.mm(call, T, dvn_cols_ref[...], ta=True, dt=F32)
    dv_ref[...] = (dvb * beta).astype(dv_ref.dtype)
    dbeta = _t.rowsum(dvb * _t.load_f32(v_cols_ref))

    ks = _t.load_f32(k_cols_ref)
    de_gam_end_ref[...] = _t.rowsum(acc["dKd"] * ks)  # Kd = K e^{gamma_C - gamma}
    dk = acc["dKd"] * e_gam_end_ref[...]

    kbs = ks * beta
    if call.grad_tp == "direct":  # HopperTuning.grad_t_phase: dA = -strict(T^T dvn Vn^T), since (I + A)^T T^T = I
        dA = -_t.mm(call, T, acc["dVV"], ta=True, dt=F32, role="inv") * strict
        M, dKK, dkb, dX = _wy_backward(call, T, A, Gs, strict, None, acc["dW"], ks, e_gam, dA=dA)
    else:
        dT = acc["dVV"] + _t.mm(call, acc["dVV"], A, tb=True, dt=F32)  # dvn Vn^T (I + A)^T
        M, dKK, dkb, dX = _wy_backward(call, T, A, Gs, strict, dT, acc["dW"], ks, e_gam)
    dk = dk + _t.mm(call, dKK, kbs, ta=True) + dkb * beta
    dbeta = dbeta + _t.rowsum(dkb * ks)
    deg = _t.rowsum(dX * kbs)

    _qk_grads_and_write(call, _t.load_f32(q_ref) * call.scale, k, _t.load_f32(q_cols_ref) * call.scale, ks, gam,
                        gam_row, e_gam, acc["dAqk"], acc["dQg"], M, strict, dk, dbeta, deg, dq_ref, dk_ref,
                        dbeta_ref, dgam_ref, dgam_row_ref, de_gam_ref)


def chunk_grads(call: KernelCall, q, k, v, do, beta, gam, gam_row, e_gam, e_gam_end, h, dh, vn, dvn, t=None):
    """The gradient kernel over all chunks: grid (B*H, chunks), or (B*H, chunks, K/bk) when
    ``call.grad_nk > 1``. Returns a dict ``dq, dk, dv`` (token layout, input dtype; dq, dk per
    VALUE head: with grouped heads the caller sums each group), ``dbeta,
    dgam, de_gam, de_gam_end`` [BH, T, 1], ``dgam_row`` [BH, n, 1, C], ``de_gam_last``
    [BH, n, 1, 1], all scalars f32 (summed over K blocks)."""
    C, K, V, BH, n, Tp, nk = call.C, call.K, call.V, call.BH, call.n, call.Tp, call.grad_nk
    bk, bvs = K // nk, V // nk
    # grid index (b, c[, j]) -> block indices; j: this program's block of K (and share of V) columns
    ix = lambda f: (lambda b, c, *j: f(b, c, j[0] if j else 0))
    tk = token_spec(call, C, K, ix(lambda b, c, j: (b, c, 0)), key=True)
    tv = token_spec(call, C, V, ix(lambda b, c, j: (b, c, 0)))
    tks_in = token_spec(call, C, bk, ix(lambda b, c, j: (b, c, j)), key=True)  # q, k: key heads
    tks = token_spec(call, C, bk, ix(lambda b, c, j: (b, c, j)))  # dq, dk: per value head
    tvs = token_spec(call, C, bvs, ix(lambda b, c, j: (b, c, j)))
    col = hm_spec(C, 1, ix(lambda b, c, j: (b, c, 0)))
    hv = hm_spec(C, V, ix(lambda b, c, j: (b, c, 0)))
    row = pl.BlockSpec((None, None, 1, C), ix(lambda b, c, j: (b, c, 0, 0)))
    states = pl.BlockSpec((None, None, bk, V), ix(lambda b, c, j: (b, c, j, 0)))
    tile = pl.BlockSpec((None, None, C, C), ix(lambda b, c, j: (b, c, 0, 0)))
    common = dict(beta=(beta, col), gam=(gam, col), gam_row=(gam_row, row), e_gam=(e_gam, col),
                  e_gam_end=(e_gam_end, col), h=(h, states), dh=(dh, states), vn=(vn, hv), dvn=(dvn, hv))
    token_grads = dict(dq=(token_shape(call, K, call.in_dt), tks), dk=(token_shape(call, K, call.in_dt), tks),
                       dv=(token_shape(call, V, call.in_dt), tvs))
    t_in = dict(t=(t, tile) if call.save_t else None)
    if nk == 1:
        inputs = dict(q=(q, tk), k=(k, tk), v=(v, tv), do=(do, tv), **common, **t_in)
        outputs = dict(token_grads,
                       dbeta=(sds((BH, Tp, 1), F32), col), dgam=(sds((BH, Tp, 1), F32), col),
                       dgam_row=(sds((BH, n, 1, C), F32), row), de_gam=(sds((BH, Tp, 1), F32), col),
                       de_gam_end=(sds((BH, Tp, 1), F32), col),
                       de_gam_last=(sds((BH, n, 1, 1), F32), pl.BlockSpec((None, None, 1, 1),
                                                                          lambda b, c: (b, c, 0, 0))))
        return run(call, functools.partial(_grad_kernel, call), name="gdn_bwd_dqkvg", grid=(BH, n), inputs=inputs,
                   outputs=outputs, warps=call.warps_grad)
    # K-split: per-token scalar gradients are partial sums, one slab per K block
    pcol = pl.BlockSpec((None, None, C, 1), lambda b, c, j: (j, b, c, 0))
    prow = pl.BlockSpec((None, None, None, 1, C), lambda b, c, j: (j, b, c, 0, 0))
    pdec = pl.BlockSpec((None, None, None, 1, 1), lambda b, c, j: (j, b, c, 0, 0))
    inputs = dict(q=(q, tk), k=(k, tk), q_cols=(q, tks_in), k_cols=(k, tks_in), v_cols=(v, tvs), do=(do, tv),
                  **common, dvn_cols=(dvn, hm_spec(C, bvs, lambda b, c, j: (b, c, j))), **t_in)
    outputs = dict(token_grads,
                   dbeta=(sds((nk, BH, Tp, 1), F32), pcol), dgam=(sds((nk, BH, Tp, 1), F32), pcol),
                   dgam_row=(sds((nk, BH, n, 1, C), F32), prow), de_gam=(sds((nk, BH, Tp, 1), F32), pcol),
                   de_gam_end=(sds((nk, BH, Tp, 1), F32), pcol), de_gam_last=(sds((nk, BH, n, 1, 1), F32), pdec))
    out = run(call, functools.partial(_grad_kernel_ksplit, call), name="gdn_bwd_dqkvg_ksplit", grid=(BH, n, nk),
              inputs=inputs, outputs=outputs, warps=call.warps_grad)
    # dgam / dgam_row are the same in every K block (C x C terms only); the rest are partial sums over K
    for name in ("dbeta", "de_gam", "de_gam_end", "de_gam_last"):
        out[name] = out[name].sum(0)
    out["dgam"], out["dgam_row"] = out["dgam"][0], out["dgam_row"][0]
    return out
