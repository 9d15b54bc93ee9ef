"""Shared Mosaic GPU helpers of the Hopper (sm_90) kernels of this package: the ``plgpu`` module
and ``plgpu.kernel``'s keyword arguments (interpret mode, ``approx_math``, the kernels' own
barriers), swizzled shared-memory tiles, wgmma groups (:func:`mmas`, which interpret mode computes
with ``jnp``), bf16 (hi, lo) splits, TMA tile loads / stores, slot barriers and the state passes'
per-chunk scalar row.

On CPU the kernels run in Mosaic GPU's interpret mode (``platform="interpret"``): their data
movement (TMA slots, barriers, indexing) is interpreted and their matmuls computed with ``jnp``
(the interpreter has no transposed wgmma operands nor register layouts), so CI checks the
kernels' logic; the wgmma lowering itself is checked by ``jax.export(..., platforms=["cuda"])``.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..call import KernelCall

F32, BF16 = jnp.float32, jnp.bfloat16


def plgpu_api():
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return plgpu


def interpret_params():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def kernel_kw(call: KernelCall, kernel: Optional[str] = None) -> dict:
    """``plgpu.kernel``'s keyword arguments for ``call``: Mosaic GPU's interpreter (platform
    "interpret") or, on a GPU, compiler params: with ``HopperTuning.approx_math`` exp lowered to
    ``ex2.approx.ftz`` (a multiply and one instruction instead of libdevice's range reduction);
    ``unsafe_no_auto_barriers`` for ``kernel`` (one of hopper.tuning.OWN_BARRIER_KERNELS: "wy", "state",
    "reverse", "grads", kernels that can place their own barriers, see :func:`sync_own_barriers`) where
    ``HopperTuning.auto_barriers`` resolved to leave out Pallas' barriers (``call.own_barriers``)."""
    if call.platform == "interpret":
        return dict(interpret=interpret_params())
    kw = dict(approx_math=True) if call.approx_math else {}
    if kernel is not None and kernel in call.own_barriers:
        kw["unsafe_no_auto_barriers"] = True
    return dict(compiler_params=plgpu_api().CompilerParams(**kw)) if kw else {}


def sync_own_barriers(call: KernelCall, kernel: str):
    """The warpgroup barrier that Pallas' automatic barriers would have put before the next store to
    shared memory, where the data flow may need it (``kernel`` in ``call.own_barriers``): where a
    warpgroup's threads read a tile with thread loads and then overwrite it. ``commit_smem`` (a fence
    and a ``bar.sync``); nothing with the automatic barriers or in interpret mode. Not needed after
    ``wait_smem_to_gmem``: Mosaic GPU ends that wait with a warpgroup ``bar.sync`` itself
    (``LaunchContext.await_async_copy``, JAX 0.10 and 0.11), so threads that overwrite a tile after
    it know the TMA store has read it. Where a tile is refilled by TMA, every thread read of it
    comes before a ``commit_smem`` that precedes the refill."""
    if kernel in call.own_barriers and call.platform != "interpret":
        plgpu_api().commit_smem()


def smem_transforms(dtype, cols, swizzle=None):
    """Tiling + swizzle of a [rows, cols] SMEM tile (wgmma operands and TMA destinations): the
    widest swizzle the row allows, or ``swizzle`` bytes (the two operands of a wgmma must agree)."""
    plgpu = plgpu_api()
    item = jnp.dtype(dtype).itemsize
    sw = swizzle or plgpu.find_swizzle(cols * item * 8)
    return (plgpu.TilingTransform((8, sw // item)), plgpu.SwizzleTransform(sw))


def smem(shape, dtype, swizzle=None):
    return plgpu_api().SMEM(tuple(shape), jnp.dtype(dtype), transforms=smem_transforms(dtype, shape[-1], swizzle))


def load_tile(ref, layout, interp):
    """An SMEM tile into registers with the given layout (interpret mode: a plain read)."""
    return ref[...] if interp else plgpu_api().load(ref, (), layout=layout)


class Transposed:
    """A transposed SMEM operand of :func:`mmas` (A or B)."""

    def __init__(self, ref):
        self.ref = ref


def wgmma_operand(x):
    return plgpu_api().transpose_ref(x.ref, (1, 0)) if isinstance(x, Transposed) else x


def mmas(specs, interp, between=None):
    """Issue the wgmmas ``acc_i (+)= a_i @ b_i`` together, wait, return the accumulators.

    ``specs``: (init, a, b) with ``init`` an (M, N) shape (zero accumulator) or a float32 array in
    the wgmma layout (accumulate onto it); ``a`` an SMEM ref, a 16-bit array in the wgmma layout
    (registers) or a tuple of such terms (summed into one accumulator); ``b`` an SMEM ref or
    ``Transposed(ref)`` (transposed; 16-bit only; float32 operands run as TF32 and need B transposed).
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
                av, bv = (load_any(x) for x in (a, b))
                r = r + jnp.dot(av.astype(F32), bv.astype(F32), preferred_element_type=F32)
            out.append(r if isinstance(init, tuple) else init + r)
        return tuple(out)
    plgpu = plgpu_api()

    def issue(accs):
        for acc, (_, As, Bs) in zip(accs, norm):
            for a, b in zip(As, Bs):
                plgpu.wgmma(acc, wgmma_operand(a), wgmma_operand(b))
        if between is not None:
            between()

    if all(isinstance(x, tuple) for x, *_ in specs):
        def scoped(*accs):
            issue(accs)
            return tuple(a[...] for a in accs)

        return pl.run_scoped(scoped, *[plgpu.ACC(x, F32) for x, *_ in specs])
    if any(isinstance(x, tuple) for x, *_ in specs):
        raise ValueError("mmas: all accumulators zero-initialised or all initialised")
    return pl.run_state(issue)(tuple(plgpu.ACC.init(x) for x, *_ in specs))


def load_any(x):
    """Interpret mode: the value of an operand (array, ref or transposed ref)."""
    if isinstance(x, Transposed):
        return x.ref[...].T
    if isinstance(x, jax.Array) or not hasattr(x, "at"):
        return x
    return x[...]


def iota(shape, dim, interp):
    if interp:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    plgpu = plgpu_api()
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def split_hi_lo(x, lo=True):
    """float32 -> (hi, lo) bfloat16 with hi + lo = x to ~2^-16 relative (bf16x3 products); with
    ``lo=False`` (``HopperTuning.wy_precision="bf16"``) (hi, None)."""
    hi = x.astype(BF16)
    return hi, (x - hi.astype(F32)).astype(BF16) if lo else None


def tile_in(src, tile, bar, interp):
    """A GMEM block into the staging ``tile`` by TMA (once the tile's last TMA store has read it),
    then into registers in the wgmma layout: the state passes' initial-state loads."""
    plgpu = plgpu_api()
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    plgpu.copy_gmem_to_smem(src, tile, bar)
    plgpu.barrier_wait(bar)
    return load_tile(tile, plgpu.Layout.WGMMA, interp)


def tile_out(x, tile, dst):
    """Registers ``x`` through the staging ``tile`` to ``dst`` by TMA (the store waits until the tile's
    last TMA store has read it, and is committed before the copy): o and final-state stores."""
    plgpu = plgpu_api()
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    tile[...] = x.astype(tile.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(tile, dst)


def i32(x):
    """A Python int as an int32 scalar: grid and loop indices are int32, and lax.div / rem want
    equal dtypes (a bare Python int becomes int64 under ``jax_enable_x64``)."""
    return jnp.int32(x)


def wait_slot_copies(bars, slot):
    """Wait for every TMA copy into ``slot`` of the double-buffered tiles (one barrier pair each)."""
    for bar in bars:
        plgpu_api().barrier_wait(bar.at[slot])


def slot_flags(g_s, slot):
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


def hi_lo_terms(a, b, hp):
    """The (As, Bs) terms of ``A @ B`` for :func:`mmas` from A's and B's (hi, lo) pairs: bf16x3
    (hi hi + lo hi + hi lo) with ``hp``, else the hi product alone (the lo parts may be None)."""
    return ((a[0], a[1], a[0]), (b[0], b[0], b[1])) if hp else ((a[0],), (b[0],))


def zero_acc(shape, interp):
    z = jnp.zeros(shape, F32)
    return z if interp else plgpu_api().layout_cast(z, plgpu_api().Layout.WGMMA)
