"""GatedDeltaNet's decode step on the fused decode kernel (``decode_backend="pallas"``, Pallas
interpret mode on CPU) against the plain XLA step (``"scan"``), the bfloat16-state cache and the
decode options' checks.

Tolerances (RMS-relative): fused vs scan layer outputs and states 1e-5 (float32; measured ~1e-7:
the same formulas, summed in another order); a bfloat16 state moves three decode steps' outputs by
at most 2e-2 from the float32-state layer's (measured 2.7e-3, the state 2.8e-3: it is rounded to bf16
once per token).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax.layers import GatedDeltaNet, KimiDeltaAttention
from gdn_jax.models import LMConfig

BF16 = jnp.bfloat16


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


def _cache(layer, B, seed=0):
    """A cache of ``layer`` holding random state and conv values (as after some prompt), no prefill."""
    r = np.random.default_rng(seed)  # numpy: no eager jax.random compiles
    c = layer.init_cache(B)
    return type(c)(*(None if a is None else jnp.asarray(r.normal(size=a.shape) * (0.3 if i == 0 else 1.0), a.dtype)
                     for i, a in enumerate(c)))


def _x(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _decode(layer, x, cache):
    """Decode every token of x ``[B, T, d]`` from ``cache``, one jitted step (cache donated) per token."""
    graphdef, state = nnx.split(layer)
    step = jax.jit(lambda st, xt, c: nnx.merge(graphdef, st).decode(xt, c), donate_argnums=2)
    ys = []
    for t in range(x.shape[1]):
        y, cache = step(state, x[:, t:t + 1], cache)
        ys.append(y)
    return jnp.concatenate(ys, 1), cache


@pytest.mark.parametrize("kw", [dict(), dict(decay_per_channel=True, beta_per_channel=True, num_v_heads=4)])
def test_fused_layer_decode_matches_scan(kw):
    """Per-head gates; per-key-channel decay + per-value-channel beta + grouped value heads. (The scan
    step's parity with the full-sequence call: tests/models/test_inference.py.)"""
    x = _x((2, 3, 32), 1)
    ys = {}
    for be in ("scan", "pallas"):
        layer = GatedDeltaNet(32, 2, decode_backend=be, rngs=nnx.Rngs(0), **kw)
        ys[be] = _decode(layer, x, _cache(layer, 2))
    (ya, ca), (yb, cb) = ys["scan"], ys["pallas"]
    assert yb.shape == (2, 3, 32) and cb.state.dtype == jnp.float32
    assert rel(yb, ya) < 1e-5 and rel(cb.state, ca.state) < 1e-5
    for a, b in zip(ca[1:], cb[1:]):  # conv states: the same ops on both paths
        np.testing.assert_array_equal(a, b)


def test_bf16_state_cache():
    """state_dtype=bfloat16: init_cache and both decode backends keep the state in bf16 (prefill
    too); the outputs stay within 2e-2 of the float32-state layer's; a cache in the other dtype is
    refused."""
    x = _x((2, 3, 32), 2)
    f32 = GatedDeltaNet(32, 2, rngs=nnx.Rngs(0))
    ref, ref_cache = _decode(f32, x, _cache(f32, 2))
    for be in ("scan", "pallas"):
        layer = GatedDeltaNet(32, 2, decode_backend=be, state_dtype=BF16, rngs=nnx.Rngs(0))
        cache = _cache(layer, 2)
        assert cache.state.dtype == BF16 and cache.conv_q.dtype == jnp.float32
        y, cache = _decode(layer, x, cache)
        assert cache.state.dtype == BF16
        assert rel(y, ref) < 2e-2 and rel(cache.state, ref_cache.state) < 2e-2
    assert jax.eval_shape(lambda: layer.prefill(x)[1]).state.dtype == BF16
    with pytest.raises(TypeError, match="state_dtype is bfloat16"):
        layer.decode(x[:, :1], f32.init_cache(2))
    kda = KimiDeltaAttention(32, 2, decode_backend="pallas", state_dtype="bfloat16", rngs=nnx.Rngs(0))
    assert jax.eval_shape(lambda: kda.decode(x[:, :1], kda.init_cache(2))[1]).state.dtype == BF16


def test_decode_options_checked_when_built():
    with pytest.raises(ValueError, match="decode_backend must be one of"):
        GatedDeltaNet(32, 2, decode_backend="fused", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="state_dtype must be one of"):
        GatedDeltaNet(32, 2, state_dtype=jnp.float16, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="state_dtype must be a floating dtype"):
        LMConfig(d_model=32, num_heads=2, state_dtype="int8")
    with pytest.raises(ValueError, match=r"decode_backend='pallas' .*head dim K=24"):
        GatedDeltaNet(48, 2, decode_backend="pallas", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="mixer 'gla' keeps a float32 state"):
        LMConfig(d_model=32, num_heads=2, mixer="gla", state_dtype="bfloat16")
    LMConfig(d_model=48, num_heads=2, mixer="attention", decode_backend="pallas")  # no delta-rule layer: no kernel check


def test_apply_rows_runs_one_row_as_two_and_leaves_batches_alone():
    """``gdn_jax.layers._rows.apply_rows``: a single row [1, 1, d] is projected as two rows (the
    second zero; what the wrapped function sees is recorded) and returns exactly the one-row
    product; a batch of 3 rows passes through unpadded. Against a float64 product, 1e-6."""
    from gdn_jax.layers._rows import apply_rows

    rng = np.random.default_rng(7)
    w = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    seen = []

    def f(x):
        seen.append(x.shape)
        return jnp.dot(x, w, precision="highest")

    for shape, padded in (((1, 1, 16), (2, 1, 16)), ((1, 16), (2, 16)), ((3, 1, 16), (3, 1, 16))):
        x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        y = jax.jit(lambda x: apply_rows(f, x))(x)
        ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        assert seen[-1] == padded and y.shape == shape[:-1] + (8,)
        assert np.max(np.abs(np.asarray(y, np.float64) - ref)) < 1e-6 * np.max(np.abs(ref))
