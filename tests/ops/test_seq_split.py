"""The sequence split of the Pallas op (``KernelConfig.seq_split``, ``gdn_jax.ops.seq_split``), in
interpret mode: o, the final state and the gradient of every input (q, k, v, g, beta,
initial_state) against the unsplit Pallas op (max |split - unsplit| <= 1e-4 max |unsplit| per
array: float32 rounding of the composed maps) and against the float64 reference (the suite's
tolerances, ``tests/conftest.py``); initial state, packed documents crossing piece boundaries (one
starting exactly on a boundary, an empty one), grouped value heads, T not a multiple of the piece
length, P = 2 and 4. Weak gates (g ~ -0.001), so that the state entering a piece matters (with
strong gates it would be forgotten within a few tokens and a wrong map could pass). Also the
planner's choices at the benchmark shapes, the declines and the unchanged program where the split
does not run."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import F32, GRAD_NAMES, TOL_GATE, TOL_GRAD, TOL_O, TOL_S, check_close, make_inputs, seed_of
from reference import reference, reference_grads

from gdn_jax.ops import KernelConfig, gated_delta_rule
from gdn_jax.ops.pallas import forward_kernels, backward_kernels
from gdn_jax.ops.pallas import split_plan

SPLIT_TOL = 1e-4
CU = [0, 30, 64, 64, 150, 200]  # P = 4 (pieces of 64): a document from 64 (a boundary) crossing 128, one empty at 64


def run(x, cfg, *, cu=None, chunk_size=16, l2norm=False):
    def loss(q, k, v, g, b, s):
        o, S = gated_delta_rule(q, k, v, g, b, initial_state=s, output_final_state=True, cu_seqlens=cu,
                                backend="pallas", chunk_size=chunk_size, kernel_config=cfg, use_qk_l2norm=l2norm)
        return jnp.sum(o.astype(F32) * x.do) + jnp.sum(S * x.dS), (o, S)

    grads, (o, S) = jax.jit(jax.grad(loss, argnums=tuple(range(6)), has_aux=True))(
        x.q, x.k, x.v, x.g, x.beta, x.S0)
    return dict(o=o, S=S, **{"d" + n: gr for n, gr in zip(GRAD_NAMES, grads)})


def inputs(case, B, T, Hk, group, K, V, N=None, l2norm=False):
    x = make_inputs(seed_of("seq-split", case), B, T, Hk * group, K, V, init=True, gates="weak", N=N,
                    normalize_qk=not l2norm)
    if group > 1:  # grouped value heads: q, k on the key heads
        rng = np.random.default_rng(seed_of("seq-split-qk", case))
        for n in ("q", "k"):
            a = rng.standard_normal((B, T, Hk, K))
            x[n] = jnp.asarray(a / np.linalg.norm(a, axis=-1, keepdims=True), F32)
    return x


@pytest.mark.parametrize("case", [
    dict(P=2, B=2, T=200, Hk=2, group=1, l2norm=True),  # T = 200 in pieces of 112: 24 padded tokens
    dict(P=4, B=1, T=200, Hk=1, group=2),  # GVA; pieces of 64
    dict(P=4, B=1, T=200, Hk=2, group=1, cu=CU),
    dict(P=2, B=1, T=200, Hk=1, group=2, cu=CU),  # pieces of 112: 64 .. 150 crosses 112
], ids=["dense-P2", "gva-P4", "packed-P4", "packed-gva-P2"])
def test_split_equals_unsplit_and_reference(case):
    P, cu, l2 = case["P"], case.get("cu"), case.get("l2norm", False)
    x = inputs(tuple(sorted((k, str(v)) for k, v in case.items())), case["B"], case["T"], case["Hk"], case["group"],
               16, 32, N=None if cu is None else len(cu) - 1, l2norm=l2)
    cu_j = None if cu is None else jnp.asarray(cu, jnp.int32)
    split_cfg = KernelConfig(platform="interpret", seq_split=P)
    assert forward_kernels(x.q, x.k, x.v, x.g, x.beta, chunk_size=16, cu_seqlens=cu_j,
                           kernel_config=split_cfg).pieces == P  # the split runs
    got = run(x, split_cfg, cu=cu_j, l2norm=l2)
    base = run(x, KernelConfig(platform="interpret"), cu=cu_j, l2norm=l2)
    for n, val in got.items():
        err = float(jnp.max(jnp.abs(val - base[n])))
        assert err <= SPLIT_TOL * float(jnp.max(jnp.abs(base[n]))), (n, err)
    args = (x.q, x.k, x.v, x.g, x.beta)
    ro, rS = reference(*args, initial_state=x.S0, cu_seqlens=cu, use_qk_l2norm=l2)
    rg = reference_grads(*args, initial_state=x.S0, cu_seqlens=cu, do=x.do, dS=x.dS, use_qk_l2norm=l2)
    pairs = {"o": (got["o"], ro, TOL_O), "S": (got["S"], rS, TOL_S)}
    pairs.update({"d" + n: (got["d" + n], rg[n], TOL_GATE if n in ("g", "beta") else TOL_GRAD) for n in GRAD_NAMES})
    check_close(pairs)


def test_entering_state_matters():
    """The test above can fail: a split whose pieces all start from zero (maps dropped) is far off."""
    x = inputs("zero-start", 1, 200, 2, 1, 16, 32)
    kw = dict(output_final_state=True, backend="pallas", chunk_size=16)
    o_split = gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, kernel_config=KernelConfig(platform="interpret",
                                                                                        seq_split=4), **kw)[0]
    pieces = lambda a: a.reshape(4, 50, *a.shape[2:])
    o_zero = gated_delta_rule(*(pieces(a) for a in (x.q, x.k, x.v, x.g, x.beta)),
                              kernel_config=KernelConfig(platform="interpret"), **kw)[0].reshape(o_split.shape)
    ro, _ = reference(x.q, x.k, x.v, x.g, x.beta)
    check_close({"o": (o_split, ro, TOL_O)})
    with pytest.raises(AssertionError):
        check_close({"o": (o_zero, ro, TOL_O)})


# the planner at the benchmark shapes (benchmarks/bench_pallas.py, bench_seq_split.py) on 132 SMs
PLANS = {(4, 4096, 16, 128): 1, (8, 2048, 16, 128): 1, (1, 16384, 16, 128): 4, (2, 8192, 16, 64): 4,
         (2, 8192, 8, 256): 1, (1, 32768, 16, 128): 4, (1, 16384, 8, 128): 8}


@pytest.mark.parametrize("shape", list(PLANS))
def test_planner_choices(shape):
    B, T, H, D = shape
    assert split_plan.auto_pieces(B, H, D, D, T, 64, 132) == PLANS[shape]
    pieces, why = split_plan.decide("auto", B=B, T=T, H=H, K=D, V=D, chunk=64, platform="gpu", sms=132)
    assert pieces == PLANS[shape] and (why is None) == (pieces > 1), (pieces, why)


def test_planner_auto_declines_where_the_hopper_kernels_run():
    """Where the Hopper kernels are asked for, "auto" does not split (every measured split lost on an
    H100: split_plan.MEASURED_HOPPER), with the reason; an explicit piece count still splits; the
    Triton kernels keep the model's choice."""
    from gdn_jax.ops.pallas.platform import hopper_asked

    assert all(max(fw, fb) < 1 for rec in split_plan.MEASURED_HOPPER.values() for fw, fb in rec.values())
    kw = dict(B=1, T=16384, H=16, K=128, V=128, chunk=64, platform="gpu", sms=132)
    pieces, why = split_plan.decide("auto", hopper=True, **kw)
    assert pieces == 1 and "Hopper" in why and "MEASURED_HOPPER" in why
    assert split_plan.decide(4, hopper=True, **kw) == (4, None)
    assert split_plan.decide("auto", hopper=False, **kw) == (4, None)
    assert hopper_asked("mosaic", "gpu") and not hopper_asked("triton", "gpu")
    assert not hopper_asked("mosaic", "interpret") and not hopper_asked(None, "interpret")


