"""The gate-free identity T = T0 * D (``gdn_jax/ops/gatefree.py``), its eligibility rule
(``gatefree_covers``) and the forward written with it, against independent float64 references.

* identity: in float64, T0 * D equals the gated inverse that ``backend="chunk"`` forms
  (``gdn_jax/ops/chunk.py``: decay_gram_head + unit_lower_inverse) to 1e-12 absolute (T's
  diagonal is 1), and T0 equals numpy's inverse of I + A0; with beta up to 2, per-step log decays
  down to -5, random, repeated and near-repeated unit-norm keys; |T0| <= max(1, max beta);
* eligibility: raw keys of norm 3, near-repeated, beta 0.9, g -1: T0 in float32 overflows while
  the float32 gated inverse stays finite and accurate -- the reason the gate-free path takes
  unit-norm keys only;
* forward: ``gatefree_gated_delta_rule`` against ``tests/reference.py`` (float64 to 1e-10; float32
  within the suite's TOL_O / TOL_S), with initial / final state, ``cu_seqlens``, grouped value
  heads, T not a multiple of the chunk, strong gates, beta up to 2; one float64 gradient check.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TOL_O, TOL_S, gatefree_betas, gatefree_keys, seed_of
from reference import reference, reference_grads, rel_rms

from gdn_jax.ops._common import GateForms
from gdn_jax.ops.chunk import decay_gram_head, to_chunks, unit_lower_inverse
from gdn_jax.ops.gatefree import decay_mask, gatefree_gated_delta_rule, gatefree_t0
from gdn_jax.ops.pallas.inverse_gatefree import gatefree_covers

C = 64






def gated_inverse(k, beta, g, chunk, cu_seqlens=None):
    """The gated T = (I + A)^-1 exactly as backend="chunk" forms it (chunk.chunk_forward)."""
    (kc, bc, gc), _, _, _ = to_chunks((k, beta, g), cu_seqlens, chunk)
    gam = jnp.cumsum(gc, axis=3)
    A = decay_gram_head(kc * bc[..., None], kc, gam)
    strict = jnp.arange(chunk)[:, None] > jnp.arange(chunk)[None, :]
    return unit_lower_inverse(jnp.where(strict, A, 0.0))


def numpy_t0(k, beta, chunk):
    """T0 per chunk by numpy's float64 inverse (no cu_seqlens; k [B,T,H,K] on the value heads)."""
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


@pytest.mark.parametrize("kind", ["random", "repeated", "near"])
def test_identity_float64(kind):
    """T0 * D = the chunk backend's gated inverse to 1e-12, strong gates and beta up to 2."""
    rng = np.random.default_rng(seed_of("gatefree identity", kind))
    B, T, H, K = 2, 150, 2, 32  # T not a multiple of C: a padded last chunk
    k, beta = gatefree_keys(rng, kind, (B, T, H, K)), gatefree_betas(rng, (B, T, H))
    g = rng.uniform(-5.0, 0.0, (B, T, H))  # strong gates: |gamma_i - gamma_j| up to ~300 in a chunk
    with jax.enable_x64(True):
        kj, bj, gj = (jnp.asarray(a, jnp.float64) for a in (k, beta, g))
        T0 = np.asarray(gatefree_t0(kj, bj, chunk_size=C))
        D = np.asarray(decay_mask(gj, chunk_size=C))
        Tg = np.asarray(gated_inverse(kj, bj, gj, C))
    assert T0.shape == Tg.shape == (B, H, 3, C, C)
    np.testing.assert_array_equal(np.triu(D, 1), 0.0)
    assert np.all(np.diagonal(D, axis1=-2, axis2=-1) == 1.0) and D.max() <= 1.0
    err = np.abs(T0 * D - Tg).max()
    assert err <= 1e-12, err
    assert np.abs(T0 - numpy_t0(k, beta, C)).max() <= 1e-12
    # T0_ij = -beta_i k_i^T (prod of the transitions between j and i) k_j beta_j-free: |T0| <= max(1, beta)
    assert np.abs(T0).max() <= 2.0 + 1e-9, np.abs(T0).max()
    assert np.abs(Tg).max() <= 2.0 + 1e-9


