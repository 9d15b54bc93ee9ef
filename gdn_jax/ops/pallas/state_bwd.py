"""Backward state passes: the reverse pass over the chunks, alone or merged in one launch with
the forward recompute of :mod:`.state_fwd`.

Reverse pass, per (batch x head, block of bv value channels), a ``fori_loop`` from the last chunk
with dS [K, bv] (the gradient w.r.t. the state leaving chunk n) held on chip::

    dh_n = dS                                      (written: the gradient kernel reads it)
    dVn  = dVl + (K * e^{gamma_C - gamma}) dS
    dS  <- e^{gamma_C} dS + (Q * e^gamma)^T dO - W^T dVn

and d initial_state = dS after the first chunk (per sequence with ``cu_seqlens``, where dS
restarts from d final_state at each sequence's last chunk).
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
from .layout import run, sds
from .state_fwd import flags_input, forward_state_loop, state_specs

F32 = _t.F32


def reverse_state_loop(call: KernelCall, *, q_ref, k_ref, w_ref, dvl_ref, do_ref, e_gam_ref, e_gam_end_ref,
                       e_gam_last_ref, dfinal_ref, dh_ref, dvn_ref, dh0_ref, flags_ref=None):
    """The loop of the reverse state pass: writes dh_n, dVn and d initial_state."""
    C, n = call.C, call.n

    def body(jj, dS):
        i = n - 1 - jj
        t0 = pl.multiple_of(i * C, C)
        if call.packed:
            sid, first, last = _t.chunk_flags(flags_ref, i)
            dS = lax.cond(last, lambda: _t.load_f32(dfinal_ref, sid), lambda: dS)
        dh_ref[i] = dS.astype(dh_ref.dtype)
        rows = pl.ds(t0, C)
        kd = _t.load_f32(k_ref, rows, slice(None)) * e_gam_end_ref[rows, :]
        sdt = call.state_dt
        dvn = _t.load_f32(dvl_ref, rows, slice(None)) + _t.mm(call, kd, dS, dt=sdt)
        dvn_ref[rows, :] = dvn.astype(dvn_ref.dtype)
        qg = _t.load_f32(q_ref, rows, slice(None)) * (e_gam_ref[rows, :] * call.scale)
        dS = (e_gam_last_ref[i] * dS + _t.mm(call, qg, do_ref[rows, :], ta=True, dt=sdt)
              - _t.mm(call, w_ref[rows, :], dvn, ta=True, dt=sdt))
        if call.packed:

            @pl.when(first)
            def _():
                dh0_ref[sid] = dS.astype(dh0_ref.dtype)

        return dS

    dS0 = jnp.zeros(dfinal_ref.shape[1:], F32) if call.packed else _t.load_f32(dfinal_ref, 0)
    dS = lax.fori_loop(0, n, body, dS0)
    if not call.packed:
        dh0_ref[0] = dS.astype(dh0_ref.dtype)


def reverse_states(call: KernelCall, q, k, w, dvl, do, e_gam, e_gam_end, e_gam_last, dfinal, flags):
    """The reverse state pass; grid (B*H, V/bv_state). Returns ``dh`` [BH, n, K, V], ``dvn``
    [BH, T, V] (mid dtype) and ``dh0`` [BH | H, nseq, K, V] f32. On TPU:
    :func:`.state_tpu.reverse_states` (streamed by chunk, from the last)."""
    if _plat.is_tpu_layout(call.platform):
        return state_tpu.reverse_states(call, q, k, w, dvl, do, e_gam, e_gam_end, e_gam_last, dfinal, flags)
    bv = call.bv_state
    BH, K, V, n, Tp = call.BH, call.K, call.V, call.n, call.Tp
    sp = state_specs(call, bv)
    inputs = dict(q=(q, sp["tok_k"]), k=(k, sp["tok_k"]), w=(w, sp["hm_k"]), dvl=(dvl, sp["hm_v"]),
                  do=(do, sp["tok_v"]), e_gam=(e_gam, sp["col"]), e_gam_end=(e_gam_end, sp["col"]),
                  e_gam_last=(e_gam_last, sp["last"]), dfinal=(dfinal, sp["state"]), flags=flags_input(call, flags))
    outputs = dict(dh=(sds((BH, n, K, V), call.mid_dt), sp["chunk_states"]),
                   dvn=(sds((BH, Tp, V), call.mid_dt), sp["hm_v"]),
                   dh0=(sds(dfinal.shape, F32), sp["state"]))
    return run(call, functools.partial(reverse_state_loop, call), name="gdn_bwd_dh", grid=(BH, V // bv),
               inputs=inputs, outputs=outputs, warps=call.warps_state)


def _merged_kernel(call: KernelCall, *, w_ref, u_ref, k_ref, e_gam_end_ref, e_gam_last_ref, h0_ref, q_ref, dvl_ref,
                   do_ref, e_gam_ref, dfinal_ref, vn_ref, h_ref, dh_ref, dvn_ref, dh0_ref, flags_ref=None):
    d = pl.program_id(2)

    @pl.when(d == 0)
    def _():
        forward_state_loop(call, w_ref=w_ref, u_ref=u_ref, k_ref=k_ref, e_gam_end_ref=e_gam_end_ref,
                           e_gam_last_ref=e_gam_last_ref, h0_ref=h0_ref, flags_ref=flags_ref, vn_ref=vn_ref,
                           h_ref=h_ref)

    @pl.when(d == 1)
    def _():
        reverse_state_loop(call, q_ref=q_ref, k_ref=k_ref, w_ref=w_ref, dvl_ref=dvl_ref, do_ref=do_ref,
                           e_gam_ref=e_gam_ref, e_gam_end_ref=e_gam_end_ref, e_gam_last_ref=e_gam_last_ref,
                           dfinal_ref=dfinal_ref, dh_ref=dh_ref, dvn_ref=dvn_ref, dh0_ref=dh0_ref,
                           flags_ref=flags_ref)


def merged_states(call: KernelCall, w, u, k, e_gam_end, e_gam_last, h0, q, dvl, do, e_gam, dfinal, flags):
    """The forward recompute (Vn, h_n; no final state) and the reverse pass in one launch, grid
    (B*H, V/bv_state, 2): direction 0 runs the forward, direction 1 the reverse. They are
    independent, so this doubles the concurrent sequential chains (``call.merge_state``; GPU /
    interpret only: each program writes only its own outputs, which the TPU pipeline would not
    allow). Returns ``vn``, ``h``, ``dh``, ``dvn``, ``dh0``."""
    bv = call.bv_state
    BH, K, V, n, Tp = call.BH, call.K, call.V, call.n, call.Tp
    sp = {name: pl.BlockSpec(s.block_shape, lambda b, j, d, im=s.index_map: im(b, j))
          for name, s in state_specs(call, bv).items()}
    inputs = dict(w=(w, sp["hm_k"]), u=(u, sp["hm_v"]), k=(k, sp["tok_k"]), e_gam_end=(e_gam_end, sp["col"]),
                  e_gam_last=(e_gam_last, sp["last"]), h0=(h0, sp["state"]), q=(q, sp["tok_k"]),
                  dvl=(dvl, sp["hm_v"]), do=(do, sp["tok_v"]), e_gam=(e_gam, sp["col"]),
                  dfinal=(dfinal, sp["state"]), flags=flags_input(call, flags))
    outputs = dict(vn=(sds((BH, Tp, V), call.mid_dt), sp["hm_v"]),
                   h=(sds((BH, n, K, V), call.mid_dt), sp["chunk_states"]),
                   dh=(sds((BH, n, K, V), call.mid_dt), sp["chunk_states"]),
                   dvn=(sds((BH, Tp, V), call.mid_dt), sp["hm_v"]),
                   dh0=(sds(dfinal.shape, F32), sp["state"]))
    return run(call, functools.partial(_merged_kernel, call), name="gdn_bwd_h_dh", grid=(BH, V // bv, 2),
               inputs=inputs, outputs=outputs, warps=call.warps_state)

