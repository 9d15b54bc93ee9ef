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

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reference import reference, reference_grads, rel_rms, to_f64

from gdn_jax.ops import gated_delta_rule
from gdn_jax.ops import pallas as P
from gdn_jax.ops import _pallas_platform as plat
from gdn_jax.ops._common import GateForms

TOL_O = 5e-3
TOL_S = 5e-3
TOL_GRAD = 8e-3
TOL_GATE = 2e-2
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _seed(*key):
    return zlib.crc32(repr(key).encode())


def _logsigmoid(x):
    return -np.logaddexp(0.0, -x)


def make(seed, B, T, H, K, V, *, gates="strong", dtype=F32, init=False, N=None, normalize=True):
    """Random inputs as numpy float64 arrays already rounded to ``dtype`` (so that the
    reference sees exactly what the op sees), plus cotangents do (rounded) and dS."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    if normalize:
        q /= np.linalg.norm(q, axis=-1, keepdims=True)
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, H, V))
    if gates == "weak":
        g = -0.001 * rng.uniform(0.5, 1.5, (B, T, H))
    elif gates == "strong":
        g = 2.0 * _logsigmoid(rng.normal(-1.0, 1.0, (B, T, H)))  # ~ -5.4 .. -0.85
    elif gates == "extreme":
        g = _logsigmoid(rng.standard_normal((B, T, H))) / 0.01
    elif gates == "zero":
        g = np.zeros((B, T, H))
    else:
        raise ValueError(gates)
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H))))
    n = B if N is None else N
    S0 = 0.5 * rng.standard_normal((n, H, K, V)) if init else None
    do = rng.standard_normal((B, T, H, V))
    dS = rng.standard_normal((n, H, K, V))
    rnd = lambda a: np.asarray(jnp.asarray(a, dtype).astype(F32), np.float64)
    x = dict(q=rnd(q), k=rnd(k), v=rnd(v), g=rnd(g), beta=rnd(beta), S0=S0, do=rnd(do), dS=dS, dtype=dtype)
    return x


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
    """All of o, S, and the gradients present in got; collects every violation."""
    (o, S, gr), (ro, rS, rg) = got, want
    pairs = {"o": (o, ro, TOL_O), "S": (S, rS, TOL_S)}
    for n, val in gr.items():
        pairs["d" + n] = (val, rg[n], TOL_GATE if n in ("g", "beta") else TOL_GRAD)
    errs, bad = {}, []
    for name, (val, r, tol) in pairs.items():
        val = to_f64(val)
        if not np.all(np.isfinite(val)):
            bad.append(f"{name}: {np.sum(~np.isfinite(val))} non-finite")
            continue
        errs[name] = e = rel_rms(val, r)
        if not e <= tol * tol_scale:
            bad.append(f"{name}: {e:.2e} > {tol * tol_scale:g}")
    assert not bad, "; ".join(bad) + f"   all: { {k: f'{v:.1e}' for k, v in errs.items()} }"
    return errs


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
]


def _id(c):
    return f"{jnp.dtype(c[0]).name}-{c[1]}-B{c[2]}T{c[3]}H{c[4]}K{c[5]}V{c[6]}C{c[7]}{'-h0' if c[8] else ''}"


@pytest.mark.parametrize("case", FWD_CASES, ids=_id)
def test_forward(case):
    dt, gates, B, T, H, K, V, C, init = case
    x = make(_seed(case), B, T, H, K, V, gates=gates, dtype=dt, init=init)
    check(run(x, chunk_size=C, grads=False), ref(x, grads=False))


def test_single_token():
    x = make(1, 2, 1, 2, 32, 32, init=True)
    check(run(x, chunk_size=64, grads=False), ref(x, grads=False))


def test_l2norm_and_scale():
    x = make(2, 1, 37, 2, 32, 32, normalize=False, init=True)
    got = run(x, chunk_size=16, grads=False, use_qk_l2norm=True, scale=0.3)
    check(got, ref(x, grads=False, use_qk_l2norm=True, scale=0.3))


def test_zero_gate_is_ungated_delta_rule():
    """REFERENCE §7.2: g == 0 is DeltaNet; checked against a numpy delta rule without gates."""
    x = make(3, 1, 45, 2, 16, 32, gates="zero", init=True)
    o, S, _ = run(x, chunk_size=16, grads=False)
    q, k, v, beta = x["q"] * 16 ** -0.5, x["k"], x["v"], x["beta"]
    St = x["S0"][0].copy()  # [H,K,V]
    want = np.zeros_like(v)
    for t in range(q.shape[1]):
        pred = np.einsum("hkv,hk->hv", St, k[0, t])
        St = St + np.einsum("hk,hv->hkv", k[0, t], beta[0, t][:, None] * (v[0, t] - pred))
        want[0, t] = np.einsum("hkv,hk->hv", St, q[0, t])
    assert rel_rms(o, want) < 1e-5 and rel_rms(S[0], St) < 1e-5


# ---------------------------------------------------------------------------
# TPU variant (interpret) and real TPU / GPU lowering
# ---------------------------------------------------------------------------


def test_tpu_variant_interpret():
    """The TPU layout (head-major blocks, SMEM flags) under pltpu.InterpretParams():
    uninitialised memory is NaN-filled there, so anything read before written shows up."""
    x = make(4, 2, 40, 2, 32, 16, init=True)
    with plat.force_platform("tpu_interpret"):
        got = run(x, chunk_size=16)
    check(got, ref(x))


def test_tpu_variant_interpret_packed():
    cu = [0, 7, 7, 30, 45]
    x = make(5, 1, 45, 2, 16, 32, init=True, N=4)
    with plat.force_platform("tpu_interpret"):
        got = run(x, chunk_size=16, cu_seqlens=cu)
    check(got, ref(x, cu_seqlens=cu))


def _export(target, packed, K, V, C, dtype=BF16):
    """Lower forward and gradient for `target` ("tpu" / "cuda") with the kernels built for it."""
    B, T, H = 1, 200, 2
    cu = jnp.asarray([0, 50, 120, 200], jnp.int32) if packed else None
    n0 = 3 if packed else B
    sds = [jax.ShapeDtypeStruct(s, d) for s, d in (
        ((B, T, H, K), dtype), ((B, T, H, K), dtype), ((B, T, H, V), dtype), ((B, T, H), F32), ((B, T, H), dtype),
        ((n0, H, K, V), F32))]

    def fwd(q, k, v, g, b, s):
        return gated_delta_rule(q, k, v, g, b, initial_state=s, output_final_state=True, backend="pallas",
                                chunk_size=C, cu_seqlens=cu)

    def loss(*a):
        o, S = fwd(*a)
        return jnp.sum(o.astype(F32)) + jnp.sum(S)

    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5))
    dis = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")] if target == "cuda" else []
    want = "tpu_custom_call" if target == "tpu" else "__gpu$xla.gpu.triton"
    with plat.force_platform("tpu" if target == "tpu" else "gpu"):
        for f in (fwd, grad):
            exp = jax.export.export(jax.jit(f), platforms=[target], disabled_checks=dis)(*sds)
            assert want in exp.mlir_module()


@pytest.mark.parametrize("packed,K,V,C", [(False, 64, 128, 64), (True, 16, 256, 16), (False, 256, 32, 128)])
def test_tpu_lowering_export(packed, K, V, C):
    """Mosaic TPU lowering (block-shape (8,128) rule, SMEM scalars, transposed dots) of fwd and grad."""
    _export("tpu", packed, K, V, C)


@pytest.mark.parametrize("packed,K,V,C", [(False, 128, 128, 64), (True, 16, 256, 32)])
def test_gpu_triton_lowering_export(packed, K, V, C):
    """Pallas -> Triton IR lowering of fwd and grad (the Triton compiler itself runs only on a GPU)."""
    _export("cuda", packed, K, V, C)
