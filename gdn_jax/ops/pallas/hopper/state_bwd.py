"""The Hopper (sm_90, Mosaic GPU) reverse state pass of the backward: the twin of
:func:`gdn_jax.ops.pallas.state_bwd.reverse_states`. With S = h_n the state entering chunk n and
dS = dh_n the gradient of the state leaving it (notation of :mod:`gdn_jax.ops.pallas.grads`):

* :func:`reverse_states` (one CTA per head and ``bv`` value channels, dS [K, bv] float32 in
  registers, the chunks walked backwards with the previous chunk's tiles arriving by TMA)::

      dh_n = dS;   dVn = dVl + e^{gamma_C - gamma} * (K dS)
      dS  <- e^{gamma_C} dS + Q^T (e^gamma scale * dO) - W^T dVn

  and d e^{gamma_C} = sum(h_n * dS) (float32 dS), d initial_state.

Interpret mode: see :mod:`.common`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..._vma import varying_kernel
from ..call import KernelCall
from .common import (BF16, F32, Transposed, chunk_last_row, i32, kernel_kw, load_tile, mmas, plgpu_api, slot_flags, smem, tile_in, tile_out, wait_slot_copies, zero_acc)
from .plan import reverse_block, reverse_single_tiles


def reverse_states(call: KernelCall, q, k, w, dvl, do, e_gam, e_gam_end, e_gam_last, dfinal, h, flags, aqk=None):
    """The reverse state pass on Hopper (the twin of :func:`gdn_jax.ops.pallas.state_bwd.reverse_states`
    plus d e^{gamma_C}): grid (B*H, V / bv), dS [K, bv] float32 in registers, the chunks from the
    last, the previous chunk's q, k, W, dVl, dO and gates arriving by TMA while this one runs (h_n,
    which only feeds d e^{gamma_C}, in one buffer loaded at the start of its step). With
    ``HopperTuning.reverse_producer`` at K <= 128 a second, producer warpgroup issues the slots'
    copies and the consumer releases each slot after its step's last wgmma (h_n is still copied by
    the consumer). At K > 128
    (:func:`reverse_single_tiles`) q, k and W have one tile each, refilled as soon as this chunk's
    wgmmas have read them.
    With ``cu_seqlens`` dS restarts from ``dfinal[seq]`` at a sequence's last chunk and
    ``dh0[seq]`` is written after its first.

    With ``aqk`` (the forward's [BH, n, C, C] bf16 Aqk, ``HopperTuning.save_states`` with
    ``save_wy``) and ``dvl=None`` the kernel forms dVl = Aqk^T dO itself (one more wgmma per chunk,
    off the dS chain, issued with K dS): no dVl round trip through HBM and no WY stage in the
    backward.

    Returns ``dh`` [BH, n, K, V], ``dvn`` [BH, T, V] (bf16), ``dh0`` (``dfinal``'s shape, f32) and
    ``de_gam_last`` [BH, n, 1, 1] f32 (sum(h_n * dS) over the value blocks)."""
    if (aqk is None) == (dvl is None):
        raise ValueError("reverse_states: pass exactly one of dvl and aqk")
    own_dvl = aqk is not None
    one = reverse_single_tiles(call)
    prod = call.rev_prod and not one  # HopperTuning.reverse_producer (K <= 128)
    plgpu = plgpu_api()
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
        b, hh = lax.div(bh, i32(H)), lax.rem(bh, i32(H))
        hk = lax.div(hh, i32(G)) if G > 1 else hh
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
            dS0 = zero_acc((K, bv), interp) if call.packed else load_state(0)

            def step(jj, dS):
                i = n - 1 - jj
                slot = lax.rem(jj, i32(2))
                # h_n only feeds d e^{gamma_C} (off the dS chain): one buffer, waited for when needed
                plgpu.copy_gmem_to_smem(h_ref.at[bh, i, :, vsl], hs_s, h_bar)

                if not prod:
                    pl.when(i > 0)(lambda: fetch(i - 1, 1 - slot))

                wait_slot_copies(bars, slot)
                if one:
                    plgpu.barrier_wait(single_bars[1])  # k (q and W are waited for before the last wgmma)
                if call.packed:
                    seq, first, last = slot_flags(g_s, slot)
                    dS = lax.cond(last, lambda: load_state(seq), lambda: dS)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # ds_s, dvn_s, dd_s may feed last chunk's stores
                ds_s[...] = dS.astype(BF16)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(ds_s, dh_ref.at[bh, i, :, vsl])
                if own_dvl:  # dVl = Aqk^T dO with K dS (dvl_s holds this chunk's Aqk)
                    kd, dvl = mmas([((C, bv), tile(k_s, slot), ds_s), ((C, bv), Transposed(dvl_s.at[slot]), do_s.at[slot])],
                                    interp)
                else:
                    (kd,) = mmas([((C, bv), tile(k_s, slot), ds_s)], interp)
                    dvl = load_tile(dvl_s.at[slot], WG, interp).astype(F32)
                if one:  # K dS has read k: the previous chunk's lands during the rest of this step
                    pl.when(i > 0)(lambda: fetch_single(i - 1, (1,)))
                row = WG.reduce(1)
                e_end = load_tile(g_s.at[slot, 1], row, interp)
                e_o = load_tile(g_s.at[slot, 0], row, interp)
                # the slot's last gate read before the commit below (see hopper.state_fwd.forward_states_and_output)
                g_end = g_s[slot, 2, 0]
                dvn = dvl + kd * lax.broadcast_in_dim(e_end, kd.shape, [0])
                dvn_s[...] = dvn.astype(BF16)
                ndvn_s[...] = (-dvn).astype(BF16)
                dos_s[...] = (load_tile(do_s.at[slot], WG, interp).astype(F32)
                              * lax.broadcast_in_dim(e_o, kd.shape, [0])).astype(BF16)
                plgpu.barrier_wait(h_bar)
                dd_s[...] = jnp.sum(load_tile(hs_s, WG, interp).astype(F32) * dS, axis=1)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(dvn_s, dvn_ref.at[bh, pl.ds(i * C, C), vsl])
                plgpu.copy_smem_to_gmem(dd_s, dd_ref.at[bh, vb, i])
                if one:
                    plgpu.barrier_wait(single_bars[0])
                    plgpu.barrier_wait(single_bars[2])
                (dS,) = mmas([(dS * g_end, (Transposed(tile(q_s, slot)), Transposed(tile(w_s, slot))), (dos_s, ndvn_s))],
                              interp)
                if prod:  # the slot's last read: the producer may refill it
                    plgpu.barrier_arrive(free.at[slot])
                if one:  # the last wgmma has read q and W: the previous chunk's land during its next step
                    pl.when(i > 0)(lambda: fetch_single(i - 1, (0, 2)))
                if call.packed:
                    pl.when(first)(lambda: store_state(dS, seq))
                return dS

            dS = lax.fori_loop(i32(0), i32(n), step, dS0)
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
                pl.when(jj >= 2)(lambda: plgpu.barrier_wait(free.at[lax.rem(jj, i32(2))]))
                fetch(n - 1 - jj, lax.rem(jj, i32(2)))
                return carry

            lax.fori_loop(i32(0), i32(n), issue, None)
            # every release of every slot observed (Mosaic GPU's interpreter checks it)
            lax.fori_loop(i32(max(n - 2, 0)), i32(n),
                          lambda jj, c: (plgpu.barrier_wait(free.at[lax.rem(jj, i32(2))]), c)[1], None)

        pl.when(wg == 0)(consume)

    sw = min(128, 2 * bv)
    lead = () if one else (2,)  # the K-wide tiles' leading slot axis (none: single tiles)
    scratch = [smem(lead + (C, K), in_dt, sw), smem(lead + (C, K), in_dt, sw), smem(lead + (C, K), BF16, sw),
               smem((2, C, C if own_dvl else bv), BF16, sw), smem((2, C, bv), in_dt, sw),
               plgpu.SMEM((2, 3, C), F32),
               smem((K, bv), BF16, sw), smem((K, bv), BF16, sw), smem((C, bv), BF16, sw),
               smem((C, bv), BF16, sw), smem((C, bv), BF16, sw), smem((K, bv), F32), plgpu.SMEM((K,), F32),
               [plgpu.Barrier(num_barriers=2) for _ in range(3 if one else 6)], plgpu.Barrier(num_barriers=1),
               plgpu.Barrier(num_barriers=1)]
    if one:
        scratch += [plgpu.Barrier(num_barriers=1) for _ in range(3)]  # q, k, W
    if prod:  # a slot is free again once the consumer has read it
        scratch += [plgpu.Barrier(num_arrivals=1, num_barriers=2)]
    out_type = (jax.ShapeDtypeStruct((BH, n, K, V), BF16), jax.ShapeDtypeStruct((BH, Tp, V), BF16),
                jax.ShapeDtypeStruct(dfinal.shape, F32), jax.ShapeDtypeStruct((BH, nvb, n, K), F32))
    kw = kernel_kw(call, "reverse")  # HopperTuning.auto_barriers (see hopper.common.sync_own_barriers)
    if prod:
        kw.update(num_threads=2, thread_name="wg")
    fn = varying_kernel(plgpu.kernel, body, out_type=out_type, scratch_types=scratch, grid=(BH, nvb), grid_names=("bh", "vb"), **kw)
    dh, dvn, dh0, dd = fn(q, k, w.astype(BF16), (aqk if own_dvl else dvl).astype(BF16), do, gates,
                          dfinal.astype(F32), h.astype(BF16))
    return dict(dh=dh, dvn=dvn, dh0=dh0, de_gam_last=dd.sum((1, 3)).reshape(BH, n, 1, 1))
