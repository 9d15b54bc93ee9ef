"""Numerical robustness of every backend against the float64 reference (``tests/reference.py``):
strong-gate gradients, gates below float32's range and ``-inf``, float64 with ``-inf`` gates,
non-finite inputs that must not reach back in time, pallas bf16 at every head dim, a huge
``A_log`` / very negative ``dt_bias`` in the layers, and layer / LM arguments checked at
construction.

Tolerances (rel_rms = rms(x - ref) / rms(ref)): o and the final state 5e-3, every gradient 8e-3
(dg and dbeta included), for float32 and 16-bit inputs alike, unless a test states otherwise.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import GRAD_NAMES, TOL_GRAD, TOL_O, make_inputs, seed_of
from reference import reference, reference_grads, rel_rms

from gdn_jax.ops import gated_delta_rule, gated_linear_attention

NAMES = GRAD_NAMES
DT = {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16, "f64": jnp.float64}


def _seed(*parts):
    return seed_of(*parts)


def make(seed, *, B=2, T=75, H=2, K=32, gate=0.02, g_pc=False, dtype="f32", cu=None, h0=False):
    """``conftest.make_inputs`` with V = K and FLA's gate grid: normalised q, k; v ~ N(0, 1);
    beta = sigmoid(N(0, 1)); g = logsigmoid(U(0, 1)) / gate (gate 0.02 gives per-token gates of
    -16 .. -35) or, for a tuple ``("const", c)``, c + U(-1, 1). g stays float32 (as FLA's grid;
    float64 for float64 inputs), the rest in ``dtype``. Returns (x, do, dS, cu)."""
    if cu is not None:
        B = 1
    dt = DT[dtype]
    x = make_inputs(seed, B, T, H, K, K, gates=gate if isinstance(gate, tuple) else ("fla", gate), g_per_key=g_pc,
                    init=h0, dtype=dt, g_dtype=jnp.float64 if dtype == "f64" else jnp.float32,
                    N=B if cu is None else len(cu) - 1, state_scale=1.0)
    args = dict(q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta, initial_state=x.S0)
    return args, x.do, x.dS, cu


@functools.lru_cache(maxsize=None)
def _jitted_grads(backend, chunk_size, cu):
    """jit(grad) of L = sum(o do) + sum(S dS) for one (backend, chunk, packing), shared by the
    cases that call it (jit keys on shapes and dtypes)."""
    cu_a = None if cu is None else jnp.asarray(cu, jnp.int32)

    def loss(q, k, v, g, beta, S0, do, dS):
        acc = S0.dtype  # float64 for float64 inputs, else float32
        o, S = gated_delta_rule(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu_a, output_final_state=True,
                                chunk_size=chunk_size, backend=backend)
        return jnp.sum(o.astype(acc) * do.astype(acc)) + jnp.sum(S * dS.astype(acc)), (o, S)

    return jax.jit(jax.grad(loss, argnums=tuple(range(6)), has_aux=True))


def run(x, do, dS, cu, backend, chunk_size):
    """(o, S, grads) of L = sum(o do) + sum(S dS); grads w.r.t. q, k, v, g, beta, initial_state
    (against zeros when there is none)."""
    S0 = x["initial_state"]
    acc = jnp.float64 if x["q"].dtype == jnp.float64 else jnp.float32
    S0 = jnp.zeros(dS.shape, acc) if S0 is None else jnp.asarray(S0, acc)
    f = _jitted_grads(backend, chunk_size, None if cu is None else tuple(int(c) for c in cu))
    grads, (o, S) = f(x["q"], x["k"], x["v"], x["g"], x["beta"], S0, do, dS)
    return o, S, dict(zip(NAMES, grads))


def refs(x, do, dS, cu):
    args = [np.asarray(x[n]) for n in NAMES[:5]]
    S0 = None if x["initial_state"] is None else np.asarray(x["initial_state"])
    o, S = reference(*args, initial_state=S0, cu_seqlens=cu)
    gr = reference_grads(*args, initial_state=S0, cu_seqlens=cu, do=np.asarray(do), dS=np.asarray(dS))
    return o, S, gr


F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32, 1.2e-38


def check(o, S, grads, ro, rS, rg, *, tol_o=TOL_O, tol_grad=TOL_GRAD, absolute=()):
    """Every output relative to the reference. Names in ``absolute``, and every gradient whose
    reference RMS is below float32's smallest normal (no float32 result can be relatively
    accurate there, see test_gates_below_float32_range), are held instead by their absolute RMS
    error against the RMS of the reference's dq, dk and dv."""
    scale = np.sqrt(np.mean([np.mean(np.asarray(rg[n]) ** 2) for n in ("q", "k", "v")]))
    errs, bad = {}, []
    for name, val, ref, tol in [("o", o, ro, tol_o), ("S", S, rS, tol_o)] + [
            ("d" + n, grads[n], rg[n], tol_grad) for n in NAMES]:
        val = np.asarray(val, np.float64)
        if not np.all(np.isfinite(val)):
            bad.append(f"{name} has {int(np.sum(~np.isfinite(val)))} non-finite values")
            continue
        if name in absolute or (name.startswith("d") and np.sqrt(np.mean(ref ** 2)) < F32_TINY):
            e = float(np.sqrt(np.mean((val - ref) ** 2)) / scale)
        else:
            e = rel_rms(val, ref)
        errs[name] = e
        if not e <= tol:
            bad.append(f"{name}: {e:.2e} > {tol:g}")
    assert not bad, f"{bad}  all: { {k: f'{v:.1e}' for k, v in errs.items()} }"


