"""Operator tests for ``gdn_jax.ops.gated_delta_rule`` against the independent
float64 reference in ``tests/reference.py``.

Small CPU shapes only. Every backend in ``BACKENDS`` (pallas in interpret mode) is checked
against the reference (forward + all gradients), non-scan backends also against "scan"; a call a
backend does not cover (pallas: per-key-channel g, per-value-channel beta, head dims that are not
multiples of 16, float64) must raise ``NotImplementedError`` naming the option. To add a backend
append it to ``BACKENDS`` (and to ``VALUE_BETA_BACKENDS`` if it takes per-value-channel beta).
Tolerances and the input maker live in ``tests/conftest.py``.
"""

from __future__ import annotations

import functools
import math
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (BF16, F16, F32, GRAD_NAMES, TOL_GATE, TOL_GRAD, TOL_O, TOL_S, Inputs, check_close, make_inputs,
                      seed_of)
from reference import reference, reference_boxed, reference_grads, rel_rms, to_f64

try:
    from gdn_jax.ops import gated_delta_rule
except ImportError as _e:  # fail (not skip) every operator test, keep reference tests running
    gated_delta_rule = None
    _IMPORT_ERROR = _e

BACKENDS = ["scan", "chunk", "pallas"]
VALUE_BETA_BACKENDS = {"scan"}  # backends that take beta [B,T,H,V]
NON_SCAN_BACKENDS = [b for b in BACKENDS if b != "scan"]


def _op():
    if gated_delta_rule is None:
        pytest.fail(f"cannot import gdn_jax.ops.gated_delta_rule: {_IMPORT_ERROR!r}")
    return gated_delta_rule


@pytest.fixture
def seed(request):
    """Deterministic per-test seed (differs between tests)."""
    return zlib.crc32(request.node.nodeid.encode())


def declined(backend, x, chunk_size=64):
    """The reason ``backend`` does not cover inputs ``x`` (None if it does)."""
    if backend != "pallas":
        return None
    from gdn_jax.ops import pallas
    from gdn_jax.ops._common import GateForms

    forms = GateForms(x.g.ndim == 4, x.beta.ndim == 4)
    return pallas.supports(forms, chunk_size=chunk_size, K=x.q.shape[-1], V=x.v.shape[-1], dtype=x.v.dtype)


def assert_declines(backend, x, chunk_size=64, **kw):
    """A backend that does not cover a call says so: NotImplementedError naming the option."""
    reason = declined(backend, x, chunk_size)
    words = reason.split("(")[0].replace("does not take", "").strip().split()[:2]
    with pytest.raises(NotImplementedError, match=re.escape(" ".join(words))):
        op_fwd(x, backend, jit=False, chunk_size=chunk_size, **kw)


def ref_fwd(x, **kw):
    return reference(x.q, x.k, x.v, x.g, x.beta, initial_state=x.S0, **kw)


def ref_grads(x, **kw):
    return reference_grads(x.q, x.k, x.v, x.g, x.beta, initial_state=x.S0, do=x.do, dS=x.dS, **kw)


# ---------------------------------------------------------------------------
# running the operator
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _jitted_fwd(backend, kw):
    """One jitted forward per (backend, options), shared by every case that calls it (jit's own
    cache then keys on the shapes): equal shapes compile once, e.g. the scan runs of section 2."""
    fn = functools.partial(_op(), output_final_state=True, backend=backend, **dict(kw))
    return jax.jit(lambda q, k, v, g, beta, S0, cu: fn(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu))


@functools.lru_cache(maxsize=None)
def _jitted_fwd_grads(backend, has_S0, kw):
    fn = functools.partial(_op(), output_final_state=True, backend=backend, **dict(kw))

    def loss(q, k, v, g, beta, S0, do, dS, cu):
        o, S = fn(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu)
        val = jnp.sum(o.astype(F32) * do) + jnp.sum(S.astype(F32) * dS)
        return val, (o, S)

    argnums = (0, 1, 2, 3, 4, 5) if has_S0 else (0, 1, 2, 3, 4)
    return jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))


def op_fwd(x, backend, *, jit=True, cu_seqlens=None, **kw):
    if jit:
        return _jitted_fwd(backend, tuple(sorted(kw.items())))(x.q, x.k, x.v, x.g, x.beta, x.S0, cu_seqlens)
    return _op()(x.q, x.k, x.v, x.g, x.beta, initial_state=x.S0, cu_seqlens=cu_seqlens, output_final_state=True,
                 backend=backend, **kw)


