"""Edge cases found by trying to break the op: huge/infinite negative gates mid-chunk, and a
malformed traced cu_seqlens (values, final state AND gradients must be NaN, never silently wrong)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax.ops import gated_delta_rule
from reference import reference, rel_rms


def _inputs(seed=0, B=1, T=70, H=2, K=16):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, H, K)), jnp.float32)
    k = rng.normal(size=(B, T, H, K))
    k = jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, T, H, K)), jnp.float32)
    g = jnp.asarray(jax.nn.log_sigmoid(rng.normal(size=(B, T, H))) / 4, jnp.float32)
    b = jnp.asarray(jax.nn.sigmoid(rng.normal(size=(B, T, H))), jnp.float32)
    return q, k, v, g, b


@functools.lru_cache(maxsize=None)
def _fwd_and_grad(backend, chunk):
    """jitted (o, S) and (dq, dg) of sum(o), compiled once per (backend, chunk) for both gate values."""
    f = lambda q, k, v, g, b: gated_delta_rule(q, k, v, g, b, output_final_state=True, backend=backend,
                                               chunk_size=chunk)
    return jax.jit(f), jax.jit(jax.grad(lambda q, k, v, g, b: f(q, k, v, g, b)[0].sum(), argnums=(0, 3)))


@pytest.mark.parametrize("backend,chunk", [("chunk", 64), ("chunk", 16), ("pallas", 32), ("scan", 64)])
@pytest.mark.parametrize("val", [-1e6, -np.inf])
def test_huge_negative_gate_mid_chunk(backend, chunk, val):
    """A state-reset idiom (g = -1e6 or -inf on some tokens) must stay exact, never NaN."""
    q, k, v, g, b = _inputs()
    g = g.at[:, 3::5].set(val)
    fwd, grad = _fwd_and_grad(backend, chunk)
    o, S = fwd(q, k, v, g, b)
    o_ref, S_ref = reference(q, k, v, g, b)
    assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(S)))
    assert rel_rms(np.asarray(o), o_ref) <= 5e-3
    assert rel_rms(np.asarray(S), S_ref) <= 5e-3
    dq, dg = grad(q, k, v, g, b)
    assert np.all(np.isfinite(np.asarray(dq))) and np.all(np.isfinite(np.asarray(dg)))


@pytest.mark.parametrize("backend", ["scan", "chunk"])
def test_malformed_traced_cu_seqlens_poisons_everything(backend):
    q, k, v, g, b = _inputs(T=37)

    def f(q, cu):
        o, S = gated_delta_rule(q, k, v, g, b, cu_seqlens=cu, output_final_state=True, backend=backend, chunk_size=16)
        return o, S

    jf = jax.jit(f)
    jg = jax.jit(jax.grad(lambda q, cu: (f(q, cu)[0] ** 2).sum() + f(q, cu)[1].sum()))
    for bad in ([0, 5, 30], [0, 30, 5]):
        o, S = jf(q, jnp.array(bad))
        assert np.all(np.isnan(np.asarray(o))) and np.all(np.isnan(np.asarray(S)))
        assert np.all(np.isnan(np.asarray(jg(q, jnp.array(bad)))))
    o, S = jf(q, jnp.array([0, 5, 37]))
    assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(S)))
    assert np.all(np.isfinite(np.asarray(jg(q, jnp.array([0, 5, 37])))))


def _step_inputs(B=2, H=2, K=16, V=16, seed=0):
    r = np.random.default_rng(seed)
    q, k = (jnp.asarray(r.standard_normal((B, H, K)), jnp.float32) for _ in range(2))
    v = jnp.asarray(r.standard_normal((B, H, V)), jnp.float32)
    g = -jnp.asarray(r.uniform(0.01, 1, (B, H)), jnp.float32)
    b = jnp.asarray(r.uniform(0.1, 0.9, (B, H)), jnp.float32)
    S = jnp.asarray(r.standard_normal((B, H, K, V)), jnp.float32)
    return q, k, v, g, b, S


def test_pallas_decode_step_is_differentiable():
    """The fused step aliases its state buffer (Pallas cannot differentiate that): its VJP is the
    scan step's at the same inputs, so gradients through decoding work with every backend."""
    from gdn_jax.ops import gated_delta_rule_step

    args = _step_inputs()

    def loss(backend):
        def f(*a):
            o, S = gated_delta_rule_step(*a, backend=backend, use_qk_l2norm=True)
            return jnp.sum(o ** 2) + jnp.sum(jnp.sin(S))
        return jax.grad(f, argnums=tuple(range(6)))

    for gs, gp in zip(loss("scan")(*args), loss("pallas")(*args)):
        assert rel_rms(gp, gs) <= 1e-5


