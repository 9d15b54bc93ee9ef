"""Kimi Linear's KDA layer (transformers' ``KimiLinearDeltaAttention``) <-> :class:`~gdn_jax.layers.KimiDeltaAttention`.

Layout (transformers 5.24 ``modeling_kimi_linear.py``; the original checkpoints' names, accepted
too, in brackets): ``q_proj``/``k_proj``/``v_proj [H*K, d]``; ``conv1d.weight [3*H*K, 1, W]`` over
q | k | v (``q_conv1d``/``k_conv1d``/``v_conv1d [H*K, 1, W]``); ``forget_gate.f_a_proj [K, d]``,
``forget_gate.f_b_proj [H*K, K]``, ``forget_gate.dt_bias [H*K]``, ``forget_gate.A_log [1, 1, H, 1]``
(``f_a_proj``, ``f_b_proj``, ``dt_bias``, ``A_log`` on the layer); ``b_proj [H, d]``;
``g_a_proj [K, d]``, ``g_b_proj [H*K, K]``; ``o_norm.weight [K]``; ``o_proj [d, H*K]``.
The rest of Kimi Linear (MLA attention, MoE) is not supported.
"""
from __future__ import annotations

from typing import Dict

import jax
import jax.numpy as jnp
from flax import nnx

from ..layers.kda import KimiDeltaAttention
from .checkpoint import CheckpointError, config_int

_RENAMES = {"f_a_proj.weight": "forget_gate.f_a_proj.weight", "f_b_proj.weight": "forget_gate.f_b_proj.weight",
            "dt_bias": "forget_gate.dt_bias", "A_log": "forget_gate.A_log"}


