"""The LM's decode options (``LMConfig.decode_backend``, ``state_dtype``) through ``generate`` and
the timed decode loop (``decode_loop``, ``time_decode_loop``, ``generate(timings=...)``), and the
1024-step drift of a bfloat16-state decode against the float32-state one.

bf16-state drift bound (``BF16_STATE_DRIFT``): RMS-relative logit error of the bfloat16-state
teacher-forced decode against the float32-state decode of the same model (d 32, 2 heads x 16,
2 GDN layers, float32 activations, embeddings N(0, 1)) at every one of 1024 steps. Measured on CPU
(JAX 0.10.2; eight token draws, numpy seeds 3-10): max 1.0e-2 to 4.0e-2 (4.0e-2 for the test's draw,
seed 3; single steps: the 99th percentile is 7.1e-3 to 9.4e-3), mean 2.6e-3 to 2.8e-3, the last 256 steps' mean 0.87 to
1.12 times the first 256 steps' (no compounding: the state is rounded once per token and the decay
forgets old roundings), final states 5e-3 to 7e-3. Bounds: max 0.15, mean 1e-2, last-256 mean < 2x
first-256 mean, states 3e-2. ``experiments/decode_drift.py`` reports it for larger models.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax.inference.generate import (TRACE_COUNT, decode_drift, decode_loop, generate, teacher_forced_logits,
                                        time_decode_loop)
from gdn_jax.models import LM, LMConfig

BF16_STATE_DRIFT = dict(max=0.15, mean=1e-2, state=3e-2)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


def test_bf16_state_drift_1024_steps():
    base = dict(d_model=32, num_heads=2, num_layers=2, embed_init_std=1.0, backend="scan")  # scan: cheap compiles
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 256, (1, 1025)), jnp.int32)
    m32 = LM(LMConfig(**base), rngs=nnx.Rngs(0))
    m16 = LM(LMConfig(**base, state_dtype="bfloat16"), rngs=nnx.Rngs(0))  # same parameters
    np.testing.assert_array_equal(m16.embed.embedding[...], m32.embed.embedding[...])
    ref, c32 = teacher_forced_logits(m32, tokens)
    r, c16 = decode_drift(m16, tokens, reference=ref)
    print("bf16-state vs f32-state logits: max", r.max(), "mean", r.mean(), "first/last 256",
          r[:256].mean(), r[-256:].mean())
    assert r.shape == (1024,) and np.all(np.isfinite(r))
    assert r.max() < BF16_STATE_DRIFT["max"] and r.mean() < BF16_STATE_DRIFT["mean"]
    assert r[-256:].mean() < 2 * r[:256].mean()
    for a, b in zip(c16, c32):
        assert a.state.dtype == jnp.bfloat16 and b.state.dtype == jnp.float32
        assert rel(a.state, b.state) < BF16_STATE_DRIFT["state"]
    with pytest.raises(ValueError, match="reference must have"):
        decode_drift(m16, tokens, reference=ref[:, 1:])


def test_generate_fused_step_bf16_state_and_timed_loop():
    """A hybrid LM with decode_backend='pallas' (interpret mode) and a bf16 state: generate's
    one-call path, its timed two-call path and decode_loop give the same tokens; the loop donates
    the cache; time_decode_loop reuses the loop's compile and reports per-token times."""
    cfg = LMConfig(d_model=32, num_heads=2, num_layers=2, hybrid_every=2, hybrid_mixer="gated_attention",
                   embed_init_std=1.0, backend="scan", decode_backend="pallas", state_dtype="bfloat16")
    model = LM(cfg, rngs=nnx.Rngs(0))
    prompt = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 4)), jnp.int32)
    key = jax.random.key(0)
    out = generate(model, prompt, 5, key=key, temperature=0.7, max_len=64)
    t = {}
    out2 = generate(model, prompt, 5, key=key, temperature=0.7, max_len=64, timings=t)
    np.testing.assert_array_equal(out, out2)
    assert t["decode_tokens"] == 4 and t["prefill_s"] > 0 and t["per_token_s"] == pytest.approx(t["decode_s"] / 4)
    t1 = {}
    one = generate(model, prompt, 1, key=key, temperature=0.7, max_len=64, timings=t1)  # no loop steps
    np.testing.assert_array_equal(one, out[:, :1])
    assert t1["decode_tokens"] == 0 and np.isnan(t1["per_token_s"])
    greedy = generate(model, prompt, 5, key=key, max_len=64)
    graphdef, state = nnx.split(model)
    cache = jax.jit(lambda st, p: nnx.merge(graphdef, st).prefill(p, 64)[1])(state, prompt)
    assert cache[0].state.dtype == jnp.bfloat16
    toks, new = decode_loop(model, cache, greedy[:, 0], 4, key=key)  # greedy: its own compile (argmax only)
    before = TRACE_COUNT["decode_loop"]
    np.testing.assert_array_equal(toks, greedy[:, 1:])
    assert cache[0].state.is_deleted() and new[0].state.dtype == jnp.bfloat16 and int(new[1].pos) == 8
    r = time_decode_loop(model, new, greedy[:, -1], 2, reps=1)  # static counts: n = 2 compiles, 2n = 4 is
    assert TRACE_COUNT["decode_loop"] == before + 1                # decode_loop's
    assert r["tokens"] == 2 and len(r["call_s"]) == len(r["call2_s"]) == 1 and r["per_token_s"] > 0
    assert int(r["cache"][1].pos) == 8 + 2 * (3 + 3)  # warm-ups of n and 2n, then n + 2n per rep
    r = time_decode_loop(model, r["cache"], greedy[:, -1], 2, reps=1, traced_count=True)  # one compile of 2n
    assert TRACE_COUNT["decode_loop"] == before + 2                                       # slots, traced count
    assert int(r["cache"][1].pos) == 20 + 2 * (1 + 3)
    with pytest.raises(ValueError, match=r"token must be an integer array \[B\] or \[B, 1\]"):
        decode_loop(model, r["cache"], greedy, 2, key=key)
    from gdn_jax.inference.generate import _check_token  # [B, 1] as decode_step takes it: the same [B]

    np.testing.assert_array_equal(_check_token(greedy[:, -1:], r["cache"]), greedy[:, -1])
    with pytest.raises(ValueError, match="num_tokens must be"):
        decode_loop(model, r["cache"], greedy[:, 0], -1, key=key)


