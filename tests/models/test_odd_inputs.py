"""Odd inputs to the layers, the LM and decoding found by a breaking session (2026-12-04): each
must raise a ValueError / TypeError naming the argument, or (a malformed traced cu_seqlens) give
NaN -- never a silent answer."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax.inference.generate import decode_loop, generate
from gdn_jax.layers import Attention, GatedDeltaNet
from gdn_jax.models import LM, LMConfig

SMALL = dict(vocab_size=50, d_model=32, num_layers=1, num_heads=2)


@pytest.mark.parametrize("cu", [[0, 15, 5, 20], [0, 7, 25], [3, 7, 20], [0, 7, 12]])
def test_attention_refuses_malformed_cu_seqlens(cu):
    a = Attention(32, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="cu_seqlens"):
        a(jnp.ones((1, 20, 32)), cu_seqlens=jnp.array(cu))


def test_attention_lm_poisons_malformed_traced_cu_seqlens():
    m = LM(LMConfig(**SMALL, mixer="attention"), rngs=nnx.Rngs(0))
    f = nnx.jit(lambda m, t, cu: m(t, cu_seqlens=cu))
    tok = jnp.zeros((1, 20), jnp.int32)
    assert bool(jnp.isnan(f(m, tok, jnp.array([0, 7, 12]))).all())
    assert bool(jnp.isfinite(f(m, tok, jnp.array([0, 7, 20]))).all())


def test_decode_loop_refuses_to_run_past_the_kv_cache():
    m = LM(LMConfig(**{**SMALL, "num_layers": 2}, hybrid_every=2, chunk_size=16), rngs=nnx.Rngs(0))
    tok = jax.random.randint(jax.random.key(1), (2, 8), 0, 50)
    _, cache = m.prefill(tok[:, :5], 6)
    with pytest.raises(ValueError, match="max_len = 6"):
        decode_loop(m, cache, tok[:, 5], 4, key=jax.random.key(0))
    out, _ = decode_loop(m, cache, tok[:, 5], 1, key=jax.random.key(0))
    assert out.shape == (2, 1)


@pytest.mark.parametrize("kw, exc", [
    (dict(temperature=float("nan")), ValueError), (dict(temperature=float("inf")), ValueError),
    (dict(temperature="hot"), TypeError), (dict(temperature=jnp.array([1.0, 0.0])), TypeError),
    (dict(temperature=1.0, top_k=2.5), TypeError), (dict(temperature=1.0, top_k=True), TypeError),
])
def test_generate_sampling_arguments(kw, exc):
    m = LM(LMConfig(**SMALL), rngs=nnx.Rngs(0))
    with pytest.raises(exc, match="temperature|top_k"):
        generate(m, jnp.zeros((1, 3), jnp.int32), 2, key=jax.random.key(0), **kw)


def test_generate_takes_numpy_and_jax_scalars():
    m = LM(LMConfig(**SMALL), rngs=nnx.Rngs(0))
    out = generate(m, jnp.zeros((1, 3), jnp.int32), 2, key=jax.random.key(0), temperature=jnp.float32(0.5),
                   top_k=np.int64(3))
    assert out.shape[0] == 1


@pytest.mark.parametrize("kw, match", [
    (dict(dt_max=float("nan")), "dt_max"), (dict(dt_min=-1.0), "dt_min"), (dict(dt_min=0.5, dt_max=0.1), "dt_min"),
    (dict(A_init_range=(5.0, 1.0)), "A_init_range"), (dict(A_init_range=(-5.0, -1.0)), "A_init_range"),
    (dict(A_init_range=3.0), "A_init_range"), (dict(use_short_conv="no"), "use_short_conv"),
    (dict(decay="none", decay_per_channel=True), "decay_per_channel"),
    (dict(beta_per_channel=True, backend="chunk"), "chunk"),
])
def test_gdn_layer_arguments_checked_at_construction(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        GatedDeltaNet(32, 2, rngs=nnx.Rngs(0), **kw)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(beta_per_channel=True, backend="chunk"), ValueError, "per-value-channel beta"),
    (dict(num_v_heads=3), ValueError, "num_v_heads"),
    (dict(mixer="attention", attn_num_heads=3), ValueError, "attn_num_heads"),
    (dict(mixer="kda", num_v_heads=4), ValueError, "kda"),
    (dict(mixer="kda", allow_neg_eigval=True), ValueError, "allow_neg_eigval / beta_per_channel are gdn"),
    (dict(mixer="kda", beta_per_channel=True, backend="scan"), ValueError, "mixer 'kda'"),
    (dict(allow_neg_eigval=1), TypeError, "allow_neg_eigval"),
    (dict(decay="none", decay_per_channel=True), ValueError, "decay_per_channel"),
    # a GDN option no layer would read (used to build the default model silently)
    (dict(mixer="kda", decay="sigmoid"), ValueError, r"LMConfig.decay = 'sigmoid' is an option of the gdn mixer; "
                                                     r"the layers \(kda\) do not read it"),
    (dict(mixer="mamba2", value_head_dim=8), ValueError, r"value_head_dim = 8 is an option of the deltanet / gdn"),
    (dict(mixer="deltanet", decay_per_channel=True), ValueError, r"decay_per_channel = True .* \(deltanet\)"),
    (dict(mixer="gla", allow_neg_eigval=True), ValueError, r"allow_neg_eigval"),
])
def test_lm_config_checks(kw, exc, match):
    with pytest.raises(exc, match=match):
        LMConfig(**{**SMALL, "d_model": 64}, **kw)


def test_lm_config_unused_option_allowed_where_read():
    """The unused-option check leaves configs where some layer reads the option (hybrids), attention-only
    models (HF configs carry their linear-attention fields) and registered mixers alone."""
    from gdn_jax.models import register_mixer, MIXERS

    LMConfig(**{**SMALL, "d_model": 64, "num_layers": 2}, mixer=("gdn", "mamba2"), value_head_dim=8, decay="sigmoid")
    LMConfig(**{**SMALL, "d_model": 64}, mixer="attention", value_head_dim=8, num_v_heads=4)
    register_mixer("my_mixer_reads_decay", MIXERS["mamba2"])
    try:
        LMConfig(**{**SMALL, "d_model": 64}, mixer="my_mixer_reads_decay", decay="sigmoid")
    finally:
        del MIXERS["my_mixer_reads_decay"]


def _small_layer(name, **kw):
    from gdn_jax.layers import GatedLinearAttention, ShortConv, ZeroCenteredRMSNorm

    make = dict(attention=lambda: Attention(16, 2, rngs=nnx.Rngs(0), **kw),
                gla=lambda: GatedLinearAttention(16, 2, rngs=nnx.Rngs(0), **kw),
                conv=lambda: ShortConv(**{"channels": 8, "rngs": nnx.Rngs(0), **kw}),
                norm=lambda: ZeroCenteredRMSNorm(**{"dim": 8, **kw}))[name]
    return make()


@pytest.mark.parametrize("name, kw, exc, match", [
    ("attention", dict(qk_norm="no"), TypeError, "qk_norm must be a bool"),
    ("attention", dict(output_gate=1), TypeError, "output_gate must be a bool"),
    ("gla", dict(use_qk_l2norm=1), TypeError, "use_qk_l2norm must be a bool"),
    ("gla", dict(dt_input="yes", decay="mamba2"), TypeError, "dt_input must be a bool"),
    ("conv", dict(channels=0), ValueError, "channels must be >= 1"),
    ("conv", dict(kernel_size=2.5), TypeError, "kernel_size must be an int"),
    ("conv", dict(init_std=-0.1), ValueError, "init_std must be a finite number >= 0"),
    ("conv", dict(activation="no"), TypeError, "activation must be a bool"),
    ("conv", dict(rngs=None), TypeError, "rngs must be a flax.nnx.Rngs"),
    ("norm", dict(dim=-1), ValueError, "dim must be >= 1"),
    ("norm", dict(epsilon=0.0), ValueError, "epsilon"),
    ("norm", dict(dtype="int32"), ValueError, "dtype must be a floating dtype"),
])
def test_building_blocks_check_arguments(name, kw, exc, match):
    """Every public layer names a bad argument when built (a string flag used to switch an option on,
    ShortConv(0, 4) was accepted, a float kernel size failed inside JAX)."""
    with pytest.raises(exc, match=match):
        _small_layer(name, **kw)


def test_gla_qk_l2norm_old_name():
    """GatedLinearAttention's old ``qk_l2norm`` still works (DeprecationWarning) and sets what
    ``use_qk_l2norm`` (the op's name) sets; both at once is a ValueError."""
    with pytest.warns(DeprecationWarning, match="use_qk_l2norm"):
        old = _small_layer("gla", qk_l2norm=True)
    assert old.use_qk_l2norm is True and _small_layer("gla").use_qk_l2norm is False
    assert _small_layer("gla", use_qk_l2norm=True).use_qk_l2norm is True
    with pytest.raises(ValueError, match="not both"):
        _small_layer("gla", qk_l2norm=True, use_qk_l2norm=False)


def test_rope_checks_rot_dim():
    from gdn_jax.layers.attention import rope

    x = jnp.ones((1, 3, 2, 8))
    for rot_dim in (3, 10, -2, 2.0, True):
        with pytest.raises(ValueError, match="rot_dim must be an even integer in \\[0, D=8\\]"):
            rope(x, jnp.arange(3), rot_dim=rot_dim)
    with pytest.raises(ValueError, match="theta"):
        rope(x, jnp.arange(3), rot_dim=8, theta=0.0)
    assert rope(x, jnp.arange(3), rot_dim=4).shape == x.shape and rope(x, jnp.arange(3), rot_dim=0) is x
    # position 0 is the identity, position 1 rotates the pair (x1, x2) = (1, 1) of frequency 1 by 1 rad
    y = rope(x, jnp.arange(3), rot_dim=2)
    np.testing.assert_allclose(y[0, 0], x[0, 0], rtol=0)
    np.testing.assert_allclose(y[0, 1, 0, :2], [np.cos(1) - np.sin(1), np.sin(1) + np.cos(1)], rtol=1e-6)


def test_lm_token_and_cache_arguments():
    m = LM(LMConfig(**SMALL, mixer="deltanet"), rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="tokens"):
        m([[1, 2, 3]])
    for shape in ((0, 4), (1, 0)):
        with pytest.raises(ValueError, match="B >= 1 and T >= 1"):
            m(jnp.zeros(shape, jnp.int32))
    for args, exc in (((-1, 4), ValueError), ((2.0, 4), TypeError), ((1, 0), ValueError)):
        with pytest.raises(exc, match="batch|max_len"):
            m.init_cache(*args)
    with pytest.raises(TypeError, match="token"):
        m.decode_step([1, 2], m.init_cache(2, 4))
    with pytest.raises(ValueError, match="B >= 1"):
        generate(m, jnp.zeros((0, 3), jnp.int32), 2, key=jax.random.key(0))


def test_decode_cache_mismatches_named():
    layer = GatedDeltaNet(32, 2, rngs=nnx.Rngs(0))
    cache = layer.init_cache(1)
    with pytest.raises(ValueError, match="x_t has batch B = 2, the cache has batch 1"):
        layer.decode(jnp.ones((2, 1, 32)), cache)
    with pytest.raises(ValueError, match="short-conv states"):
        layer.decode(jnp.ones((1, 1, 32)), cache._replace(conv_q=None))


def test_teacher_forced_logits_n_prompt():
    from gdn_jax.inference.generate import teacher_forced_logits

    m = LM(LMConfig(**SMALL), rngs=nnx.Rngs(0))
    tok = jnp.zeros((1, 5), jnp.int32)
    for n in (0, 6, 2.0):
        with pytest.raises(ValueError, match="n_prompt"):
            teacher_forced_logits(m, tok, n_prompt=n)
    logits, _ = teacher_forced_logits(m, tok, n_prompt=2)
    assert logits.shape == (1, 3, 50)


def test_recurrent_decode_names_cache_state():
    from gdn_jax.layers import GatedLinearAttention

    layer = GatedLinearAttention(16, 2, rngs=nnx.Rngs(0))
    cache = layer.init_cache(1)
    with pytest.raises(ValueError, match="cache.state must have shape"):
        layer.decode(jnp.ones((1, 1, 16)), cache._replace(state=jnp.zeros((1, 2, 8, 4))))
    with pytest.raises(TypeError, match="cache.state is bfloat16"):
        layer.decode(jnp.ones((1, 1, 16)), cache._replace(state=cache.state.astype(jnp.bfloat16)))
    with pytest.raises(TypeError, match="use_short_conv"):
        GatedLinearAttention(16, 2, use_short_conv="no", rngs=nnx.Rngs(0))


def test_kernel_config_numpy_ints_and_warps():
    from gdn_jax.ops import KernelConfig, TritonTuning

    k = KernelConfig(fwd_chunk=np.int64(32))
    assert type(k.fwd_chunk) is int and k == KernelConfig(fwd_chunk=32) and hash(k) == hash(KernelConfig(fwd_chunk=32))
    with pytest.raises(ValueError, match="warps_wy"):
        KernelConfig(triton=TritonTuning(warps_wy=64))


def test_layers_and_loader_type_errors():
    from gdn_jax.data import MQARConfig, TaskLoader
    from gdn_jax.layers import GatedLinearAttention, KimiDeltaAttention

    for make in (lambda: GatedLinearAttention(16, 2, rngs=None), lambda: Attention(16, 2, rngs=0),
                 lambda: GatedDeltaNet(16, 2, rngs=None), lambda: KimiDeltaAttention(16, 2, rngs=None)):
        with pytest.raises(TypeError, match="rngs"):
            make()
    with pytest.raises(TypeError, match="task config"):
        TaskLoader(MQARConfig, 2)


def test_decay_init_of_another_decay_refused():
    """dt_min / dt_max / A_init_range are decay='mamba2''s: given with another decay they are a
    ValueError, good value or bad (they used to be ignored silently with decay 'gla', 'none' or
    'sigmoid'); gate_low_rank / gate_logit_normalizer are decay='gla''s."""
    from gdn_jax.layers import GatedLinearAttention

    for make, name in ((lambda: GatedLinearAttention(16, 2, decay="gla", dt_min=-1.0, rngs=nnx.Rngs(0)), "dt_min"),
                       (lambda: GatedLinearAttention(16, 2, decay="none", A_init_range="x", rngs=nnx.Rngs(0)),
                        "A_init_range"),
                       (lambda: GatedDeltaNet(16, 2, decay="sigmoid", dt_max=float("nan"), rngs=nnx.Rngs(0)), "dt_max"),
                       (lambda: GatedDeltaNet(16, 2, decay="sigmoid", dt_max=0.2, rngs=nnx.Rngs(0)), "dt_max"),
                       (lambda: GatedDeltaNet(16, 2, decay="none", dt_min=1e-2, rngs=nnx.Rngs(0)), "dt_min"),
                       (lambda: GatedDeltaNet(16, 2, decay="none", A_init_range=(0.0, 16.0), rngs=nnx.Rngs(0)),
                        "A_init_range")):
        with pytest.raises(ValueError, match=f"{name} is an option of decay='mamba2'"):
            make()
    for kw, name in ((dict(decay="mamba2", gate_low_rank=8), "gate_low_rank"), (dict(decay="gla", dt_max=0.2), "dt_max"),
                     (dict(decay="none", A_init_range=(1.0, 2.0)), "A_init_range")):
        with pytest.raises(ValueError, match=f"{name} is an option of decay"):
            GatedLinearAttention(16, 2, rngs=nnx.Rngs(0), **kw)
    GatedLinearAttention(16, 2, decay="gla", gate_low_rank=8, rngs=nnx.Rngs(0))
    GatedLinearAttention(16, 2, decay="mamba2", dt_min=1e-2, rngs=nnx.Rngs(0))
    # with decay="mamba2" the values are used: dt_bias = softplus^-1(dt), dt in [dt_min, dt_max]
    layer = GatedDeltaNet(16, 2, decay="mamba2", dt_min=0.05, dt_max=0.05, A_init_range=(2.0, 2.0), rngs=nnx.Rngs(0))
    np.testing.assert_allclose(np.asarray(jax.nn.softplus(layer.dt_bias[...])), 0.05, rtol=1e-5)
    np.testing.assert_allclose(np.exp(np.asarray(layer.A_log[...])), 2.0, rtol=1e-5)
    for bad in (dict(dt_max=float("nan")), dict(dt_min=0.5, dt_max=0.1), dict(A_init_range=(5.0, 1.0))):
        with pytest.raises((ValueError, TypeError), match="dt_min|dt_max|A_init_range"):
            GatedDeltaNet(16, 2, decay="mamba2", rngs=nnx.Rngs(0), **bad)


def test_generate_one_new_token():
    """max_new_tokens=1 is the prefill's token alone (its decode loop has no step; it used to fail
    tracing the empty loop), equal to the first token of a longer greedy generation."""
    m = LM(LMConfig(vocab_size=16, d_model=32, num_layers=1, num_heads=2), rngs=nnx.Rngs(0))
    prompt = jnp.array([[1, 2, 3]])
    one = generate(m, prompt, 1, key=jax.random.key(0))
    assert one.shape == (1, 1)
    assert int(one[0, 0]) == int(generate(m, prompt, 3, key=jax.random.key(0))[0, 0])
