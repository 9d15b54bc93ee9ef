"""The Pallas kernels keep the batch and head sharding of their inputs under ``jax.jit``.

A ``pallas_call`` is opaque to XLA's SPMD partitioner: left alone, it replicates the kernels'
operands (all-gathers) and runs the whole batch on every device. :func:`run_sharded` wraps a
kernel entry point -- the forward and backward kernels of :mod:`.vjp`, the decode step of
:mod:`.decode` -- in a ``jax.experimental.custom_partitioning`` whose rule says which axes are
independent: the batch axis and the head axis are partitioned as the inputs carry them, every
other axis (time, head dims, per-chunk flags) is replicated. Each device then runs the kernels on
its own block of batch rows and heads; nothing is gathered and the outputs keep the inputs'
sharding.

Labels (one character per axis of an array): ``"b"`` batch; ``"h"`` key heads; ``"v"`` value
heads, ``group`` per key head, key-major (value head j reads key head ``j // group``), so a device
holding key heads ``[a, b)`` holds value heads ``[a * group, b * group)``; ``"."`` an axis that is
not split; a trailing ``"*"``: every remaining axis ``"."``. The head axis is split only along the
key heads (the factor ``group`` stays whole), batch and heads only by mesh axes whose size divides
them (others are gathered first, as XLA would).

Where nothing is partitioned (one device; inside a ``shard_map`` that is manual over every mesh
axis) the wrapper is inlined at lowering: the same program as without it. Under ``jax.vmap`` the
kernels run as before (the vmapped axis is a batch of the kernel call, unpartitioned):
``custom_partitioning`` has no batching rule, so the call is wrapped in a
``jax.custom_batching.custom_vmap`` that batches the unwrapped entry point.

Both partitioners are served: Shardy (the default in JAX 0.10 / 0.11) through the
``sharding_rule``, GSPMD through ``infer_sharding_from_operands``.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional, Sequence, Tuple

import jax
import numpy as np
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import ArrayMapping, CompoundFactor, SdyShardingRule, custom_partitioning
from jax.sharding import Mesh, NamedSharding, PartitionSpec

LABELS = "bhv.*"


class _Call:
    """What the callbacks of one wrapped call read (static; hashed by identity): the entry point,
    its static argument, the labels and the group size, and the output labels, resolved against
    the output ranks when the call is traced."""

    def __init__(self, fn, static, in_labels, out_labels, group, heads):
        self.fn, self.static = fn, static
        self.in_labels, self.out_templates = tuple(in_labels), tuple(out_labels)
        self.group, self.heads = int(group), heads
        self.out_labels = None

    def run(self, *args):
        outs = tuple(self.fn(self.static, *args))
        if len(outs) != len(self.out_templates):
            raise ValueError(f"{getattr(self.fn, '__name__', self.fn)} returned {len(outs)} arrays, "
                             f"{len(self.out_templates)} output labels were given")
        self.out_labels = tuple(_resolve(lab, x.ndim) for lab, x in zip(self.out_templates, outs))
        return outs


def _resolve(labels: str, ndim: int) -> str:
    """``labels`` for an array of rank ``ndim`` (a trailing ``"*"`` fills the rest with ``"."``)."""
    if labels.endswith("*"):
        labels = labels[:-1] + "." * max(0, ndim - len(labels) + 1)
    if len(labels) != ndim or any(c not in LABELS[:-1] for c in labels):
        raise ValueError(f"sharding labels {labels!r} do not fit an array of rank {ndim}")
    return labels


def _rule(call: _Call, *_):
    """The Shardy rule: factors ``b``, ``h`` (and ``g`` in the compound ``(h g)`` of grouped value
    heads, kept whole); every other axis its own factor that needs replication. (JAX passes the
    mesh and the operand / result types after ``call``: not needed.)"""
    counter = [0]
    replicated = []  # in the order the factors first appear (Shardy wants them sorted)

    def mapping(labels):
        out = []
        for c in labels:
            if c == "b":
                out.append("b")
            elif c == "h" or (c == "v" and call.group == 1):
                out.append("h")
            elif c == "v":
                out.append(CompoundFactor("h", "g"))
                if "g" not in replicated:
                    replicated.append("g")  # value heads of one key head stay on one device
            else:
                name = f"r{counter[0]}"
                counter[0] += 1
                replicated.append(name)
                out.append(name)
        return ArrayMapping(*out)

    operands = tuple(mapping(x) for x in call.in_labels)
    results = tuple(mapping(x) for x in call.out_labels)
    sizes = {}
    if call.group > 1:
        sizes["g"] = call.group
        if "h" not in "".join(call.in_labels + call.out_labels):
            sizes["h"] = call.heads
    return SdyShardingRule(operands, results, need_replication_factors=tuple(replicated), **sizes)


def _entry_axes(entry) -> Tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _shardings(call: _Call, mesh, arg_shapes, result_labels):
    """(mesh, argument shardings, result shardings): batch and head axes as the arguments carry
    them (the first argument with that axis decides), every other axis replicated."""
    args = list(arg_shapes)
    named = [a.sharding for a in args if isinstance(a.sharding, NamedSharding)]
    if named:
        mesh = named[0].mesh
    if mesh is None or mesh.empty:  # no mesh to name axes on: replicate (correct, not partitioned)
        devices = sorted({d for a in args for d in a.sharding.device_set}, key=lambda d: d.id)
        mesh = Mesh(np.array(devices), ("_all",))
    if len(named) != len(args) or any(s.mesh.shape_tuple != mesh.shape_tuple for s in named):
        named = []

    def axes_of(kinds):
        """The mesh axes of the first argument axis labelled one of ``kinds`` (key heads: a
        ``"v"`` axis holds ``group`` value heads per key head), () where they do not divide it."""
        if not named:
            return ()
        for a, labels in zip(args, call.in_labels):
            for j, c in enumerate(labels):
                if c in kinds:
                    ax = _entry_axes(a.sharding.spec[j] if j < len(a.sharding.spec) else None)
                    size = a.shape[j] // (call.group if c == "v" else 1)
                    return ax if ax and size % math.prod(mesh.shape[x] for x in ax) == 0 else ()
        return ()

    b_axes = axes_of("b")
    h_axes = axes_of("hv")
    if set(h_axes) & set(b_axes):  # one mesh axis cannot split both
        h_axes = ()

    def spec(labels):
        entries = []
        for c in labels:
            ax = b_axes if c == "b" else h_axes if c in "hv" else ()
            entries.append(None if not ax else ax[0] if len(ax) == 1 else ax)
        return NamedSharding(mesh, PartitionSpec(*entries))

    return mesh, tuple(spec(x) for x in call.in_labels), tuple(spec(x) for x in result_labels)


def _partition(call: _Call, mesh, arg_shapes, result_shape):
    mesh, arg_sh, res_sh = _shardings(call, mesh, arg_shapes, call.out_labels)

    def lower_fn(*local_args):
        return tuple(call.fn(call.static, *local_args))

    return mesh, lower_fn, res_sh, arg_sh


def _infer(call: _Call, mesh, arg_shapes, result_shape):
    return _shardings(call, mesh, arg_shapes, call.out_labels)[2]


@functools.lru_cache(maxsize=None)
def _partitioned():
    cp = custom_partitioning(lambda call, *args: call.run(*args), static_argnums=(0,))
    cp.def_partition(partition=_partition, infer_sharding_from_operands=_infer, sharding_rule=_rule)
    return cp


def run_sharded(fn: Callable, static, args: Sequence[jax.Array], in_labels: Sequence[str],
                out_labels: Sequence[str], *, group: int = 1, heads: Optional[int] = None,
                interpreted: bool = False):
    """``fn(static, *args)`` (a tuple of arrays), partitioned over the batch and head axes.

    Args:
      fn: the entry point; called with ``static`` and arrays of any block of batch rows and key
        heads (its value heads with them), it must compute that block alone and read the block's
        sizes from its arrays' shapes.
      static: a hashable value passed through unchanged.
      args: the arrays.
      in_labels, out_labels: one label string per argument / output (see the module docstring).
      group: value heads per key head (``"v"`` axes).
      heads: the number of key heads, needed only when no array has an ``"h"`` axis and
        ``group > 1``.
      interpreted: the kernels run in an interpreter (CPU). Interpreters that keep state through
        ordered callbacks (TPU semantics, Mosaic GPU) cannot run inside ``custom_partitioning``
        (its primitive carries no effects): for these calls (found by tracing ``fn`` once, hence
        only where asked) ``fn`` runs unwrapped, as without sharding rules.

    In a process with one device (``jax.device_count() == 1``) ``fn`` runs unwrapped: nothing can
    be partitioned there, and the one-device program stays exactly the kernels' own.

    Returns:
      ``fn(static, *args)`` as a tuple; under ``jit`` over several devices each output keeps the
      batch and head sharding of the arguments.

    Raises:
      ValueError: a label string that does not fit its array, or a different number of outputs
        than ``out_labels``.
    """
    args = tuple(args)
    if len(in_labels) != len(args):
        raise ValueError(f"{len(args)} arguments, {len(in_labels)} label strings")
    labels = tuple(_resolve(lab, x.ndim) for lab, x in zip(in_labels, args))
    if jax.device_count() == 1:  # one device: nothing to partition; the entry point runs as it is
        return tuple(fn(static, *args))
    if interpreted:
        closed = jax.make_jaxpr(lambda *a: tuple(fn(static, *a)))(*args)
        if closed.effects:  # the traced entry point itself (no second trace of ``fn``) where JAX has eval_jaxpr
            run = getattr(jax.core, "eval_jaxpr", None)
            return tuple(run(closed.jaxpr, closed.consts, *args) if run else fn(static, *args))

    def call_partitioned(*a):
        return _partitioned()(_Call(fn, static, labels, out_labels, group, heads), *a)

    wrapped = custom_vmap(call_partitioned)

    @wrapped.def_vmap
    def _batched(axis_size, in_batched, *a):  # the unwrapped entry point, batched as before
        axes = [0 if b else None for b in in_batched]
        outs = jax.vmap(lambda *x: tuple(fn(static, *x)), in_axes=axes)(*a)
        return outs, (True,) * len(outs)

    return wrapped(*args)
