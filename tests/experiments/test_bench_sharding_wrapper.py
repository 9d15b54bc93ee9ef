"""Smoke test of benchmarks/bench_sharding_wrapper.py (CPU, interpret mode, in process on the 4 CPU
devices of tests/conftest.py): one tiny shape, the wrapper on and off on one device (the same bits,
checked by the script) and with the batch split over 2 devices (no all-gather with the wrapper,
some without)."""
import importlib.util
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_sharding_wrapper_tiny(capsys):
    path = os.path.join(REPO, "benchmarks", "bench_sharding_wrapper.py")
    spec = importlib.util.spec_from_file_location("bench_sharding_wrapper", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--shapes", "2x32x2x16", "--rounds", "1", "--reps", "1", "--mesh-devices", "2"])
    rows = capsys.readouterr().out.split("gathers on/off")[-1].strip().splitlines()
    assert [r.split()[0] for r in rows] == ["2x32x2x16", "2x32x2x16"]
    one, two = (re.search(r"(\d+)/(\d+)$", r).groups() for r in rows)
    assert one == ("0", "0") and two[0] == "0" and int(two[1]) > 0
