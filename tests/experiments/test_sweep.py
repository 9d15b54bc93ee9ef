"""Smoke tests of the recall suite: every mixer and every task trains from the sweep runner (the loss
must fall; no accuracy asserted), resumption, best-LR selection, worker processes, bad arguments."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from gdn_jax import sweep as S

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "experiments", "sweep.py")
ALL_MIXERS = ("gdn", "deltanet", "mamba2", "gla", "linear", "kda", "attention", "gated_attention", "hybrid")


def _smoke(task, out, **kw):
    cfg = S.apply_preset(S.SweepConfig(preset="cpu_smoke", task=task, out=str(out), progress=False, **kw),
                         explicit=["task", "out", "progress", *kw])
    return cfg, S.run_sweep(cfg)


# Every mixer trains on one task and every task trains several mixers (gdn on each): 11 of the 27
# task x mixer cells, each compiled and trained like the preset's (the models read only tokens;
# the tasks differ in data, lengths and metric).
TASK_MIXERS = {"mqar": ("gdn", "deltanet", "mamba2", "kda"), "niah": ("gdn", "gla", "linear", "gated_attention"),
               "state_tracking": ("gdn", "attention", "hybrid")}


def test_task_mixers_cover_every_mixer():
    from gdn_jax.models.lm import MIXERS

    assert sorted(ALL_MIXERS) == sorted(set(MIXERS) | {"hybrid"})  # a new mixer joins the smoke test
    assert S.apply_preset(S.SweepConfig(preset="cpu_smoke")).mixers == ALL_MIXERS
    assert sorted({m for ms in TASK_MIXERS.values() for m in ms}) == sorted(ALL_MIXERS)
    assert all("gdn" in ms for ms in TASK_MIXERS.values())


@pytest.mark.parametrize("task", list(TASK_MIXERS))
def test_every_mixer_trains(task, tmp_path):
    cfg, summary = _smoke(task, tmp_path, mixers=TASK_MIXERS[task])
    assert cfg.mixers == TASK_MIXERS[task]
    assert sorted(c["mixer"] for c in summary["cells"]) == sorted(TASK_MIXERS[task])
    for c in summary["cells"]:
        r = json.load(open(os.path.join(tmp_path, "runs", c["cell"], f"lr{cfg.lrs[0]:g}", "results.json")))
        curve = r["train_curve"]
        first = sum(x[1] for x in curve[:3]) / 3
        last = sum(x[1] for x in curve[-3:]) / 3
        assert last < first - 0.01, (c["cell"], first, last)  # the loss falls
        assert r["task"] == task and r["steps"] == 24
        if c["mixer"] == "hybrid":
            assert r["config"]["hybrid_every"] == 4 and r["config"]["num_layers"] == 4
    for name in ("runs.csv", "summary.csv", "summary.json", "accuracy_vs_dmodel.png"):
        assert os.path.getsize(tmp_path / name) > 0
    assert not (tmp_path / "accuracy_vs_lr.png").exists()  # one learning rate: no lr figure
    if task == "state_tracking":
        assert all(c["best_scaled_accuracy"] is not None for c in summary["cells"])
    # the summary names only the axes the task has (they used to show a never-used "L 32, 4 pairs")
    md = open(tmp_path / "summary.md").read()
    head = {"mqar": "## L 32, 4 pairs", "niah": "## L 32\n", "state_tracking": "## lengths of the task config"}[task]
    assert head in md, md
    assert all((c["num_kv_pairs"] is None) == (task != "mqar") for c in summary["cells"])


def test_resume_best_lr_and_neg_eigval(tmp_path):
    kw = dict(mixers=("deltanet",), lrs=(1e-4, 1e-2), neg_eigval=(False, True))
    # beta in (0, 2) only where there is a delta rule: the grid (what run_sweep trains) has no
    # mamba2 "_neg" cell (mamba2 itself trains in test_every_mixer_trains)
    both = dict(kw, mixers=("deltanet", "mamba2"))
    grid = S.apply_preset(S.SweepConfig(preset="cpu_smoke", task="state_tracking", **both), explicit=["task", *both])
    assert sorted(c.name for c in S.cells(grid)) == ["state_tracking_deltanet_d16", "state_tracking_deltanet_d16_neg",
                                                     "state_tracking_mamba2_d16"]
    cfg, summary = _smoke("state_tracking", tmp_path, **kw)
    names = sorted(c["cell"] for c in summary["cells"])
    assert names == ["state_tracking_deltanet_d16", "state_tracking_deltanet_d16_neg"]
    neg = json.load(open(tmp_path / "runs" / "state_tracking_deltanet_d16_neg" / "lr0.0001" / "results.json"))
    assert neg["config"]["allow_neg_eigval"] is True
    for c in summary["cells"]:  # the best LR is the one with the best (scaled) accuracy
        runs = [json.load(open(tmp_path / "runs" / c["cell"] / f"lr{lr:g}" / "results.json")) for lr in cfg.lrs]
        assert c["best_scaled_accuracy"] == max(r["best_scaled_accuracy"] for r in runs)
        assert c["lrs_tried"] == [1e-4, 1e-2]
    assert os.path.getsize(tmp_path / "accuracy_vs_lr.png") > 10_000  # two learning rates: the lr figure
    # a second sweep over the same folder trains nothing
    mtimes = {p: os.path.getmtime(p) for p in (tmp_path / "runs").rglob("results.json")}
    S.run_sweep(cfg)
    assert mtimes == {p: os.path.getmtime(p) for p in (tmp_path / "runs").rglob("results.json")}


def test_workers_split_cells(tmp_path):
    """Two worker processes (here two on the one CPU device: ``workers_per_device``; on a multi-GPU
    host one or more per device) share the grid."""
    argv = ["--preset", "cpu_smoke", "--mixers", "linear", "attention", "mamba2", "--d_models", "8",
            "--out", str(tmp_path), "--workers_per_device", "2", "--no-progress"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=os.path.join(REPO, ".jax_cache"))
    p = subprocess.run([sys.executable, SCRIPT, *argv], cwd=str(tmp_path), env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    summary = json.load(open(tmp_path / "summary.json"))
    assert sorted(c["mixer"] for c in summary["cells"]) == ["attention", "linear", "mamba2"]
    logs = [open(tmp_path / f"worker{i}.log").read() for i in range(2)]
    claimed = [line.split()[-1] for log in logs for line in log.splitlines() if line.startswith("[worker")]
    assert sorted(claimed) == sorted(c["cell"] for c in summary["cells"])  # each cell trained exactly once


def test_workers_split_learning_rates(tmp_path):
    """``--lrs_in_parallel``: workers claim (cell, learning rate) runs, so one cell's two rates train
    in two processes at once (each run once); without it one worker takes the whole cell."""
    argv = ["--preset", "cpu_smoke", "--mixers", "linear", "--d_models", "8", "--lrs", "0.001", "0.003",
            "--out", str(tmp_path), "--workers_per_device", "2", "--no-progress", "--lrs_in_parallel"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=os.path.join(REPO, ".jax_cache"))
    p = subprocess.run([sys.executable, SCRIPT, *argv], cwd=str(tmp_path), env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    logs = [open(tmp_path / f"worker{i}.log").read() for i in range(2)]
    claims = [[line.split(None, 2)[2] for line in log.splitlines() if line.startswith("[worker")] for log in logs]
    (cell,) = [c["cell"] for c in json.load(open(tmp_path / "summary.json"))["cells"]]
    assert sorted(c for cl in claims for c in cl) == [f"{cell} lr 0.001", f"{cell} lr 0.003"]
    assert all(len(cl) == 1 for cl in claims)  # one rate each: the cell's two runs in two workers
    for lr in ("0.001", "0.003"):
        assert (tmp_path / "runs" / cell / f"lr{lr}" / "results.json").exists()


def test_rates_skipped_once_one_reached_the_target(tmp_path, monkeypatch):
    """With skip_lrs_after_target, a rate of the cell that reached the target (whichever rate, e.g.
    one that a parallel worker finished first) makes the cell done: its unstarted rates are not run;
    without the skip every rate runs."""
    import gdn_jax.recall as R

    cfg = S.apply_preset(S.SweepConfig(preset="cpu_smoke", mixers=("linear",), d_models=(8,), lrs=(1e-3, 3e-3),
                                       out=str(tmp_path), progress=False),
                         explicit=["mixers", "d_models", "lrs", "out", "progress"])
    cell = S.cells(cfg)[0]
    later = S._results_path(cfg, cell, 3e-3)
    os.makedirs(os.path.dirname(later))
    with open(later, "w") as f:
        json.dump({"reached_target": True}, f)
    trained = []
    monkeypatch.setattr(R, "run", lambda rc: trained.append(rc.lr) or ({"reached_target": False, "ckpt_dir": ""},))
    assert S.cell_done(cfg, cell)
    assert S.run_cell(cfg, cell) and trained == []
    # a rate that had started (it has a checkpoint: it ran beside the one that reached the target and
    # was interrupted) is not skipped: it resumes and finishes
    ckpt = S.run_config(cfg, cell, 1e-3).out + "/ckpt/7"
    os.makedirs(ckpt)
    assert not S.cell_done(cfg, cell)
    assert S.run_cell(cfg, cell) and trained == [1e-3]
    os.rmdir(ckpt)
    cfg = dataclasses.replace(cfg, skip_lrs_after_target=False)
    assert not S.cell_done(cfg, cell)
    assert S.run_cell(cfg, cell) and trained == [1e-3, 1e-3]


def test_flags_with_equals_override_the_preset(monkeypatch):
    """``--name=value`` is as explicit as ``--name value``: the preset does not override it."""
    import runpy

    ns = runpy.run_path(SCRIPT)
    seen = {}
    monkeypatch.setattr(S, "run_sweep", lambda cfg, argv=(), script=None: seen.setdefault("cfg", cfg) and {})
    ns["main"](["--preset", "cpu_smoke", "--mixers=linear", "--d_models=8", "--lrs=0.001", "--out=/tmp/never"])
    cfg = seen["cfg"]
    assert (cfg.mixers, cfg.d_models, cfg.lrs, cfg.out) == (("linear",), (8,), (0.001,), "/tmp/never")


def test_visible_device_ids():
    """Workers go to the sweep's own visible devices (CUDA_VISIBLE_DEVICES=1,2,3 keeps device 0
    for other work), else to 0 .. n - 1; a list that disagrees with JAX's count is an error."""
    assert S.visible_device_ids(None, 2) == ["0", "1"]
    assert S.visible_device_ids("", 1) == ["0"]
    assert S.visible_device_ids("1, 2,3", 3) == ["1", "2", "3"]
    assert S.visible_device_ids("5", 0) == ["5"]
    with pytest.raises(ValueError, match="name 2 devices but JAX sees 3"):
        S.visible_device_ids("0,1", 3)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        S.apply_preset(S.SweepConfig(preset="nope"))
    with pytest.raises(ValueError, match="unknown mixer"):
        S.cells(S.SweepConfig(mixers=("gdn", "mamba3")))
    with pytest.raises(ValueError, match="not a RecallConfig field"):
        S.run_config(S.SweepConfig(base=("stepz=3",)), S.cells(S.SweepConfig())[0], 1e-3)
    with pytest.raises(ValueError, match="field=value"):
        S.run_config(S.SweepConfig(base=("steps",)), S.cells(S.SweepConfig())[0], 1e-3)
    with pytest.raises(ValueError, match=r"bad SweepConfig\.base setting: RecallConfig\.steps: invalid int value"):
        S.run_config(S.SweepConfig(base=("steps=many",)), S.cells(S.SweepConfig())[0], 1e-3)
    with pytest.raises(ValueError, match=r"set by the sweep.*SweepConfig\.d_models"):
        S.run_config(S.SweepConfig(base=("d_model=32",)), S.cells(S.SweepConfig())[0], 1e-3)
    with pytest.raises(ValueError, match=r"set by the sweep.*'hybrid' in SweepConfig\.mixers"):
        S.run_config(S.SweepConfig(base=("hybrid_every=2",)), S.cells(S.SweepConfig())[0], 1e-3)
    # base values are parsed by the RecallConfig field's type
    rc = S.run_config(S.SweepConfig(base=("max_steps=none", "random_non_queries=false", "depth=0.25", "steps=9")),
                      S.cells(S.SweepConfig())[0], 1e-3)
    assert (rc.max_steps, rc.random_non_queries, rc.depth, rc.steps) == (None, False, 0.25, 9)
    # the whole grid is checked before anything trains; nothing is written
    bad = [dict(task="foo"), dict(lrs=()), dict(d_models=(0,)), dict(seq_lens=(8,), num_kv_pairs=(4,)),
           dict(workers=-1), dict(workers_per_device=0), dict(d_models=(30,), base=("num_heads=4",)), dict(lrs=(float("nan"),)),
           dict(worker_index=-1), dict(lrs=(1e-3, 1e-3)), dict(lrs=(1e-3, 1.0000001e-3)),
           # an axis the task has not (its values used to collapse to the first, silently)
           dict(task="state_tracking", seq_lens=(32, 64)), dict(task="niah", num_kv_pairs=(4, 8)),
           dict(task="niah", shapes=("64x4",))]
    for kw in bad:
        out = tmp_path / "never"
        with pytest.raises(ValueError):
            S.run_sweep(S.SweepConfig(out=str(out), progress=False, mixers=("gdn",), **kw))
        assert not out.exists(), kw
    # the command line: the same errors as exit messages naming the sweep's flags
    import runpy

    main = runpy.run_path(SCRIPT)["main"]
    for argv, msg in [(["--task", "foo"], r"^sweep\.py: error: --task must be one of"),
                      (["--preset", "nope"], r"^sweep\.py: error: --preset must be one of"),
                      (["--base", "d_model=32"], r"^sweep\.py: error: --base setting 'd_model' is set by the sweep; use --d_models$"),
                      (["--base", "steps=many"], r"bad --base setting: RecallConfig\.steps: invalid int value"),
                      (["--lrs", "0.001", "0.001"], r"--lrs has rates that repeat")]:
        with pytest.raises(SystemExit, match=msg):
            main(argv + ["--out", str(tmp_path / "never"), "--no-progress"])
    assert not (tmp_path / "never").exists()


