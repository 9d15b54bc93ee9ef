"""Tests of ``backend="pallas"`` (Pallas kernels) on CPU, in interpret mode, SMALL shapes.

Compared with the independent float64 reference of ``tests/reference.py``
(forward and all gradients); low-precision inputs are compared with the
reference run on the same rounded inputs. Also: the TPU variant of the kernels
under ``pltpu.InterpretParams()``, and real TPU (Mosaic) and GPU (Triton) lowering
of forward and gradient through ``jax.export`` (interpret mode accepts blocks the
real lowerings reject).

Tolerances (rel_rms = rms(x - ref) / rms(ref)): 5e-3 for o and the final state,
8e-3 for dq, dk, dv, d initial_state, 2e-2 for dg, dbeta.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BF16, F16, F32, GRAD_NAMES, TOL_GATE, TOL_GRAD, TOL_O, TOL_S, check_close, make_inputs, seed_of
from reference import reference, reference_grads, rel_rms

from gdn_jax.ops import HopperTuning, KernelConfig, Precision, TritonTuning, gated_delta_rule
from gdn_jax.ops import pallas as P
from gdn_jax.ops._common import GateForms
from gdn_jax.ops.pallas import config as PC

NAMES = GRAD_NAMES


def _seed(*key):
    return seed_of(*key)


def make(seed, B, T, H, K, V, *, gates="strong", dtype=F32, init=False, N=None, normalize=True):
    """Random inputs (``conftest.make_inputs``: q, k, v, g, beta rounded to ``dtype``, so that the
    reference sees exactly what the op sees; cotangents do (rounded) and dS)."""
    return make_inputs(seed, B, T, H, K, V, gates=gates, dtype=dtype, init=init, N=N, normalize_qk=normalize)


def _jx(x):
    dt = x["dtype"]
    arrs = [jnp.asarray(x[n], dt) for n in ("q", "k", "v", "g", "beta")]
    S0 = None if x["S0"] is None else jnp.asarray(x["S0"], F32)
    return arrs, S0


def run(x, *, chunk_size, cu_seqlens=None, grads=True, **kw):
    """(o, S, grads dict) of backend='pallas' through the public op, jitted."""
    (q, k, v, g, beta), S0 = _jx(x)
    cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens, jnp.int32)
    fn = functools.partial(gated_delta_rule, output_final_state=True, backend="pallas", chunk_size=chunk_size, **kw)
    if not grads:
        o, S = jax.jit(lambda q, k, v, g, b, s, cu: fn(q, k, v, g, b, initial_state=s, cu_seqlens=cu))(
            q, k, v, g, beta, S0, cu)
        return o, S, {}
    do = jnp.asarray(x["do"], F32)
    dS = jnp.asarray(x["dS"], F32)
    has0 = S0 is not None

    def loss(q, k, v, g, b, s, cu):
        o, S = fn(q, k, v, g, b, initial_state=s, cu_seqlens=cu)
        return jnp.sum(o.astype(F32) * do) + jnp.sum(S * dS), (o, S)

    argnums = (0, 1, 2, 3, 4, 5) if has0 else (0, 1, 2, 3, 4)
    gr, (o, S) = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(q, k, v, g, beta, S0, cu)
    return o, S, dict(zip(NAMES, gr))


def ref(x, *, cu_seqlens=None, grads=True, **kw):
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    o, S = reference(*args, initial_state=x["S0"], cu_seqlens=cu_seqlens, **kw)
    if not grads:
        return o, S, {}
    gr = reference_grads(*args, initial_state=x["S0"], cu_seqlens=cu_seqlens, do=x["do"], dS=x["dS"], **kw)
    return o, S, gr


def check(got, want, *, tol_scale=1.0):
    """All of o, S, and the gradients present in got (conftest tolerances times ``tol_scale``)."""
    (o, S, gr), (ro, rS, rg) = got, want
    pairs = {"o": (o, ro, TOL_O), "S": (S, rS, TOL_S)}
    for n, val in gr.items():
        pairs["d" + n] = (val, rg[n], TOL_GATE if n in ("g", "beta") else TOL_GRAD)
    return check_close(pairs, scale=tol_scale)


# ---------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------

# (dtype, gates, B, T, H, K, V, C, init): K, V in {16..256} pairwise, odd T, all chunk sizes.
FWD_CASES = [
    (F32, "strong", 2, 75, 2, 16, 32, 16, True),
    (F32, "weak", 1, 75, 2, 32, 16, 32, False),
    (BF16, "strong", 1, 75, 2, 64, 64, 64, True),
    (BF16, "weak", 1, 100, 2, 128, 32, 32, False),
    (F32, "strong", 1, 40, 1, 256, 16, 16, True),
    (F32, "weak", 1, 33, 1, 16, 256, 16, True),
    (F16, "strong", 1, 50, 2, 32, 128, 16, False),
    (F32, "weak", 1, 150, 1, 32, 32, 128, True),
    (F32, "strong", 1, 64, 2, 48, 80, 32, True),  # multiples of 16 that are not powers of 2
    (BF16, "strong", 1, 40, 1, 256, 64, 32, True),  # K > 128: gradient kernel split over K blocks
]


def _id(c):
    return f"{jnp.dtype(c[0]).name}-{c[1]}-B{c[2]}T{c[3]}H{c[4]}K{c[5]}V{c[6]}C{c[7]}{'-h0' if c[8] else ''}"


@pytest.mark.parametrize("case", FWD_CASES, ids=_id)
def test_forward_and_grads(case):
    """o, final state and the gradients w.r.t. q, k, v, g, beta (and initial_state)."""
    dt, gates, B, T, H, K, V, C, init = case
    x = make(_seed(case), B, T, H, K, V, gates=gates, dtype=dt, init=init)
    check(run(x, chunk_size=C), ref(x))


def test_single_token():
    x = make(1, 2, 1, 2, 32, 32, init=True)
    check(run(x, chunk_size=64), ref(x))


def test_l2norm_and_scale():
    x = make(2, 1, 37, 2, 32, 32, normalize=False, init=True)
    got = run(x, chunk_size=16, grads=False, use_qk_l2norm=True, scale=0.3)
    check(got, ref(x, grads=False, use_qk_l2norm=True, scale=0.3))


# ---------------------------------------------------------------------------
# TPU variant (interpret) and real TPU / GPU lowering
# ---------------------------------------------------------------------------


def test_tpu_variant_interpret():
    """The TPU layout (head-major blocks, SMEM flags) under pltpu.InterpretParams():
    uninitialised memory is NaN-filled there, so anything read before written shows up."""
    x = make(4, 2, 40, 2, 32, 16, init=True)
    got = run(x, chunk_size=16, kernel_config=KernelConfig(platform="tpu_interpret"))
    check(got, ref(x))


def test_tpu_variant_interpret_packed():
    cu = [0, 7, 7, 30, 45]
    x = make(5, 1, 45, 2, 16, 32, init=True, N=4)
    got = run(x, chunk_size=16, cu_seqlens=cu, kernel_config=KernelConfig(platform="tpu_interpret"))
    check(got, ref(x, cu_seqlens=cu))


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_tpu_variant_interpret_streamed(fuse):
    """The streamed TPU state passes (grid bh x value block x chunk, the state carried in VMEM
    scratch) over several chunks and two value blocks per head: T = 70 is not a multiple of the
    chunk (5 chunks of 16), the scratch restarts per (bh, value block), the reverse pass walks the
    chunks backwards; fused and unfused forward, initial state, float64 reference."""
    x = make(_seed("tpu-stream", fuse), 2, 70, 2, 32, 32, init=True)
    cfg = KernelConfig(platform="tpu_interpret", triton=TritonTuning(bv_state=16, fuse_output=fuse))
    check(run(x, chunk_size=16, kernel_config=cfg), ref(x))


def test_tpu_variant_interpret_streamed_packed_bf16():
    """Packed sequences on the streamed TPU passes (per-chunk SMEM flags: a sequence starts, ends
    or spans chunks; an empty one keeps its initial state), two value blocks, bf16 inputs."""
    cu = [0, 5, 5, 40, 41, 77]
    x = make(_seed("tpu-stream-packed"), 1, 77, 2, 32, 32, init=True, N=5, dtype=BF16)
    cfg = KernelConfig(platform="tpu_interpret", triton=TritonTuning(bv_state=16))
    check(run(x, chunk_size=16, cu_seqlens=cu, kernel_config=cfg), ref(x, cu_seqlens=cu))


def _export(target, packed, K, V, C, dtype=BF16, group=1, **tune):
    """Lower forward and gradient for `target` ("tpu" / "cuda") with the kernels built for it
    (``group`` value heads per key head; ``tune``: fields of ``TritonTuning``)."""
    B, T, H = 1, 200, 2
    cu = jnp.asarray([0, 50, 120, 200], jnp.int32) if packed else None
    n0 = 3 if packed else B
    sds = [jax.ShapeDtypeStruct(s, d) for s, d in (
        ((B, T, H, K), dtype), ((B, T, H, K), dtype), ((B, T, H * group, V), dtype), ((B, T, H * group), F32),
        ((B, T, H * group), dtype), ((n0, H * group, K, V), F32))]

    config = KernelConfig(platform="tpu" if target == "tpu" else "gpu", triton=TritonTuning(**tune))

    def fwd(q, k, v, g, b, s):
        return gated_delta_rule(q, k, v, g, b, initial_state=s, output_final_state=True, backend="pallas",
                                chunk_size=C, cu_seqlens=cu, kernel_config=config)

    def loss(*a):
        o, S = fwd(*a)
        return jnp.sum(o.astype(F32)) + jnp.sum(S)

    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5))
    dis = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")] if target == "cuda" else []
    want = "tpu_custom_call" if target == "tpu" else "__gpu$xla.gpu.triton"
    for f in (fwd, grad):
        exp = jax.export.export(jax.jit(f), platforms=[target], disabled_checks=dis)(*sds)
        assert want in exp.mlir_module()


@pytest.mark.parametrize("packed,K,V,C,fuse,group", [(False, 64, 128, 64, True, 1), (True, 16, 256, 16, False, 1),
                                                      (False, 256, 32, 128, True, 1), (False, 128, 128, 64, True, 2)])
def test_tpu_lowering_export(packed, K, V, C, fuse, group):
    """Mosaic TPU lowering (block-shape (8,128) rule, SMEM scalars, transposed dots) of fwd and grad,
    grouped value heads included (the key-head index maps)."""
    _export("tpu", packed, K, V, C, fuse_output=fuse, group=group)


@pytest.mark.parametrize("packed,K,V,C,fuse,group", [(False, 128, 128, 64, True, 1), (True, 16, 256, 32, False, 1),
                                                      (False, 64, 64, 64, True, 2)])
def test_gpu_triton_lowering_export(packed, K, V, C, fuse, group):
    """Pallas -> Triton IR lowering of fwd and grad (the Triton compiler itself runs only on a GPU)."""
    _export("cuda", packed, K, V, C, fuse_output=fuse, merge_state=not fuse, save_t=fuse, group=group)


# ---------------------------------------------------------------------------
# gradients
# ---------------------------------------------------------------------------


def test_packed_sequences():
    """With cu_seqlens the state restarts at every boundary; packing equals
    separate runs (forward, final states and all gradients, initial states included;
    one empty sequence passes its initial state through)."""
    cu = [0, 20, 20, 53, 61]
    x = make(6, 1, 61, 2, 32, 16, init=True, N=4)
    got = run(x, chunk_size=16, cu_seqlens=cu)
    check(got, ref(x, cu_seqlens=cu))
    o, S, gr = got
    for n in range(4):
        s, e = cu[n], cu[n + 1]
        if s == e:
            np.testing.assert_allclose(S[n], np.float32(x["S0"][n]), rtol=0, atol=0)
            continue
        xs = {key: (val[:, s:e] if key in ("q", "k", "v", "g", "beta", "do") else val) for key, val in x.items()}
        xs["S0"], xs["dS"] = x["S0"][n:n + 1], x["dS"][n:n + 1]
        on, Sn, gn = run(xs, chunk_size=16)
        assert rel_rms(o[:, s:e], on) < 1e-5 and rel_rms(S[n:n + 1], Sn) < 1e-5
        for name in ("q", "k", "v", "g", "beta"):
            assert rel_rms(gr[name][:, s:e], gn[name]) < 1e-4, name
        assert rel_rms(gr["initial_state"][n:n + 1], gn["initial_state"]) < 1e-4


def test_packed_merged_state_passes():
    """cu_seqlens with both backward state passes in one launch (TritonTuning.merge_state)."""
    cu = [0, 30, 30, 41]
    x = make(11, 1, 41, 2, 16, 32, init=True, N=3)
    got = run(x, chunk_size=16, cu_seqlens=cu, kernel_config=KernelConfig(triton=TritonTuning(merge_state=True, bv_state=16)))
    check(got, ref(x, cu_seqlens=cu))


@pytest.mark.parametrize("packed,chunk,fwd_chunk", [(False, 16, 32), (True, 16, 64), (True, 32, 16)],
                         ids=["fwd32-bwd16", "packed-fwd64-bwd16", "packed-fwd16-bwd32"])
def test_forward_chunk_differs_from_backward(packed, chunk, fwd_chunk):
    """The forward kernels at their own chunk (``KernelConfig(fwd_chunk=...)``; on GPU the forward runs
    at C=64 and the backward at C=32): forward, final state and all gradients vs the reference,
    with cu_seqlens too (sequences that end inside a forward chunk, one empty sequence)."""
    cu = [0, 21, 21, 70, 83] if packed else None
    x = make(_seed("fwdchunk", packed, chunk, fwd_chunk), 1 if packed else 2, 83, 2, 32, 16, init=True,
             N=4 if packed else None)
    config = KernelConfig(fwd_chunk=fwd_chunk)
    (q, k, v, g, b), _ = _jx(x)
    prep = P.to_kernel_inputs(q, k, v, g, b, chunk_size=chunk, cu_seqlens=None if cu is None else jnp.asarray(cu),
                              config=config)
    assert (prep.calls[0].C, prep.calls[1].C) == (fwd_chunk, chunk)
    got = run(x, chunk_size=chunk, cu_seqlens=cu, kernel_config=config)
    check(got, ref(x, cu_seqlens=cu))


@pytest.mark.parametrize("mid", ["auto", "f32"])
def test_bf16_near_beta_two_without_decay(mid):
    """The hardest bf16 case found: g = 0 and beta = 1.9 (eigenvalue -0.9 along k, no decay, so
    rounding in the state is not forgotten). Default bf16 intermediates / state dots: within the
    documented bf16 bound of 1e-2 for o and S and 1.2e-2 for gradients (measured at B4: o 6.4e-3,
    S 7.2e-3, dk 8.3e-3; the chunk backend 1.7e-3 / 6e-7 / 2.1e-3). ``Precision(mid_dtype="f32")``
    meets the float32 tolerances of every other test."""
    x = make(_seed("beta19", mid), 2, 200, 2, 64, 64, gates="zero", dtype=BF16, init=True)
    x["beta"] = np.full_like(x["beta"], float(jnp.asarray(1.9, BF16)))
    got = run(x, chunk_size=16, kernel_config=KernelConfig(precision=Precision(mid_dtype=mid)))
    errs = check(got, ref(x), tol_scale=1.0 if mid == "f32" else 2.0)
    if mid == "auto":
        assert max(errs["o"], errs["S"]) <= 1e-2 and max(errs[k] for k in ("dq", "dk", "dv")) <= 1.2e-2, errs


def test_bf16_d256_strong_gates_small_dg():
    """K = V = 256, bf16, strong gates, an initial state, T 200 at chunk 64 (benchmarks/check_gpu.py's
    "d256" case). On a typical draw every output and gradient meets the suite's bf16 tolerances. The
    check's own draw is the one where dg itself is smallest (RMS 1.2e-2 against 0.03-0.25 on ten
    others): its relative dg error is 2.4e-2 in interpret mode (docs/kernels.md, Precision), an absolute RMS
    error of ~3e-4; held here to 3e-2 relative and 5e-4 absolute, the other gradients to the suite's."""
    x = make(_seed("d256-edge", 4), 1, 200, 2, 256, 256, gates="strong", dtype=BF16, init=True)
    check(run(x, chunk_size=64), ref(x))
    x = make_inputs(seed_of("check_gpu", "d256"), 1, 200, 2, 256, 256, gates="strong", dtype=BF16, init=True)
    o, S, gr = run(x, chunk_size=64)
    ro, rS, rg = ref(x)
    dg, rdg = np.asarray(gr["g"], np.float64), rg["g"]
    assert rel_rms(dg, rdg) <= 3e-2 and np.sqrt(np.mean((dg - rdg) ** 2)) <= 5e-4, rel_rms(dg, rdg)
    check((o, S, {n: v for n, v in gr.items() if n != "g"}), (ro, rS, rg))