def test_identity_packed_float64():
    """With cu_seqlens both sides use the packed chunk layout: the identity holds chunk by chunk."""
    rng = np.random.default_rng(seed_of("gatefree identity packed"))
    T, H, K = 170, 2, 16
    cu = jnp.asarray([0, 37, 37, 120, 170], jnp.int32)
    k, beta = gatefree_keys(rng, "near", (1, T, H, K), eps=0.05), gatefree_betas(rng, (1, T, H))
    g = rng.uniform(-5.0, 0.0, (1, T, H))
    with jax.enable_x64(True):
        kj, bj, gj = (jnp.asarray(a, jnp.float64) for a in (k, beta, g))
        T0 = np.asarray(gatefree_t0(kj, bj, chunk_size=C, cu_seqlens=cu))
        D = np.asarray(decay_mask(gj, chunk_size=C, cu_seqlens=cu))
        Tg = np.asarray(gated_inverse(kj, bj, gj, C, cu))
    assert np.abs(T0 * D - Tg).max() <= 1e-12
    # the packed layout: every sequence starts a chunk; each chunk's T0 is that of its own tokens
    pieces = [(0, 37), (37, 101), (101, 120), (120, 170)]  # chunks 0 .. 3; chunks 4 .. 6 are padding
    for i, (s, e) in enumerate(pieces):
        np.testing.assert_allclose(T0[:, :, i], numpy_t0(k[:, s:e], beta[:, s:e], C)[:, :, 0], atol=1e-12)
    np.testing.assert_array_equal(T0[:, :, len(pieces):], np.broadcast_to(np.eye(C), T0[:, :, len(pieces):].shape))


def test_raw_keys_overflow_t0_but_not_the_gated_inverse():
    """Why the gate-free path takes unit-norm keys only: raw keys of norm 3, nearly repeated,
    beta 0.9, g = -1. Then T0_ij grows like |1 - beta |k|^2|^(i-j) = 7.1^63 ~ 1e53 (float64 shows
    it is the true value, not rounding), beyond float32's 3.4e38: the float32 T0 is inf / NaN. The
    gated inverse is damped by e^-1 per step (|(1 - 8.1) e^-1|^63 ~ 1e26): finite in float32, and
    accurate. The same directions at norm 1 give a bounded T0 in float32."""
    rng = np.random.default_rng(seed_of("gatefree overflow"))
    B, T, H, K = 1, 64, 1, 32
    k = gatefree_keys(rng, "near", (B, T, H, K), norm=3.0, eps=1e-2)
    beta = np.full((B, T, H), 0.9)
    g = np.full((B, T, H), -1.0)
    with jax.enable_x64(True):
        t0_64 = np.asarray(gatefree_t0(jnp.asarray(k), jnp.asarray(beta), chunk_size=C))
        tg_64 = np.asarray(gated_inverse(jnp.asarray(k), jnp.asarray(beta), jnp.asarray(g), C))
    assert np.abs(t0_64).max() > 1e45  # the exact T0 is out of float32's range
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    t0_32 = np.asarray(gatefree_t0(f32(k), f32(beta), chunk_size=C))
    tg_32 = np.asarray(gated_inverse(f32(k), f32(beta), f32(g), C))
    assert not np.all(np.isfinite(t0_32)) or np.abs(t0_32).max() > 1e30
    assert np.all(np.isfinite(tg_32))
    assert np.abs(tg_32 - tg_64).max() <= 1e-4 * np.abs(tg_64).max()
    # the same directions, unit norm: T0 bounded by max(1, beta), float32 close to float64
    ku = k / 3.0
    with jax.enable_x64(True):
        tu_64 = np.asarray(gatefree_t0(jnp.asarray(ku), jnp.asarray(beta), chunk_size=C))
    tu_32 = np.asarray(gatefree_t0(f32(ku), f32(beta), chunk_size=C))
    assert np.abs(tu_64).max() <= 1.0 + 1e-9
    assert np.abs(tu_32 - tu_64).max() <= 1e-5


def test_gatefree_covers():
    head = GateForms(g_per_channel=False, beta_per_channel=False)
    ok = dict(chunk_size=64, dtype=jnp.bfloat16, use_qk_l2norm=True)
    assert gatefree_covers(head, **ok) is None
    assert gatefree_covers(head, **dict(ok, use_qk_l2norm=False, keys_unit_norm=True)) is None
    assert gatefree_covers(head, **dict(ok, dtype=jnp.float32)) is None
    assert "unit-norm" in gatefree_covers(head, **dict(ok, use_qk_l2norm=False))
    assert "per-key-channel g" in gatefree_covers(GateForms(True, False), **ok)
    assert "per-value-channel beta" in gatefree_covers(GateForms(False, True), **ok)
    assert "chunk_size=32" in gatefree_covers(head, **dict(ok, chunk_size=32))
    assert "float64" in gatefree_covers(head, **dict(ok, dtype=jnp.float64))


