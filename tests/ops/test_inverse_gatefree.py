"""The gate-free inverse kernel (``gdn_jax/ops/pallas/inverse_gatefree.py``) in interpret mode on
the CPU against float64 T0 (numpy's inverse of I + A0 per chunk, on the inputs as rounded), and
its Triton lowering (``jax.export`` for CUDA: nothing runs).

Tolerances: float32 output max |T0 - T0_ref| <= 1e-5 (interpret mode runs float32 dots at
HIGHEST: ~2e-7 seen), bfloat16 output <= 2^-8 * max(1, max beta) (its rounding). Inputs: unit-norm
random / repeated / near-repeated keys, beta up to 2, T not a multiple of the chunk, grouped value
heads, packed sequences, a head dim that is not a power of two.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TOL_O, TOL_S, gatefree_betas, gatefree_keys, seed_of
from reference import reference, rel_rms

from gdn_jax.ops.gatefree import gatefree_gated_delta_rule, gatefree_t0
from gdn_jax.ops.pallas.inverse_gatefree import gatefree_inverse

C = 64
BF16, F32 = jnp.bfloat16, jnp.float32






def numpy_t0(k, beta, chunk):
    """float64 T0 [B, H, n, C, C]: numpy's inverse per chunk; k [B, T, Hk, K], beta [B, T, H]."""
    k = np.repeat(np.asarray(k, np.float64), beta.shape[2] // k.shape[2], axis=2)
    beta = np.asarray(beta, np.float64)
    B, T, H, K = k.shape
    n = -(-T // chunk)
    kp = np.zeros((B, n * chunk, H, K))
    kp[:, :T] = k
    bp = np.zeros((B, n * chunk, H))
    bp[:, :T] = beta
    kc = np.moveaxis(kp, 2, 1).reshape(B, H, n, chunk, K)
    bc = np.moveaxis(bp, 2, 1).reshape(B, H, n, chunk)
    A0 = np.tril(bc[..., :, None] * (kc @ np.swapaxes(kc, -1, -2)), -1)
    return np.linalg.inv(np.eye(chunk) + A0)


def rounded(x, dt):
    """x as the kernel reads it (rounded to ``dt``) and its exact float64 value."""
    xj = jnp.asarray(x, dt)
    return xj, np.asarray(xj.astype(F32), np.float64)


@pytest.mark.parametrize("kind,dt,shape", [
    ("near", F32, (2, 150, 1, 2, 32)),  # T not a multiple of C, 2 value heads per key head
    ("repeated", BF16, (1, 128, 2, 2, 64)),
    ("random", BF16, (1, 100, 1, 1, 48)),  # K = 48: zero-padded to 64 in the kernel
])
def test_kernel_matches_float64(kind, dt, shape):
    B, T, Hk, H, K = shape
    rng = np.random.default_rng(seed_of("gatefree kernel", kind, shape))
    kj, k64 = rounded(gatefree_keys(rng, kind, (B, T, Hk, K)), dt)
    bj, b64 = rounded(gatefree_betas(rng, (B, T, H)), dt)
    t0 = gatefree_inverse(kj, bj, platform="interpret")
    assert t0.shape == (B, H, -(-T // C), C, C) and t0.dtype == F32
    ref = numpy_t0(k64, b64, C)
    err = np.abs(np.asarray(t0, np.float64) - ref).max()
    assert err <= 1e-5, err
    # bounded: |T0_ij| <= beta_i prod_l |1 - beta_l |k_l|^2| over the tokens between (at most 1 each for
    # unit norm); keys rounded to bf16 are off unit norm by delta <= ~2^-8, so with beta = 2 on repeated
    # keys each step may grow by 1 + 2 delta: T0 stays below 2 e^{2 C delta} (here ~2.003)
    delta = np.abs(np.sum(k64 ** 2, axis=-1) - 1.0).max()
    assert np.abs(ref).max() <= 2.0 * np.exp(2 * C * delta) + 1e-6


@pytest.mark.parametrize("chunk,diag", [(16, "substitution"), (32, "substitution"), (64, "products")])
def test_kernel_other_chunks_and_diag(chunk, diag):
    """Chunks 16 / 32, and the diagonal blocks by products instead of substitution."""
    rng = np.random.default_rng(seed_of("gatefree kernel chunk", chunk, diag))
    kj, k64 = rounded(gatefree_keys(rng, "near", (1, 70, 1, 32), eps=0.1), F32)
    bj, b64 = rounded(gatefree_betas(rng, (1, 70, 1)), F32)
    t0 = gatefree_inverse(kj, bj, chunk_size=chunk, diag=diag, platform="interpret")
    assert np.abs(np.asarray(t0, np.float64) - numpy_t0(k64, b64, chunk)).max() <= 1e-5


def test_kernel_packed_and_bf16_output():
    """cu_seqlens (traced, under jit): the chunks of the packed layout (every sequence on a chunk
    boundary), as the plain-JAX gatefree_t0 lays them out (itself checked against numpy in
    test_gatefree.py); bfloat16 output within its rounding."""
    rng = np.random.default_rng(seed_of("gatefree kernel packed"))
    T, H, K = 170, 2, 32
    cu = jnp.asarray([0, 37, 37, 120, 170], jnp.int32)
    kj, k64 = rounded(gatefree_keys(rng, "near", (1, T, 1, K), eps=0.05), BF16)
    bj, b64 = rounded(gatefree_betas(rng, (1, T, H)), F32)
    with jax.enable_x64(True):
        ref = np.asarray(gatefree_t0(jnp.asarray(k64), jnp.asarray(b64), chunk_size=C, cu_seqlens=cu))
    # under jit: cu_seqlens traced (the layout's length depends on its static size only)
    t0 = jax.jit(lambda k, b, cu: gatefree_inverse(k, b, cu_seqlens=cu, platform="interpret"))(kj, bj, cu)
    assert t0.shape == ref.shape
    assert np.abs(np.asarray(t0, np.float64) - ref).max() <= 1e-5
    t0b = gatefree_inverse(kj, bj, cu_seqlens=cu, platform="interpret", out_dtype=BF16)
    assert t0b.dtype == BF16
    err = np.abs(np.asarray(t0b.astype(F32), np.float64) - ref).max()
    assert 0 < err <= 2.0**-8 * 2.0, err


def test_kernel_raw_keys_overflow():
    """The kernel shows what the eligibility rule guards against: raw keys of norm 3, nearly
    repeated, beta 0.9 -> T0 (true size ~1e53) overflows float32."""
    rng = np.random.default_rng(seed_of("gatefree kernel overflow"))
    k = jnp.asarray(gatefree_keys(rng, "near", (1, 64, 1, 32), norm=3.0, eps=1e-2), F32)
    t0 = np.asarray(gatefree_inverse(k, jnp.full((1, 64, 1), 0.9, F32), platform="interpret"))
    assert not np.all(np.isfinite(t0)) or np.abs(t0).max() > 1e30


def test_forward_with_kernel_t0():
    """The gate-free forward (plain JAX) fed the kernel's T0 against the float64 oracle."""
    rng = np.random.default_rng(seed_of("gatefree kernel forward"))
    B, T, H, K, V = 1, 100, 2, 32, 16
    q = rng.standard_normal((B, T, H, K))
    k = gatefree_keys(rng, "near", (B, T, H, K), eps=0.3)
    v = rng.standard_normal((B, T, H, V))
    g, beta = rng.uniform(-5.0, 0.0, (B, T, H)), gatefree_betas(rng, (B, T, H))
    o_ref, S_ref = reference(q, k, v, g, beta)
    args = [jnp.asarray(a, F32) for a in (q, k, v, g, beta)]
    t0 = gatefree_inverse(args[1], args[4], platform="interpret")
    o, S = gatefree_gated_delta_rule(*args, output_final_state=True, chunk_size=C, t0=t0)
    assert rel_rms(o, o_ref) <= TOL_O and rel_rms(S, S_ref) <= TOL_S


@pytest.mark.parametrize("dt,diag", [(BF16, "substitution"), (F32, "substitution"), (BF16, "products")])
def test_triton_lowering(dt, diag):
    """platform="gpu" lowers to a Triton custom call on a CPU-only host (GVA, K = 128, T = 200)."""
    sds = [jax.ShapeDtypeStruct((2, 200, 2, 128), dt), jax.ShapeDtypeStruct((2, 200, 4), dt)]
    dis = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    f = lambda k, b: gatefree_inverse(k, b, platform="gpu", diag=diag)
    exp = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=dis)(*sds)
    assert "__gpu$xla.gpu.triton" in exp.mlir_module()
    assert exp.out_avals[0].shape == (2, 4, 4, C, C)


def test_kernel_input_errors():
    k, b = jnp.zeros((1, 64, 2, 32), F32), jnp.zeros((1, 64, 4), F32)
    with pytest.raises(ValueError, match=r"k must have shape \[B, T, Hk, K\]"):
        gatefree_inverse(k[0], b)
    with pytest.raises(ValueError, match="beta must have shape"):
        gatefree_inverse(k, b[:, :32])
    with pytest.raises(ValueError, match="multiple of the key heads"):
        gatefree_inverse(k, b[..., :3])
    with pytest.raises(TypeError, match="k must be float32, bfloat16, float16"):
        with jax.enable_x64(True):
            gatefree_inverse(jnp.zeros((1, 64, 2, 32), jnp.float64), b)
    with pytest.raises(TypeError, match="beta must have a floating dtype"):
        gatefree_inverse(k, b.astype(jnp.int32))
    with pytest.raises(ValueError, match="chunk_size"):
        gatefree_inverse(k, b, chunk_size=48)
    with pytest.raises(ValueError, match="cu_seqlens .* B = 1"):
        gatefree_inverse(jnp.zeros((2, 64, 2, 32)), jnp.zeros((2, 64, 4)), cu_seqlens=jnp.asarray([0, 64]))
    with pytest.raises(NotImplementedError, match="K=512"):
        gatefree_inverse(jnp.zeros((1, 64, 1, 512)), jnp.zeros((1, 64, 1)))
    with pytest.raises(NotImplementedError, match="TPU"):
        gatefree_inverse(k, b, platform="tpu_interpret")
    with pytest.raises(ValueError, match="f32_dot"):
        gatefree_inverse(k, b, f32_dot="fp8")
    with pytest.raises(ValueError, match="diag"):
        gatefree_inverse(k, b, diag="lu")
    with pytest.raises(ValueError, match="num_warps must be a power of two <= 32.*got 3"):
        gatefree_inverse(k, b, num_warps=3)
    with pytest.raises(ValueError, match="num_warps must be a power of two <= 32.*got 64"):
        gatefree_inverse(k, b, num_warps=64)
    with pytest.raises(TypeError, match="num_warps must be an int, got float"):
        gatefree_inverse(k, b, num_warps=4.0)
    with pytest.raises(ValueError, match="num_stages must be a positive int, got 0"):
        gatefree_inverse(k, b, num_stages=0)
