"""Forward state pass over the chunks (and, unfused, the output kernel).

Per (batch x head, block of bv value channels), a ``fori_loop`` over the chunks with the state
S [K, bv] held on chip; per chunk n, with S the state entering it::

    Vn  = U - W S                                 (the chunk's corrected values)
    O   = (Q * e^gamma) S + Aqk Vn                (fused forward: written here)
    S  <- e^{gamma_C} S + (K * e^{gamma_C - gamma})^T Vn

With ``cu_seqlens`` the state restarts from the sequence's initial state at its first chunk and
is written out after its last (flags from :func:`gdn_jax.ops.packing.chunk_flags`). Only the
first and last dots sit on the S -> S' dependency chain.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import platform as _plat
from . import state_tpu
from . import tiles as _t
from .config import KernelCall
from .layout import hm_spec, run, sds, token_shape, token_spec

F32 = _t.F32


def forward_state_loop(call: KernelCall, *, k_ref, e_gam_end_ref, e_gam_last_ref, h0_ref, w_ref=None, u_ref=None,
                       flags_ref=None, final_ref=None, vn_ref=None, h_ref=None, q_ref=None, e_gam_ref=None,
                       aqk_ref=None, o_ref=None, t0_ref=None, v_ref=None, beta_ref=None, gam_ref=None,
                       gam_row_ref=None):
    """The loop of the forward state pass. Writes, where given: ``h_ref`` (the state entering each
    chunk), ``vn_ref`` (Vn), ``o_ref`` (O; needs ``q_ref``, ``e_gam_ref``, ``aqk_ref``) and
    ``final_ref`` (the final state of each sequence).

    Vn of each chunk, with S the state entering it: ``U - W S`` from ``w_ref``, ``u_ref`` (the WY
    form), or with ``t0_ref`` (the gate-free form, path ``gatefree``: also ``v_ref``, ``beta_ref``,
    ``gam_ref``, ``gam_row_ref``; T0 the chunk's gate-free inverse, D_ij = e^{gamma_i - gamma_j},
    i >= j)::

        Vn = (T0 * D) (beta * (V - e^gamma * (K S)))       (= U - W S of the WY form)

    K S, the T0 * D product and the update then sit on the S -> S' dependency chain (one C x C x bv
    dot more than W S; no W, U round trip through HBM); the T0 * D product is a float32 dot whatever
    the intermediates' dtype (the WY kernel's T products are float32 too)."""
    C = call.C

    def body(i, S):
        t0 = pl.multiple_of(i * C, C)
        if call.packed:
            sid, first, last = _t.chunk_flags(flags_ref, i)
            S = lax.cond(first, lambda: _t.load_f32(h0_ref, sid), lambda: S)
        if h_ref is not None:
            h_ref[i] = S.astype(h_ref.dtype)
        rows = pl.ds(t0, C)
        sdt = call.state_dt
        k = None
        if t0_ref is None:
            vn = _t.load_f32(u_ref, rows, slice(None)) - _t.mm(call, w_ref[rows, :], S, dt=sdt)
        else:
            k = _t.load_f32(k_ref, rows, slice(None))
            ks = _t.mm(call, k, S, dt=sdt)
            x = beta_ref[rows, :] * (_t.load_f32(v_ref, rows, slice(None)) - e_gam_ref[rows, :] * ks)
            tm = t0_ref[i] * _t.decay_matrix(gam_ref[rows, :], gam_row_ref[i], incl=True)
            # a float32 dot, as the WY kernel forms U = T (beta V) and W: with bf16 operands the rounding
            # of each of the C entries of x adds up in Vn (measured: o 4-8 % and the final state up to
            # 22 % further from float64 than the WY form's, bf16 inputs at K = V = 64 and 128)
            vn = _t.mm(call, tm, x, dt=F32)
        if vn_ref is not None:
            vn_ref[rows, :] = vn.astype(vn_ref.dtype)
        if o_ref is not None:
            qg = _t.load_f32(q_ref, rows, slice(None)) * (e_gam_ref[rows, :] * call.scale)
            o = _t.mm(call, qg, S, dt=call.out_dt) + _t.mm(call, aqk_ref[i], vn, dt=call.out_dt)
            o_ref[rows, :] = o.astype(o_ref.dtype)
        kd = (_t.load_f32(k_ref, rows, slice(None)) if k is None else k) * e_gam_end_ref[rows, :]
        S = e_gam_last_ref[i] * S + _t.mm(call, kd, vn, ta=True, dt=sdt)
        if call.packed and final_ref is not None:

            @pl.when(last)
            def _():
                final_ref[sid] = S.astype(final_ref.dtype)

        return S

    S0 = jnp.zeros(h0_ref.shape[1:], F32) if call.packed else _t.load_f32(h0_ref, 0)
    S = lax.fori_loop(0, call.n, body, S0)
    if not call.packed and final_ref is not None:
        final_ref[0] = S.astype(final_ref.dtype)


def state_specs(call: KernelCall, bv):
    """BlockSpecs of the GPU / interpret state passes (grid (bh, value block j); whole sequences
    per program; the TPU passes stream by chunk, :mod:`.state_tpu`):
    token [T, K] (q, k: key heads), token [T, bv], head-major [T, K] and [T, bv], scalar column
    [T, 1], e^{gamma_C} [n, 1, 1],
    states [nseq, K, bv] and per-chunk states [n, K, bv]."""
    Tp, K, n = call.Tp, call.K, call.n
    return dict(
        tok_k=token_spec(call, Tp, K, lambda b, j: (b, 0, 0), key=True),
        tok_v=token_spec(call, Tp, bv, lambda b, j: (b, 0, j)),
        hm_k=hm_spec(Tp, K, lambda b, j: (b, 0, 0)),
        hm_v=hm_spec(Tp, bv, lambda b, j: (b, 0, j)),
        col=hm_spec(Tp, 1, lambda b, j: (b, 0, 0)),
        last=pl.BlockSpec((None, n, 1, 1), lambda b, j: (b, 0, 0, 0)),
        state=pl.BlockSpec((None, call.nseq, K, bv), lambda b, j: (b, 0, 0, j)),
        chunk_states=pl.BlockSpec((None, n, K, bv), lambda b, j: (b, 0, 0, j)),
    )


def flags_input(call: KernelCall, flags):
    return (flags, _plat.smem_spec(call.platform, flags.shape)) if call.packed else None


def forward_states(call: KernelCall, w, u, k, e_gam_end, e_gam_last, h0, flags):
    """Forward state pass writing Vn and the entering states (the backward's recompute; the
    unfused forward). Returns ``vn`` [BH, T, V], ``h`` [BH, n, K, V] (mid dtype) and ``final``
    [BH | H, nseq, K, V] f32. On TPU: :func:`.state_tpu.forward_states` (streamed by chunk)."""
    if _plat.is_tpu_layout(call.platform):
        return state_tpu.forward_states(call, w, u, k, e_gam_end, e_gam_last, h0, flags)
    bv = call.bv_state
    BH, K, V, n, Tp = call.BH, call.K, call.V, call.n, call.Tp
    sp = state_specs(call, bv)
    inputs = dict(w=(w, sp["hm_k"]), u=(u, sp["hm_v"]), k=(k, sp["tok_k"]), e_gam_end=(e_gam_end, sp["col"]),
                  e_gam_last=(e_gam_last, sp["last"]), h0=(h0, sp["state"]), flags=flags_input(call, flags))
    outputs = dict(vn=(sds((BH, Tp, V), call.mid_dt), sp["hm_v"]),
                   h=(sds((BH, n, K, V), call.mid_dt), sp["chunk_states"]),
                   final=(sds(h0.shape, F32), sp["state"]))
    return run(call, functools.partial(forward_state_loop, call), name="gdn_fwd_h", grid=(BH, V // bv),
               inputs=inputs, outputs=outputs, warps=call.warps_state)


def forward_states_and_output(call: KernelCall, w, u, k, e_gam_end, e_gam_last, h0, flags, q, e_gam, aqk):
    """The fused forward: the state pass that also writes o (no h_n / Vn round trip through HBM).
    Returns ``o`` (token layout, input dtype) and ``final`` [BH | H, nseq, K, V] f32. On TPU:
    :func:`.state_tpu.forward_states_and_output` (streamed by chunk)."""
    if _plat.is_tpu_layout(call.platform):
        return state_tpu.forward_states_and_output(call, w, u, k, e_gam_end, e_gam_last, h0, flags, q, e_gam, aqk)
    bv = call.bv_state
    BH, V, n, Tp, C = call.BH, call.V, call.n, call.Tp, call.C
    sp = state_specs(call, bv)
    inputs = dict(w=(w, sp["hm_k"]), u=(u, sp["hm_v"]), k=(k, sp["tok_k"]), e_gam_end=(e_gam_end, sp["col"]),
                  e_gam_last=(e_gam_last, sp["last"]), h0=(h0, sp["state"]), q=(q, sp["tok_k"]),
                  e_gam=(e_gam, sp["col"]), aqk=(aqk, pl.BlockSpec((None, n, C, C), lambda b, j: (b, 0, 0, 0))),
                  flags=flags_input(call, flags))
    outputs = dict(o=(token_shape(call, V, call.in_dt), token_spec(call, Tp, bv, lambda b, j: (b, 0, j))),
                   final=(sds(h0.shape, F32), sp["state"]))
    return run(call, functools.partial(forward_state_loop, call), name="gdn_fwd_h_o", grid=(BH, V // bv),
               inputs=inputs, outputs=outputs, warps=call.warps_state)


def forward_final_state(call: KernelCall, w, u, k, e_gam_end, e_gam_last, h0, flags):
    """The final-state-only forward state pass (the maps' pass of :func:`gdn_jax.ops.state_maps.state_map`
    and of the sequence split): :func:`forward_state_loop` writing neither o nor Vn nor the per-chunk
    states, and reading no q or Aqk (the WY stage then forms no Aqk either). Returns ``final``
    [BH | H, nseq, K, V] f32. On TPU: :func:`.state_tpu.forward_final_state` (streamed by chunk)."""
    if _plat.is_tpu_layout(call.platform):
        return state_tpu.forward_final_state(call, w, u, k, e_gam_end, e_gam_last, h0, flags)
    bv = call.bv_state
    BH, V = call.BH, call.V
    sp = state_specs(call, bv)
    inputs = dict(w=(w, sp["hm_k"]), u=(u, sp["hm_v"]), k=(k, sp["tok_k"]), e_gam_end=(e_gam_end, sp["col"]),
                  e_gam_last=(e_gam_last, sp["last"]), h0=(h0, sp["state"]), flags=flags_input(call, flags))
    outputs = dict(final=(sds(h0.shape, F32), sp["state"]))
    return run(call, functools.partial(forward_state_loop, call), name="gdn_fwd_h_final", grid=(BH, V // bv),
               inputs=inputs, outputs=outputs, warps=call.warps_state)


def _output_kernel(call: KernelCall, *, q_ref, k_ref, gam_ref, gam_row_ref, e_gam_ref, h_ref, vn_ref, o_ref):
    q = _t.load_f32(q_ref) * call.scale
    Aqk = _t.mm(call, q, k_ref[...], tb=True) * _t.decay_matrix(gam_ref[...], gam_row_ref[...], incl=True)
    o = _t.mm(call, q * e_gam_ref[...], h_ref[...], dt=call.out_dt) + _t.mm(call, Aqk, vn_ref[...], dt=call.out_dt)
    o_ref[...] = o.astype(o_ref.dtype)


def output(call: KernelCall, q, k, gam, gam_row, e_gam, h, vn):
    """The unfused forward's output, O = (Q e^gamma) h_n + tril(Q K^T * Gamma) Vn; grid (B*H,
    chunks, V/bv_out). Returns ``o`` in the token layout and input dtype."""
    bv = call.bv_out
    C, K, V, BH, n = call.C, call.K, call.V, call.BH, call.n
    tk = token_spec(call, C, K, lambda b, c, j: (b, c, 0), key=True)
    col = hm_spec(C, 1, lambda b, c, j: (b, c, 0))
    inputs = dict(q=(q, tk), k=(k, tk), gam=(gam, col),
                  gam_row=(gam_row, pl.BlockSpec((None, None, 1, C), lambda b, c, j: (b, c, 0, 0))),
                  e_gam=(e_gam, col), h=(h, pl.BlockSpec((None, None, K, bv), lambda b, c, j: (b, c, 0, j))),
                  vn=(vn, hm_spec(C, bv, lambda b, c, j: (b, c, j))))
    outputs = dict(o=(token_shape(call, V, call.in_dt), token_spec(call, C, bv, lambda b, c, j: (b, c, j))))
    return run(call, functools.partial(_output_kernel, call), name="gdn_fwd_o", grid=(BH, n, V // bv),
               inputs=inputs, outputs=outputs, warps=call.warps_out)


def forward_states_and_output_gatefree(call: KernelCall, q, k, v, beta, gam, gam_row, e_gam, e_gam_end, e_gam_last,
                                       h0, flags, t0, aqk):
    """The gate-free forward state pass (path ``gatefree``, :func:`forward_state_loop` with ``t0_ref``): reads v,
    beta and the chunks' T0 and Aqk (:func:`.inverse_gatefree.t0_and_aqk`) instead of W and U.
    Returns ``o`` (token layout, input dtype) and ``final`` [BH | H, nseq, K, V] f32. GPU /
    interpret layout only. With ``q`` and ``aqk`` None (:func:`forward_final_state_gatefree`) no
    output: ``final`` alone."""
    bv = call.bv_state
    BH, V, n, C = call.BH, call.V, call.n, call.C
    sp = state_specs(call, bv)
    tile = pl.BlockSpec((None, n, C, C), lambda b, j: (b, 0, 0, 0))
    with_o = q is not None
    inputs = dict(k=(k, sp["tok_k"]), v=(v, sp["tok_v"]), beta=(beta, sp["col"]), gam=(gam, sp["col"]),
                  gam_row=(gam_row, pl.BlockSpec((None, n, 1, C), lambda b, j: (b, 0, 0, 0))),
                  e_gam_end=(e_gam_end, sp["col"]), e_gam_last=(e_gam_last, sp["last"]), h0=(h0, sp["state"]),
                  q=(q, sp["tok_k"]) if with_o else None, e_gam=(e_gam, sp["col"]), t0=(t0, tile),
                  aqk=(aqk, tile) if with_o else None, flags=flags_input(call, flags))
    outputs = dict(o=(token_shape(call, V, call.in_dt), token_spec(call, call.Tp, bv, lambda b, j: (b, 0, j))),
                   final=(sds(h0.shape, F32), sp["state"]))
    if not with_o:
        del outputs["o"]
    return run(call, functools.partial(forward_state_loop, call),
               name="gdn_fwd_h_o_gatefree" if with_o else "gdn_fwd_h_final_gatefree", grid=(BH, V // bv),
               inputs=inputs, outputs=outputs, warps=call.warps_state)


def forward_final_state_gatefree(call: KernelCall, k, v, beta, gam, gam_row, e_gam, e_gam_end, e_gam_last, h0, flags,
                                 t0):
    """The final-state-only gate-free forward state pass: :func:`forward_states_and_output_gatefree`
    without q, Aqk and o. Returns ``final`` [BH | H, nseq, K, V] f32."""
    return forward_states_and_output_gatefree(call, None, k, v, beta, gam, gam_row, e_gam, e_gam_end, e_gam_last, h0,
                                              flags, t0, None)