def op_fwd_grads(x, backend, *, cu_seqlens=None, **kw):
    """(o, S, grads) with grads of sum(o*do) + sum(S*dS) w.r.t. q,k,v,g,beta
    (and initial_state when given), jitted."""
    has_S0 = x.S0 is not None
    f = _jitted_fwd_grads(backend, has_S0, tuple(sorted(kw.items())))
    grads, (o, S) = f(x.q, x.k, x.v, x.g, x.beta, x.S0, x.do, x.dS, cu_seqlens)
    return o, S, dict(zip(GRAD_NAMES, grads))


assert_close = check_close


def fwd_grad_pairs(o, S, grads, o_ref, S_ref, g_ref):
    pairs = {"o": (o, o_ref, TOL_O), "final_state": (S, S_ref, TOL_S)}
    for name in GRAD_NAMES:
        if name in grads:
            tol = TOL_GATE if name in ("g", "beta") else TOL_GRAD
            pairs["d" + name] = (grads[name], g_ref[name], tol)
    return pairs


# ---------------------------------------------------------------------------
# 0. the reference itself, validated independently
# ---------------------------------------------------------------------------


def test_reference_hand_computed_T2_K1_V1():
    """T=2, K=V=1, scalar arithmetic by hand (decay first, then delta update)."""
    s0, g, beta, k, v, q = 0.5, [-0.5, -1.0], [0.6, 0.3], [1.0, -2.0], [2.0, 1.0], [1.5, -0.5]
    S, o_hand = s0, []
    for t in range(2):
        S = math.exp(g[t]) * S
        S = S + k[t] * beta[t] * (v[t] - S * k[t])
        o_hand.append(S * q[t] * 1.0)  # scale = K**-0.5 = 1
    # t=0 literally: S=0.5e^-0.5=0.303265; S+=0.6(2-0.303265)=1.321306; o=1.5S=1.981959
    assert abs(o_hand[0] - 1.9819592) < 1e-6
    r = lambda a: np.asarray(a, np.float64).reshape(1, 2, 1, 1)  # noqa: E731
    o, Sf = reference(
        r(q), r(k), r(v), np.asarray(g).reshape(1, 2, 1), np.asarray(beta).reshape(1, 2, 1),
        initial_state=np.full((1, 1, 1, 1), s0),
    )
    np.testing.assert_allclose(o.reshape(-1), o_hand, rtol=1e-12)
    np.testing.assert_allclose(Sf.reshape(()), S, rtol=1e-12)
    assert o.dtype == np.float64 and Sf.dtype == np.float64


