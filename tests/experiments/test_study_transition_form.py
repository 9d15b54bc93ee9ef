"""Smoke test of benchmarks/study_transition_form.py (a CPU numerics study, no kernel): both emulated
state chains stay within the suite's o / S tolerance (5e-3) of the float64 reference on a short draw,
so a wrong emulation (a sign, a missing decay) fails here rather than in a design decision."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_study_transition_form_runs_and_matches_reference():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "study_transition_form.py"),
                        "--T", "256", "--D", "64", "--heads", "1"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [ln.split() for ln in p.stdout.splitlines() if ln.strip().startswith("256")]
    assert len(rows) == 9, p.stdout
    for r in rows:
        o, S = float(r[-2]), float(r[-1])
        assert 0 < o <= 5e-3 and 0 < S <= 5e-3, r


def test_study_transition_form_rejects_bad_sizes():
    for args in (["--T", "0"], ["--T", "100"], ["--D", "0"], ["--heads", "0"]):
        p = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "study_transition_form.py"), *args],
                           env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300)
        assert p.returncode == 2 and "error: --" in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
