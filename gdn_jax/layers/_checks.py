"""Argument checks shared by the token mixers (construction and call time)."""
from __future__ import annotations

import math
import numbers
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np


def positive_int(name: str, value, *, minimum: int = 1) -> int:
    """``value`` as an int ``>= minimum``; TypeError for non-integers (bools included), ValueError below."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def rngs(value) -> None:
    """A layer's ``rngs`` must be a ``flax.nnx.Rngs`` (TypeError otherwise, not an AttributeError later)."""
    from flax import nnx

    if not isinstance(value, nnx.Rngs):
        raise TypeError(f"rngs must be a flax.nnx.Rngs (e.g. nnx.Rngs(0)), got {type(value).__name__} {value!r}")


def flag(name: str, value) -> bool:
    """``value`` as a bool (TypeError for anything else: ``"no"`` or ``1`` would be read as True)."""
    from ..ops._common import check_flags

    check_flags(**{name: value})
    return bool(value)


def positive_float(name: str, value) -> float:
    """``value`` as a float > 0 (TypeError / ValueError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return float(value)


def float_dtype(name: str, value):
    """``value`` as a floating ``jnp.dtype`` (ValueError for unknown or non-floating dtypes)."""
    try:
        dt = jnp.dtype(value)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"{name} must be a floating dtype (e.g. jnp.float32, 'bfloat16'), got {value!r}")
    return dt


def one_of(name: str, value, allowed) -> str:
    """ValueError unless ``value`` is in ``allowed``."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")
    return value


def mixer_input(x, hidden_size: int, cu_seqlens=None, *, name: str = "x"):
    """A mixer's input: floating ``[B, T, hidden_size]``; ``cu_seqlens`` integer ``[N + 1]`` with B = 1."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array [B, T, {hidden_size}], got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must have a floating dtype (the layer's input activations), got {x.dtype}")
    if x.ndim != 3 or x.shape[-1] != hidden_size:
        raise ValueError(f"{name} must have shape [B, T, {hidden_size}], got {tuple(x.shape)}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{name} must have B >= 1 and T >= 1, got shape {tuple(x.shape)}")
    if cu_seqlens is not None:
        cu_seqlens_arg(cu_seqlens, x.shape[0], x.shape[1])


def step_input(x_t, hidden_size: int, cache=None, cache_type=None):
    """A decode step's input: floating ``[B, 1, hidden_size]`` (named ``x_t`` in the errors) and,
    with ``cache_type``, a cache of that type."""
    if hasattr(x_t, "ndim") and x_t.ndim != 3:
        raise ValueError(f"x_t must have shape [B, 1, {hidden_size}], got {tuple(x_t.shape)}")
    if cache_type is not None and not isinstance(cache, cache_type):
        raise TypeError(f"cache must be a {cache_type.__name__} (from init_cache or prefill), got {type(cache).__name__}")
    mixer_input(x_t, hidden_size, name="x_t")
    if x_t.shape[1] != 1:
        raise ValueError(f"x_t must have shape [B, 1, {hidden_size}], got {tuple(x_t.shape)}")
    if cache is not None:
        batches = sorted({a.shape[0] for a in jax.tree_util.tree_leaves(cache) if np.ndim(a) >= 1})
        if batches != [x_t.shape[0]]:
            raise ValueError(f"x_t has batch B = {x_t.shape[0]}, the cache has batch "
                             f"{batches[0] if len(batches) == 1 else batches}: init_cache / prefill with x_t's B")


def cu_seqlens_arg(cu_seqlens, batch: int, T: Optional[int] = None):
    """``cu_seqlens`` must be an integer ``[N + 1]`` array (N >= 1) and the batch size 1; with ``T``,
    a concrete ``cu_seqlens`` must also start at 0, end at T and be non-decreasing (a traced one
    is checked inside the mixer, whose output is then NaN)."""
    shape = tuple(np.shape(cu_seqlens))
    dtype = getattr(cu_seqlens, "dtype", None) or np.asarray(cu_seqlens).dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"cu_seqlens must be an integer array [N + 1], got dtype {dtype}")
    if len(shape) != 1 or shape[0] < 2:
        raise ValueError(f"cu_seqlens must have shape [N + 1] (1-D, N >= 1 packed sequences), got shape {shape}")
    if batch != 1:
        raise ValueError(f"cu_seqlens (packed sequences) needs batch size B = 1, got B = {batch}")
    if T is not None:
        from ..ops._common import check_cu_values

        check_cu_values(cu_seqlens, T)


STATE_DTYPES = ("float32", "bfloat16")
# the step op's backends ("auto", "scan", "pallas") and "fused_layer": the whole GDN layer's decode in
# one kernel (gdn_jax.ops.pallas.decode_layer; "auto" picks it on a GPU where it applies)
DECODE_BACKENDS = ("auto", "scan", "pallas", "fused_layer")


def decode_options(decode_backend: str, state_dtype, *, K: int, V: int, dtype, owner: str = "",
                   check_kernel: bool = True):
    """The decode step's options of a delta-rule mixer, checked when the layer or config is built.

    ``decode_backend`` one of :data:`DECODE_BACKENDS` ("auto", "scan", "pallas", "fused_layer");
    ``state_dtype`` float32 or bfloat16 (the dtype of the cache's recurrent state). With
    ``decode_backend="pallas"`` or ``"fused_layer"`` (and ``check_kernel``) the fused decode kernel must
    take the head dims and dtypes (``ValueError`` with its reason; the layer checks the rest of
    ``"fused_layer"``'s conditions). Returns ``state_dtype`` as a ``jnp.dtype``."""
    one_of("decode_backend", decode_backend, DECODE_BACKENDS)
    sdt = float_dtype("state_dtype", state_dtype)
    if sdt.name not in STATE_DTYPES:
        raise ValueError(f"{owner}state_dtype must be one of {STATE_DTYPES}, got {sdt.name!r}")
    if decode_backend in ("pallas", "fused_layer") and check_kernel:
        from ..ops.pallas import decode as _decode

        # the step's inputs: q, k, v in the compute dtype, g and beta in float32
        reason = _decode.covers(K, V, jnp.promote_types(jnp.dtype(dtype), jnp.float32), sdt)
        if reason is not None:
            raise ValueError(f"{owner}decode_backend={decode_backend!r} (the fused decode kernel) does not take {reason}; "
                             "use decode_backend='scan' or 'auto'")
    return sdt
