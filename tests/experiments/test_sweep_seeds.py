"""Sweeps over seeds (mean ± std in the summaries), live progress of the run in flight, and the
compiled train step shared by a process's runs of the same shapes (learning rate as an argument)."""
import csv
import json

import jax
import numpy as np
import pytest

from gdn_jax import step_cache
from gdn_jax import sweep as S
from gdn_jax import training as T

BASE = ("vocab_size=32", "num_heads=2", "steps=6", "warmup=1", "batch_size=8", "eval_every=3", "test_examples=16",
        "eval_batch_size=16", "backend=chunk", "chunk_size=16", "log_every=2")


def _cfg(tmp_path, **kw):
    return S.SweepConfig(**{**dict(mixers=("linear",), d_models=(16,), seq_lens=(16,), num_kv_pairs=(2,),
                                   lrs=(1e-2, 3e-3), base=BASE, out=str(tmp_path), progress=False,
                                   skip_lrs_after_target=False), **kw})


def test_seed_axis_mean_and_spread_and_one_compiled_step(tmp_path):
    step_cache.clear()
    cfg = _cfg(tmp_path, seeds=(0, 1))
    summary = S.run_sweep(cfg)
    (cell,) = S.cells(cfg)
    res = {(lr, s): json.load(open(tmp_path / "runs" / cell.name / f"lr{lr:g}_seed{s}" / "results.json"))
           for lr in cfg.lrs for s in cfg.seeds}
    assert {k: r["config"]["seed"] for k, r in res.items()} == {k: k[1] for k in res}
    # four runs of one shape: one compiled train step (the rate is an argument), one eval step
    assert len(step_cache._CACHE) == 1
    ((train, evaluate),) = step_cache._CACHE.values()
    assert train._cache_size() == 1 and evaluate._cache_size() == 1
    # the summary: the rate with the best mean, mean and sample std over the seeds
    means = {lr: np.mean([res[lr, s]["best_test_accuracy"] for s in cfg.seeds]) for lr in cfg.lrs}
    (b,) = summary["cells"]
    assert b["lr"] == max(means, key=means.get) and b["best_test_accuracy"] == pytest.approx(means[b["lr"]])
    accs = [res[b["lr"], s]["best_test_accuracy"] for s in cfg.seeds]
    assert b["best_test_accuracy_std"] == pytest.approx(np.std(accs, ddof=1))
    assert b["n_seeds"] == 2 and b["seeds"] == [0, 1] and b["steps"] == 6
    rows = list(csv.DictReader(open(tmp_path / "runs.csv")))
    assert sorted((float(r["lr"]), int(r["seed"])) for r in rows) == sorted(res)
    assert "best_test_accuracy_std" in next(csv.DictReader(open(tmp_path / "summary.csv")))
    md = open(tmp_path / "summary.md").read()
    assert f"{100 * b['best_test_accuracy']:.1f} ± {100 * b['best_test_accuracy_std']:.1f} (2 seeds, 6 steps" in md
    for name in ("accuracy_vs_dmodel.png", "accuracy_vs_lr.png"):
        assert (tmp_path / name).stat().st_size > 10_000

    # one seed: no spread; the base's seed with the axis is refused
    one = S.summarize(_cfg(tmp_path, seeds=(0,)))
    assert one["cells"][0]["best_test_accuracy_std"] is None and "±" not in open(tmp_path / "summary.md").read()
    with pytest.raises(ValueError, match="SweepConfig.seeds"):
        S.validate(_cfg(tmp_path / "x", seeds=(0, 1), base=BASE + ("seed=3",)))
    with pytest.raises(ValueError, match="SweepConfig.seeds repeats"):
        S.validate(_cfg(tmp_path / "x", seeds=(1, 1)))


def test_live_progress_of_the_run_in_flight(tmp_path, capsys, monkeypatch):
    class Bar:
        shown = []

        def set_postfix_str(self, s):
            self.shown.append(s)

    cfg = _cfg(tmp_path, lrs=(1e-2,))
    S.run_cell(cfg, S.cells(cfg)[0], progress=Bar())
    name = S.cells(cfg)[0].name
    assert Bar.shown[0].startswith(f"{name} lr 0.01: step 2/6, loss ")
    assert any("step 4/6" in s and " acc " in s and " test " in s for s in Bar.shown), Bar.shown
    # the sweep's own bar (one process) shows it where it is seen live
    import gdn_jax.recall as R

    with monkeypatch.context() as m:
        m.setattr(R, "live_progress", lambda cls: True)
        S.run_sweep(_cfg(tmp_path / "bar", lrs=(1e-2,), progress=True))
    assert f"{name} lr 0.01: step 6/6" in capsys.readouterr().err
    # in a log (stderr not a terminal, as captured here): no bar ('\r' lines), a line per finished cell
    S.run_sweep(_cfg(tmp_path / "log", lrs=(1e-2,), progress=True))
    err = capsys.readouterr().err
    assert "\r" not in err and f": {name} done (1/1 cells)" in err


def test_shared_step_equals_the_optimizer_at_that_rate():
    """The step with the rate as an argument (optimizer built at rate 1) against make_optimizer(lr):
    the same parameters after a few steps up to float32 rounding (AdamW with weight decay, clipping,
    warmup + cosine)."""
    from flax import nnx

    from gdn_jax.models import LM, LMConfig

    model = LM(LMConfig(vocab_size=32, d_model=16, num_layers=1, num_heads=2, mixer="gdn", backend="chunk",
                        chunk_size=16), rngs=nnx.Rngs(0))
    mesh = T.make_mesh()
    opt = dict(warmup_steps=2, total_steps=8, weight_decay=0.1, min_lr_ratio=0.1, b1=0.9, b2=0.98, grad_clip=1.0,
               steps_per_epoch=None)
    rng = np.random.default_rng(0)
    batches = [T.shard_batch((rng.integers(0, 32, (4, 16)).astype(np.int32),
                              rng.integers(0, 32, (4, 16)).astype(np.int32)), mesh) for _ in range(5)]
    out = {}
    for lr in (3e-3, 2e-2):
        tx = T.make_optimizer(lr, **opt)
        graphdef, s_ref = T.create_train_state(model, tx, mesh=mesh)
        s_new = s_ref
        ref = T.make_train_step(graphdef, tx, mesh)
        new, _ = step_cache.shared_steps(graphdef, mesh, lr=lr, optimizer=opt, max_scored=None)
        for b in batches:
            s_ref, _ = ref(s_ref, b)
            s_new, _ = new(s_new, b)
        a, c = jax.tree.leaves(s_ref.params), jax.tree.leaves(s_new.params)
        num = np.sqrt(sum(float(np.sum((np.asarray(x) - np.asarray(y)) ** 2)) for x, y in zip(a, c)))
        moved = np.sqrt(sum(float(np.sum((np.asarray(x) - np.asarray(y)) ** 2))
                            for x, y in zip(a, jax.tree.leaves(T.create_train_state(model, tx)[1].params))))
        out[lr] = moved
        assert num <= 1e-4 * moved, (lr, num, moved)  # the updates agree to float32 rounding
    assert out[2e-2] > 2 * out[3e-3]  # and the rate is used: a larger rate moves the parameters further
    with pytest.raises(ValueError, match="lr"):
        step_cache.shared_steps(graphdef, mesh, lr=-1.0, optimizer=opt, max_scored=None)
