"""CPU smoke test of benchmarks/study_gemv.py: every variant computes x @ W (to bf16 rounding), the
compiled kernels are named, the JSON is written once."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import study_gemv  # noqa: E402


def test_tiny(tmp_path):
    rows = study_gemv.main(["--tiny", "--out", str(tmp_path / "g")])
    assert [r["variant"] for r in rows] == list(study_gemv.VARIANTS)
    assert all(r["us"] > 0 and r["rel_err"] < 1e-2 and r["kernels"].get("while") == 1 for r in rows)
    assert json.loads((tmp_path / "g" / "gemv.json").read_text())["rows"][0]["d"] == 64
    with pytest.raises(SystemExit, match="exists"):
        study_gemv.main(["--tiny", "--out", str(tmp_path / "g")])
    with pytest.raises(ValueError, match="unknown variant"):
        study_gemv.product("gemm")


def test_kernels_of_names_fusions_and_custom_calls():
    text = '\n'.join(['  %gemm_fusion_dot.1 = bf16[1,2048]{1,0} fusion(%p0, %p1), kind=kCustom, calls=%c',
                      '  %cc = (f32[4]) custom-call(%a), custom_call_target="__cublas$gemm"',
                      '  %input_reduce_fusion.9 = f32[2048]{0} fusion(%x), kind=kInput, calls=%r'])
    got = study_gemv.kernels_of(text)
    assert got == {"fusion kCustom (gemm_fusion_dot)": 1, "custom-call __cublas$gemm": 1,
                   "fusion kInput (input_reduce_fusion)": 1}
