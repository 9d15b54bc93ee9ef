"""Tests of the Hopper (Mosaic GPU) forward kernels of ``backend="pallas"`` without a GPU.

* numerics: ``KernelConfig(platform="interpret", gpu_kernels="mosaic")`` runs the kernels of
  ``gdn_jax/ops/pallas/hopper/`` (wy.py, state_fwd.py) in Mosaic GPU's interpret mode (TMA slots, barriers and
  indexing interpreted; the matmuls computed with jnp), compared with the float64 reference of
  ``tests/reference.py`` (o, final state and every gradient: the backward is the Triton path's);
* dispatch: which calls the Hopper kernels take (``hopper.plan.fwd_covers``) and that the others fall
  back to the Triton kernels with the same numbers;
* lowering: both kernels lowered for CUDA with ``jax.export(..., platforms=["cuda"])`` (Mosaic
  GPU's own lowering: TMA descriptors, wgmma, register layouts).

Tolerances (rel_rms against float64 on the same rounded inputs): 5e-3 for o and the final state,
8e-3 for dq, dk, dv, d initial_state, 2e-2 for dg, dbeta (tests/conftest.py).
"""
from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (BF16, F16, F32, GRAD_NAMES, TOL_GATE, TOL_GRAD, TOL_O, TOL_S, check_close, cuda_lowering,
                      make_inputs, seed_of, tuned)
from reference import reference, reference_grads

from gdn_jax.ops import HopperTuning, KernelConfig, Precision, TritonTuning, gated_delta_rule
from gdn_jax.ops.pallas import hopper, paths
from gdn_jax.ops.pallas.config import resolve
from gdn_jax.ops.pallas.hopper.tuning import HopperVariants
from gdn_jax.ops.pallas.vjp import to_kernel_inputs

MOSAIC = KernelConfig(platform="interpret", gpu_kernels="mosaic")


def _run(x, config, *, chunk_size=64, cu_seqlens=None):
    """(o, S, grads) of backend='pallas' through the public op, jitted."""
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    S0 = x["S0"] if x["S0"] is None else jnp.asarray(x["S0"], F32)
    fn = functools.partial(gated_delta_rule, output_final_state=True, backend="pallas", chunk_size=chunk_size,
                           kernel_config=config, cu_seqlens=cu_seqlens)
    do, dS = jnp.asarray(x["do"], F32), jnp.asarray(x["dS"], F32)

    def loss(q, k, v, g, b, s):
        o, S = fn(q, k, v, g, b, initial_state=s)
        return jnp.sum(o.astype(F32) * do) + jnp.sum(S * dS), (o, S)

    argnums = (0, 1, 2, 3, 4) + ((5,) if S0 is not None else ())
    gr, (o, S) = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(q, k, v, g, beta, S0)
    return o, S, dict(zip(GRAD_NAMES, gr))


def _check(x, got, *, cu_seqlens=None):
    o, S, gr = got
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    ro, rS = reference(*args, initial_state=x["S0"], cu_seqlens=cu_seqlens)
    rg = reference_grads(*args, initial_state=x["S0"], cu_seqlens=cu_seqlens, do=x["do"], dS=x["dS"])
    pairs = {"o": (o, ro, TOL_O), "S": (S, rS, TOL_S)}
    for n, val in gr.items():
        pairs["d" + n] = (val, rg[n], TOL_GATE if n in ("g", "beta") else TOL_GRAD)
    return check_close(pairs)


def _mosaic_taken(x, config, chunk_size=64, cu_seqlens=None):
    prep = to_kernel_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=chunk_size, config=config,
                            cu_seqlens=cu_seqlens)
    return prep.paths[0].startswith("hopper")


