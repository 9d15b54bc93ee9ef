"""Tests for gdn_jax.data.state_tracking (parity / addition mod m, Grazzi et al. 2025)."""

import dataclasses

import numpy as np
import pytest

from gdn_jax.data import (
    IGNORE_INDEX,
    StateTrackingConfig,
    TaskBatch,
    TaskLoader,
    generate_state_tracking,
    make_test_set,
    scaled_accuracy,
)


def _check_example(inp, tgt, m, lo, hi, label_mode="all"):
    """Independent check of one example (Python loop); returns its length."""
    inp, tgt = inp.tolist(), tgt.tolist()
    assert len(inp) == hi
    n = next((i for i, t in enumerate(inp) if t == m), hi)  # first PAD
    assert lo <= n <= hi
    assert all(0 <= t < m for t in inp[:n])
    assert all(t == m for t in inp[n:])  # right padding only
    s = 0
    for t in range(n):
        s = (s + inp[t]) % m
        if label_mode == "all" or t == n - 1:
            assert tgt[t] == s, (t, tgt[t], s)
        else:
            assert tgt[t] == IGNORE_INDEX
    assert all(t == IGNORE_INDEX for t in tgt[n:])
    return n


@pytest.mark.parametrize("label_mode", ["all", "last"])
@pytest.mark.parametrize("m, lo, hi", [(2, 3, 40), (2, 40, 256), (3, 1, 1), (5, 1, 17), (7, 10, 10), (60, 2, 9)])
def test_structure_and_labels(m, lo, hi, label_mode):
    b = generate_state_tracking(60, modulus=m, min_len=lo, max_len=hi, label_mode=label_mode, seed=3)
    assert isinstance(b, TaskBatch)
    assert b.inputs.shape == (60, hi) and b.targets.shape == (60, hi)
    assert b.inputs.dtype == np.int32 and b.targets.dtype == np.int32
    assert b.inputs.min() >= 0 and b.inputs.max() <= m  # [0, model_vocab_size)
    lengths = [_check_example(i, t, m, lo, hi, label_mode) for i, t in zip(b.inputs, b.targets)]
    if label_mode == "last":
        assert int(b.query_mask.sum()) == 60
    else:
        assert int(b.query_mask.sum()) == sum(lengths)


def test_parity_by_hand():
    b = generate_state_tracking(200, modulus=2, min_len=5, max_len=5, seed=0)
    expected = np.cumsum(b.inputs, axis=1) % 2  # no padding at fixed length
    np.testing.assert_array_equal(b.targets, expected)
    # Both labels and both symbols occur, in roughly equal proportions.
    assert abs(b.inputs.mean() - 0.5) < 0.05 and abs(b.targets.mean() - 0.5) < 0.05


@pytest.mark.parametrize("split", ["train", "test"])
def test_length_distribution_covers_split_range(split):
    cfg = StateTrackingConfig(modulus=3, train_min_len=3, train_max_len=12, test_min_len=20, test_max_len=30)
    lo, hi = cfg.lengths(split)
    b = cfg.generate(3000, 1, split=split)
    assert b.inputs.shape == (3000, hi)
    n = (b.inputs != cfg.pad_id).sum(axis=1)
    counts = np.bincount(n, minlength=hi + 1)
    assert counts[:lo].sum() == 0 and len(counts) == hi + 1
    expected = 3000 / (hi - lo + 1)
    assert counts[lo:].min() > 0.7 * expected and counts[lo:].max() < 1.3 * expected
    for inp, tgt in zip(b.inputs[:50], b.targets[:50]):
        _check_example(inp, tgt, 3, lo, hi)


def test_symbols_uniform_and_padding_token():
    b = generate_state_tracking(500, modulus=5, min_len=1, max_len=50, seed=2)
    pad = b.inputs == 5
    np.testing.assert_array_equal(pad, b.targets == IGNORE_INDEX)
    counts = np.bincount(b.inputs[~pad], minlength=5)
    assert counts.min() > 0.9 * counts.mean() and counts.max() < 1.1 * counts.mean()
    assert pad.any() and not pad[:, 0].any()  # min_len >= 1: position 0 is never padding


def test_determinism_and_seeds():
    cfg = StateTrackingConfig(modulus=3)
    a, b, c = cfg.generate(50, 11), cfg.generate(50, 11), cfg.generate(50, 12)
    np.testing.assert_array_equal(a.inputs, b.inputs)
    np.testing.assert_array_equal(a.targets, b.targets)
    assert not np.array_equal(a.inputs, c.inputs)
    ss = np.random.SeedSequence(7, spawn_key=(3,))
    np.testing.assert_array_equal(cfg.generate(20, ss, split="test").inputs, cfg.generate(20, ss, split="test").inputs)
    assert ss.n_children_spawned == 0
    # The splits differ in their length range (and so width).
    assert cfg.generate(4, 0, split="train").inputs.shape == (4, 40)
    assert cfg.generate(4, 0, split="test").inputs.shape == (4, 256)


