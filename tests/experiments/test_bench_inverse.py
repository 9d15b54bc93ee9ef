"""Smoke test of benchmarks/bench_inverse.py on CPU (``--interpret``): the T0 kernel's line with
its float64 check, the plain-JAX T0 and our Triton WY stage print, so that a device call is not
spent finding a broken script (its timings mean nothing here). In a subprocess of its own."""
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_inverse_interpret():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
               JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_inverse.py"), "--interpret",
                          "--shapes", "1x70x2x32", "--quick"], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0 and "Traceback" not in res.stderr + res.stdout, (res.stdout[-3000:], res.stderr[-3000:])
    text = res.stdout
    m = re.search(r"T0 kernel w4 +[0-9.]+ ms +[0-9.]+ MB +[0-9.]+ GB/s +err ([0-9.e+-]+) / ([0-9.e+-]+)\n", text)
    assert m and float(m.group(1)) <= 1e-5, text  # T = 70: two chunks, the second padded
    for name in ("T0 XLA (plain JAX)", "ours triton WY (W,U,Aqk) C=64"):
        assert re.search(re.escape(name) + r" +[0-9.]+ ms", text), (name, text)
    assert "T0 kernel w1" not in text and "FAILED" not in text, text
