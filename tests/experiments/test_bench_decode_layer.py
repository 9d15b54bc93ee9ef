"""CPU smoke test of benchmarks/bench_decode_layer.py (interpret mode): it times every program
shape asked for, writes its JSON once and refuses to write over it."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_decode_layer as bench  # noqa: E402


def test_tiny_run_and_no_overwrite(tmp_path):
    out = tmp_path / "run"
    rows = bench.main(["--tiny", "--out", str(out)])
    assert [(r["batch"], r["bv"]) for r in rows] == [(1, 8), (1, 16)]
    assert all(r["us"] > 0 and r["floor_us"] is None and r["floor_bytes"] > 0 for r in rows)
    res = json.loads((out / "decode_layer.json").read_text())
    assert res["rows"] == json.loads(json.dumps(rows)) and res["copy"]["bandwidth"] is None
    with pytest.raises(SystemExit, match="exists"):
        bench.main(["--tiny", "--out", str(out)])


def test_floor_bytes_of_the_seed_layer():
    """State read + written (float32), conv states read + written, projection read, y written."""
    from gdn_jax.ops.pallas import decode_layer as DL

    spec = DL.LayerSpec(Hk=16, H=16, K=128, V=128, W=4)
    state, conv = 16 * 128 * 128 * 4, 3 * (3 * 2048) * 2
    assert bench.floor_bytes(spec, 1) == 2 * state + 2 * conv + DL.proj_width(spec) * 2 + 2048 * 2
    assert bench.floor_bytes(spec, 64) == 64 * bench.floor_bytes(spec, 1)
