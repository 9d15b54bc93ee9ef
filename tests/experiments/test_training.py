"""Tests of gdn_jax.training, gdn_jax.cli and experiments/mqar.py (tiny models; < 60 s on 2 cores)."""
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from typing import Dict, List, Literal, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax import training as T
from gdn_jax.cli import apply_overrides, as_flags, exit_on_error, parse_dataclass, parse_overrides
from gdn_jax.data import IGNORE_INDEX, MQARConfig, TaskLoader
from gdn_jax.models import LM, LMConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "experiments", "mqar.py")

TASK = MQARConfig(vocab_size=32, seq_len=32, num_kv_pairs=4, test_examples=64)
LM_CFG = LMConfig(vocab_size=32, d_model=32, num_layers=1, num_heads=2, chunk_size=32)
TINY_ARGS = ["--vocab_size", "32", "--seq_len", "32", "--num_kv_pairs", "4", "--d_model", "32",
             "--num_layers", "1", "--num_heads", "2", "--chunk_size", "32", "--batch_size", "16",
             "--test_examples", "64", "--eval_batch_size", "32", "--lr", "1e-2", "--warmup", "2",
             "--log_every", "3", "--no-progress"]


def _load_script():
    spec = importlib.util.spec_from_file_location("mqar_experiment", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mqar_experiment"] = mod
    spec.loader.exec_module(mod)
    return mod


def _tree_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def setup():
    """One model / optimizer / compiled step shared by the library tests."""
    model_fn = lambda: LM(LM_CFG, rngs=nnx.Rngs(0))
    tx = T.make_optimizer(1e-2, warmup_steps=2, total_steps=40)
    mesh = T.make_mesh()
    graphdef, state = T.create_train_state(model_fn(), tx, seed=0, mesh=mesh)
    step = T.make_train_step(graphdef, tx, mesh)
    loader = TaskLoader(TASK, 16, mode="stream")
    return dict(model_fn=model_fn, tx=tx, mesh=mesh, graphdef=graphdef, state0=state, step=step, loader=loader)


# ----------------------------------------------------------------------------- losses, optimizer


def test_masked_losses_match_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 7)).astype(np.float32)
    targets = rng.integers(0, 7, size=(3, 5)).astype(np.int32)
    targets[rng.random((3, 5)) < 0.5] = IGNORE_INDEX
    m = targets != IGNORE_INDEX
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, np.where(m, targets, 0)[..., None], -1)[..., 0]
    np.testing.assert_allclose(T.masked_cross_entropy(logits, targets), ce[m].mean(), rtol=1e-5)
    np.testing.assert_allclose(T.masked_accuracy(logits, targets), (logits.argmax(-1) == targets)[m].mean())
    none = np.full((2, 3), IGNORE_INDEX, np.int32)
    assert float(T.masked_cross_entropy(logits[:2, :3], none)) == 0.0


def test_weight_decay_mask_skips_vectors():
    _, params, _ = nnx.split(LM(LM_CFG, rngs=nnx.Rngs(0)), nnx.Param, ...)
    mask = T.decay_mask(params)
    flat = {jax.tree_util.keystr(k): bool(v) for k, v in jax.tree_util.tree_flatten_with_path(mask)[0]}
    assert any("A_log" in k for k in flat) and any("dt_bias" in k for k in flat)
    for k, v in flat.items():
        if any(s in k for s in ("A_log", "dt_bias", "scale")):
            assert not v, k
        if any(s in k for s in ("kernel", "embedding")):
            assert v, k
    # Decay really is skipped: with zero gradients only the ndim >= 2 leaves move.
    params = {"w": jnp.ones((2, 3)), "conv": jnp.ones((4, 2)), "b": jnp.ones((3,)), "A_log": jnp.ones((2,))}
    tx = T.make_optimizer(1e-1, warmup_steps=0, total_steps=10, grad_clip=None)
    upd, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    assert {k: bool(jnp.any(v != 0)) for k, v in upd.items()} == {"w": True, "conv": True, "b": False, "A_log": False}
    np.testing.assert_allclose(upd["w"], -1e-1 * 0.1 * np.ones((2, 3)), rtol=1e-6)


