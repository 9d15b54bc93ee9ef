"""Tests for gdn_jax.data.mqar (Zoology MQAR generator, config and loader)."""

import dataclasses

import numpy as np
import pytest

from gdn_jax.data import (
    IGNORE_INDEX,
    TASK_CONFIGS,
    MQARConfig,
    TaskBatch,
    TaskLoader,
    generate_mqar,
    make_test_set,
    make_train_set,
    seed_epoch_shuffle,
    seed_stream_batch,
    seed_test_set,
    seed_train_set,
)
from gdn_jax.data.mqar import _sample_distinct

V, L, N = 128, 64, 8
SMALL = dict(vocab_size=V, seq_len=L, num_kv_pairs=N)


def _gen(num=64, seed=0, **kw):
    args = dict(SMALL)
    args.update(kw)
    return generate_mqar(num, seed=seed, **args)


def _check_example(inp, tgt, V, L, N):
    """Full structural check of one example; returns the query slot indices."""
    keys, values = inp[0 : 2 * N : 2], inp[1 : 2 * N : 2]
    assert np.all((keys >= 1) & (keys < V // 2))
    assert np.all((values >= V // 2) & (values < V))
    assert len(set(keys.tolist())) == N and len(set(values.tolist())) == N
    assert np.all(tgt[: 2 * N] == IGNORE_INDEX)
    qpos = np.flatnonzero(tgt != IGNORE_INDEX)
    assert len(qpos) == N
    # Query positions are the first position of a slot.
    assert np.all(qpos >= 2 * N) and np.all((qpos - 2 * N) % 2 == 0)
    kv = dict(zip(keys.tolist(), values.tolist()))
    # Every key queried exactly once, and the label is its paired value.
    assert sorted(inp[qpos].tolist()) == sorted(keys.tolist())
    for p in qpos:
        assert tgt[p] == kv[int(inp[p])]
    return (qpos - 2 * N) // 2


@pytest.mark.parametrize("random_non_queries", [True, False])
@pytest.mark.parametrize("V_,L_,N_", [(128, 64, 8), (4, 4, 1), (16, 32, 7), (8192, 256, 64), (40, 16, 4)])
def test_structure(V_, L_, N_, random_non_queries):
    b = generate_mqar(50, vocab_size=V_, seq_len=L_, num_kv_pairs=N_, seed=3,
                      random_non_queries=random_non_queries)
    assert isinstance(b, TaskBatch)
    assert b.inputs.shape == (50, L_) and b.targets.shape == (50, L_)
    assert b.inputs.dtype == np.int32 and b.targets.dtype == np.int32
    assert b.num_examples == 50
    assert np.all((b.inputs >= 0) & (b.inputs < V_))
    np.testing.assert_array_equal(b.query_mask, b.targets != IGNORE_INDEX)
    for inp, tgt in zip(b.inputs, b.targets):
        _check_example(inp, tgt, V_, L_, N_)
        if not random_non_queries:
            qmask = tgt != IGNORE_INDEX
            qmask[: 2 * N_] = True
            assert np.all(inp[~qmask] == 0)


def test_random_non_queries_fill():
    b = _gen(200, random_non_queries=True)
    region_mask = ~b.query_mask
    region_mask[:, : 2 * N] = False
    fill = b.inputs[region_mask]
    # Roughly uniform over [0, V): both halves of the vocabulary and token 0 appear.
    assert fill.min() == 0 and fill.max() == V - 1
    assert abs(np.mean(fill < V // 2) - 0.5) < 0.02


def test_query_order_is_random():
    # The order in which keys are queried is independent of the context order.
    b = _gen(2000, seed=5, power_a=1.0)
    first_query_key = b.inputs[np.arange(2000), np.argmax(b.query_mask, axis=1)]
    which = np.array([list(row[0 : 2 * N : 2]).index(k) for row, k in zip(b.inputs, first_query_key)])
    counts = np.bincount(which, minlength=N)
    assert counts.min() > 2000 / N * 0.7 and counts.max() < 2000 / N * 1.3


def test_determinism_and_seeds():
    a, b, c = _gen(seed=11), _gen(seed=11), _gen(seed=12)
    np.testing.assert_array_equal(a.inputs, b.inputs)
    np.testing.assert_array_equal(a.targets, b.targets)
    assert not np.array_equal(a.inputs, c.inputs)
    # SeedSequence seeds work and are not mutated.
    ss = np.random.SeedSequence(7, spawn_key=(3,))
    d1, d2 = _gen(seed=ss), _gen(seed=ss)
    np.testing.assert_array_equal(d1.inputs, d2.inputs)
    assert ss.n_children_spawned == 0


def test_chunked_generation_is_valid(monkeypatch):
    # Force many small chunks: still valid, deterministic, and chunks differ.
    import gdn_jax.data.mqar as mqar

    monkeypatch.setattr(mqar, "_CHUNK_ELEMENTS", 64 * 5)  # 5 rows per chunk
    b1, b2 = _gen(23, seed=1), _gen(23, seed=1)
    np.testing.assert_array_equal(b1.inputs, b2.inputs)
    for inp, tgt in zip(b1.inputs, b1.targets):
        _check_example(inp, tgt, V, L, N)
    assert len({row.tobytes() for row in b1.inputs}) == 23


def test_sample_distinct_sparse_and_dense():
    rng = np.random.default_rng(0)
    for width, k in [(1000, 5), (10, 5), (7, 7), (100, 12)]:
        x = _sample_distinct(rng, 3000, width, k)
        assert x.shape == (3000, k)
        assert np.all((x >= 0) & (x < width))
        assert all(len(set(r)) == k for r in x.tolist())
    # Uniformity of each position (sparse path, width > 8k).
    x = _sample_distinct(rng, 50_000, 50, 3)
    for j in range(3):
        counts = np.bincount(x[:, j], minlength=50)
        assert counts.min() > 1000 * 0.8 and counts.max() < 1000 * 1.2


def test_slot_distribution_favours_early_slots():
    # L=256, N=8: 120 slots. With a=0.01, p(i) ∝ (i+1)^-0.99, so slot 0 alone has
    # ~19% of the mass and the first 10% of slots far more than 10%.
    b = generate_mqar(2000, vocab_size=256, seq_len=256, num_kv_pairs=8, seed=0)
    slots = ((np.nonzero(b.query_mask)[1] - 16) // 2)
    num_slots = 120
    counts = np.bincount(slots, minlength=num_slots)
    assert counts.sum() == 2000 * 8
    frac_first = counts[: num_slots // 10].sum() / counts.sum()
    frac_last = counts[-num_slots // 10 :].sum() / counts.sum()
    assert frac_first > 0.35, frac_first
    assert frac_last < 0.05, frac_last
    assert counts[0] == counts.max()
    # Per-slot inclusion rates match Zoology's sampler (np.random choice without
    # replacement with p(i) ∝ (i+1)^(a-1)), i.e. Gumbel-top-k is the same law.
    p = np.arange(1, num_slots + 1) ** (0.01 - 1.0)
    p /= p.sum()
    rng = np.random.default_rng(123)
    ref = np.zeros(num_slots)
    for _ in range(2000):
        ref[rng.choice(num_slots, 8, replace=False, p=p)] += 1
    np.testing.assert_allclose(counts[:12] / 2000, ref[:12] / 2000, atol=0.05)
    assert abs(frac_first - ref[:12].sum() / ref.sum()) < 0.02
    assert counts[0] / 2000 > 0.75  # slot 0 is queried in most examples
    # a = 1 is uniform over slots.
    u = generate_mqar(2000, vocab_size=256, seq_len=256, num_kv_pairs=8, seed=0, power_a=1.0)
    uslots = (np.nonzero(u.query_mask)[1] - 16) // 2
    ufrac_first = np.mean(uslots < num_slots // 10)
    assert abs(ufrac_first - 0.1) < 0.02


def test_config_and_sets():
    cfg = MQARConfig(vocab_size=8192, seq_len=32, num_kv_pairs=4, train_examples=3000, test_examples=1000, seed=0)
    test, train = make_test_set(cfg), make_train_set(cfg)
    assert test.inputs.shape == (1000, 32) and train.inputs.shape == (3000, 32)
    assert MQARConfig().test_examples >= 1000
    # Deterministic.
    np.testing.assert_array_equal(make_test_set(cfg).inputs, test.inputs)
    # Disjoint: no test example equals a training example (large vocab).
    train_rows = {r.tobytes() for r in train.inputs}
    assert not any(r.tobytes() in train_rows for r in test.inputs)
    # The seed streams differ: test vs train vs stream vs epoch, and across cfg.seed.
    def state(ss):
        return tuple(ss.generate_state(4).tolist())
    states = [state(seed_test_set(cfg)), state(seed_train_set(cfg))]
    states += [state(seed_stream_batch(cfg, s)) for s in range(5)]
    states += [state(seed_epoch_shuffle(cfg, e)) for e in range(5)]
    states += [state(seed_test_set(dataclasses.replace(cfg, seed=1)))]
    assert len(set(states)) == len(states)
    assert seed_test_set(cfg).spawn_key[0] == 1
    assert all(s.spawn_key[0] == 0 for s in (seed_train_set(cfg), seed_stream_batch(cfg, 0), seed_epoch_shuffle(cfg, 0)))
    # A different cfg.seed gives different sets.
    assert not np.array_equal(make_test_set(dataclasses.replace(cfg, seed=1)).inputs, test.inputs)


def _small_cfg(**kw):
    base = dict(vocab_size=64, seq_len=32, num_kv_pairs=4, train_examples=100, test_examples=10, seed=4)
    base.update(kw)
    return MQARConfig(**base)


def test_loader_fixed_mode():
    cfg = _small_cfg()
    loader = TaskLoader(cfg, batch_size=32, mode="fixed")
    assert loader.steps_per_epoch == 3
    train = make_train_set(cfg)
    rows = {r.tobytes(): i for i, r in enumerate(train.inputs)}
    epochs = []
    for e in range(2):
        idx = []
        for i in range(3):
            b = loader.batch(3 * e + i)
            assert b.inputs.shape == (32, 32) and b.inputs.dtype == np.int32
            for inp, tgt in zip(b.inputs, b.targets):
                j = rows[inp.tobytes()]  # every example comes from the fixed training set
                np.testing.assert_array_equal(tgt, train.targets[j])
                idx.append(j)
        assert len(set(idx)) == 96  # no repeats within an epoch
        epochs.append(idx)
    assert epochs[0] != epochs[1]  # reshuffled per epoch
    # Batches are copies: writing into one does not affect the next.
    b = loader.batch(0)
    b.inputs[:] = 0
    assert loader.batch(0).inputs.any()


def test_loader_stream_mode():
    cfg = _small_cfg()
    loader = TaskLoader(cfg, batch_size=16, mode="stream")
    assert loader.steps_per_epoch is None
    b0, b1 = loader.batch(0), loader.batch(1)
    assert not np.array_equal(b0.inputs, b1.inputs)
    for inp, tgt in zip(b0.inputs, b0.targets):
        _check_example(inp, tgt, 64, 32, 4)
    # Stream data differs from the fixed training set's data.
    fixed = TaskLoader(cfg, batch_size=16, mode="fixed").batch(0)
    assert not np.array_equal(b0.inputs, fixed.inputs)
    with pytest.raises(ValueError, match="train_set"):
        loader.train_set


@pytest.mark.parametrize("mode", ["fixed", "stream"])
def test_loader_resumable(mode):
    cfg = _small_cfg()
    a = TaskLoader(cfg, batch_size=8, mode=mode)
    b = TaskLoader(cfg, batch_size=8, mode=mode)
    # Random-access order does not matter: batch(s) is a pure function of (cfg, bs, mode, s).
    for s in [37, 0, 12, 37, 5, 100]:
        x, y = a.batch(s), b.batch(s)
        np.testing.assert_array_equal(x.inputs, y.inputs)
        np.testing.assert_array_equal(x.targets, y.targets)
    # Uninterrupted iteration == iteration resumed at step 20.
    it = iter(TaskLoader(cfg, batch_size=8, mode=mode))
    full = [next(it) for _ in range(30)]
    it2 = iter(TaskLoader(cfg, batch_size=8, mode=mode, start_step=20))
    for s in range(20, 30):
        r = next(it2)
        np.testing.assert_array_equal(r.inputs, full[s].inputs)
        np.testing.assert_array_equal(r.targets, full[s].targets)
        np.testing.assert_array_equal(r.inputs, a.batch(s).inputs)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(seq_len=63), r"seq_len.*63"),
        (dict(seq_len=30, num_kv_pairs=8), r"num_kv_pairs=8.*seq_len=30"),
        (dict(vocab_size=16, num_kv_pairs=8), r"num_kv_pairs=8.*vocab_size//2 - 1 = 7"),
        (dict(vocab_size=16, num_kv_pairs=9, seq_len=64), r"distinct values.*= 8"),
        (dict(num_examples=0), r"num_examples.*0"),
        (dict(vocab_size=3, num_kv_pairs=1), r"vocab_size.*3"),
        (dict(num_kv_pairs=0), r"num_kv_pairs.*0"),
        (dict(seed=-1), r"seed.*-1"),
        (dict(power_a=float("nan")), r"power_a"),
    ],
)
def test_value_errors(kw, match):
    args = dict(num_examples=4, vocab_size=V, seq_len=L, num_kv_pairs=N, seed=0)
    args.update(kw)
    num = args.pop("num_examples")
    with pytest.raises(ValueError, match=match):
        generate_mqar(num, **args)


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_examples=4.0),
        dict(vocab_size=128.0),
        dict(seq_len="64"),
        dict(num_kv_pairs=True),
        dict(seed=1.5),
        dict(power_a="0.01"),
        dict(random_non_queries=1),
    ],
)
def test_type_errors(kw):
    args = dict(num_examples=4, vocab_size=V, seq_len=L, num_kv_pairs=N, seed=0)
    args.update(kw)
    num = args.pop("num_examples")
    with pytest.raises(TypeError):
        generate_mqar(num, **args)


def test_numpy_integer_args_accepted():
    b = generate_mqar(np.int64(3), vocab_size=np.int32(V), seq_len=np.int64(L), num_kv_pairs=np.int16(N),
                      seed=np.uint32(2))
    assert b.inputs.shape == (3, L)


def test_config_and_loader_validation():
    with pytest.raises(ValueError, match="seq_len"):
        MQARConfig(seq_len=63)
    with pytest.raises(ValueError, match="train_examples"):
        MQARConfig(train_examples=0)
    with pytest.raises(TypeError):
        MQARConfig(test_examples=10.0)
    cfg = _small_cfg()
    with pytest.raises(ValueError, match="mode"):
        TaskLoader(cfg, 8, mode="epochs")
    with pytest.raises(ValueError, match="batch_size=101"):
        TaskLoader(cfg, 101, mode="fixed")
    TaskLoader(cfg, 101, mode="stream")  # fine: no fixed set involved
    with pytest.raises(ValueError, match="batch_size"):
        TaskLoader(cfg, 0)
    with pytest.raises(ValueError, match="step"):
        TaskLoader(cfg, 8).batch(-1)
    with pytest.raises(TypeError):
        TaskLoader(cfg, 8).batch(1.0)


def test_task_configs_carry_their_facts():
    """Each task config names itself and carries its label count, log label and headline metric."""
    from gdn_jax.data import NIAHConfig, StateTrackingConfig

    assert TASK_CONFIGS == {"mqar": MQARConfig, "niah": NIAHConfig, "state_tracking": StateTrackingConfig}
    mqar, niah, st = MQARConfig(num_kv_pairs=5), NIAHConfig(value_len=3, depth=0.5), StateTrackingConfig()
    assert (mqar.max_labels, niah.max_labels, st.max_labels) == (5, 3, None)
    assert (mqar.label, niah.label) == ("L=64 N=5", "L=1024 key=1 value=3 depth=0.5")
    assert st.label == "mod 2 train 3-40 test 40-256"
    assert [c.metric for c in (mqar, niah, st)] == ["test_accuracy", "test_accuracy", "scaled_accuracy"]
    for cfg in (mqar, niah, st):  # max_labels bounds the labels of every example
        b = cfg.generate(16, seed=1)
        if cfg.max_labels is not None:
            assert int((b.targets != IGNORE_INDEX).sum(axis=1).max()) == cfg.max_labels
        assert "name" not in {f.name for f in dataclasses.fields(cfg)}  # class facts, not fields


def test_token_ids_fit_int32_and_config_seed_is_an_int():
    from gdn_jax.data import NIAHConfig, StateTrackingConfig

    with pytest.raises(ValueError, match="int32"):
        MQARConfig(vocab_size=2 ** 32)
    with pytest.raises(ValueError, match="int32"):
        NIAHConfig(vocab_size=2 ** 32)
    with pytest.raises(ValueError, match="int32"):
        StateTrackingConfig(modulus=2 ** 40)
    with pytest.raises(TypeError, match="seed"):
        MQARConfig(vocab_size=32, seq_len=32, num_kv_pairs=4, seed=np.random.SeedSequence(3))
