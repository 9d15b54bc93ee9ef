"""Smoke test of benchmarks/bench_hopper_stages.py on CPU (``--interpret``: Mosaic GPU's interpret
mode, in process): the stage lines it is asked for print a time, so that a device call is not
spent finding a broken script. (The script's timings are meaningless here.)"""
import importlib.util
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_hopper_stages_interpret(capsys):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_hopper_stages",
                                                  os.path.join(REPO, "benchmarks", "bench_hopper_stages.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # the stages of KernelConfig.save_states and the default gradient kernel (every precomputed
    # intermediate runs too: forward WY, backward WY, recompute, reverse pass)
    mod.main(["--interpret", "--shapes", "1x64x1x64", "--reps", "1", "--only", "+ h,own dVl,gradient kernel"])
    text = capsys.readouterr().out
    assert "Traceback" not in text, text
    for name in ("fwd state pass + h, Vn", "bwd reverse, own dVl", "bwd gradient kernel"):
        assert re.search(re.escape(name) + r" +[0-9.]+ \(per call [0-9.]+\) ms", text), (name, text)
    assert "fwd WY " not in text and "pallas" not in text  # --only filters the rest
