"""GatedDeltaNet layer, ShortConv, Attention and the LM: shapes, dtypes, init, packing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax.layers import Attention, GatedDeltaNet, ShortConv, inverse_softplus
from gdn_jax.models import LM, LMConfig, MIXERS, register_mixer


def _x(shape, seed=0, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"use_short_conv": False, "decay": "sigmoid"},
        {"decay_per_channel": True, "allow_neg_eigval": True},
        {"beta_per_channel": True, "value_head_dim": 24},
    ],
)
def test_gdn_layer_shape_dtype(kw):
    layer = GatedDeltaNet(32, 2, 16, rngs=nnx.Rngs(0), **kw)
    x = _x((2, 19, 32))
    y = layer(x)
    assert y.shape == x.shape and y.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(y)))
    g, beta = layer.gates(x)
    assert bool(jnp.all(g <= 0))
    hi = 2.0 if kw.get("allow_neg_eigval") else 1.0
    assert bool(jnp.all((beta > 0) & (beta < hi)))
    assert g.shape == ((2, 19, 2, 16) if kw.get("decay_per_channel") else (2, 19, 2))
    assert beta.shape == ((2, 19, 2, 24) if kw.get("beta_per_channel") else (2, 19, 2))


def test_gdn_layer_bf16():
    layer = GatedDeltaNet(32, 2, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    y = layer(_x((1, 40, 32), dtype=jnp.bfloat16))
    assert y.dtype == jnp.bfloat16 and y.shape == (1, 40, 32)
    assert bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))


def test_gdn_init():
    layer = GatedDeltaNet(64, 8, rngs=nnx.Rngs(3))
    A = np.exp(np.asarray(layer.A_log[...]))
    assert np.all(np.isfinite(np.asarray(layer.A_log[...])))
    assert np.all((A >= 1e-4) & (A <= 16.0))
    dt = np.asarray(jax.nn.softplus(layer.dt_bias[...]))
    assert np.all((dt >= 1e-3 * 0.999) & (dt <= 0.1 * 1.001))
    # inverse_softplus is the inverse of softplus
    z = jnp.array([1e-3, 0.05, 0.1, 2.0])
    np.testing.assert_allclose(jax.nn.softplus(inverse_softplus(z)), z, rtol=1e-5)
    # short conv starts near identity: last tap (current token) is 1
    np.testing.assert_array_equal(np.asarray(layer.q_conv.weight[...][-1]), 1.0)


def test_gdn_layer_backends_agree():
    x = _x((2, 45, 32), seed=1)
    outs = {}
    for be in ("scan", "chunk"):
        layer = GatedDeltaNet(32, 2, rngs=nnx.Rngs(0), backend=be, chunk_size=16)
        outs[be] = np.asarray(layer(x))
    err = np.sqrt(np.mean((outs["scan"] - outs["chunk"]) ** 2)) / np.sqrt(np.mean(outs["scan"] ** 2))
    assert err < 1e-4


@pytest.mark.parametrize("backend", ["scan", "chunk"])
def test_gdn_layer_packed_equals_separate(backend):
    """Packed sequences (cu_seqlens) at the layer level: the recurrence AND the short conv restart."""
    layer = GatedDeltaNet(32, 2, rngs=nnx.Rngs(0), backend=backend, chunk_size=16)
    x = _x((1, 50, 32), seed=2)
    cu = jnp.array([0, 7, 30, 50])
    y = layer(x, cu_seqlens=cu)
    for a, b in zip([0, 7, 30], [7, 30, 50]):
        ys = layer(x[:, a:b])
        np.testing.assert_allclose(np.asarray(y[:, a:b]), np.asarray(ys), rtol=1e-4, atol=1e-5)
    # without the reset, the second segment would differ
    assert not np.allclose(np.asarray(layer(x)[:, 7:30]), np.asarray(y[:, 7:30]), atol=1e-4)


def test_short_conv_causal_and_cache():
    conv = ShortConv(8, 4, rngs=nnx.Rngs(0))
    x = _x((2, 12, 8), seed=3)
    y = conv(x)
    # causal: changing a future token does not change the past
    x2 = x.at[:, 6].add(10.0)
    np.testing.assert_allclose(np.asarray(conv(x2)[:, :6]), np.asarray(y[:, :6]), rtol=1e-6)
    # streaming with the cache gives the same outputs
    cache = jnp.zeros((2, 3, 8))
    y1, cache = conv(x[:, :5], cache=cache)
    y2, cache = conv(x[:, 5:], cache=cache)
    np.testing.assert_allclose(np.asarray(jnp.concatenate([y1, y2], 1)), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_attention_causal_and_packed():
    att = Attention(32, 4, rngs=nnx.Rngs(0))
    x = _x((1, 30, 32), seed=4)
    y = att(x)
    assert y.shape == x.shape
    np.testing.assert_allclose(np.asarray(att(x.at[:, 20].add(5.0))[:, :20]), np.asarray(y[:, :20]), rtol=1e-5, atol=1e-6)
    cu = jnp.array([0, 12, 30])
    yp = att(x, cu_seqlens=cu)
    np.testing.assert_allclose(np.asarray(yp[:, 12:]), np.asarray(att(x[:, 12:])), rtol=1e-4, atol=1e-5)
    gated = Attention(32, 4, qk_norm=True, output_gate=True, rope_fraction=0.25, rngs=nnx.Rngs(0))
    assert gated(x).shape == x.shape and gated.rot_dim == 2


@pytest.mark.parametrize(
    "cfg",
    [
        LMConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2),
        LMConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, mixer="attention", mlp_ratio=2.0),
        LMConfig(vocab_size=64, d_model=32, num_layers=4, num_heads=2, hybrid_every=4, hybrid_mixer="gated_attention"),
    ],
)
def test_lm_shapes(cfg):
    model = LM(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 17)), jnp.int32)
    logits = model(tokens)
    assert logits.shape == (2, 17, 64) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_lm_hybrid_pattern_and_tied_head():
    cfg = LMConfig(vocab_size=64, d_model=32, num_layers=8, num_heads=2, hybrid_every=4)
    assert cfg.layer_mixers() == ("gdn", "gdn", "gdn", "attention") * 2
    model = LM(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    names = ["/".join(map(str, p)) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    assert not any("head" in n or "lm_head" in n for n in names)  # the head is the embedding


def test_lm_bf16_and_errors():
    cfg = LMConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, dtype="bfloat16")
    model = LM(cfg, rngs=nnx.Rngs(0))
    out = model(jnp.zeros((1, 9), jnp.int32))
    assert out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))
    with pytest.raises(TypeError, match="tokens must be an integer array"):  # a dtype error: TypeError
        model(jnp.zeros((1, 9), jnp.float32))
    with pytest.raises(ValueError, match=r"tokens must be an integer array \[B, T\], got shape \(9,\)"):
        model(jnp.zeros((9,), jnp.int32))
    with pytest.raises(ValueError, match="unknown mixer"):
        LM(LMConfig(mixer="nope"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="x must have shape"):
        GatedDeltaNet(32, 2, rngs=nnx.Rngs(0))(jnp.zeros((1, 4, 16)))


def test_register_mixer_pluggable():
    @register_mixer("identity_test")
    def _f(cfg, i, rngs):
        class Zero(nnx.Module):
            def __call__(self, x, *, cu_seqlens=None):
                return jnp.zeros_like(x)

        return Zero()

    try:
        m = LM(LMConfig(vocab_size=16, d_model=8, num_layers=1, num_heads=1, mixer="identity_test"), rngs=nnx.Rngs(0))
        assert m(jnp.zeros((1, 3), jnp.int32)).shape == (1, 3, 16)
    finally:
        MIXERS.pop("identity_test")


def test_lm_token_range_checked():
    model = LM(LMConfig(vocab_size=16, d_model=8, num_layers=1, num_heads=1), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="vocab_size=16"):
        model(jnp.full((1, 3), 16, jnp.int32))
    with pytest.raises(ValueError, match="tokens must be in"):
        model(jnp.full((1, 3), -1, jnp.int32))


def test_caches_live_beside_their_layers():
    """Nothing in gdn_jax/layers imports gdn_jax/inference; the inference package re-exports the caches."""
    import ast
    import pathlib

    import gdn_jax.inference
    import gdn_jax.layers

    for f in sorted(pathlib.Path(gdn_jax.layers.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            assert not any("inference" in n for n in names), (f.name, names)
    assert gdn_jax.inference.GDNCache is gdn_jax.layers.GDNCache
    assert gdn_jax.inference.KVCache is gdn_jax.layers.KVCache


def test_kernel_config_reaches_the_op():
    """GatedDeltaNet / LMConfig pass a KernelConfig to the Pallas op (same numbers as the
    defaults: the options change nothing beyond rounding) and reject it where it cannot apply."""
    from gdn_jax.ops import KernelConfig, TritonTuning

    x = _x((1, 40, 32))
    kc = KernelConfig(fwd_chunk=16, triton=TritonTuning(fuse_output=False, bv_out=16))
    a = GatedDeltaNet(32, 2, backend="pallas", chunk_size=32, rngs=nnx.Rngs(0))
    b = GatedDeltaNet(32, 2, backend="pallas", chunk_size=32, kernel_config=kc, rngs=nnx.Rngs(0))
    assert b.kernel_config == kc
    np.testing.assert_allclose(np.asarray(b(x)), np.asarray(a(x)), rtol=2e-5, atol=2e-6)
    with pytest.raises(ValueError, match="kernel_config"):
        GatedDeltaNet(32, 2, backend="chunk", kernel_config=kc, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="kernel_config"):
        GatedDeltaNet(32, 2, backend="pallas", kernel_config={"bv_state": 16}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="kernel_config"):
        LMConfig(backend="scan", kernel_config=kc)
    m = LM(LMConfig(vocab_size=32, d_model=32, num_layers=1, backend="pallas", kernel_config=kc), rngs=nnx.Rngs(0))
    assert m.blocks[0].mixer.kernel_config == kc


@pytest.mark.parametrize("kw", [dict(backend="chunk"), dict(decay_per_channel=True, beta_per_channel=True,
                                                           backend="scan")])
def test_gdn_layer_grouped_value_heads(kw):
    """num_v_heads = 2 * num_heads equals a one-to-one layer whose q / k projections and convs are
    the grouped layer's repeated in repeat_interleave order (value head j reads key head j // 2);
    prefill + step-by-step decode agree with the full call; caches are sized by value heads."""
    d, Hk, Hv, K = 32, 2, 4, 8
    x = _x((2, 11, d))
    gva = GatedDeltaNet(d, Hk, K, num_v_heads=Hv, chunk_size=16, rngs=nnx.Rngs(1), **kw)
    ref = GatedDeltaNet(d, Hv, K, chunk_size=16, rngs=nnx.Rngs(2), **kw)
    assert gva.q_proj.kernel[...].shape == (d, Hk * K) and gva.v_proj.kernel[...].shape == (d, Hv * K)
    assert gva.A_log[...].shape == (Hv,)
    rep = lambda w: jnp.repeat(w.reshape(w.shape[0], Hk, K), Hv // Hk, axis=1).reshape(w.shape[0], Hv * K)
    for name in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj"):
        w = getattr(gva, name).kernel[...]
        getattr(ref, name).kernel[...] = rep(w) if name in ("q_proj", "k_proj") else w
    for name in ("q_conv", "k_conv", "v_conv"):
        w = getattr(gva, name).weight[...]
        getattr(ref, name).weight[...] = rep(w) if name != "v_conv" else w
    ref.A_log[...], ref.dt_bias[...], ref.o_norm.scale[...] = gva.A_log[...], gva.dt_bias[...], gva.o_norm.scale[...]
    np.testing.assert_allclose(np.asarray(gva(x)), np.asarray(ref(x)), rtol=1e-5, atol=1e-6)
    cache = gva.init_cache(2)
    assert cache.state.shape == (2, Hv, K, K) and cache.conv_q.shape[-1] == Hk * K and cache.conv_v.shape[-1] == Hv * K
    y_full = gva(x)
    y_pre, cache = gva.prefill(x[:, :6])
    outs = [y_pre]
    for t in range(6, 11):
        y_t, cache = gva.decode(x[:, t:t + 1], cache)
        outs.append(y_t)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(y_full), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="num_v_heads must be a multiple of num_heads"):
        GatedDeltaNet(d, 2, K, num_v_heads=3, rngs=nnx.Rngs(0))


def test_pallas_options_checked_when_built():
    """A layer or LMConfig asking backend='pallas' for something the kernels do not take fails when
    built (ValueError with the kernels' reason), not at its first call; so do unknown mixer names,
    an indivisible d_model and a decode step without a cache."""
    with pytest.raises(ValueError, match="chunk_size=48"):
        GatedDeltaNet(64, 2, backend="pallas", chunk_size=48, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="head dim K=24"):
        LMConfig(d_model=48, num_heads=2, backend="pallas")
    with pytest.raises(ValueError, match="per-key-channel g"):
        LMConfig(mixer="kda", backend="pallas")
    with pytest.raises(ValueError, match="per-key-channel g"):
        LMConfig(decay_per_channel=True, backend="pallas")
    LMConfig(decay_per_channel=True, backend="auto")  # auto picks a backend that takes it
    with pytest.raises(ValueError, match="unknown mixer 'gdm'"):
        LMConfig(mixer="gdm")
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        LMConfig(d_model=64, num_heads=3)
    layer = GatedDeltaNet(32, 2, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="cache must be a GDNCache"):
        layer.decode(_x((1, 1, 32)), None)
    with pytest.raises(ValueError, match=r"x_t must have shape \[B, 1, 32\]"):
        layer.decode(_x((1, 32))[:, 0], layer.init_cache(1))