def test_initial_state_gradient():
    """d initial_state exists, is not detached, and matches the reference
    and a central finite difference along a random direction."""
    x = make(7, 1, 37, 2, 16, 16, gates="weak", init=True)
    _, _, gr = run(x, chunk_size=16)
    dh0 = np.asarray(gr["initial_state"], np.float64)
    assert np.abs(dh0).max() > 1e-3
    assert rel_rms(dh0, reference_grads(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["S0"], do=x["do"],
                                        dS=x["dS"])["initial_state"]) < TOL_GRAD
    (q, k, v, g, b), _ = _jx(x)
    do, dS = jnp.asarray(x["do"], F32), jnp.asarray(x["dS"], F32)
    f = jax.jit(lambda s: (lambda o, S: jnp.sum(o * do) + jnp.sum(S * dS))(
        *gated_delta_rule(q, k, v, g, b, initial_state=s, output_final_state=True, backend="pallas", chunk_size=16)))
    d = np.random.default_rng(0).standard_normal(x["S0"].shape)
    eps = 1e-2
    fd = (float(f(jnp.asarray(x["S0"] + eps * d, F32))) - float(f(jnp.asarray(x["S0"] - eps * d, F32)))) / (2 * eps)
    assert abs(fd - np.sum(dh0 * d)) < 2e-3 * abs(fd) + 1e-3