# (gates, B, T, H key heads, group, K, V, init): T not a multiple of the chunk, K != V, GVA,
# strong and weak gates, with and without an initial state
CASES = [
    ("strong", 1, 150, 2, 1, 128, 128, True),
    ("weak", 2, 64, 1, 1, 64, 128, False),
    ("strong", 1, 100, 1, 2, 128, 64, True),  # grouped value heads: 2 value heads per key head
    (("fla", 0.02), 1, 90, 2, 1, 64, 64, False),  # gates -16 .. -35 per token
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_mosaic_forward_matches_float64(case):
    gates, B, T, H, G, K, V, init = case
    x = make_inputs(seed_of("hopper", case), B, T, H, K, V, gates=gates, dtype=BF16, init=init)
    if G > 1:  # grouped value heads: v, g, beta, S0, do, dS on H * G heads
        y = make_inputs(seed_of("hopper-v", case), B, T, H * G, K, V, gates=gates, dtype=BF16, init=init)
        x = dict(x, v=y["v"], g=y["g"], beta=y["beta"], S0=y["S0"], do=y["do"], dS=y["dS"])
    assert _mosaic_taken(x, MOSAIC), "the Hopper kernels did not take a call they cover"
    _check(x, _run(x, MOSAIC))


def test_mosaic_beta_near_two():
    """Negative eigenvalues (beta in (0, 2)), no decay: the bound of the 16-bit Pallas path."""
    x = make_inputs(seed_of("hopper-beta2"), 1, 128, 1, 128, 128, gates="zero", dtype=BF16)
    x["beta"] = jnp.asarray(1.9 * np.ones(x["beta"].shape), BF16)
    errs = check_close({"o": (_run(x, MOSAIC)[0], reference(x["q"], x["k"], x["v"], x["g"], x["beta"])[0], 1e-2)})
    assert errs["o"] > 0


def test_mosaic_equals_triton_path_numbers():
    """The two GPU kernel families compute the same thing (both bf16 intermediates)."""
    x = make_inputs(seed_of("hopper-vs-triton"), 1, 128, 2, 128, 128, dtype=BF16, init=True)
    o_m, S_m, _ = _run(x, MOSAIC)
    o_t, S_t, _ = _run(x, KernelConfig(platform="interpret", gpu_kernels="triton"))
    rel = lambda a, b: float(jnp.linalg.norm((a.astype(F32) - b.astype(F32)).ravel()) / jnp.linalg.norm(b.astype(F32).ravel()))
    assert rel(o_m, o_t) < 8e-3 and rel(S_m, S_t) < 8e-3


def test_f32_inputs_bf16_operands():
    """``Precision(f32_inputs="bf16")``: float32 inputs take the 16-bit path (the Hopper
    kernels included); o, S and gradients are float32 and within the bf16 tolerances of the
    float64 reference on the unrounded inputs."""
    x = make_inputs(seed_of("hopper-f32"), 1, 96, 2, 128, 128, dtype=F32, init=True)
    cfg = dataclasses.replace(MOSAIC, precision=Precision(f32_inputs="bf16"))
    assert _mosaic_taken(x, cfg)
    o, S, gr = _run(x, cfg)
    assert o.dtype == F32 and S.dtype == F32 and all(g.dtype == F32 for g in gr.values())
    _check(x, (o, S, gr))
    assert not _mosaic_taken(x, dataclasses.replace(MOSAIC, precision=Precision(f32_inputs="keep")))


def test_f16_inputs_bf16_operands():
    """``Precision(f16_inputs="bf16")``: float16 inputs rounded to bf16 take the Hopper kernels;
    o, S and gradients come back float16 (S float32: the state's dtype) and within the bf16
    tolerances of the float64 reference on the unrounded inputs; "keep" (the default) leaves
    float16 to the Triton kernels."""
    x = make_inputs(seed_of("hopper-f16"), 1, 96, 2, 128, 128, dtype=F16, init=True)
    cfg = dataclasses.replace(MOSAIC, precision=Precision(f16_inputs="bf16"))
    assert _mosaic_taken(x, cfg)
    o, S, gr = _run(x, cfg)
    assert o.dtype == F16 and S.dtype == F32
    assert all(gr[n].dtype == F16 for n in ("q", "k", "v"))
    _check(x, (o, S, gr))
    assert not _mosaic_taken(x, MOSAIC)
    with pytest.raises(ValueError, match="f16_inputs"):
        KernelConfig(precision=Precision(f16_inputs="fp16"))


def _call(**kw):
    """The forward's call as the path the table chooses prepares it (the Hopper paths set its value
    block and form)."""
    base = dict(platform="interpret", C=64, n=4, BH=4, H=2, K=128, V=128, K0=128, V0=128, scale=0.1,
                in_dt=BF16, packed=False, nseq=1, group=1)
    cfg = kw.pop("config", MOSAIC)
    base.update(kw)
    return paths.choose("fwd", resolve(cfg, **base)).call


def _on_hopper(call):
    """Whether the forward path the table chooses for ``call`` runs the Hopper kernels."""
    return paths.FORWARD_BY_NAME[paths.choose("fwd", call).path].hopper


def _fwd_reason(call):
    """Why the Hopper forward does not take ``call`` (with the Hopper paths' value block and form)."""
    return hopper.plan.fwd_covers(paths.hopper_call(call))


def _on_hopper_bwd(call):
    """Whether the backward path the table chooses for ``call`` (no forward given) is "hopper"."""
    return paths.choose("bwd", call).path == "hopper"


@pytest.mark.parametrize("kw,reason", [
    (dict(C=32), "chunk"),
    (dict(in_dt=F16), "bfloat16"),
    (dict(in_dt=F32), "bfloat16"),
    (dict(K=256, V=256, K0=256, V0=256, C=32), "chunk 32"),
    (dict(K=128, V=256, K0=128, V0=256, C=32), "chunk 32"),
    (dict(K=512, V=512, K0=512, V0=512), "K=512"),
    (dict(K=32, V=32, K0=32, V0=32), "K=32"),
    (dict(config=dataclasses.replace(MOSAIC, precision=Precision(mid_dtype="f32"))), "mid_dt"),
    (dict(config=dataclasses.replace(MOSAIC, triton=TritonTuning(fuse_output=False))), "fuse_output"),
    (dict(config=dataclasses.replace(MOSAIC, precision=Precision(u_dtype="f32"))), "u_dt"),
])
def test_coverage_reasons(kw, reason):
    call = _call(**kw)
    assert not _on_hopper(call)
    assert reason in _fwd_reason(call)


def test_default_block():
    # 64 where that gives >= 64 CTAs; halved on a GPU for few (batch x head) rows; interpret keeps 64
    assert hopper.plan.default_block(64, 128) == 64 and hopper.plan.default_block(128, 128) == 64
    assert hopper.plan.default_block(16, 128) == 32 and hopper.plan.default_block(32, 64) == 32
    assert hopper.plan.default_block(2, 64) == 16 and hopper.plan.default_block(4, 32) == 16
    assert hopper.plan.default_block(2, 64, "interpret") == 64
    assert _call(platform="gpu", config=dataclasses.replace(MOSAIC, platform="gpu"), BH=16, H=16).bv_mosaic == 32


def test_dispatch():
    assert _on_hopper(_call())
    assert _on_hopper(_call(group=2, BH=4, H=2))
    assert _call(config=dataclasses.replace(MOSAIC, triton=TritonTuning(bv_state=32))).bv_mosaic == 32
    assert not _on_hopper(_call(config=KernelConfig(platform="interpret")))  # None: Hopper GPUs only
    assert not _on_hopper(_call(config=KernelConfig(platform="interpret", gpu_kernels="triton")))
    assert not _on_hopper(_call(platform="tpu_interpret", config=dataclasses.replace(MOSAIC, platform="tpu_interpret")))
    with pytest.raises(ValueError, match="gpu_kernels"):
        KernelConfig(gpu_kernels="cuda")
    with pytest.raises(ValueError, match="f32_inputs"):
        KernelConfig(precision=Precision(f32_inputs="tf32"))
    with pytest.raises(ValueError, match="HopperTuning.wy_inverse must be one of"):
        KernelConfig(hopper=HopperTuning(wy_inverse="Blocked"))
    for bad in (None, 1, "yes"):
        with pytest.raises(TypeError, match="HopperTuning.wy_compact must be True or False"):
            KernelConfig(hopper=HopperTuning(wy_compact=bad))
    with pytest.raises(TypeError, match="HopperTuning.wy_inverse must be one of"):
        KernelConfig(hopper=HopperTuning(wy_inverse=np.array([1, 2])))
    with pytest.raises(ValueError, match="HopperTuning.wy_precision must be one of"):
        KernelConfig(hopper=HopperTuning(wy_precision="tf32"))
    with pytest.raises(ValueError, match="HopperTuning.grad_precision must be one of"):
        KernelConfig(hopper=HopperTuning(grad_precision="fp8"))


@pytest.mark.parametrize("cu", [(0, 40, 41, 150), (0, 64, 64, 100, 230)], ids=["len1", "empty"])
def test_mosaic_packed_sequences(cu):
    """cu_seqlens: the state restarts from initial_state[n] at each sequence's first chunk and is
    written after its last (a length-1 and an empty sequence included)."""
    N = len(cu) - 1
    x = make_inputs(seed_of("hopper-packed", cu), 1, cu[-1], 2, 128, 64, dtype=BF16, init=True, N=N)
    cu = jnp.asarray(cu, jnp.int32)
    assert _mosaic_taken(x, MOSAIC, cu_seqlens=cu)
    o, S, _ = _run(x, MOSAIC, cu_seqlens=cu)
    ro, rS = reference(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["S0"], cu_seqlens=cu)
    # the forward only: the gradients come from the Triton backward (tests/ops/test_pallas.py); its
    # bf16 dg in the "len1" case is 2.1e-2, just over the 2e-2 gate, with either forward
    check_close({"o": (o, ro, TOL_O), "S": (S, rS, TOL_S)})


def test_uncovered_call_falls_back_with_same_numbers():
    """float16 is not covered: gpu_kernels="mosaic" runs the Triton kernels, still exact."""
    x = make_inputs(seed_of("hopper-f16"), 1, 100, 1, 64, 64, dtype=F16, init=True)
    assert not _mosaic_taken(x, MOSAIC)
    _check(x, _run(x, MOSAIC))


@pytest.mark.parametrize("K,V,group,bv,packed", [(128, 128, 1, 64, False), (64, 128, 2, 32, False),
                                                 (64, 64, 1, 16, False), (128, 128, 1, 64, True)])
def test_cuda_lowering_export(K, V, group, bv, packed):
    """Both Hopper kernels through Mosaic GPU's lowering for CUDA (no GPU needed)."""
    B, T, H = 1, 256, 2
    cu = jnp.asarray([0, 100, 101, 256], jnp.int32) if packed else None
    cfg = KernelConfig(platform="gpu", gpu_kernels="mosaic", triton=TritonTuning(bv_state=bv))
    sds = [jax.ShapeDtypeStruct(s, BF16) for s in ((B, T, H, K), (B, T, H, K), (B, T, H * group, V))]
    sds += [jax.ShapeDtypeStruct((B, T, H * group), F32), jax.ShapeDtypeStruct((B, T, H * group), BF16)]
    call = to_kernel_inputs(*[jnp.zeros(s.shape, s.dtype) for s in sds], chunk_size=64, config=cfg,
                            cu_seqlens=cu).calls[0]
    assert _on_hopper(call) and call.bv_mosaic == bv and call.group == group

    def fwd(q, k, v, g, b):
        return gated_delta_rule(q, k, v, g, b, output_final_state=True, backend="pallas", chunk_size=64,
                                kernel_config=cfg, cu_seqlens=cu)

    exp = jax.export.export(jax.jit(fwd), platforms=["cuda"])(*sds)
    text = exp.mlir_module()
    assert text.count("mosaic_gpu") >= 2, "expected the two Mosaic GPU kernels in the lowered module"


def test_forward_kernels_reports_the_path():
    from gdn_jax.ops.pallas import forward_kernels

    x = make_inputs(seed_of("hopper-fk"), 1, 70, 2, 128, 128, dtype=BF16)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert forward_kernels(*args, kernel_config=MOSAIC)[:3] == ("hopper", None, "hopper_wu")
    assert forward_kernels(*args, kernel_config=KernelConfig(platform="interpret"))[:3] == ("interpret", None, "fused")
    rep = forward_kernels(*args, chunk_size=32, kernel_config=MOSAIC)
    name, why = rep[:2]
    assert name == "interpret" and "chunk 32" in why
    # the path table's report: every other entry and why it does not run, in the table's order
    assert rep.path == "fused" and [n for n, _ in rep.not_taken] == ["hopper_t", "hopper_transition", "hopper_wu",
                                                                     "gatefree", "unfused"]
    assert "chunk 32" in dict(rep.not_taken)["hopper_wu"] and "comes first" in dict(rep.not_taken)["unfused"]
    y = [a.astype(F16) for a in args]
    assert "float16" in forward_kernels(*y, kernel_config=MOSAIC)[1]


def test_default_on_hopper(monkeypatch):
    """KernelConfig() on an sm_90 GPU: the Hopper forward for covered calls (cu_seqlens too: checked
    on an H200 by benchmarks/check_gpu.py), Triton for what it does not cover."""
    from gdn_jax.ops.pallas import platform as plat

    monkeypatch.setattr(plat, "is_hopper", lambda: True)
    gpu = dict(platform="gpu", config=KernelConfig())
    assert _on_hopper(_call(**gpu))
    assert _on_hopper(_call(packed=True, nseq=3, **gpu))
    assert not _on_hopper(_call(in_dt=F16, **gpu))
    monkeypatch.setattr(plat, "is_hopper", lambda: False)
    assert not _on_hopper(_call(**gpu))


@pytest.mark.parametrize("K,V,save_wy", [(64, 64, False), (128, 64, True)])
def test_blocked_inverse_equals_dense(K, V, save_wy, monkeypatch):
    """``HopperTuning(wy_inverse="blocked")``: the inverse's rounds inside the 16x16 diagonal blocks
    on those blocks alone (compressed [C, 16] products) give the dense rounds' T: the same nonzero
    bf16x3 products, so o, the final state and every gradient agree to float32 rounding
    (rel_rms <= 1e-5; measured 0 here) -- in the forward's WY and, with ``save_wy=False``, the
    backward's; and against float64 within the suite's tolerances."""
    from gdn_jax.ops.pallas.hopper import plan as HP, wy as HW

    x = make_inputs(seed_of("hopper-blocked", K, V), 1, 150, 2, K, V, gates="strong", dtype=BF16, init=True)
    dense = dataclasses.replace(MOSAIC, hopper=HopperTuning(save_wy=save_wy, wy_inverse="dense"))
    ref = _run(x, dense)
    calls = []
    real = HW._blocked_rounds
    monkeypatch.setattr(HW, "_blocked_rounds", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = _run(x, tuned(dense, hopper=dict(wy_inverse="blocked")))
    assert len(calls) == (1 if save_wy else 2)  # the forward's WY (and the backward's without save_wy)
    o, S, gr = got
    for a, b in [(o, ref[0]), (S, ref[1])] + [(gr[n], ref[2][n]) for n in gr]:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)) <= 1e-5
    _check(x, got)