def test_config_properties_and_defaults():
    cfg = StateTrackingConfig()
    assert (cfg.modulus, cfg.train_min_len, cfg.train_max_len, cfg.test_min_len, cfg.test_max_len) == (2, 3, 40, 40, 256)
    assert cfg.label_mode == "all" and cfg.test_examples == 1000 and cfg.seed == 0
    assert cfg.model_vocab_size == 3 and cfg.pad_id == 2 and cfg.chance == 0.5
    c5 = StateTrackingConfig(modulus=5)
    assert c5.model_vocab_size == 6 and c5.chance == pytest.approx(0.2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.modulus = 3


def test_scaled_accuracy():
    assert scaled_accuracy(0.5, 0.5) == 0.0
    assert scaled_accuracy(1.0, 0.5) == 1.0
    assert scaled_accuracy(0.75, 0.5) == pytest.approx(0.5)
    assert scaled_accuracy(0.2, 0.2) == 0.0
    assert scaled_accuracy(0.0, 0.5) == -1.0
    assert isinstance(scaled_accuracy(np.float32(0.9), 0.5), float)
    np.testing.assert_allclose(scaled_accuracy(np.array([0.5, 1.0]), 0.5), [0.0, 1.0])
    assert scaled_accuracy(0.9, StateTrackingConfig(modulus=10).chance) == pytest.approx(0.8 / 0.9)
    with pytest.raises(ValueError, match="chance"):
        scaled_accuracy(0.5, 1.0)
    with pytest.raises(ValueError, match="chance"):
        scaled_accuracy(0.5, -0.1)
    with pytest.raises(TypeError, match="chance"):
        scaled_accuracy(0.5, "0.5")


def test_test_set_and_stream_loader():
    cfg = StateTrackingConfig(modulus=4, test_examples=30, seed=2)
    test = make_test_set(cfg)
    assert test.inputs.shape == (30, 256)
    np.testing.assert_array_equal(make_test_set(cfg).inputs, test.inputs)
    assert not np.array_equal(make_test_set(dataclasses.replace(cfg, seed=3)).inputs, test.inputs)
    for inp, tgt in zip(test.inputs, test.targets):
        _check_example(inp, tgt, 4, 40, 256)
    loader = TaskLoader(cfg, 8, mode="stream")
    b3 = loader.batch(3)
    assert b3.inputs.shape == (8, 40) and b3.inputs.dtype == np.int32
    np.testing.assert_array_equal(b3.inputs, TaskLoader(cfg, 8, mode="stream").batch(3).inputs)
    assert not np.array_equal(b3.inputs, loader.batch(4).inputs)
    for inp, tgt in zip(b3.inputs, b3.targets):
        _check_example(inp, tgt, 4, 3, 40)
    with pytest.raises(ValueError, match="stream"):
        TaskLoader(cfg, 8)  # no fixed training set
    with pytest.raises(ValueError, match="split"):
        cfg.generate(2, 0, split="validation")
    with pytest.raises(ValueError, match="split"):
        cfg.lengths("val")


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(modulus=1), r"modulus.*1"),
        (dict(modulus=0), r"modulus.*0"),
        (dict(train_min_len=0), r"train_min_len.*0"),
        (dict(train_min_len=-2), r"train_min_len.*-2"),
        (dict(train_min_len=41), r"train_min_len=41 > train_max_len=40"),
        (dict(test_min_len=300), r"test_min_len=300 > test_max_len=256"),
        (dict(test_max_len=10), r"test_min_len=40 > test_max_len=10"),
        (dict(test_examples=0), r"test_examples.*0"),
        (dict(seed=-1), r"seed.*-1"),
        (dict(label_mode="first"), r"label_mode"),
    ],
)
def test_config_value_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        StateTrackingConfig(**kw)


@pytest.mark.parametrize(
    "kw",
    [dict(modulus=2.0), dict(modulus=True), dict(train_min_len=3.0), dict(train_max_len="40"),
     dict(test_min_len=None), dict(test_max_len=256.0), dict(test_examples=True), dict(seed=0.5),
     dict(label_mode=None)],
)
def test_config_type_errors(kw):
    with pytest.raises(TypeError):
        StateTrackingConfig(**kw)


def test_generate_argument_errors():
    with pytest.raises(ValueError, match="num_examples"):
        generate_state_tracking(0, min_len=1, max_len=2, seed=0)
    with pytest.raises(TypeError, match="num_examples"):
        generate_state_tracking(2.0, min_len=1, max_len=2, seed=0)
    with pytest.raises(ValueError, match="min_len=3 > max_len=2"):
        generate_state_tracking(2, min_len=3, max_len=2, seed=0)
    with pytest.raises(ValueError, match="modulus"):
        generate_state_tracking(2, modulus=1, min_len=1, max_len=2, seed=0)
    with pytest.raises(TypeError, match="seed"):
        generate_state_tracking(2, min_len=1, max_len=2, seed=1.0)
    b = generate_state_tracking(np.int64(3), modulus=np.int32(3), min_len=np.int16(2), max_len=np.int64(4),
                                seed=np.uint32(1))
    assert b.inputs.shape == (3, 4)
