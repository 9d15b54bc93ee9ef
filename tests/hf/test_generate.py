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