@pytest.mark.parametrize("variant", [
    dict(triton=TritonTuning(bv_state=16, bv_out=16, bv_grad=16, fuse_output=False, save_t=False)),
    dict(precision=Precision(u_dtype="f32", state_dot="f32", out_dot="f32"), triton=TritonTuning(merge_state=True)),
    dict(triton=TritonTuning(bk_grad=16, bv_grad=32, save_t=True)),
    dict(triton=TritonTuning(bk_grad=32, save_t=False, num_stages=3)),
], ids=["small-blocks-unfused", "f32-U-and-state-dots-merged", "grad-k-blocks", "grad-k-blocks-no-t"])
def test_kernel_config_variants(variant):
    """Kernel settings the benchmark may pick (blocking; all-bf16 intermediates) stay within tolerance."""
    x = make(8, 1, 75, 2, 64, 64, dtype=BF16, init=True)
    got = run(x, chunk_size=32, kernel_config=KernelConfig(**variant))
    check(got, ref(x))


@pytest.mark.parametrize("variant,dtype", [(dict(), F32), (dict(bk_grad=32, save_t=False), F32), (dict(), BF16)],
                         ids=["whole-k-f32", "k-blocks-f32", "whole-k-bf16-keeps-chain"])
def test_grad_t_phase_direct_triton(variant, dtype):
    """``HopperTuning(grad_t_phase="direct")`` (the default) against ``"chain"`` in the Triton
    gradient kernels (interpret mode; ``variant``: fields of ``TritonTuning``):
    dA = -strict((T^T dVn) Vn^T) accumulated over the value blocks (whole-K kernel, float32
    intermediates) or -strict(T^T (dVn Vn^T)) (K-split kernel), exact since (I + A)^T T^T = I. It
    takes effect (dk, dbeta or dg differ from the chain's; float32 inputs, since the forms'
    ~1e-10 differences vanish in bf16 outputs), o, S, dq, dv do not change, and every output is
    within the suite's tolerances of float64 (strong gates, an initial state, two value blocks, T
    not a multiple of the chunk). With bf16 intermediates the whole-K kernel keeps the chain (the
    direct form would read the bf16-stored Vn): the same outputs bit for bit."""
    x = make(seed_of("triton-grad-t-phase", str(variant), str(dtype)), 1, 75, 2, 64, 64, dtype=dtype, init=True,
             gates="strong")
    base = KernelConfig(triton=TritonTuning(bv_grad=32, **variant), hopper=HopperTuning(grad_t_phase="chain"))
    a = run(x, chunk_size=32, kernel_config=base)
    direct = KernelConfig(triton=TritonTuning(bv_grad=32, **variant), hopper=HopperTuning(grad_t_phase="direct"))
    b = run(x, chunk_size=32, kernel_config=direct)
    assert np.array_equal(np.asarray(a[0]), np.asarray(b[0])) and np.array_equal(np.asarray(a[2]["v"]),
                                                                                    np.asarray(b[2]["v"]))
    changed = [not np.array_equal(np.asarray(a[2][n]), np.asarray(b[2][n])) for n in ("k", "beta", "g")]
    assert any(changed) if dtype == F32 else not any(changed), changed
    check(b, ref(x))


