"""The forward state pass in its "transition" form on Hopper (``KernelConfig.fwd_form="transition"``,
opt-in; built 2026-12-04 on CPU, NOT yet run on a GPU: results/hopper_h200/NOTE.md item 28).

Today's pass (:func:`.hopper.forward_states_and_output`, "wu") has two dependent wgmma rounds per chunk
on its S chain, and its output work needs the chain's Vn. With the chunk's transition matrix
(gamma the in-chunk cumulative log decay, K~ = diag(e^{gamma_C - gamma}) K, W and U of the WY
representation)::

    M_i     = -K~_i^T W_i                                  (K x K, independent of S: formed before the pass)
    S_{i+1} = e^{gamma_C} S_i + K~_i^T U_i + M_i bf16(S_i)  one wgmma group on the chain
    Vn_i    = U_i - W_i bf16(S_i),  o_i = e^{gamma} scale Q_i bf16(S_i) + Aqk_i Vn_i

so nothing on the chain waits for Vn. Each chunk step issues one group of wgmmas -- the chain's
(K~^T U and M S into the float32 state, the decay an elementwise product), W S and Q S for this chunk
and the previous chunk's Aqk Vn -- and waits once; Vn is formed after the wait and feeds the next
step's group (the previous chunk's output leaves one step late). Three TMA slots: the chunk before
(its Aqk), this one and the next. M and K~ are formed in XLA here (bf16, float32 accumulation); the
numerics of the form: ``benchmarks/study_transition_form.py`` (as accurate as "wu").

Covers what the "wu" pass covers at K <= 128 without the producer warpgroup: per-head g and beta,
initial / final state, ``cu_seqlens``, GVA, ``save_states`` (h and Vn for the backward).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .config import KernelCall
from .hopper import (BF16, F32, SMEM_BYTES, _T, _i32, _kernel_kw, _load, _mmas, _plgpu, _slot_flags, _smem,
                     chunk_last_row)

SLOTS = 3


def smem_bytes(call: KernelCall, bv: int) -> int:
    """Shared memory of :func:`forward_states_transition` at value block ``bv``: three slots of q,
    K~, W, M, U's value block, Aqk and the gates; the S, Vn, o and h0 / final tiles."""
    C, K = call.C, call.K
    isz = jnp.dtype(call.in_dt).itemsize
    slot = C * K * isz + 2 * C * K * 2 + K * K * 2 + C * bv * 2 + C * C * 2 + 3 * C * 4
    return SLOTS * slot + K * bv * 2 + C * bv * 2 + C * bv * isz + K * bv * 4


def covers(call: KernelCall) -> str | None:
    """None when the transition pass takes ``call`` (after :func:`.hopper.covers`), else why not."""
    if call.K > 128:
        return f"K={call.K} (the transition form needs K <= 128: M is K x K per chunk)"
    if smem_bytes(call, call.bv_mosaic) > SMEM_BYTES:
        return (f"shared memory: the transition pass at value block {call.bv_mosaic} needs "
                f"{smem_bytes(call, call.bv_mosaic) // 1024} KB of {SMEM_BYTES // 1024} KB")
    return None


def transition_inputs(call: KernelCall, k, w, e_gam_end):
    """K~ = bf16(e^{gamma_C - gamma} k) [BH, T, K] and M = -K~^T W per chunk [BH, n, K, K] (bf16, float32
    accumulation), from k in the token layout [B, T, Hk, K], W [BH, T, K] and e^{gamma_C - gamma}
    [BH, T, 1]."""
    BH, H, G, n, C, K = call.BH, call.H, call.group, call.n, call.C, call.K
    B = BH // H
    kk = k[:, :call.Tp]
    if G > 1:  # each value head's key head
        kk = jnp.repeat(kk, G, axis=2)
    kk = jnp.moveaxis(kk, 2, 1).reshape(BH, call.Tp, K)
    kt = (kk.astype(F32) * e_gam_end).astype(BF16)
    m = -jnp.einsum("bncK,bncL->bnKL", kt.reshape(BH, n, C, K), w.astype(BF16).reshape(BH, n, C, K),
                    preferred_element_type=F32)
    return kt, m.astype(BF16)


