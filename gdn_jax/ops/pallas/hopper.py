"""Hopper (sm_90) kernels through Pallas' Mosaic GPU backend (``plgpu.kernel``: TMA copies into
swizzled shared memory, ``wgmma`` with float32 accumulators in registers): the forward's two
stages, chosen by ``KernelConfig.gpu_kernels`` for the calls :func:`covers` takes (the backward's
kernels, which reuse both in their backward modes, are in :mod:`.hopper_bwd`).

:func:`wy_forward`: the WY representation of every chunk (the twin of
:func:`gdn_jax.ops.pallas.wy.wy_repr`), one CTA per chunk, the triangular inverse as bf16x3 wgmmas.

:func:`forward_states_and_output`: the forward state pass fused with the output (the twin of
:func:`gdn_jax.ops.pallas.state_fwd.forward_states_and_output`). One CTA (one compute warpgroup) per
(batch x value head, block of ``bv`` value channels; ``state_warpgroups`` blocks with the producer)
walks the chunks with the state S [K, bv] in registers (float32, the wgmma accumulator layout); per chunk n, with S entering it::

    Vn  = U - W S                              wgmma (W: SMEM, S: bf16 copy in SMEM)
    O   = e^gamma * scale * (Q S) + Aqk Vn     wgmma x 2, the row scaling on the accumulator
    S  <- e^{gamma_C} S + K^T (e^{gamma_C - gamma} * Vn)     wgmma with K transposed in SMEM

The next chunk's q, k, W, U, Aqk and gates are copied by TMA into the other of two SMEM slots
(``state_slots`` with the producer below) while this one computes; o leaves through SMEM by TMA. Only ``U - W S`` and the K^T update sit
on the S -> S' chain; Q S is issued beside W S. With ``KernelConfig.state_producer`` (the default
on a GPU, K <= 128: :func:`producer`) a second, producer warpgroup issues those copies into
``state_slots`` slots and the compute warpgroup(s) release each slot after their step's last
wgmma, so the copies' issue and waits leave the chain.

On CPU the same kernel runs in Mosaic GPU's interpret mode (``platform="interpret"``): its data
movement (TMA slots, barriers, indexing) is interpreted and its matmuls computed with ``jnp``
(the interpreter has no transposed wgmma operands nor register layouts), so CI checks the
kernel's logic; the wgmma lowering itself is checked by ``jax.export(..., platforms=["cuda"])``.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .._vma import varying_kernel
from .config import KernelCall
from .hopper_plan import (SMEM_BYTES, block_for, default_block, producer, single_q, smem_bytes, wy_compact,  # noqa: F401
                          wy_smem_bytes)
from .hopper_plan import fwd_covers as covers  # noqa: F401  (the planning module's; re-exported)

F32, BF16 = jnp.float32, jnp.bfloat16


def _plgpu():
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return plgpu


def _interpret_params():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def _kernel_kw(call: KernelCall, kernel: Optional[str] = None) -> dict:
    """``plgpu.kernel``'s keyword arguments for ``call``: Mosaic GPU's interpreter (platform
    "interpret") or, on a GPU, compiler params: with ``KernelConfig.approx_math`` exp lowered to
    ``ex2.approx.ftz`` (a multiply and one instruction instead of libdevice's range reduction);
    ``unsafe_no_auto_barriers`` for ``kernel`` (one of config.OWN_BARRIER_KERNELS: "wy", "state",
    "reverse", "grads", kernels that can place their own barriers, see :func:`_sync`) where
    ``KernelConfig.auto_barriers`` resolved to leave out Pallas' barriers (``call.own_barriers``)."""
    if call.platform == "interpret":
        return dict(interpret=_interpret_params())
    kw = dict(approx_math=True) if call.approx_math else {}
    if kernel is not None and kernel in call.own_barriers:
        kw["unsafe_no_auto_barriers"] = True
    return dict(compiler_params=_plgpu().CompilerParams(**kw)) if kw else {}


def _sync(call: KernelCall, kernel: str):
    """The warpgroup barrier that Pallas' automatic barriers would have put before the next store to
    shared memory, where the data flow may need it (``kernel`` in ``call.own_barriers``): where a
    warpgroup's threads read a tile with thread loads and then overwrite it. ``commit_smem`` (a fence
    and a ``bar.sync``); nothing with the automatic barriers or in interpret mode. Not needed after
    ``wait_smem_to_gmem``: Mosaic GPU ends that wait with a warpgroup ``bar.sync`` itself
    (``LaunchContext.await_async_copy``, JAX 0.10 and 0.11), so threads that overwrite a tile after
    it know the TMA store has read it. Where a tile is refilled by TMA, every thread read of it
    comes before a ``commit_smem`` that precedes the refill."""
    if kernel in call.own_barriers and call.platform != "interpret":
        _plgpu().commit_smem()


def _transforms(dtype, cols, swizzle=None):
    """Tiling + swizzle of a [rows, cols] SMEM tile (wgmma operands and TMA destinations): the
    widest swizzle the row allows, or ``swizzle`` bytes (the two operands of a wgmma must agree)."""
    plgpu = _plgpu()
    item = jnp.dtype(dtype).itemsize
    sw = swizzle or plgpu.find_swizzle(cols * item * 8)
    return (plgpu.TilingTransform((8, sw // item)), plgpu.SwizzleTransform(sw))


def _smem(shape, dtype, swizzle=None):
    return _plgpu().SMEM(tuple(shape), jnp.dtype(dtype), transforms=_transforms(dtype, shape[-1], swizzle))


def _load(ref, layout, interp):
    """An SMEM tile into registers with the given layout (interpret mode: a plain read)."""
    return ref[...] if interp else _plgpu().load(ref, (), layout=layout)


class _T:
    """A transposed SMEM operand of :func:`_mmas` (A or B)."""

    def __init__(self, ref):
        self.ref = ref


def _operand(x):
    return _plgpu().transpose_ref(x.ref, (1, 0)) if isinstance(x, _T) else x


def _mmas(specs, interp, between=None):
    """Issue the wgmmas ``acc_i (+)= a_i @ b_i`` together, wait, return the accumulators.

    ``specs``: (init, a, b) with ``init`` an (M, N) shape (zero accumulator) or a float32 array in
    the wgmma layout (accumulate onto it); ``a`` an SMEM ref, a 16-bit array in the wgmma layout
    (registers) or a tuple of such terms (summed into one accumulator); ``b`` an SMEM ref or
    ``_T(ref)`` (transposed; 16-bit only; float32 operands run as TF32 and need B transposed).
    ``between``: a function run after the wgmmas are issued and before they are waited for (work
    that does not touch their operands or accumulators). Interpret mode computes them with
    ``jnp`` (and runs ``between`` first)."""
    if between is not None and interp:
        between()
    norm = [(init, a if isinstance(a, (tuple, list)) else (a,), b if isinstance(b, (tuple, list)) else (b,))
            for init, a, b in specs]
    if interp:
        out = []
        for init, As, Bs in norm:
            r = 0.0
            for a, b in zip(As, Bs):
                av, bv = (_load_any(x) for x in (a, b))
                r = r + jnp.dot(av.astype(F32), bv.astype(F32), preferred_element_type=F32)
            out.append(r if isinstance(init, tuple) else init + r)
        return tuple(out)
    plgpu = _plgpu()

    def issue(accs):
        for acc, (_, As, Bs) in zip(accs, norm):
            for a, b in zip(As, Bs):
                plgpu.wgmma(acc, _operand(a), _operand(b))
        if between is not None:
            between()

    if all(isinstance(x, tuple) for x, *_ in specs):
        def scoped(*accs):
            issue(accs)
            return tuple(a[...] for a in accs)

        return pl.run_scoped(scoped, *[plgpu.ACC(x, F32) for x, *_ in specs])
    if any(isinstance(x, tuple) for x, *_ in specs):
        raise ValueError("_mmas: all accumulators zero-initialised or all initialised")
    return pl.run_state(issue)(tuple(plgpu.ACC.init(x) for x, *_ in specs))


def _load_any(x):
    """Interpret mode: the value of an operand (array, ref or transposed ref)."""
    if isinstance(x, _T):
        return x.ref[...].T
    if isinstance(x, jax.Array) or not hasattr(x, "at"):
        return x
    return x[...]


def _iota(shape, dim, interp):
    if interp:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    plgpu = _plgpu()
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _split(x, lo=True):
    """float32 -> (hi, lo) bfloat16 with hi + lo = x to ~2^-16 relative (bf16x3 products); with
    ``lo=False`` (``KernelConfig.wy_precision="bf16"``) (hi, None)."""
    hi = x.astype(BF16)
    return hi, (x - hi.astype(F32)).astype(BF16) if lo else None


def tile_in(src, tile, bar, interp):
    """A GMEM block into the staging ``tile`` by TMA (once the tile's last TMA store has read it),
    then into registers in the wgmma layout: the state passes' initial-state loads."""
    plgpu = _plgpu()
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    plgpu.copy_gmem_to_smem(src, tile, bar)
    plgpu.barrier_wait(bar)
    return _load(tile, plgpu.Layout.WGMMA, interp)


def tile_out(x, tile, dst):
    """Registers ``x`` through the staging ``tile`` to ``dst`` by TMA (the store waits until the tile's
    last TMA store has read it, and is committed before the copy): o and final-state stores."""
    plgpu = _plgpu()
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    tile[...] = x.astype(tile.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(tile, dst)


def _i32(x):
    """A Python int as an int32 scalar: grid and loop indices are int32, and lax.div / rem want
    equal dtypes (a bare Python int becomes int64 under ``jax_enable_x64``)."""
    return jnp.int32(x)


def _wait_slot(bars, slot):
    """Wait for every TMA copy into ``slot`` of the double-buffered tiles (one barrier pair each)."""
    for bar in bars:
        _plgpu().barrier_wait(bar.at[slot])


def _slot_flags(g_s, slot):
    """(sequence id, first chunk of it, last chunk of it) of the chunk in ``slot``: its
    ``cu_seqlens`` flags, carried as a float in row 2, column 1 of the gates tile (the encoding
    of :func:`gdn_jax.ops.packing.chunk_flags`)."""
    f = g_s[slot, 2, 1].astype(jnp.int32)
    return f >> 2, (f & 1) != 0, (f & 2) != 0


def chunk_last_row(call: KernelCall, e_gam_last, flags):
    """The state passes' per-chunk scalar row [BH, n, C] f32: [e^{gamma_C}, the chunk's flags
    (``cu_seqlens`` only; exact in float32 below 2^24), 0, ...] -- by concatenation (a scatter
    into zeros would be a kernel launch of its own on a GPU)."""
    BH, n, C = call.BH, call.n, call.C
    cols = [e_gam_last.reshape(BH, n, 1).astype(F32)]
    if call.packed:
        cols.append(jnp.broadcast_to(flags.astype(F32)[None, :, None], (BH, n, 1)))
    return jnp.concatenate(cols + [jnp.zeros((BH, n, C - len(cols)), F32)], axis=-1)


def forward_states_and_output(call: KernelCall, w, u, k, e_gam_end, e_gam_last, h0, flags, q=None, e_gam=None,
                              aqk=None, save_states: bool = False, v=None, t=None, beta=None):
    """The fused forward state pass on Hopper; arguments and result as
    :func:`gdn_jax.ops.pallas.state_fwd.forward_states_and_output`. With ``cu_seqlens``
    (``call.packed``) the per-chunk ``flags`` ride in the gates row of each chunk: at a sequence's
    first chunk S restarts from ``h0[seq]`` (TMA), after its last S is written to ``final[seq]``.

    Without ``q`` (the backward's recompute, :func:`gdn_jax.ops.pallas.hopper_bwd.recompute_states`)
    no output is formed: the state entering each chunk ``h`` [BH, n, K, V] and ``vn`` [BH, T, V]
    (bf16) leave by TMA instead of ``o`` and the final state. With ``q`` and ``save_states``
    (``KernelConfig.save_states``) they leave as well as ``o`` and the final state, the same
    values the recompute writes (the result has all four).

    With :func:`producer` (``KernelConfig.state_producer``) the CTA has ``state_warpgroups`` compute
    warpgroups (each its own value block: grid (B*H, V / (bv * state_warpgroups))) and a producer
    warpgroup that copies every chunk's tiles into ``state_slots`` slots, refilling a slot once each
    compute warpgroup has arrived on its "free" barrier after the step's last wgmma.

    With ``t`` = (t_hi, t_lo) [BH, n, C, C] bf16 (``KernelConfig.fwd_form="t"``; ``w`` and ``u``
    are None, ``v`` the values in the token layout, ``beta`` the beta column [BH, T, 1]) Vn is
    formed from T instead of W, U: ``Vn = T (beta V - beta e^gamma (K S))`` (K S issued beside
    Q S, the product with T as bf16x2)."""
    plgpu = _plgpu()
    interp = call.platform == "interpret"
    C, K, V, BH, H, G, n, Tp = call.C, call.K, call.V, call.BH, call.H, call.group, call.n, call.Tp
    B = BH // H
    bv = call.bv_mosaic
    in_dt = jnp.dtype(call.in_dt)
    # per-chunk scalars, one TMA row each: e^gamma * scale, e^{gamma_C - gamma}, last_row and, for
    # fwd_form "t", beta and beta e^gamma
    last_row = chunk_last_row(call, e_gam_last, flags)
    rec = q is None
    tf = t is not None
    keep = rec or save_states  # h and Vn leave by TMA
    e_o = jnp.zeros((BH, n, C), F32) if rec else e_gam.reshape(BH, n, C) * call.scale
    rows_ = [e_o, e_gam_end.reshape(BH, n, C), last_row]
    if tf:
        rows_ += [beta.reshape(BH, n, C), (beta * e_gam).reshape(BH, n, C)]
    gates = jnp.stack(rows_, axis=2).astype(F32)

    sw = min(128, 2 * bv)  # every wgmma pairs a [., K] or [., C] tile with a [., bv] one: one swizzle
    # KernelConfig.state_producer: a producer warpgroup fills D slots; nc compute warpgroups (value
    # blocks) share each chunk's tiles but U's, and have their own state tiles
    wspec = producer(call)
    D, nc = (call.state_slots, call.state_wgs) if wspec else (2, 1)
    per_wg = lambda shape: (nc,) + tuple(shape) if wspec else tuple(shape)
    # per-chunk tiles (D TMA slots each; U's D * nc), in fetch order
    one_q = not rec and single_q(call)  # one q tile, refilled once Q S has read it
    one_w = not tf and single_q(call)  # "wu": one W tile, refilled once W S has read it
    slots = {} if (rec or one_q) else dict(q_s=_smem((D, C, K), in_dt, sw))
    slots["k_s"] = _smem((D, C, K), in_dt, sw)
    if tf:
        slots.update(th_s=_smem((D, C, C), BF16, sw), tl_s=_smem((D, C, C), BF16, sw),
                     u_s=_smem((D * nc, C, bv), in_dt, sw))  # v's value block
    else:
        slots.update({} if one_w else dict(w_s=_smem((D, C, K), BF16, sw)))
        slots.update(u_s=_smem((D * nc, C, bv), BF16, sw))
    if not rec:
        slots["a_s"] = _smem((D, C, C), BF16, sw)
    slots["g_s"] = plgpu.SMEM((D, len(rows_), C), F32)
    scratch = dict(slots, s_s=_smem(per_wg((K, bv)), BF16, sw), vn_s=_smem(per_wg((C, bv)), BF16, sw),
                   vs_s=_smem(per_wg((C, bv)), BF16, sw))
    if not rec:
        scratch["o_s"] = _smem(per_wg((C, bv)), in_dt, sw)
    scratch.update(f_s=_smem(per_wg((K, bv)), F32),
                   bars=[plgpu.Barrier(num_barriers=D * (nc if name == "u_s" else 1)) for name in slots],
                   h0_bar=plgpu.Barrier(num_barriers=nc))
    if wspec:  # a slot is free again once every compute warpgroup has arrived
        scratch["free"] = plgpu.Barrier(num_arrivals=nc, num_barriers=D)
    if one_q:
        scratch.update(q_s=_smem((C, K), in_dt, sw), q_bar=plgpu.Barrier(num_barriers=1))
    if one_w:
        scratch.update(w_s=_smem((C, K), BF16, sw), w_bar=plgpu.Barrier(num_barriers=1))
    in_names = ([] if rec else ["q_ref"]) + ["k_ref"] + (["th_ref", "tl_ref", "v_ref"] if tf else ["w_ref", "u_ref"])
    in_names += ([] if rec else ["a_ref"]) + ["g_ref", "h0_ref"]
    out_names = ["h_ref", "vno_ref"] if rec else ["o_ref", "fin_ref"] + (["h_ref", "vno_ref"] if save_states else [])

    def body(*refs):
        r = dict(zip(in_names + out_names + list(scratch), refs))
        bh = lax.axis_index("bh")
        b, h = lax.div(bh, _i32(H)), lax.rem(bh, _i32(H))
        hk = lax.div(h, _i32(G)) if G > 1 else h
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
                slot = lax.rem(i, _i32(D))
                pl.when(i >= D)(lambda: plgpu.barrier_wait(r["free"].at[slot]))
                fetch(i, slot, range(nc))
                return _

            lax.fori_loop(_i32(0), _i32(n), issue, None)
            # every release of every slot observed (Mosaic GPU's interpreter checks it)
            lax.fori_loop(_i32(max(n - D, 0)), _i32(n),
                          lambda i, _: (plgpu.barrier_wait(r["free"].at[lax.rem(i, _i32(D))]), _)[1], None)

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
        s_s, vn_s, vs_s, f_s = (pick(r[x]) for x in ("s_s", "vn_s", "vs_s", "f_s"))
        o_s = None if rec else pick(r["o_s"])
        bars, h0_bar = r["bars"], r["h0_bar"].at[w]
        h0_ref, h_ref, vno_ref, o_ref, fin_ref = (r.get(x) for x in ("h0_ref", "h_ref", "vno_ref", "o_ref", "fin_ref"))
        bh = lax.axis_index("bh")
        vsl = pl.ds((lax.axis_index("vb") * nc + w) * bv, bv)
        b, h = lax.div(bh, _i32(H)), lax.rem(bh, _i32(H))
        hk = lax.div(h, _i32(G)) if G > 1 else h

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

        late = call.late_o and not rec  # KernelConfig.late_o_store: chunk i-1's o leaves during step i's wgmmas

        def store_o(o, j):  # o of chunk j through o_s by TMA
            tile_out(o, o_s, o_ref.at[b, pl.ds(j * C, C), h, vsl])

        def step(i, carry):
            S, o_prev = carry if late else (carry, None)
            slot = lax.rem(i, _i32(D))
            if fetch is not None:
                pl.when(i + 1 < n)(lambda: fetch(i + 1, 1 - slot))
            wait_slot(slot)
            if one_q:
                plgpu.barrier_wait(r["q_bar"])
            if one_w:
                plgpu.barrier_wait(r["w_bar"])
            if call.packed:
                seq, first, last = _slot_flags(g_s, slot)
                S = lax.cond(first, lambda: load_state(seq), lambda: S)
            if keep:  # s_s and vn_s may still feed the previous chunk's h / Vn stores
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            s_s[...] = S.astype(BF16)
            plgpu.commit_smem()
            if keep:
                plgpu.copy_smem_to_gmem(s_s, h_ref.at[bh, i, :, vsl])
            # W S (or K S for fwd_form "t") and Q S, issued together
            x_s = k_s.at[slot] if tf else (w_s if one_w else w_s.at[slot])
            if rec:
                (ws,) = _mmas([((C, bv), x_s, s_s)], interp)
            else:
                prev = (lambda: pl.when(i > 0)(lambda: store_o(o_prev, i - 1))) if late else None
                ws, qs = _mmas([((C, bv), x_s, s_s), ((C, bv), q_s if one_q else q_s.at[slot], s_s)],
                               interp, between=prev)
                if one_q:  # Q S has completed: the next chunk's q lands during the rest of this step
                    pl.when(i + 1 < n)(lambda: fetch_q(i + 1))
            if one_w:  # W S has completed: likewise the next chunk's W
                pl.when(i + 1 < n)(lambda: fetch_w(i + 1))
            if tf:  # Vn = T (beta V - beta e^gamma (K S)); the scaled residual goes through vs_s
                x = (_load(u_s.at[slot * nc + w], plgpu.Layout.WGMMA, interp).astype(F32)
                     * bcast(_load(g_s.at[slot, 3], row, interp), (C, bv))
                     - ws * bcast(_load(g_s.at[slot, 4], row, interp), (C, bv)))
                vs_s[...] = x.astype(BF16)
                plgpu.commit_smem()
                (vn,) = _mmas([((C, bv), (th_s.at[slot], tl_s.at[slot]), (vs_s, vs_s))], interp)
            else:
                vn = _load(u_s.at[slot * nc + w], plgpu.Layout.WGMMA, interp).astype(F32) - ws
            e_end = _load(g_s.at[slot, 1], row, interp)
            # this slot's last gate reads come before the commit below: the one-warpgroup pass refills
            # the slot at its next step, and without the automatic barriers (KernelConfig.auto_barriers,
            # the default for this pass) nothing else orders those reads before that TMA copy
            g_end = g_s[slot, 2, 0]
            e_o = None if rec else _load(g_s.at[slot, 0], row, interp)
            vn_s[...] = vn.astype(BF16)
            vs_s[...] = (vn * bcast(e_end, vn.shape)).astype(BF16)
            plgpu.commit_smem()
            if keep:
                plgpu.copy_smem_to_gmem(vn_s, vno_ref.at[bh, pl.ds(i * C, C), vsl])
            release = (lambda: plgpu.barrier_arrive(r["free"].at[slot])) if wspec else (lambda: None)
            if rec:
                (S,) = _mmas([(S * g_end, _T(k_s.at[slot]), vs_s)], interp)
                release()  # the slot's last read
                return S
            o0 = qs * bcast(e_o, qs.shape)
            o, S = _mmas([(o0, a_s.at[slot], vn_s), (S * g_end, _T(k_s.at[slot]), vs_s)], interp)
            release()
            if not late:
                store_o(o, i)
            if call.packed:
                pl.when(last)(lambda: store_state(S, seq))
            return (S, o.astype(in_dt)) if late else S

        if late:
            o0 = jnp.zeros((C, bv), in_dt)
            o0 = o0 if interp else plgpu.layout_cast(o0, plgpu.Layout.WGMMA)
            S, o_last = lax.fori_loop(_i32(0), _i32(n), step, (S0, o0))
            store_o(o_last, n - 1)
        else:
            S = lax.fori_loop(_i32(0), _i32(n), step, S0)
        if not call.packed and not rec:
            store_state(S, 0)
        plgpu.wait_smem_to_gmem(0)

    kw = _kernel_kw(call, "state")  # KernelConfig.auto_barriers (see _sync)
    states = (jax.ShapeDtypeStruct((BH, n, K, V), BF16), jax.ShapeDtypeStruct((BH, Tp, V), BF16))
    if rec:
        out_type = states
    else:
        out_type = (jax.ShapeDtypeStruct((B, Tp, H, V), in_dt), jax.ShapeDtypeStruct(h0.shape, F32))
        out_type += states if save_states else ()
    if wspec:
        kw.update(num_threads=nc + 1, thread_name="wg")
    fn = varying_kernel(plgpu.kernel, body, out_type=out_type,
                        scratch_types=list(scratch.values()), grid=(BH, V // (bv * nc)),
                        grid_names=("bh", "vb"), **kw)
    args = ([] if rec else [q]) + [k] + ([t[0], t[1], v] if tf else [w.astype(BF16), u.astype(BF16)])
    args += ([] if rec else [aqk.astype(BF16)]) + [gates, h0]
    out = fn(*args)
    if rec:
        return dict(h=out[0], vn=out[1])
    if save_states:
        return dict(o=out[0], final=out[1], h=out[2], vn=out[3])
    return dict(o=out[0], final=out[1])


def scaled_t(t, col, C):
    """A zero-argument function giving T diag(s) as a bf16 (hi, lo) register pair (to ~2^-16) for
    :func:`write_w_u`: ``t`` the float32 [C, C] T in the wgmma layout, ``col`` the [C] scales s in
    the column-broadcast layout (``Layout.WGMMA.reduce(0)``)."""
    return lambda: _split(t * lax.broadcast_in_dim(col, (C, C), [1]))


def write_w_u(tw, tu, k_s, v_s, w_s, w_dst, u_dst, C, K, V, interp, sequential=False):
    """W = T diag(beta e^gamma) K and U = T diag(beta) V as bf16x2 products (float32 accumulation):
    ``tw`` / ``tu`` zero-argument functions giving the A operands' (hi, lo) pairs, :func:`scaled_t`
    (the scales on T's columns in registers; ``k_s`` / ``v_s`` the unscaled K and V tiles: no
    rounding of a scaled K or V, no SMEM round trip of the tiles; called when their product is
    issued, so that one pair is live at a time in the sequential form). Written to ``w_dst`` /
    ``u_dst`` by TMA through ``w_s`` and ``v_s``; waits for every copy of the CTA to land. ``sequential``: W first, then U, each in column blocks of at most 128
    (one [C, <= 128] accumulator and one pair live at a time; ``w_s`` may be ``k_s``)."""
    plgpu = _plgpu()
    if sequential:
        for pair_fn, x_s, dst_s, N, dst in ((tw, k_s, w_s, K, w_dst), (tu, v_s, v_s, V, u_dst)):
            pair = pair_fn()
            # in column blocks of at most 128 (a [C, 128] float32 accumulator: 64 registers)
            for c0 in range(0, N, 128):
                cols = pl.ds(c0, min(128, N))
                xc = x_s if N <= 128 else x_s.at[:, cols]
                (Xm,) = _mmas([((C, min(128, N)), pair, (xc, xc))], interp)
                # the wgmma has completed: these columns of x_s are free (W leaves through K's tile)
                (dst_s if N <= 128 else dst_s.at[:, cols])[...] = Xm.astype(dst_s.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dst_s, dst)
        plgpu.wait_smem_to_gmem(0)
        return
    Wm, Um = _mmas([((C, K), tw(), (k_s, k_s)), ((C, V), tu(), (v_s, v_s))], interp)
    w_s[...] = Wm.astype(w_s.dtype)
    v_s[...] = Um.astype(v_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(w_s, w_dst)
    plgpu.copy_smem_to_gmem(v_s, u_dst)
    plgpu.wait_smem_to_gmem(0)


def _terms(a, b, hp):
    """The (As, Bs) terms of ``A @ B`` for :func:`_mmas` from A's and B's (hi, lo) pairs: bf16x3
    (hi hi + lo hi + hi lo) with ``hp``, else the hi product alone (the lo parts may be None)."""
    return ((a[0], a[1], a[0]), (b[0], b[0], b[1])) if hp else ((a[0],), (b[0],))


def _k_slices(a_hi, a_lo, b_hi, b_lo, slices):
    """bf16x3 terms of ``A @ B`` contracted over the row / column ``slices`` ((start, size) pairs)
    only, where A (registers, hi / lo) and B (SMEM, hi / lo) may be nonzero: (As, Bs) for
    :func:`_mmas`; with ``a_lo`` None (``wy_precision="bf16"``) the hi terms alone."""
    As, Bs = (), ()
    for a, n in slices:
        lo = None if a_lo is None else a_lo[:, a:a + n]
        b_lo_ = None if a_lo is None else b_lo.at[pl.ds(a, n)]
        A_, B_ = _terms((a_hi[:, a:a + n], lo), (b_hi.at[pl.ds(a, n)], b_lo_), a_lo is not None)
        As, Bs = As + A_, Bs + B_
    return As, Bs


def _round_tiles(hp, pairs):
    """Store each (hi, lo) register pair of a doubling round into its (hi_ref, lo_ref) SMEM tiles
    (the lo tiles only with bf16x3 products, ``hp``), then make the stores visible to wgmma."""
    for (hi, lo), (hi_ref, lo_ref) in pairs:
        hi_ref[...] = hi
        if hp:
            lo_ref[...] = lo
    _plgpu().commit_smem()


def _blocked_rounds(A, T2, i, j, C, interp, eye_s, tc_hi, tc_lo, lc_hi, lc_lo, hp=True):
    """The doubling rounds of T = (I + A)^-1 that stay inside the 16 x 16 diagonal blocks
    (T_2 -> T_4 -> T_8 -> T_16), computed on those blocks alone (``KernelConfig.wy_inverse="blocked"``).

    A block-diagonal X is kept compressed, ``Xc[r, m] = X[r, 16 (r // 16) + m]`` ([C, 16]); for
    block-diagonal X, Y, ``(X Y)c = sum_b mask_b(Xc) @ Yc[16 b : 16 b + 16]`` with ``mask_b`` the rows
    of block b: one m64n16k16 wgmma per block (bf16x3 as the dense rounds), a quarter of a dense
    round's FLOPs. A's diagonal blocks go to shared memory once (``Ac``, as L's tiles); each round
    ``Pc = (T_s L_s)c`` is ``(T_s A)c`` masked to L_s's blocks (rows of the odd s-blocks, columns of
    the s-block before theirs): T_s is block diagonal, so a row r of an odd s-block meets A only in
    the rows of its own s-block, where L_s = A on those columns -- the same products, so the same
    values as forming and storing L_s per round, without it (one [C, C] where, split and store
    less per round). Then ``Tc <- Tc - (P T)c``, and T_16 is expanded to [C, C] exactly:
    ``T = sum_b mask_b(Tc_hi + Tc_lo) @ I[16 b : 16 b + 16]`` (the identity in ``eye_s``, T_hi's
    tile, in a 32-byte swizzle as a K = 16 wgmma operand needs; the next round overwrites it).
    ``A``: the strictly lower [C, C] matrix; ``T2``: T_2 (full); ``hp``: bf16x3 products (else one
    bf16 wgmma per block, ``KernelConfig.wy_precision="bf16"``). Returns T_16 as a float32 [C, C]
    array."""
    plgpu = _plgpu()
    nb = C // 16
    rb = _iota((C, 16), 0, interp) >> 4
    rl = _iota((C, 16), 0, interp) & 15  # the row within its 16-block
    m = _iota((C, 16), 1, interp)  # the compressed column: global column 16 (r // 16) + m

    def compress(X):
        out = jnp.where(rb == 0, X[:, 0:16], 0.0)
        for b in range(1, nb):
            out = jnp.where(rb == b, X[:, 16 * b:16 * b + 16], out)
        return out

    def masked(x, b):
        return jnp.where(rb == b, x, jnp.zeros_like(x))

    def terms(hi, lo, b_hi, b_lo):  # bf16x3: hi*B_hi + lo*B_hi + hi*B_lo per block (bf16: hi*B_hi)
        As, Bs = (), ()
        for b in range(nb):
            rows = pl.ds(16 * b, 16)
            A_, B_ = _terms((masked(hi, b), masked(lo, b) if hp else None),
                            (b_hi.at[rows], b_lo.at[rows] if hp else None), hp)
            As, Bs = As + A_, Bs + B_
        return As, Bs

    ah, al = _split(compress(A), hp)
    lc_hi[...] = ah
    if hp:
        lc_lo[...] = al
    Tc = compress(T2)
    for lg in (1, 2, 3):
        bi = rl >> lg
        th, tl = _split(Tc, hp)
        _round_tiles(hp, [((th, tl), (tc_hi, tc_lo))])
        (P,) = _mmas([((C, 16), *terms(th, tl, lc_hi, lc_lo))], interp)
        P = jnp.where(((bi & 1) == 1) & ((m >> lg) == bi - 1), P, 0.0)
        ph, pl_ = _split(-P, hp)
        (Tc,) = _mmas([(Tc, *terms(ph, pl_, tc_hi, tc_lo))], interp)
    eye_s[...] = jnp.where(i == j, 1.0, 0.0).astype(BF16)
    plgpu.commit_smem()
    th, tl = _split(Tc)
    As, Bs = [], []
    for b in range(nb):
        As += [masked(th, b), masked(tl, b)]
        Bs += [eye_s.at[pl.ds(16 * b, 16)]] * 2
    (T,) = _mmas([((C, C), tuple(As), tuple(Bs))], interp)
    return T


def wy_forward(call: KernelCall, q, k, v, beta, gam, e_gam, do=None, save_t=False, t_form=False, with_w=False):
    """The forward's WY representation on Hopper (the Mosaic GPU twin of
    :func:`gdn_jax.ops.pallas.wy.wy_repr` with ``q``): one CTA per (batch x value head, chunk).

    In SMEM / registers (gamma the in-chunk cumulative log decay, masks applied to exponents)::

        QK, then (Aqk stored) KK = Q K^T, K K^T                wgmma (K transposed in SMEM)
        A   = strictly_lower(beta_i KK_ij e^{gamma_i - gamma_j});  Aqk = tril(scale QK_ij e^{..})
        T   = (I + A)^-1   recursive blocks T_2s = T_s - (T_s L_s) T_s, s = 1 .. C/2
        W   = T diag(beta e^gamma) K,  U = T diag(beta) V      the scales on T's columns (write_w_u)

    The inverse's products can run as bf16x3 (T = T_hi + T_lo in registers, the SMEM operand split
    the same way; three wgmmas, ~2^-16 relative: finer than the TF32 of the Triton kernel); W and U
    as bf16x2 (T diag(s) as a register hi / lo pair against the unscaled bf16 K / V tile); with
    ``KernelConfig.wy_precision="bf16"`` the doubling rounds' products take bf16 operands (one
    wgmma each, float32 accumulation), with ``"bf16_blocks"`` only the rounds inside the 16 x 16
    diagonal blocks (T_2 -> T_16); W, U and T's outputs keep the hi / lo pair.
    Returns ``w`` [BH, T, K], ``u`` [BH, T, V] (bf16) and ``aqk`` [BH, n, C, C] (bf16); with ``do``
    (the backward, :func:`gdn_jax.ops.pallas.hopper_bwd.wy_backward`) ``dvl`` = Aqk^T dO [BH, T, V]
    and T as ``t_hi``, ``t_lo`` [BH, n, C, C] (bf16, T = t_hi + t_lo to ~2^-16) instead of ``aqk``;
    with ``save_t`` (the forward of ``KernelConfig.save_wy``) ``t_hi``, ``t_lo`` besides ``aqk``.
    With ``t_form`` (``KernelConfig.fwd_form="t"``: the state pass forms Vn from T, v and the
    state; ``v`` is not read and may be None) ``aqk``, ``t_hi``, ``t_lo`` and, with ``with_w``,
    ``w`` (for the backward), no U.
    """
    plgpu = _plgpu()
    interp = call.platform == "interpret"
    C, K, V, BH, H, G, n, Tp = call.C, call.K, call.V, call.BH, call.H, call.group, call.n, call.Tp
    in_dt = jnp.dtype(call.in_dt)
    rs = lambda x: x.reshape(BH, n, C)
    # rows: beta, gamma (row-broadcast layout), beta e^gamma, gamma, beta (column-broadcast: W's and
    # U's scales on T's columns) -- an SMEM row is read in one register layout only: JAX 0.11's
    # layout inference finds no solution when one row feeds both layouts
    gates = jnp.stack([rs(beta), rs(gam), rs(beta) * rs(e_gam), rs(gam), rs(beta)], axis=2).astype(F32)
    scale = call.scale

    backward = do is not None
    blocked = call.wy_inverse == "blocked" and C % 16 == 0 and C >= 32
    # KernelConfig.wy_compact (the forward only): q's tile takes v once Q K^T has read q, Aqk's
    # staging tile is L's hi tile of the inverse's rounds once Aqk has left
    compact = (wy_compact(call) or t_form) and not backward
    has_v = not t_form  # fwd_form="t": no v (compact layout: q, k and the [C, C] tiles)
    # KernelConfig.wy_precision: bf16x3 products (else bf16) in the rounds inside the 16x16 diagonal
    # blocks (T_2 -> T_16) and in the rounds across them (T_16 -> T_64)
    hp_in, hp_across = call.wy_precision == "bf16x3", call.wy_precision != "bf16"

    # scratch tiles by name (T and L as bf16 hi / lo pairs; the lo tiles only where a product
    # uses them: with wy_precision="bf16" the rounds read none, and T's lo part leaves through L
    # hi's tile -- 20 KB less shared memory at C = 64)
    lo_in, lo_any = hp_in, hp_in or hp_across
    # T and L tiles with the blocked inverse in a 32-byte swizzle, so that a wgmma can contract over
    # 16-row slices of them (K = 16)
    sw = 32 if blocked else None
    cc = lambda: _smem((C, C), BF16, sw)
    # KernelConfig.wy_chunks_per_cta (the compact forward): m consecutive chunks per CTA, the next
    # chunk's q, k and gates arriving by TMA in a second slot while this one computes
    per = call.wy_per_cta if compact else 1
    S = 2 if per > 1 else 1  # TMA slots of q, k (and v), gates
    if compact:  # q's tile takes v, Aqk's staging tile is L hi's
        scratch = dict(q_s=_smem((S, C, K), in_dt), k_s=_smem((S, C, K), in_dt), l_hi=cc(), t_hi=cc())
    else:
        scratch = dict(q_s=_smem((S, C, K), in_dt), k_s=_smem((S, C, K), in_dt), v_s=_smem((S, C, V), in_dt),
                       a_s=_smem((C, C), BF16), l_hi=cc(), t_hi=cc())
    if lo_any:
        scratch.update(t_lo=cc(), l_lo=cc())
    scratch["g_s"] = plgpu.SMEM((S, 5, C), F32)
    if backward:
        scratch["do_s"] = _smem((C, V), in_dt)
    if blocked:  # the compressed rounds' T and L (hi, lo)
        scratch.update(tc_hi=_smem((C, 16), BF16), lc_hi=_smem((C, 16), BF16))
        if lo_in:
            scratch.update(tc_lo=_smem((C, 16), BF16), lc_lo=_smem((C, 16), BF16))
    scratch["bars"] = [plgpu.Barrier(num_barriers=S) for _ in range(5 if backward else 4)]  # one per source
    in_names = ["q_ref", "k_ref"] + (["v_ref"] if has_v else []) + ["g_ref"] + (["do_ref"] if backward else [])
    if t_form:
        out_names = ["a_ref", "thi_ref", "tlo_ref"] + (["w_ref"] if with_w else [])
    else:
        out_names = ["w_ref", "u_ref"] + (["dvl_ref", "thi_ref", "tlo_ref"] if backward else
                                          ["a_ref"] + (["thi_ref", "tlo_ref"] if save_t else []))

    def body(*refs):
        r = dict(zip(in_names + out_names + list(scratch), refs))
        r.setdefault("v_s", r["q_s"])  # compact
        r.setdefault("a_s", r["l_hi"])
        q_ref, k_ref, v_ref, g_ref, do_ref = (r.get(x) for x in ("q_ref", "k_ref", "v_ref", "g_ref", "do_ref"))
        q_s, k_s, v_s, g_s, do_s, bars = (r.get(x) for x in ("q_s", "k_s", "v_s", "g_s", "do_s", "bars"))
        bh = lax.axis_index("bh")
        b, h = lax.div(bh, _i32(H)), lax.rem(bh, _i32(H))
        hk = lax.div(h, _i32(G)) if G > 1 else h
        slot_refs = (q_s, k_s, v_s, g_s)

        def sources(c):
            rows = pl.ds(c * C, C)
            srcs = [q_ref.at[b, rows, hk], k_ref.at[b, rows, hk], v_ref.at[b, rows, h] if has_v else None,
                    g_ref.at[bh, c]]
            return srcs + ([do_ref.at[b, rows, h]] if backward else [])

        def issue(c, slot):  # the chunk's first copies (compact: v after Q K^T, into q's tile)
            srcs = sources(c)
            dsts = [x.at[slot] for x in slot_refs] + ([do_s] if backward else [])
            for i in (0, 1, 3) if compact else range(len(srcs)):
                plgpu.copy_gmem_to_smem(srcs[i], dsts[i], bars[i].at[slot])

        if per == 1:
            c = lax.axis_index("c")
            issue(c, 0)
            chunk_body(r, bh, c, 0, sources(c))
            return
        c0 = lax.axis_index("c") * _i32(per)
        issue(c0, 0)

        def step(t, carry):
            c, slot = c0 + t, lax.rem(t, _i32(2))

            @pl.when(c < n)
            def _():
                # the previous chunk's stores have read their tiles (its slot is the next one's)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                pl.when((t + 1 < per) & (c + 1 < n))(lambda: issue(c + 1, 1 - slot))
                chunk_body(r, bh, c, slot, sources(c))
            return carry

        lax.fori_loop(_i32(0), _i32(per), step, _i32(0))
        plgpu.wait_smem_to_gmem(0)

    def chunk_body(r, bh, c, slot, srcs):
        """One chunk of the WY kernel (``r``: the kernel's refs by name), its q, k (v) and gates
        tiles in ``slot``, ``srcs`` its GMEM sources."""
        w_ref, u_ref, a_ref, dvl_ref, thi_ref, tlo_ref, do_s, bars = (r.get(x) for x in (
            "w_ref", "u_ref", "a_ref", "dvl_ref", "thi_ref", "tlo_ref", "do_s", "bars"))
        a_s, t_hi, t_lo, l_hi, l_lo = (r.get(x) for x in ("a_s", "t_hi", "t_lo", "l_hi", "l_lo"))
        small = tuple(r.get(x) for x in ("tc_hi", "tc_lo", "lc_hi", "lc_lo"))
        rows = pl.ds(c * C, C)
        q_s, k_s, g_s = r["q_s"].at[slot], r["k_s"].at[slot], r["g_s"].at[slot]
        v_s = q_s if compact else r["v_s"].at[slot]
        bar = lambda i: bars[i].at[slot] if i < 4 else bars[i].at[0]
        for i in (0, 1, 3) if compact else range(4):
            plgpu.barrier_wait(bar(i))
        # Q K^T first, Aqk formed and stored, then K K^T: one [C, C] accumulator live at a time (185
        # registers instead of 196; H200 whole forward 0.274 -> 0.265 ms at 4x4096x16x128, 0.475 ->
        # 0.461 at 1x16384x16x128, results/hopper_h200/, measured
        # before W and U took T as t_hi + t_lo, a change not yet timed or checked on the GPU)
        (qk,) = _mmas([((C, C), q_s, _T(k_s))], interp)
        if compact and has_v:  # the wgmmas reading q have completed: v lands in its tile during the inverse
            plgpu.copy_gmem_to_smem(srcs[2], v_s, bar(2))
        i, j = _iota((C, C), 0, interp), _iota((C, C), 1, interp)
        row, col = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
        bcast_r = lambda x: lax.broadcast_in_dim(x, (C, C), [0])
        gam_r = _load(g_s.at[1], row, interp)
        dg = (bcast_r(gam_r) - lax.broadcast_in_dim(_load(g_s.at[3], col, interp), (C, C), [1]))
        lower, incl = i > j, i >= j
        beta_r = _load(g_s.at[0], row, interp)
        e = jnp.exp(jnp.where(incl, dg, 0.0))  # one exp for both: the strict lower part is A's
        aqk = jnp.where(incl, qk * (scale * e), 0.0)
        a_s[...] = aqk.astype(BF16)
        plgpu.commit_smem()
        if backward:  # dVl = Aqk^T dO; dO's tile then carries dVl out
            plgpu.barrier_wait(bar(4))
            (dvl,) = _mmas([((C, V), _T(a_s), do_s)], interp)
            do_s[...] = dvl.astype(do_s.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(do_s, dvl_ref.at[bh, rows])
        else:
            plgpu.copy_smem_to_gmem(a_s, a_ref.at[bh, c])
        (kk,) = _mmas([((C, C), k_s, _T(k_s))], interp)
        A = jnp.where(lower, kk * bcast_r(beta_r) * e, 0.0)
        # T = (I + A)^-1: T_2 exact, then T_2s = T_s - (T_s L_s) T_s with L_s the sub-diagonal s-blocks
        eye = jnp.where(i == j, 1.0, 0.0)
        T = eye - jnp.where(((i & 1) == 1) & (j == i - 1), A, 0.0)
        lg = 1
        if blocked:  # the rounds inside the 16x16 diagonal blocks on those blocks alone
            T = _blocked_rounds(A, T, i, j, C, interp, t_hi, *small, hp=hp_in)
            lg = 4
        if compact:  # l_hi is Aqk's staging tile: its store must have read it
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        if blocked and (1 << lg) < C:  # A to L's tiles once: each round masks T_s A instead of forming L_s
            ah, al = _split(A, hp_across)
            _round_tiles(hp_across, [((ah, al), (l_hi, l_lo))])
        while (1 << lg) < C:
            bi = i >> lg
            mask = ((bi & 1) == 1) & ((j >> lg) == bi - 1)  # L_s's blocks
            hp = hp_in if lg < 4 else hp_across
            th, tl = _split(T, hp)
            if blocked:  # contract only where the operand is nonzero: A's odd s-blocks of rows, P's even columns
                _round_tiles(hp, [((th, tl), (t_hi, t_lo))])
                sz = 1 << lg
                odd = [(sz * (2 * t + 1), sz) for t in range(C // (2 * sz))]
                even = [(2 * t * sz, sz) for t in range(C // (2 * sz))]
                # (T_s A) on the odd s-blocks' rows of A = T_s L_s on L_s's blocks (see _blocked_rounds)
                (P,) = _mmas([((C, C), *_k_slices(th, tl, l_hi, l_lo, odd))], interp)
                ph, pl_ = _split(-jnp.where(mask, P, 0.0), hp)
                (T,) = _mmas([(T, *_k_slices(ph, pl_, t_hi, t_lo, even))], interp)
            else:
                lh, ll = _split(jnp.where(mask, A, 0.0), hp)
                _round_tiles(hp, [((th, tl), (t_hi, t_lo)), ((lh, ll), (l_hi, l_lo))])
                (P,) = _mmas([((C, C), *_terms((th, tl), (l_hi, l_lo), hp))], interp)
                ph, pl_ = _split(-P, hp)
                (T,) = _mmas([(T, *_terms((ph, pl_), (t_hi, t_lo), hp))], interp)
            lg += 1
        if t_form:  # T (hi, lo) for the state pass (and the backward); W only where the backward reuses it
            th, tl = _split(T)
            tlo_s = l_hi if t_lo is None else t_lo  # the rounds' last wgmma reading L hi has completed
            t_hi[...], tlo_s[...] = th, tl
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(t_hi, thi_ref.at[bh, c])
            plgpu.copy_smem_to_gmem(tlo_s, tlo_ref.at[bh, c])
            if with_w:  # W = T diag(beta e^gamma) K, the scales on T's columns (see write_w_u)
                (Wm,) = _mmas([((C, K), scaled_t(T, _load(g_s.at[2], col, interp), C)(), (k_s, k_s))], interp)
                k_s[...] = Wm.astype(k_s.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(k_s, w_ref.at[bh, rows])
            plgpu.wait_smem_to_gmem(0)
            return
        # W = T diag(beta e^gamma) K, U = T diag(beta) V: the scales on T's columns (write_w_u), T
        # taken as its (hi, lo) pair's sum -- the T that the gradient kernel and wy_from_saved read
        th, tl = _split(T)
        T = th.astype(F32) + tl.astype(F32)
        if backward or save_t:  # T for the gradient kernel (and the backward's WY), as its (hi, lo) pair
            tlo_s = l_hi if t_lo is None else t_lo  # the rounds' last wgmma reading L hi has completed
            t_hi[...], tlo_s[...] = th, tl
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(t_hi, thi_ref.at[bh, c])
            plgpu.copy_smem_to_gmem(tlo_s, tlo_ref.at[bh, c])
        tw, tu = scaled_t(T, _load(g_s.at[2], col, interp), C), scaled_t(T, _load(g_s.at[4], col, interp), C)
        if compact:  # W leaves through K's tile, U through v's (q's), one after the other
            plgpu.barrier_wait(bar(2))
            write_w_u(tw, tu, k_s, v_s, k_s, w_ref.at[bh, rows], u_ref.at[bh, rows], C, K, V, interp,
                      sequential=True)
        else:
            write_w_u(tw, tu, k_s, v_s, q_s, w_ref.at[bh, rows], u_ref.at[bh, rows], C, K, V, interp,
                      sequential=max(K, V) > 128)  # K or V = 256: one [C, 128] accumulator at a time

    kw = _kernel_kw(call, "wy")  # KernelConfig.auto_barriers (see _sync)
    if t_form:
        out_type = [jax.ShapeDtypeStruct((BH, n, C, C), BF16)] * 3
        out_type += [jax.ShapeDtypeStruct((BH, Tp, K), in_dt)] if with_w else []
        fn = varying_kernel(plgpu.kernel, body, out_type=tuple(out_type), scratch_types=list(scratch.values()),
                            grid=(BH, pl.cdiv(n, per)), grid_names=("bh", "c"), **kw)
        return dict(zip(("aqk", "t_hi", "t_lo", "w"), fn(q, k, gates)))
    out_type = [jax.ShapeDtypeStruct((BH, Tp, K), in_dt), jax.ShapeDtypeStruct((BH, Tp, V), in_dt)]
    if backward:
        out_type += [jax.ShapeDtypeStruct((BH, Tp, V), in_dt)] + [jax.ShapeDtypeStruct((BH, n, C, C), BF16)] * 2
    else:
        out_type += [jax.ShapeDtypeStruct((BH, n, C, C), BF16)] * (3 if save_t else 1)
    fn = varying_kernel(plgpu.kernel, body, out_type=tuple(out_type), scratch_types=list(scratch.values()),
                        grid=(BH, pl.cdiv(n, per)), grid_names=("bh", "c"), **kw)
    if backward:
        w, u, dvl, t_hi, t_lo = fn(q, k, v, gates, do)
        return dict(w=w, u=u, dvl=dvl, t_hi=t_hi, t_lo=t_lo)
    if save_t:
        w, u, aqk, t_hi, t_lo = fn(q, k, v, gates)
        return dict(w=w, u=u, aqk=aqk, t_hi=t_hi, t_lo=t_lo)
    w, u, aqk = fn(q, k, v, gates)
    return dict(w=w, u=u, aqk=aqk)