# ---------------------------------------------------------------------------
# 1. strong-gate gradient grid (FLA-style): every backend, forward and every gradient
# ---------------------------------------------------------------------------

# (dtype, g per key channel, chunk size, T, gate, packed cu_seqlens, initial state). Pairwise over
# the options; the first row is FLA's failing row (gates -16 .. -35), gate 0.005 spans -63 .. -139
# (dg still dominated by gates whose exp is a float32 normal), ("const", -80) is the reported
# initial-state-gradient case.
GRID = [
    ("f32", False, 64, 75, 0.02, None, False),
    ("f32", False, 16, 75, 0.01, None, True),
    ("f32", True, 32, 75, 0.02, None, False),
    ("f16", False, 128, 75, 0.005, None, False),
    ("bf16", True, 64, 75, 0.01, None, True),
    ("f32", False, 32, 150, 0.005, (0, 10, 10, 75, 150), True),
    ("f16", True, 16, 150, 0.02, (0, 1, 40, 150), False),
    ("bf16", False, 64, 75, 0.05, None, False),
    ("f32", False, 64, 75, ("const", -80.0), None, True),
    ("f32", True, 128, 75, ("const", -40.0), None, True),
]


def _grid_id(c):
    dt, pc, C, T, gate, cu, h0 = c
    return f"{dt}-{'chan' if pc else 'head'}-C{C}-T{T}-g{gate if not isinstance(gate, tuple) else gate[1]}" \
           f"{'-packed' if cu else ''}{'-h0' if h0 else ''}"


@pytest.mark.parametrize("case", GRID, ids=[_grid_id(c) for c in GRID])
@pytest.mark.parametrize("backend", ["scan", "chunk", "pallas"])
def test_strong_gate_grid(backend, case):
    dt, g_pc, C, T, gate, cu, h0 = case
    if backend == "pallas" and g_pc:
        pytest.skip("pallas does not take per-key-channel g (declined with NotImplementedError)")
    x, do, dS, cu = make(_seed(case), T=T, gate=gate, g_pc=g_pc, dtype=dt, cu=cu, h0=h0)
    check(*run(x, do, dS, cu, backend, C), *refs(x, do, dS, cu))


@pytest.mark.parametrize("backend", ["scan", "chunk", "pallas"])
@pytest.mark.parametrize("g_pc", [False, True])
def test_gates_below_float32_range(backend, g_pc):
    """Per-token gates from -100 to -1e4 and -inf: exp(g) and the true dg and d initial_state
    (~ exp(g) * O(1) < 4e-44) are below float32's smallest normal (1.2e-38), so no float32 code
    can give them relative accuracy -- the scan, which floors nothing, returns 0 there too. They
    are checked by their absolute error against the scale of dq, dk, dv; everything else
    relative to the float64 reference."""
    if backend == "pallas" and g_pc:
        pytest.skip("pallas does not take per-key-channel g")
    x, do, dS, cu = make(_seed("below", backend, g_pc), gate=0.01, g_pc=g_pc, h0=True)
    rng = np.random.default_rng(1)
    g = -np.exp(rng.uniform(np.log(100.0), np.log(1e4), x["g"].shape))
    g[rng.uniform(size=g.shape) < 0.2] = -np.inf
    x["g"] = jnp.asarray(g, jnp.float32)
    res = run(x, do, dS, cu, backend, 32)
    ro, rS, rg = refs(x, do, dS, cu)
    assert np.sqrt(np.mean(rg["g"] ** 2)) < 1.2e-38  # the premise: the true dg underflows float32
    check(*res, ro, rS, rg, absolute=("dg", "dinitial_state"))