# ----------------------------------------------------------------------------- training, resume


def test_loss_falls(setup):
    state, step, loader, mesh = setup["state0"], setup["step"], setup["loader"], setup["mesh"]
    losses = []
    for s in range(30):
        state, m = step(state, T.shard_batch(loader.batch(s), mesh))
        losses.append(float(m["loss"]))
    assert int(state.step) == 30 and np.all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < losses[0] - 0.3, losses


@pytest.mark.parametrize("mode", ["stream", "fixed"])
def test_prefetch_workers_same_batches(setup, mode):
    """Several prefetch threads give exactly the loader's batches, in step order (fixed mode
    across epoch boundaries: 3 steps per epoch, the shuffle is shared state behind a lock)."""
    loader = TaskLoader(dataclasses.replace(TASK, train_examples=48), 16, mode=mode)
    ref = TaskLoader(dataclasses.replace(TASK, train_examples=48), 16, mode=mode)
    got = list(T.prefetch_batches(loader.batch, range(10), setup["mesh"], depth=4, workers=3))
    assert [s for s, _ in got] == list(range(10))
    for s, b in got:
        want = ref.batch(s)
        np.testing.assert_array_equal(np.asarray(b.inputs), want.inputs)
        np.testing.assert_array_equal(np.asarray(b.targets), want.targets)
    # bad arguments raise when called, not at the first next() of the generator
    with pytest.raises(ValueError, match="workers"):
        T.prefetch_batches(loader.batch, range(2), setup["mesh"], workers=0)
    for kw in (dict(workers=1.5), dict(depth="3")):
        with pytest.raises(TypeError, match="workers|depth"):
            T.prefetch_batches(loader.batch, range(2), setup["mesh"], **kw)
    # depth 0: synchronous, the same batches
    got0 = list(T.prefetch_batches(loader.batch, range(3), setup["mesh"], depth=0))
    assert [s for s, _ in got0] == [0, 1, 2]
    np.testing.assert_array_equal(np.asarray(got0[2][1].inputs), ref.batch(2).inputs)


def test_checkpoint_resume_bit_identical(setup, tmp_path):
    state0, step, loader, mesh, tx = (setup[k] for k in ("state0", "step", "loader", "mesh", "tx"))
    # uninterrupted: 12 steps, checkpoint at 6 (and at the end)
    ck = T.Checkpointer(tmp_path / "a", max_to_keep=2)
    state = state0
    for _, batch in T.prefetch_batches(loader.batch, range(12), mesh):
        state, _ = step(state, batch)
        if int(state.step) in (6, 12):
            ck.save(state, {"loader_step": int(state.step)})
    ck.close()
    # interrupted: restore the step-6 checkpoint into an abstract state, continue to 12
    ck = T.Checkpointer(tmp_path / "a")
    assert ck.all_steps() == [6, 12]
    graphdef, abstract = T.abstract_train_state(setup["model_fn"], tx, mesh=mesh)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    resumed, meta = ck.restore(6, abstract)
    assert meta["loader_step"] == 6 and int(resumed.step) == 6
    for s in range(int(resumed.step), 12):
        resumed, _ = step(resumed, T.shard_batch(loader.batch(s), mesh))
    assert _tree_equal(resumed, state)
    latest, _ = ck.restore_latest(abstract)
    assert _tree_equal(latest, state)
    ck.close()
    # the merged model is usable
    model = T.merge_model(graphdef, resumed)
    assert model(jnp.zeros((1, 8), jnp.int32)).shape == (1, 8, LM_CFG.vocab_size)