def _core_math(cfg, q, k, v, beta, gc, gr, eg, ekd, dec, h0):
    """Pure-JAX mirror of the forward kernels, ``pallas.vjp.forward`` (head-major layout, one sequence per row, f32,
    forward substitution instead of the kernels' recursive block inverse). Returns (o, fin) and the
    intermediates (W, U, Vn, h)."""
    BH, n, C, K, V = cfg.BH, cfg.n, cfg.C, cfg.K, cfg.V
    hi = jax.lax.Precision.HIGHEST
    mm = lambda a, b: jnp.matmul(a, b, precision=hi)
    ch = lambda x: x.reshape(BH, n, C, x.shape[-1])
    qc, kc, vc, bc = ch(q) * cfg.scale, ch(k), ch(v), ch(beta)
    gcol, grow = ch(gc), gr  # [BH,n,C,1], [BH,n,1,C]
    i, j = np.arange(C)[:, None], np.arange(C)[None, :]
    gam = lambda m: jnp.where(m, jnp.exp(jnp.where(m, gcol - grow, 0.0)), 0.0)
    kb = kc * bc
    A = mm(kb, jnp.swapaxes(kc, -1, -2)) * gam(i > j)
    # (I + A)^-1 by row-by-row forward substitution (no LAPACK: XLA:CPU's batched
    # triangular solve was seen to deadlock on 2-core machines)
    Tinv = jnp.zeros_like(A)
    for r in range(C):
        Tinv = Tinv.at[..., r, :].set(jnp.eye(C)[r] - jnp.einsum("...j,...jk->...k", A[..., r, :], Tinv, precision=hi))
    W, U = mm(Tinv, kb * ch(eg)), mm(Tinv, vc * bc)
    Aqk = mm(qc, jnp.swapaxes(kc, -1, -2)) * gam(i >= j)
    qg, kd = qc * ch(eg), kc * ch(ekd)

    def step(S, xs):
        W, U, qg, Aqk, kd, dec = xs
        vn = U - mm(W, S)
        o = mm(qg, S) + mm(Aqk, vn)
        return dec * S + mm(jnp.swapaxes(kd, -1, -2), vn), (o, vn, S)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (W, U, qg, Aqk, kd, dec))
    fin, (o, vn, h) = jax.lax.scan(step, h0[:, 0], xs)
    back = lambda a: jnp.moveaxis(a, 0, 1).reshape(BH, n * C, a.shape[-1])
    return (back(o), fin[:, None]), (W.reshape(BH, n * C, K), U.reshape(BH, n * C, V), back(vn), jnp.moveaxis(h, 0, 1))