def test_planner_sm_count_and_report():
    """More SMs split more (the rule fills SMs); the report of a benchmark shape (traced, no arrays)."""
    assert split_plan.auto_pieces(4, 16, 128, 128, 4096, 64, 132) == 1
    assert split_plan.auto_pieces(4, 16, 128, 128, 4096, 64, 528) > 1
    assert split_plan.auto_pieces(1, 16, 128, 128, 512, 64, 132) == 1  # pieces of >= 4 chunks: T too short
    shape = (1, 16384, 16, 128)
    sds = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)] * 3 + [jax.ShapeDtypeStruct(shape[:3], F32)] * 2
    got = []
    cfg = KernelConfig(platform="interpret", seq_split="auto")
    jax.eval_shape(lambda *a: got.extend(f(*a, chunk_size=64, kernel_config=cfg)
                                         for f in (forward_kernels, backward_kernels)) or 0, *sds)
    assert [r.pieces for r in got] == [4, 4] and got[0].split_reason is None


def test_declines():
    """Declined by name: T too short, per-value-channel beta, per-key-channel g, "auto" choosing 1; a
    declined split runs the unsplit program (the same jaxpr); bad options are refused when made."""
    assert split_plan.decide(4, B=1, T=100, H=2, K=16, V=16, chunk=16, platform="interpret")[1].startswith("T=100")
    assert "per-value-channel" in split_plan.decide(2, B=1, T=512, H=2, K=16, V=16, chunk=16, platform="interpret",
                                                    beta_per_channel=True)[1]
    assert "per-key-channel" in split_plan.decide(2, B=1, T=512, H=2, K=16, V=16, chunk=16, platform="interpret",
                                                  g_per_channel=True)[1]
    assert split_plan.decide(None, B=1, T=512, H=2, K=16, V=16, chunk=16, platform="interpret") == (1, None)
    x = inputs("decline", 1, 100, 2, 1, 16, 16)
    short = KernelConfig(platform="interpret", seq_split=4)
    rep = forward_kernels(x.q, x.k, x.v, x.g, x.beta, chunk_size=16, kernel_config=short)
    assert rep.pieces == 1 and "too short" in rep.split_reason

    def jaxpr(cfg):
        f = lambda *a: gated_delta_rule(*a, backend="pallas", chunk_size=16, kernel_config=cfg)[0].sum()
        return str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2, 3, 4)))(x.q, x.k, x.v, x.g, x.beta))

    plain = jaxpr(KernelConfig(platform="interpret"))
    assert jaxpr(short) == plain
    assert jaxpr(KernelConfig(platform="interpret", seq_split="auto")) == plain  # auto: 1 piece here
    assert jaxpr(KernelConfig(platform="interpret", seq_split=2)) != plain  # T = 100 >= 2 x 2 x 16: split
    for bad, err in ((3, ValueError), (1, ValueError), (128, ValueError), ("half", TypeError), (True, TypeError)):
        with pytest.raises(err, match="seq_split"):
            KernelConfig(seq_split=bad)
    from gdn_jax.cli import parse_kernel_config  # the benchmarks' command lines

    assert [parse_kernel_config([f"seq_split={s}"]).seq_split for s in ("4", "auto", "none")] == [4, "auto", None]