def test_evaluate_pads_last_batch(setup):
    """20 examples in batches of 8 (last one padded) == the same plus 4 unlabelled rows (no padding)."""
    mesh, graphdef, state = setup["mesh"], setup["graphdef"], setup["state0"]
    ev = T.make_eval_step(graphdef, mesh)
    x, y = TASK.generate(24, seed=3)
    y = y.copy()
    y[20:] = IGNORE_INDEX
    a = T.evaluate(ev, state, (x[:20], y[:20]), batch_size=8, mesh=mesh)
    b = T.evaluate(ev, state, (x, y), batch_size=8, mesh=mesh)
    assert a["count"] == b["count"] == 20 * TASK.num_kv_pairs
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-6)
    assert a["accuracy"] == b["accuracy"] and 0.0 <= a["accuracy"] <= 1.0
    assert a["loss"] > 0


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs >= 2 devices (see test_script_sharded_subprocess)")
def test_sharded_step_two_devices(setup):
    mesh = T.make_mesh(jax.devices()[:2])
    tx, graphdef = setup["tx"], setup["graphdef"]
    _, state = T.create_train_state(setup["model_fn"](), tx, mesh=mesh)
    batch = T.shard_batch(setup["loader"].batch(0), mesh)
    assert batch.inputs.sharding.spec == jax.sharding.PartitionSpec("data")
    assert {s.data.shape[0] for s in batch.inputs.addressable_shards} == {8}
    state, m = T.make_train_step(graphdef, tx, mesh)(state, batch)
    assert np.isfinite(float(m["loss"]))
    with pytest.raises(ValueError, match="divisible"):
        T.shard_batch(TASK.generate(3, seed=0), mesh)


# ----------------------------------------------------------------------------- CLI


@dataclasses.dataclass
class _Cfg:
    lr: float = 3e-3
    steps: int = 10
    mixer: str = "gdn"
    resume: bool = False
    progress: bool = True
    max_steps: Optional[int] = None
    sizes: Tuple[int, ...] = (1, 2)


def test_cli_overrides():
    c = parse_dataclass(_Cfg, [])
    assert c == _Cfg()
    c = parse_dataclass(_Cfg, ["--lr", "1e-3", "--mixer", "attention", "--resume", "--no-progress",
                               "--max_steps", "5", "--sizes", "3", "4", "5"])
    assert c == _Cfg(lr=1e-3, mixer="attention", resume=True, progress=False, max_steps=5, sizes=(3, 4, 5))
    assert isinstance(c.lr, float) and isinstance(c.max_steps, int)
    assert parse_dataclass(_Cfg, ["--max_steps", "none"]).max_steps is None
    assert parse_dataclass(_Cfg, ["--steps", "7"], defaults=_Cfg(lr=1.0)) == _Cfg(lr=1.0, steps=7)
    with pytest.raises(TypeError, match="list of 'field=value'"):
        parse_overrides(_Cfg, "lr=1e-3")
    # a sequence flag given twice adds to the list (the sweep's --base a=1 --base b=2 keeps both)
    assert parse_dataclass(_Cfg, ["--sizes", "3", "--sizes", "4", "5"]).sizes == (3, 4, 5)


