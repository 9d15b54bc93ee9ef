"""Decoding a Qwen3.5 / Qwen3-Next checkpoint: greedy tokens and caches against transformers."""
from __future__ import annotations

import numpy as np
import pytest

from _hf_common import build_hf, qwen35_config, qwen3next_config, rms_rel, save_hf, torch

import jax
import jax.numpy as jnp

from gdn_jax import hf
from gdn_jax.hf.qwen import gva_supported
from gdn_jax.inference.generate import generate

HYBRID = ["linear_attention"] * 3 + ["full_attention"]
CASES = {"qwen35_hybrid": lambda: qwen35_config(HYBRID), "qwen3next_hybrid": lambda: qwen3next_config(HYBRID)}
if gva_supported():
    CASES["qwen35_gva2_hybrid"] = lambda: qwen35_config(HYBRID, Hk=2, Hv=4)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    m = build_hf(CASES[request.param](), seed=11)
    path = save_hf(m, tmp_path_factory.mktemp(request.param))
    return request.param, m, hf.load_pretrained(path, chunk_size=16)


def _prompt(T=21, B=2):
    return np.random.default_rng(5).integers(0, 97, (B, T)).astype(np.int64)


def test_greedy_generation_matches_hf_generate(pair):
    name, m, model = pair
    prompt = _prompt()
    with torch.no_grad():
        ids = torch.as_tensor(prompt)  # an explicit mask: else generate takes pad_token_id tokens for padding
        ref = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                         do_sample=False, pad_token_id=0, eos_token_id=None)[:, prompt.shape[1]:].numpy()
    ours = np.asarray(generate(model, jnp.asarray(prompt, jnp.int32), 16, key=jax.random.key(0), temperature=0.0))
    np.testing.assert_array_equal(ours, ref, err_msg=name)


def test_prefill_decode_states_match_hf_cache(pair):
    """Prefill of T tokens, then one decode step: logits, GDN recurrent and conv states, and the
    attention keys/values equal transformers' cache within 1e-5 (RMS-relative)."""
    name, m, model = pair
    prompt = _prompt()
    nxt = np.array([[3], [7]], np.int64)
    with torch.no_grad():
        out = m(torch.as_tensor(prompt), use_cache=True)
        cache = out.cache
        out2 = m(torch.as_tensor(nxt), cache=cache, use_cache=True)
    logits, ours = model.prefill(jnp.asarray(prompt, jnp.int32), max_len=32)
    assert rms_rel(logits, out.logits.numpy()) <= 1e-5
    step, ours = model.decode_step(jnp.asarray(nxt[:, 0], jnp.int32), ours)
    assert rms_rel(step, out2.logits.numpy()[:, -1]) <= 1e-5, name
    T = prompt.shape[1] + 1
    for i, (layer, c) in enumerate(zip(cache.layers, ours)):
        if hasattr(layer, "recurrent_states"):
            err = rms_rel(c.state, layer.recurrent_states[0].numpy())
            assert err <= 1e-5, f"{name} layer {i}: recurrent state {err:.2e}"
            conv = np.concatenate([np.asarray(c.conv_q), np.asarray(c.conv_k), np.asarray(c.conv_v)], axis=-1)
            ref = layer.conv_states[0].numpy()[:, :, 1:].transpose(0, 2, 1)  # last W-1 inputs
            assert rms_rel(conv, ref) <= 1e-5, f"{name} layer {i}: conv state"
        else:
            assert int(c.pos) == T
            for ours_kv, ref in ((c.k, layer.keys), (c.v, layer.values)):
                ref = ref.numpy().transpose(0, 2, 1, 3)
                assert rms_rel(np.asarray(ours_kv)[:, :T], ref) <= 1e-5, f"{name} layer {i}: kv"


def test_fused_decode_layer_matches_hf_cache(tmp_path):
    """decode_backend="fused_layer" (the whole GDN layer's decode in one kernel, interpret mode on
    CPU) on a Qwen3.5 checkpoint with head dims 16 (the kernel's smallest) and grouped value heads
    where transformers has them: prefill, then two decode steps, whose logits and GDN recurrent and
    conv states equal transformers' cache within 1e-5 (RMS-relative)."""
    import transformers

    Hv = 4 if gva_supported() else 2
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=Hv, linear_key_head_dim=16,
        linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"], tie_word_embeddings=False,
        rms_norm_eps=1e-6)
    m = build_hf(cfg, seed=3)
    model = hf.load_pretrained(save_hf(m, tmp_path / "ckpt"), chunk_size=16, decode_backend="fused_layer")
    assert model.blocks[0].mixer.uses_fused_decode() and model.blocks[0].mixer.num_v_heads == Hv
    prompt = _prompt(T=9)
    nxt = np.array([[3, 5], [7, 11]], np.int64)
    with torch.no_grad():
        out = m(torch.as_tensor(prompt), use_cache=True)
        cache = out.cache
        steps = [m(torch.as_tensor(nxt[:, i:i + 1]), cache=cache, use_cache=True).logits.numpy()[:, -1] for i in range(2)]
    _, ours = model.prefill(jnp.asarray(prompt, jnp.int32), max_len=16)
    view = model.decode_view()
    for i in range(2):
        step, ours = model.decode_step(jnp.asarray(nxt[:, i], jnp.int32), ours, view=view)
        assert rms_rel(step, steps[i]) <= 1e-5, i
    layer, c = cache.layers[0], ours[0]
    assert rms_rel(c.state, layer.recurrent_states[0].numpy()) <= 1e-5
    conv = np.concatenate([np.asarray(c.conv_q), np.asarray(c.conv_k), np.asarray(c.conv_v)], axis=-1)
    assert rms_rel(conv, layer.conv_states[0].numpy()[:, :, 1:].transpose(0, 2, 1)) <= 1e-5
