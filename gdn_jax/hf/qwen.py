"""Qwen3.5 (text) and Qwen3-Next (dense MLP) checkpoints <-> gdn_jax ``LM``.

Layouts (read from transformers' ``modeling_qwen3_5.py`` / ``modeling_qwen3_next.py``, v5.24):

* GDN layers (``layer_types[i] == "linear_attention"``), ``model.layers.{i}.linear_attn.*``:
  either separate ``in_proj_qkv`` (rows q | k | v, head-major) ``in_proj_z``, ``in_proj_b``,
  ``in_proj_a`` (Qwen3.5), or fused ``in_proj_qkvz`` / ``in_proj_ba`` (Qwen3-Next), grouped by key
  head: per key head h the rows are q_h [K], k_h [K], then the r = Hv/Hk value heads h*r..h*r+r-1 of
  v [r*V] and z [r*V]; ``in_proj_ba`` per key head b [r] then a [r]. ``conv1d.weight [C, 1, W]`` is
  one depthwise conv over q | k | v (tap W-1 multiplies the current token), ``A_log``/``dt_bias``
  ``[Hv]``, ``norm.weight [V]`` the gated RMSNorm (standard scale, SiLU gate), ``out_proj``.
* Attention layers (``"full_attention"``), ``model.layers.{i}.self_attn.*``: ``q_proj [N*2D, d]``
  grouped by head as query_n [D] then gate_n [D] (the sigmoid output gate); ``k_proj``/``v_proj``
  ``[N_kv*D, d]`` (GQA); ``q_norm``/``k_norm [D]`` zero-centred RMSNorm; ``o_proj``; RoPE on the
  first ``int(D * partial_rotary_factor)`` channels (Qwen3.5's mRoPE reduces to it for text
  positions: the three sections see the same position).
* ``input_layernorm``, ``post_attention_layernorm``, ``model.norm``: RMSNorm ``x/rms * (1 + w)``;
  ``mlp.{gate,up,down}_proj``: SwiGLU; ``model.embed_tokens``; ``lm_head`` unless tied.
"""
from __future__ import annotations

import inspect
from typing import Dict, Tuple

import jax
import jax.numpy as jnp
from flax import nnx
from flax import traverse_util

from ..layers import GatedDeltaNet
from ..models.lm import LM, LMConfig
from .checkpoint import CheckpointError, config_int

LAYER_TYPES = {"linear_attention": "gdn", "full_attention": "gated_attention"}
MIXER_TYPES = {v: k for k, v in LAYER_TYPES.items()}
TEXT_TYPES = ("qwen3_5_text", "qwen3_next")
ARCHITECTURES = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}
# tensors of a Qwen3_5ForConditionalGeneration checkpoint that the text model does not use
IGNORED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")


def _field(tc: dict, name: str, default=None, required: bool = False):
    if name in tc and tc[name] is not None:
        return tc[name]
    if required:
        raise CheckpointError(f"config.json lacks the field {name!r} (model_type {tc.get('model_type')!r})")
    return default


def _int_field(tc: dict, name: str, default=None, required: bool = False, minimum: int = 1) -> int:
    """An integer field of config.json, >= minimum (:func:`.checkpoint.config_int`)."""
    return config_int(_field(tc, name, default, required), name, minimum=minimum)


def text_config(hf: dict) -> dict:
    """The text-model config of a Qwen3.5 / Qwen3-Next ``config.json`` dict (Qwen3.5's
    ``text_config`` for ``Qwen3_5ForConditionalGeneration``), with ``model_type`` one of TEXT_TYPES."""
    if not isinstance(hf, dict):
        raise TypeError(f"the config must be a config.json dict (json.load), got {type(hf).__name__}")
    mt = hf.get("model_type")
    if mt in ("qwen3_5_moe", "qwen3_5_moe_text"):
        raise NotImplementedError(f"config.json model_type {mt!r}: MoE checkpoints are not supported "
                                  "(gdn_jax implements dense SwiGLU MLP layers only)")
    if mt == "qwen3_5":
        tc = hf.get("text_config")
        if not isinstance(tc, dict):
            raise CheckpointError("config.json (model_type 'qwen3_5') has no 'text_config' dict")
        tc = dict(tc)
        # transformers (5.24.0) ties the composite model's lm_head by the TOP-level field (default
        # False), whatever text_config says; gdn_jax follows it so that both load the same model
        tc["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings") or False)
        tc["model_type"] = "qwen3_5_text"
        return tc
    if mt in TEXT_TYPES:
        return hf
    raise CheckpointError(f"config.json model_type {mt!r} is not supported; expected one of "
                          f"{list(TEXT_TYPES) + ['qwen3_5']} (Kimi Linear: gdn_jax.hf.kda_from_hf for its KDA layer)")