@pytest.mark.parametrize("argv", [["--bogus", "1"], ["--step", "5"], ["--lr", "abc"], ["--steps", "1.5"], ["extra"]])
def test_cli_rejects_bad_flags(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse_dataclass(_Cfg, argv)
    assert e.value.code == 2


def test_overrides_parse_by_field_type():
    """field=value strings (the sweep's --base) are parsed by the field's type, as the flags are."""
    c = apply_overrides(_Cfg(), ["lr=1e-3", "mixer=attention", "resume=true", "progress=0", "max_steps=5",
                                 "sizes=3, 4,5", "steps=7", "steps=8"])
    assert c == _Cfg(lr=1e-3, mixer="attention", resume=True, progress=False, max_steps=5, sizes=(3, 4, 5), steps=8)
    assert isinstance(c.lr, float) and isinstance(c.max_steps, int)
    assert apply_overrides(_Cfg(max_steps=3), ["max_steps=none"]).max_steps is None
    assert parse_overrides(_Cfg, []) == {} and parse_overrides(_Cfg, ["mixer=a=b"]) == {"mixer": "a=b"}
    from gdn_jax.recall import RecallConfig

    assert parse_overrides(RecallConfig, ["data_mode=fixed", "depth=0.5", "random_non_queries=false"]) == dict(
        data_mode="fixed", depth=0.5, random_non_queries=False)
    for item, msg in [("steps", "field=value"), ("stepz=3", "'stepz' is not a _Cfg field"),
                      ("steps=many", r"_Cfg\.steps: invalid int value: 'many'"), ("steps=1.5", r"_Cfg\.steps"),
                      ("resume=maybe", r"_Cfg\.resume: not a boolean"), ("sizes=1,x", r"_Cfg\.sizes")]:
        with pytest.raises(ValueError, match=msg):
            apply_overrides(_Cfg(), [item])
    with pytest.raises(ValueError, match=r"RecallConfig\.data_mode: invalid choice: 'epochs'"):
        parse_overrides(RecallConfig, ["data_mode=epochs"])


@dataclasses.dataclass
class _Typed:
    pair: Tuple[int, float] = (1, 0.5)
    maybe_sizes: Optional[Tuple[int, ...]] = None
    num: Union[int, str] = 3
    ratio: Union[int, float] = 1
    flags: Tuple[bool, ...] = (True,)
    modes: Tuple[Literal["a", "b"], ...] = ("a",)
    names: List[str] = dataclasses.field(default_factory=list)


def test_cli_field_types():
    """Fixed-length tuples, Optional sequences, scalar Unions and Literal elements parse by their types,
    on the command line and as field=value overrides."""
    c = parse_dataclass(_Typed, ["--pair", "2", "0.25", "--maybe_sizes", "3", "4", "--num", "7", "--ratio", "0.5",
                                 "--flags", "no", "1", "--modes", "b", "a", "--names", "x", "y"])
    assert c == _Typed(pair=(2, 0.25), maybe_sizes=(3, 4), num=7, ratio=0.5, flags=(False, True), modes=("b", "a"),
                       names=["x", "y"])
    assert type(c.pair[0]) is int and type(c.pair[1]) is float and type(c.num) is int and type(c.names) is list
    assert parse_dataclass(_Typed, ["--num", "abc", "--ratio", "4"]).num == "abc"
    assert type(parse_dataclass(_Typed, ["--ratio", "4"]).ratio) is int
    assert parse_dataclass(_Typed, ["--maybe_sizes", "none"], defaults=_Typed(maybe_sizes=(1,))).maybe_sizes is None
    assert parse_dataclass(_Typed, ["--pair", "5", "1", "--pair", "6", "2"]).pair == (6, 2.0)  # fixed: replaced
    assert parse_overrides(_Typed, ["pair=3,1.5", "maybe_sizes=none", "num=x", "modes=b"]) == dict(
        pair=(3, 1.5), maybe_sizes=None, num="x", modes=("b",))
    assert parse_overrides(_Typed, ["maybe_sizes=5,6"]) == dict(maybe_sizes=(5, 6))
    for item, msg in [("pair=1", r"_Typed\.pair: expected 2 values, got 1"), ("pair=1,2,3", "expected 2 values"),
                      ("pair=x,1", "invalid int"), ("ratio=abc", "'abc' is none of int, float"),
                      ("modes=a,c", "invalid choice: 'c'"), ("maybe_sizes=1,none", "invalid int"),
                      ("maybe_sizes=", "at least one value")]:
        with pytest.raises(ValueError, match=msg):
            parse_overrides(_Typed, [item])
    for argv in (["--pair", "1"], ["--pair", "1", "2", "3"], ["--ratio", "x"], ["--modes", "c"],
                 ["--maybe_sizes", "1", "none"]):
        with pytest.raises(SystemExit) as e:
            parse_dataclass(_Typed, argv)
        assert e.value.code == 2

    @dataclasses.dataclass
    class Bare:
        items: list = dataclasses.field(default_factory=list)

    with pytest.raises(TypeError, match=r"Bare\.items: a sequence field needs its element type"):
        parse_dataclass(Bare, [])

    @dataclasses.dataclass
    class Nested:
        table: Dict[str, int] = dataclasses.field(default_factory=dict)

    with pytest.raises(TypeError, match=r"Nested\.table: the command line cannot parse a field of type"):
        parse_dataclass(Nested, [])
    with pytest.raises(TypeError, match=r"Nested\.table"):
        parse_overrides(Nested, ["table=a"])


@dataclasses.dataclass
class _Commented:
    # -- a section heading, not a field's doc --
    lr: float = 1e-3  # peak learning rate
    # several lines above a field
    # are its doc too
    steps: int = 10
    seed: int = 0
    fmt: str = "%d items"  # 50% of the help text is a percent sign

    def __post_init__(self):
        seed: int = self.seed  # a method's annotated local, not a field's doc
        del seed


def test_help_from_field_comments():
    """--help shows the comments written beside each field (metadata["help"] wins when given)."""
    from gdn_jax.cli import make_parser

    text = " ".join(make_parser(_Commented).format_help().split())
    assert "--lr FLOAT peak learning rate (default: 0.001)" in text
    assert "--steps INT several lines above a field are its doc too (default: 10)" in text
    assert "--seed INT (default: 0)" in text and "section heading" not in text and "annotated local" not in text
    assert "--fmt STR 50% of the help text is a percent sign (default: '%d items')" in text
    from gdn_jax.recall import RecallConfig

    rc = " ".join(make_parser(RecallConfig).format_help().split())
    assert "--eval_every INT steps between evaluations" in rc and "--resume, --no-resume continue from the latest" in rc


def test_library_errors_become_exit_messages():
    """Scripts turn a library ValueError/TypeError into an exit message, fields written as flags."""
    assert as_flags("_Cfg.lr must be > 0 (_Cfg.nope, Other.lr, x_Cfg.steps)", _Cfg) == \
        "--lr must be > 0 (_Cfg.nope, Other.lr, x_Cfg.steps)"
    # a boolean setting as the flag the parser takes (argparse refuses --resume=False)
    assert as_flags("or _Cfg.progress=False; _Cfg.resume=True; _Cfg.nope=False", _Cfg) == \
        "or --no-progress; --resume; _Cfg.nope=False"
    for exc in (ValueError, TypeError):
        with pytest.raises(SystemExit, match=r"^prog: error: --steps must be >= 1$"):
            with exit_on_error("prog", _Cfg):
                raise exc("_Cfg.steps must be >= 1")
    with pytest.raises(SystemExit, match=r"^prog: error: _Cfg.steps$"):
        with exit_on_error("prog"):
            raise ValueError("_Cfg.steps")
    with pytest.raises(KeyError):  # anything else is a bug: it keeps its traceback
        with exit_on_error("prog", _Cfg):
            raise KeyError("x")


def test_script_config_flags_cover_fields():
    mod = _load_script()
    cfg = parse_dataclass(mod.Config, ["--lr", "1e-3", "--mixer", "attention", "--backend", "scan", "--resume"])
    assert (cfg.lr, cfg.mixer, cfg.backend, cfg.resume) == (1e-3, "attention", "scan", True)
    assert cfg.steps == mod.Config().steps


# ----------------------------------------------------------------------------- the script


def test_script_end_to_end_and_resume(tmp_path):
    mod = _load_script()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    common = TINY_ARGS + ["--steps", "12", "--eval_every", "6"]
    res = mod.main(common + ["--out", a])
    assert os.path.isfile(os.path.join(a, "results.json")) and os.path.getsize(os.path.join(a, "curves.png")) > 0
    with open(os.path.join(a, "results.json")) as f:
        saved = json.load(f)
    assert saved["steps"] == res["steps"] == 12
    assert [e["step"] for e in saved["evals"]] == [6, 12]
    assert 0.0 <= saved["final_test_accuracy"] <= 1.0 and saved["num_devices"] == len(jax.local_devices())
    assert saved["backend_resolved"] == ["chunk"] and saved["config"]["lr"] == 1e-2
    for k in ("jax_version", "device_kind", "wall_s", "train_curve"):
        assert k in saved
    # evaluations (2 here, compile included) are timed apart from the training steps
    assert saved["eval_s"] > 0 and saved["train_steps_per_s"] > saved["steps_per_s"] > 0

    # interrupted at 6 (a copy of the step-6 checkpoint), resumed to 12: bit-identical to the
    # uninterrupted run
    import shutil

    shutil.copytree(os.path.join(a, "ckpt", "6"), os.path.join(b, "ckpt", "6"))
    cfg = parse_dataclass(mod.Config, common + ["--out", b, "--resume"])
    res_b, state_b = mod.run(cfg)
    assert res_b["resumed_from"] == 6 and [e["step"] for e in res_b["evals"]] == [6, 12]
    model_fn, tx = mod.build(cfg)[3:]
    _, abstract = T.abstract_train_state(model_fn, tx, mesh=T.make_mesh())
    ck = T.Checkpointer(os.path.join(a, "ckpt"))
    state_a, meta_a = ck.restore_latest(abstract)
    ck.close()
    assert meta_a["step"] == 12
    assert _tree_equal(state_a, state_b)
    assert res_b["final_test_accuracy"] == res["final_test_accuracy"]
    assert res_b["evals"][-1]["test_loss"] == res["evals"][-1]["test_loss"]


@pytest.mark.parametrize("log_every", [3, 1])
def test_suspended_session_history_identical(tmp_path, log_every):
    """A session stopped (session_time_s) between log points (log_every 3) or on one (1) and resumed
    gives the uninterrupted run's train curve and evaluation losses exactly (the per-step metrics
    since the last curve point and the losses since the last evaluation travel in the checkpoint;
    until 2026-12-05 the stop added a curve point and the evaluation's mean loss lost the steps
    before it; until 2026-12-06 a stop on a log step left that step's point to be merged with the
    next one's)."""
    mod = _load_script()
    common = TINY_ARGS + ["--steps", "14", "--eval_every", "7", "--log_every", str(log_every)]
    full, _ = mod.run(parse_dataclass(mod.Config, common + ["--out", str(tmp_path / "a")]))
    cut = parse_dataclass(mod.Config, common + ["--out", str(tmp_path / "b"), "--session_time_s", "1e-6"])
    rec, _ = mod.run(cut)
    assert rec["interrupted"] and rec["steps"] == 1
    res, _ = mod.run(parse_dataclass(mod.Config, common + ["--out", str(tmp_path / "b"), "--resume"]))
    assert res["resumed_from"] == 1
    assert res["train_curve"] == full["train_curve"]
    assert [(e["step"], e["loss"], e["test_loss"]) for e in res["evals"]] == \
        [(e["step"], e["loss"], e["test_loss"]) for e in full["evals"]]


def test_ctrl_c_in_the_last_step_finishes_then_stops(tmp_path, monkeypatch):
    """A Ctrl-C during the step that ends the run (here the last one): the run finishes and writes
    its results, then KeyboardInterrupt stops the caller (a sweep must not go on to its next run)."""
    import signal

    from gdn_jax import recall

    mod = _load_script()
    after = recall._Run._after_step

    def after_step(self, bar):
        stop = after(self, bar)
        if self.step == self.stop:  # the run's SIGINT handler, called as a Ctrl-C would (no OS signal:
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)  # nothing can reach another thread)
        return stop

    monkeypatch.setattr(recall._Run, "_after_step", after_step)
    out = tmp_path / "run"
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN in a background process
    with pytest.raises(KeyboardInterrupt, match="the run finished at step 6"):
        mod.run(parse_dataclass(mod.Config, TINY_ARGS + ["--steps", "6", "--eval_every", "3", "--out", str(out)]))
    assert json.load(open(out / "results.json"))["steps"] == 6
    assert signal.getsignal(signal.SIGINT) is before  # the handler is put back