@pytest.mark.parametrize("form", ["head", "key_g", "value_beta", "key_g_value_beta"])
def test_reference_matrix_identity(form, seed):
    """S_t = alpha (I - beta k k^T) S_{t-1} + beta k v^T (per-head gates), and the
    per-key / per-value generalisations S_t = (I - k k^T diag.) D S_{t-1} ...,
    with explicit numpy matrices; o_t = S_t^T q_t * scale."""
    B, T, H, K, V = 2, 7, 2, 3, 4
    x = make_inputs(seed, B, T, H, K, V, gates="strong", init=True,
                    g_per_key="key_g" in form, beta_per_value="value_beta" in form)
    scale = 0.7
    q, k, v, g, beta, S0 = (to_f64(a) for a in (x.q, x.k, x.v, x.g, x.beta, x.S0))
    o_ref, S_ref = reference(q, k, v, g, beta, initial_state=S0, scale=scale)
    o_mat = np.zeros((B, T, H, V))
    S_mat = np.zeros((B, H, K, V))
    for b in range(B):
        for h in range(H):
            S = S0[b, h].copy()
            for t in range(T):
                kt, vt, qt = k[b, t, h][:, None], v[b, t, h][:, None], q[b, t, h][:, None]
                gt, bt = g[b, t, h], beta[b, t, h]
                D = np.diag(np.exp(gt)) if np.ndim(gt) else np.exp(gt) * np.eye(K)
                if np.ndim(bt) == 0:
                    # the textbook delta-rule identity
                    S = (np.eye(K) - bt * kt @ kt.T) @ D @ S + bt * kt @ vt.T
                else:
                    Bd = np.diag(bt)
                    S = D @ S - kt @ kt.T @ D @ S @ Bd + kt @ (Bd @ vt).T
                o_mat[b, t, h] = (S.T @ (scale * qt))[:, 0]
            S_mat[b, h] = S
    np.testing.assert_allclose(o_ref, o_mat, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(S_ref, S_mat, rtol=1e-10, atol=1e-12)


def test_reference_l2norm_and_cu_seqlens(seed):
    """use_qk_l2norm == manual x*rsqrt(sum x^2 + 1e-6); cu_seqlens == separate runs."""
    x = make_inputs(seed, 1, 20, 2, 4, 3, gates="weak", init=True, normalize_qk=False, N=3)
    q, k = to_f64(x.q), to_f64(x.k)
    nq = q / np.sqrt(np.sum(q**2, -1, keepdims=True) + 1e-6)
    nk = k / np.sqrt(np.sum(k**2, -1, keepdims=True) + 1e-6)
    cu = np.array([0, 3, 11, 20])
    o1, S1 = reference(q, k, x.v, x.g, x.beta, initial_state=x.S0, cu_seqlens=cu, use_qk_l2norm=True)
    o2, S2 = reference(nq, nk, x.v, x.g, x.beta, initial_state=x.S0, cu_seqlens=cu)
    np.testing.assert_allclose(o1, o2, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(S1, S2, rtol=1e-12, atol=1e-14)
    for n in range(3):
        s, e = cu[n], cu[n + 1]
        on, Sn = reference(nq[:, s:e], nk[:, s:e], x.v[:, s:e], x.g[:, s:e], x.beta[:, s:e],
                           initial_state=x.S0[n:n + 1])
        np.testing.assert_allclose(o2[:, s:e], on, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(S2[n:n + 1], Sn, rtol=1e-12, atol=1e-14)


def test_reference_grads_finite_differences(seed):
    """reference_grads vs central finite differences (float64) along random directions."""
    x = make_inputs(seed, 1, 5, 2, 3, 2, gates="strong", g_per_key=True, beta_per_value=True,
                    init=True, normalize_qk=False)
    args = {n: to_f64(getattr(x, a)) for n, a in zip(GRAD_NAMES, ("q", "k", "v", "g", "beta", "S0"))}
    do, dS = to_f64(x.do), to_f64(x.dS)

    def loss(a):
        o, S = reference(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["initial_state"],
                         use_qk_l2norm=True)
        return float(np.sum(o * do) + np.sum(S * dS))

    grads = reference_grads(args["q"], args["k"], args["v"], args["g"], args["beta"],
                            initial_state=args["initial_state"], use_qk_l2norm=True, do=do, dS=dS)
    rng = np.random.default_rng(seed + 1)
    eps = 1e-5
    for name in GRAD_NAMES:
        d = rng.standard_normal(args[name].shape)
        ap = dict(args, **{name: args[name] + eps * d})
        am = dict(args, **{name: args[name] - eps * d})
        fd = (loss(ap) - loss(am)) / (2 * eps)
        an = float(np.sum(grads[name] * d))
        assert abs(fd - an) <= 1e-6 * max(1.0, abs(an)), (name, fd, an)


def test_reference_g_zero_is_ungated_delta_rule(seed):
    x = make_inputs(seed, 2, 17, 2, 4, 5, gates="zero", init=True)
    o, S = ref_fwd(x)
    o_d, S_d = _ungated_delta_rule(x)
    np.testing.assert_allclose(o, o_d, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(S, S_d, rtol=1e-10, atol=1e-12)


def test_reference_decay_first_vs_boxed_distinguishable(seed):
    """Boxed (prediction from S_{t-1} before decay) differs from decay-first by
    >1e-2 with strong gates and <5e-3 with weak gates (~0.1 vs ~7e-4)."""
    xs = make_inputs(seed, 1, 64, 2, 16, 16, gates="strong", init=True)
    xw = make_inputs(seed, 1, 64, 2, 16, 16, gates="weak", init=True)
    strong = rel_rms(reference_boxed(xs.q, xs.k, xs.v, xs.g, xs.beta, initial_state=xs.S0)[0], ref_fwd(xs)[0])
    weak = rel_rms(reference_boxed(xw.q, xw.k, xw.v, xw.g, xw.beta, initial_state=xw.S0)[0], ref_fwd(xw)[0])
    assert strong > 1e-2, strong
    assert weak < 5e-3, weak


def _ungated_delta_rule(x, scale=None):
    """Explicit float64 python loop of the plain (ungated) delta rule."""
    q, k, v, beta = (to_f64(a) for a in (x.q, x.k, x.v, x.beta))
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    S0 = np.zeros((B, H, K, V)) if x.S0 is None else to_f64(x.S0)
    o = np.zeros((B, T, H, V))
    S_out = np.zeros((B, H, K, V))
    for b in range(B):
        for h in range(H):
            S = S0[b, h].copy()
            for t in range(T):
                kt = k[b, t, h]
                S = S + np.outer(kt, beta[b, t, h] * (v[b, t, h] - S.T @ kt))
                o[b, t, h] = S.T @ (scale * q[b, t, h])
            S_out[b, h] = S
    return o, S_out


# ---------------------------------------------------------------------------
# 1. each backend vs the reference: forward + all gradients
# ---------------------------------------------------------------------------

# pairwise-ish coverage of dtype x gate regime x gate forms x T/chunk x options
CASES = [
    dict(id="f32-weak-headg-T64-c64", B=2, T=64, H=2, K=16, V=32, gates="weak", chunk=64),
    dict(id="f32-strong-keyg-init-T75-c16", B=1, T=75, H=2, K=32, V=16, gates="strong", g_per_key=True,
         init=True, chunk=16),
    dict(id="f32-strong-headg-init-l2norm-T75-c32", B=2, T=75, H=2, K=16, V=16, gates="strong", init=True,
         l2=True, chunk=32),
    dict(id="f32-weak-keyg-scale-T40-c64", B=1, T=40, H=3, K=16, V=16, gates="weak", g_per_key=True,
         scale=0.3, chunk=64),
    dict(id="f32-weak-headg-init-T80-c128", B=1, T=80, H=2, K=32, V=32, gates="weak", init=True, chunk=128),
    dict(id="f32-strong-T1-init-c16", B=2, T=1, H=2, K=8, V=8, gates="strong", init=True, chunk=16),
    dict(id="bf16-strong-headg-init-T50-c16", B=2, T=50, H=2, K=16, V=16, gates="strong", init=True,
         chunk=16, dtype=BF16),
    dict(id="bf16-weak-keyg-l2norm-T75-c32", B=1, T=75, H=2, K=32, V=32, gates="weak", g_per_key=True,
         l2=True, chunk=32, dtype=BF16),
    dict(id="f32-strong-valbeta-init-T48", B=2, T=48, H=2, K=16, V=16, gates="strong", beta_per_value=True,
         init=True, chunk=16),
    dict(id="bf16-weak-keyg-valbeta-l2norm-T33", B=1, T=33, H=2, K=16, V=8, gates="weak", g_per_key=True,
         beta_per_value=True, l2=True, chunk=16, dtype=BF16),
]


def _case_params():
    for c in CASES:
        for b in BACKENDS:
            if c.get("beta_per_value") and b not in VALUE_BETA_BACKENDS:
                continue  # covered by test_value_beta_unsupported_backend_raises / test_auto_backend
            yield pytest.param(b, c, id=f"{b}-{c['id']}")


@pytest.mark.parametrize("backend,case", list(_case_params()))
def test_backend_vs_reference_fwd_and_grads(backend, case, seed):
    c = case
    x = make_inputs(seed, c["B"], c["T"], c["H"], c["K"], c["V"], gates=c["gates"],
                    g_per_key=c.get("g_per_key", False), beta_per_value=c.get("beta_per_value", False),
                    init=c.get("init", False), normalize_qk=not c.get("l2", False), dtype=c.get("dtype", F32))
    kw = dict(scale=c.get("scale"), use_qk_l2norm=c.get("l2", False))
    if declined(backend, x, c["chunk"]):
        return assert_declines(backend, x, c["chunk"], **kw)
    o, S, grads = op_fwd_grads(x, backend, chunk_size=c["chunk"], **kw)
    assert o.dtype == x.v.dtype and S.dtype == F32
    assert o.shape == x.v.shape and S.shape == (c["B"], c["H"], c["K"], c["V"])
    for name in ("q", "k", "v", "g", "beta"):
        assert grads[name].shape == getattr(x, name).shape
    o_ref, S_ref = ref_fwd(x, **kw)
    g_ref = ref_grads(x, **kw)
    assert_close(fwd_grad_pairs(o, S, grads, o_ref, S_ref, g_ref))


# ---------------------------------------------------------------------------
# 2. non-scan backends vs scan: odd T, T < chunk, T multiple of chunk, T = 1
# ---------------------------------------------------------------------------

CHUNK_T = [  # (chunk_size, T, gates, g_per_key)
    (16, 75, "strong", False),
    (32, 75, "weak", True),
    (64, 75, "strong", True),
    (128, 75, "weak", False),
    (16, 1, "weak", True),
    (64, 10, "strong", False),
    (32, 64, "strong", False),
    (128, 128, "weak", True),
    (16, 48, "weak", False),
]


@pytest.mark.parametrize("backend", NON_SCAN_BACKENDS)
@pytest.mark.parametrize("chunk_size,T,gates,g_per_key", CHUNK_T)
def test_vs_scan_chunk_sizes_and_lengths(backend, chunk_size, T, gates, g_per_key, seed):
    x = make_inputs(seed, 2, T, 2, 16, 16, gates=gates, g_per_key=g_per_key, init=True)
    if declined(backend, x, chunk_size):
        return assert_declines(backend, x, chunk_size)
    o, S = op_fwd(x, backend, chunk_size=chunk_size)
    o_s, S_s = op_fwd(x, "scan")
    o_ref, S_ref = ref_fwd(x)
    assert_close({"o_vs_scan": (o, o_s, TOL_O), "S_vs_scan": (S, S_s, TOL_S),
                  "o_vs_ref": (o, o_ref, TOL_O), "S_vs_ref": (S, S_ref, TOL_S)})


# ---------------------------------------------------------------------------
# 3. per-value-channel beta: scan only; chunk raises naming "scan"; auto works
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b not in VALUE_BETA_BACKENDS])
def test_value_beta_unsupported_backend_raises(backend, seed):
    x = make_inputs(seed, 1, 20, 2, 8, 8, beta_per_value=True)
    with pytest.raises(NotImplementedError, match="scan"):
        op_fwd(x, backend, jit=False, chunk_size=16)


@pytest.mark.parametrize("beta_per_value,g_per_key", [(True, False), (False, True), (True, True)])
def test_auto_backend(beta_per_value, g_per_key, seed):
    x = make_inputs(seed, 2, 37, 2, 16, 16, gates="strong", beta_per_value=beta_per_value,
                    g_per_key=g_per_key, init=True)
    o, S = op_fwd(x, "auto", chunk_size=16)
    o_ref, S_ref = ref_fwd(x)
    assert_close({"o": (o, o_ref, TOL_O), "final_state": (S, S_ref, TOL_S)})


# ---------------------------------------------------------------------------
# 4. cu_seqlens (packed varlen)
# ---------------------------------------------------------------------------

# lengths 5 (< chunk), 27 (boundary 32 = chunk boundary for 16/32), 38, 5
CU = [0, 5, 32, 70, 75]


@pytest.mark.parametrize("backend,init,chunk_size",
                         [(b, init, cs) for b in BACKENDS for init, cs in ((False, 16), (True, 32))])
def test_cu_seqlens_vs_separate_runs(backend, init, chunk_size, seed):
    """Packed == each sequence alone (op), == reference; grads == reference.
    Weak gates so that any state leaking across a boundary would be visible."""
    N = len(CU) - 1
    x = make_inputs(seed, 1, CU[-1], 2, 16, 16, gates="weak", init=init, N=N)
    cu = jnp.asarray(CU, jnp.int32)
    o, S, grads = op_fwd_grads(x, backend, cu_seqlens=cu, chunk_size=chunk_size)
    assert o.shape == x.v.shape and S.shape == (N, 2, 16, 16)
    o_ref, S_ref = ref_fwd(x, cu_seqlens=CU)
    g_ref = ref_grads(x, cu_seqlens=CU)
    pairs = fwd_grad_pairs(o, S, grads, o_ref, S_ref, g_ref)
    # each sequence alone through the operator (B=1, no cu_seqlens)
    o_sep, S_sep = [], []
    for n in range(N):
        s, e = CU[n], CU[n + 1]
        xn = Inputs()
        xn.q, xn.k, xn.v, xn.g, xn.beta = (a[:, s:e] for a in (x.q, x.k, x.v, x.g, x.beta))
        xn.S0 = None if x.S0 is None else x.S0[n:n + 1]
        on, Sn = op_fwd(xn, backend, chunk_size=chunk_size)
        o_sep.append(np.asarray(on))
        S_sep.append(np.asarray(Sn))
    pairs["o_vs_separate"] = (o, np.concatenate(o_sep, axis=1), TOL_O)
    pairs["S_vs_separate"] = (S, np.concatenate(S_sep, axis=0), TOL_S)
    assert_close(pairs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cu_seqlens_traced_under_jit_no_recompile(backend, seed):
    T, N = 48, 3
    x = make_inputs(seed, 1, T, 2, 16, 16, gates="weak", init=True, N=N)
    traces = [0]

    @jax.jit
    def f(q, k, v, g, beta, S0, cu):
        traces[0] += 1
        return _op()(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu,
                     chunk_size=16, backend=backend)

    for packing in ([0, 16, 20, 48], [0, 7, 40, 48]):
        o, S = f(x.q, x.k, x.v, x.g, x.beta, x.S0, jnp.asarray(packing, jnp.int32))
        o_ref, S_ref = ref_fwd(x, cu_seqlens=packing)
        assert_close({f"o{packing}": (o, o_ref, TOL_O), f"S{packing}": (S, S_ref, TOL_S)})
    assert traces[0] == 1, f"retraced {traces[0]} times for two packings of the same static length"


# ---------------------------------------------------------------------------
# 5. pitfalls
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_pitfall_extreme_gates_low_precision(backend, dtype, seed):
    """B=2, T=75, H=4, K=V=64, g = logsigmoid(x)/0.01 (down to -hundreds):
    no NaN/inf anywhere, matches the reference (and scan)."""
    x = make_inputs(seed, 2, 75, 4, 64, 64, gates="extreme", init=True, dtype=dtype)
    assert float(jnp.min(x.g.astype(F32))) < -100
    o, S, grads = op_fwd_grads(x, backend, chunk_size=32)
    for name, a in [("o", o), ("final_state", S)] + [("d" + n, g) for n, g in grads.items()]:
        assert bool(jnp.all(jnp.isfinite(a.astype(F32)))), f"non-finite {name}"
    pairs = fwd_grad_pairs(o, S, grads, *ref_fwd(x), ref_grads(x))
    if backend != "scan":
        o_s, S_s = op_fwd(x, "scan")
        pairs["o_vs_scan"] = (o, o_s, TOL_O)
        pairs["S_vs_scan"] = (S, S_s, TOL_S)
    assert_close(pairs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pitfall_g_zero_is_ungated_delta_rule(backend, seed):
    x = make_inputs(seed, 2, 40, 2, 16, 16, gates="zero", init=True)
    o, S = op_fwd(x, backend, chunk_size=16)
    o_d, S_d = _ungated_delta_rule(x)
    assert_close({"o": (o, o_d, TOL_O), "final_state": (S, S_d, TOL_S)})


@pytest.mark.parametrize("which", ["do_only", "dS_only"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_pitfall_initial_state_gradient(backend, which, seed):
    x = make_inputs(seed, 2, 40, 2, 16, 16, gates="weak", init=True)
    if which == "do_only":
        x.dS = jnp.zeros_like(x.dS)
    else:
        x.do = jnp.zeros_like(x.do)
    _, _, grads = op_fwd_grads(x, backend, chunk_size=16)
    g_ref = ref_grads(x)
    d0 = to_f64(grads["initial_state"])
    assert np.sqrt(np.mean(d0**2)) > 1e-3 * np.sqrt(np.mean(g_ref["initial_state"] ** 2)) > 0
    assert_close({"dinitial_state": (d0, g_ref["initial_state"], TOL_GRAD)})


@pytest.mark.parametrize("backend", BACKENDS)
def test_decay_first_not_boxed(backend, seed):
    """With strong gates the op matches decay-first and is far (>1e-2) from the
    prediction-before-decay ("boxed") formula."""
    x = make_inputs(seed, 1, 64, 2, 16, 16, gates="strong", init=True)
    o, S = op_fwd(x, backend, chunk_size=16)
    o_ref, _ = ref_fwd(x)
    o_box, _ = reference_boxed(x.q, x.k, x.v, x.g, x.beta, initial_state=x.S0)
    assert rel_rms(o, o_ref) <= TOL_O
    assert rel_rms(o, o_box) > 1e-2


# ---------------------------------------------------------------------------
# 6. output dtypes / None final state / float64
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("backend", BACKENDS + ["auto"])
def test_output_dtypes(backend, dtype, seed):
    x = make_inputs(seed, 1, 20, 2, 16, 16, dtype=dtype, init=True)
    op = _op()
    o, S = op(x.q, x.k, x.v, x.g, x.beta, initial_state=x.S0, output_final_state=True, chunk_size=16,
              backend=backend)
    assert o.dtype == dtype and o.shape == x.v.shape
    assert S.dtype == F32 and S.shape == (1, 2, 16, 16)
    o2, S2 = op(x.q, x.k, x.v, x.g, x.beta, initial_state=x.S0, output_final_state=False, chunk_size=16,
                backend=backend)
    assert S2 is None and o2.dtype == dtype
    np.testing.assert_array_equal(to_f64(o2), to_f64(o))


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_inputs_accumulate_in_float64(backend, seed):
    """Under a local x64 context, float64 inputs give a float64 o accurate to ~1e-9."""
    x = make_inputs(seed, 1, 40, 2, 16, 16, gates="strong", g_per_key=backend != "pallas", init=True)
    o_ref, _ = ref_fwd(x)
    with jax.enable_x64(True):
        args = [jnp.asarray(to_f64(a), jnp.float64) for a in (x.q, x.k, x.v, x.g, x.beta, x.S0)]
        if backend == "pallas":  # kernels accumulate in float32: declined, naming float64
            with pytest.raises(NotImplementedError, match="float64"):
                _op()(*args[:5], initial_state=args[5], chunk_size=16, backend=backend)
            return
        o, _ = _op()(*args[:5], initial_state=args[5], output_final_state=True, chunk_size=16,
                     backend=backend)
        assert o.dtype == jnp.float64
        err = rel_rms(o, o_ref)
    assert err < 1e-9, err


# ---------------------------------------------------------------------------
# 7. validation
# ---------------------------------------------------------------------------

_B, _T, _H, _K, _V = 1, 8, 2, 4, 4


def _valid():
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), F32)  # noqa: E731
    return dict(q=f(_B, _T, _H, _K), k=f(_B, _T, _H, _K), v=f(_B, _T, _H, _V),
                g=-jnp.abs(f(_B, _T, _H)), beta=jax.nn.sigmoid(f(_B, _T, _H)))


def _two_batch(a):
    a["q"], a["k"], a["v"], a["g"], a["beta"] = (jnp.concatenate([x, x], 0)
                                                  for x in (a["q"], a["k"], a["v"], a["g"], a["beta"]))


def _set(**kw):
    def mod(a, kwargs):
        for key, fn in kw.items():
            if key in a:
                a[key] = fn(a[key])
            else:
                kwargs[key] = fn(None)
    return mod


def _cu(vals):
    return lambda _: jnp.asarray(vals, jnp.int32)


def _mod_cu_B2(a, kwargs):
    _two_batch(a)
    kwargs["cu_seqlens"] = jnp.asarray([0, 3, _T], jnp.int32)


VALIDATION = [
    # (id, modifier, exception, match)
    ("q-rank", _set(q=lambda x: x[..., 0]), ValueError, r"\bq\b"),
    ("k-rank", _set(k=lambda x: x[None]), ValueError, r"\bk\b"),
    ("v-rank", _set(v=lambda x: x[0]), ValueError, r"\bv\b"),
    ("g-rank", _set(g=lambda x: x[0]), ValueError, r"\bg\b"),
    ("beta-rank", _set(beta=lambda x: x[..., None, None]), ValueError, r"\bbeta\b"),
    ("k-B", _set(k=lambda x: jnp.concatenate([x, x], 0)), ValueError, r"\b(q|k)\b"),
    ("v-T", _set(v=lambda x: x[:, :-1]), ValueError, r"\bv\b"),
    ("v-H", _set(v=lambda x: jnp.concatenate([x, x[:, :, :1]], 2)), ValueError, r"\bv\b.*multiple of the key heads"),
    ("v-H-gva-gates", _set(v=lambda x: jnp.concatenate([x, x], 2)), ValueError, r"\bg\b"),  # gates on the value heads
    ("k-K", _set(k=lambda x: x[..., :-1]), ValueError, r"\b(q|k)\b"),
    ("g-T", _set(g=lambda x: x[:, :-1]), ValueError, r"\bg\b"),
    ("g-K", _set(g=lambda x: jnp.zeros((_B, _T, _H, _K + 1), F32)), ValueError, r"\bg\b"),
    ("beta-H", _set(beta=lambda x: x[:, :, :1]), ValueError, r"\bbeta\b"),
    ("beta-V", _set(beta=lambda x: jnp.ones((_B, _T, _H, _V + 1), F32)), ValueError, r"\bbeta\b"),
    ("q-int", _set(q=lambda x: x.astype(jnp.int32)), TypeError, r"\bq\b"),
    ("k-int", _set(k=lambda x: x.astype(jnp.int32)), TypeError, r"\bk\b"),
    ("v-int", _set(v=lambda x: x.astype(jnp.int32)), TypeError, r"\bv\b"),
    ("g-int", _set(g=lambda x: x.astype(jnp.int32)), TypeError, r"\bg\b"),
    ("beta-bool", _set(beta=lambda x: x > 0.5), TypeError, r"\bbeta\b"),
    ("initial_state-shape", _set(initial_state=lambda _: jnp.zeros((_B, _H, _K, _V + 1), F32)), ValueError,
     "initial_state"),
    ("initial_state-rank", _set(initial_state=lambda _: jnp.zeros((_H, _K, _V), F32)), ValueError,
     "initial_state"),
    ("chunk_size-0", _set(chunk_size=lambda _: 0), ValueError, "chunk_size"),
    ("chunk_size-neg", _set(chunk_size=lambda _: -16), ValueError, "chunk_size"),
    ("cu_seqlens-B2", _mod_cu_B2, ValueError, "cu_seqlens"),
    ("cu_seqlens-start", _set(cu_seqlens=_cu([1, 4, _T])), ValueError, "cu_seqlens"),
    ("cu_seqlens-end", _set(cu_seqlens=_cu([0, 4, _T - 1])), ValueError, "cu_seqlens"),
    ("cu_seqlens-end-over", _set(cu_seqlens=_cu([0, 4, _T + 2])), ValueError, "cu_seqlens"),
    ("cu_seqlens-decreasing", _set(cu_seqlens=_cu([0, 5, 3, _T])), ValueError, "cu_seqlens"),
    # unsigned: np.diff wraps around instead of going negative (it used to pass the check, then give NaN)
    ("cu_seqlens-decreasing-uint32", _set(cu_seqlens=lambda _: np.asarray([0, 5, 3, _T], np.uint32)), ValueError,
     "non-decreasing"),
    ("cu_seqlens-initial_state-N", lambda a, kw: kw.update(cu_seqlens=jnp.asarray([0, 3, _T], jnp.int32),
                                                           initial_state=jnp.zeros((3, _H, _K, _V), F32)),
     ValueError, "initial_state"),
    ("backend-unknown", _set(backend=lambda _: "nope"), ValueError, "backend"),
    ("use_qk_l2norm-str", _set(use_qk_l2norm=lambda _: "yes"), TypeError, "use_qk_l2norm"),
    ("mask_nonfinite-int", _set(mask_nonfinite=lambda _: 1), TypeError, "mask_nonfinite"),
]


@pytest.mark.parametrize("backend", BACKENDS + ["auto"])
@pytest.mark.parametrize("mod,exc,match", [pytest.param(m, e, r, id=i) for i, m, e, r in VALIDATION])
def test_validation_errors(backend, mod, exc, match):
    a = _valid()
    kwargs = dict(backend=backend, chunk_size=16, output_final_state=True)
    mod(a, kwargs)
    with pytest.raises(exc, match=match):
        _op()(a["q"], a["k"], a["v"], a["g"], a["beta"], **kwargs)


@pytest.mark.parametrize("backend", BACKENDS + ["auto"])
def test_numpy_float64_inputs_as_jax_takes_them(backend):
    """NumPy float64 inputs with x64 off are float32 to JAX: every backend (pallas included) takes
    them as such and agrees with the same call on jnp float32 arrays."""
    if jax.config.jax_enable_x64:
        pytest.skip("x64 on: float64 stays float64")
    r = np.random.default_rng(seed_of("numpy-f64", backend))
    shapes = dict(q=(1, 40, 2, 16), k=(1, 40, 2, 16), v=(1, 40, 2, 16), g=(1, 40, 2), beta=(1, 40, 2))
    as_np = {n: r.normal(size=s) for n, s in shapes.items()}  # float64
    as_np["k"] /= np.linalg.norm(as_np["k"], axis=-1, keepdims=True)
    as_np["g"] = -np.abs(as_np["g"]) / 4
    as_np["beta"] = 1 / (1 + np.exp(-as_np["beta"]))
    a = {n: jnp.asarray(x, jnp.float32) for n, x in as_np.items()}
    kw = dict(backend=backend, chunk_size=16, output_final_state=True)
    o, S = _op()(*(as_np[n] for n in ("q", "k", "v", "g", "beta")), **kw)
    o2, S2 = _op()(*(a[n] for n in ("q", "k", "v", "g", "beta")), **kw)
    assert o.dtype == jnp.float32 and S.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(o), np.asarray(o2), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(S), np.asarray(S2), rtol=1e-5, atol=1e-6)
