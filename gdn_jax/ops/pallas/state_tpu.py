"""The state passes on TPU (platforms "tpu" / "tpu_interpret"), streamed chunk by chunk.

The GPU state passes (:mod:`.state_fwd`, :mod:`.state_bwd`) give each program a whole sequence of
one (batch x head, value block) and loop over its chunks in the kernel. On TPU a block lives in
VMEM (16 MiB scoped by default on v5e, 32 MiB on v6e), so these kernels instead run on the grid
(B*H, V/bv, chunks): the chunk axis is walked in order ("arbitrary" dimension semantics; the other
two "parallel"), the Pallas pipeline brings in one chunk's blocks at a time (double-buffered),
and the recurrent state S [K, bv] (reverse pass: dS) is carried between chunks in a float32 VMEM
scratch, initialised at chunk 0 and written out after the last. The reverse pass walks the chunks
backwards through its index maps (chunk n - 1 - i at step i). Nothing in VMEM grows with T or
with the number of packed sequences: without ``cu_seqlens`` the initial / final state is one
[K, bv] block per program; with it the states stay in HBM and a sequence's [K, bv] window is
copied by DMA into the scratch at its first chunk (reverse: its last) and out of it after its last
(reverse: its first), and the packed-sequence flags are read one chunk at a time from SMEM.

Per chunk the arithmetic is that of the GPU kernels (see :mod:`.state_fwd` and :mod:`.state_bwd`
for the equations).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import tiles as _t
from .config import KernelCall
from .layout import hm_spec, run, sds, token_shape, token_spec

F32 = _t.F32
SEMANTICS = ("parallel", "parallel", "arbitrary")  # (bh, value block, chunk)


def _specs(call: KernelCall, bv: int, reverse: bool):
    """BlockSpecs of one chunk on the grid (bh, value block j, step i); chunk c = i, or n - 1 - i
    when ``reverse``."""
    C, K, n = call.C, call.K, call.n
    ch = (lambda i: n - 1 - i) if reverse else (lambda i: i)
    return dict(
        tok_k=token_spec(call, C, K, lambda b, j, i: (b, ch(i), 0), key=True),
        tok_v=token_spec(call, C, bv, lambda b, j, i: (b, ch(i), j)),
        hm_k=hm_spec(C, K, lambda b, j, i: (b, ch(i), 0)),
        hm_v=hm_spec(C, bv, lambda b, j, i: (b, ch(i), j)),
        col=hm_spec(C, 1, lambda b, j, i: (b, ch(i), 0)),
        last=pl.BlockSpec((None, None, 1, 1), lambda b, j, i: (b, ch(i), 0, 0)),
        tile=pl.BlockSpec((None, None, C, C), lambda b, j, i: (b, ch(i), 0, 0)),
        # packed: the N states of a row stay in HBM, one [K, bv] window copied in / out by DMA at a
        # sequence's first / last chunk (VMEM then holds no per-sequence buffers either)
        state=(pl.BlockSpec(memory_space=pl.ANY) if call.packed
               else pl.BlockSpec((None, 1, K, bv), lambda b, j, i: (b, 0, 0, j))),
        chunk_state=pl.BlockSpec((None, None, K, bv), lambda b, j, i: (b, ch(i), 0, j)),
        # flags as [n, 1, 1]: a (1, 1) block per chunk (a rank-1 block of one element breaks the
        # TPU block-shape rule; SMEM is small, so the flags of all chunks are not kept there)
        flags=pl.BlockSpec((None, 1, 1), lambda b, j, i: (ch(i), 0, 0), memory_space=pltpu.SMEM),
    )


def _flags_input(call: KernelCall, flags, sp):
    return (flags.reshape(-1, 1, 1), sp["flags"]) if call.packed else None


def _copy(call: KernelCall, src, dst, sem):
    """A synchronous DMA ``src`` -> ``dst`` (the packed path's per-sequence state windows)."""
    cp = pltpu.make_async_copy(src, dst, sem)
    cp.start()
    cp.wait()


def _window(call: KernelCall, ref, sid):
    """The [K, bv] window of sequence ``sid``'s state of this program's (bh, value block), in the
    HBM array ``ref`` [BH | H, nseq, K, V]."""
    bv = call.bv_state
    cols = slice(None) if bv == call.V else pl.ds(pl.multiple_of(pl.program_id(1) * bv, bv), bv)
    return ref.at[pl.program_id(0), sid, :, cols]


def _chunk_flags(flags_ref):
    """(sequence id, first chunk of it, last chunk of it) of this step's chunk (the encoding of
    :func:`.tiles.chunk_flags`)."""
    f = flags_ref[0, 0]
    return f >> 2, (f & 1) != 0, (f & 2) != 0


def _forward_chunk(call: KernelCall, *, w_ref, u_ref, k_ref, e_gam_end_ref, e_gam_last_ref, h0_ref, s_ref,
                   flags_ref=None, final_ref=None, vn_ref=None, h_ref=None, q_ref=None, e_gam_ref=None,
                   aqk_ref=None, o_ref=None, sem_ref=None):
    """One chunk of the forward state pass; S enters from / leaves to the scratch ``s_ref``."""
    i = pl.program_id(2)

    @pl.when(i == 0)
    def _():
        if call.packed:  # the row's first chunk starts a sequence: it loads that sequence's h0
            s_ref[...] = jnp.zeros(s_ref.shape, F32)
        else:
            s_ref[...] = _t.load_f32(h0_ref, 0)

    if call.packed:
        sid, first, last = _chunk_flags(flags_ref)

        @pl.when(first)
        def _():
            _copy(call, _window(call, h0_ref, sid), s_ref, sem_ref)

    S = s_ref[...]
    if h_ref is not None:
        h_ref[...] = S.astype(h_ref.dtype)
    sdt = call.state_dt
    vn = _t.load_f32(u_ref) - _t.mm(call, w_ref[...], S, dt=sdt)
    if vn_ref is not None:
        vn_ref[...] = vn.astype(vn_ref.dtype)
    if o_ref is not None:
        qg = _t.load_f32(q_ref) * (e_gam_ref[...] * call.scale)
        o = _t.mm(call, qg, S, dt=call.out_dt) + _t.mm(call, aqk_ref[...], vn, dt=call.out_dt)
        o_ref[...] = o.astype(o_ref.dtype)
    kd = _t.load_f32(k_ref) * e_gam_end_ref[...]
    S = e_gam_last_ref[...] * S + _t.mm(call, kd, vn, ta=True, dt=sdt)
    s_ref[...] = S
    if final_ref is None:
        return
    if call.packed:

        @pl.when(last)
        def _():
            _copy(call, s_ref, _window(call, final_ref, sid), sem_ref)
    else:

        @pl.when(i == call.n - 1)
        def _():
            final_ref[0] = S.astype(final_ref.dtype)


def _scratch(call: KernelCall, bv: int):
    """The carried state (forward: S; reverse: dS), float32 [K, bv] in VMEM; packed: and the DMA
    semaphore of the state windows' copies."""
    scratch = dict(s=pltpu.VMEM((call.K, bv), F32))
    if call.packed:
        scratch["sem"] = pltpu.SemaphoreType.DMA(())
    return scratch


def forward_states(call: KernelCall, w, u, k, e_gam_end, e_gam_last, h0, flags):
    """:func:`.state_fwd.forward_states` streamed: grid (B*H, V/bv_state, chunks). Returns ``vn``
    [BH, T, V], ``h`` [BH, n, K, V] (mid dtype) and ``final`` [BH | H, nseq, K, V] f32."""
    bv = call.bv_state
    BH, K, V, n, Tp = call.BH, call.K, call.V, call.n, call.Tp
    sp = _specs(call, bv, reverse=False)
    inputs = dict(w=(w, sp["hm_k"]), u=(u, sp["hm_v"]), k=(k, sp["tok_k"]), e_gam_end=(e_gam_end, sp["col"]),
                  e_gam_last=(e_gam_last, sp["last"]), h0=(h0, sp["state"]), flags=_flags_input(call, flags, sp))
    outputs = dict(vn=(sds((BH, Tp, V), call.mid_dt), sp["hm_v"]),
                   h=(sds((BH, n, K, V), call.mid_dt), sp["chunk_state"]),
                   final=(sds(h0.shape, F32), sp["state"]))
    return run(call, functools.partial(_forward_chunk, call), name="gdn_fwd_h_tpu", grid=(BH, V // bv, n),
               inputs=inputs, outputs=outputs, warps=call.warps_state, scratch=_scratch(call, bv),
               semantics=SEMANTICS)


def forward_states_and_output(call: KernelCall, w, u, k, e_gam_end, e_gam_last, h0, flags, q, e_gam, aqk):
    """:func:`.state_fwd.forward_states_and_output` streamed: grid (B*H, V/bv_state, chunks).
    Returns ``o`` (token layout, input dtype) and ``final`` [BH | H, nseq, K, V] f32."""
    bv = call.bv_state
    V, n = call.V, call.n
    sp = _specs(call, bv, reverse=False)
    inputs = dict(w=(w, sp["hm_k"]), u=(u, sp["hm_v"]), k=(k, sp["tok_k"]), e_gam_end=(e_gam_end, sp["col"]),
                  e_gam_last=(e_gam_last, sp["last"]), h0=(h0, sp["state"]), q=(q, sp["tok_k"]),
                  e_gam=(e_gam, sp["col"]), aqk=(aqk, sp["tile"]), flags=_flags_input(call, flags, sp))
    outputs = dict(o=(token_shape(call, V, call.in_dt), sp["tok_v"]), final=(sds(h0.shape, F32), sp["state"]))
    return run(call, functools.partial(_forward_chunk, call), name="gdn_fwd_h_o_tpu", grid=(call.BH, V // bv, n),
               inputs=inputs, outputs=outputs, warps=call.warps_state, scratch=_scratch(call, bv),
               semantics=SEMANTICS)


def forward_final_state(call: KernelCall, w, u, k, e_gam_end, e_gam_last, h0, flags):
    """:func:`.state_fwd.forward_final_state` streamed: grid (B*H, V/bv_state, chunks); no q, Aqk,
    o, Vn or per-chunk states. Returns ``final`` [BH | H, nseq, K, V] f32."""
    bv = call.bv_state
    V, n = call.V, call.n
    sp = _specs(call, bv, reverse=False)
    inputs = dict(w=(w, sp["hm_k"]), u=(u, sp["hm_v"]), k=(k, sp["tok_k"]), e_gam_end=(e_gam_end, sp["col"]),
                  e_gam_last=(e_gam_last, sp["last"]), h0=(h0, sp["state"]), flags=_flags_input(call, flags, sp))
    outputs = dict(final=(sds(h0.shape, F32), sp["state"]))
    return run(call, functools.partial(_forward_chunk, call), name="gdn_fwd_h_final_tpu", grid=(call.BH, V // bv, n),
               inputs=inputs, outputs=outputs, warps=call.warps_state, scratch=_scratch(call, bv),
               semantics=SEMANTICS)


def _reverse_chunk(call: KernelCall, *, q_ref, k_ref, w_ref, dvl_ref, do_ref, e_gam_ref, e_gam_end_ref,
                   e_gam_last_ref, dfinal_ref, dh_ref, dvn_ref, dh0_ref, s_ref, flags_ref=None, sem_ref=None):
    """One chunk (chunk n - 1 - i at step i) of the reverse state pass; dS in the scratch ``s_ref``."""
    i = pl.program_id(2)

    @pl.when(i == 0)
    def _():
        if call.packed:  # the row's last chunk ends a sequence: it loads that sequence's d final
            s_ref[...] = jnp.zeros(s_ref.shape, F32)
        else:
            s_ref[...] = _t.load_f32(dfinal_ref, 0)

    if call.packed:
        sid, first, last = _chunk_flags(flags_ref)

        @pl.when(last)
        def _():
            _copy(call, _window(call, dfinal_ref, sid), s_ref, sem_ref)

    dS = s_ref[...]
    dh_ref[...] = dS.astype(dh_ref.dtype)
    sdt = call.state_dt
    kd = _t.load_f32(k_ref) * e_gam_end_ref[...]
    dvn = _t.load_f32(dvl_ref) + _t.mm(call, kd, dS, dt=sdt)
    dvn_ref[...] = dvn.astype(dvn_ref.dtype)
    qg = _t.load_f32(q_ref) * (e_gam_ref[...] * call.scale)
    dS = (e_gam_last_ref[...] * dS + _t.mm(call, qg, do_ref[...], ta=True, dt=sdt)
          - _t.mm(call, w_ref[...], dvn, ta=True, dt=sdt))
    s_ref[...] = dS
    if call.packed:

        @pl.when(first)
        def _():
            _copy(call, s_ref, _window(call, dh0_ref, sid), sem_ref)
    else:

        @pl.when(i == call.n - 1)
        def _():
            dh0_ref[0] = dS.astype(dh0_ref.dtype)


def reverse_states(call: KernelCall, q, k, w, dvl, do, e_gam, e_gam_end, e_gam_last, dfinal, flags):
    """:func:`.state_bwd.reverse_states` streamed: grid (B*H, V/bv_state, chunks), the chunks
    walked from the last. Returns ``dh`` [BH, n, K, V], ``dvn`` [BH, T, V] (mid dtype) and
    ``dh0`` [BH | H, nseq, K, V] f32."""
    bv = call.bv_state
    BH, K, V, n, Tp = call.BH, call.K, call.V, call.n, call.Tp
    sp = _specs(call, bv, reverse=True)
    inputs = dict(q=(q, sp["tok_k"]), k=(k, sp["tok_k"]), w=(w, sp["hm_k"]), dvl=(dvl, sp["hm_v"]),
                  do=(do, sp["tok_v"]), e_gam=(e_gam, sp["col"]), e_gam_end=(e_gam_end, sp["col"]),
                  e_gam_last=(e_gam_last, sp["last"]), dfinal=(dfinal, sp["state"]),
                  flags=_flags_input(call, flags, sp))
    outputs = dict(dh=(sds((BH, n, K, V), call.mid_dt), sp["chunk_state"]),
                   dvn=(sds((BH, Tp, V), call.mid_dt), sp["hm_v"]),
                   dh0=(sds(dfinal.shape, F32), sp["state"]))
    return run(call, functools.partial(_reverse_chunk, call), name="gdn_bwd_dh_tpu", grid=(BH, V // bv, n),
               inputs=inputs, outputs=outputs, warps=call.warps_state, scratch=_scratch(call, bv),
               semantics=SEMANTICS)