def test_script_ctrl_c_checkpoints_and_resumes(tmp_path):
    """Ctrl-C (SIGINT) stops the run at the end of the step in flight, checkpoints it and exits with
    status 130 and one line (no traceback); --resume continues from that step. (It used to print a
    KeyboardInterrupt traceback and keep only the last evaluation's checkpoint.)"""
    import signal
    import subprocess
    import time

    out = tmp_path / "run"
    args = [sys.executable, SCRIPT, *TINY_ARGS, "--steps", "100000", "--eval_every", "5", "--out", str(out)]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ckpt = out / "ckpt"
    t0 = time.time()
    while not (ckpt.is_dir() and any(n.isdigit() for n in os.listdir(ckpt))):  # training: a first checkpoint
        assert p.poll() is None and time.time() - t0 < 900, p.communicate()  # a hang guard, not a budget
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "mqar.py: interrupted: checkpointed at step" in err, err[-3000:]
    step = int(err.split("mqar.py: interrupted: checkpointed at step ")[1].split()[0])
    assert step >= 5 and max(int(n) for n in os.listdir(ckpt) if n.isdigit()) == step
    assert not (out / "results.json").exists()
    mod = _load_script()
    res, _ = mod.run(parse_dataclass(mod.Config, TINY_ARGS + ["--steps", str(step + 2), "--eval_every", "5",
                                                             "--out", str(out), "--resume"]))
    assert res["resumed_from"] == step and res["steps"] == step + 2


