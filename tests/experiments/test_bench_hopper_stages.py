"""Smoke test of benchmarks/bench_hopper_stages.py on CPU (``--interpret``: Mosaic GPU's interpret
mode): the stage lines it is asked for print, so that a device call is not spent finding a broken
script. (The script's timings are meaningless here.) It runs in a subprocess of its own: the
script times back-to-back interpreted kernels and leaves nothing behind in the test worker."""
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _stages(shape, only):
    """stdout of ``bench_hopper_stages.py --interpret --shapes shape --reps 1 --only only`` (asserts a
    clean exit)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
               JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_hopper_stages.py"), "--interpret",
                          "--shapes", shape, "--reps", "1", "--only", only],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    return res.stdout


def test_bench_hopper_stages_interpret():
    # the stages of HopperTuning.save_states, the default gradient kernel, the persistent one and
    # the compact forward WY (HopperTuning.wy_compact)
    # (HopperVariants.grad_chunks_per_cta=2: T = 70 is two chunks) (every precomputed
    # intermediate runs too: forward WY, backward WY, recompute, reverse pass); T = 70 is not a
    # multiple of the chunk (dO is padded to the kernels' time axis)
    # (--only with ';' separators, so that a label with a comma, "+ h, Vn", is one filter)
    # ('=' matches a whole name: "fwd WY + T compact" is not timed)
    text = _stages("1x70x1x64", "+ h, Vn;own dVl;gradient kernel;bwd grads 2 per;=fwd WY compact;own barriers")
    for name in ("fwd state pass + h, Vn", "bwd reverse, own dVl", "bwd gradient kernel", "bwd grads 2 per CTA",
                 "fwd WY compact", "fwd WY own barriers", "fwd state pass + h, Vn own barriers",
                 "bwd reverse own barriers", "bwd grads own barriers", "fwd WY auto barriers",
                 "fwd state pass + h, Vn auto barriers", "bwd reverse auto barriers", "bwd grads auto barriers",
                 "bwd WY from saved own barriers", "bwd WY from saved auto barriers"):
        assert re.search(re.escape(name) + r" +[0-9.]+ \(per call [0-9.]+\) ms", text), (name, text)
    # HopperTuning.wy_compact's lines check their outputs against the default's, auto_barriers False's against True's
    assert "fwd WY compact: outputs equal to the separate layout's: True" in text, text
    for name in ("fwd WY own barriers", "fwd WY + T own barriers", "fwd state pass own barriers",
                 "fwd state pass + h, Vn own barriers", "bwd reverse own barriers", "bwd grads own barriers",
                 "bwd WY from saved own barriers"):
        assert f"{name}: outputs equal to the automatic barriers': True" in text, text
    assert not re.search(r"fwd WY +[0-9]", text) and "pallas" not in text  # --only filters the rest
    assert "fwd WY + T compact" not in text, text


def test_bench_hopper_stages_k256_backward_lines():
    """At K = 256 (the backward not on the Hopper kernels) the script prints the Triton backward's
    stages and the two stages of wide_backward="hopper_xla" (the Hopper reverse pass, the XLA local
    gradients) on the Hopper forward's residuals."""
    text = _stages("1x70x1x256", "K256,[triton]")
    for name in ("bwd WY (+dVl) [triton]", "bwd reverse state pass [triton]", "bwd local grads [triton]"):
        assert re.search(re.escape(name) + r" +[0-9.]+ ms", text), (name, text)
    assert re.search(r"bwd reverse K256 \[hopper\] +[0-9.]+ \(per call", text), text
    assert re.search(r"bwd grads K256 \[xla\] +[0-9.]+ \(per call", text), text
    assert re.search(r"bwd grads K256 \[hopper blocks\] +[0-9.]+ \(per call", text), text


