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

__all__ = ["IGNORE_INDEX", "MAX_TOKEN_ID", "SeedLike", "TaskBatch", "check_int", "check_seed", "check_token_count",
           "child"]

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


MAX_TOKEN_ID = 2 ** 31 - 1  # token ids are int32


def check_token_count(name: str, value: int) -> int:
    """A vocabulary size (or modulus) whose ids fit int32: ValueError naming ``name`` above 2**31 - 1."""
    if value > MAX_TOKEN_ID:
        raise ValueError(f"{name} must be <= 2**31 - 1 (token ids are int32), got {name}={value}")
    return value


def check_seed(seed, *, allow_sequence: bool = True) -> np.random.SeedSequence:
    """A :class:`numpy.random.SeedSequence` from a non-negative int (or, with ``allow_sequence``,
    the sequence itself; task configs take ints only: their seed is written to results.json)."""
    if isinstance(seed, np.random.SeedSequence):
        if allow_sequence:
            return seed
        raise TypeError(f"seed must be a non-negative int here (a task config's seed), got {seed!r}")
    seed = check_int("seed", seed)
    if seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got seed={seed}")
    return np.random.SeedSequence(seed)


def child(ss: np.random.SeedSequence, *key: int) -> np.random.SeedSequence:
    """Pure (non-mutating) equivalent of a spawned child with ``spawn_key + key``."""
    return np.random.SeedSequence(ss.entropy, spawn_key=tuple(ss.spawn_key) + tuple(key), pool_size=ss.pool_size)
