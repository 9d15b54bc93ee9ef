"""The single-token decode op ``gated_delta_rule_step`` against the full op (T = 1 and iterated),
low-precision inputs and argument errors (the op's validator without the token axis)."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax.ops import gated_delta_rule, gated_delta_rule_step


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


@pytest.mark.parametrize("g_pc,b_pc", list(itertools.product([False, True], [False, True])))
def test_step_matches_op_T1_and_iterated(g_pc, b_pc):
    B, T, H, K, V = 2, 12, 2, 8, 6
    ks = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(ks[0], (B, T, H, K))
    k = jax.random.normal(ks[1], (B, T, H, K))
    v = jax.random.normal(ks[2], (B, T, H, V))
    g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (B, T, H) + ((K,) if g_pc else ()))) * 2.0  # strong gates
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H) + ((V,) if b_pc else ())))
    S0 = jax.random.normal(ks[5], (B, H, K, V))
    # T = 1 against the op
    o1, S1 = gated_delta_rule(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], initial_state=S0,
                              output_final_state=True, use_qk_l2norm=True, backend="scan")
    step = jax.jit(lambda *a: gated_delta_rule_step(*a, use_qk_l2norm=True))
    o, S = step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S0)
    assert o.shape == (B, H, V) and S.shape == (B, H, K, V) and S.dtype == jnp.float32
    np.testing.assert_allclose(o, o1[:, 0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(S, S1, rtol=1e-6, atol=1e-6)
    # iterated steps against the op over T tokens (chunked backend where it takes the gate form)
    backend = "scan" if b_pc else "chunk"
    oT, ST = gated_delta_rule(q, k, v, g, beta, initial_state=S0, output_final_state=True,
                              use_qk_l2norm=True, backend=backend, chunk_size=16)
    S, outs = S0, []
    for t in range(T):
        o, S = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S)
        outs.append(o)
    assert rel(jnp.stack(outs, 1), oT) < 1e-5 and rel(S, ST) < 1e-5


def test_step_bf16_inputs_scale_and_errors():
    B, H, K, V = 1, 2, 4, 4
    q = jnp.ones((B, H, K), jnp.bfloat16)
    o, S = gated_delta_rule_step(q, q, jnp.ones((B, H, V), jnp.bfloat16), jnp.zeros((B, H)), jnp.ones((B, H)),
                                 jnp.zeros((B, H, K, V)), scale=1.0)
    assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32
    # beta = 1, empty state: S = k v^T, o = (q.k) v = 4 per channel with scale 1
    np.testing.assert_allclose(np.asarray(o, np.float32), 4.0)
    with pytest.raises(ValueError, match="state must have shape"):
        gated_delta_rule_step(q, q, q, jnp.zeros((B, H)), jnp.ones((B, H)), jnp.zeros((B, H, K, V + 1)))
    with pytest.raises(ValueError, match=r"^g\b.*must have shape"):
        gated_delta_rule_step(q, q, q, jnp.zeros((B, H, 3)), jnp.ones((B, H)), jnp.zeros((B, H, K, V)))
    with pytest.raises(TypeError):
        gated_delta_rule_step(q, q, q, jnp.zeros((B, H), jnp.int32), jnp.ones((B, H)), jnp.zeros((B, H, K, V)))
    with pytest.raises(ValueError, match=r"k must have the shape of q \[B, Hk, K\]"):
        gated_delta_rule_step(q, q[..., :2], q, jnp.zeros((B, H)), jnp.ones((B, H)), jnp.zeros((B, H, K, V)))
    with pytest.raises(ValueError, match=r"beta must have shape \[B, H\]"):
        gated_delta_rule_step(q, q, q, jnp.zeros((B, H)), jnp.ones((B, H, V + 1)), jnp.zeros((B, H, K, V)))