@pytest.mark.parametrize("K,bk", [(16, None), (64, 16), (32, 16)], ids=["whole-K", "4-K-blocks", "2-K-blocks"])
def test_kernel_pieces_vs_vjp(K, bk):
    """Each kernel against the pure-JAX chunk math, and every cotangent of the backward kernels
    (q, k, v, beta, gamma as column and as row, e^gamma, e^{gamma_C-gamma}, e^{gamma_C},
    h0) against jax.vjp of that math -- before the plain-JAX chain rule mixes them. Also
    with the gradient kernel split over K blocks (``bk_grad``)."""
    from gdn_jax.ops.pallas import vjp as PV
    from gdn_jax.ops.pallas.state_fwd import forward_states, output
    from gdn_jax.ops.pallas.wy import wy_repr

    BH, n, C, V = 2, 3, 16, 64 if K == 64 else 32
    config = KernelConfig(platform="interpret", triton=TritonTuning(bv_state=16, bv_grad=16, bk_grad=bk))
    call = PC.resolve(config, platform="interpret", C=C, n=n, BH=BH, H=2, K=K, V=V, K0=K, V0=V, scale=0.3,
                      in_dt=F32, packed=False, nseq=1)
    cfg = dataclasses.replace(call, layout="hm")  # head-major token arrays on the interpret path
    assert cfg.grad_nk == K // (bk or K)
    rng = np.random.default_rng(9)
    Tp = n * C
    f = lambda *s: jnp.asarray(rng.standard_normal(s), F32)
    q, v = f(BH, Tp, K), f(BH, Tp, V)
    k = f(BH, Tp, K)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (BH, Tp, 1)), F32)
    gam = jnp.cumsum(jnp.asarray(-rng.uniform(0.05, 1.0, (BH, n, C)), F32), -1)
    gc, gr = gam.reshape(BH, Tp, 1), gam.reshape(BH, n, 1, C)
    eg, ekd = jnp.exp(gc), jnp.exp(gam[..., -1:] - gam).reshape(BH, Tp, 1)
    dec = jnp.exp(gam[..., -1]).reshape(BH, n, 1, 1)
    h0 = f(BH, 1, K, V)
    args = (q, k, v, beta, gc, gr, eg, ekd, dec, h0)

    (o_r, fin_r), (W_r, U_r, vn_r, h_r) = _core_math(cfg, *args)
    wy = wy_repr(cfg, k, v, beta, gc, gr, eg)
    W, U = wy["w"], wy["u"]
    st = forward_states(cfg, W, U, k, ekd, dec, h0, None)
    vn, h, fin = st["vn"], st["h"], st["final"]
    o = output(cfg, q, k, gc, gr, eg, h, vn)["o"]
    for name, a, b in (("W", W, W_r), ("U", U, U_r), ("Vn", vn, vn_r), ("h", h, h_r), ("fin", fin, fin_r), ("o", o, o_r)):
        assert rel_rms(a, b) < 1e-5, name

    do, dfin = f(BH, Tp, V), f(BH, 1, K, V)
    info = jnp.zeros((1,), jnp.int32)
    _, vjp_r = jax.vjp(lambda *a: _core_math(cfg, *a)[0], *args)
    names = ("q", "k", "v", "beta", "gamma_col", "gamma_row", "exp_gamma", "exp_gammaC_minus_gamma", "exp_gammaC", "h0")
    got = dict(zip(names, PV.backward(cfg, args + (info,), (do, dfin))))
    want = dict(zip(names, vjp_r((do, dfin))))
    # gamma enters as a column and as a row (two views of one array): only their sum is
    # defined (the kernel drops the gamma-independent diagonal of Gamma from both).
    for d in (got, want):
        d["gamma"] = d.pop("gamma_col") + d.pop("gamma_row").reshape(BH, Tp, 1)
    for name in got:
        assert rel_rms(got[name], want[name]) < 1e-5, (name, rel_rms(got[name], want[name]))