def test_empty_batch_and_empty_heads():
    """B = 0 computes nothing on every backend (no kernel launched); zero heads or channels are a
    ValueError naming the shapes."""
    from gdn_jax.ops import gated_delta_rule_step

    z = lambda *s: jnp.zeros(s, jnp.float32)
    for backend in ("scan", "chunk", "pallas"):
        o, S = gated_delta_rule(z(0, 8, 2, 16), z(0, 8, 2, 16), z(0, 8, 2, 16), z(0, 8, 2), z(0, 8, 2),
                                backend=backend, output_final_state=True)
        assert o.shape == (0, 8, 2, 16) and S.shape == (0, 2, 16, 16)
    o, S = gated_delta_rule_step(z(0, 2, 16), z(0, 2, 16), z(0, 2, 16), z(0, 2), z(0, 2), z(0, 2, 16, 16),
                                 backend="pallas")
    assert o.shape == (0, 2, 16)
    for qs, vs in (((1, 4, 0, 16), (1, 4, 0, 16)), ((1, 4, 2, 0), (1, 4, 2, 16))):
        with pytest.raises(ValueError, match="at least one head and one channel"):
            gated_delta_rule(z(*qs), z(*qs), z(*vs), z(*vs[:3]), z(*vs[:3]))


@pytest.mark.parametrize("scale, exc", [(np.ones(3), TypeError), ("x", TypeError), (True, TypeError),
                                        (jnp.array([0.3]), TypeError), (float("nan"), ValueError),
                                        (float("inf"), ValueError)])
def test_scale_checked_by_op_and_step(scale, exc):
    from gdn_jax.ops import gated_delta_rule_step

    with pytest.raises(exc, match="scale"):
        gated_delta_rule_step(*_step_inputs(), scale=scale)
    with pytest.raises(exc, match="scale"):
        gated_delta_rule(*_inputs(T=8), scale=scale)


def test_step_flag_type():
    from gdn_jax.ops import gated_delta_rule_step

    with pytest.raises(TypeError, match="use_qk_l2norm"):
        gated_delta_rule_step(*_step_inputs(), use_qk_l2norm="yes")


def test_pallas_refuses_any_float64_input():
    """Not only v: a float64 q (or g, initial_state) makes the call float64, which the kernels do
    not take; auto then runs chunk and returns a float64 final state."""
    with jax.enable_x64(True):
        q, k, v, g, b = _inputs(T=8)
        with pytest.raises(NotImplementedError, match="float64"):
            gated_delta_rule(q.astype(jnp.float64), k, v, g, b, backend="pallas")
        _, S = gated_delta_rule(q.astype(jnp.float64), k, v, g, b, backend="auto", output_final_state=True)
        assert S.dtype == jnp.float64


@pytest.mark.parametrize("op", ["gated_delta_rule", "gated_linear_attention", "step"])
def test_positive_concrete_gate_refused(op):
    """g is a log decay (<= 0): a concrete positive entry is a ValueError naming g on every op (the
    scan and the chunked forms used to overflow at different points, or silently grow the state);
    -inf (a reset), 0 and a traced g (cannot be checked) pass."""
    from gdn_jax.ops import gated_delta_rule_step, gated_linear_attention
    q, k, v, g, b = _inputs(T=8)
    call = dict(gated_delta_rule=lambda g: gated_delta_rule(q, k, v, g, b),
                gated_linear_attention=lambda g: gated_linear_attention(q, k, v, g),
                step=lambda g: gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], b[:, 0],
                                                     jnp.zeros((1, 2, 16, 16))))[op]
    with pytest.raises(ValueError, match=r"g is a log-space decay and must be <= 0.*1 positive.*largest 0.25"):
        call(g.at[0, 0, 1].set(0.25))
    ok = g.at[0, 0, 0].set(-jnp.inf).at[0, 0, 1].set(0.0)
    assert jnp.isfinite(call(ok)[0]).all()
    assert call(np.asarray(g)) is not None  # NumPy g: checked the same way, passes
    traced = jax.jit(call)(g.at[0, 0, 1].set(0.25))[0]  # traced: not checkable, runs
    assert traced.shape[-1] == 16


@pytest.mark.parametrize("backend", ["scan", "chunk"])
def test_l2norm_of_huge_keys_is_the_unit_vector(backend):
    """use_qk_l2norm on keys and queries of size ~1e20 (their float32 sum of squares overflows): the
    same output as the same directions at size 1, not the zeros of x * rsqrt(inf); gradients finite,
    and zero keys keep finite gradients too."""
    rng = np.random.default_rng(7)
    q, k = (rng.standard_normal((1, 20, 2, 16)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((1, 20, 2, 16)).astype(np.float32)
    g, beta = -rng.uniform(0.1, 1.0, (1, 20, 2)).astype(np.float32), rng.uniform(0, 1, (1, 20, 2)).astype(np.float32)
    k[0, 3] = 0.0  # a zero key among them
    run = lambda s: gated_delta_rule(jnp.asarray(q * s), jnp.asarray(k * s), v, g, beta, use_qk_l2norm=True,
                                     backend=backend)[0]
    o1, o_big = run(1.0), run(np.float32(1e20))
    assert np.all(np.isfinite(np.asarray(o_big)))
    assert rel_rms(o_big, o1) <= 1e-5, rel_rms(o_big, o1)
    assert rel_rms(o1, reference(q, k, v, g, beta, use_qk_l2norm=True)[0]) <= 5e-3
    for s in (1.0, np.float32(1e20)):
        dk = jax.grad(lambda k: jnp.sum(gated_delta_rule(jnp.asarray(q * s), k, v, g, beta, use_qk_l2norm=True,
                                                         backend=backend)[0]))(jnp.asarray(k * s))
        assert np.all(np.isfinite(np.asarray(dk)))
