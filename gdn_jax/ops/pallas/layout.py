"""Block specs of the kernels' arrays and the one helper that builds and runs a ``pallas_call``
with named refs.

Layouts: token arrays (q, k, v, o, do, dq, dk, dv) are read in the caller's layout: ``"bthd"`` =
[B, T, H, D] with the head axis squeezed out of the block (GPU / CPU interpret; no transposes in
HBM) or ``"hm"`` = head-major [B*H, T, D] (TPU, where a block's last two dims must be divisible
by (8, 128) or equal the array's). The kernels' own arrays are head-major: W [BH, T, K],
U / Vn / dVl / dVn [BH, T, V], h_n / dh_n [BH, n, K, V]; per-token scalars are columns
[BH, T, 1], the in-chunk cumulative decay also a row [BH, n, 1, C], per-chunk scalars [BH, n, 1, 1].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .._vma import varying_struct
from . import platform as _plat
from .config import KernelCall


def token_spec(call: KernelCall, rows, cols, f, key: bool = False):
    """A token array in the caller's layout, block [rows, cols]; ``f(*grid) -> (bh, row_block,
    col_block)`` with bh the program's (batch, value head). ``key``: an array on the key heads
    (q, k), which grouped value heads share: value head h reads key head h // group through this
    index map, so q and k are never repeated in HBM."""
    H, G = call.H, call.group
    if call.layout == "bthd":
        if key and G > 1:
            def index_map(*g):
                bh, r, c = f(*g)
                return (bh // H, r, (bh % H) // G, c)
        else:
            def index_map(*g):
                bh, r, c = f(*g)
                return (bh // H, r, bh % H, c)

        return pl.BlockSpec((None, rows, None, cols), index_map)
    if key and G > 1:
        def index_map_hm(*g):  # truncating lax.div / rem (bh >= 0): Mosaic lowers floor division via sign
            bh, r, c = f(*g)
            # the constants in bh's dtype (int32): a Python int is int64 under jax_enable_x64 and lax.div
            # / rem take no mixed dtypes
            Hc, Gc, HGc = (lax.convert_element_type(x, bh.dtype) for x in (H, G, H // G))
            return (lax.div(bh, Hc) * HGc + lax.div(lax.rem(bh, Hc), Gc), r, c)

        return pl.BlockSpec((None, rows, cols), index_map_hm)
    return pl.BlockSpec((None, rows, cols), lambda *g: f(*g))


def token_shape(call: KernelCall, D, dtype):
    """ShapeDtypeStruct of a token array (o, dq, dk, dv) in the caller's layout."""
    shape = (call.BH // call.H, call.Tp, call.H, D) if call.layout == "bthd" else (call.BH, call.Tp, D)
    return sds(shape, dtype)


def hm_spec(rows, cols, f):
    """A head-major array [BH, T, D] (or a scalar column [BH, T, 1]), block [rows, cols]."""
    return pl.BlockSpec((None, rows, cols), lambda *g: f(*g))


def sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def run(call: KernelCall, body, *, name: str, grid, inputs: dict, outputs: dict, warps: int, scratch=None,
        semantics=None):
    """Build and run one ``pallas_call`` whose kernel takes its refs by name.

    ``inputs``: ``{name: (array, BlockSpec) or None}`` (None entries are left out: optional
    refs); ``outputs``: ``{name: (ShapeDtypeStruct, BlockSpec)}``. ``body`` is called as
    ``body(**{name + "_ref": ref})``, inputs then outputs, in the dicts' order. TPU only:
    ``scratch`` ``{name: pltpu.VMEM(...)}`` scratch buffers (kept across the grid's steps; passed
    last, by name) and ``semantics`` the grid's dimension semantics (default all "parallel").
    Returns ``{name: array}`` of the outputs.
    """
    ins = [(k, a, s) for k, v in inputs.items() if v is not None for a, s in (v,)]
    # typed varying like the inputs: under shard_map(check_vma=True) a pallas_call needs it
    outs = list((k, varying_struct(o, *[a for _, a, _ in ins]), s) for k, (o, s) in outputs.items())
    names = [k + "_ref" for k, _, _ in ins] + [k + "_ref" for k, _, _ in outs]
    extra = {}
    if scratch:
        names += [k + "_ref" for k in scratch]
        extra["scratch_shapes"] = list(scratch.values())

    def kernel(*refs):
        body(**dict(zip(names, refs)))

    blocks = [(s, a.dtype) for _, a, s in ins] + [(s, o.dtype) for _, o, s in outs]
    fn = pl.pallas_call(
        kernel,
        out_shape=[o for _, o, _ in outs],
        grid=tuple(grid),
        in_specs=[s for _, _, s in ins],
        out_specs=[s for _, _, s in outs],
        name=name,
        **extra,
        **_plat.call_kwargs(call.platform, num_warps=warps, num_stages=call.num_stages, n_grid=len(grid),
                            blocks=blocks, **({"semantics": semantics} if semantics else {})),
    )
    res = _plat.invoke(call.platform, fn, *[a for _, a, _ in ins])
    return dict(zip([k for k, _, _ in outs], res))
