"""The backward's local gradients as batched XLA matmuls (no Pallas): the gradient stage of the
Hopper backward at head dim 256 (``HopperTuning.wide_backward="hopper_xla"``), where the Mosaic
GPU gradient kernel (:func:`gdn_jax.ops.pallas.hopper.grads.chunk_grads`, K <= 128) does not fit in
shared memory. The same arithmetic as that kernel's direct form (``grad_t_phase="direct"``), per
chunk and head (q scaled, S = h_n the state entering the chunk, dS = dh_n the gradient of the
state leaving it, T = (I + A)^-1 from the forward's saved hi / lo pair)::

    dQg = dO S^T, dAqk = dO Vn^T, dKd = Vn dS^T          (contract over V)
    dvb = T^T dVn, dA = -strict(T^T dVn Vn^T), dX = -dvb S^T  (the direct dA; dX = T^T dW)
    dv = beta dvb, dbeta = rowsum(dvb v) + rowsum(dkb k), dkb = (dA * Gamma) k + e^gamma dX
    dk = e^{gamma_C - gamma} dKd + (dA * Gamma)^T (beta k) + beta dkb + (dAqk * Gamma_incl)^T q
    dq = (dAqk * Gamma_incl) k + e^gamma dQg
    d gamma: row / column sums of M = dA * A + strict(dAqk * Aqk)

Every product has float32 accumulation on bf16 operands: the inputs, h_n, dh_n, Vn, dVn as stored;
T, T^T dVn and dVn Vn^T as bf16 (hi, lo) pairs (~16 mantissa bits); dA * Gamma and dAqk * Gamma
rounded once to bf16 before their [C, C] x [C, K] products (as the Triton kernels' bf16
intermediates). dA is formed as -strict(T^T (dVn Vn^T)), equal to -strict((T^T dVn) Vn^T). Batched
over every chunk of every head, each stage one large matmul (cuBLAS on GPU), operands that share a
right-hand side stacked so that it is read once (S: [dO; (T^T dVn) hi; lo] S^T; Vn: [dO; dVn] Vn^T;
K: [dKK; dQK] K). The [C, K] float32 intermediates go through HBM: at B2 T8192 H8 D256 each is
134 MB (first version, all products separate: 2.445 ms on an H200, results/hopper_h200/NOTE.md 26).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .config import KernelCall
from .hopper.common import split_hi_lo  # float32 -> (hi, lo) bf16 pair

F32, BF16 = jnp.float32, jnp.bfloat16


def _mm(eq, a, b):
    """einsum ``eq`` with float32 accumulation; a float32 operand enters as a bf16 (hi, lo) pair
    (two products; at most one operand may be float32)."""
    a32, b32 = jnp.dtype(a.dtype) == F32, jnp.dtype(b.dtype) == F32
    if a32 and b32:
        raise ValueError("_mm: at most one float32 operand")
    if a32:
        hi, lo = split_hi_lo(a)
        return (jnp.einsum(eq, hi, b, preferred_element_type=F32)
                + jnp.einsum(eq, lo, b, preferred_element_type=F32))
    if b32:
        hi, lo = split_hi_lo(b)
        return (jnp.einsum(eq, a, hi, preferred_element_type=F32)
                + jnp.einsum(eq, a, lo, preferred_element_type=F32))
    return jnp.einsum(eq, a, b, preferred_element_type=F32)


def chunk_grads_xla(call: KernelCall, q, k, v, do, beta, gam, e_gam, e_gam_end, h, dh, vn, dvn, t_hi, t_lo):
    """The local gradients of every chunk (the XLA twin of :func:`gdn_jax.ops.pallas.hopper.grads.chunk_grads`).

    Args: q, k [B, T, Hk, K] and v, dO [B, T, H, V] (token layout, 16-bit); beta, gamma, e^gamma,
      e^{gamma_C - gamma} columns [BH, T, 1] f32; h, dh [BH, n, K, V] (the state entering each chunk
      and the gradient of the one leaving it); vn, dvn [BH, T, V]; T = t_hi + t_lo [BH, n, C, C] bf16.
    Returns a dict: ``dq, dk`` (per VALUE head) and ``dv`` in the token layout (input dtype);
      ``dbeta, dgam, de_gam, de_gam_end`` [BH, T, 1] and ``dgam_row`` [BH, n, 1, C], f32
      (d e^{gamma_C} comes from the reverse pass).
    """
    if call.layout != "bthd":
        raise ValueError(f"chunk_grads_xla: the token layout [B, T, H, D] only (got layout {call.layout!r})")
    C, V, BH, H, G, n, Tp = call.C, call.V, call.BH, call.H, call.group, call.n, call.Tp
    B = BH // H
    in_dt = jnp.dtype(call.in_dt)
    lo_dt = BF16 if in_dt == jnp.dtype(F32) else in_dt  # the operands' 16-bit dtype

    def chunks(x, heads):  # [B, Tp, heads, D] -> [BH, n, C, D] per value head
        D = x.shape[-1]
        x = jnp.moveaxis(x.reshape(B, n, C, heads, D), 3, 1)
        if heads != H:
            x = jnp.repeat(x, H // heads, axis=1)
        return x.reshape(BH, n, C, D).astype(lo_dt)

    def tokens(x):  # [BH, n, C, D] f32 -> [B, Tp, H, D] in the input dtype
        D = x.shape[-1]
        return jnp.moveaxis(x.reshape(B, H, Tp, D), 1, 2).astype(in_dt)

    qc, kc = chunks(q, H // G), chunks(k, H // G)
    vc, doc = chunks(v, H), chunks(do, H)
    col = lambda x: x.reshape(BH, n, C, 1).astype(F32)
    beta_c, gam_c, eg, ege = col(beta), col(gam), col(e_gam), col(e_gam_end)
    vn_c, dvn_c = vn.reshape(BH, n, C, V).astype(lo_dt), dvn.reshape(BH, n, C, V).astype(lo_dt)
    S, dS = h.astype(lo_dt), dh.astype(lo_dt)

    i = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    j = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    strict, incl = i > j, i >= j
    gdiff = gam_c - jnp.swapaxes(gam_c, -1, -2)  # gamma_i - gamma_j
    Gs = jnp.where(strict, jnp.exp(jnp.where(strict, gdiff, 0.0)), 0.0)
    Gi = jnp.where(incl, jnp.exp(jnp.where(incl, gdiff, 0.0)), 0.0)

    ein = lambda eq, a, b: jnp.einsum(eq, a, b, preferred_element_type=F32)
    th, tl = t_hi.astype(lo_dt), t_lo.astype(lo_dt)
    kf = kc.astype(F32)
    # the products over V, each big operand read once. [dO; dVn] against Vn: dAqk = dO Vn^T and
    # DV = dVn Vn^T in one product
    G1 = ein("bnscv,bndv->bnscd", jnp.stack([doc, dvn_c], axis=2), vn_c)
    dAqk, DV = G1[:, :, 0], G1[:, :, 1]
    dvb = ein("bndc,bndv->bncv", th, dvn_c) + ein("bndc,bndv->bncv", tl, dvn_c)  # T^T dVn
    dv = dvb * beta_c
    dbeta = jnp.sum(dvb * vc.astype(F32), -1, keepdims=True)
    # [dO; (T^T dVn) hi; lo] against S: dQg = dO S^T and dX = T^T dW = -(T^T dVn) S^T in one product
    G2 = ein("bnscv,bnkv->bnsck", jnp.stack([doc, *split_hi_lo(dvb)], axis=2), S)
    dQg, dX = G2[:, :, 0], -(G2[:, :, 1] + G2[:, :, 2])
    dKd = ein("bncv,bnkv->bnck", vn_c, dS)

    # C x C: A = strict((beta K) K^T * Gamma), Aqk = Q K^T * Gamma_incl, dA = -strict(T^T (dVn Vn^T))
    G3 = ein("bnsck,bndk->bnscd", jnp.stack([kc, qc], axis=2), kc)
    A = beta_c * G3[:, :, 0] * Gs
    Aqk = call.scale * G3[:, :, 1] * Gi
    dA = -jnp.where(strict, _mm("bndc,bnde->bnce", th, DV) + _mm("bndc,bnde->bnce", tl, DV), 0.0)
    M = dA * A + jnp.where(strict, dAqk * Aqk, 0.0)
    dKK = dA * Gs
    dQK = dAqk * Gi
    # the [C, C] x [C, K] products with single-bf16 [C, C] operands (as the Triton kernels' bf16
    # intermediates): [dKK; dQK] K for dkb and dq, then dk's (dKK beta)^T K + (dQK scale)^T Q
    G4 = ein("bnscd,bndk->bnsck", jnp.stack([dKK, dQK], axis=2).astype(lo_dt), kc)
    dkb = G4[:, :, 0] + dX * eg
    dq = (G4[:, :, 1] + dQg * eg) * call.scale
    dk = (dKd * ege + dkb * beta_c + ein("bndc,bndk->bnck", (dKK * beta_c).astype(lo_dt), kc)
          + ein("bndc,bndk->bnck", (dQK * call.scale).astype(lo_dt), qc))
    dbeta = dbeta + jnp.sum(dkb * kf, -1, keepdims=True)
    deg = jnp.sum(dX * kf * beta_c, -1, keepdims=True) + call.scale * jnp.sum(dQg * qc.astype(F32), -1, keepdims=True)
    de_gam_end = jnp.sum(dKd * kf, -1, keepdims=True)
    cols = lambda x: x.reshape(BH, Tp, 1)
    return dict(dq=tokens(dq), dk=tokens(dk), dv=tokens(dv), dbeta=cols(dbeta), dgam=cols(jnp.sum(M, -1, keepdims=True)),
                dgam_row=-jnp.sum(M, -2, keepdims=True), de_gam=cols(deg), de_gam_end=cols(de_gam_end))
