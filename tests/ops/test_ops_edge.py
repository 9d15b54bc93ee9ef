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
