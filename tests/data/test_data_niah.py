"""Tests for gdn_jax.data.niah (needle-in-a-haystack generator and config)."""

import dataclasses
import time

import numpy as np
import pytest

from gdn_jax.data import IGNORE_INDEX, NIAHConfig, TaskBatch, TaskLoader, generate_niah, make_test_set
from gdn_jax.data.niah import niah_vocab_ranges


def _check_example(inp, tgt, V, L, k, m):
    """Independent structural check of one example; returns the needle start position."""
    q, h = V // 4, V // 2
    inp, tgt = inp.tolist(), tgt.tolist()
    assert all(0 < t < V for t in inp)  # token 0 is never emitted
    key_pos = [i for i, t in enumerate(inp) if 1 <= t < q]
    # Key tokens occur exactly at the needle key and the query key (2k positions, two runs of k).
    assert len(key_pos) == 2 * k
    p, Q = key_pos[0], L - k - m + 1
    assert key_pos == list(range(p, p + k)) + list(range(Q, Q + k))
    key = inp[p : p + k]
    value = inp[p + k : p + k + m]
    assert inp[Q : Q + k] == key  # the query is the key again
    assert all(q <= t < h for t in value)
    assert p + k + m <= Q  # the needle lies entirely before the query
    # Filler: everything outside needle and query, all from [h, V) (never a key or value token).
    needle_or_query = set(range(p, p + k + m)) | set(range(Q, L))
    filler = [t for i, t in enumerate(inp) if i not in needle_or_query]
    assert all(h <= t < V for t in filler)
    # The query is followed by v1..v_{m-1} (teacher forcing) and ends the sequence.
    assert inp[Q + k :] == value[: m - 1]
    # Labels: the value at the last m positions, IGNORE elsewhere.
    for t in range(L):
        if t >= L - m:
            assert tgt[t] == value[t - (L - m)]
        else:
            assert tgt[t] == IGNORE_INDEX
    return p