def test_supports_and_unsupported_options_raise():
    ok = GateForms(False, False)
    assert P.supports(ok, chunk_size=64, K=128, V=128, dtype=BF16) is None
    assert P.supports(ok, chunk_size=16, K=48, V=256, dtype=F32) is None
    assert "per-value-channel beta" in P.supports(GateForms(False, True), chunk_size=64, K=64, V=64, dtype=F32)
    assert "per-key-channel g" in P.supports(GateForms(True, False), chunk_size=64, K=64, V=64, dtype=F32)
    assert "chunk_size=48" in P.supports(ok, chunk_size=48, K=64, V=64, dtype=F32)
    assert "K=8" in P.supports(ok, chunk_size=64, K=8, V=64, dtype=F32)
    assert "V=512" in P.supports(ok, chunk_size=64, K=64, V=512, dtype=F32)
    assert "float64" in P.supports(ok, chunk_size=64, K=64, V=64, dtype=jnp.float64)
    x = make(10, 1, 8, 1, 16, 16)
    (q, k, v, g, b), _ = _jx(x)
    with pytest.raises(NotImplementedError, match="per-value-channel beta"):
        gated_delta_rule(q, k, v, g, jnp.ones(v.shape), backend="pallas")
    with pytest.raises(NotImplementedError, match="per-key-channel g"):
        gated_delta_rule(q, k, v, jnp.zeros(q.shape), b, backend="pallas")
    with pytest.raises(NotImplementedError, match="chunk_size=24"):
        gated_delta_rule(q, k, v, g, b, backend="pallas", chunk_size=24)


def test_gpu_kernel_chunk_policy():
    """The GPU kernels cap the chunk (measured on an H200; the result is chunk-independent)."""
    kc = lambda p, c, d, direction="bwd", dt=BF16, **kw: PC.kernel_chunk(KernelConfig(**kw), p, direction, c, d, dt)
    assert kc("gpu", 64, 128) == 32
    assert kc("gpu", 64, 256) == 32
    assert kc("gpu", 16, 64) == 16
    assert kc("interpret", 64, 256) == 64
    assert kc("tpu", 128, 128) == 128
    # the forward kernels have their own cap (no C x C gradient tiles to spill), for 16-bit inputs
    assert kc("gpu", 64, 128, "fwd") == 64
    assert kc("gpu", 64, 256, "fwd") == 32
    assert kc("gpu", 16, 128, "fwd") == 16
    assert kc("interpret", 64, 256, "fwd") == 64
    assert kc("gpu", 64, 128, "fwd", dt=F32) == 32
    # explicit chunks win
    assert kc("gpu", 64, 128, "fwd", fwd_chunk=16) == 16 and kc("gpu", 64, 128, bwd_chunk=64) == 64
    # as to_kernel_inputs applies it
    for dt, want in ((BF16, (64, 32)), (F16, (64, 32)), (F32, (32, 32))):
        x = jnp.zeros((1, 70, 2, 128), dt)
        prep = P.to_kernel_inputs(x, x, x, jnp.zeros((1, 70, 2)), jnp.ones((1, 70, 2)), chunk_size=64,
                                  config=KernelConfig(platform="gpu"))
        assert (prep.calls[0].C, prep.calls[1].C) == want, dt


