"""Bad checkpoints: every field or tensor gdn_jax cannot honour raises an error naming it (no torch needed)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytest.importorskip("safetensors")

import jax.numpy as jnp
from flax import nnx

from gdn_jax import hf
from gdn_jax.hf import CheckpointError
from gdn_jax.models import LM, LMConfig

BASE = dict(vocab_size=40, d_model=16, num_layers=2, num_heads=2, head_dim=8, mixer=("gdn", "gated_attention"),
            mlp_hidden_size=24, norm_style="zero_centered", tie_embeddings=False, attn_num_heads=2,
            attn_num_kv_heads=1, attn_head_dim=8, rope_fraction=0.5)


@pytest.fixture(scope="module")
def ckpt():
    model = LM(LMConfig(**BASE), rngs=nnx.Rngs(0))
    return hf.to_hf(model, "qwen3_5_text")


def _load(cfg, tensors):
    return hf.from_hf(cfg, tensors)


def test_good_checkpoint_loads(ckpt):
    cfg, t = ckpt
    assert isinstance(_load(cfg, t), LM)


@pytest.mark.parametrize("field, value, exc, match", [
    ("layer_types", ["linear_attention", "sliding_attention"], CheckpointError,
     r"layer_types\[1\] = 'sliding_attention' is not supported; expected one of \['full_attention', 'linear_attention'\]"),
    ("layer_types", ["linear_attention"], CheckpointError, r"layer_types must list num_hidden_layers = 2"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}, NotImplementedError,
     r"rope_parameters.rope_type 'yarn' is not supported"),
    ("hidden_act", "gelu", NotImplementedError, r"hidden_act 'gelu' is not supported \(expected 'silu'\)"),
    ("attention_bias", True, NotImplementedError, r"attention_bias"),
    ("linear_num_value_heads", 3, CheckpointError, r"linear_num_value_heads = 3 must be a multiple of linear_num_key_heads = 2"),
    ("model_type", "llama", CheckpointError, r"model_type 'llama' is not supported"),
    ("model_type", "qwen3_5_moe", NotImplementedError, r"model_type 'qwen3_5_moe': MoE checkpoints are not supported"),
    ("hidden_size", None, CheckpointError, r"config.json lacks the field 'hidden_size'"),
])
def test_bad_config_fields(ckpt, field, value, exc, match):
    cfg, t = ckpt
    bad = dict(cfg)
    if value is None:
        del bad[field]
    else:
        bad[field] = value
    with pytest.raises(exc, match=match):
        _load(bad, t)


def test_qwen3_next_moe_layer_named(ckpt):
    cfg, t = ckpt
    bad = dict(cfg, model_type="qwen3_next", num_experts=8, decoder_sparse_step=1, mlp_only_layers=[0])
    with pytest.raises(NotImplementedError, match=r"layer 1 of this Qwen3-Next checkpoint is a MoE layer"):
        _load(bad, t)
    ok = dict(cfg, model_type="qwen3_next", num_experts=8, mlp_only_layers=[0, 1])  # every layer dense
    assert isinstance(_load(ok, t), LM)


def test_missing_unexpected_and_misshapen_tensors(ckpt):
    cfg, t = ckpt
    bad = {k: v for k, v in t.items() if k != "model.layers.0.linear_attn.A_log"}
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.0.linear_attn.A_log' \(expected shape \(2,\)\)"):
        _load(cfg, bad)
    bad = dict(t, **{"model.layers.1.self_attn.k_proj.weight": jnp.zeros((16, 16))})
    with pytest.raises(CheckpointError, match=r"'model.layers.1.self_attn.k_proj.weight' has shape \(16, 16\), "
                                              r"expected \(8, 16\)"):
        _load(cfg, bad)
    bad = dict(t, **{"model.layers.0.mlp.experts.0.weight": jnp.zeros((2, 2))})
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model.layers.0.mlp.experts.0.weight'"):
        _load(cfg, bad)
    tied = dict(cfg, tie_word_embeddings=True)  # untied tensors under a tied config: lm_head is dropped
    assert isinstance(_load(tied, t), LM)
    with pytest.raises(CheckpointError, match=r"missing tensor 'lm_head.weight'"):
        _load(cfg, {k: v for k, v in t.items() if k != "lm_head.weight"})


def test_odd_rotary_dim(ckpt):
    cfg, t = ckpt
    bad = dict(cfg, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.375})
    with pytest.raises(NotImplementedError, match=r"rotary dim int\(head_dim \* partial_rotary_factor\)"):
        _load(bad, t)


@pytest.mark.parametrize("scaling", [{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
                                     {"type": "linear", "factor": 2.0}])
def test_rope_scaling_beside_rope_parameters_refused(ckpt, scaling):
    """A legacy rope_scaling next to rope_parameters (Qwen's model cards add one for long context;
    transformers merges the two) used to load as plain RoPE, logits ~1.6e-2 off: now refused."""
    cfg, t = ckpt
    assert cfg["rope_parameters"]["rope_type"] == "default"
    with pytest.raises(NotImplementedError, match=r"rope_scaling.rope_type '(yarn|linear)' is not supported"):
        _load(dict(cfg, rope_scaling=scaling), t)
    assert isinstance(_load(dict(cfg, rope_scaling={"rope_type": "default"}), t), LM)


def test_directory_errors(ckpt, tmp_path):
    cfg, t = ckpt
    with pytest.raises(CheckpointError, match="has no config.json"):
        hf.load_pretrained(str(tmp_path))
    hf.write_checkpoint(str(tmp_path), cfg, t)
    assert isinstance(hf.load_pretrained(str(tmp_path)), LM)
    with pytest.raises(CheckpointError, match="is a file; give the Hugging Face checkpoint directory"):
        hf.load_pretrained(str(tmp_path / "config.json"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"broken/config.json is not valid JSON"):
        hf.load_pretrained(str(broken))
    (broken / "config.json").write_text(json.dumps(cfg))
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{truncated")
    with pytest.raises(CheckpointError, match=r"cannot read .*broken/model.safetensors"):
        hf.load_pretrained(str(broken))
    with open(tmp_path / "model.safetensors.index.json", "w") as fh:
        json.dump({"weight_map": {k: "model-00002-of-00002.safetensors" for k in t}}, fh)
    with pytest.raises(CheckpointError, match=r"shard 'model-00002-of-00002.safetensors' listed in "
                                              r"model.safetensors.index.json is missing"):
        hf.load_pretrained(str(tmp_path))


def test_overrides_and_export_checked(ckpt):
    cfg, t = ckpt
    with pytest.raises(ValueError, match=r"overrides \['num_layers'\] are not run-time options"):
        hf.from_hf(cfg, t, num_layers=3)
    # run-time options: the decode path's backend and state dtype
    m = hf.from_hf(cfg, t, decode_backend="scan", state_dtype="bfloat16")
    assert (m.cfg.decode_backend, m.cfg.state_dtype) == ("scan", "bfloat16")
    plain = LM(LMConfig(vocab_size=40, d_model=16, num_layers=2, num_heads=2, mixer="attention", mlp_ratio=2),
               rngs=nnx.Rngs(0))
    with pytest.raises(CheckpointError, match=r"LMConfig.norm_style = 'standard' has no qwen3_5_text counterpart"):
        hf.to_hf(plain)


def test_bfloat16_checkpoint_roundtrip(ckpt, tmp_path):
    """A bf16 checkpoint loads with bf16 parameters (float32 compute) and writes back bit-exact."""
    cfg, t = ckpt
    t16 = {k: jnp.asarray(v, jnp.bfloat16) for k, v in t.items()}
    hf.write_checkpoint(str(tmp_path), dict(cfg, dtype="bfloat16"), t16)
    model = hf.load_pretrained(str(tmp_path))
    assert model.cfg.param_dtype == "bfloat16" and model.cfg.dtype == "float32"
    _, back = hf.to_hf(model)
    for k in t16:
        assert back[k].dtype == jnp.bfloat16 and np.array_equal(np.asarray(back[k]).view(np.uint16),
                                                                np.asarray(t16[k]).view(np.uint16)), k


def test_hf_probe_script(ckpt, tmp_path):
    """experiments/hf_probe.py on a tiny checkpoint: backends agree, generation and the probe run."""
    import importlib.util

    cfg, t = ckpt
    hf.write_checkpoint(str(tmp_path / "ckpt"), cfg, t)
    path = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "hf_probe.py")
    spec = importlib.util.spec_from_file_location("hf_probe", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    ids = ",".join(str(i) for i in range(24))  # the prompt and the probe share one shape: one compile
    r = probe.main([str(tmp_path / "ckpt"), "--prompt_ids", ids, "--max_new_tokens", "4", "--niah_lengths", "24",
                    "--trials", "1", "--out", str(tmp_path / "out")])
    assert max(r["backend_rms_rel_vs_scan"].values()) <= 1e-5
    assert len(r["continuation_ids"]) == 4 and 0.0 <= r["niah"][24] <= 1.0
    assert os.path.exists(tmp_path / "out" / "probe.json")
    # cheap arguments are checked before the checkpoint is loaded (a missing folder is never reached)
    for argv in (["--trials", "0"], ["--niah_lengths", "8"], ["--prompt_ids", "1,x"], ["--max_new_tokens", "0"]):
        with pytest.raises(SystemExit):
            probe.main([str(tmp_path / "missing"), *argv])
    # after loading: a missing folder and out-of-vocabulary ids are one line each, not a traceback
    with pytest.raises(SystemExit, match="1"):
        probe.main([str(tmp_path / "missing")])
    with pytest.raises(SystemExit):
        probe.main([str(tmp_path / "ckpt"), "--prompt_ids", "1,40", "--niah_lengths", ""])


def test_default_head_dims_round_trip(tmp_path):
    """head_dim / attn_head_dim left None: the config carries the resolved dims (d_model // heads)
    and the saved checkpoint loads back with the same logits."""
    cfg = LMConfig(vocab_size=50, d_model=32, num_layers=2, num_heads=2, mixer=("gdn", "gated_attention"),
                   mlp_hidden_size=48, norm_style="zero_centered")
    model = LM(cfg, rngs=nnx.Rngs(0))
    hcfg, tensors = hf.to_hf(model)
    assert (hcfg["linear_key_head_dim"], hcfg["linear_value_head_dim"], hcfg["head_dim"]) == (16, 16, 16)
    hf.save_pretrained(model, str(tmp_path / "ck"))
    back = hf.load_pretrained(str(tmp_path / "ck"))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 50, (1, 9)), jnp.int32)
    np.testing.assert_allclose(np.asarray(back(ids)), np.asarray(model(ids)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("field, value", [("attn_bias", "qkvo"), ("pos_embedding", "learned")])
def test_to_hf_refuses_options_without_counterpart(field, value):
    """Attention biases and learned positions have no Qwen3.5 / Qwen3-Next tensors: an error naming
    the field, not a checkpoint that silently drops them."""
    kw = {field: value, **({"max_seq_len": 16} if field == "pos_embedding" else {})}
    model = LM(LMConfig(**{**BASE, **kw}), rngs=nnx.Rngs(0))
    with pytest.raises(CheckpointError, match=f"LMConfig.{field}"):
        hf.to_hf(model)


@pytest.mark.parametrize("field, value", [("hidden_size", "16"), ("hidden_size", 16.5), ("linear_num_key_heads", 0),
                                          ("num_hidden_layers", True)])
def test_integer_fields_checked(ckpt, field, value):
    cfg, t = ckpt
    with pytest.raises(CheckpointError, match=field):
        _load({**cfg, field: value}, t)


def test_config_and_tensors_types(ckpt):
    cfg, t = ckpt
    with pytest.raises(TypeError, match="config.json dict"):
        hf.config_from_hf(None)
    with pytest.raises(TypeError, match="mapping"):
        hf.from_hf(cfg, list(t.items()))
    with pytest.raises(TypeError, match="config.json dict"):
        hf.kda_from_hf({}, None)
    with pytest.raises(CheckpointError, match="full_attention_interval"):
        hf.config_from_hf({**{k: v for k, v in cfg.items() if k != "layer_types"}, "full_attention_interval": 0})


def test_dtype_objects_in_lm_config_export(tmp_path):
    """LMConfig takes jnp dtypes as well as names and stores the name: the config is equal to the
    named one and save_pretrained writes it (it used to fail in json.dump, leaving config.json cut)."""
    kw = dict(vocab_size=50, d_model=32, num_layers=2, num_heads=2, mixer=("gdn", "gated_attention"),
              mlp_hidden_size=48, norm_style="zero_centered")
    cfg = LMConfig(**kw, param_dtype=jnp.bfloat16, dtype=jnp.float32, state_dtype=jnp.float32)
    assert cfg == LMConfig(**kw, param_dtype="bfloat16") and cfg.param_dtype == "bfloat16"
    hf.save_pretrained(LM(cfg, rngs=nnx.Rngs(0)), str(tmp_path / "ck"))
    with open(tmp_path / "ck" / "config.json") as fh:
        assert json.load(fh)["dtype"] == "bfloat16"
    assert hf.load_pretrained(str(tmp_path / "ck")).cfg.param_dtype == "bfloat16"
