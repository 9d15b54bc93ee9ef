"""The Hopper (sm_90, Mosaic GPU) forward state pass, fused with the output, and its recompute mode
for the backward (:func:`recompute_states`).

:func:`forward_states_and_output`: the twin of
:func:`gdn_jax.ops.pallas.state_fwd.forward_states_and_output`. One CTA (one compute warpgroup) per
(batch x value head, block of ``bv`` value channels; ``state_warpgroups`` blocks with the producer)
walks the chunks with the state S [K, bv] in registers (float32, the wgmma accumulator layout); per chunk n, with S entering it::
    Vn  = U - W S                              wgmma (W: SMEM, S: bf16 copy in SMEM)
    O   = e^gamma * scale * (Q S) + Aqk Vn     wgmma x 2, the row scaling on the accumulator
    S  <- e^{gamma_C} S + K^T (e^{gamma_C - gamma} * Vn)     wgmma with K transposed in SMEM

The next chunk's q, k, W, U, Aqk and gates are copied by TMA into the other of two SMEM slots
(``state_slots`` with the producer below) while this one computes; o leaves through SMEM by TMA. Only ``U - W S`` and the K^T update sit
on the S -> S' chain; Q S is issued beside W S. With ``HopperTuning.state_producer`` (the default
on a GPU, K <= 128: :func:`producer`) a second, producer warpgroup issues those copies into
``state_slots`` slots and the compute warpgroup(s) release each slot after their step's last
wgmma, so the copies' issue and waits leave the chain.

Interpret mode: see :mod:`.common`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..._vma import varying_kernel
from ..call import KernelCall
from .common import (BF16, F32, Transposed, chunk_last_row, i32, kernel_kw, load_tile, mmas, plgpu_api, slot_flags, smem, tile_in, tile_out)
from .plan import producer, single_q


def forward_states_and_output(call: KernelCall, w, u, k, e_gam_end, e_gam_last, h0, flags, q=None, e_gam=None,
                              aqk=None, save_states: bool = False, v=None, t=None, beta=None, final_only: bool = False):
    """The fused forward state pass on Hopper; arguments and result as
    :func:`gdn_jax.ops.pallas.state_fwd.forward_states_and_output`. With ``cu_seqlens``
    (``call.packed``) the per-chunk ``flags`` ride in the gates row of each chunk: at a sequence's
    first chunk S restarts from ``h0[seq]`` (TMA), after its last S is written to ``final[seq]``.

    Without ``q`` (the backward's recompute, :func:`gdn_jax.ops.pallas.hopper.state_fwd.recompute_states`)
    no output is formed: the state entering each chunk ``h`` [BH, n, K, V] and ``vn`` [BH, T, V]
    (bf16) leave by TMA instead of ``o`` and the final state. With ``final_only`` (``q`` and ``aqk``
    None, ``e_gam`` read by the "t" form only: the final-state-only forward,
    :func:`forward_final_state`) no output either
    and only the final state leaves (with ``save_states`` also ``h`` and ``vn``): per chunk only
    W S (or K S), Vn and the state update, no Q S, no Aqk Vn, no o tile. With ``q`` and ``save_states``
    (``HopperTuning.save_states``) they leave as well as ``o`` and the final state, the same
    values the recompute writes (the result has all four).

    With :func:`producer` (``HopperTuning.state_producer``) the CTA has ``state_warpgroups`` compute
    warpgroups (each its own value block: grid (B*H, V / (bv * state_warpgroups))) and a producer
    warpgroup that copies every chunk's tiles into ``state_slots`` slots, refilling a slot once each
    compute warpgroup has arrived on its "free" barrier after the step's last wgmma.

    With ``t`` = (t_hi, t_lo) [BH, n, C, C] bf16 (``HopperTuning.fwd_form="t"``; ``w`` and ``u``
    are None, ``v`` the values in the token layout, ``beta`` the beta column [BH, T, 1]) Vn is
    formed from T instead of W, U: ``Vn = T (beta V - beta e^gamma (K S))`` (K S issued beside
    Q S, the product with T as bf16x2)."""
    plgpu = plgpu_api()
    interp = call.platform == "interpret"
    C, K, V, BH, H, G, n, Tp = call.C, call.K, call.V, call.BH, call.H, call.group, call.n, call.Tp
    B = BH // H
    bv = call.bv_mosaic
    in_dt = jnp.dtype(call.in_dt)
    # per-chunk scalars, one TMA row each: e^gamma * scale, e^{gamma_C - gamma}, last_row and, for
    # fwd_form "t", beta and beta e^gamma
    last_row = chunk_last_row(call, e_gam_last, flags)
    if final_only and q is not None:
        raise ValueError("forward_states_and_output(final_only=True) takes no q (it forms no output)")
    noq = q is None  # no output: the recompute (rec) or the final-state-only forward
    rec = noq and not final_only
    tf = t is not None
    keep = rec or save_states  # h and Vn leave by TMA
    e_o = jnp.zeros((BH, n, C), F32) if noq else e_gam.reshape(BH, n, C) * call.scale
    rows_ = [e_o, e_gam_end.reshape(BH, n, C), last_row]
    if tf:
        rows_ += [beta.reshape(BH, n, C), (beta * e_gam).reshape(BH, n, C)]
    gates = jnp.stack(rows_, axis=2).astype(F32)

    sw = min(128, 2 * bv)  # every wgmma pairs a [., K] or [., C] tile with a [., bv] one: one swizzle
    # HopperTuning.state_producer: a producer warpgroup fills D slots; nc compute warpgroups (value
    # blocks) share each chunk's tiles but U's, and have their own state tiles
    wspec = producer(call)
    D, nc = (call.state_slots, call.state_wgs) if wspec else (2, 1)
    per_wg = lambda shape: (nc,) + tuple(shape) if wspec else tuple(shape)
    # per-chunk tiles (D TMA slots each; U's D * nc), in fetch order
    one_q = not noq and single_q(call)  # one q tile, refilled once Q S has read it
    one_w = not tf and single_q(call)  # "wu": one W tile, refilled once W S has read it
    slots = {} if (noq or one_q) else dict(q_s=smem((D, C, K), in_dt, sw))
    slots["k_s"] = smem((D, C, K), in_dt, sw)
    if tf:
        slots.update(th_s=smem((D, C, C), BF16, sw), tl_s=smem((D, C, C), BF16, sw),
                     u_s=smem((D * nc, C, bv), in_dt, sw))  # v's value block
    else:
        slots.update({} if one_w else dict(w_s=smem((D, C, K), BF16, sw)))
        slots.update(u_s=smem((D * nc, C, bv), BF16, sw))
    if not noq:
        slots["a_s"] = smem((D, C, C), BF16, sw)
    slots["g_s"] = plgpu.SMEM((D, len(rows_), C), F32)
    scratch = dict(slots, s_s=smem(per_wg((K, bv)), BF16, sw))
    if keep or not noq:  # Vn's tile: the h / Vn stores or the Aqk Vn product read it
        scratch["vn_s"] = smem(per_wg((C, bv)), BF16, sw)
    scratch["vs_s"] = smem(per_wg((C, bv)), BF16, sw)
    if not noq:
        scratch["o_s"] = smem(per_wg((C, bv)), in_dt, sw)
    scratch.update(f_s=smem(per_wg((K, bv)), F32),
                   bars=[plgpu.Barrier(num_barriers=D * (nc if name == "u_s" else 1)) for name in slots],
                   h0_bar=plgpu.Barrier(num_barriers=nc))
    if wspec:  # a slot is free again once every compute warpgroup has arrived
        scratch["free"] = plgpu.Barrier(num_arrivals=nc, num_barriers=D)
    if one_q:
        scratch.update(q_s=smem((C, K), in_dt, sw), q_bar=plgpu.Barrier(num_barriers=1))
    if one_w:
        scratch.update(w_s=smem((C, K), BF16, sw), w_bar=plgpu.Barrier(num_barriers=1))
    in_names = ([] if noq else ["q_ref"]) + ["k_ref"] + (["th_ref", "tl_ref", "v_ref"] if tf else ["w_ref", "u_ref"])
    in_names += ([] if noq else ["a_ref"]) + ["g_ref", "h0_ref"]
    if rec:
        out_names = ["h_ref", "vno_ref"]
    else:
        out_names = ([] if noq else ["o_ref"]) + ["fin_ref"] + (["h_ref", "vno_ref"] if save_states else [])

    def body(*refs):
        r = dict(zip(in_names + out_names + list(scratch), refs))
        bh = lax.axis_index("bh")
        b, h = lax.div(bh, i32(H)), lax.rem(bh, i32(H))
        hk = lax.div(h, i32(G)) if G > 1 else h
        vsl_of = lambda w: pl.ds((lax.axis_index("vb") * nc + w) * bv, bv)

        def fetch(i, slot, wgs=(0,)):
            """Chunk i's tiles into ``slot`` (U's value block of each compute warpgroup in ``wgs``)."""
            rows = pl.ds(i * C, C)
            src = dict(q_s=lambda: r["q_ref"].at[b, rows, hk], k_s=lambda: r["k_ref"].at[b, rows, hk],
                       w_s=lambda: r["w_ref"].at[bh, rows], th_s=lambda: r["th_ref"].at[bh, i],
                       tl_s=lambda: r["tl_ref"].at[bh, i],
                       a_s=lambda: r["a_ref"].at[bh, i], g_s=lambda: r["g_ref"].at[bh, i])
            for name, bar in zip(slots, r["bars"]):
                if name != "u_s":
                    plgpu.copy_gmem_to_smem(src[name](), r[name].at[slot], bar.at[slot])
                    continue
                for w in wgs:
                    vsl = vsl_of(w)
                    u_src = r["v_ref"].at[b, rows, h, vsl] if tf else r["u_ref"].at[bh, rows, vsl]
                    plgpu.copy_gmem_to_smem(u_src, r["u_s"].at[slot * nc + w], bar.at[slot * nc + w])

        if not wspec:
            compute(r, fetch, 0)
            return
        wg = lax.axis_index("wg")

        @pl.when(wg == nc)
        def _producer():
            if not interp and nc > 1:  # three warpgroups: the consumers need ~200 registers each
                plgpu.set_max_registers(40, action="decrease")

            def issue(i, _):
                slot = lax.rem(i, i32(D))
                pl.when(i >= D)(lambda: plgpu.barrier_wait(r["free"].at[slot]))
                fetch(i, slot, range(nc))
                return _

            lax.fori_loop(i32(0), i32(n), issue, None)
            # every release of every slot observed (Mosaic GPU's interpreter checks it)
            lax.fori_loop(i32(max(n - D, 0)), i32(n),
                          lambda i, _: (plgpu.barrier_wait(r["free"].at[lax.rem(i, i32(D))]), _)[1], None)

        @pl.when(wg < nc)
        def _consumers():
            if not interp and nc > 1:
                plgpu.set_max_registers(232, action="increase")
            compute(r, None, wg)

    def compute(r, fetch, w):
        """One compute warpgroup's walk over the chunks (``fetch``: this warpgroup issues the next
        chunk's copies itself; None: the producer warpgroup does, ``w`` names this warpgroup)."""
        pick = (lambda x: x.at[w]) if wspec else (lambda x: x)
        q_s, k_s, w_s, a_s, g_s, th_s, tl_s = (r.get(x) for x in ("q_s", "k_s", "w_s", "a_s", "g_s", "th_s", "tl_s"))
        u_s = r["u_s"]
        s_s, vs_s, f_s = (pick(r[x]) for x in ("s_s", "vs_s", "f_s"))
        vn_s = pick(r["vn_s"]) if "vn_s" in r else None
        o_s = None if noq else pick(r["o_s"])
        bars, h0_bar = r["bars"], r["h0_bar"].at[w]
        h0_ref, h_ref, vno_ref, o_ref, fin_ref = (r.get(x) for x in ("h0_ref", "h_ref", "vno_ref", "o_ref", "fin_ref"))
        bh = lax.axis_index("bh")
        vsl = pl.ds((lax.axis_index("vb") * nc + w) * bv, bv)
        b, h = lax.div(bh, i32(H)), lax.rem(bh, i32(H))
        hk = lax.div(h, i32(G)) if G > 1 else h

        def wait_slot(slot):  # every copy into ``slot`` (U's: this warpgroup's value block)
            for name, bar in zip(slots, bars):
                plgpu.barrier_wait(bar.at[slot * nc + w if name == "u_s" else slot])

        def fetch_q(i):  # single_q: the one q tile
            plgpu.copy_gmem_to_smem(r["q_ref"].at[b, pl.ds(i * C, C), hk], q_s, r["q_bar"])

        def fetch_w(i):  # single_q, "wu": the one W tile
            plgpu.copy_gmem_to_smem(r["w_ref"].at[bh, pl.ds(i * C, C)], w_s, r["w_bar"])

        load_state = lambda seq: tile_in(h0_ref.at[bh, seq, :, vsl], f_s, h0_bar, interp)
        store_state = lambda S, seq: tile_out(S, f_s, fin_ref.at[bh, seq, :, vsl])

        if fetch is not None:
            fetch(0, 0)
        if one_q:
            fetch_q(0)
        if one_w:
            fetch_w(0)
        if call.packed:  # every sequence starts at a chunk flagged "first": S0 is never read
            S0 = jnp.zeros((K, bv), F32) if interp else plgpu.layout_cast(jnp.zeros((K, bv), F32),
                                                                           plgpu.Layout.WGMMA)
        else:
            S0 = load_state(0)
        row = plgpu.Layout.WGMMA.reduce(1)
        bcast = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])

        late = call.late_o and not noq  # HopperTuning.late_o_store: chunk i-1's o leaves during step i's wgmmas

        def store_o(o, j):  # o of chunk j through o_s by TMA
            tile_out(o, o_s, o_ref.at[b, pl.ds(j * C, C), h, vsl])

        def step(i, carry):
            S, o_prev = carry if late else (carry, None)
            slot = lax.rem(i, i32(D))
            if fetch is not None:
                pl.when(i + 1 < n)(lambda: fetch(i + 1, 1 - slot))
            wait_slot(slot)
            if one_q:
                plgpu.barrier_wait(r["q_bar"])
            if one_w:
                plgpu.barrier_wait(r["w_bar"])
            if call.packed:
                seq, first, last = slot_flags(g_s, slot)
                S = lax.cond(first, lambda: load_state(seq), lambda: S)
            if keep:  # s_s and vn_s may still feed the previous chunk's h / Vn stores
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            s_s[...] = S.astype(BF16)
            plgpu.commit_smem()
            if keep:
                plgpu.copy_smem_to_gmem(s_s, h_ref.at[bh, i, :, vsl])
            # W S (or K S for fwd_form "t") and Q S, issued together
            x_s = k_s.at[slot] if tf else (w_s if one_w else w_s.at[slot])
            if noq:
                (ws,) = mmas([((C, bv), x_s, s_s)], interp)
            else:
                prev = (lambda: pl.when(i > 0)(lambda: store_o(o_prev, i - 1))) if late else None
                ws, qs = mmas([((C, bv), x_s, s_s), ((C, bv), q_s if one_q else q_s.at[slot], s_s)],
                               interp, between=prev)
                if one_q:  # Q S has completed: the next chunk's q lands during the rest of this step
                    pl.when(i + 1 < n)(lambda: fetch_q(i + 1))
            if one_w:  # W S has completed: likewise the next chunk's W
                pl.when(i + 1 < n)(lambda: fetch_w(i + 1))
            if tf:  # Vn = T (beta V - beta e^gamma (K S)); the scaled residual goes through vs_s
                x = (load_tile(u_s.at[slot * nc + w], plgpu.Layout.WGMMA, interp).astype(F32)
                     * bcast(load_tile(g_s.at[slot, 3], row, interp), (C, bv))
                     - ws * bcast(load_tile(g_s.at[slot, 4], row, interp), (C, bv)))
                vs_s[...] = x.astype(BF16)
                plgpu.commit_smem()
                (vn,) = mmas([((C, bv), (th_s.at[slot], tl_s.at[slot]), (vs_s, vs_s))], interp)
            else:
                vn = load_tile(u_s.at[slot * nc + w], plgpu.Layout.WGMMA, interp).astype(F32) - ws
            e_end = load_tile(g_s.at[slot, 1], row, interp)
            # this slot's last gate reads come before the commit below: the one-warpgroup pass refills
            # the slot at its next step, and without the automatic barriers (HopperTuning.auto_barriers,
            # the default for this pass) nothing else orders those reads before that TMA copy
            g_end = g_s[slot, 2, 0]
            e_o = None if noq else load_tile(g_s.at[slot, 0], row, interp)
            if vn_s is not None:
                vn_s[...] = vn.astype(BF16)
            vs_s[...] = (vn * bcast(e_end, vn.shape)).astype(BF16)
            plgpu.commit_smem()
            if keep:
                plgpu.copy_smem_to_gmem(vn_s, vno_ref.at[bh, pl.ds(i * C, C), vsl])
            release = (lambda: plgpu.barrier_arrive(r["free"].at[slot])) if wspec else (lambda: None)
            if noq:
                (S,) = mmas([(S * g_end, Transposed(k_s.at[slot]), vs_s)], interp)
                release()  # the slot's last read
                if call.packed and final_only:
                    pl.when(last)(lambda: store_state(S, seq))
                return S
            o0 = qs * bcast(e_o, qs.shape)
            o, S = mmas([(o0, a_s.at[slot], vn_s), (S * g_end, Transposed(k_s.at[slot]), vs_s)], interp)
            release()
            if not late:
                store_o(o, i)
            if call.packed:
                pl.when(last)(lambda: store_state(S, seq))
            return (S, o.astype(in_dt)) if late else S

        if late:
            o0 = jnp.zeros((C, bv), in_dt)
            o0 = o0 if interp else plgpu.layout_cast(o0, plgpu.Layout.WGMMA)
            S, o_last = lax.fori_loop(i32(0), i32(n), step, (S0, o0))
            store_o(o_last, n - 1)
        else:
            S = lax.fori_loop(i32(0), i32(n), step, S0)
        if not call.packed and not rec:
            store_state(S, 0)
        plgpu.wait_smem_to_gmem(0)

    kw = kernel_kw(call, "state")  # HopperTuning.auto_barriers (see sync_own_barriers)
    states = (jax.ShapeDtypeStruct((BH, n, K, V), BF16), jax.ShapeDtypeStruct((BH, Tp, V), BF16))
    if rec:
        out_type = states
    else:
        out_type = () if noq else (jax.ShapeDtypeStruct((B, Tp, H, V), in_dt),)
        out_type += (jax.ShapeDtypeStruct(h0.shape, F32),) + (states if save_states else ())
    if wspec:
        kw.update(num_threads=nc + 1, thread_name="wg")
    fn = varying_kernel(plgpu.kernel, body, out_type=out_type, scratch_types=list(scratch.values()), grid=(BH, V // (bv * nc)),
                        grid_names=("bh", "vb"), **kw)
    args = ([] if noq else [q]) + [k] + ([t[0], t[1], v] if tf else [w.astype(BF16), u.astype(BF16)])
    args += ([] if noq else [aqk.astype(BF16)]) + [gates, h0]
    out = fn(*args)
    if rec:
        return dict(h=out[0], vn=out[1])
    if final_only:
        return dict(zip(("final", "h", "vn"), out))
    if save_states:
        return dict(o=out[0], final=out[1], h=out[2], vn=out[3])
    return dict(o=out[0], final=out[1])


def recompute_states(call: KernelCall, w, u, k, e_gam_end, e_gam_last, h0, flags):
    """The backward's forward recompute on Hopper: ``h`` [BH, n, K, V] (the state entering each
    chunk) and ``vn`` [BH, T, V], bf16 (:func:`forward_states_and_output` without q)."""
    return forward_states_and_output(call, w, u, k, e_gam_end, e_gam_last, h0, flags)


def forward_final_state(call: KernelCall, w, u, k, e_gam_end, e_gam_last, h0, flags, save_states: bool = False,
                        v=None, t=None, beta=None, e_gam=None):
    """The final-state-only forward state pass on Hopper (the maps' pass of
    :func:`gdn_jax.ops.state_maps.state_map` and of the sequence split): :func:`forward_states_and_output`
    without q, Aqk and o, in either form ("wu": ``w``, ``u``; "t": ``v``, ``t``, ``beta``, ``e_gam``). Returns
    ``final`` [BH | H, nseq, K, V] float32 and, with ``save_states``, ``h`` and ``vn`` as the fused
    pass writes them (for the Hopper backward)."""
    return forward_states_and_output(call, w, u, k, e_gam_end, e_gam_last, h0, flags, e_gam=e_gam,
                                     save_states=save_states, v=v, t=t, beta=beta, final_only=True)
