"""The metric loggers (gdn_jax.loggers; the ``loggers`` extra, which .ci/run installs): a run's
metrics read back from the TensorBoard event file (its protobuf records) and from the W&B offline
run file, written by recall.run with ``--logger``, by the sweep and by a hand-written loop."""
import glob
import os
import struct
import time

import numpy as np
import pytest

from gdn_jax import loggers as L

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = dict(vocab_size=32, seq_len=16, num_kv_pairs=2, d_model=16, num_layers=1, num_heads=2, chunk_size=16,
            batch_size=8, test_examples=16, eval_batch_size=16, lr=1e-2, warmup=1, steps=6, eval_every=3,
            log_every=2, progress=False, backend="chunk")


def tb_scalars(logdir):
    """``{tag: [(step, value)]}`` of every scalar in the event files under ``logdir``, parsed from
    the TFRecord framing (length, its CRC, data, its CRC) and tensorboardX's ``Event`` protobuf."""
    from tensorboardX.proto.event_pb2 import Event

    out = {}
    files = glob.glob(os.path.join(logdir, "**", "events.out.tfevents.*"), recursive=True)
    assert files, f"no event file under {logdir}"
    for path in files:
        data = open(path, "rb").read()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            ev = Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in ev.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


def wandb_history(root, until=lambda history: bool(history), timeout=60.0):
    """``[{key: value}]`` of the history records in the offline W&B run file under ``root``
    (``run-<id>.wandb``: a ``:W&B`` header, then LevelDB-log records of ``wandb_internal_pb2.Record``
    in 32 KiB blocks), and the run's config keys.

    ``run.finish()`` can return before W&B's service process has written the records (seen on a
    loaded 2-core machine: an empty history read right after ``finish``, the full one a moment
    later), so the file is read again until ``until(history)`` holds or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        history, config = _read_wandb_file(root)
        if until(history) or time.monotonic() > deadline:
            return history, config
        time.sleep(0.2)


def _read_wandb_file(root):
    import json

    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(root, "wandb", "offline-run-*", "run-*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, buf, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the rest of a block too short for a record header: padding
            pos += block - pos % block
            continue
        n, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk = data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            records.append(buf + chunk)
    history, config = [], {}
    for raw in records:
        r = pb.Record.FromString(raw)
        kind = r.WhichOneof("record_type")
        if kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
        elif kind == "config":
            config.update({i.key: i.value_json for i in r.config.update})
        elif kind == "run":
            config.update({i.key: i.value_json for i in r.run.config.update})
    return history, config


def test_tensorboard_logger_round_trip(tmp_path):
    with L.make_logger("tensorboard", logdir=str(tmp_path), config={"lr": 0.5}) as lg:
        for step in range(5):
            lg.log({"train/loss": np.float32(1.0 / (step + 1)), "skipped": None}, step)
        with pytest.raises(TypeError, match="metric 'x'"):
            lg.log({"x": "abc"}, 5)
        with pytest.raises(ValueError, match="step"):
            lg.log({"x": 1.0}, -1)
    got = tb_scalars(str(tmp_path))
    assert list(got) == ["train/loss"]
    steps, vals = zip(*got["train/loss"])
    assert steps == (0, 1, 2, 3, 4)
    np.testing.assert_allclose(vals, [1.0 / (s + 1) for s in steps], rtol=1e-6)
    with pytest.raises(ValueError, match="logger must be one of"):
        L.make_logger("mlflow", logdir=str(tmp_path))


def _run(tmp_path, **kw):
    from gdn_jax.recall import RecallConfig, run

    return run(RecallConfig(**TINY, out=str(tmp_path), **kw))[0]


def test_recall_run_logs_to_tensorboard(tmp_path):
    res = _run(tmp_path, logger="tensorboard")
    got = tb_scalars(str(tmp_path / "tb"))
    assert sorted(got) == ["test/accuracy", "test/loss", "train/accuracy", "train/loss", "train/lr"]
    # the event file holds results.json's curve and evaluations
    assert [(s, pytest.approx(v, rel=1e-6)) for s, v in got["train/loss"]] == \
        [(s, l) for s, l, _ in res["train_curve"]]
    assert [s for s, _ in got["test/accuracy"]] == [e["step"] for e in res["evals"]] == [3, 6]
    np.testing.assert_allclose([v for _, v in got["test/accuracy"]], [e["test_accuracy"] for e in res["evals"]],
                               rtol=1e-6)
    lrs = dict(got["train/lr"])
    assert lrs[2] == pytest.approx(1e-2, rel=1e-6)  # warmup 1: the peak at the second step, then the cosine
    assert lrs[6] < lrs[4] < lrs[2]


def test_recall_and_sweep_log_to_wandb_offline(tmp_path, monkeypatch):
    """W&B offline (no network): the run's history and config in its offline run file; a sweep's
    ``--logger wandb`` reaches its runs (grouped by the sweep's folder name)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    res = _run(tmp_path / "run", logger="wandb", wandb_project="gdn_test")
    def complete(h):
        return (sum("train/loss" in r for r in h) >= len(res["train_curve"])
                and sum("test/accuracy" in r for r in h) >= len(res["evals"]))

    history, config = wandb_history(str(tmp_path / "run"), until=complete)
    losses = [(h["_step"], h["train/loss"]) for h in history if "train/loss" in h]
    assert [(s, pytest.approx(v, rel=1e-6)) for s, v in losses] == [(s, l) for s, l, _ in res["train_curve"]]
    evals = [(h["_step"], h["test/accuracy"]) for h in history if "test/accuracy" in h]
    assert evals == [(e["step"], pytest.approx(e["test_accuracy"], rel=1e-6)) for e in res["evals"]]
    assert "lr" in config and "mixer" in config

    from gdn_jax import sweep as S

    cfg = S.SweepConfig(mixers=("linear",), d_models=(16,), seq_lens=(16,), num_kv_pairs=(2,), lrs=(1e-2,),
                        base=tuple(f"{k}={v}" for k, v in TINY.items() if k not in ("d_model", "seq_len", "num_kv_pairs",
                                                                                    "lr", "progress")),
                        out=str(tmp_path / "sweep"), progress=False, logger="wandb")
    summary = S.run_sweep(cfg)
    (cell,) = summary["cells"]
    run_dir = tmp_path / "sweep" / "runs" / cell["cell"] / "lr0.01"
    assert any("test/accuracy" in h
               for h in wandb_history(str(run_dir), until=lambda h: any("test/accuracy" in r for r in h))[0])
    assert S.run_config(cfg, S.cells(cfg)[0], 1e-2).wandb_group == "sweep"


def test_logger_options_refused_where_unread(tmp_path):
    from gdn_jax.recall import RecallConfig, validate

    with pytest.raises(ValueError, match="RecallConfig.wandb_project .* logger 'wandb'"):
        validate(RecallConfig(wandb_project="x"))
    with pytest.raises(ValueError, match="RecallConfig.logger must be one of"):
        validate(RecallConfig(logger="mlflow"))