def test_script_sharded_subprocess(tmp_path):
    """The script on 2 forced host devices: batches split over "data", results report 2 devices."""
    code = textwrap.dedent(f"""
        import runpy, json, numpy as np, jax
        assert len(jax.devices()) == 2, jax.devices()
        from gdn_jax import training as T
        mesh = T.make_mesh()
        x = T.shard_batch((np.zeros((4, 8), np.int32),), mesh)[0]
        assert sorted(s.data.shape for s in x.addressable_shards) == [(2, 8), (2, 8)]
        try:
            T.shard_batch((np.zeros((3, 8), np.int32),), mesh)
            raise SystemExit("no error for an indivisible batch")
        except ValueError:
            pass
        mod = runpy.run_path({SCRIPT!r})
        res = mod["main"]({TINY_ARGS!r} + ["--steps", "4", "--eval_every", "2", "--out", {str(tmp_path)!r}])
        assert res["num_devices"] == 2 and np.isfinite(res["evals"][-1]["test_loss"])
        print("OK", res["steps"])
    """)
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"  # keeps conftest's
    env = dict(os.environ, XLA_FLAGS=flags.strip(),
               JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=os.path.join(REPO, ".jax_cache"))
    p = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "OK 4" in p.stdout
    assert json.load(open(tmp_path / "results.json"))["num_devices"] == 2