def test_summarize_timeline():
    """bench_hopper_stages --timeline's arithmetic on synthetic kernel events: two calls 5 ms apart,
    each two kernels (10 us and 20 us) with a 5 us gap; host wall 0.1 ms per call."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import bench_hopper_stages as bhs

    ev = []
    for t0 in (0, 5_000_000):
        ev += [(t0, t0 + 10_000, "wy"), (t0 + 15_000, t0 + 35_000, "grads")]
    text = bhs.summarize_timeline(ev, [1e-4, 1e-4])
    first = text.splitlines()[0]
    assert first.startswith("2 calls: wall 0.100 ms, kernel span 0.035, kernels busy 0.030 (2 kernels)"), first
    assert "idle inside the span 0.005, host outside it 0.065 ms" in first, first
    assert re.search(r"gap +5\.0 us +20\.0 us  grads", text), text
    assert bhs.summarize_timeline([], [1.0]).startswith("no device kernels")


def test_bench_knockouts_interpret():
    """benchmarks/bench_knockouts.py on CPU (interpret mode): every knockout's text edit still applies
    to today's kernel source (a stale edit raises), each variant runs (the state pass's also with
    ``--producer``, the warp-specialised pass, without the loads' knockouts), the table lists them all,
    and the unmodified kernel's difference from itself is 0 while a knockout's is not."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
               JAX_PLATFORMS="cpu")
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import bench_knockouts as bk

    producer_edits = {k: v for k, v in bk.STATE_EDITS.items() if k not in bk._PRODUCER_SKIP}
    for kernel, edits, extra in (("wy", bk.WY_EDITS, []), ("grads", bk.GRAD_EDITS, []), ("state", bk.STATE_EDITS, []),
                                 ("state", producer_edits, ["--producer"])):
        res = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_knockouts.py"), "--kernel", kernel,
                              "--interpret"] + extra, capture_output=True, text=True, env=env, timeout=600)
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
        table = res.stdout.split("=== knockouts")[1]
        for name in edits:
            assert re.search(r"^" + re.escape(name) + r" +0\.000 ", table, re.M), (name, table)
        assert re.search(r"^base +0\.000 +(\w+ 0\.0e\+00 ?)+$", table, re.M), table
        first = {"wy": "no inverse rounds", "grads": "T^T dVn (so dX, dA) with T hi only",
                 "state": "no Q S, Aqk Vn (chain + store)"}[kernel]
        line = [ln for ln in table.splitlines() if ln.startswith(first)][0]
        assert any(float(v) > 0 for v in re.findall(r"\d\.\de[-+]\d\d", line)), line
        if kernel == "state" and not extra:  # the interpreter has no races: skipping the waits changes no value
            assert re.search(r"^no slot waits +0\.000 +(\w+ 0\.0e\+00 ?)+$", table, re.M), table


def test_bench_knockouts_stale_edit():
    """An edit whose text is no longer in the kernel's source is an error that names it."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import bench_knockouts as bk
    from gdn_jax.ops.pallas.hopper import wy

    import pytest

    with pytest.raises(ValueError, match="knockout 'gone': text not found in wy.py"):
        bk.edited_module(wy, [("no such line in the kernel", "")], "gone")


def test_bench_hopper_stages_transition_lines():
    """The transition form's stage lines (HopperTuning.fwd_form="transition", K = 64): the state pass
    with and without h / Vn, its values against the default pass, and the whole op."""
    text = _stages("1x130x1x64", "transition")
    for name in ("fwd state transition", "fwd state transition + h, Vn"):
        assert re.search(re.escape(name) + r" +[0-9.]+ \(per call [0-9.]+\) ms", text), (name, text)
    m = re.search(r"transition vs default pass rel_rms: o ([0-9.e+-]+)  final ([0-9.e+-]+)", text)
    assert m and 0 < float(m.group(1)) <= 4e-3 and float(m.group(2)) <= 4e-3, text
    assert "fwd form transition" in text, text


def _knockouts(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_knockouts.py"), *args],
                          capture_output=True, text=True, env=env, timeout=600)


def test_bench_knockouts_shape():
    """``--shape`` is honoured with ``--interpret`` (it was ignored until 2026-12-05) and checked."""
    res = _knockouts("--interpret", "--kernel", "wy", "--shape", "1x64x1x64", "--reps", "1")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "knockouts of the wy kernel at (1, 64, 1, 64)" in res.stdout, res.stdout
    for shape in ("1x64", "1x64x1x64,1x64x1x64", "0x64x1x64"):
        res = _knockouts("--interpret", "--shape", shape)
        assert res.returncode != 0 and "--shape" in res.stderr and "Traceback" not in res.stderr, res.stderr