def test_blocked_inverse_lowers_for_cuda():
    """value_and_grad with ``wy_inverse="blocked"`` (both WY kernels: ``save_wy=False``) through Mosaic
    GPU's CUDA lowering: the m64n16k16 wgmmas of the compressed rounds and the K = 16 expansion."""
    text = cuda_lowering(KernelConfig(platform="gpu", gpu_kernels="mosaic",
                                      hopper=HopperTuning(wy_inverse="blocked", save_wy=False)))
    assert text.count("mosaic_gpu") >= 6


@pytest.mark.parametrize("inverse,save_wy,precision", [("blocked", True, "bf16"), ("dense", False, "bf16"),
                                                       ("blocked", False, "bf16_blocks")])
def test_bf16_rounds(inverse, save_wy, precision):
    """``HopperTuning(wy_precision="bf16")``: the inverse's doubling rounds with bf16 operands (one
    wgmma per product instead of bf16x3's three) -- in the forward's WY and, with ``save_wy=False``,
    the backward's; ``"bf16_blocks"`` in the rounds inside the 16 x 16 diagonal blocks only. The option takes effect (o and the gradients differ from bf16x3's), the change
    stays below the bf16 rounding of the kernels' outputs (rel_rms <= 2e-3 against bf16x3; the
    rounds' errors do not compound: T_2 is exact and each round's accumulator is float32), and the
    result is within the suite's tolerances of float64."""
    x = make_inputs(seed_of("hopper-bf16-rounds", inverse), 1, 150, 2, 128, 128, gates="strong", dtype=BF16,
                    init=True)
    base = dataclasses.replace(MOSAIC, hopper=HopperTuning(save_wy=save_wy, wy_inverse=inverse, wy_precision="bf16x3"))
    ref = _run(x, base)
    got = _run(x, tuned(base, hopper=dict(wy_precision=precision)))
    o, S, gr = got
    errs = []
    for a, b in [(o, ref[0]), (S, ref[1])] + [(gr[n], ref[2][n]) for n in gr]:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        errs.append(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))
    assert max(errs) > 0 and max(errs) <= 2e-3, errs
    _check(x, got)


@pytest.mark.parametrize("wgs", [2, 1])
def test_grad_precision_bf16(wgs):
    """``HopperTuning(grad_precision="bf16")`` (the default) against ``"bf16x3"``: the gradient
    kernel's T phase (default "direct": Y Vn^T) with one bf16 wgmma per product, in both gradient
    kernels. It takes effect (dk, dbeta, dg differ from
    bf16x3's; o, the final state, dq and dv do not: the T phase feeds only dk and the gates), the
    change stays near one bf16 rounding of dk (rel_rms <= 3e-3 against bf16x3), and the gradients are
    within the suite's tolerances of float64."""
    x = make_inputs(seed_of("hopper-grad-precision", wgs), 1, 150, 2, 128, 128, gates="strong", dtype=BF16,
                    init=True)
    base = dataclasses.replace(MOSAIC, hopper=HopperTuning(grad_warpgroups=wgs, grad_precision="bf16x3"))
    got, errs = _t_phase_change(x, base, tuned(base, hopper=dict(grad_precision="bf16")))
    assert min(errs) > 0 and max(errs) <= 3e-3, errs
    _check(x, got)