@pytest.mark.parametrize(
    "V, L, k, m",
    [(256, 1024, 1, 1), (8, 3, 1, 1), (16, 16, 2, 3), (64, 64, 3, 5), (1000, 200, 4, 1), (256, 9, 1, 4)],
)
def test_structure_and_labels(V, L, k, m):
    b = generate_niah(40, vocab_size=V, seq_len=L, key_len=k, value_len=m, seed=3)
    assert isinstance(b, TaskBatch)
    assert b.inputs.shape == (40, L) and b.targets.shape == (40, L)
    assert b.inputs.dtype == np.int32 and b.targets.dtype == np.int32
    assert int(b.query_mask.sum()) == 40 * m
    starts = [_check_example(i, t, V, L, k, m) for i, t in zip(b.inputs, b.targets)]
    # The docstring's recipe recovers the needle start.
    np.testing.assert_array_equal(np.argmax((b.inputs >= 1) & (b.inputs < V // 4), axis=1), starts)


def test_vocab_ranges_disjoint_and_cover():
    for V in (8, 9, 10, 11, 256, 1001):
        r = niah_vocab_ranges(V)
        assert r["key"][0] == 1 and r["key"][1] == r["value"][0] and r["value"][1] == r["filler"][0]
        assert r["filler"][1] == V and all(b > a for a, b in r.values())
        assert NIAHConfig(vocab_size=V, seq_len=8).num_values == r["value"][1] - r["value"][0]


def test_token_distributions_use_whole_ranges():
    V = 64
    b = generate_niah(2000, vocab_size=V, seq_len=32, key_len=1, value_len=1, seed=0)
    keys = b.inputs[:, -1]
    values = b.targets[:, -1]
    assert set(np.unique(keys).tolist()) == set(range(1, V // 4))
    assert set(np.unique(values).tolist()) == set(range(V // 4, V // 2))
    filler = b.inputs[:, :-1][b.inputs[:, :-1] >= V // 2]
    assert set(np.unique(filler).tolist()) == set(range(V // 2, V))


def test_uniform_depth_covers_all_valid_starts():
    L, k, m = 20, 2, 2
    b = generate_niah(4000, vocab_size=32, seq_len=L, key_len=k, value_len=m, seed=1)
    starts = np.argmax((b.inputs >= 1) & (b.inputs < 8), axis=1)
    max_start = L - 2 * k - 2 * m + 1
    counts = np.bincount(starts, minlength=max_start + 1)
    assert len(counts) == max_start + 1  # never beyond the last valid start
    expected = 4000 / (max_start + 1)
    assert counts.min() > 0.75 * expected and counts.max() < 1.25 * expected


@pytest.mark.parametrize("depth, expected", [(0.0, 0), (1.0, 1015), (0.5, 508), (0.25, 254), (1 / 3, 338)])
def test_fixed_depth(depth, expected):
    # L=1024, k=2, m=3: valid starts 0..P with P = 1024 - 2*2 - 2*3 + 1 = 1015; start = floor(depth * P + 1/2).
    L, k, m = 1024, 2, 3
    b = NIAHConfig(vocab_size=128, seq_len=L, key_len=k, value_len=m, depth=depth).generate(30, 5)
    for inp, tgt in zip(b.inputs, b.targets):
        assert _check_example(inp, tgt, 128, L, k, m) == expected
    if depth == 1.0:  # the needle ends immediately before the query
        assert expected + k + m == L - k - m + 1


def test_determinism_and_seeds():
    cfg = NIAHConfig(vocab_size=128, seq_len=256, value_len=2)
    a, b, c = cfg.generate(50, 11), cfg.generate(50, 11), cfg.generate(50, 12)
    np.testing.assert_array_equal(a.inputs, b.inputs)
    np.testing.assert_array_equal(a.targets, b.targets)
    assert not np.array_equal(a.inputs, c.inputs)
    assert not np.array_equal(a.targets, c.targets)
    ss = np.random.SeedSequence(7, spawn_key=(3,))
    d1, d2 = cfg.generate(50, ss), cfg.generate(50, ss, split="test")
    np.testing.assert_array_equal(d1.inputs, d2.inputs)  # same distribution for both splits
    assert ss.n_children_spawned == 0
    assert len({r.tobytes() for r in a.inputs}) == 50


def test_long_sequences_are_fast():
    """Vectorised generation: 1000 examples of 8192 tokens cost about as much as drawing their 8.2 M
    random tokens once (measured 0.9-1.1x); a per-token Python loop would cost ~1000x. Compared with
    that draw on the same machine (the best of 3 each), not with seconds: a fixed 2 s limit failed
    on a busy machine."""
    rng = np.random.default_rng(0)
    gen, base = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        b = generate_niah(1000, vocab_size=256, seq_len=8192, value_len=4, key_len=2, seed=0)
        gen.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        rng.integers(0, 256, (1000, 8192))
        base.append(time.perf_counter() - t0)
    assert b.inputs.shape == (1000, 8192)
    assert min(gen) < 20 * min(base), (gen, base)
    for inp, tgt in zip(b.inputs[:3], b.targets[:3]):
        _check_example(inp, tgt, 256, 8192, 2, 4)


def test_config_test_set_and_stream_loader():
    cfg = NIAHConfig(vocab_size=64, seq_len=128, value_len=2, key_len=2, test_examples=20, seed=2)
    assert cfg.model_vocab_size == 64 and cfg.chance == 1 / 16
    test = make_test_set(cfg)
    assert test.inputs.shape == (20, 128)
    np.testing.assert_array_equal(make_test_set(cfg).inputs, test.inputs)
    assert not np.array_equal(make_test_set(dataclasses.replace(cfg, seed=3)).inputs, test.inputs)
    loader = TaskLoader(cfg, 8, mode="stream")
    b3 = loader.batch(3)
    assert b3.inputs.shape == (8, 128) and b3.inputs.dtype == np.int32
    np.testing.assert_array_equal(b3.inputs, TaskLoader(cfg, 8, mode="stream").batch(3).inputs)
    assert not np.array_equal(b3.inputs, loader.batch(4).inputs)
    for inp, tgt in zip(b3.inputs, b3.targets):
        _check_example(inp, tgt, 64, 128, 2, 2)
    with pytest.raises(ValueError, match="stream"):
        TaskLoader(cfg, 8)  # no fixed training set
    with pytest.raises(ValueError, match="split"):
        cfg.generate(2, 0, split="val")


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(vocab_size=7), r"vocab_size.*7"),
        (dict(seq_len=0), r"seq_len.*0"),
        (dict(seq_len=8, value_len=4, key_len=1), r"seq_len=8.*value_len=4.*= 9"),
        (dict(seq_len=8, key_len=4), r"seq_len=8.*key_len=4"),
        (dict(value_len=0), r"value_len.*0"),
        (dict(key_len=-1), r"key_len.*-1"),
        (dict(depth=1.5), r"depth"),
        (dict(depth=-0.1), r"depth"),
        (dict(depth=float("nan")), r"depth"),
        (dict(test_examples=0), r"test_examples.*0"),
        (dict(seed=-1), r"seed.*-1"),
    ],
)
def test_config_value_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        NIAHConfig(**kw)


@pytest.mark.parametrize(
    "kw",
    [dict(vocab_size=256.0), dict(seq_len=True), dict(value_len=1.0), dict(key_len="1"), dict(depth="0.5"),
     dict(depth=True), dict(test_examples=10.0), dict(seed=1.5), dict(seed=False)],
)
def test_config_type_errors(kw):
    with pytest.raises(TypeError):
        NIAHConfig(**kw)


def test_generate_argument_errors():
    cfg = NIAHConfig(seq_len=32)
    with pytest.raises(ValueError, match="num_examples"):
        cfg.generate(0, 0)
    with pytest.raises(TypeError, match="num_examples"):
        cfg.generate(2.0, 0)
    with pytest.raises(TypeError, match="seed"):
        cfg.generate(2, 1.0)
    with pytest.raises(ValueError, match="seed"):
        cfg.generate(2, -3)
    b = generate_niah(np.int64(3), vocab_size=np.int32(32), seq_len=np.int64(16), depth=np.float32(0.5),
                      seed=np.uint32(2))
    assert b.inputs.shape == (3, 16)
