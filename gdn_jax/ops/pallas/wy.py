"""Intra-chunk WY / UT representation (DeltaNet, Yang et al. 2024, §3; gated: GDN paper §3.3).

Per (batch x head, chunk of C tokens), with gamma the in-chunk cumulative log decay and q
already multiplied by ``scale``::

    Gamma_ij = exp(gamma_i - gamma_j) for i >= j (exponent masked before exp), else 0
    A   = strictly_lower((beta K) K^T * Gamma);   T = (I + A)^-1
    W   = T ((beta K) * e^gamma);                 U = T (beta V)
    Aqk = tril(Q K^T * Gamma)                     (forward: for the fused state pass / output)
    dVl = Aqk^T dO                                (backward: the intra-chunk part of dVn)
"""
from __future__ import annotations

import functools

from jax.experimental import pallas as pl

from . import tiles as _t
from .config import KernelCall
from .layout import hm_spec, run, sds, token_spec

F32 = _t.F32


def _wy_kernel(call: KernelCall, *, k_ref, v_ref, beta_ref, gam_ref, gam_row_ref, e_gam_ref, w_ref, u_ref,
               q_ref=None, do_ref=None, aqk_ref=None, dvl_ref=None, t_ref=None):
    """One chunk: W, U; with q also Aqk (forward) or, with q and dO, dVl = Aqk^T dO and T (backward)."""
    k = _t.load_f32(k_ref)
    beta = beta_ref[...]
    gam, gam_row = gam_ref[...], gam_row_ref[...]
    kb = k * beta
    A = _t.mm(call, kb, k, tb=True) * _t.decay_matrix(gam, gam_row, incl=False)
    T = _t.inv_unit_lower(call, A)
    if t_ref is not None:
        t_ref[...] = T
    w_ref[...] = _t.mm(call, T, kb * e_gam_ref[...], dt=F32).astype(w_ref.dtype)
    u_ref[...] = _t.mm(call, T, _t.load_f32(v_ref) * beta, dt=F32).astype(u_ref.dtype)
    if q_ref is not None:
        q = _t.load_f32(q_ref) * call.scale
        Aqk = _t.mm(call, q, k, tb=True) * _t.decay_matrix(gam, gam_row, incl=True)
        if aqk_ref is not None:
            aqk_ref[...] = Aqk.astype(aqk_ref.dtype)
        else:
            dvl_ref[...] = _t.mm(call, Aqk, do_ref[...], ta=True).astype(dvl_ref.dtype)


def wy_repr(call: KernelCall, k, v, beta, gam, gam_row, e_gam, q=None, do=None):
    """The WY representation of every chunk; grid (B*H, chunks), one chunk per program.

    Args: k, v (and q, dO) in the token layout; beta, gamma, e^gamma columns [BH, T, 1] f32;
      gamma row [BH, n, 1, C].
    Returns a dict: ``w`` [BH, T, K] (mid dtype), ``u`` [BH, T, V] (``u_dt``); with ``q`` only,
      ``aqk`` [BH, n, C, C] (``out_dt``); with ``q`` and ``do``, ``dvl`` [BH, T, V] (mid dtype)
      and, if ``call.save_t``, ``t`` [BH, n, C, C] f32.
    """
    C, K, V, BH, n, Tp = call.C, call.K, call.V, call.BH, call.n, call.Tp
    backward = do is not None
    tk = token_spec(call, C, K, lambda b, c: (b, c, 0), key=True)
    tv = token_spec(call, C, V, lambda b, c: (b, c, 0))
    col = hm_spec(C, 1, lambda b, c: (b, c, 0))
    tile = pl.BlockSpec((None, None, C, C), lambda b, c: (b, c, 0, 0))
    inputs = dict(q=None if q is None else (q, tk), k=(k, tk), v=(v, tv), do=(do, tv) if backward else None,
                  beta=(beta, col), gam=(gam, col),
                  gam_row=(gam_row, pl.BlockSpec((None, None, 1, C), lambda b, c: (b, c, 0, 0))),
                  e_gam=(e_gam, col))
    outputs = dict(w=(sds((BH, Tp, K), call.mid_dt), hm_spec(C, K, lambda b, c: (b, c, 0))),
                   u=(sds((BH, Tp, V), call.u_dt), hm_spec(C, V, lambda b, c: (b, c, 0))))
    if backward:
        outputs["dvl"] = (sds((BH, Tp, V), call.mid_dt), hm_spec(C, V, lambda b, c: (b, c, 0)))
        if call.save_t:
            outputs["t"] = (sds((BH, n, C, C), F32), tile)
    elif q is not None:
        outputs["aqk"] = (sds((BH, n, C, C), call.out_dt), tile)
    mode = "bwd" if backward else ("fwd" if q is not None else "wu")
    return run(call, functools.partial(_wy_kernel, call), name=f"gdn_wy_{mode}", grid=(BH, n), inputs=inputs,
               outputs=outputs, warps=call.warps_wy)