def test_recall_rejects_bad_settings(tmp_path):
    """The library raises ValueError naming the RecallConfig field; the script exits with the flag."""
    from gdn_jax.recall import RecallConfig, build

    cases = [(dict(mixer="mamba2", allow_neg_eigval=True), r"RecallConfig\.allow_neg_eigval needs a delta-rule"),
             (dict(hybrid_every=4, num_layers=2), r"RecallConfig\.hybrid_every"),
             (dict(lr=-1.0), r"RecallConfig\.lr"), (dict(d_model=-16), r"RecallConfig\.d_model"),
             (dict(num_layers=0), r"RecallConfig\.num_layers"), (dict(task="niah", value_len=100, seq_len=64), "niah"),
             (dict(steps=0), r"RecallConfig\.steps"), (dict(batch_size=0), r"RecallConfig\.batch_size"),
             (dict(eval_every=0), r"RecallConfig\.eval_every"),
             (dict(num_heads=3), r"divisible by RecallConfig\.num_heads"),
             (dict(max_time_s=-1.0), r"RecallConfig\.max_time_s"), (dict(steps=20, warmup=5000), r"RecallConfig\.warmup"),
             (dict(target_accuracy=2.0), r"RecallConfig\.target_accuracy"), (dict(max_steps=-1), r"RecallConfig\.max_steps"),
             (dict(task="parity"), r"RecallConfig\.task"), (dict(backend="cuda"), r"RecallConfig\.backend"),
             (dict(hybrid_mixer="rnn"), r"RecallConfig\.hybrid_mixer"),
             (dict(task="niah", data_mode="fixed"), r"RecallConfig\.data_mode"),
             (dict(steps=300, max_steps=400), r"RecallConfig\.max_steps"), (dict(b1=1.5), r"RecallConfig\.b1"),
             (dict(b2=-0.1), r"RecallConfig\.b2"), (dict(weight_decay=-1.0), r"RecallConfig\.weight_decay"),
             (dict(grad_clip=-1.0), r"RecallConfig\.grad_clip"), (dict(min_lr_ratio=2.0), r"RecallConfig\.min_lr_ratio"),
             (dict(seed=-1), r"RecallConfig\.seed"), (dict(backend="pallas", chunk_size=48), "chunk_size=48"),
             (dict(backend="pallas", mixer="kda"), "per-key-channel g")]
    # a baseline option no layer of the run reads (it used to be recorded as if used)
    cases += [(dict(mixer="gdn", attn_bias="qkvo"), r"RecallConfig\.attn_bias = 'qkvo' is an option of the attention"),
              (dict(mixer="attention", gla_expand_k=0.5), r"RecallConfig\.gla_expand_k"),
              (dict(mixer="gla", mamba2_dt_input=True), r"RecallConfig\.mamba2_dt_input")]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            build(RecallConfig(out=str(tmp_path), **kw))
    build(RecallConfig(out=str(tmp_path), mixer="gdn", hybrid_every=2, rope_fraction=0.5))  # the hybrid reads it
    # an output / checkpoint folder that is a file (or under one): refused before anything trains (a
    # --ckpt_dir file used to fail in orbax at the first checkpoint, after a 5-minute wait)
    afile = tmp_path / "afile"
    afile.write_text("")
    for kw, msg in [(dict(out=str(afile)), r"RecallConfig\.out='.*afile' is a file, not a folder"),
                    (dict(out=str(tmp_path), ckpt_dir=str(afile / "sub")), r"RecallConfig\.ckpt_dir=.* lies under the file")]:
        with pytest.raises(ValueError, match=msg):
            build(RecallConfig(**kw))
    with pytest.raises(ValueError, match=r"SweepConfig\.ckpt_root=.* is a file"):
        S.run_sweep(S.SweepConfig(out=str(tmp_path / "sw"), ckpt_root=str(afile), progress=False, mixers=("gdn",)))
    assert not (tmp_path / "sw").exists()
    # a value of the wrong type: TypeError naming the field (lr="x" used to fail in math.isfinite)
    for kw, msg in [(dict(seq_len=64.0), r"RecallConfig\.seq_len must be an int, got float 64\.0"),
                    (dict(lr="x"), r"RecallConfig\.lr must be a float, got str 'x'"),
                    (dict(resume="no"), r"RecallConfig\.resume must be a bool"),
                    (dict(max_time_s="1"), r"RecallConfig\.max_time_s must be a float or None")]:
        with pytest.raises(TypeError, match=msg):
            build(RecallConfig(out=str(tmp_path), **kw))
    # NumPy scalars become Python ones (they reach JSON: results, checkpoint metadata)
    import numpy as np

    rc = RecallConfig(steps=np.int64(40), lr=np.float32(3e-3), resume=np.bool_(False))
    assert type(rc.steps) is int and type(rc.lr) is float and type(rc.resume) is bool
    # head_dim set: d_model need not be a multiple of num_heads
    assert build(RecallConfig(out=str(tmp_path), d_model=30, num_heads=4, head_dim=8))[2].head_dim == 8
    # the command line: the same checks, as an exit message naming the flags (nothing trains)
    import runpy

    main = runpy.run_path(os.path.join(REPO, "experiments", "recall.py"))["main"]
    for argv, msg in [(["--lr", "-1"], r"^recall\.py: error: --lr must be a positive finite number, got -1\.0$"),
                      (["--num_heads", "3"], r"--d_model must be divisible by --num_heads 3"),
                      (["--task", "niah", "--data_mode", "fixed"], r"--data_mode must be 'stream'"),
                      (["--backend", "pallas", "--chunk_size", "48"], r"^recall\.py: error: .*chunk_size=48"),
                      (["--steps", "10", "--warmup", "20"],
                       r"^recall\.py: error: --warmup must be in \[0, --steps\) = \[0, 10\), got 20"),
                      (["--steps", "50"], r"--warmup must be in \[0, --steps\) = \[0, 50\), got 200 \(the default "
                                          r"warmup is 200 steps: pass a smaller --warmup with a short --steps\)")]:
        with pytest.raises(SystemExit, match=msg):
            main(argv + ["--out", str(tmp_path / "cli")])


