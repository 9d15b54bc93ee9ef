"""Qwen3.5 / Qwen3-Next checkpoints: gdn_jax against the real transformers modules (float32)."""
from __future__ import annotations

import numpy as np
import pytest

from _hf_common import build_hf, hf_logits, qwen35_config, qwen3next_config, rms_rel, save_hf, torch

import jax
import jax.numpy as jnp

from gdn_jax import hf
from gdn_jax.hf.qwen import gva_supported, model_params

TOL = 1e-5
GDN2 = ["linear_attention"] * 2
HYBRID = ["linear_attention"] * 3 + ["full_attention"]
needs_gva = pytest.mark.skipif(not gva_supported(), reason="GatedDeltaNet has no num_v_heads yet (grouped value heads)")


def _ids(T, B=2, vocab=97, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (B, T)).astype(np.int64)


def _compare(hf_model, path, T=37, chunk_size=16, **kw):
    model = hf.load_pretrained(path, chunk_size=chunk_size, **kw)
    ids = _ids(T)
    ours = np.asarray(model(jnp.asarray(ids, jnp.int32)))
    return rms_rel(ours, hf_logits(hf_model, ids)), model


CASES = {
    "qwen35_gdn": lambda: qwen35_config(GDN2),
    "qwen35_hybrid": lambda: qwen35_config(HYBRID),
    "qwen35_hybrid_tied": lambda: qwen35_config(HYBRID, tie=True),
    "qwen3next_hybrid": lambda: qwen3next_config(HYBRID),
}
GVA_CASES = {
    "qwen35_gva2_hybrid": lambda: qwen35_config(HYBRID, Hk=2, Hv=4),
    "qwen3next_gva2_hybrid": lambda: qwen3next_config(HYBRID, Hk=2, Hv=4),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Every case saved once: {name: (hf_model, directory)}."""
    out = {}
    cases = dict(CASES, **(GVA_CASES if gva_supported() else {}))
    for i, (name, make) in enumerate(cases.items()):
        m = build_hf(make(), seed=i)
        out[name] = (m, save_hf(m, tmp_path_factory.mktemp(name)))
    return out


@pytest.mark.parametrize("name", list(CASES) + [pytest.param(n, marks=needs_gva) for n in GVA_CASES])
def test_logits_match_transformers(checkpoints, name):
    """T = 37 with chunk 16: not a multiple of the chunk, and longer than it."""
    m, path = checkpoints[name]
    err, _ = _compare(m, path)
    assert err <= TOL, f"{name}: logits RMS-relative error {err:.2e}"


@pytest.mark.parametrize("backend", ["scan", "chunk"])
def test_backends_match_transformers(checkpoints, backend):
    m, path = checkpoints["qwen35_hybrid"]
    err, _ = _compare(m, path, T=20, backend=backend)
    assert err <= TOL, f"{backend}: {err:.2e}"


@pytest.mark.parametrize("name", ["qwen35_hybrid", "qwen3next_hybrid"])
def test_roundtrip_bit_exact(checkpoints, name):
    """to_hf(from_hf(d)) == d, tensor for tensor, bit for bit (and the same config fields)."""
    _, path = checkpoints[name]
    cfg, tensors = hf.read_checkpoint(path)
    model = hf.from_hf(cfg, tensors)
    cfg2, back = hf.to_hf(model, cfg["model_type"])
    assert sorted(back) == sorted(tensors)
    for k in tensors:
        a, b = np.asarray(tensors[k]), np.asarray(back[k])
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32)), k
    for k in ("layer_types", "hidden_size", "linear_num_value_heads", "head_dim", "tie_word_embeddings"):
        assert cfg2[k] == cfg[k], k


def test_save_pretrained_loads_in_transformers(tmp_path):
    """A gdn_jax model written with save_pretrained loads in transformers with the same logits."""
    from flax import nnx
    from gdn_jax.models import LM
    import transformers

    base = hf.config_from_hf(qwen35_config(HYBRID).to_dict())
    model = LM(base, rngs=nnx.Rngs(3))
    for mt in ("qwen3_5_text", "qwen3_next"):
        d = tmp_path / mt
        hf.save_pretrained(model, str(d), mt)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
        ids = _ids(19)
        err = rms_rel(np.asarray(model(jnp.asarray(ids, jnp.int32))), hf_logits(theirs, ids))
        assert err <= TOL, f"{mt}: {err:.2e}"


def test_sharded_checkpoint(checkpoints, tmp_path):
    """A sharded directory (model.safetensors.index.json) loads like the single file."""
    m, _ = checkpoints["qwen35_hybrid"]
    m.save_pretrained(str(tmp_path), max_shard_size="20KB")
    import os
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    err, _ = _compare(m, str(tmp_path))
    assert err <= TOL


def _corrupt_and_compare(checkpoints, name, corrupt):
    m, path = checkpoints[name]
    model = hf.load_pretrained(path, chunk_size=16)
    from flax import nnx
    params = nnx.state(model, nnx.Param)
    corrupt(model)
    ids = _ids(37)
    return rms_rel(np.asarray(model(jnp.asarray(ids, jnp.int32))), hf_logits(m, ids))


def _first_gdn(model):
    return model.blocks[0].mixer


def test_negative_control_a_b_swapped(checkpoints):
    def swap(model):
        mx = _first_gdn(model)
        a, b = mx.a_proj.kernel[...], mx.b_proj.kernel[...]
        mx.a_proj.kernel[...], mx.b_proj.kernel[...] = b, a
    assert _corrupt_and_compare(checkpoints, "qwen35_hybrid", swap) > 100 * TOL


def test_negative_control_conv_taps_reversed(checkpoints):
    def rev(model):
        mx = _first_gdn(model)
        for c in (mx.q_conv, mx.k_conv, mx.v_conv):
            c.weight[...] = c.weight[...][::-1]
    assert _corrupt_and_compare(checkpoints, "qwen35_hybrid", rev) > 100 * TOL


@needs_gva
@pytest.mark.parametrize("name", ["qwen35_gva2_hybrid", "qwen3next_gva2_hybrid"])
def test_negative_control_heads_tiled(checkpoints, name):
    """Value head j reading key head j % Hk (tile order) instead of j // (Hv/Hk) must fail: permute
    every per-value-head parameter of the first GDN layer from interleave into tile order."""
    def tile(model):
        mx = _first_gdn(model)
        Hk, Hv, V = mx.num_heads, mx.num_v_heads, mx.value_head_dim
        r = Hv // Hk
        perm = np.arange(Hv).reshape(Hk, r).T.reshape(-1)  # tile position -> interleave head
        cols = lambda w, n: w.reshape(w.shape[0], Hv, n)[:, perm].reshape(w.shape)
        for p in ("v_proj", "g_proj"):
            getattr(mx, p).kernel[...] = cols(getattr(mx, p).kernel[...], V)
        for p in ("a_proj", "b_proj"):
            getattr(mx, p).kernel[...] = cols(getattr(mx, p).kernel[...], 1)
        mx.A_log[...], mx.dt_bias[...] = mx.A_log[...][perm], mx.dt_bias[...][perm]
        mx.v_conv.weight[...] = cols(mx.v_conv.weight[...], V)
        o = mx.o_proj.kernel[...]
        mx.o_proj.kernel[...] = o.reshape(Hv, V, -1)[perm].reshape(o.shape)
    assert _corrupt_and_compare(checkpoints, name, tile) > 100 * TOL


@pytest.mark.parametrize("tie_top, tie_text", [(None, False), (True, False)])
def test_conditional_generation_text_part(tmp_path, tie_top, tie_text):
    """The text part of a Qwen3_5ForConditionalGeneration checkpoint (model.language_model.*, the
    vision tower ignored) against its text-only forward. transformers ties the lm_head by the
    top-level ``tie_word_embeddings`` whatever text_config says (a (True, False) config used to be
    refused here: "missing tensor 'lm_head.weight'")."""
    import transformers
    from _hf_common import perturb_

    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32, patch_size=2,
                  temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)
    text = dict(qwen35_config(HYBRID).to_dict(), tie_word_embeddings=tie_text)
    top = {} if tie_top is None else dict(tie_word_embeddings=tie_top)
    cfg = transformers.Qwen3_5Config(text_config=text, vision_config=vision, **top)
    torch.manual_seed(0)
    m = perturb_(transformers.Qwen3_5ForConditionalGeneration(cfg).eval(), 0)
    m.save_pretrained(str(tmp_path))
    err, model = _compare(m, str(tmp_path))
    assert err <= TOL, f"{err:.2e}"
    assert model.cfg.tie_embeddings is bool(tie_top)
