"""RMSNorm variants of the LM and attention layers: the standard one (``x / rms(x) * w``, flax's
``nnx.RMSNorm``) and Qwen3.5 / Qwen3-Next's zero-centred one (``x / rms(x) * (1 + w)``, w init 0)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from . import _checks

NORM_STYLES = ("standard", "zero_centered")


class ZeroCenteredRMSNorm(nnx.Module):
    """``x * rsqrt(mean(x^2) + eps) * (1 + scale)`` computed in float32, returned in ``dtype``
    (Qwen3-Next / Qwen3.5's ``RMSNorm``: the parameter is stored as the offset from 1 and starts at 0).

    The parameter is named ``scale`` like ``nnx.RMSNorm``'s, so code that reads norm weights by
    path works for both styles.

    Args:
      dim: the normalised (last) axis's size. epsilon: added to ``mean(x^2)`` (> 0).
      dtype: the output's dtype (None: x's). param_dtype: the scale's. rngs: unused (the scale
        starts at 0), accepted for the signature of ``nnx.RMSNorm``.

    Raises:
      ValueError / TypeError: ``dim`` not a positive integer, ``epsilon`` not a positive finite
        number, a dtype that is not a floating dtype.
    """

    def __init__(self, dim: int, *, epsilon: float = 1e-6, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs = None):
        _checks.positive_int("dim", dim)
        _checks.positive_float("epsilon", epsilon)
        dtype = None if dtype is None else _checks.float_dtype("dtype", dtype)
        param_dtype = _checks.float_dtype("param_dtype", param_dtype)
        self.scale = nnx.Param(jnp.zeros((dim,), param_dtype))
        self.epsilon, self.dtype = epsilon, dtype

    def __call__(self, x):
        x32 = jnp.asarray(x, jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
        y = y * (1.0 + self.scale[...].astype(jnp.float32))
        return y.astype(self.dtype if self.dtype is not None else x.dtype)


def rms_norm(style: str, dim: int, *, epsilon: float, dtype, param_dtype, rngs: nnx.Rngs):
    """An RMSNorm of ``style`` (:data:`NORM_STYLES`) over the last axis of size ``dim``."""
    if style == "standard":
        return nnx.RMSNorm(dim, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    if style == "zero_centered":
        return ZeroCenteredRMSNorm(dim, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    raise ValueError(f"norm_style must be one of {NORM_STYLES}, got {style!r}")