def test_divergence_is_reported(tmp_path):
    """A NaN loss stops the run; results.json stays strict JSON (NaN -> null)."""
    from gdn_jax.recall import RecallConfig, run

    res, _ = run(RecallConfig(vocab_size=32, seq_len=32, num_kv_pairs=4, d_model=16, batch_size=8, lr=1e4,
                              grad_clip=0.0, warmup=1, steps=40, eval_every=5, test_examples=16,
                              eval_batch_size=16, backend="chunk", chunk_size=16, progress=False, out=str(tmp_path)))
    assert res["diverged"] and res["steps"] < 40
    text = open(tmp_path / "results.json").read()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))


def test_bench_train_step_runs():
    """benchmarks/bench_train_step.py --quick prints a table row per mixer and population size
    (``--population 2``: two runs vmapped in one step, run-steps/s = 2 x steps/s)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=os.path.join(REPO, ".jax_cache"))
    p = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_train_step.py"), "--quick",
                        "--mixers", "gdn", "gla", "--population", "1", "2"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    table = [r.split() for r in p.stdout.split("first-step s")[-1].split("\n")[1:] if r.strip()]
    assert [r[0] for r in table] == ["gdn", "gdn", "gla", "gla"]
    assert [r[-1] for r in table] == ["-", "2", "-", "2"]  # "pop 2" ends the population rows
    for r in table:
        P = 2 if r[-1] == "2" else 1
        assert abs(float(r[4]) - P * float(r[3])) <= 0.11 * P, r  # run-steps/s = P x steps/s (rounded)


def test_bench_pallas_runs():
    """benchmarks/bench_pallas.py --quick (CPU: interpret mode) checks numerics, times pallas and a
    variant (with the variant's own numerics) and prints the summary table last."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=os.path.join(REPO, ".jax_cache"))
    p = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_pallas.py"), "--quick", "--no-chunk",
                        "--no-jla", "--variants-first", "--variants", "warps_wy=8", "--reps", "2"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    out = p.stdout
    assert "pallas[warps_wy=8] vs chunk rel_rms: o" in out
    summary = out.split("SUMMARY")[-1]
    assert "pallas[warps_wy=8]" in summary and "pallas vs chunk rel_rms" in summary
    # the variant only changes Triton settings: on CPU (interpret) its numbers equal pallas's
    errs = [line.split("rel_rms:")[1].split()[1] for line in out.splitlines() if "vs chunk rel_rms:" in line]
    assert len(errs) >= 2 and float(errs[0]) < 5e-3 and len(set(errs)) == 1, errs


def test_check_gpu_runs():
    """benchmarks/check_gpu.py --quick (CPU: interpret mode) runs its float64-reference cases, names
    the forward and backward kernels that ran and exits 0 when every case is within the tolerances."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=os.path.join(REPO, ".jax_cache"))
    p = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "check_gpu.py"), "--quick", "--dtypes",
                        "float32", "--configs", ""], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "3 of 3 cases within the suite's tolerances" in p.stdout
    assert p.stdout.count(" interpret/interpret ") >= 3  # the kernels that ran, fwd / bwd (CPU: interpret mode)


def test_mqar_filler_switch():
    """``random_non_queries`` reaches the MQAR generator: 0-filled query region when False."""
    import numpy as np

    from gdn_jax.recall import RecallConfig, make_task

    for flag in (True, False):
        task = make_task(RecallConfig(vocab_size=64, seq_len=64, num_kv_pairs=4, random_non_queries=flag))
        assert task.random_non_queries is flag
        b = task.generate(8, seed=0)
        region = np.asarray(b.inputs)[:, 8:]  # after the 4 key-value pairs
        queries = np.asarray(b.targets)[:, 8:] != -100
        zero_frac = float((region[~queries] == 0).mean())  # the query region's other tokens
        assert (zero_frac > 0.8) if not flag else (zero_frac < 0.1), (flag, zero_frac)


def test_mqar_compare_on_committed_results(tmp_path):
    """experiments/mqar_compare.py puts the committed H200 sweep beside the published numbers."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mqar_compare", os.path.join(REPO, "experiments", "mqar_compare.py"))
    mc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mc)
    res = os.path.join(REPO, "results")
    out = str(tmp_path / "cmp")
    mc.main([os.path.join(res, "mqar_h200_v2"), "--extra", "300 s=" + os.path.join(res, "mqar_h200_long", "gla"),
             "--out", out])
    md = open(out + ".md").read()
    assert "L = 512, 64 pairs, vocab 8192" in md and "| deltanet |" in md and "/ 100" in md
    assert "92.3 (2948 steps, capped, lr 0.003); 300 s: 99.2 (7000 steps, lr 0.003) / 95" in md
    assert os.path.getsize(out + ".png") > 10_000
    assert "(partial)" not in md.split("\n\n", 1)[1]  # the table (the header explains the mark)
    # a cell with learning rates still to run (the summary's "unfinished") is marked, the others not
    with open(os.path.join(res, "mqar_h200_v2", "summary.json")) as f:
        s = json.load(f)
    gla64 = next(c["cell"] for c in s["cells"] if c["mixer"] == "gla" and int(c["d_model"]) == 64)
    os.makedirs(tmp_path / "pending")
    with open(tmp_path / "pending" / "summary.json", "w") as f:
        json.dump(dict(s, unfinished=[gla64]), f)
    mc.main([str(tmp_path / "pending"), "--out", out])
    rows = {ln.split("|")[1].strip(): ln for ln in open(out + ".md").read().splitlines() if ln.startswith("| ")}
    assert rows["gla"].split("|")[2].count("(partial)") == 1 and "(partial)" not in rows["gdn"], rows
    # another setting: no published column; mixing settings, bad folders and arguments are refused
    mc.main([os.path.join(res, "sweep_cpu_mqar"), "--out", out])
    md = open(out + ".md").read()
    assert "L = 64, 8 pairs, vocab 256" in md and "/ 100" not in md and "/ 81" not in md
    (tmp_path / "afile").write_text("")
    for argv in (["--extra", "no-label"], ["--extra", "cpu=" + os.path.join(res, "sweep_cpu_mqar")],
                 ["--out", str(tmp_path / "afile" / "x")], ["--shape", "64"], ["--shape", "128x9"]):
        with pytest.raises(SystemExit):
            mc.main([os.path.join(res, "mqar_h200_v2"), "--out", out, *argv])
    mc.main([os.path.join(res, "mqar_h200_v2"), "--out", str(tmp_path / "new" / "cmp")])  # its folder is made
    assert os.path.exists(tmp_path / "new" / "cmp.md")
    # a sweep over several (seq_len, kv pairs): one point at a time with --shape (it used to have no way)
    with pytest.raises(SystemExit):
        mc.main([os.path.join(res, "zoology_fig2"), "--out", out])
    mc.main([os.path.join(res, "zoology_fig2"), "--shape", "128x8", "--out", out])
    assert "L = 128, 8 pairs" in open(out + ".md").read()
    for folder in (os.path.join(res, "parity_h200"), str(tmp_path / "nothing")):
        with pytest.raises(SystemExit):
            mc.main([folder, "--out", out])
    with pytest.raises(ValueError, match="not an MQAR sweep"):
        mc.load(os.path.join(res, "parity_h200"))


