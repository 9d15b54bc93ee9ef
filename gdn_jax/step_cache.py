"""Compiled train and eval steps shared by the runs of one process.

Every :func:`gdn_jax.recall.run` used to build and compile its own ``jax.jit`` train and eval steps;
in a sweep, the runs of one cell at several learning rates (or seeds) compiled the same program again
(on the CPU most of a small sweep's time). :func:`shared_steps` keeps the last
:data:`MAX_ENTRIES` pairs of steps, keyed by what the compiled program depends on -- the model's
graph definition (``nnx.GraphDef``: mixer, sizes, backend, ...), the device mesh, the number of
scored labels and the optimizer settings other than the learning rate -- so a run of the same
shapes reuses them: jit finds its compiled executable for the same argument shapes. The learning
rate enters as an argument (:func:`gdn_jax.training.make_train_step` with ``lr_arg``), the
optimizer being built at rate 1; seeds change only the data and the initial state.
"""
from __future__ import annotations

import collections
from typing import Any, Callable, Mapping, Optional, Tuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from gdn_jax import training as T

__all__ = ["MAX_ENTRIES", "clear", "shared_steps"]

#: Step pairs kept (least recently used dropped first): a sweep runs a cell's rates one after the other.
MAX_ENTRIES = 4

_CACHE: "collections.OrderedDict[Any, Tuple[Callable, Callable]]" = collections.OrderedDict()


def clear() -> None:
    """Forget every shared step (their executables are freed once no run holds them)."""
    _CACHE.clear()


def shared_steps(graphdef: nnx.GraphDef, mesh: Mesh, *, lr: float, optimizer: Mapping[str, Any],
                 max_scored: Optional[int]) -> Tuple[Callable, Callable]:
    """``(train_step(state, batch) -> (state, metrics), eval_step(state, batch) -> sums)`` for a
    model of ``graphdef`` on ``mesh``, trained with ``make_optimizer(lr, **optimizer)``; the
    compiled programs are shared with every earlier call of equal ``graphdef``, ``mesh``,
    ``optimizer`` and ``max_scored`` (the last :data:`MAX_ENTRIES` kept).

    Args:
      graphdef: the model's graph definition (``nnx.split``; equal for models of equal configs).
      mesh: the data-parallel mesh (:func:`gdn_jax.training.make_mesh`).
      lr: the peak learning rate of this run (passed to the shared step as an argument).
      optimizer: the keyword arguments of :func:`gdn_jax.training.make_optimizer` but ``lr``
        (their values hashable).
      max_scored: the loss's and evaluation's sparse head (:func:`gdn_jax.training.make_lm_loss`),
        or None for the dense one.

    Raises:
      TypeError / ValueError: as :func:`gdn_jax.training.make_optimizer` for bad settings
        (``lr`` checked like the schedule's peak rate).
    """
    T._finite("lr", lr, low=0.0, strict=True)  # make_schedule's check of the peak rate
    key = (graphdef, mesh, max_scored, tuple(sorted(optimizer.items())))
    steps = _CACHE.get(key)
    if steps is None:
        unit = T.make_optimizer(1.0, **optimizer)
        steps = (T.make_train_step(graphdef, unit, mesh, loss_fn=T.make_lm_loss(max_scored), lr_arg=True),
                 T.make_eval_step(graphdef, mesh, max_scored=max_scored))
        _CACHE[key] = steps
        while len(_CACHE) > MAX_ENTRIES:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    train, evaluate = steps
    rate = jax.device_put(np.float32(lr), T.replicated(mesh))

    def train_step(state: T.TrainState, batch):
        return train(state, batch, rate)

    return train_step, evaluate
