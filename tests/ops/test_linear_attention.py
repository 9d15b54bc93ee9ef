"""gated_linear_attention (no delta rule) against an independent float64 token-loop reference."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from conftest import make_inputs
from reference import rel_rms
from gdn_jax.ops import gated_linear_attention
from gdn_jax.ops import linear_attention as LA

B, T, H, K, V, C = 2, 37, 2, 8, 6, 16


def _ref_one(q, k, v, g, S0):
    """One sequence, float64, a plain Python loop over tokens. q,k [T,H,K]; v [T,H,V]; g [T,H,K]."""
    S, outs = S0, []
    for t in range(q.shape[0]):
        S = jnp.exp(g[t])[:, :, None] * S + k[t][:, :, None] * v[t][:, None, :]
        outs.append(jnp.einsum("hkv,hk->hv", S, q[t]))
    return jnp.stack(outs), S


def ref(q, k, v, g, S0, *, scale=None, cu=None, l2=False):
    """Reference (call inside enable_x64): S_t = diag(exp g_t) S + k v^T; o_t = S^T (scale q)."""
    q, k, v = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
    if l2:
        q = q / jnp.sqrt(jnp.sum(q * q, -1, keepdims=True) + 1e-6)
        k = k / jnp.sqrt(jnp.sum(k * k, -1, keepdims=True) + 1e-6)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    g = jnp.zeros(q.shape[:3], jnp.float64) if g is None else jnp.asarray(g, jnp.float64)
    if g.ndim == 3:
        g = jnp.broadcast_to(g[..., None], q.shape)
    bounds = [(b, 0, q.shape[1]) for b in range(q.shape[0])] if cu is None else \
        [(0, int(cu[i]), int(cu[i + 1])) for i in range(len(cu) - 1)]
    os, Ss = [], []
    for n, (b, s, e) in enumerate(bounds):
        h0 = jnp.zeros((q.shape[2], q.shape[3], v.shape[3])) if S0 is None else jnp.asarray(S0[n], jnp.float64)
        if e > s:
            o, S = _ref_one(q[b, s:e], k[b, s:e], v[b, s:e], g[b, s:e], h0)
            os.append(o)
        else:
            S = h0
        Ss.append(S)
    o = jnp.concatenate(os, 0)
    o = o[None] if cu is not None else o.reshape(q.shape[0], q.shape[1], q.shape[2], -1)
    return o, jnp.stack(Ss)


def inputs(form, dtype=jnp.float32, strong=False, seed=0, b=B, t=T):
    """(q, k, v, g, S0) from ``conftest.make_inputs``: normalised q, k; g = logsigmoid(N(1, 1))
    per head / per key channel, or 4 logsigmoid(N(-3, 1)) (~ -10 per token) when ``strong``;
    None for ``form="none"``; S0 ~ N(0, 1) float32."""
    gates = ("logsigmoid", -3.0, 4.0) if strong else ("logsigmoid", 1.0, 1.0)
    x = make_inputs(seed, b, t, H, K, V, gates=gates, g_per_key=form == "channel", init=True, dtype=dtype,
                    state_scale=1.0)
    return x.q, x.k, x.v, None if form == "none" else x.g, x.S0


def _loss(f, w_o, w_s):
    def L(q, k, v, g, S0):
        o, S = f(q, k, v, g, S0)
        return jnp.sum(o.astype(jnp.float64 if o.dtype == jnp.float64 else jnp.float32) * w_o) + jnp.sum(S * w_s)
    return L


@pytest.fixture
def state_pass(request, monkeypatch):
    """"parallel" (the chunk backend's default at a few chunks) or "scan" (forced across chunks by
    ``PARALLEL_MAX_CHUNKS = 0``, the path of long sequences)."""
    if request.param == "scan":
        monkeypatch.setattr(LA, "PARALLEL_MAX_CHUNKS", 0)
    return request.param


@pytest.mark.parametrize("form", ["none", "head", "channel"])
@pytest.mark.parametrize("backend,state_pass", [("scan", "scan"), ("chunk", "parallel"), ("chunk", "scan")],
                         indirect=["state_pass"])
@pytest.mark.parametrize("dtype,strong", [(jnp.float32, False), (jnp.float32, True), (jnp.bfloat16, False)])
def test_forward_and_grads(form, backend, state_pass, dtype, strong):
    q, k, v, g, S0 = inputs(form, dtype, strong)
    w_o = jax.random.normal(jax.random.PRNGKey(7), (B, T, H, V))
    w_s = jax.random.normal(jax.random.PRNGKey(8), (B, H, K, V))
    op = lambda q, k, v, g, S0: gated_linear_attention(q, k, v, g, initial_state=S0, output_final_state=True,
                                                      chunk_size=C, backend=backend)
    argn = (0, 1, 2, 4) if g is None else (0, 1, 2, 3, 4)
    o, S = jax.jit(op)(q, k, v, g, S0)
    assert o.dtype == dtype and S.dtype == jnp.float32 and o.shape == (B, T, H, V)
    grads = jax.jit(jax.grad(_loss(op, w_o, w_s), argnums=argn))(q, k, v, g, S0)
    with jax.enable_x64(True):
        f64 = lambda x: None if x is None else jnp.asarray(np.asarray(x, np.float64))
        a = tuple(map(f64, (q, k, v, g, S0)))
        ro, rS = ref(*a)
        rg = jax.grad(_loss(lambda *x: ref(*x), f64(w_o), f64(w_s)), argnums=argn)(*a)
        ro, rS, rg = np.asarray(ro), np.asarray(rS), [np.asarray(x) for x in rg]
    tol = 5e-3
    assert rel_rms(o, ro) <= tol and rel_rms(S, rS) <= 5e-3
    names = ["dq", "dk", "dv", "dg", "dS0"] if g is not None else ["dq", "dk", "dv", "dS0"]
    for n, x, r in zip(names, grads, rg):
        gt = 2e-2 if n == "dg" else 8e-3
        assert np.all(np.isfinite(np.asarray(x, np.float32))), n
        assert rel_rms(np.asarray(x, np.float32), r) <= gt, (n, rel_rms(np.asarray(x, np.float32), r))


@pytest.mark.parametrize("backend", ["scan", "chunk"])
@pytest.mark.parametrize("form", ["head", "channel"])
def test_cu_seqlens_matches_separate_runs(backend, form):
    cu = np.array([0, 5, 5, 30, 44], np.int32)
    q, k, v, g, _ = inputs(form, b=1, t=44, seed=3)
    S0 = jax.random.normal(jax.random.PRNGKey(4), (4, H, K, V))
    o, S = gated_linear_attention(q, k, v, g, initial_state=S0, cu_seqlens=cu, output_final_state=True,
                                  chunk_size=C, backend=backend, use_qk_l2norm=True)
    for n in range(4):
        s, e = cu[n], cu[n + 1]
        if e == s:
            np.testing.assert_allclose(S[n], S0[n], rtol=1e-6)
            continue
        on, Sn = gated_linear_attention(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], initial_state=S0[n:n + 1],
                                        output_final_state=True, chunk_size=C, backend=backend, use_qk_l2norm=True)
        assert rel_rms(o[:, s:e], on) < 1e-5 and rel_rms(S[n], Sn[0]) < 1e-5
    with jax.enable_x64(True):
        ro, rS = ref(*(np.asarray(x, np.float64) for x in (q, k, v, g, S0)), cu=cu, l2=True)
    assert rel_rms(o, ro) < 5e-3 and rel_rms(S, rS) < 5e-3


@pytest.mark.parametrize("backend", ["scan", "chunk"])
def test_channel_equal_decay_equals_head_decay(backend):
    q, k, v, g, S0 = inputs("head", seed=5)
    gc = jnp.broadcast_to(g[..., None], q.shape)
    kw = dict(initial_state=S0, output_final_state=True, chunk_size=C, backend=backend)
    o1, S1 = gated_linear_attention(q, k, v, g, **kw)
    o2, S2 = gated_linear_attention(q, k, v, gc, **kw)
    assert rel_rms(o2, o1) < 1e-5 and rel_rms(S2, S1) < 1e-5


def test_infinite_gate_resets_state_no_nan():
    q, k, v, g, S0 = inputs("head", seed=6)
    g = g.at[:, 20].set(-jnp.inf)
    for backend in ("scan", "chunk"):
        o, S = gated_linear_attention(q, k, v, g, initial_state=S0, output_final_state=True, chunk_size=C, backend=backend)
        o2, S2 = gated_linear_attention(q[:, 20:], k[:, 20:], v[:, 20:], g[:, 20:].at[:, 0].set(0.0),
                                        output_final_state=True, chunk_size=C, backend=backend)
        assert np.all(np.isfinite(o)) and rel_rms(o[:, 20:], o2) < 1e-5 and rel_rms(S, S2) < 1e-5


def test_validation_errors():
    q, k, v, g, S0 = inputs("head", t=8)
    with pytest.raises(ValueError, match="backend"):
        gated_linear_attention(q, k, v, g, backend="pallas")
    with pytest.raises(ValueError, match="g"):
        gated_linear_attention(q, k, v, g[..., :1])
    with pytest.raises(ValueError, match="v must"):
        gated_linear_attention(q, k, v[:, :3], g)
    with pytest.raises(ValueError, match="initial_state"):
        gated_linear_attention(q, k, v, g, initial_state=S0[:1])
    with pytest.raises(TypeError):
        gated_linear_attention(q.astype(jnp.int32), k, v, g)
    with pytest.raises(ValueError, match="cu_seqlens"):
        gated_linear_attention(q, k, v, g, cu_seqlens=np.array([0, 8], np.int32))  # B = 2
    with pytest.raises(ValueError, match="cu_seqlens"):
        gated_linear_attention(q[:1], k[:1], v[:1], g[:1], cu_seqlens=np.array([0, 5], np.int32))
    with pytest.raises(ValueError, match="chunk_size"):
        gated_linear_attention(q, k, v, g, chunk_size=0)


def test_traced_malformed_cu_seqlens_gives_nan():
    q, k, v, g, _ = inputs("head", b=1, t=20)
    f = jax.jit(lambda cu: gated_linear_attention(q, k, v, g, cu_seqlens=cu, output_final_state=True, chunk_size=C))
    o, S = f(jnp.array([0, 8, 20], jnp.int32))
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(S))
    o, S = f(jnp.array([0, 12, 8], jnp.int32))
    assert np.all(np.isnan(o)) and np.all(np.isnan(S))

@pytest.mark.parametrize("form", ["head", "channel"])
def test_parallel_state_pass_no_cancellation(form, monkeypatch):
    """Strong decay in the first chunks (-40 per token), mild after: the parallel state pass sums
    same-sign log decays (no difference of two large cumulative sums), so float32 stays within
    1e-5 of the float64 reference and of the scan across chunks, in o, the final state and grads."""
    t = 6 * C
    q, k, v, g, S0 = inputs(form, t=t, seed=11)
    g = jnp.where(jnp.arange(t)[None, :, None] < 2 * C, -40.0, 0.02 * g[..., 0] if form == "channel" else 0.02 * g)
    g = jnp.broadcast_to(g[..., None], q.shape) * jnp.linspace(0.5, 1.0, K) if form == "channel" else g
    op = lambda *x: gated_linear_attention(*x[:4], initial_state=x[4], output_final_state=True, chunk_size=C,
                                           backend="chunk")
    assert t // C <= LA.PARALLEL_MAX_CHUNKS
    w_o = jax.random.normal(jax.random.PRNGKey(1), (B, t, H, V))
    w_s = jax.random.normal(jax.random.PRNGKey(2), (B, H, K, V))
    got = jax.jit(op)(q, k, v, g, S0), jax.grad(_loss(op, w_o, w_s), argnums=(0, 1, 2, 3))(q, k, v, g, S0)
    monkeypatch.setattr(LA, "PARALLEL_MAX_CHUNKS", 0)
    scan = jax.jit(op)(q, k, v, g, S0), jax.grad(_loss(op, w_o, w_s), argnums=(0, 1, 2, 3))(q, k, v, g, S0)
    with jax.enable_x64(True):
        a = tuple(jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, g, S0))
        ro, rS = ref(*a)
        rg = jax.grad(_loss(lambda *x: ref(*x), jnp.asarray(np.asarray(w_o, np.float64)),
                            jnp.asarray(np.asarray(w_s, np.float64))), argnums=(0, 1, 2, 3))(*a)
    for (o, S), grads in (got, scan):
        assert rel_rms(o, np.asarray(ro)) < 1e-5 and rel_rms(S, np.asarray(rS)) < 1e-5
        for x, r in zip(grads, rg):
            assert rel_rms(np.asarray(x), np.asarray(r)) < 1e-4
    assert rel_rms(got[0][0], scan[0][0]) < 1e-6 and rel_rms(got[0][1], scan[0][1]) < 1e-6


@pytest.mark.parametrize("state_pass", ["parallel", "scan"], indirect=True)
def test_unguarded_nonfinite_is_never_silent(state_pass):
    """mask_nonfinite=False (default): a NaN in v at t makes o at t and after NaN, never finite
    garbage; earlier outputs are finite or NaN (the chunk form may leak it backward: documented),
    and the parallel state pass and the scan agree wherever both are finite."""
    q, k, v, g, S0 = inputs("channel", t=5 * C + 3, seed=12)
    t = 2 * C + 5
    o = gated_linear_attention(q, k, v.at[:, t].set(jnp.nan), g, initial_state=S0, chunk_size=C, backend="chunk")[0]
    o = np.asarray(o)
    assert np.all(np.isnan(o[:, t:])) and np.all(np.isfinite(o[:, :C]))  # chunk 0 reads only S0 and itself
    o_clean = np.asarray(gated_linear_attention(q, k, v, g, initial_state=S0, chunk_size=C, backend="chunk")[0])
    fin = np.isfinite(o[:, :t])
    np.testing.assert_allclose(o[:, :t][fin], o_clean[:, :t][fin], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("C,sub", [(64, None), (64, 16), (64, 4), (32, 8), (16, 16)])
def test_decay_gram_channel_sub_blocks_match_float64(C, sub):
    """The per-key-channel decay Gram at any sub-block size (None: the default, 8) equals the
    direct float64 sum M_ij = sum_c a_ic b_jc exp(g_ic - g_jc) (i >= j), with decays strong enough
    (down to -8 per token) that the unfactored exp(-g_jc) would overflow float32; value and grads."""
    from gdn_jax.ops import chunk as CH

    rng = np.random.default_rng(C + (sub or 0))
    Kc = 8
    a, b = (rng.standard_normal((2, C, Kc)).astype(np.float32) for _ in range(2))
    g = -rng.exponential(1.0, (2, C, Kc)).astype(np.float32) * (rng.random((2, C, Kc)) < 0.3) * 8
    gc = np.cumsum(g, axis=1)
    w = rng.standard_normal((2, C, C)).astype(np.float32)

    def f(a, b, gc):
        kw = {} if sub is None else dict(sub=sub)
        return jnp.sum(CH.decay_gram_channel(a, b, gc, **kw) * w)

    got, grads = jax.value_and_grad(f, argnums=(0, 1, 2))(*map(jnp.asarray, (a, b, gc)))
    with jax.enable_x64(True):
        def f64(a, b, gc):
            d = gc[:, :, None, :] - gc[:, None, :, :]
            low = np.tril(np.ones((C, C), bool))[None, :, :, None]
            e = jnp.exp(jnp.where(low, d, -jnp.inf))
            return jnp.sum(jnp.einsum("nic,njc,nijc->nij", a, b, e) * w.astype(np.float64))
        want, wgrads = jax.value_and_grad(f64, argnums=(0, 1, 2))(*(jnp.asarray(x, jnp.float64) for x in (a, b, gc)))
        assert abs(float(got) - float(want)) <= 1e-5 * max(1.0, abs(float(want)))
        for x, y in zip(grads, wgrads):
            assert np.isfinite(np.asarray(x)).all()
            assert rel_rms(x, y) <= 1e-5
