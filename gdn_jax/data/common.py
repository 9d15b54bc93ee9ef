"""What every synthetic task of :mod:`gdn_jax.data` shares: the batch type, the label convention,
argument checks and pure seed derivation.

Label convention ("predict at position t", already shifted): ``targets[b, t]`` is what the model
must output at position ``t`` (the prediction of the next token), or :data:`IGNORE_INDEX` (-100)
where position ``t`` is not scored. A causal LM's ``logits[:, t]`` are scored against
``targets[:, t]`` with no further shift (:func:`gdn_jax.training.masked_cross_entropy`).
"""
from __future__ import annotations

import numbers
from typing import NamedTuple, Union

import numpy as np

__all__ = ["IGNORE_INDEX", "SeedLike", "TaskBatch", "check_int", "check_seed", "child"]

#: Target value at positions that carry no label (PyTorch / Zoology convention).
IGNORE_INDEX: int = -100

SeedLike = Union[int, np.integer, np.random.SeedSequence]


class TaskBatch(NamedTuple):
    """A batch of examples of a synthetic task (a NamedTuple, hence also a JAX pytree).

    Attributes:
      inputs: ``int32 [B, L]`` input token ids in ``[0, model_vocab_size)``.
      targets: ``int32 [B, L]``; ``targets[b, t]`` is the label of the prediction made at
        position ``t``, :data:`IGNORE_INDEX` (-100) where nothing is scored.
    """

    inputs: np.ndarray
    targets: np.ndarray

    @property
    def num_examples(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def query_mask(self) -> np.ndarray:
        """``bool [B, L]``: True exactly at the labelled (scored) positions."""
        return self.targets != IGNORE_INDEX


def check_int(name: str, value) -> int:
    """``value`` as a Python int; ``TypeError`` naming ``name`` for bools, floats and non-integers."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} of type {type(value).__name__}")
    return int(value)


def check_seed(seed) -> np.random.SeedSequence:
    """A :class:`numpy.random.SeedSequence` from a non-negative int (or the sequence itself)."""
    if isinstance(seed, np.random.SeedSequence):
        return seed
    seed = check_int("seed", seed)
    if seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got seed={seed}")
    return np.random.SeedSequence(seed)


def child(ss: np.random.SeedSequence, *key: int) -> np.random.SeedSequence:
    """Pure (non-mutating) equivalent of a spawned child with ``spawn_key + key``."""
    return np.random.SeedSequence(ss.entropy, spawn_key=tuple(ss.spawn_key) + tuple(key), pool_size=ss.pool_size)
