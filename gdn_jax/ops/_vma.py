"""Varying-manual-axes bookkeeping for code that may run inside ``jax.shard_map``: a constant
that meets sharded values in a ``scan`` carry must be marked varying over the same axes."""
from __future__ import annotations

import jax


def varying_axes(x) -> set:
    """The ``shard_map`` axes ``x`` varies over (``aval.vma`` in some JAX versions,
    ``aval.mat.varying`` in others; empty outside ``shard_map``)."""
    t = jax.typeof(x)
    vma = getattr(t, "vma", None)
    if vma is None:
        vma = getattr(getattr(t, "mat", None), "varying", None)
    return set(vma or ())


def match_vma(x, *like):
    """``x`` marked varying over every ``shard_map`` axis that an array of ``like`` varies over
    (a constant start state of a ``scan`` whose body reads sharded inputs must be; a no-op
    outside ``shard_map`` or with ``check_vma=False``)."""
    vma = set()
    for y in like:
        vma |= varying_axes(y)
    missing = tuple(sorted(vma - varying_axes(x), key=str))
    if not missing:
        return x
    cast = getattr(jax.lax, "pcast", None)
    return cast(x, missing, to="varying") if cast is not None else jax.lax.pvary(x, missing)


def varying_struct(struct, *like):
    """``jax.ShapeDtypeStruct`` ``struct`` typed as varying over every ``shard_map`` axis that an
    array of ``like`` varies over: the ``out_shape`` of a ``pallas_call`` whose inputs are ``like``
    (under ``shard_map(..., check_vma=True)`` a ``pallas_call`` refuses an ``out_shape`` without the
    type). JAX 0.10 / 0.11 take ``manual_axis_type=jax.sharding.ManualAxisType(varying=...)``,
    earlier versions ``vma=``; outside ``shard_map`` (or with ``check_vma=False``) the type is
    not read."""
    vma = set()
    for y in like:
        vma |= varying_axes(y)
    mat = getattr(jax.sharding, "ManualAxisType", None)
    if mat is not None:
        return jax.ShapeDtypeStruct(struct.shape, struct.dtype, manual_axis_type=mat(varying=frozenset(vma)))
    try:
        return jax.ShapeDtypeStruct(struct.shape, struct.dtype, vma=frozenset(vma))
    except TypeError:  # a JAX without varying-axes types
        return struct


def varying_kernel(kernel, body, *, out_type, **kw):
    """``kernel(body, out_type=out_type, **kw)`` (Mosaic GPU's ``plgpu.kernel``) built when it is
    called, its outputs typed varying like the arrays it is called with, so that it runs under
    ``jax.shard_map(..., check_vma=True)``; elsewhere the same call. ``plgpu.kernel`` (JAX 0.10,
    0.11) traces with the check off and returns untyped (invariant) outputs whatever ``out_type``
    says: they are cast (``pcast`` / ``pvary``, no data movement) after the call, and ``out_type``
    is typed too (:func:`varying_struct`) for a JAX that reads it. Use inside a ``custom_vjp``
    rule only (the kernels' outputs are never differentiated: the cast's transpose, a sum over the
    axes, would be wrong for them)."""
    is_struct = lambda x: isinstance(x, jax.ShapeDtypeStruct)

    def call(*args):
        typed = jax.tree.map(lambda s: varying_struct(s, *args) if is_struct(s) else s, out_type, is_leaf=is_struct)
        outs = kernel(body, out_type=typed, **kw)(*args)
        return jax.tree.map(lambda x: match_vma(x, *args), outs)

    return call
