"""Smoke test of benchmarks/bench_decode.py (``--tiny`` on CPU, in process): a timed row per cell with
its floor at the copy bandwidth measured in the run, the ``--profile`` kernel counts, the JSON and the plot;
the time-budget skip."""
import importlib.util
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_decode", os.path.join(REPO, "benchmarks", "bench_decode.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_decode_tiny(bench, tmp_path, capsys):
    out = tmp_path / "bench"
    # gdn + hybrid: both cache kinds (the hybrid has a gated-attention layer); two compiles
    bench.main(["--tiny", "--contexts", "64", "--batches", "2", "--mixers", "gdn,hybrid", "--profile", "--out", str(out)])
    text = capsys.readouterr().out
    assert "random values of the right shapes (no prefill" in text and "floor µs" in text
    assert "copy bandwidth measured in this run" in text and "### profile: gdn" in text
    res = json.load(open(out / "results.json"))
    # the floor's bandwidth: the fastest of the copies measured in the run (16 MiB read + written, 10 times)
    assert res["bandwidth"] == res["copy"]["best"] >= res["copy"]["bandwidth"] > 0 and len(res["copy"]["times_s"]) == 10
    assert res["bandwidth_nominal"] == 4.3e12
    # --profile: the compiled loop's kernels per step for each model (batch 2, context 64); greedy
    # with unroll 1 on CPU: one while loop whose body holds every layer's ops
    assert [p["label"] for p in res["profiles"]] == [r["label"] for r in res["rows"]]
    for p in res["profiles"]:
        assert p["unroll"] == 1 and len(p["hlo_loops"]) == 1 and p["hlo_loops"][0]["per_step"] > 10
        assert p["trace"] == []  # no device plane on a CPU
    hlos = sorted(f.name for f in out.glob("compiled_loop_*.hlo.txt"))  # the compiled module of each profile
    assert len(hlos) == 2 and all("HloModule" in (out / f).read_text()[:200] for f in hlos), hlos
    assert os.path.getsize(out / "latency.png") > 0
    rows = res["rows"]
    assert [(r["mixer"], r["batch"], r["context"]) for r in rows] == [("gdn", 2, 64), ("hybrid", 2, 64)]
    m = res["model"]
    K, L, d = m["head_dim"], m["num_layers"], m["d_model"]
    for r in rows:
        assert r["ms_per_token"] > 0 and r["floor_ms"] > 0 and r["ratio"] == pytest.approx(r["ms_per_token"] / r["floor_ms"])
        assert r["decode_backend"] == "auto=scan" and r["state_dtype"] == "float32"
        n_attn = 1 if r["mixer"] == "hybrid" else 0
        # per layer: GDN f32 state [2, 2, 16, 16] + bf16 conv states 3 x [2, 3, 32], read and written;
        # attention: bf16 k, v [2, 64, 2, 16] read, one slot written
        gdn = 2 * (2 * 2 * K * K * 4 + 3 * 2 * 3 * d * 2)
        attn = 2 * 2 * 64 * 2 * K * 2 + 2 * 2 * 2 * K * 2
        assert r["bytes_per_token"] == r["weight_bytes"] + (L - n_attn) * gdn + n_attn * attn
        assert r["floor_ms"] == pytest.approx(r["bytes_per_token"] / res["bandwidth"] * 1e3)
        assert r["floor_ms_nominal"] == pytest.approx(r["bytes_per_token"] / 4.3e12 * 1e3) and r["unroll"] == 1
    # --check: the fused layer's first step against the plain XLA decode of the same model and cache
    bench.main(["--tiny", "--contexts", "64", "--batches", "1", "--mixers", "gdn", "--decode_backend", "fused_layer",
                "--dtype", "float32", "--check", "--out", str(out)])
    row = json.load(open(out / "results.json"))["rows"][0]
    assert row["decode_backend"] == "fused_layer" and row["check"]["logits"] < 1e-5 and row["check"]["state"] < 1e-5
    # an exhausted time budget: every cell skipped and listed, the JSON still written
    bench.main(["--tiny", "--contexts", "64", "--batches", "1", "--mixers", "attention", "--max_seconds", "1e-9",
                "--out", str(out)])
    rows = json.load(open(out / "results.json"))["rows"]
    assert len(rows) == 1 and "time budget" in rows[0]["skipped"]
    with pytest.raises(SystemExit, match="must exceed"):
        bench.main(["--tiny", "--contexts", "8", "--out", str(out)])
