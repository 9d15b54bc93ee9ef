"""``RecallConfig.context_parallel`` / ``--context_parallel``: a recall run with every sequence
split over devices (mesh ("data", "seq"), docs/context_parallel.md) on the 4 simulated CPU devices
that tests/conftest.py gives this process.

Tolerance: the train-curve losses and the evaluations of a 2 x 2 (data x seq) run equal the
unsharded (4 x 1 data-parallel) run's to 1e-5 relative (float32 rounding in another order of sums:
measured 6.9e-8 for 2 x 2, 1.4e-7 for 1 x 4, over 6 steps), the accuracies exactly.
"""
import json
import os

import jax
import numpy as np
import pytest

from gdn_jax.commands import recall
from gdn_jax.recall import RecallConfig, make_run_mesh, run, validate

TINY = dict(seq_len=32, num_kv_pairs=4, vocab_size=32, d_model=32, num_layers=2, num_heads=2, mixer="gdn",
            hybrid_every=2, batch_size=8, steps=4, warmup=1, log_every=1, eval_every=4, test_examples=16,
            eval_batch_size=8, chunk_size=16, progress=False)


def test_sequence_sharded_run_equals_unsharded(tmp_path):
    """gdn + gated attention, 4 steps: the run on a 2 x 2 mesh (batch over 'data', T over 'seq')
    has the unsharded run's train losses, accuracies and test loss (float32 rounding); the flag
    reaches the run through the command line and results.json records the mesh."""
    assert len(jax.devices()) == 4
    base, _ = run(RecallConfig(out=str(tmp_path / "cp1"), **TINY))
    flags = [f"--{k}={v}" for k, v in TINY.items() if k != "progress"] + ["--no-progress"]
    cp = recall(flags + ["--context_parallel", "2", "--out", str(tmp_path / "cp2")])
    assert base["mesh_shape"] == {"data": 4} and cp["mesh_shape"] == {"data": 2, "seq": 2}
    assert cp["num_devices"] == 4 and cp["config"]["context_parallel"] == 2
    with open(tmp_path / "cp2" / "results.json") as f:
        assert json.load(f)["mesh_shape"] == {"data": 2, "seq": 2}
    a, b = np.array(base["train_curve"]), np.array(cp["train_curve"])
    assert a.shape == b.shape == (4, 3)
    np.testing.assert_allclose(b[:, 1], a[:, 1], rtol=1e-5)  # loss per step
    np.testing.assert_array_equal(b[:, 2], a[:, 2])  # accuracy per step
    assert len(np.unique(a[:, 1])) == 4  # the losses move: the comparison is over trained steps
    for e0, e1 in zip(base["evals"], cp["evals"]):
        assert e0["step"] == e1["step"]
        np.testing.assert_allclose(e1["test_loss"], e0["test_loss"], rtol=1e-5)
        assert e1["test_accuracy"] == e0["test_accuracy"]


@pytest.mark.parametrize("kw, match", [
    (dict(seq_len=30), r"RecallConfig\.seq_len = 30 must be a multiple of RecallConfig\.context_parallel = 4"),
    (dict(context_parallel=16, seq_len=32), r"shards of 2 tokens, fewer than the short convolution's halo of 3"),
    (dict(pos_embedding="learned"), r"pos_embedding = 'learned' is not supported with RecallConfig\.context_parallel"),
    (dict(task="state_tracking", test_max_len=250), r"RecallConfig\.test_max_len = 250 must be a multiple"),
    (dict(context_parallel=0), r"RecallConfig\.context_parallel must be >= 1"),
])
def test_bad_settings_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        validate(RecallConfig(**{"context_parallel": 4, **kw}))


def test_devices_and_batch_checked(tmp_path):
    """context_parallel must divide the devices, the batch the data axis; attention-only models
    have no conv halo to check; the mesh is data x seq."""
    with pytest.raises(ValueError, match=r"context_parallel = 3 must divide the 4 devices"):
        make_run_mesh(RecallConfig(context_parallel=3, seq_len=60, num_kv_pairs=4))
    assert dict(make_run_mesh(RecallConfig(context_parallel=4)).shape) == {"data": 1, "seq": 4}
    validate(RecallConfig(context_parallel=16, seq_len=32, mixer="attention"))
    with pytest.raises(ValueError, match=r"batch_size=3 is not divisible by the 2 devices of the data axis"):
        run(RecallConfig(**dict(TINY, batch_size=3, context_parallel=2, out=str(tmp_path / "b"))))
    assert not os.path.exists(tmp_path / "b" / "results.json")