@pytest.mark.parametrize("kw,err", [(dict(fwd_chunk=0), ValueError), (dict(fwd_chunk=48), ValueError),
                                    (dict(fwd_chunk="64"), TypeError), (dict(triton=dict(warps_out=3)), ValueError),
                                    (dict(precision=dict(mid_dtype="f16")), ValueError),
                                    (dict(triton=dict(merge_state="yes")), TypeError),
                                    (dict(triton=dict(warps_grad=0)), ValueError),
                                    (dict(precision=dict(state_dot="bf16")), ValueError),
                                    (dict(platform="cuda"), ValueError), (dict(bwd_chunk=24), ValueError)])
def test_bad_kernel_config_rejected_when_made(kw, err):
    """Bad kernel settings fail when the KernelConfig, or its group (``triton`` / ``precision``: a dict
    of the group's fields here), is made, naming the field."""
    (name, val), = kw.items()
    group = {"triton": TritonTuning, "precision": Precision}.get(name)
    with pytest.raises(err, match=rf"\.{next(iter(val)) if group else name} must"):
        KernelConfig(**{name: group(**val)}) if group else KernelConfig(**kw)


def test_kernel_config_argument_checked():
    x = make(12, 1, 8, 1, 16, 64)
    (q, k, v, g, b), _ = _jx(x)
    with pytest.raises(ValueError, match="kernel_config"):
        gated_delta_rule(q, k, v, g, b, backend="chunk", kernel_config=KernelConfig())
    with pytest.raises(TypeError, match="kernel_config must be a gdn_jax.ops.KernelConfig"):
        gated_delta_rule(q, k, v, g, b, backend="pallas", kernel_config=dict(bv_state=16))
    with pytest.raises(ValueError, match="bv_state=48 must divide the head dim 64"):
        gated_delta_rule(q, k, v, g, b, backend="pallas", kernel_config=KernelConfig(triton=TritonTuning(bv_state=48)))


def test_two_configs_two_compilations():
    """A KernelConfig is a static argument: under one jit, two configs give two compilations
    (no stale trace, unlike a global setting jit cannot see) and each computes the right numbers."""
    x = make(13, 1, 45, 2, 32, 32, init=True)
    (q, k, v, g, b), S0 = _jx(x)
    traces = []

    def f(q, k, v, g, b, s, kernel_config):
        traces.append(kernel_config)
        return gated_delta_rule(q, k, v, g, b, initial_state=s, output_final_state=True, backend="pallas",
                                chunk_size=32, kernel_config=kernel_config)

    jf = jax.jit(f, static_argnames="kernel_config")
    c1 = KernelConfig(triton=TritonTuning(fuse_output=False, bv_out=16))
    c2 = KernelConfig(fwd_chunk=16, triton=TritonTuning(bv_state=16))
    want = ref(x, grads=False)
    for c in (c1, c2, c1, KernelConfig(triton=TritonTuning(fuse_output=False, bv_out=16))):
        o, S = jf(q, k, v, g, b, S0, kernel_config=c)
        check((o, S, {}), want)
    assert traces == [c1, c2]  # equal configs hit the cache, different ones compile anew
    assert jf._cache_size() == 2
    calls = {c: P.to_kernel_inputs(q, k, v, g, b, chunk_size=32, config=c).calls for c in (c1, c2)}
    assert calls[c1][0].C == 32 and not calls[c1][0].fuse_output and calls[c2][0].C == 16


def test_merge_state_policy():
    """Both backward state passes share one launch on GPU only when they would have <= 128
    programs (fewer than an H200's 132 SMs); explicit settings win; never on TPU."""
    def mk(p, BH, V, K=128, **t):
        return PC.resolve(KernelConfig(triton=TritonTuning(**t)), platform=p, C=32, n=8, BH=BH, H=16, K=K, V=V, K0=K, V0=V, scale=1.0,
                          in_dt=BF16, packed=False, nseq=1)

    assert mk("gpu", 16, 128).merge_state  # B1 H16 D128: bv 16 -> 128 programs
    assert not mk("gpu", 64, 128).merge_state  # B4 H16: 256 programs
    assert not mk("interpret", 16, 128).merge_state
    assert mk("interpret", 16, 128, merge_state=True).merge_state
    assert not mk("gpu", 16, 128, merge_state=False).merge_state
    assert not mk("tpu", 16, 128, merge_state=True).merge_state
    # D = 256 with bf16 state dots: value blocks of 32 (B2 H8 on an H200: 128 programs, merged)
    c256 = mk("gpu", 16, 256, K=256)
    assert c256.bv_state == 32 and c256.merge_state and c256.grad_nk == 2 and not c256.save_t