# ---------------------------------------------------------------------------
# 2. -inf gates, float64 included
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend,dtype", [("scan", "f64"), ("chunk", "f64"), ("scan", "f32"), ("chunk", "f32"),
                                           ("pallas", "f32"), ("pallas", "bf16")])
@pytest.mark.parametrize("g_pc", [False, True])
def test_minus_inf_gates(backend, dtype, g_pc):
    """The reported case (q, k, v [1, 4, 1, 4], g = [0, -inf, 0, 0], beta = 0.5) and a longer one
    with -inf gates mid-chunk: o, final state and every gradient finite and equal to the float64
    reference (float64: to 1e-10)."""
    if backend == "pallas" and g_pc:
        pytest.skip("pallas does not take per-key-channel g")
    with jax.enable_x64(dtype == "f64"):
        k0 = 16 if backend == "pallas" else 4  # pallas takes head dims from 16
        for T, K, C, pos in [(4, k0, 64, [1]), (75, 16, 16, [3, 20, 21, 64])]:
            x, do, dS, cu = make(_seed("inf", backend, dtype, T), T=T, K=K, gate=1.0, g_pc=g_pc, dtype=dtype,
                                 h0=True, B=1, H=1)
            g = np.asarray(x["g"]).copy()
            g[:, pos] = -np.inf
            x["g"] = jnp.asarray(g)
            if T == 4:
                x["beta"] = jnp.full_like(x["beta"], 0.5)
            tol = (1e-10, 1e-10) if dtype == "f64" else (TOL_O, TOL_GRAD)
            check(*run(x, do, dS, cu, backend, C), *refs(x, do, dS, cu), tol_o=tol[0], tol_grad=tol[1])


# ---------------------------------------------------------------------------
# 3. gated_linear_attention (mamba2 / gla decays) under strong gates
# ---------------------------------------------------------------------------


def _la_ref_grads(q, k, v, g, S0, do, dS, cu):
    from test_linear_attention import ref as la_ref

    with jax.enable_x64(True):
        f64 = lambda a: jnp.asarray(np.asarray(a, np.float64))

        def L(q, k, v, g, S0):
            o, S = la_ref(q, k, v, g, S0, cu=cu)
            return jnp.sum(o * f64(do)) + jnp.sum(S * f64(dS)), (o, S)

        grads, (o, S) = jax.grad(L, argnums=range(5), has_aux=True)(*map(f64, (q, k, v, g, S0)))
        return np.asarray(o), np.asarray(S), [np.asarray(a) for a in grads]


@pytest.mark.parametrize("backend", ["scan", "chunk"])
@pytest.mark.parametrize("g_pc,gate,C,dtype,packed", [(False, 0.02, 64, "f32", False), (True, 0.02, 32, "f32", True),
                                                      (False, 0.005, 16, "bf16", True), (True, 0.01, 16, "f16", False),
                                                      (True, ("const", -80.0), 64, "f32", False)])
def test_linear_attention_strong_gates(backend, g_pc, gate, C, dtype, packed):
    cu = (0, 30, 30, 75) if packed else None
    x, do, dS, cu = make(_seed("la", g_pc, gate, C), gate=gate, g_pc=g_pc, dtype=dtype, cu=cu, h0=True, K=16)
    q, k, v, g, S0 = x["q"], x["k"], x["v"], x["g"], x["initial_state"]
    cu_a = None if cu is None else jnp.asarray(cu, jnp.int32)

    def L(q, k, v, g, S0):
        o, S = gated_linear_attention(q, k, v, g, initial_state=S0, output_final_state=True, cu_seqlens=cu_a,
                                      chunk_size=C, backend=backend)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(S * dS), (o, S)

    grads, (o, S) = jax.jit(jax.grad(L, argnums=range(5), has_aux=True))(q, k, v, g, S0)
    ro, rS, rg = _la_ref_grads(q, k, v, g, S0, do, dS, cu)
    for name, val, ref, tol in [("o", o, ro, TOL_O), ("S", S, rS, TOL_O)] + [
            ("d" + n, a, r, TOL_GRAD) for n, a, r in zip("qkvgS", grads, rg)]:
        assert np.all(np.isfinite(np.asarray(val, np.float64))), name
        assert rel_rms(val, ref) <= tol, (name, rel_rms(val, ref))