@pytest.mark.parametrize("task", ["mqar", "niah"])
def test_sparse_head_equals_dense(task):
    """The LM head at the labelled positions only gives the dense loss, accuracy and gradients."""
    from gdn_jax.data import NIAHConfig
    from gdn_jax.models import LM, LMConfig
    from gdn_jax.recall import max_labels
    from gdn_jax.training import lm_loss, make_lm_loss

    cfg = (MQARConfig(vocab_size=32, seq_len=32, num_kv_pairs=4) if task == "mqar"
           else NIAHConfig(vocab_size=32, seq_len=48, value_len=3))
    batch = cfg.generate(6, 3)
    model = LM(LMConfig(vocab_size=32, d_model=16, num_layers=1, num_heads=2, backend="chunk", chunk_size=16),
               rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)

    def f(loss_fn):
        def g(p):
            return loss_fn(nnx.merge(graphdef, p), batch, None)
        (l, aux), grads = jax.value_and_grad(g, has_aux=True)(params)
        return l, aux, grads

    l0, a0, g0 = f(lm_loss)
    l1, a1, g1 = f(make_lm_loss(max_labels(cfg)))
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    np.testing.assert_allclose(a1["accuracy"], a0["accuracy"], rtol=1e-6)
    assert int(a1["unscored"]) == 0
    for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
    # too small a max_scored is reported, never silently used
    _, a2, _ = f(make_lm_loss(max_labels(cfg) - 1))
    assert int(a2["unscored"]) == 6


