"""Issue #16 on the CPU: the Zoology sweep presets (settings, shapes, epochs, a time budget that
checkpoints and resumes), the per-epoch cosine, the device-resident fixed set, the published-baseline
options, and the attention-fillers experiment (tiny). Each test is a few seconds of tiny shapes."""
import dataclasses
import importlib.util
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax import sweep as S
from gdn_jax import training as T
from gdn_jax.data import MQARConfig, TaskLoader

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOGSPACE = tuple(np.logspace(-4, -2, 4))


def test_zoology_presets_settings():
    cfg = S.apply_preset(S.SweepConfig(preset="zoology_mqar", out="/tmp/unused"))
    assert sorted(cfg.lrs) == pytest.approx(LOGSPACE) and cfg.workers_per_device == 2
    grid = S.cells(cfg)
    assert len(grid) == 20 and {c.d_model for c in grid} == {64, 128, 256, 512}
    assert {c.mixer for c in grid} == {"gdn", "deltanet", "mamba2", "gla", "attention"}
    rc = S.run_config(cfg, grid[0], cfg.lrs[0])
    assert (rc.seq_len, rc.num_kv_pairs, rc.vocab_size, rc.batch_size) == (512, 64, 8192, 128)
    assert (rc.data_mode, rc.train_examples, rc.test_examples, rc.target_accuracy) == ("fixed", 100_000, 3000, 0.99)
    assert rc.steps == 64 * 781 and rc.eval_every == 781 and rc.lr_per_epoch and rc.warmup == 0
    assert (rc.random_non_queries, rc.grad_clip, rc.min_lr_ratio, rc.b2) == (False, 0.0, 0.0, 0.999)
    fig2 = S.apply_preset(S.SweepConfig(preset="zoology_fig2", out="/tmp/unused"))
    g2 = S.cells(fig2)
    assert len(g2) == 3 * 2 * 3
    shapes = {(c.seq_len, c.num_kv_pairs, c.batch_size) for c in g2}
    assert shapes == {(64, 4, 512), (128, 8, 512), (256, 16, 256)}
    c256 = next(c for c in g2 if c.seq_len == 256)
    rc = S.run_config(fig2, c256, fig2.lrs[0])
    assert rc.batch_size == 256 and rc.steps == 64 * (100_000 // 256) and rc.eval_every == 100_000 // 256
    assert len(S.validate(fig2)) == 18  # every run's settings build (abstractly)

    # the published-variant presets: the same protocol, the variant's options, d 64 / 128
    main = S.run_config(cfg, grid[0], cfg.lrs[0])
    for name, mixer, opts in [("zoology_gla_published", "gla", dict(use_short_conv=False, gla_expand_k=0.5)),
                              ("zoology_gla_noconv", "gla", dict(use_short_conv=False, gla_expand_k=None)),
                              ("zoology_gla_halfk", "gla", dict(use_short_conv=True, gla_expand_k=0.5)),
                              ("zoology_mamba2_published", "mamba2", dict(la_qk_l2norm=False, mamba2_dt_input=True)),
                              ("zoology_attention_zoo", "attention", dict(attn_bias="qkvo", pos_embedding="learned",
                                                                          rope_fraction=0.0, num_heads=1)),
                              ("zoology_attention_abspos", "attention", dict(attn_bias="", pos_embedding="learned",
                                                                             rope_fraction=0.0, num_heads=2)),
                              ("zoology_attention_bias", "attention", dict(attn_bias="qkvo", pos_embedding="none",
                                                                           rope_fraction=None, num_heads=2)),
                              ("zoology_attention_1head", "attention", dict(attn_bias="", pos_embedding="none",
                                                                            rope_fraction=None, num_heads=1))]:
        pc = S.apply_preset(S.SweepConfig(preset=name, out="/tmp/unused"))
        pg = S.validate(pc)
        single = name in ("zoology_gla_noconv", "zoology_gla_halfk")  # ablations: d 64 at lr 2.15e-3 only
        assert [(c.mixer, c.d_model) for c in pg] == ([(mixer, 64)] if single else [(mixer, 64), (mixer, 128)])
        assert pc.lrs == (S.ZOOLOGY_LRS[:1] if single else S.ZOOLOGY_LRS), name
        rc = S.run_config(pc, pg[0], pc.lrs[0])
        assert {k: getattr(rc, k) for k in opts} == opts, name
        same = ("seq_len", "num_kv_pairs", "vocab_size", "batch_size", "train_examples", "steps", "b2", "weight_decay")
        assert all(getattr(rc, k) == getattr(main, k) for k in same), name


def test_sweep_field_errors():
    with pytest.raises(ValueError, match="SweepConfig.shapes"):
        S.validate(S.SweepConfig(shapes=("64by4",), out="/tmp/unused"))
    with pytest.raises(ValueError, match="SweepConfig.epochs needs the fixed training set"):
        S.validate(S.SweepConfig(epochs=2, out="/tmp/unused"))
    with pytest.raises(ValueError, match="SweepConfig.time_budget_s"):
        S.validate(S.SweepConfig(time_budget_s=-1.0, out="/tmp/unused"))
    from gdn_jax.recall import RecallConfig, validate

    with pytest.raises(ValueError, match="RecallConfig.lr_per_epoch"):
        validate(RecallConfig(lr_per_epoch=True))
    with pytest.raises(ValueError, match="RecallConfig.session_time_s"):
        validate(RecallConfig(session_time_s=0.0))


def test_epoch_cosine_is_torch_cosine_annealing_per_epoch():
    E, spe, lr = 4, 3, 2e-3
    sch = T.make_schedule(lr, warmup_steps=0, total_steps=E * spe, min_lr_ratio=0.0, steps_per_epoch=spe)
    for step in range(E * spe):
        e = step // spe
        assert float(sch(step)) == pytest.approx(lr * 0.5 * (1 + math.cos(math.pi * e / E)), rel=1e-5)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        T.make_schedule(lr, warmup_steps=0, total_steps=4, steps_per_epoch=0)


def test_device_fixed_loader_equals_host_batches():
    task = MQARConfig(vocab_size=32, seq_len=16, num_kv_pairs=2, train_examples=20)
    loader = TaskLoader(task, 8, mode="fixed")  # 2 steps per epoch: steps 0-5 cross two epoch boundaries
    dl = T.DeviceFixedLoader(loader, T.make_mesh())
    for step in range(6):
        x, y = jax.device_get(dl.batch(step))
        ref = loader.batch(step)
        np.testing.assert_array_equal(x, ref.inputs)
        np.testing.assert_array_equal(y, ref.targets)
    # the device-side batch counter: consecutive steps, jumps back and forth, repeats, epoch ends
    loader4 = TaskLoader(task, 4, mode="fixed")  # 5 steps per epoch
    dl4 = T.DeviceFixedLoader(loader4, T.make_mesh())
    for step in [0, 1, 2, 3, 4, 5, 6, 9, 2, 2, 3, 14, 15, 7]:
        x, y = jax.device_get(dl4.batch(step))
        np.testing.assert_array_equal(x, loader4.batch(step).inputs, err_msg=f"step {step}")
        np.testing.assert_array_equal(y, loader4.batch(step).targets, err_msg=f"step {step}")
    with pytest.raises(ValueError, match="mode='fixed'"):
        T.DeviceFixedLoader(TaskLoader(task, 8, mode="stream"), T.make_mesh())


def test_zoology_smoke_budget_resume_and_table(tmp_path):
    """A time budget stops the sweep inside a run (checkpoint, no results.json); the same command
    continues it; the table marks the epoch budget."""
    kw = dict(preset="cpu_zoology_smoke", out=str(tmp_path), progress=False, mixers=("attention",), lrs=(1e-2,),
              shapes=("16x2x16",), ckpt_root=str(tmp_path / "ckpt"))
    explicit = ["out", "progress", "mixers", "lrs", "shapes", "ckpt_root"]
    run_dir = tmp_path / "runs" / "mqar_attention_d16_L16_N2" / "lr0.01"
    ckpt_dir = tmp_path / "ckpt" / "mqar_attention_d16_L16_N2" / "lr0.01"
    # a budget already spent starts nothing
    late = S.apply_preset(S.SweepConfig(**kw, deadline=0.0), explicit=explicit + ["deadline"])
    assert S.out_of_budget(late) and S.run_cell(late, S.cells(late)[0]) is False and not run_dir.exists()
    # a session that runs out inside a run (session_time_s is what the budget sets per run): checkpoint, stop
    cut = dict(kw, base=("session_time_s=0.001",))
    s1 = S.run_sweep(S.apply_preset(S.SweepConfig(**cut), explicit=explicit))
    assert not (run_dir / "results.json").exists() and os.listdir(ckpt_dir)
    # the interrupted run is in progress, not "not started" (it was reported as not started until 2026-12-05)
    step = max(int(x) for x in os.listdir(ckpt_dir) if x.isdigit())
    assert s1["cells"] == [] and s1["not_started"] == [] and s1["unfinished"] == ["mqar_attention_d16_L16_N2"]
    assert s1["in_progress"] == [f"mqar_attention_d16_L16_N2 lr 0.01 (checkpoint at step {step})"]
    assert "| attention | — (in progress) |" in open(tmp_path / "summary.md").read()
    # benchmarks/unpack_sweeps.py's progress line of an unfinished run, read from its checkpoint
    spec = importlib.util.spec_from_file_location("unpack_sweeps", os.path.join(REPO, "benchmarks", "unpack_sweeps.py"))
    us = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(us)
    (row,) = us.in_flight(str(tmp_path / "ckpt"))
    assert row.startswith(f"mqar_attention_d16_L16_N2/lr0.01: step {step}, best test acc ") and row.endswith(" s"), row
    s2 = S.run_sweep(S.apply_preset(S.SweepConfig(**kw), explicit=explicit))
    r = json.load(open(run_dir / "results.json"))
    assert r["resumed_from"] is not None and r["resumed_from"] >= 1
    assert r["steps"] == 2 * (32 // 16) and [e["step"] for e in r["evals"]][-2:] == [2, 4]  # once per epoch
    for k in ("eval_s", "ckpt_s", "data_wait_s", "metrics_fetch_s", "train_steps_per_s"):
        assert k in r
    (c,) = s2["cells"]
    assert c["epochs"] == 2.0 and c["hit_budget"] == (not c["reached_target"])
    md = open(tmp_path / "summary.md").read()
    assert "L 16, 2 pairs" in md and "2 ep" in md and (("‡" in md) == c["hit_budget"])


def test_published_attention_options():
    from gdn_jax.layers import Attention
    from gdn_jax.models import LM, LMConfig

    tok = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 8)), jnp.int32)
    zoo = LM(LMConfig(vocab_size=32, d_model=16, mixer="attention", attn_bias="qkvo", pos_embedding="learned",
                      max_seq_len=8, rope_fraction=0.0), rngs=nnx.Rngs(0))
    a = zoo.blocks[0].mixer
    assert all(getattr(a, f"{p}_proj").bias is not None for p in "qkvo") and a.rot_dim == 0
    assert zoo.pos_embed.embedding.shape == (8, 16) and jnp.isfinite(zoo(tok)).all()
    # the same tokens at other positions embed differently with learned positions
    e = zoo.embed_tokens(jnp.zeros((1, 8), jnp.int32))[0]
    assert float(jnp.abs(e[0] - e[1]).max()) > 0
    with pytest.raises(NotImplementedError, match="pos_embedding"):
        zoo.prefill(tok[:, :4], max_len=8)
    with pytest.raises(ValueError, match="max_seq_len"):
        zoo(jnp.zeros((1, 9), jnp.int32))
    kb = Attention(16, 2, bias="k", rngs=nnx.Rngs(0))
    assert kb.k_proj.bias is not None and kb.q_proj.bias is None and kb.o_proj.bias is None
    x = jax.random.normal(jax.random.key(1), (2, 8, 16))
    w = kb.attention_weights(x)  # what the layer applies
    o = jnp.einsum("bnts,bsnd->btnd", w, kb.qkv(x, jnp.arange(8))[2])
    np.testing.assert_allclose(kb.output(o, x), kb(x), atol=1e-5)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
    assert float(jnp.abs(jnp.triu(w[0, 0], 1)).max()) == 0.0
    with pytest.raises(ValueError, match="bias"):
        Attention(16, 2, bias="x", rngs=nnx.Rngs(0))


