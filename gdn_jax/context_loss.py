"""Training with the sequence sharded over devices (context parallelism) and the batch over
others: a loss function for :func:`gdn_jax.training.make_train_step` that runs the LM inside
``jax.shard_map`` over a mesh with a data axis and a sequence axis (docs/context_parallel.md)."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .training import IGNORE_INDEX, _ce_terms


def make_context_parallel_lm_loss(mesh: Mesh, *, data_axis: str = "data", seq_axis: str = "seq",
                                  ignore_index: int = IGNORE_INDEX) -> Callable:
    """``loss_fn(model, batch, key) -> (loss, {"accuracy": ...})`` like :func:`gdn_jax.training.lm_loss`
    (masked cross-entropy of ``model(inputs)`` against ``targets``), with ``inputs, targets [B, T]``
    split B over ``data_axis`` and T over ``seq_axis`` of ``mesh``: every device runs the LM on its
    ``[B / D, T / S]`` block (``LM(..., context_axis=seq_axis)``: exact, the recurrent layers
    exchange their state maps and conv halos), and the loss and accuracy are sums of the token
    terms and label counts over both axes (``psum``) divided once, so they equal the unsharded
    values to float32 rounding, as do the gradients (the parameters enter replicated; their
    gradients are summed over the mesh by ``shard_map``'s transpose).

    Pass it as ``make_train_step(graphdef, tx, loss_fn=make_context_parallel_lm_loss(mesh))``.

    Raises:
      ValueError: an axis that ``mesh`` has not; at call time, B not a multiple of the data
        axis's size or T of the sequence axis's.
    """
    for name, a in (("data_axis", data_axis), ("seq_axis", seq_axis)):
        if a not in mesh.shape:
            raise ValueError(f"{name}={a!r} is not an axis of the mesh {dict(mesh.shape)}")
    spec = P(data_axis, seq_axis)
    axes = (data_axis, seq_axis)

    def loss_fn(model, batch, key):
        inputs, targets = batch
        B, T = inputs.shape
        if B % mesh.shape[data_axis] or T % mesh.shape[seq_axis]:
            raise ValueError(f"batch [B, T] = {(B, T)}: B must be a multiple of {mesh.shape[data_axis]} (axis "
                             f"{data_axis!r}) and T of {mesh.shape[seq_axis]} (axis {seq_axis!r})")
        graphdef, state = nnx.split(model)

        def body(state, x, y):
            logits = nnx.merge(graphdef, state)(x, context_axis=seq_axis)
            ce, correct, mask = _ce_terms(logits, y, ignore_index)
            n = jnp.maximum(jax.lax.psum(mask.sum(), axes), 1)
            return jax.lax.psum(ce.sum(), axes) / n, jax.lax.psum(correct.sum(), axes) / n

        loss, acc = jax.shard_map(body, mesh=mesh, in_specs=(P(), spec, spec), out_specs=(P(), P()))(
            state, inputs, targets)
        return loss, {"accuracy": acc}

    return loss_fn