@pytest.mark.parametrize("kw, exc, match", [
    (dict(warmup_steps=3, total_steps=12, steps_per_epoch=4), ValueError, "warmup_steps must be 0"),
    (dict(warmup_steps=20, total_steps=10), ValueError, "warmup_steps must be < total_steps"),
    (dict(lr=-1.0), ValueError, "lr"), (dict(lr=float("nan")), ValueError, "lr"), (dict(lr="1e-3"), TypeError, "lr"),
    (dict(min_lr_ratio=-1.0), ValueError, "min_lr_ratio"), (dict(min_lr_ratio=5.0), ValueError, "min_lr_ratio"),
    (dict(warmup_steps=2.5), TypeError, "warmup_steps"), (dict(total_steps=float("inf")), TypeError, "total_steps"),
    (dict(warmup_steps=None), TypeError, "warmup_steps"),
])
def test_schedule_arguments(kw, exc, match):
    """make_schedule refuses what would train silently wrong (lr 0 for an epoch, a horizon ignored,
    a rising or negative lr) or fail obscurely."""
    args = {"lr": 1.0, "warmup_steps": 0, "total_steps": 10, **kw}
    with pytest.raises(exc, match=match):
        T.make_schedule(args.pop("lr"), **args)


@pytest.mark.parametrize("kw, match", [(dict(b1=1.0), "b1"), (dict(b2=-1.0), "b2"), (dict(eps=0.0), "eps"),
                                       (dict(weight_decay=float("nan")), "weight_decay"),
                                       (dict(weight_decay=-1.0), "weight_decay"),
                                       (dict(grad_clip=float("nan")), "grad_clip")])
def test_optimizer_arguments(kw, match):
    """Settings that turned parameters NaN within three updates are a ValueError naming them."""
    with pytest.raises(ValueError, match=match):
        T.make_optimizer(1e-3, warmup_steps=0, total_steps=10, **kw)


def test_fresh_run_deletes_only_checkpoints(tmp_path):
    """A fresh run with overwrite (no resume) clears orbax step folders in ckpt_dir and refuses a folder holding
    anything else (it used to delete the whole folder)."""
    from gdn_jax import recall as R

    base = dict(vocab_size=32, seq_len=32, num_kv_pairs=4, d_model=16, num_heads=2, batch_size=8, test_examples=16,
                eval_batch_size=8, warmup=0, steps=2, eval_every=2, progress=False)
    ck = tmp_path / "ck"
    R.run(R.RecallConfig(**base, out=str(tmp_path / "a"), ckpt_dir=str(ck)))
    assert (ck / "2").is_dir()
    R.run(R.RecallConfig(**base, out=str(tmp_path / "b"), ckpt_dir=str(ck), overwrite=True))  # checkpoints only: replaced
    (ck / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not checkpoints"):
        R.run(R.RecallConfig(**base, out=str(tmp_path / "c"), ckpt_dir=str(ck), overwrite=True))
    assert (ck / "notes.txt").read_text() == "mine"
