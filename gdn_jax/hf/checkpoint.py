"""Reading and writing Hugging Face checkpoint directories (``config.json`` + ``*.safetensors``,
sharded index included) with the ``safetensors`` package: no hub access, no torch."""
from __future__ import annotations

import json
import numbers
import os
from typing import Dict, Tuple

import jax.numpy as jnp


class CheckpointError(ValueError):
    """A checkpoint gdn_jax cannot load as asked: a missing or unexpected tensor, a shape that does
    not match the config, a config field with a value gdn_jax does not implement. The message
    names the tensor or field and what was expected."""


def config_int(value, name: str, *, source: str = "config.json", minimum: int = 1) -> int:
    """An integer config field (JSON ints; a float with an integer value is taken), >= ``minimum``:
    :class:`CheckpointError` naming ``source`` and ``name`` otherwise (a string or 32.5 would be
    truncated or fail obscurely)."""
    ok = not isinstance(value, bool) and (isinstance(value, numbers.Integral)
                                          or (isinstance(value, numbers.Real) and float(value).is_integer()))
    if not ok or int(value) < minimum:
        raise CheckpointError(f"{source} {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


INDEX_NAME = "model.safetensors.index.json"


def _safetensors():
    try:
        from safetensors import safe_open
        from safetensors.flax import save_file
    except ImportError as e:  # pragma: no cover - the test extra installs it
        raise ImportError("gdn_jax.hf needs the 'safetensors' package: pip install safetensors") from e
    return safe_open, save_file


def read_config(path: str) -> dict:
    """``config.json`` of the checkpoint directory ``path``."""
    if os.path.isfile(path):
        raise CheckpointError(f"{path!r} is a file; give the Hugging Face checkpoint directory that holds "
                              "config.json and the *.safetensors files")
    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        raise CheckpointError(f"{path!r} has no config.json (expected a Hugging Face checkpoint directory)")
    return _read_json(f)


def _read_json(f: str):
    with open(f) as fh:
        try:
            return json.load(fh)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{f} is not valid JSON: {e}") from e


def read_tensors(path: str) -> Dict[str, jnp.ndarray]:
    """Every tensor of the checkpoint directory ``path`` as jax arrays in their stored dtype:
    the shards listed by ``model.safetensors.index.json`` when present, else every ``*.safetensors``
    file. A shard the index names that is missing, or a tensor stored twice, raises CheckpointError."""
    safe_open, _ = _safetensors()
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        index_json = _read_json(index)
        weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map' dict")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        weight_map = None
    if not files:
        raise CheckpointError(f"{path!r} holds no *.safetensors file")
    out: Dict[str, jnp.ndarray] = {}
    for name in files:
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            raise CheckpointError(f"shard {name!r} listed in {INDEX_NAME} is missing from {path!r}")
        try:
            with safe_open(f, framework="flax") as fh:
                for key in fh.keys():
                    if key in out:
                        raise CheckpointError(f"tensor {key!r} is stored in more than one shard")
                    out[key] = fh.get_tensor(key)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors' SafetensorError (header / size) and OSError
            raise CheckpointError(f"cannot read {f}: {type(e).__name__}: {e}") from e
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(out))
        if missing:
            raise CheckpointError(f"{INDEX_NAME} lists tensors no shard holds, e.g. {missing[:3]}")
    return out


def read_checkpoint(path: str) -> Tuple[dict, Dict[str, jnp.ndarray]]:
    """``(config dict, {name: array})`` of a checkpoint directory."""
    return read_config(path), read_tensors(path)


def write_checkpoint(path: str, config: dict, tensors: Dict[str, jnp.ndarray]) -> None:
    """Write ``config.json`` and one ``model.safetensors`` (metadata format "pt", as transformers
    expects) into the directory ``path`` (created if needed)."""
    _, save_file = _safetensors()
    text = json.dumps(config, indent=2, sort_keys=True)  # before any file is opened: no half-written config
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        fh.write(text)
    save_file({k: jnp.asarray(v) for k, v in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