def _t_phase_change(x, base, changed):
    """(outputs under ``changed``, RMS-relative changes of dk, dbeta, dg against ``base``) for a
    config change of the gradient kernel's T phase; asserts o, S, dq, dv are unchanged."""
    ref, got = _run(x, base), _run(x, changed)
    rel = lambda a, b: float(np.sqrt(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)
                                     / np.mean(np.asarray(b, np.float64) ** 2)))
    assert rel(got[0], ref[0]) == 0 and rel(got[1], ref[1]) == 0
    assert rel(got[2]["q"], ref[2]["q"]) == 0 and rel(got[2]["v"], ref[2]["v"]) == 0
    return got, [rel(got[2][n], ref[2][n]) for n in ("k", "beta", "g")]


@pytest.mark.parametrize("wgs,precision", [(2, "bf16x3"), (1, "bf16"), (2, "bf16")])
def test_grad_t_phase_direct(wgs, precision):
    """``HopperTuning(grad_t_phase="direct")`` (the default): dA = -strict((T^T dVn) Vn^T) (exact
    since (I + A)^T T^T = I) instead of ``"chain"``'s dT = (dVn Vn^T)(I + A)^T, T^T dT T^T, in both gradient
    kernels. It takes effect (dk, dbeta or dg differ from the chain's; with bf16x3 products the two
    forms agree to ~1e-7 in float32 in interpret mode, so often only dg, the float32 output, shows
    it; o, S, dq, dv do not differ), the change stays under one bf16 rounding of dk (rel_rms <= 3e-3
    against the chain), and the gradients are within the suite's tolerances of float64 (strong
    gates, an initial state, T not a multiple of the chunk)."""
    x = make_inputs(seed_of("hopper-grad-t-phase", wgs, precision), 1, 150, 2, 128, 128, gates="strong",
                    dtype=BF16, init=True)
    base = dataclasses.replace(MOSAIC, hopper=HopperTuning(grad_warpgroups=wgs, grad_precision=precision,
                                                          grad_t_phase="chain"))
    got, errs = _t_phase_change(x, base, tuned(base, hopper=dict(grad_t_phase="direct")))
    assert 0 < max(errs) <= 3e-3, errs
    _check(x, got)
    with pytest.raises(ValueError, match="grad_t_phase"):
        KernelConfig(hopper=HopperTuning(grad_t_phase="fast"))


def test_grad_t_phase_direct_lowers_for_cuda():
    """Both Hopper gradient kernels with ``grad_t_phase="direct"`` lower for CUDA (bf16x3 and bf16),
    and so does the Triton backward with it."""
    for wgs, precision in ((2, "bf16x3"), (1, "bf16")):
        text = cuda_lowering(KernelConfig(platform="gpu", gpu_kernels="mosaic", hopper=HopperTuning(
            grad_t_phase="direct", grad_warpgroups=wgs, grad_precision=precision)))
        assert text.count("custom_call @mosaic_gpu") == 4
    text = cuda_lowering(KernelConfig(platform="gpu", gpu_kernels="triton", hopper=HopperTuning(grad_t_phase="direct")),
                         triton=True)
    assert "__gpu$xla.gpu.triton" in text  # the Triton gradient kernel's form (tests/ops/test_pallas.py)


def test_bf16_rounds_lower_for_cuda():
    """value_and_grad with ``wy_precision="bf16"`` through Mosaic GPU's CUDA lowering, both WY
    kernels (``save_wy=False``), the compact forward WY among them, and the gradient kernel with
    ``grad_precision="bf16"``."""
    text = cuda_lowering(KernelConfig(platform="gpu", gpu_kernels="mosaic", hopper=HopperTuning(
        wy_precision="bf16", wy_compact=True, save_wy=False, grad_precision="bf16")))
    assert text.count("mosaic_gpu") >= 6


@pytest.mark.parametrize("inverse,save_wy,group", [("blocked", True, 1), ("dense", False, 2)])
def test_compact_wy_equals_separate(inverse, save_wy, group, monkeypatch):
    """``HopperTuning(wy_compact=True)``: the forward WY kernel with v in q's tile (loaded after
    Q K^T), Aqk's staging tile reused as the inverse's L hi tile, W / U formed one after the other
    and leaving through K's / v's tiles gives the separate layout's values bit for bit (the same
    products) -- with and without the saved T (``save_wy``), both inverses, grouped value heads; and
    the compact layout did run (its shared-memory budget is the smaller one)."""
    from gdn_jax.ops.pallas.hopper import plan as HP, wy as HW

    x = make_inputs(seed_of("hopper-compact", inverse, group), 1, 150, 2, 128, 128, gates="strong", dtype=BF16,
                    init=True)
    if group > 1:
        y = make_inputs(seed_of("hopper-compact-v", inverse), 1, 150, 2 * group, 128, 128, gates="strong",
                        dtype=BF16, init=True)
        x = dict(x, v=y["v"], g=y["g"], beta=y["beta"], S0=y["S0"], do=y["do"], dS=y["dS"])
    base = dataclasses.replace(MOSAIC, hopper=HopperTuning(save_wy=save_wy, wy_inverse=inverse, wy_compact=False))
    ref = _run(x, base)
    seen = []
    real = HP.wy_compact
    monkeypatch.setattr(HW, "wy_compact", lambda call: seen.append(real(call)) or real(call))
    got = _run(x, tuned(base, hopper=dict(wy_compact=True)))
    assert any(seen) and not HP.wy_compact(_call(config=base))
    for a, b in [(got[0], ref[0]), (got[1], ref[1])] + [(got[2][n], ref[2][n]) for n in ref[2]]:
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    _check(x, got)
    call = _call(config=dataclasses.replace(MOSAIC, hopper=HopperTuning(wy_compact=True)))
    assert HP.wy_smem_bytes(call) <= (227 * 1024) // 3 - 1024 < HP.wy_smem_bytes(dataclasses.replace(
        call, wy_compact=False))
    # K != V: the separate tiles (v cannot share q's)
    assert not HP.wy_compact(dataclasses.replace(call, V=64))


@pytest.mark.parametrize("save_wy", [True, False])
def test_compact_wy_lowers_for_cuda(save_wy):
    """value_and_grad with ``wy_compact=True`` through Mosaic GPU's CUDA lowering (the forward WY
    kernel with and without the saved T; the backward's WY, when it runs, keeps its layout)."""
    text = cuda_lowering(KernelConfig(platform="gpu", gpu_kernels="mosaic",
                                      hopper=HopperTuning(wy_compact=True, save_wy=save_wy)))
    assert text.count("mosaic_gpu") >= 4