# ---------------------------------------------------------------------------
# 4. non-finite inputs: with mask_nonfinite=True a bad token at t poisons t and the future, never
#    the past; by default (no masking, no cost) the documented contract holds
# ---------------------------------------------------------------------------


def _nan_case(seed, T=64, packed=False):
    x, _, _, _ = make(seed, B=1, T=T, H=2, K=16, gate=1.0)
    return {n: x[n] for n in NAMES[:5]}


@functools.lru_cache(maxsize=None)
def _masked_fns(backend):
    """jitted (o, S) and the gradients of sum(o[:, :40]^2) and of sum(o^2), mask_nonfinite=True:
    compiled once per backend and shared by every (name, bad value) case (the shapes are the same)."""
    f = lambda *a: gated_delta_rule(*a, use_qk_l2norm=True, chunk_size=32, output_final_state=True,
                                    backend=backend, mask_nonfinite=True)
    loss = lambda t_end: lambda *a: jnp.sum(f(*a)[0][:, :t_end].astype(jnp.float32) ** 2)
    return jax.jit(f), jax.jit(jax.grad(loss(40), argnums=range(5))), jax.jit(jax.grad(loss(64), argnums=range(5)))


@pytest.mark.parametrize("backend", ["scan", "chunk", "pallas"])
@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_input_does_not_reach_back(backend, name, bad):
    """A NaN / inf at t = 50 (T = 64, chunk 32: the token shares its chunk with t = 32..63).
    Outputs before t equal those of the clean input; a loss that reads only o[:, :40] has finite
    gradients equal to the clean ones; outputs from t on (q: o_t only) and the final state are
    NaN; a loss that reads a poisoned output has NaN gradients. (-inf is a valid g, see above.)"""
    x = _nan_case(_seed("nan", name))
    bad_x = dict(x)
    bad_x[name] = x[name].at[0, 50].set(bad)
    f, grad40, grad64 = _masked_fns(backend)
    args, bad_args = [x[n] for n in NAMES[:5]], [bad_x[n] for n in NAMES[:5]]
    o0, _ = f(*args)
    o, S = f(*bad_args)
    np.testing.assert_allclose(np.asarray(o[:, :50], np.float32), np.asarray(o0[:, :50], np.float32), atol=1e-6)
    if name == "q":
        assert np.all(np.isnan(np.asarray(o[:, 50], np.float32)))
        assert np.all(np.isfinite(np.asarray(o[:, 51:], np.float32))) and np.all(np.isfinite(np.asarray(S)))
    else:
        assert np.all(np.isnan(np.asarray(o[:, 50:], np.float32))) and np.all(np.isnan(np.asarray(S)))

    g_clean = grad40(*args)
    g_bad = grad40(*bad_args)
    for a, b in zip(g_bad, g_clean):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-5)
    g_all = grad64(*bad_args)
    assert all(np.mean(np.isnan(np.asarray(a, np.float32))) > 0.9 for a in g_all)