def _inputs(seed, B, T, Hk, H, K, V, N=None):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, Hk, K))
    k = gatefree_keys(rng, "near", (B, T, Hk, K), eps=0.3)  # correlated keys
    v = rng.standard_normal((B, T, H, V))
    g = rng.uniform(-5.0, 0.0, (B, T, H))
    beta = gatefree_betas(rng, (B, T, H))
    S0 = 0.5 * rng.standard_normal((B if N is None else N, H, K, V))
    return q, k, v, g, beta, S0


@pytest.mark.parametrize("case", ["plain", "packed_gva"])
def test_forward_matches_reference(case):
    """The gate-free forward against the float64 oracle: float64 to 1e-10, float32 to TOL_O / TOL_S."""
    if case == "plain":
        x = _inputs(seed_of("gatefree fwd", case), 2, 150, 2, 2, 32, 16)
        cu = None
    else:  # packed documents crossing chunks, an empty one, grouped value heads (2 value heads per key head)
        cu = np.asarray([0, 50, 50, 131, 200], np.int32)
        x = _inputs(seed_of("gatefree fwd", case), 1, 200, 1, 2, 32, 16, N=4)
    q, k, v, g, beta, S0 = x
    o_ref, S_ref = reference(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu)
    kw = dict(initial_state=None, output_final_state=True, cu_seqlens=None if cu is None else jnp.asarray(cu),
              chunk_size=C)
    with jax.enable_x64(True):
        args = [jnp.asarray(a, jnp.float64) for a in x]
        o, S = gatefree_gated_delta_rule(*args[:5], **dict(kw, initial_state=args[5]))
        assert rel_rms(o, o_ref) <= 1e-10 and rel_rms(S, S_ref) <= 1e-10
    args = [jnp.asarray(a, jnp.float32) for a in x]
    o, S = gatefree_gated_delta_rule(*args[:5], **dict(kw, initial_state=args[5]))
    assert o.dtype == jnp.float32 and S.shape == S_ref.shape
    assert rel_rms(o, o_ref) <= TOL_O and rel_rms(S, S_ref) <= TOL_S, (rel_rms(o, o_ref), rel_rms(S, S_ref))


def test_forward_l2norm_and_gradients_float64():
    """use_qk_l2norm with raw keys of norm ~3*sqrt(K) (normalised inside: T0 bounded), and the
    gradients through T0 and D by autodiff against the float64 reference's."""
    rng = np.random.default_rng(seed_of("gatefree grads"))
    B, T, H, K, V = 1, 80, 1, 16, 16
    q, k, v = 3 * rng.standard_normal((B, T, H, K)), 3 * rng.standard_normal((B, T, H, K)), rng.standard_normal(
        (B, T, H, V))
    g, beta = rng.uniform(-3.0, 0.0, (B, T, H)), gatefree_betas(rng, (B, T, H))
    do = rng.standard_normal((B, T, H, V))
    ref = reference_grads(q, k, v, g, beta, use_qk_l2norm=True, do=do)
    with jax.enable_x64(True):
        args = [jnp.asarray(a, jnp.float64) for a in (q, k, v, g, beta)]

        def loss(*a):
            o, _ = gatefree_gated_delta_rule(*a, use_qk_l2norm=True, chunk_size=32)
            return jnp.sum(o * do)

        grads = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(*args)
    for name, gr in zip(("q", "k", "v", "g", "beta"), grads):
        assert rel_rms(gr, ref[name]) <= 1e-9, (name, rel_rms(gr, ref[name]))


def test_forward_rejects_what_does_not_factor():
    q, k, v, g, beta, _ = (jnp.asarray(a, jnp.float32) for a in _inputs(0, 1, 16, 1, 1, 16, 16))
    with pytest.raises(NotImplementedError, match="per-head g and beta"):
        gatefree_gated_delta_rule(q, k, v, jnp.repeat(g[..., None], 16, -1), beta)
    with pytest.raises(ValueError, match="t0 must have shape"):
        gatefree_gated_delta_rule(q, k, v, g, beta, t0=jnp.zeros((1, 1, 2, C, C)))
    with pytest.raises(ValueError, match="beta must have shape"):
        gatefree_t0(k, beta[:, :8])
