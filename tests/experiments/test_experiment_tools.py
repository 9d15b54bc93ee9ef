"""The experiment tools as a user meets them (docs/experiment_tools.md): run folders that no run
replaces, --resume from the saved config, load_run, one CLI convention in every script, greedy
generate without a key, the near-target evaluation cadence, and the installed commands of a wheel.
Tiny models (d 32, 1 layer, a few steps)."""
import json
import os
import shutil
import subprocess
import sys
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--vocab_size", "32", "--seq_len", "32", "--num_kv_pairs", "4", "--d_model", "32", "--num_layers", "1",
        "--num_heads", "2", "--chunk_size", "32", "--batch_size", "16", "--test_examples", "64",
        "--eval_batch_size", "32", "--lr", "1e-2", "--warmup", "0", "--log_every", "2", "--no-progress"]


def _files(folder):
    """{relative path: bytes} of every file under ``folder``."""
    out = {}
    for d, _, fs in os.walk(folder):
        for f in fs:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, folder)] = fh.read()
    return out


def _accuracy(model, task):
    """Test accuracy of ``model`` on the task's test set, computed here (argmax at scored positions)."""
    from gdn_jax.data import IGNORE_INDEX, make_test_set

    ts = make_test_set(task)
    pred = np.asarray(jnp.argmax(model(jnp.asarray(ts.inputs)), -1))
    mask = ts.targets != IGNORE_INDEX
    return float((pred == ts.targets)[mask].mean())


def test_runs_keep_their_folders_resume_and_load(tmp_path, monkeypatch, capsys):
    """The issue's scenario: a default run, then a --mixer attention run: the first run's checkpoints
    and results survive (each run has its own folder; latest points to the newest, as a symlink or,
    where the OS has none, a text file). A fresh run into a used folder is refused; --overwrite
    replaces it; --resume continues a run with its saved settings, refusing only conflicting flags;
    load_run gives back the config, the model of the best / last checkpoint and the history."""
    from gdn_jax.commands import recall
    from gdn_jax.recall import load_run, make_task, read_latest

    monkeypatch.chdir(tmp_path)
    r1 = recall(TINY + ["--steps", "8", "--max_steps", "4", "--eval_every", "2"], prog="recall.py")
    a = r1["out"]
    assert os.path.dirname(a) == str(tmp_path / "runs" / "mqar") and os.path.basename(a).startswith("gdn-")
    assert "run folder: runs/mqar/gdn-" in capsys.readouterr().out
    assert os.path.islink(tmp_path / "runs" / "mqar" / "latest") and read_latest("runs/mqar") == a
    before = _files(a)
    assert {"config.json", "results.json", "curves.png"} <= set(before) and any(p.startswith("ckpt/4/") for p in before)

    def no_symlink(*args, **kw):
        raise OSError("no symlinks here")

    with monkeypatch.context() as m:  # an OS without symlinks: latest becomes a text file
        m.setattr(os, "symlink", no_symlink)
        r2 = recall(TINY + ["--steps", "4", "--eval_every", "2", "--mixer", "attention"], prog="recall.py")
    b = r2["out"]
    assert b != a and os.path.basename(b).startswith("attention-")
    latest = tmp_path / "runs" / "mqar" / "latest"
    assert latest.is_file() and not latest.is_symlink() and read_latest("runs/mqar") == b
    assert _files(a) == before  # the first run's results and checkpoints survive, byte for byte

    # a fresh run into a used folder: refused, nothing touched
    with pytest.raises(SystemExit, match=r"recall.py: error: --out=.* already holds files .*--resume.*--overwrite"):
        recall(TINY + ["--steps", "4", "--eval_every", "2", "--out", a], prog="recall.py")
    assert _files(a) == before
    # --overwrite replaces the run in that folder
    r3 = recall(TINY + ["--steps", "2", "--eval_every", "2", "--out", b, "--overwrite"], prog="recall.py")
    assert r3["steps"] == 2 and sorted(os.listdir(os.path.join(b, "ckpt"))) == ["2"]

    # --resume: the saved settings (the tiny model) without repeating them; a conflicting flag is refused
    with pytest.raises(SystemExit, match=r"--d_model=64 \(the run has 32\)"):
        recall(["--resume", "--out", a, "--d-model", "64"], prog="recall.py")
    r4 = recall(["--resume", "--out", a, "--d-model", "32", "--max_steps", "8"], prog="recall.py")
    assert r4["resumed_from"] == 4 and r4["steps"] == 8 and [e["step"] for e in r4["evals"]] == [2, 4, 6, 8]
    assert r4["config"]["d_model"] == 32 and r4["config"]["vocab_size"] == 32 and r4["out"] == a

    last = load_run(a, params="last")
    assert last.step == 8 and last.config.d_model == 32 and last.results["steps"] == 8
    assert [e["step"] for e in last.history["evals"]] == [2, 4, 6, 8] and len(last.history["train"]) == 4
    task = make_task(last.config)
    assert _accuracy(last.model, task) == pytest.approx(r4["evals"][-1]["test_accuracy"], abs=1e-6)
    best = load_run(a)  # params="best": the checkpoint of the highest test accuracy (kept on disk)
    accs = {e["step"]: e["test_accuracy"] for e in r4["evals"]}
    assert best.step == max(accs, key=lambda s: (accs[s], s))
    assert _accuracy(best.model, task) == pytest.approx(accs[best.step], abs=1e-6)
    assert load_run("runs/mqar").path == b  # a task folder: its latest run
    assert load_run("runs/mqar/latest").path == b  # the pointer: the run's own folder
    # resuming a finished run trains nothing and keeps its record (timings included) byte for byte
    record = open(os.path.join(a, "results.json")).read()
    r5 = recall(["--resume", "--out", a], prog="recall.py")
    assert r5["steps"] == 8 and open(os.path.join(a, "results.json")).read() == record
    # --resume without --out, with --mixer: the newest run of that mixer, not the newest run
    r6 = recall(["--resume", "--mixer", "gdn"], prog="recall.py")
    assert r6["out"] == a
    with pytest.raises(ValueError, match="params must be 'best' or 'last'"):
        load_run(a, params="first")


