"""Task-generic seeding, test/train sets and the resumable training-batch loader.

A *task config* (:class:`~gdn_jax.data.MQARConfig`, :class:`~gdn_jax.data.NIAHConfig`,
:class:`~gdn_jax.data.StateTrackingConfig`) is a frozen dataclass with ``seed``, ``test_examples``,
``model_vocab_size``, ``chance`` and ``generate(num_examples, seed, *, split)``; tasks with a
fixed training set (MQAR, the Zoology protocol of Arora et al. 2023) also have ``train_examples``.
Each also carries its task-specific facts: ``name`` (the ``RecallConfig.task`` value), ``title``,
``label``, ``max_labels`` and ``metric`` (:data:`gdn_jax.data.TASK_CONFIGS`).

Seeding (all seeds are :class:`numpy.random.SeedSequence` nodes with entropy ``cfg.seed``):

* test set:               ``SeedSequence(seed, spawn_key=(1,))``
* fixed training set:     ``SeedSequence(seed, spawn_key=(0, 0))``
* stream batch at step s: ``SeedSequence(seed, spawn_key=(0, 1, s))``
* epoch-e shuffle order:  ``SeedSequence(seed, spawn_key=(0, 2, e))``
"""
from __future__ import annotations

import threading
from typing import Iterator

import numpy as np

from gdn_jax.data.common import TaskBatch, check_int as _check_int

__all__ = ["TaskLoader", "make_test_set", "make_train_set", "seed_epoch_shuffle", "seed_stream_batch",
           "seed_test_set", "seed_train_set"]


def seed_test_set(cfg) -> np.random.SeedSequence:
    """Seed of the test set: ``SeedSequence(cfg.seed, spawn_key=(1,))``."""
    return np.random.SeedSequence(cfg.seed, spawn_key=(1,))


def seed_train_set(cfg) -> np.random.SeedSequence:
    """Seed of the fixed training set: ``SeedSequence(cfg.seed, spawn_key=(0, 0))``."""
    return np.random.SeedSequence(cfg.seed, spawn_key=(0, 0))


def seed_stream_batch(cfg, step: int) -> np.random.SeedSequence:
    """Seed of the stream-mode batch at global ``step``: ``spawn_key=(0, 1, step)``."""
    return np.random.SeedSequence(cfg.seed, spawn_key=(0, 1, int(step)))


def seed_epoch_shuffle(cfg, epoch: int) -> np.random.SeedSequence:
    """Seed of the fixed-mode shuffle of ``epoch``: ``spawn_key=(0, 2, epoch)``."""
    return np.random.SeedSequence(cfg.seed, spawn_key=(0, 2, int(epoch)))


def make_test_set(cfg) -> TaskBatch:
    """The held-out test set: ``cfg.test_examples`` examples (default 1000), seed :func:`seed_test_set`."""
    return cfg.generate(cfg.test_examples, seed_test_set(cfg), split="test")


def make_train_set(cfg) -> TaskBatch:
    """The fixed training set of the Zoology protocol: ``cfg.train_examples`` examples, seed :func:`seed_train_set`."""
    return cfg.generate(cfg.train_examples, seed_train_set(cfg), split="train")


class TaskLoader:
    """Resumable training-batch iterator for any task of :mod:`gdn_jax.data` (MQAR, NIAH, state tracking).

    Modes:
      ``"fixed"``: the fixed training set :func:`make_train_set` (generated
        lazily on first use and cached), iterated in epochs of
        ``steps_per_epoch = cfg.train_examples // batch_size`` steps (the last
        partial batch of an epoch is dropped). Epoch ``e`` visits the examples
        in the order ``default_rng(seed_epoch_shuffle(cfg, e)).permutation(n)``.
      ``"stream"``: fresh examples every step; step ``s`` is
        ``cfg.generate(batch_size, seed_stream_batch(cfg, s), split="train")``
        (every task; NIAH and state tracking have no fixed set).

    In both modes :meth:`batch` is a pure function of ``(cfg, batch_size,
    mode, step)``, so a run resumed at step ``s`` sees exactly the same data as
    an uninterrupted one. Iterating the loader yields ``batch(start_step)``,
    ``batch(start_step + 1)``, ... without end.

    Args:
      cfg: the task configuration.
      batch_size: examples per batch (``<= cfg.train_examples`` in fixed mode).
      mode: ``"fixed"`` or ``"stream"``.
      start_step: first global step produced by ``iter(loader)``.
    """

    MODES = ("fixed", "stream")

    def __init__(self, cfg, batch_size: int, *, mode: str = "fixed", start_step: int = 0):
        if isinstance(cfg, type) or not callable(getattr(cfg, "generate", None)) or not hasattr(cfg, "seed"):
            raise TypeError(f"cfg must be a task config (MQARConfig, NIAHConfig, StateTrackingConfig, ...), "
                            f"got {type(cfg).__name__}")
        if mode == "fixed" and not hasattr(cfg, "train_examples"):
            raise ValueError(f"mode='fixed' needs a task with a fixed training set (train_examples); "
                             f"{type(cfg).__name__} has none: use mode='stream'")
        batch_size = _check_int("batch_size", batch_size)
        start_step = _check_int("start_step", start_step)
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got mode={mode!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got batch_size={batch_size}")
        if mode == "fixed" and batch_size > cfg.train_examples:
            raise ValueError(
                f"batch_size={batch_size} exceeds the fixed training set, train_examples={cfg.train_examples} "
                f"(mode='fixed' draws each batch from that set)"
            )
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got start_step={start_step}")
        self.cfg = cfg
        self.batch_size = batch_size
        self.mode = mode
        self.start_step = start_step
        self._train: TaskBatch | None = None
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None
        self._perm_lock = threading.Lock()  # batch() may run in several prefetch threads

    @property
    def steps_per_epoch(self) -> int | None:
        """Steps per pass over the fixed training set (``None`` in stream mode)."""
        if self.mode != "fixed":
            return None
        return self.cfg.train_examples // self.batch_size

    @property
    def train_set(self) -> TaskBatch:
        """The (cached, read-only) fixed training set; fixed mode only."""
        if self.mode != "fixed":
            raise ValueError("train_set is only defined for mode='fixed'")
        if self._train is None:
            train = make_train_set(self.cfg)
            train.inputs.flags.writeable = False
            train.targets.flags.writeable = False
            self._train = train
        return self._train

    def _epoch_perm(self, epoch: int) -> np.ndarray:
        with self._perm_lock:  # the (epoch, permutation) pair is read and replaced together
            if self._perm_epoch != epoch:
                rng = np.random.default_rng(seed_epoch_shuffle(self.cfg, epoch))
                self._perm = rng.permutation(self.cfg.train_examples)
                self._perm_epoch = epoch
            return self._perm

    def batch(self, step: int) -> TaskBatch:
        """The batch for global ``step`` (``int32 [batch_size, seq_len]`` arrays, fresh copies)."""
        step = _check_int("step", step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got step={step}")
        if self.mode == "stream":
            return self.cfg.generate(self.batch_size, seed_stream_batch(self.cfg, step), split="train")
        epoch, i = divmod(step, self.steps_per_epoch)
        idx = self._epoch_perm(epoch)[i * self.batch_size : (i + 1) * self.batch_size]
        train = self.train_set
        return TaskBatch(inputs=train.inputs[idx], targets=train.targets[idx])

    def __iter__(self) -> Iterator[TaskBatch]:
        step = self.start_step
        while True:
            yield self.batch(step)
            step += 1
