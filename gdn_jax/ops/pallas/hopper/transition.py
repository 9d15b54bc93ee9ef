"""The forward state pass in its "transition" form on Hopper (``HopperTuning.fwd_form="transition"``,
opt-in; results/hopper_h200/NOTE.md items 28-29). On one H200 it is correct (GPU
check 10 of 10 at K = 64) but slower than the default pass: 2x8192x16x64 state pass 0.255 vs 0.157 ms
(~1.75x the wgmma work per chunk step on one warpgroup; the rounds were not the bound).

Today's pass (:func:`.state_fwd.forward_states_and_output`, "wu") has two dependent wgmma rounds per chunk
on its S chain, and its output work needs the chain's Vn. With the chunk's transition matrix
(gamma the in-chunk cumulative log decay, K~ = diag(e^{gamma_C - gamma}) K, W and U of the WY
representation)::

    M_i     = -K~_i^T W_i                                  (K x K, independent of S: formed before the pass)
    S_{i+1} = e^{gamma_C} S_i + K~_i^T U_i + M_i bf16(S_i)  one wgmma group on the chain
    Vn_i    = U_i - W_i bf16(S_i),  o_i = e^{gamma} scale Q_i bf16(S_i) + Aqk_i Vn_i

so nothing on the chain waits for Vn. Each chunk step issues one group of wgmmas -- the chain's
(K~^T U and M S into the float32 state, the decay an elementwise product), W S and Q S for this
chunk, the previous chunk's Aqk Vn and the next chunk's M -- and waits once; Vn is formed after the
wait and feeds the next step's group (the previous chunk's output leaves one step late). K~ of the
next chunk is formed by the threads from its k tile before the group, M (bf16, float32
accumulation, negated) stored after it: neither touches HBM. Three TMA slots: the chunk before (its
Aqk), this one and the next (its k and W for M); two K~ and two M tiles. The numerics of the form:
``benchmarks/study_transition_form.py`` (as accurate as "wu").

Covers what the "wu" pass covers at K <= 128 without the producer warpgroup: per-head g and beta,
initial / final state, ``cu_seqlens``, GVA, ``save_states`` (h and Vn for the backward).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..._vma import varying_kernel
from ..call import KernelCall
from .common import (BF16, F32, Transposed, chunk_last_row, i32, kernel_kw, load_tile, mmas, plgpu_api, slot_flags, smem, tile_in, tile_out)
from .plan import SLOTS


def forward_states_transition(call: KernelCall, w, u, k, e_gam_end, e_gam_last, h0, flags, q, e_gam, aqk,
                              save_states: bool = False):
    """The forward state pass fused with the output, transition form (see the module docstring).
    Arguments and result as :func:`.hopper.state_fwd.forward_states_and_output` ("wu": ``w`` [BH, T, K], ``u``
    [BH, T, V], ``k`` and ``q`` in the token layout, ``aqk`` [BH, n, C, C]): ``o`` [B, T, H, V] and
    ``final`` (float32), with ``save_states`` also ``h`` [BH, n, K, V] and ``vn`` [BH, T, V] (bf16)."""
    plgpu = plgpu_api()
    interp = call.platform == "interpret"
    C, K, V, BH, H, G, n, Tp = call.C, call.K, call.V, call.BH, call.H, call.group, call.n, call.Tp
    B = BH // H
    bv = call.bv_mosaic
    in_dt = jnp.dtype(call.in_dt)
    last_row = chunk_last_row(call, e_gam_last, flags)
    gates = jnp.stack([e_gam.reshape(BH, n, C) * call.scale, e_gam_end.reshape(BH, n, C), last_row],
                      axis=2).astype(F32)
    sw = min(128, 2 * bv)
    D = SLOTS
    slots = dict(q_s=smem((D, C, K), in_dt, sw), k_s=smem((D, C, K), in_dt, sw), w_s=smem((D, C, K), BF16, sw),
                 u_s=smem((D, C, bv), BF16, sw), a_s=smem((D, C, C), BF16, sw), g_s=plgpu.SMEM((D, 3, C), F32))
    scratch = dict(slots, kt_s=smem((2, C, K), BF16, sw), m_s=smem((2, K, K), BF16, sw), s_s=smem((K, bv), BF16, sw),
                   vn_s=smem((C, bv), BF16, sw), o_s=smem((C, bv), in_dt, sw), f_s=smem((K, bv), F32),
                   bars=[plgpu.Barrier(num_barriers=D) for _ in slots], h0_bar=plgpu.Barrier(num_barriers=1))
    in_names = ["q_ref", "k_ref", "w_ref", "u_ref", "a_ref", "g_ref", "h0_ref"]
    out_names = ["o_ref", "fin_ref"] + (["h_ref", "vno_ref"] if save_states else [])

    def body(*refs):
        r = dict(zip(in_names + out_names + list(scratch), refs))
        bh = lax.axis_index("bh")
        b, h = lax.div(bh, i32(H)), lax.rem(bh, i32(H))
        hk = lax.div(h, i32(G)) if G > 1 else h
        vsl = pl.ds(lax.axis_index("vb") * bv, bv)
        s_s, vn_s, o_s, f_s, g_s, kt_s, m_s = (r[x] for x in ("s_s", "vn_s", "o_s", "f_s", "g_s", "kt_s", "m_s"))
        bars = r["bars"]
        row = plgpu.Layout.WGMMA.reduce(1)
        bcast = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])

        def fetch(i, slot):
            rows = pl.ds(i * C, C)
            src = dict(q_s=r["q_ref"].at[b, rows, hk], k_s=r["k_ref"].at[b, rows, hk], w_s=r["w_ref"].at[bh, rows],
                       u_s=r["u_ref"].at[bh, rows, vsl], a_s=r["a_ref"].at[bh, i], g_s=r["g_ref"].at[bh, i])
            for name, bar in zip(slots, bars):
                plgpu.copy_gmem_to_smem(src[name], r[name].at[slot], bar.at[slot])

        def wait(slot):  # every copy of the chunk in ``slot`` (each slot's barriers waited once per fill)
            for bar in bars:
                plgpu.barrier_wait(bar.at[slot])

        def form_kt(slot, par):  # K~ = bf16(e^{gamma_C - gamma} k) of the chunk in ``slot`` into kt_s[par]
            kk = load_tile(r["k_s"].at[slot], plgpu.Layout.WGMMA, interp).astype(F32)
            kt_s[par] = (kk * bcast(load_tile(g_s.at[slot, 1], row, interp), (C, K))).astype(BF16)

        load_state = lambda seq: tile_in(r["h0_ref"].at[bh, seq, :, vsl], f_s, r["h0_bar"].at[0], interp)
        store_state = lambda S, seq: tile_out(S, f_s, r["fin_ref"].at[bh, seq, :, vsl])
        store_o = lambda o, j: tile_out(o, o_s, r["o_ref"].at[b, pl.ds(j * C, C), h, vsl])

        def zeros(shape):
            z = jnp.zeros(shape, F32)
            return z if interp else plgpu.layout_cast(z, plgpu.Layout.WGMMA)

        # traced slot / parity indices: JAX 0.11.2's Mosaic GPU lowering rejects a constant ref index
        # inside an initialised accumulator's run_state ("must be represented by ir.Values")
        zero = lax.axis_index("vb") * 0
        fetch(0, 0)
        if n > 1:
            fetch(1, 1)
        wait(0)
        form_kt(zero, zero)
        plgpu.commit_smem()
        (M0,) = mmas([(zeros((K, K)), Transposed(kt_s.at[zero]), r["w_s"].at[zero])], interp)
        m_s[0] = (-M0).astype(BF16)  # committed with the first step's stores
        S0 = zeros((K, bv)) if call.packed else load_state(0)

        def step(i, carry):
            S, o0_prev = carry  # o0_prev: the previous chunk's e^gamma scale Q S (its Aqk Vn still to add)
            slot, nslot, pslot = (lax.rem(i + d, i32(D)) for d in (0, 1, D - 1))
            par, npar = lax.rem(i, i32(2)), lax.rem(i + 1, i32(2))
            has_next = i + 1 < n
            pl.when(has_next)(lambda: wait(nslot))  # the next chunk's tiles (this chunk's: the step before)
            if call.packed:
                seq, first, last = slot_flags(g_s, slot)
                S = lax.cond(first, lambda: load_state(seq), lambda: S)
            if save_states:  # s_s and vn_s may still feed the previous chunk's h / Vn stores
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            s_s[...] = S.astype(BF16)
            g_end = g_s[slot, 2, 0]
            e_o = load_tile(g_s.at[slot, 0], row, interp)
            u = load_tile(r["u_s"].at[slot], plgpu.Layout.WGMMA, interp).astype(F32)
            pl.when(has_next)(lambda: form_kt(nslot, npar))  # kt_s[npar]: read last by the step before's group
            plgpu.commit_smem()  # also orders this step's thread reads of its slots before their refills
            if save_states:
                plgpu.copy_smem_to_gmem(s_s, r["h_ref"].at[bh, i, :, vsl])
            # one group: the chain, this chunk's W S and Q S, the previous chunk's Aqk Vn (vn_s) and the
            # next chunk's M (on the last step a discarded product of stale tiles)
            S_new, ws, qs, o_prev, m_next = mmas([
                (S * g_end, (Transposed(kt_s.at[par]), m_s.at[par]), (r["u_s"].at[slot], s_s)),
                (zeros((C, bv)), r["w_s"].at[slot], s_s),
                (zeros((C, bv)), r["q_s"].at[slot], s_s),
                (o0_prev, r["a_s"].at[pslot], vn_s),
                (zeros((K, K)), Transposed(kt_s.at[npar]), r["w_s"].at[nslot])], interp)
            # the group has read the previous chunk's slot: the chunk after next lands there
            pl.when(i + 2 < n)(lambda: fetch(i + 2, lax.rem(i + 2, i32(D))))
            pl.when(i > 0)(lambda: store_o(o_prev, i - 1))
            vn = u - ws
            vn_s[...] = vn.astype(BF16)

            def store_m():
                m_s[npar] = (-m_next).astype(BF16)  # m_s[npar]: read last by the step before's group

            pl.when(has_next)(store_m)
            plgpu.commit_smem()
            if save_states:
                plgpu.copy_smem_to_gmem(vn_s, r["vno_ref"].at[bh, pl.ds(i * C, C), vsl])
            if call.packed:
                pl.when(last)(lambda: store_state(S_new, seq))
            return S_new, qs * bcast(e_o, qs.shape)

        S, o0 = lax.fori_loop(i32(0), i32(n), step, (S0, zeros((C, bv))))
        (o,) = mmas([(o0, r["a_s"].at[lax.rem(zero + i32(n - 1), i32(D))], vn_s)], interp)
        store_o(o, n - 1)
        if not call.packed:
            store_state(S, 0)
        plgpu.wait_smem_to_gmem(0)

    kw = kernel_kw(call, "state")
    out_type = (jax.ShapeDtypeStruct((B, Tp, H, V), in_dt), jax.ShapeDtypeStruct(h0.shape, F32))
    if save_states:
        out_type += (jax.ShapeDtypeStruct((BH, n, K, V), BF16), jax.ShapeDtypeStruct((BH, Tp, V), BF16))
    fn = varying_kernel(plgpu.kernel, body, out_type=out_type, scratch_types=list(scratch.values()), grid=(BH, V // bv),
                        grid_names=("bh", "vb"), **kw)
    out = fn(q, k, w.astype(BF16), u.astype(BF16), aqk.astype(BF16), gates, h0)
    return dict(zip(("o", "final", "h", "vn"), out))
