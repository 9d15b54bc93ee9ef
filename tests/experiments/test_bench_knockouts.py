"""Smoke test of benchmarks/bench_knockouts.py on CPU (``--interpret``): the knockouts still apply to
today's kernel source, the unmodified kernel matches itself, and ``--shape`` is honoured (it was
ignored with ``--interpret`` until 2026-12-05). Times are meaningless here; one subprocess, ~5 s."""
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_knockouts.py"), *args],
                          capture_output=True, text=True, env=env, timeout=600)


def test_bench_knockouts_interpret_wy():
    res = _run("--interpret", "--kernel", "wy", "--shape", "1x64x1x64", "--reps", "1")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "knockouts of the wy kernel at (1, 64, 1, 64)" in res.stdout, res.stdout
    base = re.search(r"^base +[0-9.]+ +w ([0-9.e+-]+) u ([0-9.e+-]+)", res.stdout, re.M)
    assert base and float(base.group(1)) == 0.0 and float(base.group(2)) == 0.0, res.stdout
    # dropping the inverse's refinement rounds changes W measurably (the knockout took effect)
    rounds = re.search(r"^no inverse rounds +[0-9.]+ +w ([0-9.e+-]+)", res.stdout, re.M)
    assert rounds and float(rounds.group(1)) > 1e-3, res.stdout


def test_bench_knockouts_bad_shape():
    for shape in ("1x64", "1x64x1x64,1x64x1x64", "0x64x1x64"):
        res = _run("--interpret", "--shape", shape)
        assert res.returncode != 0 and "--shape" in res.stderr and "Traceback" not in res.stderr, res.stderr
