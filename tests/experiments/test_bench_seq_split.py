"""Smoke test of benchmarks/bench_seq_split.py on CPU (``--interpret --shapes tiny``): the unsplit
row, a split row with its numerics against the unsplit op, a declined piece count and the final
table print, so that a device call is not spent finding a broken script (its timings mean nothing
here). In a subprocess of its own."""
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_seq_split_interpret():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
               JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_seq_split.py"), "--interpret",
                          "--shapes", "tiny", "--pieces", "2,8,auto"], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0 and "Traceback" not in res.stderr + res.stdout, (res.stdout[-3000:], res.stderr[-3000:])
    text = res.stdout
    assert re.search(r"unsplit +fwd +[0-9.]+ ms +fwd\+bwd +[0-9.]+ ms", text), text
    m = re.search(r"P=2 .* rel\.rms vs unsplit o ([0-9.e+-]+) grads \(max of [a-z, ]+\) ([0-9.e+-]+)", text)
    assert m and float(m.group(1)) <= 5e-3 and float(m.group(2)) <= 8e-3, text  # bf16 o: rounding only
    assert "P=8: declined (T=128 too short" in text, text  # 8 pieces of >= 2 chunks of 16 need T >= 256
    assert "=== sequence split" in text and re.search(r"1x128x1x16 +auto +1 ", text), text
    assert "FAILED" not in text, text