def test_published_linear_attention_options():
    from gdn_jax.layers import GatedLinearAttention
    from gdn_jax.models import LM, LMConfig

    tok = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 8)), jnp.int32)
    x = jax.random.normal(jax.random.key(1), (2, 8, 16))
    # Mamba2's dt-scaled input and no q/k norm; GLA without short conv
    base = dict(decay="mamba2", use_short_conv=False, rngs=nnx.Rngs(0))
    m0, m1 = GatedLinearAttention(16, 2, **base), GatedLinearAttention(16, 2, dt_input=True, use_qk_l2norm=False, **base)
    assert not m1.use_qk_l2norm and not hasattr(m1, "q_conv")
    assert float(jnp.abs(m0(x) - m1(x)).max()) > 0
    y, cache = m1.prefill(x[:, :7])  # decoding follows the same form
    y_t, _ = m1.decode(x[:, 7:], cache)
    np.testing.assert_allclose(y_t[:, 0], m1(x)[:, 7], atol=1e-4)
    gla = LM(LMConfig(vocab_size=32, d_model=16, mixer="gla", use_short_conv=False, gla_gate_low_rank=4,
                      gla_gate_normalizer=8.0, gla_expand_k=0.5), rngs=nnx.Rngs(0))
    g = gla.blocks[0].mixer
    assert g.gk_proj1.kernel.shape == (16, 4) and g.gate_logit_normalizer == 8.0 and not g.use_qk_l2norm
    assert (g.head_dim, g.value_head_dim) == (4, 8) and jnp.isfinite(gla(tok)).all()
    for bad, field in ((dict(attn_bias="qq"), "attn_bias"), (dict(pos_embedding="learned"), "max_seq_len"),
                       (dict(pos_embedding="rope"), "pos_embedding"), (dict(la_qk_l2norm="no"), "la_qk_l2norm"),
                       (dict(mamba2_dt_input=1), "mamba2_dt_input"),
                       (dict(gla_gate_normalizer=0.0), "gla_gate_normalizer"),
                       (dict(gla_expand_k=0.3), "gla_expand_k")):
        # a flag of the wrong type is a TypeError (as in the layers), a bad value a ValueError
        with pytest.raises(TypeError if field in ("la_qk_l2norm", "mamba2_dt_input") else ValueError, match=field):
            LMConfig(**bad)
    with pytest.raises(ValueError, match="dt_input"):
        GatedLinearAttention(16, 2, decay="gla", dt_input=True, rngs=nnx.Rngs(0))