def _two_wg_case(K, V, group, cu):
    """The two-warpgroup gradient kernel against the one-warpgroup kernel and float64 (the body of
    :func:`test_two_warpgroup_gradient_kernel`)."""
    from gdn_jax.ops.pallas.hopper import grads as HG, plan as HP

    N = None if cu is None else len(cu) - 1
    x = make_inputs(seed_of("hopper-2wg", K, V, group), 1, 150, 2, K, V, gates="strong", dtype=BF16, init=True,
                    N=N)
    if group > 1:  # value heads: 2 per key head
        y = make_inputs(seed_of("hopper-2wg-v", K, V), 1, 150, 2 * group, K, V, gates="strong", dtype=BF16,
                        init=True, N=N)
        x = dict(x, v=y["v"], g=y["g"], beta=y["beta"], S0=y["S0"], do=y["do"], dS=y["dS"])
    cu_j = None if cu is None else jnp.asarray(cu, jnp.int32)
    one = _run(x, dataclasses.replace(MOSAIC, hopper=HopperTuning(grad_warpgroups=1)), cu_seqlens=cu_j)
    calls = []
    real = HG._chunk_grads_2wg
    HG._chunk_grads_2wg = lambda *a: calls.append(1) or real(*a)
    try:
        two = _run(x, dataclasses.replace(MOSAIC, hopper=HopperTuning(grad_warpgroups=2)), cu_seqlens=cu_j)
    finally:
        HG._chunk_grads_2wg = real
    assert calls, "the two-warpgroup kernel did not run"
    assert np.array_equal(np.asarray(two[0], np.float32), np.asarray(one[0], np.float32))
    for n in one[2]:
        a, b = np.asarray(two[2][n], np.float64), np.asarray(one[2][n], np.float64)
        assert np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)) <= 5e-3, n
    _check(x, two, cu_seqlens=cu_j)


@pytest.mark.parametrize("K,V,group,cu", [(128, 128, 1, None), (64, 128, 2, (0, 70, 71, 150))])
def test_two_warpgroup_gradient_kernel(K, V, group, cu):
    """``HopperTuning(grad_warpgroups=2)``: the Hopper gradient kernel split over two warpgroups
    (Q path + T phase | dv, dKd + W phase, one barrier) gives the one-warpgroup kernel's gradients
    (rel_rms <= 5e-3: dW and the second warpgroup's dk partial are single bf16 operands there)
    and is within the suite's float64 tolerances; o and the final state are untouched. (Interpret
    mode runs the two warpgroups' work in turn in one thread: this checks the split's arithmetic
    and shared-memory hand-off; the barrier is checked by the CUDA lowering below and the GPU.)"""
    _two_wg_case(K, V, group, cu)


def test_two_warpgroup_gradient_kernel_config():
    """grad_warpgroups: 1 or 2 (bad values name the field); its shared memory fits at K = V = 128."""
    from gdn_jax.ops.pallas.hopper import grads as HG, plan as HP

    with pytest.raises(ValueError, match=r"HopperTuning.grad_warpgroups must be one of \(1, 2\)"):
        KernelConfig(hopper=HopperTuning(grad_warpgroups=3))
    with pytest.raises(TypeError, match=r"HopperTuning.grad_warpgroups must be one of \(1, 2\)"):
        KernelConfig(hopper=HopperTuning(grad_warpgroups=True))
    x = make_inputs(seed_of("hopper-2wg-cov"), 1, 64, 1, 128, 128, dtype=BF16)
    prep = to_kernel_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=64,
                            config=dataclasses.replace(MOSAIC, hopper=HopperTuning(grad_warpgroups=2)))
    call = prep.calls[1]
    assert call.grad_wgs == 2 and _on_hopper_bwd(call)
    assert HP.grads_smem_bytes(call) <= HP.SMEM_BYTES


@pytest.mark.parametrize("wgs", [1, 2])
def test_gradient_kernel_lowers_for_cuda(wgs):
    """value_and_grad with ``grad_warpgroups`` 1 and 2 (the default: two warpgroups per CTA, the
    cross-warpgroup barrier) through Mosaic GPU's CUDA lowering."""
    text = cuda_lowering(KernelConfig(platform="gpu", gpu_kernels="mosaic", hopper=HopperTuning(grad_warpgroups=wgs)))
    assert text.count("mosaic_gpu") >= 5


def _form_against_wu(x, form, save_states, cu):
    """``HopperTuning(fwd_form=form)`` against the default "wu" forward on inputs ``x``: the Hopper
    kernels take it, it takes effect (o differs), o, the final state and every gradient stay within
    4e-3 rel. RMS of "wu"'s (the kernels' bf16 rounding) and within the suite's tolerances of float64."""
    base = dataclasses.replace(MOSAIC, hopper=HopperTuning(save_states=save_states))
    cfg = tuned(base, hopper=dict(fwd_form=form))
    assert _mosaic_taken(x, cfg, cu_seqlens=cu)
    ref = _run(x, base, cu_seqlens=cu)
    got = _run(x, cfg, cu_seqlens=cu)
    rel = lambda a, b: float(np.sqrt(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)
                                     / np.mean(np.asarray(b, np.float64) ** 2)))
    errs = [rel(got[0], ref[0]), rel(got[1], ref[1])] + [rel(got[2][n], ref[2][n]) for n in got[2]]
    assert errs[0] > 0 and max(errs) <= 4e-3, errs
    _check(x, got, cu_seqlens=cu)


@pytest.mark.parametrize("save_states,group,packed", [(True, 1, False), (False, 2, True)])
def test_fwd_form_t(save_states, group, packed):
    """``HopperTuning(fwd_form="t")``: the WY kernel hands T (hi, lo) to the state pass, which forms
    Vn = T (beta V - beta e^gamma (K S)) instead of U - W S. Strong gates with an initial state,
    then grouped value heads with ``cu_seqlens`` (an empty and a length-1 sequence), with and
    without ``save_states`` (where the forward also writes W for the backward). It takes effect
    (o differs from "wu"'s), the change stays at the kernels' bf16 rounding (rel_rms <= 4e-3
    against "wu": both ~3e-3 from float64 on these draws, "wu" a little closer since W and U are
    formed from the unrounded K and V), and o, S and every gradient are within the suite's
    tolerances of float64."""
    T, N = 150, (4 if packed else None)
    cu = jnp.asarray([0, 40, 40, 41, T], jnp.int32) if packed else None
    seed = seed_of("hopper-fwd-form-t", save_states, group)
    x = make_inputs(seed, 1, T, 2, 128, 128, gates="strong", dtype=BF16, init=True, N=N)
    if group > 1:  # grouped value heads: v, g, beta, S0, do, dS on 2 * group heads
        y = make_inputs(seed + 1, 1, T, 2 * group, 128, 128, gates="strong", dtype=BF16, init=True, N=N)
        x = dict(x, v=y["v"], g=y["g"], beta=y["beta"], S0=y["S0"], do=y["do"], dS=y["dS"])
    _form_against_wu(x, "t", save_states, cu)


@pytest.mark.parametrize("grad", [True, False])
def test_fwd_form_t_lowers_for_cuda(grad):
    """``fwd_form="t"`` through Mosaic GPU's CUDA lowering: value_and_grad (the forward WY kernel
    with W for the backward, the state pass keeping h and Vn) and the forward alone (no W)."""
    cfg = KernelConfig(platform="gpu", gpu_kernels="mosaic", hopper=HopperTuning(fwd_form="t"))
    if grad:
        assert cuda_lowering(cfg).count("mosaic_gpu") >= 4
        return
    sds = [jax.ShapeDtypeStruct((1, 256, 2, 128), BF16)] * 3
    sds += [jax.ShapeDtypeStruct((1, 256, 2), F32), jax.ShapeDtypeStruct((1, 256, 2), BF16)]
    fn = lambda q, k, v, g, b: gated_delta_rule(q, k, v, g, b, backend="pallas", chunk_size=64, kernel_config=cfg)[0]
    text = jax.export.export(jax.jit(fn), platforms=["cuda"])(*sds).mlir_module()
    assert text.count("custom_call @mosaic_gpu") == 2