@pytest.mark.parametrize("backend", ["scan", "chunk", "pallas"])
def test_nonfinite_input_stays_in_its_packed_sequence(backend):
    """With cu_seqlens, a NaN in sequence 0 leaves sequence 1 (which starts inside the same chunk)
    and its final state exactly as without it."""
    x = _nan_case(_seed("nanpacked"), T=64)
    cu = jnp.asarray([0, 20, 64], jnp.int32)
    bad = dict(x)
    bad["k"] = x["k"].at[0, 10, 1].set(jnp.nan)
    f = lambda d: gated_delta_rule(*(d[n] for n in NAMES[:5]), cu_seqlens=cu, chunk_size=32,
                                   output_final_state=True, backend=backend, mask_nonfinite=True)
    (o0, S0), (o, S) = f(x), f(bad)
    np.testing.assert_allclose(np.asarray(o[:, 20:]), np.asarray(o0[:, 20:]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(o[:, :10]), np.asarray(o0[:, :10]), atol=1e-6)
    assert np.all(np.isnan(np.asarray(o[:, 10:20, 1]))) and np.all(np.isfinite(np.asarray(o[:, 10:20, 0])))
    np.testing.assert_allclose(np.asarray(S[1]), np.asarray(S0[1]), atol=1e-6)
    assert np.all(np.isnan(np.asarray(S[0, 1]))) and np.all(np.isfinite(np.asarray(S[0, 0])))


@pytest.mark.parametrize("backend", ["scan", "chunk"])
def test_linear_attention_nonfinite_input_does_not_reach_back(backend):
    x = _nan_case(_seed("la-nan"))
    f = lambda k: gated_linear_attention(x["q"], k, x["v"], x["g"], chunk_size=32, backend=backend,
                                         mask_nonfinite=True)[0]
    o0, o = f(x["k"]), f(x["k"].at[0, 50].set(jnp.nan))
    np.testing.assert_allclose(np.asarray(o[:, :50]), np.asarray(o0[:, :50]), atol=1e-6)
    assert np.all(np.isnan(np.asarray(o[:, 50:])))
    g = jax.grad(lambda k: jnp.sum(f(k)[:, :40] ** 2))(x["k"].at[0, 50].set(jnp.nan))
    g0 = jax.grad(lambda k: jnp.sum(f(k)[:, :40] ** 2))(x["k"])
    np.testing.assert_allclose(np.asarray(g), np.asarray(g0), atol=1e-5)


@functools.lru_cache(maxsize=None)
def _unmasked_fns(backend):
    """jitted (o, S) and the gradients w.r.t. q, k, v of sum(o[:, :40]^2), mask_nonfinite=False
    (the default): compiled once per backend, shared by the cases."""
    f = lambda *a: gated_delta_rule(*a, chunk_size=32, output_final_state=True, backend=backend)
    return jax.jit(f), jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)[0][:, :40].astype(jnp.float32) ** 2),
                                        argnums=(0, 1, 2)))


@pytest.mark.parametrize("backend", ["scan", "chunk", "pallas"])
@pytest.mark.parametrize("name", ["k", "v", "g", "beta"])
def test_nonfinite_input_default_contract(backend, name):
    """mask_nonfinite=False (the default): a NaN at t = 50 (chunk 32, T = 96) leaves the outputs of
    the earlier chunk (scan: of every earlier token) and of the other head unchanged, makes the
    final state of its head NaN, and puts NaNs into the gradients of its sequence and head even for
    a loss that reads only o[:, :40] (the chunked backends: at the earlier tokens too) -- loud, not
    silently wrong."""
    x = _nan_case(_seed("contract", name), T=96)
    bad = dict(x)
    bad[name] = x[name].at[0, 50, 1].set(jnp.nan)
    f, grad40 = _unmasked_fns(backend)
    args, bad_args = [x[n] for n in NAMES[:5]], [bad[n] for n in NAMES[:5]]
    (o0, _), (o, S) = f(*args), f(*bad_args)
    first = 50 if backend == "scan" else 32
    np.testing.assert_allclose(np.asarray(o[:, :first], np.float32), np.asarray(o0[:, :first], np.float32), atol=1e-6)
    np.testing.assert_allclose(np.asarray(o[:, :, 0], np.float32), np.asarray(o0[:, :, 0], np.float32), atol=1e-6)
    assert np.all(np.isnan(np.asarray(o[:, 50:, 1], np.float32))) and np.all(np.isnan(np.asarray(S[:, 1])))
    grads = grad40(*bad_args)
    if backend != "scan":  # the chunked backends: NaN gradients at earlier tokens (loud)
        assert all(np.any(np.isnan(np.asarray(gr[:, :40, 1], np.float32))) for gr in grads)


# ---------------------------------------------------------------------------
# 5. pallas with bf16 inputs: one stated bound per regime at every head dim
# ---------------------------------------------------------------------------

# bf16 inputs (float32 g). beta in (0, 1), any gates: o, S <= 5e-3, grads <= 8e-3 (the float32
# gates). beta = 1.9 without decay (eigenvalue -0.9, nothing damps the rounding): o, S <= 1e-2,
# grads <= 1.2e-2. Head dims below 64 run float32 intermediates (pallas.BF16_MID_MIN_DIM).
@pytest.mark.parametrize("K", [16, 32, 64, 128])
@pytest.mark.parametrize("regime", ["no_decay", "no_decay_beta_1.9", "strong"])
def test_pallas_bf16_bound_every_head_dim(K, regime):
    T = 75 if K >= 128 else 130
    x, do, dS, cu = make(_seed("bf16", K, regime), T=T, K=K, gate=0.05, dtype="bf16")
    if regime.startswith("no_decay"):
        x["g"] = jnp.zeros_like(x["g"])
    if regime == "no_decay_beta_1.9":
        x["beta"] = jnp.full_like(x["beta"], 1.9)
    tol = (1e-2, 1.2e-2) if regime == "no_decay_beta_1.9" else (TOL_O, TOL_GRAD)
    check(*run(x, do, dS, cu, "pallas", 64), *refs(x, do, dS, cu), tol_o=tol[0], tol_grad=tol[1])