def test_auto_backend_policy():
    """``auto``: pallas on GPU/TPU for the 16-bit calls it covers; float32 on GPU at head dims 32 to
    128 (1-pass TF32 kernels, measured faster than chunk in an H200 training step), chunk for smaller
    and wider (256: measured slower) float32 heads and for float32 on TPU."""
    from gdn_jax.ops import resolve_backend
    from gdn_jax.ops.gated_delta_rule import AUTO_F32_MAX_DIM, AUTO_F32_MIN_DIM

    ok = GateForms(False, False)
    kw = dict(chunk_size=64, K=64, V=64)
    for plat in ("gpu", "tpu"):
        assert resolve_backend("auto", ok, dtype=BF16, platform=plat, **kw) == "pallas"
        assert resolve_backend("auto", ok, dtype=jnp.float16, platform=plat, **kw) == "pallas"
        assert resolve_backend("auto", ok, dtype=F32, platform=plat, **kw) == ("pallas" if plat == "gpu" else "chunk")
        assert resolve_backend("auto", GateForms(True, False), dtype=BF16, platform=plat, **kw) == "chunk"
        assert resolve_backend("auto", GateForms(False, True), dtype=BF16, platform=plat, **kw) == "scan"
    small = dict(chunk_size=64, K=AUTO_F32_MIN_DIM // 2, V=AUTO_F32_MIN_DIM // 2)
    assert resolve_backend("auto", ok, dtype=F32, platform="gpu", **small) == "chunk"
    assert resolve_backend("auto", ok, dtype=F32, platform="gpu", chunk_size=64, K=32, V=128) == "pallas"
    wide = dict(chunk_size=64, K=2 * AUTO_F32_MAX_DIM, V=2 * AUTO_F32_MAX_DIM)
    assert resolve_backend("auto", ok, dtype=F32, platform="gpu", **wide) == "chunk"
    assert resolve_backend("auto", ok, dtype=BF16, platform="gpu", **wide) == "pallas"  # 16-bit: still pallas
    assert resolve_backend("auto", ok, dtype=F32, platform="cpu", **kw) == "chunk"
    assert resolve_backend("auto", ok, dtype=BF16, platform="cpu", **kw) == "chunk"
    assert resolve_backend("pallas", ok, dtype=F32, platform="gpu", **kw) == "pallas"  # explicit: still runs


def test_forward_and_backward_kernels_validate_like_the_op():
    """forward_kernels / backward_kernels check their arguments as gated_delta_rule does."""
    q, v = jnp.zeros((1, 16, 2, 32)), jnp.zeros((1, 16, 2, 32))
    g, b = jnp.zeros((1, 16, 2)), jnp.ones((1, 16, 2))
    cfg = KernelConfig(platform="interpret")
    for fn in (P.forward_kernels, P.backward_kernels):
        assert fn(q, q, v, g, b, kernel_config=cfg)[0] == "interpret"
        with pytest.raises(ValueError, match=r"k must have the shape of q .* got shape \(1, 8, 2, 32\)"):
            fn(q, q[:, :8], v, g, b, kernel_config=cfg)
        with pytest.raises(ValueError, match=r"g \(log-space decay\) must have shape \[B, T, H\] = \(1, 16, 2\)"):
            fn(q, q, v, g[..., :1], b, kernel_config=cfg)
        with pytest.raises(ValueError, match=r"beta must have shape \[B, T, H\] = \(1, 16, 2\)"):
            fn(q, q, v, g, b[:, :5], kernel_config=cfg)
        with pytest.raises(ValueError, match=r"v must have shape \[B, T, Hv, V\]"):
            fn(q, q, v[..., 0], g, b, kernel_config=cfg)
        with pytest.raises(TypeError, match="kernel_config must be a gdn_jax.ops.KernelConfig"):
            fn(q, q, v, g, b, kernel_config=dict(bv_state=16))
        with pytest.raises(NotImplementedError, match="chunk_size=24"):
            fn(q, q, v, g, b, chunk_size=24, kernel_config=cfg)


def test_block_messages_name_the_value_given():
    """A bv_* block names the user's value and V: the Hopper block is not clipped to V (the reason
    names it), and a block that does not divide the padded V says how V was padded."""
    x = jnp.zeros((1, 64, 2, 64), BF16)
    g, b = jnp.zeros((1, 64, 2)), jnp.ones((1, 64, 2))
    for fn in (P.forward_kernels, P.backward_kernels):
        cfg = KernelConfig(platform="interpret", gpu_kernels="mosaic", triton=TritonTuning(bv_state=256))
        assert fn(x, x, x, g, b, kernel_config=cfg)[:2] == ("interpret", "value block 256 with V=64 "
                                                         "(needs 16, 32 or 64 dividing V)")
    v48 = jnp.zeros((1, 64, 2, 48), BF16)
    with pytest.raises(ValueError, match=r"bv_grad=24 must divide the head dim 64 \(V=48 zero-padded"):
        P.forward_kernels(x, x, v48, g, b, kernel_config=KernelConfig(platform="interpret", triton=TritonTuning(bv_grad=24)))