@pytest.mark.parametrize("packed,form", [(False, None), (True, None), (True, "wu")])
def test_fwd_form_t_k256(packed, form):
    """K = V = 256 on the Hopper forward (``fwd_form="t"``, the default there, or "wu": the state
    pass keeps one q tile -- and in "wu" one W tile --, :func:`hopper.plan.single_q`, and the default
    value block halves to fit shared memory): o and the final state against float64, T not a
    multiple of the chunk, with an initial state, with and without ``cu_seqlens``; the backward is
    the platform's (the Hopper backward takes K <= 128)."""
    T, N = 150, (3 if packed else None)
    cu = jnp.asarray([0, 1, 64, T], jnp.int32) if packed else None
    x = make_inputs(seed_of("hopper-k256", packed, form), 1, T, 1, 256, 256, gates="strong", dtype=BF16, init=True,
                    N=N)
    cfg = dataclasses.replace(MOSAIC, hopper=HopperTuning(fwd_form=form))  # None: "t" where K > 128
    prep = to_kernel_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=64, config=cfg, cu_seqlens=cu)
    cf, cb = prep.calls
    assert _on_hopper(cf) and hopper.plan.single_q(cf) and cf.bv_mosaic == 32 and not _on_hopper_bwd(cb)
    assert hopper.plan.smem_bytes(cf, 32) <= hopper.plan.SMEM_BYTES < hopper.plan.smem_bytes(cf, 64)
    assert cf.fwd_form == (form or "t")
    o, S = gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=jnp.asarray(x["S0"], F32),
                            output_final_state=True, backend="pallas", chunk_size=64, kernel_config=cfg,
                            cu_seqlens=cu)
    ro, rS = reference(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["S0"], cu_seqlens=cu)
    check_close({"o": (o, ro, TOL_O), "S": (S, rS, TOL_S)})


@pytest.mark.parametrize("form", [None, "wu"])
def test_fwd_form_t_k256_lowers_for_cuda(form):
    """value_and_grad at K = V = 256 (``fwd_form`` None takes "t"): the Hopper forward (chunk 64, one q tile)
    and the Triton backward (``wide_backward="triton"``) lower for CUDA together."""
    cfg = KernelConfig(platform="gpu", gpu_kernels="mosaic",  # fwd_form None: "t" at K = 256
                       hopper=HopperTuning(fwd_form=form, wide_backward="triton"))
    text = cuda_lowering(cfg, D=256, triton=True)
    assert text.count("custom_call @mosaic_gpu") == 2 and "__gpu$xla.gpu.triton" in text


def test_approx_math_lowers_for_cuda():
    """``HopperTuning(approx_math=True)`` (the default): every Hopper kernel compiled with Mosaic GPU's
    ``approx_math`` (exp as ``ex2.approx``) lowers for CUDA, and the option reaches the kernels (the
    lowered module differs from ``approx_math=False``'s); interpret mode ignores it (same values)."""
    assert KernelConfig().hopper.approx_math and KernelConfig().hopper.late_o_store  # the defaults since 2026-12-03
    on = cuda_lowering(KernelConfig(platform="gpu", gpu_kernels="mosaic"))
    off = cuda_lowering(KernelConfig(platform="gpu", gpu_kernels="mosaic", hopper=HopperTuning(approx_math=False)))
    assert on.count("custom_call @mosaic_gpu") == off.count("custom_call @mosaic_gpu") >= 4 and on != off
    with pytest.raises(TypeError, match="approx_math"):
        KernelConfig(hopper=HopperTuning(approx_math=1))


def test_auto_barriers_lowers_for_cuda():
    """``HopperTuning.auto_barriers``: the WY kernels, the state pass, the reverse pass and the
    two-warpgroup gradient kernel compiled with Pallas' ``unsafe_no_auto_barriers`` and their own
    barriers (hopper.common.sync_own_barriers) lower for CUDA, and the option reaches exactly those kernels: the
    lowered modules of False that differ from True's are all four by default (the backward is the
    reverse pass and the gradient kernel), with ``save_wy=False`` also the backward's WY kernel,
    with ``save_states=False`` also the recompute and the backward's WY from the saved T, with
    ``grad_warpgroups=1`` not that gradient kernel; the
    default, None, differs from True in all of them but the reverse pass and from False in the
    reverse pass only. A non-bool is refused. Interpret mode has no barriers: the values are
    the same (test_scheduling_options_bit_equal)."""
    assert KernelConfig().hopper.auto_barriers is None
    # (without the location references, which number the call stack's frames)
    kernels = lambda text: [re.sub(r" loc\(#loc\d+\)", "", line) for line in text.splitlines()
                            if "custom_call @mosaic_gpu" in line]
    lower = lambda **kw: kernels(cuda_lowering(KernelConfig(platform="gpu", gpu_kernels="mosaic",
                                                            hopper=HopperTuning(**kw))))
    for extra, n_own in (({}, 4), (dict(save_wy=False), 5), (dict(save_states=False), 6), (dict(grad_warpgroups=1), 3)):
        on, off, default = (lower(auto_barriers=ab, **extra) for ab in (True, False, None))
        assert len(on) == len(off) == len(default) >= 4 and on != off
        # JAX 0.10 lowers the same kernel to the same text each time; JAX 0.11's modules (bytecode
        # with a kernel hash) differ between two lowerings of one config, so count only where they don't
        same = on == lower(auto_barriers=True, **extra)
        assert same or not jax.__version__.startswith("0.10.")  # CI's JAX: the exact count runs
        if same:
            assert sum(a != b for a, b in zip(on, off)) == n_own
            assert sum(a != b for a, b in zip(default, off)) == 1  # the reverse pass
            assert sum(a != b for a, b in zip(default, on)) == n_own - 1
    # the persistent forward WY (its per-step TMA-store wait and barrier)
    cuda_lowering(KernelConfig(platform="gpu", gpu_kernels="mosaic", hopper=HopperTuning(
        auto_barriers=False, variants=HopperVariants(wy_chunks_per_cta=2))))
    with pytest.raises(TypeError, match="auto_barriers"):
        KernelConfig(hopper=HopperTuning(auto_barriers=0))


@pytest.mark.parametrize("opt,form,packed", [
    (dict(auto_barriers=False), "wu", True),
    (dict(variants=HopperVariants(wy_chunks_per_cta=2)), "wu", True),
    (dict(variants=HopperVariants(wy_chunks_per_cta=3)), "t", True),
    (dict(late_o_store=True), "wu", False), (dict(late_o_store=True), "t", True)])