def test_pallas_auto_mid_dtype_by_head_dim():
    from gdn_jax.ops import pallas

    assert pallas.auto_mid_dtype(jnp.bfloat16, 16, 16) == jnp.float32
    assert pallas.auto_mid_dtype(jnp.bfloat16, 32, 32) == jnp.float32
    assert pallas.auto_mid_dtype(jnp.bfloat16, 64, 64) == jnp.bfloat16
    assert pallas.auto_mid_dtype(jnp.bfloat16, 32, 128) == jnp.bfloat16
    assert pallas.auto_mid_dtype(jnp.float16, 128, 128) == jnp.float32


# ---------------------------------------------------------------------------
# 6. the layers' decay under a huge A_log / very negative dt_bias
# ---------------------------------------------------------------------------


def test_mamba2_log_decay_matches_formula_and_stays_finite():
    from gdn_jax.layers.gated_deltanet import MAX_DECAY_RATE, mamba2_log_decay

    rng = np.random.default_rng(0)
    A_log = rng.uniform(-2, 3, (4,))
    z = rng.normal(0, 3, (8, 4))
    with jax.enable_x64(True):
        want = -np.exp(A_log) * np.logaddexp(0.0, z)
    np.testing.assert_allclose(np.asarray(mamba2_log_decay(A_log, z)), want, rtol=2e-6)
    # gradients match the plain formula's in the normal range
    f_new = lambda a, z: jnp.sum(mamba2_log_decay(a, z) ** 2)
    f_old = lambda a, z: jnp.sum((-jnp.exp(a) * jax.nn.softplus(z)) ** 2)
    for gn, go in zip(jax.grad(f_new, (0, 1))(jnp.asarray(A_log, jnp.float32), jnp.asarray(z, jnp.float32)),
                      jax.grad(f_old, (0, 1))(jnp.asarray(A_log, jnp.float32), jnp.asarray(z, jnp.float32))):
        np.testing.assert_allclose(np.asarray(gn), np.asarray(go), rtol=1e-4, atol=1e-6)
    # extremes: finite values and gradients; -g capped at MAX_DECAY_RATE; softplus underflow -> g = 0-
    for a, zz in [(89.0, 0.0), (200.0, 5.0), (0.0, -200.0), (100.0, -200.0), (-np.inf, 1.0)]:
        a, zz = jnp.float32(a), jnp.float32(zz)
        g = mamba2_log_decay(a, zz)
        ga, gz = jax.grad(lambda a, z: mamba2_log_decay(a, z), (0, 1))(a, zz)
        assert np.isfinite(g) and -MAX_DECAY_RATE * (1 + 1e-6) <= g <= 0 and np.isfinite(ga) and np.isfinite(gz), (a, zz, g, ga, gz)
    np.testing.assert_allclose(mamba2_log_decay(jnp.float32(89.0), jnp.float32(0.0)), -MAX_DECAY_RATE, rtol=1e-6)
    # -g = exp(100 - 200) = 3.7e-44: below float32's normal range, i.e. no decay
    assert -1e-38 <= float(mamba2_log_decay(jnp.float32(100.0), jnp.float32(-200.0))) <= 0.0


@pytest.mark.parametrize("A_log,dt_bias", [(89.0, None), (120.0, None), (0.5, -200.0), (100.0, -200.0)])
@pytest.mark.parametrize("mixer", ["gdn", "gdn_channel", "mamba2"])
def test_layer_huge_A_log_finite_forward_and_grads(mixer, A_log, dt_bias):
    from gdn_jax.layers import GatedDeltaNet
    from gdn_jax.layers.linear_attention import GatedLinearAttention

    if mixer == "mamba2":
        m = GatedLinearAttention(32, 2, decay="mamba2", rngs=nnx.Rngs(0))
    else:
        m = GatedDeltaNet(32, 2, decay_per_channel=mixer == "gdn_channel", rngs=nnx.Rngs(0))
    m.A_log[...] = jnp.full_like(m.A_log[...], A_log)
    if dt_bias is not None:
        m.dt_bias[...] = jnp.full_like(m.dt_bias[...], dt_bias)
    x = jax.random.normal(jax.random.key(0), (2, 40, 32))
    loss, grads = nnx.value_and_grad(lambda m, x: jnp.sum(m(x) ** 2))(m, x)
    assert np.isfinite(loss)
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
    assert leaves and all(np.all(np.isfinite(np.asarray(a))) for a in leaves)