def test_changed_settings_refused(tmp_path):
    """A finished run is not silently reused when the sweep's settings have changed since."""
    kw = dict(preset="cpu_smoke", mixers=("linear",), d_models=(8,), out=str(tmp_path), progress=False)
    cfg = S.apply_preset(S.SweepConfig(**kw), explicit=["mixers", "d_models"])
    S.run_sweep(cfg)
    S.run_sweep(dataclasses.replace(cfg, base=cfg.base + ("max_steps=5", "eval_every=5")))  # resume-free: fine
    changed = dataclasses.replace(cfg, base=cfg.base + ("vocab_size=64",))
    with pytest.raises(ValueError, match=r"already finished .* \(vocab_size: 32 -> 64\); use a new SweepConfig\.out"):
        S.run_sweep(changed)


def test_task_and_model_configs_built_by_field_name():
    """make_task / make_lm_config take the RecallConfig fields of their configs' names."""
    from gdn_jax.data import TASK_CONFIGS, NIAHConfig, StateTrackingConfig
    from gdn_jax.models import LMConfig
    from gdn_jax.recall import RecallConfig, make_lm_config, make_task

    rc = RecallConfig(task="niah", vocab_size=64, seq_len=48, key_len=2, value_len=3, depth=0.5, test_examples=7,
                      seed=3, d_model=32, mixer="gdn", mlp_ratio=2.0, backend="chunk", chunk_size=16,
                      use_short_conv=False, hybrid_every=2, allow_neg_eigval=True)
    assert make_task(rc) == NIAHConfig(vocab_size=64, seq_len=48, key_len=2, value_len=3, depth=0.5,
                                       test_examples=7, seed=3)
    assert make_task(RecallConfig(task="state_tracking", modulus=5, train_max_len=12, test_min_len=12, seed=2)) == \
        StateTrackingConfig(modulus=5, train_max_len=12, test_min_len=12, seed=2)
    assert make_lm_config(rc, 65) == LMConfig(vocab_size=65, d_model=32, num_layers=2, num_heads=2, mixer="gdn",
                                              hybrid_every=2, hybrid_mixer="gated_attention", mlp_ratio=2.0,
                                              backend="chunk", chunk_size=16, use_short_conv=False,
                                              allow_neg_eigval=True)
    ours = {f.name for f in dataclasses.fields(RecallConfig)}
    for cls in TASK_CONFIGS.values():  # every task setting but state tracking's label_mode is a RecallConfig field
        assert {f.name for f in dataclasses.fields(cls)} - ours <= {"label_mode"}, cls