def test_scheduling_options_bit_equal(opt, form, packed):
    """Options that move work, not arithmetic: ``wy_chunks_per_cta=m`` (the forward WY kernel
    looping over m chunks per CTA with q, k and the gates in two TMA slots; 150 tokens are 3 chunks,
    so m = 2 leaves a tail CTA) and ``late_o_store`` (the state pass storing chunk i's output during
    chunk i+1's first wgmmas; the default, compared here with it off). o, the final state and the
    gradients equal bit for bit with the option on and off, with ``cu_seqlens`` or with
    ``save_states`` off, in both forward forms; each lowers for CUDA."""
    cu = jnp.asarray([0, 1, 100, 150], jnp.int32) if packed else None
    x = make_inputs(seed_of("hopper-scheduling", sorted(opt.items()), form, packed), 1, 150, 2, 128, 128, dtype=BF16,
                    init=True, N=3 if packed else None)
    base = dataclasses.replace(MOSAIC, hopper=HopperTuning(fwd_form=form, save_states=packed, late_o_store=False))
    ref = _run(x, base, cu_seqlens=cu)
    got = _run(x, tuned(base, hopper=opt), cu_seqlens=cu)
    pairs = [(got[0], ref[0]), (got[1], ref[1])] + [(got[2][n], ref[2][n]) for n in ref[2]]
    assert all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)) for a, b in pairs)
    text = cuda_lowering(KernelConfig(platform="gpu", gpu_kernels="mosaic", hopper=HopperTuning(fwd_form=form, **opt)))
    assert text.count("custom_call @mosaic_gpu") >= 4


def test_scheduling_options_checked():
    with pytest.raises(ValueError, match="wy_chunks_per_cta"):
        KernelConfig(hopper=HopperTuning(variants=HopperVariants(wy_chunks_per_cta=0)))
    with pytest.raises(TypeError, match="late_o_store"):
        KernelConfig(hopper=HopperTuning(late_o_store=None))


def test_k256_block_and_reason():
    """At K = V = 256 the default value block halves until the state pass fits (``hopper.plan.block_for``:
    32), and an explicit ``bv_state=64`` falls back to Triton with a reason that names the shared
    memory it needs and a block that fits."""
    k256 = dict(K=256, V=256, K0=256, V0=256)
    call = _call(**k256)
    assert _on_hopper(call) and call.bv_mosaic == hopper.plan.block_for(call) == 32
    assert hopper.plan.default_block(4, 256, "interpret") == 64
    bad = _call(**k256, config=dataclasses.replace(MOSAIC, triton=TritonTuning(bv_state=64)))
    assert not _on_hopper(bad) and "bv_state=32 fits" in _fwd_reason(bad)


@pytest.mark.parametrize("K,V,form", [(256, 128, "wu"), (128, 256, "t")])
def test_k256_mixed_head_dims(K, V, form):
    """K != V with one of them 256 on the Hopper forward (the WY kernel's separate tiles, W and U
    formed in column blocks of 128): o and the final state against float64."""
    x = make_inputs(seed_of("hopper-k256-mixed", K, V, form), 1, 150, 1, K, V, gates="strong", dtype=BF16, init=True)
    cfg = dataclasses.replace(MOSAIC, hopper=HopperTuning(fwd_form=form))
    assert _mosaic_taken(x, cfg)
    o, S = gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=jnp.asarray(x["S0"], F32),
                            output_final_state=True, backend="pallas", chunk_size=64, kernel_config=cfg)
    ro, rS = reference(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["S0"])
    check_close({"o": (o, ro, TOL_O), "S": (S, rS, TOL_S)})


@pytest.mark.parametrize("nc,D,form,packed", [(1, 2, "wu", False), (1, 3, "wu", True), (1, 2, "t", True),
                                               (2, 2, "wu", True), (2, 2, "t", False)])
def test_state_producer_kernel(nc, D, form, packed):
    """The warp-specialised state pass (``HopperTuning.state_producer``: a producer warpgroup issues
    each chunk's TMA copies into ``state_slots`` = D slots; ``state_warpgroups`` = nc compute
    warpgroups share a chunk's tiles) equals the one-warpgroup pass bit for bit: the forward (o,
    final state, and h, Vn with ``save_states``) and the backward's recompute (h, Vn), with and
    without ``cu_seqlens``, in both forward forms, with one and two compute warpgroups. Called
    kernel by kernel inside ``jax.jit`` (the op itself runs the one-warpgroup pass in interpret
    mode, see ``HopperTuning.state_producer``; the interpreter needs the 4 CPU devices that
    conftest sets to run three warpgroups); it lowers for CUDA inside the op."""
    from gdn_jax.ops.pallas import vjp as V

    cu = jnp.asarray([0, 1, 100, 150], jnp.int32) if packed else None
    x = make_inputs(seed_of("hopper-producer", nc, D, form, packed), 1, 150, 2, 128, 128, dtype=BF16,
                    init=not packed, N=3 if packed else None)
    prep = to_kernel_inputs(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=64, cu_seqlens=cu,
                            config=dataclasses.replace(MOSAIC, hopper=HopperTuning(fwd_form=form)))
    cf, fargs = prep.kernel_args("fwd")
    A = dict(zip(("q", "k", "v", "beta", "gc", "gr", "eg", "ekd", "dec", "h0", "fl"), fargs))
    assert _on_hopper(cf) and not hopper.plan.producer(cf)  # interpret mode: the op runs the one-warpgroup pass
    cw = dataclasses.replace(cf, state_prod=True, state_wgs=nc, state_slots=D, bv_mosaic=64 if (nc, D) == (1, 2) else 32)
    assert hopper.plan.producer(cw) and hopper.plan.fwd_covers(cw) is None
    base = dataclasses.replace(cw, state_prod=False)
    tf = form == "t"
    wy = hopper.wy.wy_forward(cf, A["q"], A["k"], A["v"], A["beta"], A["gc"], A["eg"], t_form=tf, with_w=tf)
    wy_wu = hopper.wy.wy_forward(dataclasses.replace(cf, fwd_form="wu"), A["q"], A["k"], A["v"], A["beta"], A["gc"],
                              A["eg"]) if tf else None

    def run(c, rec=False):
        q_args = () if rec else (A["q"], A["eg"], wy["aqk"])
        kw = {} if rec else dict(save_states=True)
        if tf and not rec:
            kw.update(v=A["v"], t=(wy["t_hi"], wy["t_lo"]), beta=A["beta"])
            return hopper.state_fwd.forward_states_and_output(c, None, None, A["k"], A["ekd"], A["dec"], A["h0"], A["fl"],
                                                    *q_args, **kw)
        if rec and tf:  # the backward's recompute takes W and U (the backward's WY) in either form
            c = dataclasses.replace(c, fwd_form="wu")
        w_u = wy_wu if rec and tf else wy
        return jax.jit(lambda w, u, *a: hopper.state_fwd.forward_states_and_output(c, w, u, *a, **kw))(
            w_u["w"], w_u["u"], A["k"], A["ekd"], A["dec"], A["h0"], A["fl"], *q_args)

    for rec in (False, True):
        got, ref = run(cw, rec), run(base, rec)
        assert set(got) == set(ref) and all(np.array_equal(np.asarray(got[n], np.float32),
                                                           np.asarray(ref[n], np.float32)) for n in ref), (rec, got.keys())
    text = cuda_lowering(KernelConfig(platform="gpu", gpu_kernels="mosaic", hopper=HopperTuning(
        fwd_form=form, state_producer=True, save_states=packed,
        variants=HopperVariants(state_warpgroups=nc, state_slots=D))))
    assert text.count("custom_call @mosaic_gpu") >= 4


