"""State-tracking synthetic data: parity and addition modulo ``m`` (the cyclic group Z_m).

Source: R. Grazzi, J. Siems, A. Zela, J. K. H. Franke, F. Hutter, M. Pontil, "Unlocking
State-Tracking in Linear RNNs Through Negative Eigenvalues", ICLR 2025 (arXiv:2411.12537), whose
parity / modular-arithmetic experiments train on sequences of length 3 to 40 and test length
extrapolation on lengths 40 to 256 (the defaults here); see also W. Merrill, J. Petty, A.
Sabharwal, "The Illusion of State in State-Space Models", ICML 2024 (arXiv:2404.08819), and B. Liu,
J. T. Ash, S. Goel, A. Krishnamurthy, C. Zhang, "Transformers Learn Shortcuts to Automata", ICLR
2023 (arXiv:2210.10749). Parity is ``modulus = 2``. A linear RNN whose state-transition
eigenvalues are restricted to ``[0, 1]`` (e.g. Mamba, and DeltaNet / Gated DeltaNet with
``beta in [0, 1]``) cannot solve parity at arbitrary length with finite precision; allowing
negative eigenvalues (``beta in [0, 2]``) fixes that (Grazzi et al.).

This module is NumPy only, vectorised over examples, with explicit
:class:`numpy.random.SeedSequence` seeding so that every batch is a pure function of its arguments.

Vocabulary (``m = modulus``): symbols ``0 .. m-1`` and the padding token ``PAD = m``;
``model_vocab_size = m + 1``. Labels are symbols ``0 .. m-1``.

Layout of one example of length ``n`` (drawn uniformly from ``[min_len, max_len]`` of the split,
independently per example) in arrays of width ``max_len``::

    position   0        1              ...  n-1                |  n  ... max_len-1
    inputs     x_0      x_1            ...  x_{n-1}            |  PAD ... PAD
    targets    s_0      s_1            ...  s_{n-1}            |  -100 ... -100
               (label_mode="last": -100 ... -100 s_{n-1}       |  -100 ... -100)

with ``x_t`` i.i.d. uniform over ``{0, ..., m-1}`` and ``s_t = (x_0 + ... + x_t) mod m`` (the
running state). Label convention (see :mod:`gdn_jax.data.common`): ``targets[t]`` is what the
model must output at position ``t``, i.e. the state after reading ``x_t``; :data:`IGNORE_INDEX`
(-100) where nothing is scored (the padding, and with ``label_mode="last"`` every position but
``n - 1``). ``chance = 1/m`` (a uniform guess among the ``m`` states); report
:func:`scaled_accuracy` ``(acc - chance) / (1 - chance)``, 0 at chance and 1 when perfect, as
Grazzi et al. do.

Splits: ``"train"`` uses ``[train_min_len, train_max_len]``, ``"test"`` uses ``[test_min_len,
test_max_len]`` (length extrapolation). Seeding: a batch is generated from
``numpy.random.default_rng(seed)`` (a SeedSequence argument is not mutated); the task-level seeds
(test set, stream batches) come from :mod:`gdn_jax.data.loader`. There is no fixed training set:
train with ``TaskLoader(cfg, batch_size, mode="stream")``.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import ClassVar, Optional

import numpy as np

from gdn_jax.data.common import IGNORE_INDEX, SeedLike, TaskBatch, check_int as _check_int, check_seed as _check_seed, check_token_count as _check_token_count

__all__ = ["LABEL_MODES", "StateTrackingConfig", "generate_state_tracking", "scaled_accuracy"]

#: ``"all"``: a label at every (non-padding) position; ``"last"``: only at the final one.
LABEL_MODES = ("all", "last")


def scaled_accuracy(acc, chance):
    """``(acc - chance) / (1 - chance)``: 0 at chance level, 1 for a perfect model.

    ``acc`` may be a number or an array (NumPy / JAX); a float is returned for a scalar.
    ``chance`` must be a real number in ``[0, 1)``.
    """
    if isinstance(chance, (bool, np.bool_)) or not isinstance(chance, numbers.Real):
        raise TypeError(f"chance must be a real number in [0, 1), got {chance!r} of type {type(chance).__name__}")
    chance = float(chance)
    if not 0.0 <= chance < 1.0:
        raise ValueError(f"chance must be in [0, 1), got chance={chance}")
    out = (np.asarray(acc, dtype=np.float64) - chance) / (1.0 - chance)
    return float(out) if out.ndim == 0 else out


def _validate(num_examples, modulus, min_len, max_len, label_mode, prefix=""):
    num_examples = _check_int("num_examples", num_examples)
    modulus = _check_int("modulus", modulus)
    min_name, max_name = f"{prefix}min_len", f"{prefix}max_len"
    min_len = _check_int(min_name, min_len)
    max_len = _check_int(max_name, max_len)
    if not isinstance(label_mode, str):
        raise TypeError(f"label_mode must be a str, one of {LABEL_MODES}, got {label_mode!r}")
    if label_mode not in LABEL_MODES:
        raise ValueError(f"label_mode must be one of {LABEL_MODES}, got label_mode={label_mode!r}")
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got num_examples={num_examples}")
    if modulus < 2:
        raise ValueError(f"modulus must be >= 2, got modulus={modulus}")
    _check_token_count("modulus", modulus)
    if min_len < 1:
        raise ValueError(f"{min_name} must be >= 1, got {min_name}={min_len}")
    if min_len > max_len:
        raise ValueError(f"need {min_name} <= {max_name}, got {min_name}={min_len} > {max_name}={max_len}")
    return num_examples, modulus, min_len, max_len, label_mode


def generate_state_tracking(
    num_examples: int,
    *,
    modulus: int = 2,
    min_len: int,
    max_len: int,
    label_mode: str = "all",
    seed: SeedLike,
) -> TaskBatch:
    """Generate running-sum-mod-``modulus`` examples (see the module docstring for the layout).

    Args:
      num_examples: number of examples ``B`` (>= 1).
      modulus: ``m >= 2`` (2: parity). Symbols ``0..m-1``, ``PAD = m``.
      min_len, max_len: each example's length is uniform over ``[min_len, max_len]``
        (``1 <= min_len <= max_len``); arrays are right-padded to width ``max_len``.
      label_mode: ``"all"`` (label at every non-padding position) or ``"last"`` (final one only).
      seed: non-negative int or :class:`numpy.random.SeedSequence` (not mutated).

    Returns:
      :class:`TaskBatch` with ``inputs`` and ``targets`` both ``int32 [B, max_len]``.

    Raises:
      TypeError: a non-integer size (bools and floats included) or a non-str ``label_mode``.
      ValueError: ``modulus < 2``, ``min_len < 1``, ``min_len > max_len``, unknown ``label_mode``.
    """
    B, m, lo, hi, label_mode = _validate(num_examples, modulus, min_len, max_len, label_mode)
    rng = np.random.default_rng(_check_seed(seed))

    lengths = rng.integers(lo, hi + 1, size=B)
    x = rng.integers(0, m, size=(B, hi), dtype=np.int32)
    pos = np.arange(hi)
    valid = pos[None, :] < lengths[:, None]
    # Padding positions never feed a scored label: the running sum at t only reads x_0..x_t.
    state = (np.cumsum(x, axis=1, dtype=np.int64) % m).astype(np.int32)

    inputs = np.where(valid, x, np.int32(m)).astype(np.int32)
    if label_mode == "all":
        targets = np.where(valid, state, np.int32(IGNORE_INDEX)).astype(np.int32)
    else:
        targets = np.full((B, hi), IGNORE_INDEX, dtype=np.int32)
        rows = np.arange(B)
        targets[rows, lengths - 1] = state[rows, lengths - 1]
    return TaskBatch(inputs=inputs, targets=targets)


@dataclasses.dataclass(frozen=True)
class StateTrackingConfig:
    """Configuration of a parity / modular-addition state-tracking task (:mod:`gdn_jax.data.state_tracking`).

    Training examples have lengths in ``[train_min_len, train_max_len]``, test examples in
    ``[test_min_len, test_max_len]`` (defaults: Grazzi et al. 2025, 3-40 train, 40-256 test).
    ``test_examples`` is the size of the held-out test set; ``seed`` the root entropy of every seed
    of this task (:mod:`gdn_jax.data.loader`). There is no fixed training set (use
    ``TaskLoader(cfg, batch_size, mode="stream")``).
    """

    name: ClassVar[str] = "state_tracking"  #: ``RecallConfig.task``
    title: ClassVar[str] = "state tracking"  #: plot titles
    metric: ClassVar[str] = "scaled_accuracy"  #: headline metric (Grazzi et al.): ``(acc - chance)/(1 - chance)``

    modulus: int = 2
    train_min_len: int = 3
    train_max_len: int = 40
    test_min_len: int = 40
    test_max_len: int = 256
    test_examples: int = 1000
    seed: int = 0
    label_mode: str = "all"

    def __post_init__(self):
        _validate(1, self.modulus, self.train_min_len, self.train_max_len, self.label_mode, prefix="train_")
        _validate(1, self.modulus, self.test_min_len, self.test_max_len, self.label_mode, prefix="test_")
        v = _check_int("test_examples", self.test_examples)
        if v < 1:
            raise ValueError(f"test_examples must be >= 1, got test_examples={v}")
        _check_seed(self.seed, allow_sequence=False)

    @property
    def max_labels(self) -> Optional[int]:
        """None: every position is labelled (the loss uses the dense LM head)."""
        return None

    @property
    def label(self) -> str:
        """A short description of the task parameters (logs)."""
        return (f"mod {self.modulus} train {self.train_min_len}-{self.train_max_len} "
                f"test {self.test_min_len}-{self.test_max_len}")

    @property
    def pad_id(self) -> int:
        """The padding token, ``modulus``."""
        return self.modulus

    @property
    def model_vocab_size(self) -> int:
        """Token ids are in ``[0, modulus + 1)``: symbols ``0..modulus-1`` and ``PAD = modulus``."""
        return self.modulus + 1

    @property
    def chance(self) -> float:
        """Accuracy of a uniform guess among the ``modulus`` states, ``1 / modulus``."""
        return 1.0 / self.modulus

    def lengths(self, split: str) -> tuple:
        """``(min_len, max_len)`` of ``split`` ("train" or "test")."""
        if split == "train":
            return self.train_min_len, self.train_max_len
        if split == "test":
            return self.test_min_len, self.test_max_len
        raise ValueError(f"split must be 'train' or 'test', got split={split!r}")

    def generate(self, num_examples: int, seed: SeedLike, *, split: str = "train") -> TaskBatch:
        """:func:`generate_state_tracking` with the lengths of ``split`` ("train" or "test");
        arrays have width ``train_max_len`` or ``test_max_len``."""
        lo, hi = self.lengths(split)
        return generate_state_tracking(num_examples, modulus=self.modulus, min_len=lo, max_len=hi,
                                       label_mode=self.label_mode, seed=seed)