def forward_states_transition(call: KernelCall, w, u, kt, m, e_gam_end, e_gam_last, h0, flags, q, e_gam, aqk,
                              save_states: bool = False):
    """The forward state pass fused with the output, transition form (see the module docstring).
    ``w`` [BH, T, K], ``u`` [BH, T, V], ``kt`` = K~ [BH, T, K], ``m`` [BH, n, K, K] (bf16), ``q`` in the
    token layout, ``aqk`` [BH, n, C, C]; the rest as :func:`.hopper.forward_states_and_output`.
    Returns ``o`` [B, T, H, V] and ``final`` [nseq, H, K, V] (float32; G value heads per key head as
    there), with ``save_states`` also ``h`` [BH, n, K, V] and ``vn`` [BH, T, V] (bf16)."""
    plgpu = _plgpu()
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
    slots = dict(q_s=_smem((D, C, K), in_dt, sw), kt_s=_smem((D, C, K), BF16, sw), w_s=_smem((D, C, K), BF16, sw),
                 m_s=_smem((D, K, K), BF16, sw), u_s=_smem((D, C, bv), BF16, sw), a_s=_smem((D, C, C), BF16, sw),
                 g_s=plgpu.SMEM((D, 3, C), F32))
    scratch = dict(slots, s_s=_smem((K, bv), BF16, sw), vn_s=_smem((C, bv), BF16, sw), o_s=_smem((C, bv), in_dt, sw),
                   f_s=_smem((K, bv), F32), bars=[plgpu.Barrier(num_barriers=D) for _ in slots],
                   h0_bar=plgpu.Barrier(num_barriers=1))
    in_names = ["q_ref", "kt_ref", "w_ref", "m_ref", "u_ref", "a_ref", "g_ref", "h0_ref"]
    out_names = ["o_ref", "fin_ref"] + (["h_ref", "vno_ref"] if save_states else [])

    def body(*refs):
        r = dict(zip(in_names + out_names + list(scratch), refs))
        bh = lax.axis_index("bh")
        b, h = lax.div(bh, _i32(H)), lax.rem(bh, _i32(H))
        hk = lax.div(h, _i32(G)) if G > 1 else h
        vsl = pl.ds(lax.axis_index("vb") * bv, bv)
        s_s, vn_s, o_s, f_s, g_s = r["s_s"], r["vn_s"], r["o_s"], r["f_s"], r["g_s"]
        bars = r["bars"]

        def fetch(i, slot):
            rows = pl.ds(i * C, C)
            src = dict(q_s=r["q_ref"].at[b, rows, hk], kt_s=r["kt_ref"].at[bh, rows], w_s=r["w_ref"].at[bh, rows],
                       m_s=r["m_ref"].at[bh, i], u_s=r["u_ref"].at[bh, rows, vsl], a_s=r["a_ref"].at[bh, i],
                       g_s=r["g_ref"].at[bh, i])
            for name, bar in zip(slots, bars):
                plgpu.copy_gmem_to_smem(src[name], r[name].at[slot], bar.at[slot])

        def load_state(seq):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # f_s may still feed a final-state store
            plgpu.copy_gmem_to_smem(r["h0_ref"].at[bh, seq, :, vsl], f_s, r["h0_bar"].at[0])
            plgpu.barrier_wait(r["h0_bar"].at[0])
            return _load(f_s, plgpu.Layout.WGMMA, interp)

        def store_state(S, seq):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            f_s[...] = S
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(f_s, r["fin_ref"].at[bh, seq, :, vsl])

        def store_o(o, j):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_s[...] = o.astype(o_s.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, r["o_ref"].at[b, pl.ds(j * C, C), h, vsl])

        def zeros(shape):
            z = jnp.zeros(shape, F32)
            return z if interp else plgpu.layout_cast(z, plgpu.Layout.WGMMA)

        fetch(0, 0)
        if n > 1:
            fetch(1, 1)
        S0 = zeros((K, bv)) if call.packed else load_state(0)
        row = plgpu.Layout.WGMMA.reduce(1)
        bcast = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])

        def step(i, carry):
            S, o0_prev = carry  # o0_prev: the previous chunk's e^gamma scale Q S (its Aqk Vn still to add)
            slot, pslot = lax.rem(i, _i32(D)), lax.rem(i + D - 1, _i32(D))
            for bar in bars:
                plgpu.barrier_wait(bar.at[slot])
            if call.packed:
                seq, first, last = _slot_flags(g_s, slot)
                S = lax.cond(first, lambda: load_state(seq), lambda: S)
            if save_states:  # s_s and vn_s may still feed the previous chunk's h / Vn stores
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            s_s[...] = S.astype(BF16)
            g_end = g_s[slot, 2, 0]
            e_o = _load(g_s.at[slot, 0], row, interp)
            u = _load(r["u_s"].at[slot], plgpu.Layout.WGMMA, interp).astype(F32)
            plgpu.commit_smem()  # the thread reads of this slot come before the refill below
            if save_states:
                plgpu.copy_smem_to_gmem(s_s, r["h_ref"].at[bh, i, :, vsl])
            # one group: the chain, this chunk's W S and Q S, the previous chunk's Aqk Vn (vn_s)
            S_new, ws, qs, o_prev = _mmas([
                (S * g_end, (_T(r["kt_s"].at[slot]), r["m_s"].at[slot]), (r["u_s"].at[slot], s_s)),
                (zeros((C, bv)), r["w_s"].at[slot], s_s),
                (zeros((C, bv)), r["q_s"].at[slot], s_s),
                (o0_prev, r["a_s"].at[pslot], vn_s)], interp)
            # the group has read the previous chunk's slot: the chunk after next lands there
            pl.when(i + 2 < n)(lambda: fetch(i + 2, lax.rem(i + 2, _i32(D))))
            pl.when(i > 0)(lambda: store_o(o_prev, i - 1))
            vn = u - ws
            vn_s[...] = vn.astype(BF16)
            plgpu.commit_smem()
            if save_states:
                plgpu.copy_smem_to_gmem(vn_s, r["vno_ref"].at[bh, pl.ds(i * C, C), vsl])
            if call.packed:
                pl.when(last)(lambda: store_state(S_new, seq))
            return S_new, qs * bcast(e_o, qs.shape)

        S, o0 = lax.fori_loop(_i32(0), _i32(n), step, (S0, zeros((C, bv))))
        # the last chunk's slot as a traced index: JAX 0.11.2's Mosaic GPU lowering rejects a constant
        # ref index inside an initialised accumulator's run_state ("must be represented by ir.Values")
        last_slot = lax.rem(lax.axis_index("vb") * 0 + _i32(n - 1), _i32(D))
        (o,) = _mmas([(o0, r["a_s"].at[last_slot], vn_s)], interp)
        store_o(o, n - 1)
        if not call.packed:
            store_state(S, 0)
        plgpu.wait_smem_to_gmem(0)

    kw = _kernel_kw(call, "state")
    out_type = (jax.ShapeDtypeStruct((B, Tp, H, V), in_dt), jax.ShapeDtypeStruct(h0.shape, F32))
    if save_states:
        out_type += (jax.ShapeDtypeStruct((BH, n, K, V), BF16), jax.ShapeDtypeStruct((BH, Tp, V), BF16))
    fn = plgpu.kernel(body, out_type=out_type, scratch_types=list(scratch.values()), grid=(BH, V // bv),
                      grid_names=("bh", "vb"), **kw)
    out = fn(q, kt, w.astype(BF16), m, u.astype(BF16), aqk.astype(BF16), gates, h0)
    names = ("o", "final", "h", "vn")
    return dict(zip(names, out))
