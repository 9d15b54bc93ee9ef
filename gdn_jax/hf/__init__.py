"""Hugging Face checkpoints <-> gdn_jax (docs/huggingface.md).

* :func:`load_pretrained` / :func:`from_hf`: a local Qwen3.5 (``Qwen3_5ForCausalLM``, or the text
  part of ``Qwen3_5ForConditionalGeneration``) or dense Qwen3-Next checkpoint directory -> ``LM``.
* :func:`to_hf` / :func:`save_pretrained`: an ``LM`` -> a state dict / directory transformers loads.
* :func:`kda_from_hf` / :func:`kda_to_hf`: Kimi Linear's KDA layer <-> :class:`~gdn_jax.layers.KimiDeltaAttention`.

Reading uses the ``safetensors`` package only (no hub access, no torch).
"""
from __future__ import annotations

from .checkpoint import CheckpointError, read_checkpoint, read_config, read_tensors, write_checkpoint
from .kimi import kda_from_hf, kda_to_hf
from .qwen import config_from_hf, from_hf, hf_config_of, to_hf


def load_pretrained(path: str, **overrides):
    """``LM`` of the checkpoint directory ``path`` (``config.json`` + ``*.safetensors``, sharded or
    not). ``overrides``: ``backend``, ``chunk_size``, ``kernel_config``, ``dtype``, ``param_dtype``,
    ``decode_backend``, ``state_dtype``."""
    cfg, tensors = read_checkpoint(path)
    return from_hf(cfg, tensors, **overrides)


def save_pretrained(model, path: str, model_type: str = "qwen3_5_text") -> None:
    """Write ``model`` as a transformers checkpoint directory (``config.json`` + ``model.safetensors``)."""
    cfg, tensors = to_hf(model, model_type)
    write_checkpoint(path, cfg, tensors)


__all__ = ["CheckpointError", "config_from_hf", "from_hf", "hf_config_of", "kda_from_hf", "kda_to_hf",
           "load_pretrained", "read_checkpoint", "read_config", "read_tensors", "save_pretrained", "to_hf",
           "write_checkpoint"]
