"""Decode path (the step op itself: tests/ops/test_step.py): layer/model caches, prefill + decode parity, the
1024-step drift bound, generate (compile-once, determinism) and argument errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax.inference import GDNCache, KVCache, cache_nbytes
from gdn_jax.inference.generate import TRACE_COUNT, decode_drift, generate
from gdn_jax.layers import Attention, GatedDeltaNet, GatedLinearAttention
from gdn_jax.models import LM, LMConfig



def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


# -------------------------------------------------------------------------------- layer caches
@pytest.mark.parametrize("kw", [dict(), dict(decay_per_channel=True), dict(beta_per_channel=True),
                                dict(use_short_conv=False, decay="sigmoid"), dict(allow_neg_eigval=True)])
def test_gdn_layer_prefill_decode_parity(kw):
    layer = GatedDeltaNet(32, 2, rngs=nnx.Rngs(0), chunk_size=16, **kw)
    x = jax.random.normal(jax.random.key(1), (2, 21, 32))
    full = layer(x)
    y, cache = layer.prefill(x[:, :-1])
    np.testing.assert_allclose(y, full[:, :-1], rtol=1e-6, atol=1e-6)
    y1, cache1 = jax.jit(layer.decode)(x[:, -1:], cache)
    _, cache_full = layer.prefill(x)
    assert rel(y1[:, 0], full[:, -1]) < 1e-5
    for a, b in zip(jax.tree_util.tree_leaves(cache1), jax.tree_util.tree_leaves(cache_full)):
        assert a.shape == b.shape and a.dtype == b.dtype and rel(a, b) < 1e-5


@pytest.mark.parametrize("gated", [False, True])
def test_attention_prefill_decode_parity_and_overflow(gated):
    attn = Attention(32, 4, qk_norm=gated, output_gate=gated, rope_fraction=0.25 if gated else 1.0, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 9, 32))
    full = attn(x)
    y, cache = attn.prefill(x[:, :-1], max_len=9)
    assert int(cache.pos) == 8 and cache.k.shape == (2, 9, 4, 8)
    y1, cache = jax.jit(attn.decode)(x[:, -1:], cache)
    assert rel(y1[:, 0], full[:, -1]) < 1e-5 and int(cache.pos) == 9
    y2, _ = attn.decode(x[:, -1:], cache)  # cache full: NaN, never a silent answer
    assert bool(jnp.all(jnp.isnan(y2)))
    with pytest.raises(ValueError, match="does not fit"):
        attn.prefill(x, max_len=8)


MIXER_LAYERS = {
    "gdn": lambda r: GatedDeltaNet(32, 2, chunk_size=8, rngs=r),
    "gdn_kda_negeig": lambda r: GatedDeltaNet(32, 2, chunk_size=8, decay_per_channel=True, allow_neg_eigval=True, rngs=r),
    "gdn_sigmoid_beta_pc_noconv": lambda r: GatedDeltaNet(32, 2, decay="sigmoid", beta_per_channel=True,
                                                          use_short_conv=False, rngs=r),
    "deltanet": lambda r: GatedDeltaNet(32, 2, chunk_size=8, decay="none", rngs=r),
    "mamba2": lambda r: GatedLinearAttention(32, 2, chunk_size=8, decay="mamba2", rngs=r),
    "gla": lambda r: GatedLinearAttention(32, 2, chunk_size=8, decay="gla", rngs=r),
    "linear": lambda r: GatedLinearAttention(32, 2, chunk_size=8, decay="none", rngs=r),
    "attention": lambda r: Attention(32, 4, rngs=r),
    "gated_attention": lambda r: Attention(32, 4, qk_norm=True, output_gate=True, rope_fraction=0.25, rngs=r),
}


@pytest.mark.parametrize("name", list(MIXER_LAYERS))
def test_mixer_call_prefill_and_stepwise_decode_agree(name):
    """Each mixer's three paths: the full-sequence call, prefill of a prefix, and token-by-token
    decode (from an empty cache, and continuing the prefill) give the same outputs and caches."""
    m = MIXER_LAYERS[name](nnx.Rngs(0))
    B, T, T0 = 2, 13, 5
    x = jax.random.normal(jax.random.key(2), (B, T, 32))
    full = m(x)
    step = jax.jit(m.decode)

    def decode_from(cache, t0):
        ys = []
        for t in range(t0, T):
            y, cache = step(x[:, t:t + 1], cache)
            assert y.shape == (B, 1, 32)
            ys.append(y)
        return jnp.concatenate(ys, 1), cache

    y_scratch, cache_scratch = decode_from(m.init_cache(B, T), 0)
    assert rel(y_scratch, full) < 1e-5
    y0, cache0 = m.prefill(x[:, :T0], max_len=T)
    assert rel(y0, full[:, :T0]) < 1e-5
    y_rest, cache_rest = decode_from(cache0, T0)
    assert rel(y_rest, full[:, T0:]) < 1e-5
    _, cache_all = m.prefill(x, max_len=T)
    for c in (cache_scratch, cache_rest):
        assert type(c) is type(cache_all)
        for a, b in zip(jax.tree_util.tree_leaves(c), jax.tree_util.tree_leaves(cache_all)):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert rel(a, b) < 1e-5 if a.ndim else int(a) == int(b) == T
    with pytest.raises(ValueError, match=r"x_t must have shape \[B, 1, 32\]"):
        m.decode(x[:, :2], cache0)


# -------------------------------------------------------------------------------- model parity
MODEL_CFGS = {
    "gdn": dict(mixer="gdn"),
    "attention": dict(mixer="attention"),
    "hybrid": dict(num_layers=4, hybrid_every=4, hybrid_mixer="gated_attention", mlp_ratio=2.0),
    "hybrid_kda": dict(num_layers=4, hybrid_every=2, decay_per_channel=True),
    "deltanet": dict(mixer="deltanet"),
    "mamba2": dict(mixer="mamba2"),
    "gla": dict(mixer="gla"),
    "linear": dict(mixer="linear"),
}


@pytest.mark.parametrize("name", list(MODEL_CFGS))
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_model_prefill_plus_step_equals_forward(name, dtype, tol):
    cfg = LMConfig(d_model=32, num_heads=2, chunk_size=16, dtype=dtype, **MODEL_CFGS[name])
    model = LM(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 19), 0, cfg.vocab_size)
    full = model(tokens)
    logits, cache = model.prefill(tokens[:, :-1], 24)
    assert rel(logits, full[:, :-1]) < tol
    last, cache1 = model.decode_step(tokens[:, -1], cache)
    assert last.shape == (2, cfg.vocab_size) and last.dtype == jnp.float32
    assert rel(last, full[:, -1]) <= tol
    _, cache_full = model.prefill(tokens, 24)
    for a, b in zip(jax.tree_util.tree_leaves(cache1), jax.tree_util.tree_leaves(cache_full)):
        assert a.shape == b.shape and a.dtype == b.dtype
        if a.ndim:
            assert rel(a, b) <= tol
        else:
            assert int(a) == int(b) == 19


def test_cache_shapes_and_dtypes():
    cfg = LMConfig(d_model=32, num_heads=2, num_layers=4, hybrid_every=4, hybrid_mixer="gated_attention", dtype="bfloat16")
    cache = LM(cfg, rngs=nnx.Rngs(0)).init_cache(3, 40)
    assert len(cache) == 4
    for c in cache[:3]:
        assert isinstance(c, GDNCache)
        assert c.state.shape == (3, 2, 16, 16) and c.state.dtype == jnp.float32
        for conv in (c.conv_q, c.conv_k, c.conv_v):
            assert conv.shape == (3, 3, 32) and conv.dtype == jnp.bfloat16
    kv = cache[3]
    assert isinstance(kv, KVCache) and kv.max_len == 40
    assert kv.k.shape == kv.v.shape == (3, 40, 2, 16) and kv.k.dtype == jnp.bfloat16
    assert kv.pos.shape == () and kv.pos.dtype == jnp.int32
    assert cache_nbytes(cache) == 3 * (3 * 2 * 16 * 16 * 4 + 3 * 3 * 3 * 32 * 2) + 2 * 3 * 40 * 32 * 2 + 4


# ------------------------------------------------------------------------------ 1024-step drift
DRIFT_BOUND = 1e-4  # fp32, RMS-relative logit error at every one of 1024 decode steps (measured ~5e-7, max ~4e-6)


def test_decode_drift_1024_steps():
    """Teacher-forced 1024-step decode vs one chunked forward: bounded at every step and not growing
    (experiments/decode_drift.py plots it; results/decode_drift_cpu/)."""
    cfg = LMConfig(d_model=32, num_heads=2, num_layers=4, hybrid_every=4, hybrid_mixer="gated_attention",
                   embed_init_std=1.0)
    model = LM(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(3), (1, 1025), 0, cfg.vocab_size)
    r, cache = decode_drift(model, tokens, n_prompt=1)
    assert r.shape == (1024,)
    print("decode drift (RMS-rel logits) at step 1/64/256/1024:", r[[0, 63, 255, 1023]], "max", r.max())
    assert np.all(np.isfinite(r)) and r.max() < DRIFT_BOUND
    assert r[-256:].mean() < 10 * r[:256].mean()  # no compounding over the decode
    # the GDN states after 1024 decode steps against the chunked prefill of all tokens
    _, ref = model.prefill(tokens, 1025)
    for a, b in zip(cache[:3], ref[:3]):
        assert rel(a.state, b.state) < DRIFT_BOUND


# ------------------------------------------------------------------------------------ generate
def _tiny_hybrid(embed_init_std=1.0):
    cfg = LMConfig(d_model=32, num_heads=2, num_layers=2, hybrid_every=2, hybrid_mixer="gated_attention",
                   embed_init_std=embed_init_std)
    return LM(cfg, rngs=nnx.Rngs(0))


def test_generate_greedy_matches_naive_loop_and_compiles_once():
    model = _tiny_hybrid()
    prompt = jax.random.randint(jax.random.key(1), (2, 5), 0, 256)
    before = TRACE_COUNT["generate"]
    out = generate(model, prompt, 4, key=jax.random.key(0), temperature=0.0)
    assert out.shape == (2, 4) and out.dtype == jnp.int32
    toks = prompt
    fwd = jax.jit(model.__call__)
    for _ in range(4):  # naive: full forward over the growing sequence, argmax
        nxt = jnp.argmax(fwd(toks)[:, -1], -1).astype(jnp.int32)
        toks = jnp.concatenate([toks, nxt[:, None]], 1)
    np.testing.assert_array_equal(out, toks[:, 5:])
    generate(model, prompt + 1, 4, key=jax.random.key(5))  # new values, same shapes: no retrace
    assert TRACE_COUNT["generate"] == before + 1  # one trace (no per-token or per-value retracing)
    for t in (0.7, 0.9):  # sampling: one more compile (greedy takes the argmax only), temperature traced
        generate(model, prompt, 4, key=jax.random.key(5), temperature=t)
    assert TRACE_COUNT["generate"] == before + 2


def test_generate_sampling_determinism():
    model = _tiny_hybrid(embed_init_std=0.02)  # near-uniform logits: sampling varies with the key
    prompt = jnp.zeros((2, 3), jnp.int32)
    a = generate(model, prompt, 12, key=jax.random.key(7), temperature=1.0, top_k=20)
    b = generate(model, prompt, 12, key=jax.random.key(7), temperature=1.0, top_k=20)
    c = generate(model, prompt, 12, key=jax.random.key(8), temperature=1.0, top_k=20)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    g = generate(model, prompt, 12, key=jax.random.key(7), temperature=0.0, top_k=20)  # greedy, same compile
    g1 = generate(model, prompt, 12, key=jax.random.key(9), temperature=1.0, top_k=1)  # top-1 = greedy
    np.testing.assert_array_equal(g, g1)
    np.testing.assert_array_equal(g, generate(model, prompt, 12, key=jax.random.key(1), temperature=0.0, top_k=1))
    assert generate(model, prompt, 0, key=jax.random.key(0)).shape == (2, 0)


def test_bad_arguments():
    model = _tiny_hybrid()
    prompt = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="longer than the attention cache"):
        generate(model, prompt, 2, key=jax.random.key(0), max_len=6)
    with pytest.raises(ValueError, match="exceeds the attention cache"):
        generate(model, prompt, 4, key=jax.random.key(0), max_len=10)
    with pytest.raises(ValueError, match="longer than max_len"):
        model.prefill(prompt, 6)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, prompt, -1, key=jax.random.key(0))
    with pytest.raises(ValueError, match="empty prompt"):
        generate(model, jnp.zeros((1, 0), jnp.int32), 3, key=jax.random.key(0))
    with pytest.raises(ValueError, match="empty prompt"):
        model.prefill(jnp.zeros((1, 0), jnp.int32), 4)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, prompt, 2, key=jax.random.key(0), temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        generate(model, prompt, 2, key=jax.random.key(0), top_k=0)
    V = model.cfg.vocab_size  # out-of-range ids would embed as NaN and sample token 0
    with pytest.raises(ValueError, match=f"vocab_size={V}"):
        generate(model, prompt.at[0, 3].set(V), 2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=f"vocab_size={V}"):
        model.prefill(prompt.at[0, 0].set(-1), 12)
    _, cache = model.prefill(prompt, 12)
    with pytest.raises(ValueError, match=f"vocab_size={V}"):
        model.decode_step(jnp.asarray([V + 3]), cache)


def test_mixer_without_decode_is_a_clear_error():
    from gdn_jax.models import register_mixer

    class Plain(nnx.Module):
        def __init__(self, cfg):
            self.d = cfg.d_model

        def __call__(self, x, *, cu_seqlens=None):
            return x

    register_mixer("_plain_no_decode", lambda cfg, i, rngs: Plain(cfg), overwrite=True)
    # a registered name (a built-in included) is not replaced by accident
    with pytest.raises(ValueError, match="'gdn' is already registered; pass overwrite=True"):
        register_mixer("gdn", lambda cfg, i, rngs: Plain(cfg))
    with pytest.raises(ValueError, match="already registered"):
        register_mixer("_plain_no_decode")(lambda cfg, i, rngs: Plain(cfg))
    with pytest.raises(TypeError, match="callable"):
        register_mixer("_not_callable", 3)
    d1, d2 = register_mixer("_twice"), register_mixer("_twice")  # two decorators of one name
    d1(lambda cfg, i, rngs: Plain(cfg))
    with pytest.raises(ValueError, match="'_twice' is already registered"):
        d2(lambda cfg, i, rngs: Plain(cfg))
    model = LM(LMConfig(d_model=16, num_heads=2, num_layers=1, mixer="_plain_no_decode"), rngs=nnx.Rngs(0))
    with pytest.raises(NotImplementedError, match="has no init_cache"):
        model.init_cache(1, 8)
    with pytest.raises(NotImplementedError, match="has no prefill"):
        model.prefill(jnp.zeros((1, 3), jnp.int32), 8)