def test_state_producer_checked():
    """Bad values name the option; slots / warpgroups without the producer are refused; two
    warpgroups whose value blocks do not tile V send the call to Triton with a reason; at K = 256
    (single q / W tiles) the producer does not apply; three slots of two warpgroups fit only at
    value block 16, which the default block finds."""
    with pytest.raises(ValueError, match="state_slots"):
        KernelConfig(hopper=HopperTuning(state_producer=True, variants=HopperVariants(state_slots=5)))
    with pytest.raises(TypeError, match="state_warpgroups"):
        KernelConfig(hopper=HopperTuning(state_producer=True, variants=HopperVariants(state_warpgroups=2.0)))
    with pytest.raises(ValueError, match="needs the state pass's producer"):
        KernelConfig(hopper=HopperTuning(state_producer=False, variants=HopperVariants(state_warpgroups=2)))
    with pytest.raises(TypeError, match="state_producer"):
        KernelConfig(hopper=HopperTuning(state_producer=1))
    gpu = KernelConfig(platform="gpu", gpu_kernels="mosaic", hopper=HopperTuning(state_producer=True))
    call = _call(platform="gpu", config=gpu)
    assert _on_hopper(call) and hopper.plan.producer(call)
    bad = _call(platform="gpu", V=64, V0=64, config=tuned(gpu, hopper=dict(variants=HopperVariants(state_warpgroups=2)),
                                                         triton=dict(bv_state=64)))
    assert not _on_hopper(bad) and "state_warpgroups=2" in _fwd_reason(bad)
    assert not hopper.plan.producer(_call(platform="gpu", K=256, V=256, K0=256, V0=256, config=gpu))
    interp = dataclasses.replace(MOSAIC, hopper=HopperTuning(state_producer=True))
    assert not hopper.plan.producer(_call(config=interp))  # interpret
    c = dataclasses.replace(call, state_wgs=2, state_slots=3, bv_mosaic=64)
    assert hopper.plan.block_for(c) == 16 and hopper.plan.smem_bytes(c, 32) > hopper.plan.SMEM_BYTES
    # two warpgroups at V = 64: the default block halves until two blocks tile V (gpu: 64 -> 32)
    two = _call(platform="gpu", BH=64, H=16, K=64, V=64, K0=64, V0=64,
                config=tuned(gpu, hopper=dict(variants=HopperVariants(state_warpgroups=2))))
    assert _on_hopper(two) and two.bv_mosaic == 32, (two.bv_mosaic, _fwd_reason(two))
    four = _call(platform="gpu", config=tuned(gpu, hopper=dict(variants=HopperVariants(state_slots=4))))
    assert not _on_hopper(four) and "fewer fit" in _fwd_reason(four)


@pytest.mark.parametrize("form", ["wu", "t"])
def test_state_two_warpgroups_lower_for_cuda(form):
    """``state_warpgroups=2`` (two compute warpgroups beside the producer, each its own value
    block, sharing the chunk's tiles) lowers for CUDA, forward and backward. Its values are checked
    in interpret mode by test_state_producer_kernel (with conftest's 4 CPU devices: with one, three
    interpreted warpgroups blocking on each other's barriers hang on 2 cores). On the H200 it is bit-equal to the one-warpgroup pass at
    1x16384x16x128 (results/hopper_h200/stages_producer_89efcf0.txt) and passes check_gpu 10 of 10
    (check_gpu_producer_89efcf0.txt)."""
    cfg = KernelConfig(platform="gpu", gpu_kernels="mosaic", hopper=HopperTuning(
        fwd_form=form, save_states=False, variants=HopperVariants(state_warpgroups=2)))
    text = cuda_lowering(cfg)
    assert text.count("custom_call @mosaic_gpu") >= 5


@pytest.mark.parametrize("save_states,group,packed", [(True, 1, False), (False, 2, True)])
def test_fwd_form_transition(save_states, group, packed):
    """``HopperTuning(fwd_form="transition")`` at K = V = 64 (gdn_jax.ops.pallas.hopper.transition):
    the state chain as S' = e^{gamma_C} S + K~^T U + M S with M = -K~^T W, the outputs one step late,
    three TMA slots. Strong gates with an initial state and ``save_states``, then grouped value heads
    with ``cu_seqlens`` (an empty and a length-1 sequence). It takes effect (o differs from "wu"'s),
    stays at the kernels' bf16 rounding of "wu" (rel_rms <= 4e-3) and o, S and every gradient are
    within the suite's tolerances of float64."""
    T, N = 200, (4 if packed else None)
    cu = jnp.asarray([0, 70, 70, 71, T], jnp.int32) if packed else None
    seed = seed_of("hopper-fwd-form-transition", save_states, group)
    x = make_inputs(seed, 1, T, 2, 64, 64, gates="strong", dtype=BF16, init=True, N=N)
    if group > 1:
        y = make_inputs(seed + 1, 1, T, 2 * group, 64, 64, gates="strong", dtype=BF16, init=True, N=N)
        x = dict(x, v=y["v"], g=y["g"], beta=y["beta"], S0=y["S0"], do=y["do"], dS=y["dS"])
    _form_against_wu(x, "transition", save_states, cu)


def test_fwd_form_transition_covers_and_lowers():
    """The transition pass refuses K = 128 (three slots of M = 32 KB each do not fit shared memory)
    and lowers for CUDA at K = 64 (value_and_grad: its state pass is one more Mosaic GPU kernel)."""
    from gdn_jax.ops.pallas import forward_kernels

    x = make_inputs(1, 1, 128, 2, 128, 128, dtype=BF16)
    kern, why = forward_kernels(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=64,
                                kernel_config=dataclasses.replace(MOSAIC, hopper=HopperTuning(fwd_form="transition")))[:2]
    assert "transition" in str(why), (kern, why)
    cfg = KernelConfig(platform="gpu", gpu_kernels="mosaic", hopper=HopperTuning(fwd_form="transition"))
    sds = [jax.ShapeDtypeStruct((1, 256, 2, 64), BF16)] * 3
    sds += [jax.ShapeDtypeStruct((1, 256, 2), F32), jax.ShapeDtypeStruct((1, 256, 2), BF16)]
    fn = lambda q, k, v, g, b: gated_delta_rule(q, k, v, g, b, backend="pallas", chunk_size=64, kernel_config=cfg)[0]
    text = jax.export.export(jax.jit(fn), platforms=["cuda"])(*sds).mlir_module()
    assert text.count("custom_call @mosaic_gpu") == 2


@pytest.mark.parametrize("H,form,want", [(64, None, "t"), (8, None, "wu"), (64, "wu", "wu")])
def test_fwd_form_default_at_k128(H, form, want):
    """``fwd_form`` None at K = 128 takes "t" with >= 128 state-pass CTAs (hopper.plan.t_form_default:
    H 64 x V / 64 = 128 here), "wu" with fewer; an explicit "wu" is kept."""
    from gdn_jax.ops.pallas import to_kernel_inputs
    from gdn_jax.ops.pallas.hopper.plan import T_FORM_MIN_CTAS, t_form_default

    x = jnp.zeros((1, 64, H, 128), jnp.bfloat16)
    gz = jnp.zeros((1, 64, H), jnp.float32)
    cfg = dataclasses.replace(MOSAIC, hopper=HopperTuning(fwd_form=form))
    cf = to_kernel_inputs(x, x, x, gz, gz, chunk_size=64, config=cfg).calls[0]
    assert _on_hopper(cf) and cf.fwd_form == want
    assert t_form_default(cf) == (cf.BH * (cf.V // cf.bv_mosaic) >= T_FORM_MIN_CTAS)