def test_attention_fillers_tiny(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("attention_fillers",
                                                  os.path.join(REPO, "experiments", "attention_fillers.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(["--tiny", "--lengths", "16", "--pairs", "2", "--out", str(tmp_path)])
    saved = json.load(open(tmp_path / "attention_fillers.json"))
    assert os.path.getsize(tmp_path / "attention_fillers.png") > 0
    assert [r["attn_bias"] for r in saved["runs"]] == ["none", "k"] == [r["attn_bias"] for r in res["runs"]]
    for r in saved["runs"]:
        assert [c["step"] for c in r["curve"]] == [0, 2, 4]
        for c in r["curve"]:
            assert len(c["layers"]) == 2 and 0 <= c["accuracy"] <= 1
            for lay in c["layers"]:
                tot = sum(lay[k]["mean"] for k in ("filler", "key", "value", "self"))
                assert all(0 <= lay[k]["mean"] <= 1 for k in lay) and tot <= 1 + 1e-5
                assert len(lay["filler"]["heads"]) == 2
                # the queried pair's key, value and the next key lie in the context
                assert lay["key"]["mean"] + lay["value"]["mean"] + lay["after_value"]["mean"] <= lay["context"]["mean"] + 1e-5


def test_loop_clock_excludes_data_setup_and_counts_final_checkpoint(tmp_path, monkeypatch):
    """recall.run's clock (``_Run.t0``) starts after the fixed set is on the device and its gather
    compiled (one-off setup, not train time: on the H200 it was the loop's largest idle gap), and
    ``ckpt_s`` includes the wait for the last asynchronous checkpoint write (``ckpt.close``)."""
    from gdn_jax import recall as R

    events = []
    real_loader, real_close = T.DeviceFixedLoader, T.Checkpointer.close

    class Loader(real_loader):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            events.append(("loader", time.perf_counter()))

    def slow_close(self):
        time.sleep(1.0)
        events.append(("close", time.perf_counter()))
        return real_close(self)

    monkeypatch.setattr(T, "DeviceFixedLoader", Loader)
    monkeypatch.setattr(T.Checkpointer, "close", slow_close)
    cfg = R.RecallConfig(task="mqar", mixer="attention", d_model=16, num_heads=2, seq_len=16, num_kv_pairs=2,
                         vocab_size=32, batch_size=8, data_mode="fixed", train_examples=32, test_examples=16,
                         eval_batch_size=16, steps=3, warmup=0, eval_every=100, progress=False,
                         random_non_queries=False, backend="chunk", chunk_size=16, out=str(tmp_path))
    r = R._Run(cfg)
    r.restore_or_init()
    r.train()
    assert [e for e, _ in events] == ["loader"] and events[0][1] < r.t0
    r.finish()
    assert [e for e, _ in events] == ["loader", "close"] and r.ckpt_s >= 1.0
    res = r.results()
    assert res["ckpt_s"] >= 1.0 and res["steps"] == 3


def test_bench_loop_quick(capsys):
    """benchmarks/bench_loop.py runs every loop variant (CPU, tiny shapes) and prints its table."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_loop", os.path.join(REPO, "benchmarks", "bench_loop.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--quick", "--mixers", "attention"])
    table = capsys.readouterr().out.split("host ms/step-call\n")[-1].strip().splitlines()
    labels = ["step, one batch", "+ device gather", "+ gather + metrics", "+ host batches (prefetch)",
              "stream data gen (host only)", "_Run.train (fixed", "_Run.train (stream"]
    assert len(table) == len(labels)
    for row, label in zip(table, labels):
        assert row.startswith("attention") and label in row
        assert float(row.split()[-3]) > 0  # steps/s


def test_device_sweep_step_round_trip(tmp_path):
    """The device workflow of the Zoology grids on the CPU: ``benchmarks/run_h200.sh``'s sweep step
    (``STEPS=sweep:<preset>``, here the tiny ``cpu_zoology_smoke``) writes one bundled archive
    (``sweeps.tgz.part-*``), and ``benchmarks/unpack_sweeps.py`` merges it into a checkout's
    ``results/<preset>/`` with a rewritten summary (what each device call's results go through).
    ``LIMIT_SWEEP=none``: no wall-clock budget (a 240 s one checkpointed the run unfinished on a busy
    2-core machine and the test failed): the run is bounded by its 2 epochs; the budget's
    checkpoint-and-resume is tested by test_zoology_smoke_budget_resume_and_table."""
    import shutil
    import subprocess

    work = tmp_path / "tree"
    work.mkdir()
    for name in ("gdn_jax", "experiments", "benchmarks"):
        os.symlink(os.path.join(REPO, name), work / name)
    # committed checkpoints (results/resume/, no .base): the step starts from them, unpack supersedes them
    (work / "results" / "resume" / "ckpt_cpu_zoology_smoke" / "marker").mkdir(parents=True)
    out = tmp_path / "out"
    env = dict(os.environ, STEPS="sweep:cpu_zoology_smoke", LIMIT_SWEEP="none", OUT=str(out), JAX_PLATFORMS="cpu",
               SWEEP_ARGS_sweep_cpu_zoology_smoke="--mixers gdn --lrs 0.01 --shapes 16x2x16 --no-progress")
    for d in ("/tmp/cpu_zoology_smoke", "/tmp/ckpt_cpu_zoology_smoke", "/tmp/sweep_logs"):
        shutil.rmtree(d, ignore_errors=True)
    r = subprocess.run(["bash", "benchmarks/run_h200.sh"], cwd=work, env=env, capture_output=True, text=True,
                       timeout=1800)  # a guard against a hang only: the run itself takes well under a minute
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    parts = sorted(p.name for p in out.iterdir() if p.name.startswith("sweeps.tgz.part-"))
    assert parts, (r.stdout[-2000:], sorted(p.name for p in out.iterdir()))
    u = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "unpack_sweeps.py"), str(out), "--root",
                        str(work)], capture_output=True, text=True, timeout=300)
    assert u.returncode == 0, u.stdout[-2000:] + u.stderr[-2000:]
    res = work / "results" / "cpu_zoology_smoke"
    runs = list((res / "runs").glob("*/lr*/results.json"))
    assert [p.parent.parent.name for p in runs] == ["mqar_gdn_d16_L16_N2"], runs
    summary = json.loads((res / "summary.json").read_text())
    assert [c["mixer"] for c in summary["cells"]] == ["gdn"] and (res / "summary.md").exists()
    assert (work / ".base" / "ckpt_cpu_zoology_smoke" / "marker").is_dir()  # went out from results/resume
    assert not (work / "results" / "resume" / "ckpt_cpu_zoology_smoke").exists() and "superseded" in u.stdout