# ---------------------------------------------------------------------------
# 7. layer and LM arguments checked at construction / call
# ---------------------------------------------------------------------------


def _mixers():
    from gdn_jax.layers import Attention, GatedDeltaNet
    from gdn_jax.layers.linear_attention import GatedLinearAttention

    return {"gdn": GatedDeltaNet, "la": GatedLinearAttention, "attention": Attention}


@pytest.mark.parametrize("mixer,kw,exc,match", [
    ("gdn", dict(backend="foo"), ValueError, "backend"),
    ("gdn", dict(chunk_size=0), ValueError, "chunk_size"),
    ("gdn", dict(chunk_size=16.0), TypeError, "chunk_size"),
    ("gdn", dict(conv_size=0), ValueError, "conv_size"),
    ("gdn", dict(norm_eps=0.0), ValueError, "norm_eps"),
    ("gdn", dict(decay="exp"), ValueError, "decay"),
    ("gdn", dict(head_dim=0), ValueError, "head_dim"),
    ("gdn", dict(dtype="float99"), ValueError, "dtype"),
    ("la", dict(param_dtype="int32"), ValueError, "param_dtype"),
    ("attention", dict(dtype="int8"), ValueError, "dtype"),
    ("la", dict(backend="pallas"), ValueError, "backend"),
    ("la", dict(chunk_size=-4), ValueError, "chunk_size"),
    ("la", dict(gate_low_rank=0), ValueError, "gate_low_rank"),
    ("attention", dict(rope_fraction=1.5), ValueError, "rope_fraction"),
    ("attention", dict(head_dim=0), ValueError, "head_dim"),
])
def test_layer_arguments_checked_at_construction(mixer, kw, exc, match):
    with pytest.raises(exc, match=match):
        _mixers()[mixer](32, 2, rngs=nnx.Rngs(0), **kw)


@pytest.mark.parametrize("mixer", ["gdn", "la", "attention"])
def test_layer_call_checks(mixer):
    m = _mixers()[mixer](32, 2, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        m(jnp.ones((1, 5, 32), jnp.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens must have shape \[N \+ 1\]"):
        m(jnp.ones((1, 5, 32)), cu_seqlens=jnp.asarray([[0, 5]]))
    with pytest.raises(ValueError, match="B = 1"):
        m(jnp.ones((2, 5, 32)), cu_seqlens=jnp.asarray([0, 5]))
    with pytest.raises(TypeError, match="cu_seqlens must be an integer"):
        m(jnp.ones((1, 5, 32)), cu_seqlens=jnp.asarray([0.0, 5.0]))


@pytest.mark.parametrize("kw,exc,match", [
    (dict(backend="foo"), ValueError, "backend"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(num_layers=0), ValueError, "num_layers"),
    (dict(d_model=64.0), TypeError, "d_model"),
    (dict(dtype="int8"), ValueError, "dtype"),
    (dict(decay="x"), ValueError, "decay"),
    (dict(mlp_ratio=-1), ValueError, "mlp_ratio"),
    (dict(mixer=("gdn",), num_layers=2), ValueError, "mixer"),
])
def test_lm_config_checked_at_construction(kw, exc, match):
    from gdn_jax.models.lm import LMConfig

    with pytest.raises(exc, match=match):
        LMConfig(**kw)


def test_lm_checks_mixer_names_and_cu_seqlens():
    from gdn_jax.models.lm import LM, LMConfig

    with pytest.raises(ValueError, match="unknown mixer"):
        LM(LMConfig(mixer="nope"), rngs=nnx.Rngs(0))
    lm = LM(LMConfig(vocab_size=16, d_model=16, num_heads=2), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"cu_seqlens must have shape \[N \+ 1\]"):
        lm(jnp.zeros((1, 6), jnp.int32), cu_seqlens=jnp.asarray([[0, 6]]))