def test_hopper_kernels_bf16():
    """The Hopper (Mosaic GPU) kernels in their interpreter, bf16, K = V = 64, chunk 64, P = 2 (the
    GPU's default path): against the float64 reference at the suite's tolerances and against the
    unsplit op within bf16 rounding (rel. rms <= 8e-3; measured <= 5e-3)."""
    from reference import rel_rms

    x = make_inputs(seed_of("seq-split-hopper"), 1, 256, 2, 64, 64, init=True, gates="weak", dtype=jnp.bfloat16)
    cfg = KernelConfig(platform="interpret", gpu_kernels="mosaic", seq_split=2)
    rep = forward_kernels(x.q, x.k, x.v, x.g, x.beta, chunk_size=64, kernel_config=cfg)
    assert (rep.kernels, rep.pieces) == ("hopper", 2), rep
    got = run(x, cfg, chunk_size=64)
    base = run(x, KernelConfig(platform="interpret", gpu_kernels="mosaic"), chunk_size=64)
    for n, val in got.items():
        assert rel_rms(val, base[n]) <= 8e-3, (n, rel_rms(val, base[n]))
    args = (x.q, x.k, x.v, x.g, x.beta)
    ro, rS = reference(*args, initial_state=x.S0)
    rg = reference_grads(*args, initial_state=x.S0, do=x.do, dS=x.dS)
    pairs = {"o": (got["o"], ro, TOL_O), "S": (got["S"], rS, TOL_S)}
    pairs.update({"d" + n: (got["d" + n], rg[n], TOL_GATE if n in ("g", "beta") else TOL_GRAD) for n in GRAD_NAMES})
    check_close(pairs)