def test_fresh_run_refuses_checkpoints_unless_overwrite(tmp_path):
    """A fresh run (no resume) into a ckpt_dir holding checkpoints is refused; with overwrite its
    orbax step folders are replaced, and a folder holding anything else is still refused."""
    from gdn_jax import recall as R

    base = dict(vocab_size=32, seq_len=32, num_kv_pairs=4, d_model=16, num_heads=2, batch_size=8, test_examples=16,
                eval_batch_size=8, warmup=0, steps=2, eval_every=2, progress=False)
    ck = tmp_path / "ck"
    R.run(R.RecallConfig(**base, out=str(tmp_path / "a"), ckpt_dir=str(ck)))
    assert (ck / "2").is_dir()
    with pytest.raises(ValueError, match=r"RecallConfig.ckpt_dir=.* already holds \['2'\]"):
        R.run(R.RecallConfig(**base, out=str(tmp_path / "b"), ckpt_dir=str(ck)))
    assert not (tmp_path / "b").exists() or not os.listdir(tmp_path / "b")
    (ck / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not checkpoints"):
        R.run(R.RecallConfig(**base, out=str(tmp_path / "c"), ckpt_dir=str(ck), overwrite=True))
    assert (ck / "notes.txt").read_text() == "mine" and (ck / "2").is_dir()
    with pytest.raises(ValueError, match="overwrite must be False with RecallConfig.resume"):
        R.validate(R.RecallConfig(resume=True, overwrite=True))


def test_near_target_evaluation_stops_early(tmp_path):
    """Once a train-curve point reaches the target, the run evaluates every eval_every_near_target
    steps (at log points) instead of waiting for eval_every: here it stops at step 4, not 40."""
    from gdn_jax import recall as R
    from gdn_jax.cli import parse_dataclass

    args = TINY + ["--steps", "40", "--eval_every", "40", "--eval_every_near_target", "4", "--target_accuracy", "0.01",
                   "--out", str(tmp_path / "r")]
    res, _ = R.run(parse_dataclass(R.RecallConfig, args))
    assert res["reached_target"] and res["steps"] == 4 and [e["step"] for e in res["evals"]] == [4]
    assert res["train_curve"][0][2] >= 0.01  # the train point (step 2) that set it off


def test_progress_bar_ends_at_the_last_step_and_logs_get_lines(tmp_path, monkeypatch, capfd):
    """A run that stops at its target (step 4 of 40) closes a live bar at 4/4; with stderr not a
    terminal (here: captured) no bar is drawn -- no '\\r' in the output -- and each evaluation
    prints one line (docs/experiment_tools.md "Progress output")."""
    import io

    import tqdm.auto
    from gdn_jax import recall as R
    from gdn_jax.cli import parse_dataclass

    args = [a for a in TINY if a != "--no-progress"] + ["--steps", "40", "--eval_every", "2", "--target_accuracy",
                                                        "0.01"]
    res, _ = R.run(parse_dataclass(R.RecallConfig, args + ["--out", str(tmp_path / "log")]))
    err = capfd.readouterr().err
    assert res["steps"] == 2 and "\r" not in err
    lines = [x for x in err.splitlines() if x.startswith("mqar gdn step ")]
    assert len(lines) == len(res["evals"]) == 1 and lines[0].startswith("mqar gdn step 2/40: loss ")

    bars = []

    class Bar(tqdm.auto.tqdm):  # the live bar, drawn into a buffer
        def __init__(self, *a, **kw):
            super().__init__(*a, file=io.StringIO(), **kw)
            bars.append(self)

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    monkeypatch.setattr(R, "live_progress", lambda cls: True)
    res, _ = R.run(parse_dataclass(R.RecallConfig, args + ["--out", str(tmp_path / "live")]))
    assert res["steps"] == 2 and len(bars) == 1 and (bars[0].n, bars[0].total) == (2, 2)
    assert "mqar gdn step " not in capfd.readouterr().err


def test_generate_greedy_without_key():
    """generate / decode_loop take no key for greedy decoding (the default); sampling without one is
    a TypeError that says so."""
    from gdn_jax.inference.generate import decode_loop, generate
    from gdn_jax.models import LM, LMConfig

    model = LM(LMConfig(vocab_size=32, d_model=16, num_layers=1, num_heads=2, backend="chunk", chunk_size=16),
               rngs=nnx.Rngs(0))
    prompt = jax.random.randint(jax.random.key(1), (2, 5), 0, 32)
    greedy = generate(model, prompt, 4)
    assert greedy.shape == (2, 4) and greedy.dtype == jnp.int32
    np.testing.assert_array_equal(greedy, generate(model, prompt, 4, key=jax.random.key(7), temperature=0.0))
    with pytest.raises(TypeError, match=r"sampling \(temperature=0.7 > 0\) needs key="):
        generate(model, prompt, 4, temperature=0.7)
    _, cache = model.prefill(prompt, 12)
    with pytest.raises(TypeError, match="decode_loop: sampling"):
        decode_loop(model, cache, prompt[:, -1], 2, temperature=1.0)


# ----------------------------------------------------------------------------- one CLI convention


def test_cli_convention_dashes_lists_mixer_names():
    """Dashes = underscores, lists space- or comma-separated (key=value items keep their commas), the
    sweep's mixer name hybrid in recall too."""
    from gdn_jax.cli import CONVENTION, make_parser, parse_dataclass
    from gdn_jax.recall import RecallConfig
    from gdn_jax.sweep import SweepConfig

    r = parse_dataclass(RecallConfig, ["--num-layers", "3", "--no-use-short-conv", "--eval-every=5", "--no_progress"])
    assert (r.num_layers, r.use_short_conv, r.eval_every, r.progress) == (3, False, 5, False)
    assert parse_dataclass(RecallConfig, ["--num_layers", "3"]) == parse_dataclass(RecallConfig, ["--num-layers", "3"])
    for argv in (["--d_models", "64", "128", "--lrs", "1e-3", "3e-3", "--mixers", "gdn", "hybrid"],
                 ["--d-models", "64,128", "--lrs=1e-3,3e-3", "--mixers", "gdn,", "hybrid"]):
        s = parse_dataclass(SweepConfig, argv + ["--base", "steps=200,batch_size=8", "attn_bias=q,k"])
        assert (s.d_models, s.lrs, s.mixers) == ((64, 128), (1e-3, 3e-3), ("gdn", "hybrid"))
        assert s.base == ("steps=200", "batch_size=8", "attn_bias=q,k")
    with pytest.raises(SystemExit):  # a bad element is still an error (status 2), not a string
        parse_dataclass(SweepConfig, ["--d_models", "64,x"])
    h = parse_dataclass(RecallConfig, ["--mixer", "hybrid"])
    assert (h.mixer, h.hybrid_every, h.hybrid_mixer, h.num_layers) == ("gdn", 4, "gated_attention", 4)
    assert RecallConfig(mixer="hybrid", num_layers=8).num_layers == 8
    help_ = " ".join(make_parser(RecallConfig).format_help().split())
    assert " ".join(CONVENTION.split()) in help_


@pytest.mark.parametrize("script, argv, check", [
    ("hf_probe.py", ["x", "--niah_lengths", "128,512", "--prompt-ids", "1", "2,3"],
     lambda a: a.niah_lengths == [128, 512] and a.prompt_ids == [1, 2, 3]),
    ("hf_probe.py", ["x", "--niah_lengths", "128", "512"], lambda a: a.niah_lengths == [128, 512]),
    ("hf_probe.py", ["x", "--niah_lengths", ""], lambda a: a.niah_lengths == []),
    ("memory.py", ["--contexts", "64,128", "256", "--d-model", "8"], lambda a: a.contexts == [64, 128, 256]),
    ("decode_drift.py", ["--state-dtypes", "float32"], lambda a: a.state_dtypes == ["float32"]),
    ("attention_fillers.py", ["--lengths", "64,128", "--pairs", "4", "8", "--key-bias", "none,k"],
     lambda a: a.lengths == [64, 128] and a.pairs == [4, 8] and a.key_bias == ["none", "k"]),
    ("mqar_compare.py", ["s", "--out", "o", "--extra", "a=x,b=y", "c=z"], lambda a: a.extra == ["a=x", "b=y", "c=z"]),
])
def test_every_script_parses_the_convention(script, argv, check, monkeypatch, capsys):
    """Each argparse script of experiments/ reads its list flags space- or comma-separated and its
    flags with dashes, and its --help states the convention (the parser is caught at parse_args)."""
    import argparse
    import runpy

    from gdn_jax.cli import CONVENTION

    seen = {}

    def catch(self, args=None, namespace=None):
        ns, _ = self.parse_known_args(args, namespace)
        seen["args"] = ns
        raise SystemExit("parsed")

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    mod = runpy.run_path(os.path.join(REPO, "experiments", script))
    with pytest.raises(SystemExit, match="parsed"):
        mod["main"](argv)
    assert check(seen["args"]), vars(seen["args"])
    monkeypatch.undo()
    with pytest.raises(SystemExit) as e:
        mod["main"](["--help"])
    assert e.value.code == 0 and " ".join(CONVENTION.split()) in " ".join(capsys.readouterr().out.split())


# ----------------------------------------------------------------------------- installed commands


def test_wheel_installs_the_commands(tmp_path):
    """``pip wheel`` of the package (no clone needed to run it): the wheel holds gdn_jax and the console
    entry points; installed into a folder (``pip install --target``) and run from an empty working
    directory, ``gdn-recall --help`` and ``gdn-sweep --help`` work and import gdn_jax from the
    installed copy, not from the checkout."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), src / name)
    shutil.copytree(os.path.join(REPO, "gdn_jax"), src / "gdn_jax",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    w = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300, env=env)
    assert w.returncode == 0, w.stdout[-3000:] + w.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("gdn_jax-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry = next(n for n in names if n.endswith("entry_points.txt"))
        text = z.read(entry).decode()
    assert "gdn_jax/commands.py" in names and "gdn_jax/ops/__init__.py" in names
    for cmd in ("gdn-recall = gdn_jax.commands:recall_main", "gdn-mqar = gdn_jax.commands:mqar_main",
                "gdn-sweep = gdn_jax.commands:sweep_main"):
        assert cmd in text, text
    site = tmp_path / "site"
    i = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert i.returncode == 0, i.stdout[-3000:] + i.stderr[-3000:]
    work = tmp_path / "work"
    work.mkdir()
    env["PYTHONPATH"] = str(site)
    for cmd, expect in (("gdn-recall", "--num-layers = --num_layers"), ("gdn-sweep", "--preset")):
        exe = site / "bin" / cmd
        assert exe.is_file(), sorted(os.listdir(site))
        r = subprocess.run([sys.executable, str(exe), "--help"], cwd=work, env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert f"usage: {cmd}" in r.stdout and expect in " ".join(r.stdout.split())
    r = subprocess.run([sys.executable, "-c", "import gdn_jax; print(gdn_jax.__file__)"], cwd=work, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.strip().startswith(str(site)), r.stdout + r.stderr
    assert os.listdir(work) == []  # --help wrote nothing


def test_checkpointer_keeps_latest_and_best(tmp_path):
    """Checkpointer(best_metric=...) keeps the latest max_to_keep checkpoints and the one of the best
    metric (also across a reopened manager, as a resumed run has); saves without metrics never count."""
    from gdn_jax import training as T

    def steps():
        return sorted(int(x) for x in os.listdir(tmp_path) if x.isdigit())

    ck = T.Checkpointer(tmp_path, max_to_keep=2, best_metric="acc")
    for s, acc in zip(range(1, 6), [0.9, 0.1, 0.2, 0.3, 0.4]):
        ck.save({"w": jnp.full(3, float(s))}, {"s": s}, step=s, metrics={"acc": acc})
    ck.save({"w": jnp.full(3, 6.0)}, {"s": 6}, step=6)
    ck.close()
    assert steps() == [1, 5, 6]
    ck = T.Checkpointer(tmp_path, max_to_keep=2, best_metric="acc")
    for s, acc in ((7, 0.5), (8, 0.95), (9, 0.1), (10, 0.1)):
        ck.save({"w": jnp.full(3, float(s))}, {"s": s}, step=s, metrics={"acc": acc})
    ck.close()
    assert steps() == [8, 9, 10]


def test_hybrid_raises_num_layers_with_a_warning():
    from gdn_jax.recall import RecallConfig

    with pytest.warns(UserWarning, match=r"num_layers 3 -> 4"):
        cfg = RecallConfig(mixer="hybrid", num_layers=3)
    assert (cfg.mixer, cfg.hybrid_every, cfg.num_layers) == ("gdn", 4, 4)
    cfg = RecallConfig(mixer="hybrid", num_layers=3, hybrid_every=2)  # fits: no warning, the layers kept
    assert cfg.num_layers == 3