def _rope(tc: dict):
    """``(theta, partial_rotary_factor)`` from ``rope_parameters`` (transformers 5) or the legacy
    ``rope_theta`` / ``partial_rotary_factor`` / ``rope_scaling`` fields."""
    rp = tc.get("rope_parameters")
    if rp is None:
        rp = dict(tc.get("rope_scaling") or {})
        rp.setdefault("rope_theta", tc.get("rope_theta", 10000.0))
        rp.setdefault("partial_rotary_factor", tc.get("partial_rotary_factor", 0.25))
    if not isinstance(rp, dict):
        raise CheckpointError(f"config.json rope_parameters must be a dict, got {rp!r}")
    # transformers merges a legacy rope_scaling into rope_parameters: a scaled RoPE in either is refused
    for name, d in (("rope_parameters", rp), ("rope_scaling", tc.get("rope_scaling"))):
        if d is None:
            continue
        if not isinstance(d, dict):
            raise CheckpointError(f"config.json {name} must be a dict, got {d!r}")
        rtype = d.get("rope_type", d.get("type", "default"))
        if rtype != "default":
            raise NotImplementedError(f"config.json {name}.rope_type {rtype!r} is not supported "
                                      "(gdn_jax implements 'default' RoPE only)")
    theta = float(rp.get("rope_theta", tc.get("rope_theta", 10000.0)))
    frac = float(rp.get("partial_rotary_factor", tc.get("partial_rotary_factor", 0.25)))
    return theta, frac


def _layer_types(tc: dict, n: int):
    lt = tc.get("layer_types")
    if lt is None:
        every = _int_field(tc, "full_attention_interval", 4)
        lt = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    if not isinstance(lt, (list, tuple)) or len(lt) != n:
        raise CheckpointError(f"config.json layer_types must list num_hidden_layers = {n} types, got {lt!r}")
    for i, t in enumerate(lt):
        if t not in LAYER_TYPES:
            raise CheckpointError(f"config.json layer_types[{i}] = {t!r} is not supported; expected one of "
                                  f"{sorted(LAYER_TYPES)}")
    return list(lt)


def _check_dense(tc: dict, n: int):
    """NotImplementedError naming the first MoE layer of a Qwen3-Next config."""
    experts = int(tc.get("num_experts", 0) or 0)
    if tc.get("model_type") != "qwen3_next" or experts <= 0:
        return
    step = int(tc.get("decoder_sparse_step", 1) or 1)
    only = set(tc.get("mlp_only_layers") or [])
    for i in range(n):
        if i not in only and (i + 1) % step == 0:
            raise NotImplementedError(
                f"layer {i} of this Qwen3-Next checkpoint is a MoE layer (num_experts = {experts}, "
                f"decoder_sparse_step = {step}, mlp_only_layers = {sorted(only)}); gdn_jax implements dense "
                "MLP layers only (num_experts = 0, or every layer in mlp_only_layers)")


def gva_supported() -> bool:
    """Whether the installed GatedDeltaNet takes ``num_v_heads`` (grouped value heads)."""
    return "num_v_heads" in inspect.signature(GatedDeltaNet.__init__).parameters


