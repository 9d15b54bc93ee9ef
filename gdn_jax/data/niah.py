"""Needle-in-a-haystack (NIAH) synthetic retrieval data: one key -> value needle in a random-token haystack.

Source: the "needle in a haystack" long-context retrieval test (G. Kamradt, 2023, "Needle In A
Haystack - Pressure Testing LLMs"), in the synthetic passkey / single-needle form of RULER
(C.-P. Hsieh, S. Sun, S. Kriman, S. Acharya, D. Rekesh, F. Jia, Y. Zhang, B. Ginsburg, "RULER:
What's the Real Context Size of Your Long-Context Language Models?", 2024, arXiv:2404.06654,
task "single NIAH" (S-NIAH)) and of the passkey retrieval test (A. Mohtashami, M. Jaggi, "Landmark
Attention", 2023, arXiv:2305.16300). Gated DeltaNet (S. Yang, J. Kautz, A. Hatamizadeh, "Gated
Delta Networks: Improving Mamba2 with Delta Rule", ICLR 2025, arXiv:2412.06464) reports the
RULER S-NIAH tasks. This module is a token-level version with a synthetic vocabulary: NumPy only,
vectorised over examples, with explicit :class:`numpy.random.SeedSequence` seeding so that every
batch is a pure function of its arguments.

Vocabulary (``V = vocab_size >= 8``, ``q = V // 4``, ``h = V // 2``), three disjoint ranges::

    0          reserved, never emitted (as in MQAR)
    [1, q)     key tokens      (q - 1 of them)
    [q, h)     value tokens    (h - q of them)
    [h, V)     filler tokens   (V - h of them; the haystack)

Layout of one example (``L = seq_len``, ``k = key_len``, ``m = value_len``, needle start ``p``,
query start ``Q = L - k - m + 1``)::

    position  0 .. p-1 | p .. p+k-1 | p+k .. p+k+m-1 | p+k+m .. Q-1 | Q .. Q+k-1 | Q+k .. L-1
    inputs    filler   | K1 .. Kk   | v1 .. vm       | filler       | K1 .. Kk   | v1 .. v(m-1)
    targets   -100 ............................................... -100 ..  v1  | v2 .. vm
                                                                    (at Q+k-1)

* The key ``K1..Kk`` (i.i.d. uniform key tokens) and the value ``v1..vm`` (i.i.d. uniform value
  tokens) are drawn independently per example; the haystack is i.i.d. uniform filler. Filler and
  values never contain a key token, so key tokens occur exactly at the ``2k`` positions of the
  needle key and of the query key: the key sequence appears exactly twice.
* The needle (``k + m`` tokens) lies entirely before the query: ``0 <= p <= P`` with
  ``P = L - 2k - 2m + 1`` (so ``seq_len >= 2 * key_len + 2 * value_len - 1``).
  ``depth=None``: ``p`` is uniform over ``{0, ..., P}``. ``depth=x`` in ``[0, 1]``: ``p =
  floor(x * P + 1/2)`` for every example (``x = 0``: the needle opens the sequence; ``x = 1``: it
  ends immediately before the query), for depth x length heatmaps.
* The query is the key again, followed by the first ``m - 1`` value tokens (teacher forcing), and
  ends the sequence. The scored positions are the last ``m`` ones: the last query key token
  (label ``v1``) and the teacher-forced value tokens (labels ``v2 .. vm``).

The needle start of each example can be recovered from a batch as the first key-token position:
``numpy.argmax((inputs >= 1) & (inputs < vocab_size // 4), axis=1)``.

Label convention (already shifted, "predict at position t", see :mod:`gdn_jax.data.common`):
``targets[t]`` is what the model must output at position ``t`` (the next token), or
:data:`IGNORE_INDEX` (-100) where nothing is scored. ``chance`` is ``1 / (h - q)``, a uniform guess
among the value tokens (per scored token).

Seeding: a batch is generated from ``numpy.random.default_rng(seed)`` (a SeedSequence argument is
not mutated); the task-level seeds (test set, stream batches) come from
:mod:`gdn_jax.data.loader`. NIAH has no fixed training set: train with ``TaskLoader(cfg, B,
mode="stream")``. The ``"train"`` and ``"test"`` splits come from the same distribution.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import ClassVar, Optional

import numpy as np

from gdn_jax.data.common import IGNORE_INDEX, SeedLike, TaskBatch, check_int as _check_int, check_seed as _check_seed, check_token_count as _check_token_count

__all__ = ["NIAHConfig", "generate_niah", "niah_vocab_ranges"]


def niah_vocab_ranges(vocab_size: int) -> dict:
    """Half-open id ranges ``{"key": (1, q), "value": (q, h), "filler": (h, V)}`` (``q = V//4``, ``h = V//2``)."""
    V = _check_int("vocab_size", vocab_size)
    if V < 8:
        raise ValueError(f"vocab_size must be >= 8 (keys [1, V//4), values [V//4, V//2), filler [V//2, V)), "
                         f"got vocab_size={V}")
    _check_token_count("vocab_size", V)
    q, h = V // 4, V // 2
    return {"key": (1, q), "value": (q, h), "filler": (h, V)}


def _validate(num_examples, vocab_size, seq_len, key_len, value_len, depth):
    num_examples = _check_int("num_examples", num_examples)
    vocab_size = _check_int("vocab_size", vocab_size)
    seq_len = _check_int("seq_len", seq_len)
    key_len = _check_int("key_len", key_len)
    value_len = _check_int("value_len", value_len)
    if depth is not None:
        if isinstance(depth, (bool, np.bool_)) or not isinstance(depth, numbers.Real):
            raise TypeError(f"depth must be None or a real number in [0, 1], got {depth!r} "
                            f"of type {type(depth).__name__}")
        depth = float(depth)
        if not (math.isfinite(depth) and 0.0 <= depth <= 1.0):
            raise ValueError(f"depth must be None or in [0, 1], got depth={depth}")
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got num_examples={num_examples}")
    niah_vocab_ranges(vocab_size)  # vocab_size >= 8
    if key_len < 1:
        raise ValueError(f"key_len must be >= 1, got key_len={key_len}")
    if value_len < 1:
        raise ValueError(f"value_len must be >= 1, got value_len={value_len}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got seq_len={seq_len}")
    need = 2 * key_len + 2 * value_len - 1
    if seq_len < need:
        raise ValueError(
            f"seq_len={seq_len} is too short for key_len={key_len}, value_len={value_len}: the needle "
            f"(key_len + value_len tokens) and the query (key_len + value_len - 1 tokens) need "
            f"seq_len >= 2 * key_len + 2 * value_len - 1 = {need}"
        )
    return num_examples, vocab_size, seq_len, key_len, value_len, depth


def generate_niah(
    num_examples: int,
    *,
    vocab_size: int = 256,
    seq_len: int = 1024,
    key_len: int = 1,
    value_len: int = 1,
    depth: Optional[float] = None,
    seed: SeedLike,
) -> TaskBatch:
    """Generate needle-in-a-haystack examples (see the module docstring for layout and labels).

    Args:
      num_examples: number of examples ``B`` (>= 1).
      vocab_size: ``V >= 8``; keys ``[1, V//4)``, values ``[V//4, V//2)``, filler ``[V//2, V)``.
      seq_len: ``L >= 2 * key_len + 2 * value_len - 1``.
      key_len: key tokens ``k`` (>= 1).
      value_len: value tokens ``m`` (>= 1), all scored.
      depth: ``None`` (needle start uniform over the valid positions) or a fixed relative depth in
        ``[0, 1]`` (start ``floor(depth * P + 1/2)``, ``P = L - 2k - 2m + 1``).
      seed: non-negative int or :class:`numpy.random.SeedSequence` (not mutated).

    Returns:
      :class:`TaskBatch` with ``inputs`` and ``targets`` both ``int32 [B, L]``; exactly ``m`` scored
      positions per example, the last ``m``.

    Raises:
      TypeError: a non-integer size (bools and floats included) or a non-real ``depth``.
      ValueError: out-of-range sizes, ``depth`` outside ``[0, 1]``, ``seq_len`` too short.
    """
    B, V, L, k, m, depth = _validate(num_examples, vocab_size, seq_len, key_len, value_len, depth)
    ss = _check_seed(seed)
    q, h = V // 4, V // 2
    rng = np.random.default_rng(ss)

    inputs = rng.integers(h, V, size=(B, L), dtype=np.int32)  # filler
    keys = rng.integers(1, q, size=(B, k), dtype=np.int32)
    values = rng.integers(q, h, size=(B, m), dtype=np.int32)
    max_start = L - 2 * k - 2 * m + 1
    if depth is None:
        start = rng.integers(0, max_start + 1, size=B)
    else:
        start = np.full(B, math.floor(depth * max_start + 0.5), dtype=np.int64)

    needle = np.concatenate([keys, values], axis=1)  # [B, k + m]
    rows = np.arange(B)[:, None]
    inputs[rows, start[:, None] + np.arange(k + m)] = needle
    Q = L - k - m + 1
    inputs[:, Q:] = needle[:, : k + m - 1]

    targets = np.full((B, L), IGNORE_INDEX, dtype=np.int32)
    targets[:, L - m:] = values
    return TaskBatch(inputs=inputs, targets=targets)


@dataclasses.dataclass(frozen=True)
class NIAHConfig:
    """Configuration of a needle-in-a-haystack task (see :mod:`gdn_jax.data.niah`).

    ``test_examples`` is the size of the held-out test set; ``seed`` the root entropy of every seed
    of this task (:mod:`gdn_jax.data.loader`). There is no fixed training set (use
    ``TaskLoader(cfg, batch_size, mode="stream")``).
    """

    name: ClassVar[str] = "niah"  #: ``RecallConfig.task``
    title: ClassVar[str] = "NIAH"  #: plot titles
    metric: ClassVar[str] = "test_accuracy"  #: the headline metric of results and sweep summaries

    vocab_size: int = 256
    seq_len: int = 1024
    key_len: int = 1
    value_len: int = 1
    depth: Optional[float] = None
    test_examples: int = 1000
    seed: int = 0

    def __post_init__(self):
        _validate(1, self.vocab_size, self.seq_len, self.key_len, self.value_len, self.depth)
        v = _check_int("test_examples", self.test_examples)
        if v < 1:
            raise ValueError(f"test_examples must be >= 1, got test_examples={v}")
        _check_seed(self.seed, allow_sequence=False)

    @property
    def model_vocab_size(self) -> int:
        """Token ids are in ``[0, vocab_size)`` (0 is never emitted)."""
        return self.vocab_size

    @property
    def max_labels(self) -> int:
        """Most labelled positions in one example: the ``value_len`` value tokens."""
        return self.value_len

    @property
    def label(self) -> str:
        """A short description of the task parameters (logs)."""
        return (f"L={self.seq_len} key={self.key_len} value={self.value_len}"
                + ("" if self.depth is None else f" depth={self.depth}"))

    @property
    def num_values(self) -> int:
        """Number of possible value tokens, ``vocab_size // 2 - vocab_size // 4``."""
        return self.vocab_size // 2 - self.vocab_size // 4

    @property
    def chance(self) -> float:
        """Per-token accuracy of a uniform guess among the value tokens, ``1 / num_values``."""
        return 1.0 / self.num_values

    def generate(self, num_examples: int, seed: SeedLike, *, split: str = "train") -> TaskBatch:
        """:func:`generate_niah` with this config's parameters (``split`` "train" or "test": both
        come from the same distribution)."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got split={split!r}")
        return generate_niah(num_examples, vocab_size=self.vocab_size, seq_len=self.seq_len, key_len=self.key_len,
                             value_len=self.value_len, depth=self.depth, seed=seed)