def test_decode_loop_token_batch_must_match_the_cache():
    """A token batch other than the cache's is a ValueError naming token and the cache batch, raised
    before anything is traced (num_tokens = 0 included)."""
    cfg = LMConfig(d_model=32, num_heads=2, num_layers=2, hybrid_every=2, hybrid_mixer="gated_attention",
                   backend="scan")
    model = LM(cfg, rngs=nnx.Rngs(0))
    cache = model.init_cache(2, 8)
    before = TRACE_COUNT["decode_loop"]
    for n in (0, 2):
        with pytest.raises(ValueError, match=r"token has batch B = 3 .* the cache has batch 2"):
            decode_loop(model, cache, jnp.zeros((3,), jnp.int32), n, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"token has batch B = 1 .* the cache has batch 2"):
        time_decode_loop(model, cache, jnp.zeros((1,), jnp.int32), 1, reps=1)
    assert TRACE_COUNT["decode_loop"] == before and not cache[0].state.is_deleted()


def test_decode_loop_token_range_and_generate_zero_tokens_timings():
    """Concrete token ids outside [0, vocab) are a ValueError in decode_loop, as in generate /
    decode_step (they used to give NaN logits, or wrap around, silently); generate with
    max_new_tokens = 0 fills ``timings`` (zeros, nan) instead of leaving an earlier call's numbers."""
    cfg = LMConfig(vocab_size=64, d_model=32, num_heads=2, num_layers=1, backend="scan")
    model = LM(cfg, rngs=nnx.Rngs(0))
    cache = model.init_cache(2, 8)
    for bad in ([64, 1], [-3, 1]):
        with pytest.raises(ValueError, match=r"token ids must be in \[0, vocab_size=64\)"):
            decode_loop(model, cache, jnp.asarray(bad, jnp.int32), 2, key=jax.random.key(0))
    assert not cache[0].state.is_deleted()
    t = {"decode_tokens": 4, "per_token_s": 0.2}
    out = generate(model, jnp.ones((2, 3), jnp.int32), 0, key=jax.random.key(0), timings=t)
    assert out.shape == (2, 0) and t["decode_tokens"] == 0 and t["prefill_s"] == 0.0 and np.isnan(t["per_token_s"])


def test_float16_attention_generates_under_jit():
    """A float16 model with an attention layer runs under jit on CPU (XLA:CPU has no float16 dot with
    float32 accumulation, which jax.nn.dot_product_attention asks for: generate used to fail) and its
    greedy tokens and logits follow the float32 model with the same parameters."""
    base = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=2, mixer=("gdn", "attention"), backend="scan")
    m16 = LM(LMConfig(**base, dtype="float16", param_dtype="float16"), rngs=nnx.Rngs(0))
    m32 = LM(LMConfig(**base), rngs=nnx.Rngs(0))
    nnx.update(m32, jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(m16)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 9)), jnp.int32)
    y16, y32 = jax.jit(lambda t: m16(t))(tokens), m32(tokens)
    assert rel(y16, y32) < 2e-2
    out = generate(m16, tokens, 3, key=jax.random.key(0))
    assert out.shape == (2, 3)


def test_default_unroll_by_platform(monkeypatch):
    """Steps per loop iteration when unroll is None: 1 on the CPU; on an accelerator 2 for a static
    count (measured faster on an H100, results/decode_h100/NOTE.md) and 4 for a traced one."""
    from gdn_jax.inference import generate as gen

    assert gen.default_unroll() == 1 and gen.default_unroll(True) == 1  # this process: CPU
    monkeypatch.setattr(gen.jax, "default_backend", lambda: "gpu")
    assert gen.default_unroll() == 2 and gen.default_unroll(True) == 4
    assert gen._check_unroll(None) == 2 and gen._check_unroll(3) == 3