def config_from_hf(hf: dict, **overrides) -> LMConfig:
    """The :class:`~gdn_jax.models.LMConfig` of a Qwen3.5 / Qwen3-Next ``config.json`` dict.
    ``overrides`` set LMConfig fields that do not change the architecture (``backend``,
    ``chunk_size``, ``kernel_config``, ``dtype``, ``param_dtype``, ``decode_backend``, ``state_dtype``)."""
    tc = text_config(hf)
    n = _int_field(tc, "num_hidden_layers", required=True)
    lt = _layer_types(tc, n)
    _check_dense(tc, n)
    act = _field(tc, "hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"config.json hidden_act {act!r} is not supported (expected 'silu')")
    if _field(tc, "attention_bias", False):
        raise NotImplementedError("config.json attention_bias = true is not supported (expected false)")
    d = _int_field(tc, "hidden_size", required=True)
    Hk = _int_field(tc, "linear_num_key_heads", required=True)
    Hv = _int_field(tc, "linear_num_value_heads", required=True)
    if Hv % Hk:
        raise CheckpointError(f"config.json linear_num_value_heads = {Hv} must be a multiple of "
                              f"linear_num_key_heads = {Hk}")
    if Hv != Hk and "linear_attention" in lt and not gva_supported():
        raise NotImplementedError(f"linear_num_value_heads = {Hv} != linear_num_key_heads = {Hk} needs grouped "
                                  "value heads (GatedDeltaNet(num_v_heads=...)), which this gdn_jax lacks")
    N = _int_field(tc, "num_attention_heads", required=True)
    Nkv = _int_field(tc, "num_key_value_heads", N)
    D = _int_field(tc, "head_dim", d // N)
    theta, frac = _rope(tc)
    if "full_attention" in lt and int(D * frac) % 2:
        raise NotImplementedError(f"rotary dim int(head_dim * partial_rotary_factor) = int({D} * {frac}) is odd; "
                                  "gdn_jax rotates an even number of channels")
    kw = dict(
        vocab_size=_int_field(tc, "vocab_size", required=True), d_model=d, num_layers=n, num_heads=Hk,
        head_dim=_int_field(tc, "linear_key_head_dim", required=True),
        value_head_dim=_int_field(tc, "linear_value_head_dim", required=True),
        num_v_heads=Hv if Hv != Hk else None, mixer=tuple(LAYER_TYPES[t] for t in lt),
        mlp_hidden_size=_int_field(tc, "intermediate_size", required=True),
        norm_eps=float(_field(tc, "rms_norm_eps", 1e-6)), norm_style="zero_centered",
        tie_embeddings=bool(_field(tc, "tie_word_embeddings", False)),
        attn_num_heads=N, attn_num_kv_heads=Nkv, attn_head_dim=D, rope_theta=theta, rope_fraction=frac,
        conv_size=_int_field(tc, "linear_conv_kernel_dim", 4),
    )
    allowed = ("backend", "chunk_size", "kernel_config", "dtype", "param_dtype", "decode_backend", "state_dtype")
    bad = sorted(set(overrides) - set(allowed))
    if bad:
        raise ValueError(f"config_from_hf overrides {bad} are not run-time options (an LMConfig field that the "
                         f"checkpoint fixes, or no LMConfig field); allowed: {', '.join(allowed)}")
    return LMConfig(**{**kw, **overrides})


# ---------------------------------------------------------------------------------------- tensors
def _T(w):
    return jnp.swapaxes(w, -1, -2)


def _sizes(cfg: LMConfig):
    # the layers' own defaults: head_dim d_model // num_heads, value_head_dim head_dim, the attention
    # head dim head_dim or else d_model // attn_num_heads
    Hk, K = cfg.num_heads, cfg.head_dim or cfg.d_model // cfg.num_heads
    Hv = cfg.num_v_heads or Hk
    V = cfg.value_head_dim or K
    N = cfg.attn_num_heads or cfg.num_heads
    return Hk, K, Hv, V, N, cfg.attn_head_dim or cfg.head_dim or cfg.d_model // N


def params_to_hf(p: Dict[tuple, jnp.ndarray], cfg: LMConfig, fused: bool) -> Dict[str, jnp.ndarray]:
    """gdn_jax parameters (flat dict, tuple paths) -> HF tensors (``fused``: Qwen3-Next's
    ``in_proj_qkvz``/``in_proj_ba``; else Qwen3.5's ``in_proj_qkv``/``z``/``b``/``a``)."""
    Hk, K, Hv, V, N, D = _sizes(cfg)
    r = Hv // Hk
    d = cfg.d_model
    out = {"model.embed_tokens.weight": p[("embed", "embedding")], "model.norm.weight": p[("norm", "scale")]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = _T(p[("lm_head", "kernel")])
    for i, m in enumerate(cfg.layer_mixers()):
        b, h = ("blocks", i), f"model.layers.{i}."
        g = lambda *k: p[b + k]
        out[h + "input_layernorm.weight"] = g("norm1", "scale")
        out[h + "post_attention_layernorm.weight"] = g("norm2", "scale")
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            out[h + f"mlp.{theirs}.weight"] = _T(g("mlp", ours, "kernel"))
        if m == "gdn":
            a = h + "linear_attn."
            W = {n: _T(g("mixer", n, "kernel")) for n in ("q_proj", "k_proj", "v_proj", "g_proj", "a_proj", "b_proj")}
            if fused:
                out[a + "in_proj_qkvz.weight"] = jnp.concatenate(
                    [W["q_proj"].reshape(Hk, K, d), W["k_proj"].reshape(Hk, K, d), W["v_proj"].reshape(Hk, r * V, d),
                     W["g_proj"].reshape(Hk, r * V, d)], axis=1).reshape(-1, d)
                out[a + "in_proj_ba.weight"] = jnp.concatenate(
                    [W["b_proj"].reshape(Hk, r, d), W["a_proj"].reshape(Hk, r, d)], axis=1).reshape(-1, d)
            else:
                out[a + "in_proj_qkv.weight"] = jnp.concatenate([W["q_proj"], W["k_proj"], W["v_proj"]], axis=0)
                out[a + "in_proj_z.weight"] = W["g_proj"]
                out[a + "in_proj_b.weight"] = W["b_proj"]
                out[a + "in_proj_a.weight"] = W["a_proj"]
            conv = jnp.concatenate([g("mixer", c, "weight") for c in ("q_conv", "k_conv", "v_conv")], axis=1)
            out[a + "conv1d.weight"] = _T(conv)[:, None, :]
            out[a + "A_log"] = g("mixer", "A_log")
            out[a + "dt_bias"] = g("mixer", "dt_bias")
            out[a + "norm.weight"] = g("mixer", "o_norm", "scale")
            out[a + "out_proj.weight"] = _T(g("mixer", "o_proj", "kernel"))
        else:
            a = h + "self_attn."
            q = _T(g("mixer", "q_proj", "kernel")).reshape(N, D, d)
            z = _T(g("mixer", "g_proj", "kernel")).reshape(N, D, d)
            out[a + "q_proj.weight"] = jnp.concatenate([q, z], axis=1).reshape(-1, d)
            for n in ("k_proj", "v_proj", "o_proj"):
                out[a + n + ".weight"] = _T(g("mixer", n, "kernel"))
            out[a + "q_norm.weight"] = g("mixer", "q_norm", "scale")
            out[a + "k_norm.weight"] = g("mixer", "k_norm", "scale")
    return out


def hf_to_params(t: Dict[str, jnp.ndarray], cfg: LMConfig, fused_layers: Dict[int, bool]) -> Dict[tuple, jnp.ndarray]:
    """HF tensors (names normalised, shapes checked) -> gdn_jax parameters (flat dict);
    ``fused_layers[i]``: GDN layer i stores Qwen3-Next's fused projections."""
    Hk, K, Hv, V, N, D = _sizes(cfg)
    r = Hv // Hk
    d = cfg.d_model
    p = {("embed", "embedding"): t["model.embed_tokens.weight"], ("norm", "scale"): t["model.norm.weight"]}
    if not cfg.tie_embeddings:
        p[("lm_head", "kernel")] = _T(t["lm_head.weight"])
    for i, m in enumerate(cfg.layer_mixers()):
        b, h = ("blocks", i), f"model.layers.{i}."
        p[b + ("norm1", "scale")] = t[h + "input_layernorm.weight"]
        p[b + ("norm2", "scale")] = t[h + "post_attention_layernorm.weight"]
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            p[b + ("mlp", ours, "kernel")] = _T(t[h + f"mlp.{theirs}.weight"])
        mx = b + ("mixer",)
        if m == "gdn":
            a = h + "linear_attn."
            if fused_layers[i]:
                W = t[a + "in_proj_qkvz.weight"].reshape(Hk, 2 * K + 2 * r * V, d)
                parts = {"q_proj": W[:, :K], "k_proj": W[:, K:2 * K], "v_proj": W[:, 2 * K:2 * K + r * V],
                         "g_proj": W[:, 2 * K + r * V:]}
                BA = t[a + "in_proj_ba.weight"].reshape(Hk, 2 * r, d)
                parts.update(b_proj=BA[:, :r], a_proj=BA[:, r:])
            else:
                qkv = t[a + "in_proj_qkv.weight"]
                parts = {"q_proj": qkv[:Hk * K], "k_proj": qkv[Hk * K:2 * Hk * K], "v_proj": qkv[2 * Hk * K:],
                         "g_proj": t[a + "in_proj_z.weight"], "b_proj": t[a + "in_proj_b.weight"],
                         "a_proj": t[a + "in_proj_a.weight"]}
            for n, w in parts.items():
                p[mx + (n, "kernel")] = _T(w.reshape(-1, d))
            conv = _T(t[a + "conv1d.weight"][:, 0, :])  # [W, C]
            p[mx + ("q_conv", "weight")] = conv[:, :Hk * K]
            p[mx + ("k_conv", "weight")] = conv[:, Hk * K:2 * Hk * K]
            p[mx + ("v_conv", "weight")] = conv[:, 2 * Hk * K:]
            p[mx + ("A_log",)] = t[a + "A_log"]
            p[mx + ("dt_bias",)] = t[a + "dt_bias"]
            p[mx + ("o_norm", "scale")] = t[a + "norm.weight"]
            p[mx + ("o_proj", "kernel")] = _T(t[a + "out_proj.weight"])
        else:
            a = h + "self_attn."
            q = t[a + "q_proj.weight"].reshape(N, 2 * D, d)
            p[mx + ("q_proj", "kernel")] = _T(q[:, :D].reshape(N * D, d))
            p[mx + ("g_proj", "kernel")] = _T(q[:, D:].reshape(N * D, d))
            for n in ("k_proj", "v_proj", "o_proj"):
                p[mx + (n, "kernel")] = _T(t[a + n + ".weight"])
            p[mx + ("q_norm", "scale")] = t[a + "q_norm.weight"]
            p[mx + ("k_norm", "scale")] = t[a + "k_norm.weight"]
    return p


def normalize_names(tensors: Dict[str, jnp.ndarray]) -> Dict[str, jnp.ndarray]:
    """Tensor names of a ``Qwen3_5ForConditionalGeneration`` checkpoint (``model.language_model.*``)
    mapped to the text model's (``model.*``); vision-tower and multi-token-prediction tensors dropped."""
    if not hasattr(tensors, "items"):
        raise TypeError(f"tensors must be a mapping {{name: array}} (e.g. safetensors' load_file), got "
                        f"{type(tensors).__name__}")
    out = {}
    for k, v in tensors.items():
        if k.startswith(IGNORED_PREFIXES):
            continue
        if k.startswith("model.language_model."):
            k = "model." + k[len("model.language_model."):]
        if k in out:
            raise CheckpointError(f"tensor {k!r} is stored twice (with and without the language_model prefix)")
        out[k] = v
    return out


def abstract_model(cfg: LMConfig):
    """``(graphdef, abstract params, other state)`` of ``LM(cfg)`` without allocating it."""
    abstract = nnx.eval_shape(lambda: LM(cfg, rngs=nnx.Rngs(0)))
    return nnx.split(abstract, nnx.Param, ...)


def _fused_layers(t: Dict[str, jnp.ndarray], cfg: LMConfig, default_fused: bool) -> Dict[int, bool]:
    out = {}
    for i, m in enumerate(cfg.layer_mixers()):
        if m != "gdn":
            continue
        a = f"model.layers.{i}.linear_attn."
        if a + "in_proj_qkvz.weight" in t:
            out[i] = True
        elif a + "in_proj_qkv.weight" in t:
            out[i] = False
        else:
            out[i] = default_fused
    return out


def from_hf(hf_config: dict, tensors: Dict[str, jnp.ndarray], **overrides) -> LM:
    """A gdn_jax :class:`~gdn_jax.models.LM` holding a Qwen3.5 / Qwen3-Next checkpoint's weights.

    ``hf_config``: the ``config.json`` dict; ``tensors``: ``{name: array}`` (any array type
    ``jnp.asarray`` takes). ``overrides``: see :func:`config_from_hf`; ``param_dtype`` defaults to
    the embedding tensor's dtype, ``dtype`` (compute) to float32. Every tensor the config implies
    must be present with its exact shape, and no other tensor may be (vision / MTP tensors
    excepted): otherwise :class:`CheckpointError` naming the tensor and the expected shape."""
    t = {k: jnp.asarray(v) for k, v in normalize_names(tensors).items()}
    emb = t.get("model.embed_tokens.weight")
    if emb is None:
        raise CheckpointError("missing tensor 'model.embed_tokens.weight'")
    overrides.setdefault("param_dtype", jnp.dtype(emb.dtype).name)
    cfg = config_from_hf(hf_config, **overrides)
    fused = _fused_layers(t, cfg, text_config(hf_config)["model_type"] == "qwen3_next")
    graphdef, params, rest = abstract_model(cfg)
    flat_abs = traverse_util.flatten_dict(nnx.to_pure_dict(params))
    # the HF tensors this config implies, by name and shape (from our abstract parameters)
    expected = {}
    for fl in (True, False):
        shapes = jax.eval_shape(lambda q: params_to_hf(q, cfg, fl), flat_abs)
        for k, s in shapes.items():
            layer = k.split(".")[2] if k.startswith("model.layers.") else None
            if layer is not None and int(layer) in fused and fused[int(layer)] != fl and ".linear_attn.in_proj" in k:
                continue
            expected[k] = s
    missing = [k for k in expected if k not in t]
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]!r} (expected shape {tuple(expected[missing[0]].shape)})"
                              + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    unexpected = sorted(set(t) - set(expected))
    if unexpected:
        if cfg.tie_embeddings and unexpected == ["lm_head.weight"]:
            del t["lm_head.weight"]  # tied: transformers may store the shared matrix twice
        else:
            raise CheckpointError(f"unexpected tensor {unexpected[0]!r} for this config"
                                  + (f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else "")
                                  + " (nothing was loaded)")
    for k, s in expected.items():
        if tuple(t[k].shape) != tuple(s.shape):
            raise CheckpointError(f"tensor {k!r} has shape {tuple(t[k].shape)}, expected {tuple(s.shape)} from "
                                  "config.json")
    flat = hf_to_params(t, cfg, fused)
    flat = {k: jnp.asarray(v, flat_abs[k].dtype) for k, v in flat.items()}
    if set(flat) != set(flat_abs):  # pragma: no cover - a converter bug
        raise AssertionError(f"converter left parameters unset: {sorted(set(flat_abs) ^ set(flat))[:3]}")
    nnx.replace_by_pure_dict(params, traverse_util.unflatten_dict(flat))
    return nnx.merge(graphdef, params, rest)


def model_params(model: LM) -> Dict[tuple, jnp.ndarray]:
    """The flat ``{path tuple: array}`` of a model's parameters."""
    return traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def hf_config_of(cfg: LMConfig, model_type: str = "qwen3_5_text") -> dict:
    """The transformers ``config.json`` dict of an LM in Qwen3.5 / Qwen3-Next form (CheckpointError
    naming the LMConfig field that has no HF counterpart)."""
    if model_type not in TEXT_TYPES:
        raise ValueError(f"model_type must be one of {TEXT_TYPES}, got {model_type!r}")
    mixers = cfg.layer_mixers()
    need = {"norm_style": "zero_centered", "decay": "mamba2", "decay_per_channel": False,
            "beta_per_channel": False, "allow_neg_eigval": False, "use_short_conv": True,
            "attn_bias": "", "pos_embedding": "none"}
    for k, v in need.items():
        if getattr(cfg, k) != v:
            raise CheckpointError(f"LMConfig.{k} = {getattr(cfg, k)!r} has no {model_type} counterpart (needs {v!r})")
    bad = sorted({m for m in mixers if m not in MIXER_TYPES})
    if bad:
        raise CheckpointError(f"LMConfig mixers {bad} have no {model_type} counterpart (needs 'gdn' / 'gated_attention')")
    if cfg.mlp_hidden <= 0:
        raise CheckpointError(f"LMConfig has no MLP (mlp_ratio / mlp_hidden_size); {model_type} layers all have one")
    Hk, K, Hv, V, N, D = _sizes(cfg)
    out = {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_hidden, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": N, "num_key_value_heads": cfg.attn_num_kv_heads or N, "head_dim": D,
        "linear_num_key_heads": Hk, "linear_num_value_heads": Hv, "linear_key_head_dim": K,
        "linear_value_head_dim": V, "linear_conv_kernel_dim": cfg.conv_size,
        "layer_types": [MIXER_TYPES[m] for m in mixers], "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "dtype": cfg.param_dtype,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": 0.25 if cfg.rope_fraction is None else cfg.rope_fraction},
    }
    if model_type == "qwen3_next":
        out.update(num_experts=0, mlp_only_layers=[], decoder_sparse_step=1)
    return out


def to_hf(model: LM, model_type: str = "qwen3_5_text") -> Tuple[dict, Dict[str, jnp.ndarray]]:
    """``(config.json dict, {name: array})`` of a gdn_jax LM as a transformers ``Qwen3_5ForCausalLM``
    (``model_type="qwen3_5_text"``: separate ``in_proj_qkv``/``z``/``b``/``a``) or
    ``Qwen3NextForCausalLM`` (``"qwen3_next"``: fused ``in_proj_qkvz``/``in_proj_ba``)."""
    hf = hf_config_of(model.cfg, model_type)
    return hf, params_to_hf(model_params(model), model.cfg, fused=model_type == "qwen3_next")