def test_sweep_config_json_records_the_shapes_that_run():
    """With --shapes, sweep_config.json's seq_lens / num_kv_pairs are those of the shapes, not the
    preset's (which do not run)."""
    cfg = S.apply_preset(S.SweepConfig(preset="cpu_mqar", shapes=("32x4", "16x2x8", "32x2")), explicit=["shapes"])
    assert cfg.seq_lens == (64,) and cfg.num_kv_pairs == (8,)  # the preset's fields, unused
    rec = S.recorded_config(cfg)
    assert rec["seq_lens"] == [32, 16] and rec["num_kv_pairs"] == [4, 2]
    assert {c.seq_len for c in S.cells(cfg)} == set(rec["seq_lens"])
    assert {c.num_kv_pairs for c in S.cells(cfg)} == set(rec["num_kv_pairs"])
    assert json.loads(json.dumps(rec))["shapes"] == ["32x4", "16x2x8", "32x2"]
    plain = S.apply_preset(S.SweepConfig(preset="cpu_mqar"))
    assert S.recorded_config(plain) == dataclasses.asdict(plain)


@pytest.mark.parametrize("kw, match", [
    (dict(mixers=("mamba2",), neg_eigval=(True,)), "the grid is empty"),
    (dict(mixers=("gdn", "gdn")), "mixers repeats"), (dict(d_models=(16, 16)), "d_models repeats"),
    (dict(out=""), "out must name a folder"),
])
def test_sweep_grid_errors(kw, match, tmp_path):
    """An empty grid or repeated cells (which would share run folders) are refused before training."""
    cfg = S.apply_preset(S.SweepConfig(preset="cpu_smoke", **{"out": str(tmp_path), **kw}),
                         explicit=list(kw) + ["out"])
    with pytest.raises(ValueError, match=match):
        S.validate(cfg)
