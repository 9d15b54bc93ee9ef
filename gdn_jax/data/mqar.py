"""Multi-Query Associative Recall (MQAR) synthetic data, Zoology protocol.

Source: S. Arora, S. Eyuboglu, A. Timalsina, I. Johnson, M. Poli, J. Zou,
A. Rudra, C. Ré, "Zoology: Measuring and Improving Recall in Efficient
Language Models", 2023 (arXiv:2312.04927), and the reference generator
``zoology/data/associative_recall.py::multiquery_ar`` of that work. This module
re-implements that generator with NumPy only (no torch), vectorised over
examples, with explicit :class:`numpy.random.SeedSequence` seeding so that
every batch is a pure function of its seed.

Layout of one example (``V = vocab_size``, ``L = seq_len``, ``N = num_kv_pairs``)::

    position   0   1   2   3  ... 2N-2 2N-1 | 2N  2N+1 | 2N+2 2N+3 | ... | L-2 L-1
    inputs     k1  v1  k2  v2 ...  kN   vN  | slot 0   | slot 1    | ... | slot S-1
    targets   -100 ...                 -100 | see below

* Keys are drawn from ``[1, V//2)`` and values from ``[V//2, V)``; within one
  example the N keys are distinct and the N values are distinct (key ``k_j`` is
  paired with value ``v_j``). Token 0 is never a key or a value.
* The query region (the last ``L - 2N`` positions) is split into
  ``S = (L - 2N) // 2`` slots of two tokens; slot ``i`` occupies positions
  ``2N + 2i`` and ``2N + 2i + 1``. N slots are chosen without replacement with
  probability ``p(i) ∝ (i + 1) ** (power_a - 1)`` (``i`` from 0), so with the
  default ``power_a = 0.01`` queries concentrate at the start of the query
  region (short key→query gaps), as in Zoology. The first position of each
  chosen slot holds a key; every key is queried exactly once, in a uniformly
  random order independent of its order in the context.
* All other query-region tokens (the second token of every slot and both
  tokens of unchosen slots) are uniform over ``[0, V)`` when
  ``random_non_queries`` is true (they may coincide with keys or values, as in
  Zoology), else 0.

Label convention (already shifted, "predict at position t"): ``inputs[t]`` is
the token at position ``t`` and ``targets[t]`` is what the model must output at
position ``t``, i.e. the prediction of the *next* token. ``targets[t]`` is the
value paired with key ``inputs[t]`` exactly at the N query positions (the first
position of each chosen slot), and :data:`IGNORE_INDEX` (-100) everywhere else,
including the whole context region. A causal LM's logits ``logits[:, t]``
are therefore scored directly against ``targets[:, t]`` with no further shift;
this equals Zoology's ``labels[:, 1:]`` after its one-token shift.

Seeding: the task-level seeds (test set, fixed training set, stream batches, epoch shuffles) are
:class:`numpy.random.SeedSequence` nodes with entropy ``cfg.seed`` and distinct spawn keys
(:mod:`gdn_jax.data.loader`): every training stream lives under spawn key ``(0, ...)`` and the test
set under ``(1,)``, so the test set never shares a random stream with any training data (unlike
entropy lists such as ``[seed, 1]`` vs ``[seed, 1, 0]``, which NumPy treats as identical, spawn
keys cannot collide).

Inside :func:`generate_mqar`, examples are produced in row chunks (to bound
memory); chunk ``c`` uses the child ``SeedSequence(entropy, spawn_key=
spawn_key + (c,))`` of the given seed. The output is a deterministic function
of all the arguments.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import ClassVar

import numpy as np

from gdn_jax.data.common import IGNORE_INDEX, SeedLike, TaskBatch, check_int as _check_int, check_seed as _check_seed, check_token_count as _check_token_count, child as _child

__all__ = ["MQARConfig", "generate_mqar"]

# Upper bound on the number of elements of one temporary random array per chunk
# (float64): 2**22 elements = 32 MiB.
_CHUNK_ELEMENTS = 1 << 22


# --------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------


def _validate(num_examples, vocab_size, seq_len, num_kv_pairs, power_a, random_non_queries):
    num_examples = _check_int("num_examples", num_examples)
    vocab_size = _check_int("vocab_size", vocab_size)
    seq_len = _check_int("seq_len", seq_len)
    num_kv_pairs = _check_int("num_kv_pairs", num_kv_pairs)
    if isinstance(power_a, (bool, np.bool_)) or not isinstance(power_a, numbers.Real):
        raise TypeError(f"power_a must be a real number, got {power_a!r} of type {type(power_a).__name__}")
    power_a = float(power_a)
    if not isinstance(random_non_queries, (bool, np.bool_)):
        raise TypeError(
            f"random_non_queries must be a bool, got {random_non_queries!r} "
            f"of type {type(random_non_queries).__name__}"
        )

    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got num_examples={num_examples}")
    if vocab_size < 4:
        raise ValueError(f"vocab_size must be >= 4, got vocab_size={vocab_size}")
    _check_token_count("vocab_size", vocab_size)
    if num_kv_pairs < 1:
        raise ValueError(f"num_kv_pairs must be >= 1, got num_kv_pairs={num_kv_pairs}")
    if seq_len % 2 != 0:
        raise ValueError(f"seq_len must be even, got seq_len={seq_len}")
    if 4 * num_kv_pairs > seq_len:
        raise ValueError(
            f"need 4 * num_kv_pairs <= seq_len (2N context tokens + at least N query slots of 2), "
            f"got num_kv_pairs={num_kv_pairs}, seq_len={seq_len}"
        )
    num_keys = vocab_size // 2 - 1
    num_values = vocab_size - vocab_size // 2
    if num_kv_pairs > num_keys or num_kv_pairs > num_values:
        raise ValueError(
            f"num_kv_pairs={num_kv_pairs} exceeds the number of distinct keys "
            f"(vocab_size//2 - 1 = {num_keys}) or distinct values "
            f"(vocab_size - vocab_size//2 = {num_values}) for vocab_size={vocab_size}"
        )
    if not math.isfinite(power_a):
        raise ValueError(f"power_a must be finite, got power_a={power_a}")
    return num_examples, vocab_size, seq_len, num_kv_pairs, power_a, bool(random_non_queries)


# --------------------------------------------------------------------------
# Generator
# --------------------------------------------------------------------------


def _sample_distinct(rng: np.random.Generator, rows: int, width: int, k: int) -> np.ndarray:
    """``int64 [rows, k]``: per row, k distinct indices of ``[0, width)`` in uniformly random order.

    Dense case (``width <= 8 k``): rank ``width`` i.i.d. uniforms; the k smallest
    form a uniform k-subset and ordering them by value gives a uniform order.

    Sparse case (``width > 8 k``): draw ``m > k`` i.i.d. integers per row and
    keep the first k distinct ones in draw order, i.e. sequential sampling
    with duplicate rejection, which is exactly uniform sampling without
    replacement in a uniform order. Rows with fewer than k distinct draws
    (rare) are redrawn with a larger ``m``; the success event is invariant
    under relabelling the indices, so conditioning on it introduces no bias.
    Cost ``O(rows * k log k)`` instead of ``O(rows * width)``.
    """
    if width <= 8 * k:
        r = rng.random((rows, width))
        if k < width:
            idx = np.argpartition(r, k - 1, axis=1)[:, :k]
        else:
            idx = np.broadcast_to(np.arange(width), (rows, width))
        order = np.argsort(np.take_along_axis(r, idx, axis=1), axis=1)
        return np.take_along_axis(idx, order, axis=1)

    out = np.empty((rows, k), dtype=np.int64)
    todo = np.arange(rows)
    m = k + 2 * (-(-k * k // width)) + 16
    while todo.size:
        cand = rng.integers(0, width, size=(todo.size, m), dtype=np.int64)
        order = np.argsort(cand, axis=1, kind="stable")
        s = np.take_along_axis(cand, order, axis=1)
        new_sorted = np.ones(s.shape, dtype=bool)
        new_sorted[:, 1:] = s[:, 1:] != s[:, :-1]  # stable: earliest occurrence is "new"
        first = np.empty_like(new_sorted)
        np.put_along_axis(first, order, new_sorted, axis=1)  # back to draw order
        ok = first.sum(axis=1) >= k
        if ok.any():
            pos = np.argsort(~first[ok], axis=1, kind="stable")[:, :k]
            out[todo[ok]] = np.take_along_axis(cand[ok], pos, axis=1)
        todo = todo[~ok]
        m *= 2
    return out


def generate_mqar(
    num_examples: int,
    *,
    vocab_size: int,
    seq_len: int,
    num_kv_pairs: int,
    power_a: float = 0.01,
    random_non_queries: bool = True,
    seed: SeedLike,
) -> TaskBatch:
    """Generate MQAR examples (Zoology protocol, Arora et al. 2023).

    See the module docstring for the exact layout and the label convention.

    Args:
      num_examples: number of examples ``B`` (>= 1).
      vocab_size: vocabulary size ``V`` (>= 4). Keys come from ``[1, V//2)``,
        values from ``[V//2, V)``.
      seq_len: sequence length ``L`` (even, ``>= 4 * num_kv_pairs``).
      num_kv_pairs: number of key-value pairs ``N`` per example, all queried
        once; ``N <= V//2 - 1``.
      power_a: exponent ``a`` of the slot distribution ``p(i) ∝ (i+1)^(a-1)``;
        small ``a`` favours early slots (short gaps), ``a = 1`` is uniform.
      random_non_queries: fill non-query tokens of the query region uniformly
        from ``[0, V)`` (True) or with 0 (False).
      seed: non-negative int or :class:`numpy.random.SeedSequence`; the output
        is a deterministic function of it (and of the other arguments). A
        SeedSequence argument is not mutated.

    Returns:
      :class:`~gdn_jax.data.common.TaskBatch` with ``inputs`` and ``targets`` both ``int32 [B, L]``.

    Raises:
      TypeError: an argument has the wrong type (e.g. a non-integer size).
      ValueError: inconsistent sizes (odd ``seq_len``, ``4N > L``, too few
        keys/values for ``N``, ``num_examples < 1``, ``vocab_size < 4``).
    """
    num_examples, vocab_size, seq_len, num_kv_pairs, power_a, random_non_queries = _validate(
        num_examples, vocab_size, seq_len, num_kv_pairs, power_a, random_non_queries
    )
    ss = _check_seed(seed)

    V, L, N = vocab_size, seq_len, num_kv_pairs
    half = V // 2
    ctx = 2 * N
    num_slots = (L - ctx) // 2
    num_keys = half - 1
    num_values = V - half
    # log p(i) up to a constant, i = 0 .. num_slots-1.
    log_p = (power_a - 1.0) * np.log(np.arange(1, num_slots + 1, dtype=np.float64))

    inputs = np.empty((num_examples, L), dtype=np.int32)
    targets = np.full((num_examples, L), IGNORE_INDEX, dtype=np.int32)

    width = max(num_keys, num_values, num_slots, L)
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // width)
    for c, start in enumerate(range(0, num_examples, rows_per_chunk)):
        stop = min(start + rows_per_chunk, num_examples)
        B = stop - start
        rng = np.random.default_rng(_child(ss, c))

        keys = 1 + _sample_distinct(rng, B, num_keys, N)  # [B, N] in [1, V//2)
        values = half + _sample_distinct(rng, B, num_values, N)  # [B, N] in [V//2, V)

        # Weighted sampling of N slots without replacement (Gumbel-top-k): the N
        # largest of log p(i) + Gumbel noise are distributed as successive draws
        # without replacement from p.
        scores = log_p[None, :] + rng.gumbel(size=(B, num_slots))
        if N < num_slots:
            slots = np.argpartition(-scores, N - 1, axis=1)[:, :N]
        else:
            slots = np.broadcast_to(np.arange(num_slots), (B, num_slots))
        # Pair the j-th context key with slots[:, perm[j]] for an independent
        # uniform permutation, so the query order is uniformly random.
        perm = np.argsort(rng.random((B, N)), axis=1)
        slots = np.take_along_axis(slots, perm, axis=1)
        query_pos = ctx + 2 * slots  # [B, N]

        if random_non_queries:
            x = rng.integers(0, V, size=(B, L), dtype=np.int32)
        else:
            x = np.zeros((B, L), dtype=np.int32)
        x[:, 0:ctx:2] = keys
        x[:, 1:ctx:2] = values
        np.put_along_axis(x, query_pos, keys.astype(np.int32), axis=1)
        inputs[start:stop] = x
        np.put_along_axis(targets[start:stop], query_pos, values.astype(np.int32), axis=1)

    return TaskBatch(inputs=inputs, targets=targets)


# --------------------------------------------------------------------------
# Config (seeds, fixed sets and the loader: gdn_jax.data.loader)
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MQARConfig:
    """Configuration of an MQAR task (defaults follow a small Zoology setting).

    ``train_examples`` is the size of the fixed training set (Zoology trains on
    a fixed set, 100k examples by default) and ``test_examples`` the size of
    the held-out test set. ``seed`` is the root entropy of every seed used for
    this task (see the module docstring for the derivation).
    """

    name: ClassVar[str] = "mqar"  #: ``RecallConfig.task``
    title: ClassVar[str] = "MQAR"  #: plot titles
    metric: ClassVar[str] = "test_accuracy"  #: the headline metric of results and sweep summaries

    vocab_size: int = 256
    seq_len: int = 64
    num_kv_pairs: int = 8
    power_a: float = 0.01
    random_non_queries: bool = True
    train_examples: int = 100_000
    test_examples: int = 1000
    seed: int = 0

    def __post_init__(self):
        _validate(
            1, self.vocab_size, self.seq_len, self.num_kv_pairs, self.power_a, self.random_non_queries
        )
        for name in ("train_examples", "test_examples"):
            v = _check_int(name, getattr(self, name))
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {name}={v}")
        _check_seed(self.seed, allow_sequence=False)

    @property
    def model_vocab_size(self) -> int:
        """Token ids are in ``[0, vocab_size)``."""
        return self.vocab_size

    @property
    def max_labels(self) -> int:
        """Most labelled positions in one example: the ``num_kv_pairs`` queries."""
        return self.num_kv_pairs

    @property
    def label(self) -> str:
        """A short description of the task parameters (logs)."""
        return f"L={self.seq_len} N={self.num_kv_pairs}"

    @property
    def chance(self) -> float:
        """Accuracy of a uniform guess among the ``vocab_size - vocab_size // 2`` values."""
        return 1.0 / (self.vocab_size - self.vocab_size // 2)

    def generate(self, num_examples: int, seed: SeedLike, *, split: str = "train") -> TaskBatch:
        """:func:`generate_mqar` with this config's task parameters (``split`` "train" or "test":
        MQAR's test examples come from the training distribution)."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got split={split!r}")
        return generate_mqar(
            num_examples,
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
            num_kv_pairs=self.num_kv_pairs,
            power_a=self.power_a,
            random_non_queries=self.random_non_queries,
            seed=seed,
        )

