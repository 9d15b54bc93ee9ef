"""Grouped value heads (GVA; Qwen3-Next / Qwen3.5): q, k ``[B,T,Hk,K]``, v ``[B,T,H,V]`` with
H = group * Hk; value head j reads key head j // group. Every backend against the float64
reference (which repeats q, k with numpy and sums dq, dk over each group), forward and all
gradients, group sizes 1, 2 and 4, with initial state and packed sequences; the step op; errors.
Tolerances: ``tests/conftest.py``."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BF16, F32, GRAD_NAMES, TOL_GATE, TOL_GRAD, TOL_O, TOL_S, check_close, make_inputs, seed_of
from reference import reference, reference_grads

from gdn_jax.ops import KernelConfig, TritonTuning, gated_delta_rule, gated_delta_rule_step


def gva_inputs(seed, B, T, Hk, group, K, V, *, dtype=F32, N=None, g_per_key=False):
    """make_inputs on the value heads, then q, k drawn again on the Hk key heads."""
    x = make_inputs(seed, B, T, Hk * group, K, V, init=True, dtype=dtype, N=N, g_per_key=g_per_key)
    rng = np.random.default_rng(seed + 1)
    for n in ("q", "k"):
        a = rng.standard_normal((B, T, Hk, K))
        x[n] = jnp.asarray(a / np.linalg.norm(a, axis=-1, keepdims=True), dtype)
    return x


def run(x, backend, *, cu=None, chunk_size=16, kernel_config=None):
    def loss(q, k, v, g, b, s):
        o, S = gated_delta_rule(q, k, v, g, b, initial_state=s, output_final_state=True, cu_seqlens=cu,
                                backend=backend, chunk_size=chunk_size, kernel_config=kernel_config)
        return jnp.sum(o.astype(F32) * x.do) + jnp.sum(S * x.dS), (o, S)

    grads, (o, S) = jax.jit(jax.grad(loss, argnums=tuple(range(6)), has_aux=True))(
        x.q, x.k, x.v, x.g, x.beta, x.S0)
    return o, S, dict(zip(GRAD_NAMES, grads))


def check(x, got, *, cu=None):
    o, S, gr = got
    args = (x.q, x.k, x.v, x.g, x.beta)
    ro, rS = reference(*args, initial_state=x.S0, cu_seqlens=cu)
    rg = reference_grads(*args, initial_state=x.S0, cu_seqlens=cu, do=x.do, dS=x.dS)
    for n in ("q", "k"):
        assert gr[n].shape == x[n].shape  # dq, dk on the key heads
    pairs = {"o": (o, ro, TOL_O), "S": (S, rS, TOL_S)}
    pairs.update({"d" + n: (gr[n], rg[n], TOL_GATE if n in ("g", "beta") else TOL_GRAD) for n in GRAD_NAMES})
    return check_close(pairs)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("backend", ["scan", "chunk", "pallas"])
def test_gva_vs_reference(backend, group):
    x = gva_inputs(seed_of("gva", backend, group), 2, 45, 2, group, 16, 32)
    check(x, run(x, backend))


@pytest.mark.parametrize("backend", ["scan", "chunk", "pallas"])
def test_gva_packed_sequences(backend):
    cu = [0, 13, 13, 40]
    x = gva_inputs(seed_of("gva-packed", backend), 1, 40, 2, 2, 16, 16, N=3)
    check(x, run(x, backend, cu=jnp.asarray(cu, jnp.int32)), cu=cu)


def test_gva_tpu_layout_packed():
    """Grouped value heads with packed sequences on the TPU layout (streamed state passes)."""
    cu = [0, 13, 13, 40]
    x = gva_inputs(seed_of("gva-tpu-packed"), 1, 40, 1, 2, 16, 16, N=3)
    check(x, run(x, "pallas", cu=jnp.asarray(cu, jnp.int32), kernel_config=KernelConfig(platform="tpu_interpret")),
          cu=cu)


@pytest.mark.parametrize("kernel_config", [KernelConfig(platform="tpu_interpret"),
                                           KernelConfig(triton=TritonTuning(fuse_output=False, merge_state=True,
                                                                            bv_state=16)),
                                           KernelConfig(triton=TritonTuning(bk_grad=16, bv_grad=16))],
                         ids=["tpu-layout", "unfused-merged", "grad-k-blocks"])
def test_gva_pallas_kernel_variants(kernel_config):
    """The key-head index maps in the TPU (head-major) layout, the unfused forward with merged
    backward state passes, and the K-split gradient kernel (dq, dk per value head, summed)."""
    x = gva_inputs(seed_of("gva-variants", repr(kernel_config)), 1, 40, 2, 2, 32, 32)
    check(x, run(x, "pallas", kernel_config=kernel_config))


def test_gva_tpu_layout_under_x64():
    """jax_enable_x64 on: the head-major (TPU) layout's key-head index map keeps its int32 arithmetic
    (a Python int constant became int64 and lax.div refused the mix, 2026-12-05); float32 inputs,
    forward and gradients against the float64 reference."""
    x = gva_inputs(seed_of("gva-x64"), 1, 40, 1, 2, 16, 16)
    with jax.enable_x64(True):
        got = run(x, "pallas", kernel_config=KernelConfig(platform="tpu_interpret"))
    assert got[0].dtype == F32
    check(x, got)


def test_gva_pallas_bf16_and_per_channel_decay_chunk():
    x = gva_inputs(seed_of("gva-bf16"), 1, 50, 2, 2, 64, 64, dtype=BF16)
    check(x, run(x, "pallas", chunk_size=32))
    xc = gva_inputs(seed_of("gva-kda"), 1, 30, 1, 2, 16, 16, g_per_key=True)
    check(xc, run(xc, "chunk"))


def test_gva_equals_repeated_heads():
    """Grouping is exactly the one-to-one op on q, k repeated in repeat_interleave order (and not
    in tile order: a test of the head order that can fail)."""
    x = gva_inputs(seed_of("gva-repeat"), 1, 20, 2, 2, 16, 16)
    o, S = gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=x.S0, output_final_state=True,
                            backend="chunk", chunk_size=16)
    rep = lambda a: jnp.repeat(a, 2, axis=2)
    o_r, S_r = gated_delta_rule(rep(x.q), rep(x.k), x.v, x.g, x.beta, initial_state=x.S0, output_final_state=True,
                                backend="chunk", chunk_size=16)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_r), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(S), np.asarray(S_r), rtol=1e-6, atol=1e-6)
    tile = lambda a: jnp.tile(a, (1, 1, 2, 1))
    o_t, _ = gated_delta_rule(tile(x.q), tile(x.k), x.v, x.g, x.beta, initial_state=x.S0, output_final_state=True,
                              backend="chunk", chunk_size=16)
    assert float(jnp.max(jnp.abs(o_t - o))) > 1e-2


def test_gva_step_op():
    x = gva_inputs(seed_of("gva-step"), 2, 6, 2, 2, 16, 8)
    o, S = gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=x.S0, output_final_state=True, backend="scan")
    St, outs = x.S0, []
    for t in range(6):
        ot, St = gated_delta_rule_step(x.q[:, t], x.k[:, t], x.v[:, t], x.g[:, t], x.beta[:, t], St)
        outs.append(ot)
    np.testing.assert_allclose(np.asarray(jnp.stack(outs, 1)), np.asarray(o), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(St), np.asarray(S), rtol=1e-5, atol=1e-6)


def test_gva_errors():
    x = gva_inputs(seed_of("gva-err"), 1, 8, 2, 2, 16, 16)
    v3 = jnp.zeros((1, 8, 3, 16))
    g3, b3 = jnp.zeros((1, 8, 3)), jnp.ones((1, 8, 3))
    with pytest.raises(ValueError, match="multiple of the key heads"):
        gated_delta_rule(x.q, x.k, v3, g3, b3)
    with pytest.raises(ValueError, match="multiple of the key heads"):
        gated_delta_rule_step(x.q[:, 0], x.k[:, 0], v3[:, 0], g3[:, 0], b3[:, 0], jnp.zeros((1, 3, 16, 16)))
    with pytest.raises(ValueError, match=r"beta must have shape \[B, T, H\] = \(1, 8, 4\)"):
        gated_delta_rule(x.q, x.k, x.v, x.g, x.beta[:, :, :2])  # gates live on the value heads
    with pytest.raises(ValueError, match="initial_state"):
        gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=jnp.zeros((1, 2, 16, 16)))