def _kda_sizes(hf_config: dict):
    if not isinstance(hf_config, dict):
        raise TypeError(f"hf_config must be the Kimi Linear config.json dict, got {type(hf_config).__name__}")
    lac = hf_config.get("linear_attn_config") or {}
    get = lambda name, sub, default=None: hf_config.get(name, lac.get(sub, default))
    d = hf_config.get("hidden_size")
    H, K = get("linear_num_heads", "num_heads"), get("linear_head_dim", "head_dim")
    W = get("linear_conv_kernel_dim", "short_conv_kernel_size", 4)
    for name, v in (("hidden_size", d), ("linear_num_heads", H), ("linear_head_dim", K)):
        if v is None:
            raise CheckpointError(f"Kimi Linear config lacks the field {name!r}")
    act = hf_config.get("hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"Kimi Linear config hidden_act {act!r} is not supported (the KDA short conv "
                                  "is SiLU)")
    d, H, K, W = (config_int(v, name, source="Kimi Linear config") for name, v in
                  (("hidden_size", d), ("linear_num_heads", H), ("linear_head_dim", K), ("linear_conv_kernel_dim", W)))
    return d, H, K, W, float(hf_config.get("rms_norm_eps", 1e-5))


def _normalise(sd: Dict[str, jnp.ndarray], prefix: str) -> Dict[str, jnp.ndarray]:
    if not hasattr(sd, "items"):
        raise TypeError(f"state_dict must be a mapping {{name: array}}, got {type(sd).__name__}")
    out = {}
    for k, v in sd.items():
        if not k.startswith(prefix):
            continue
        k = k[len(prefix):]
        k = _RENAMES.get(k, k)
        out[k] = jnp.asarray(v)
    if all(f"{c}_conv1d.weight" in out for c in "qkv") and "conv1d.weight" not in out:
        out["conv1d.weight"] = jnp.concatenate([out.pop(f"{c}_conv1d.weight") for c in "qkv"], axis=0)
    return out


def kda_to_hf(layer: KimiDeltaAttention, prefix: str = "") -> Dict[str, jnp.ndarray]:
    """The ``KimiLinearDeltaAttention`` state dict (transformers names, each key prefixed with
    ``prefix``) of a :class:`KimiDeltaAttention`. Only tensors: the config that goes with them must
    carry the layer's ``norm_eps`` as ``rms_norm_eps`` (the layer's default is 1e-6; a config
    without the field means transformers' default, 1e-5, in :func:`kda_from_hf` as in transformers).

    Raises:
      CheckpointError: a layer built with ``use_short_conv=False`` (Kimi Linear's layer always has
        the short convolution: there is no checkpoint form without it).
    """
    if not layer.use_short_conv:
        raise CheckpointError("kda_to_hf: KimiDeltaAttention.use_short_conv=False has no Kimi Linear counterpart "
                              "(KimiLinearDeltaAttention always has the q / k / v short convolutions)")
    T = lambda lin: jnp.swapaxes(lin.kernel[...], 0, 1)
    H = layer.num_heads
    conv = jnp.concatenate([c.weight[...] for c in (layer.q_conv, layer.k_conv, layer.v_conv)], axis=1)
    out = {
        "q_proj.weight": T(layer.q_proj), "k_proj.weight": T(layer.k_proj), "v_proj.weight": T(layer.v_proj),
        "conv1d.weight": jnp.swapaxes(conv, 0, 1)[:, None, :],
        "forget_gate.f_a_proj.weight": T(layer.f_a_proj), "forget_gate.f_b_proj.weight": T(layer.f_b_proj),
        "forget_gate.dt_bias": layer.dt_bias[...], "forget_gate.A_log": layer.A_log[...].reshape(1, 1, H, 1),
        "b_proj.weight": T(layer.b_proj), "g_a_proj.weight": T(layer.g_a_proj), "g_b_proj.weight": T(layer.g_b_proj),
        "o_norm.weight": layer.o_norm.scale[...], "o_proj.weight": T(layer.o_proj),
    }
    return {prefix + k: v for k, v in out.items()}


def kda_from_hf(state_dict: Dict[str, jnp.ndarray], hf_config: dict, *, prefix: str = "",
                param_dtype=None, **layer_kw) -> KimiDeltaAttention:
    """A :class:`KimiDeltaAttention` holding the weights of one ``KimiLinearDeltaAttention``.

    ``state_dict``: the layer's tensors (keys after ``prefix``, e.g. ``"model.layers.0.self_attn."``
    for a full Kimi Linear checkpoint; other keys are ignored); ``hf_config``: the Kimi Linear
    ``config.json`` dict (``hidden_size``, ``linear_num_heads`` / ``linear_head_dim`` /
    ``linear_conv_kernel_dim`` or its ``linear_attn_config``, ``rms_norm_eps``). ``layer_kw``:
    ``backend``, ``chunk_size``, ``dtype``, ... of the layer (not ``use_short_conv``: the checkpoint
    has the convolutions). ``param_dtype``: the layer's parameter dtype; None: ``q_proj.weight``'s
    (float32 if the state dict has none).

    Raises:
      CheckpointError: a missing, unexpected or mis-shaped tensor (naming it and the expected
        shape), no tensor under ``prefix``, a config field missing or not a positive integer.
      NotImplementedError: a config whose ``hidden_act`` is not ``"silu"``.
      TypeError: ``hf_config`` not a dict, ``state_dict`` not a mapping.
      ValueError: ``use_short_conv`` in ``layer_kw``.
    """
    if "use_short_conv" in layer_kw:
        raise ValueError("kda_from_hf: use_short_conv is not a layer option here (a Kimi Linear checkpoint "
                         "always has the q / k / v short convolutions)")
    d, H, K, W, eps = _kda_sizes(hf_config)
    t = _normalise(state_dict, prefix)
    if not t:
        raise CheckpointError(f"no tensor of the state dict starts with prefix {prefix!r}")
    if param_dtype is None:
        param_dtype = t["q_proj.weight"].dtype if "q_proj.weight" in t else jnp.float32
    make = lambda: KimiDeltaAttention(d, H, K, conv_size=W, norm_eps=eps, param_dtype=param_dtype,
                                      rngs=nnx.Rngs(0), **layer_kw)
    expected = {k: v.shape for k, v in jax.eval_shape(lambda: kda_to_hf(make())).items()}
    for k, shape in expected.items():
        if k not in t:
            raise CheckpointError(f"missing tensor {prefix + k!r} (expected shape {tuple(shape)})")
        got = tuple(t[k].shape)
        if k == "forget_gate.A_log" and int(jnp.size(t[k])) == H:
            continue  # [H] or [1, 1, H, 1]
        if got != tuple(shape):
            raise CheckpointError(f"tensor {prefix + k!r} has shape {got}, expected {tuple(shape)}")
    extra = sorted(set(t) - set(expected))
    if extra:
        raise CheckpointError(f"unexpected tensor {prefix + extra[0]!r} in the KDA layer's state dict")
    layer = make()
    T = lambda w: jnp.swapaxes(w, 0, 1)
    dt = jnp.dtype(param_dtype)
    for name in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj"):
        getattr(layer, name).kernel[...] = T(t[name + ".weight"]).astype(dt)
    layer.f_a_proj.kernel[...] = T(t["forget_gate.f_a_proj.weight"]).astype(dt)
    layer.f_b_proj.kernel[...] = T(t["forget_gate.f_b_proj.weight"]).astype(dt)
    layer.dt_bias[...] = t["forget_gate.dt_bias"].astype(dt)
    layer.A_log[...] = t["forget_gate.A_log"].reshape(H).astype(dt)
    conv = T(t["conv1d.weight"][:, 0, :]).astype(dt)
    layer.q_conv.weight[...], layer.k_conv.weight[...], layer.v_conv.weight[...] = (
        conv[:, :H * K], conv[:, H * K:2 * H * K], conv[:, 2 * H * K:])
    layer.o_norm.scale[...] = t["o_norm.weight"].astype(dt)
    return layer
