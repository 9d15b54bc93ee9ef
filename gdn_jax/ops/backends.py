"""The backend rules of ``gated_delta_rule``, in one place: the backend names, which backend takes
which call (gate forms, chunk sizes, head dims, dtypes), what ``backend="auto"`` picks, and who takes
a ``kernel_config``. The op (:mod:`.gated_delta_rule`), the layers (``gdn_jax.layers``) and
``gdn_jax.models.LMConfig`` all check through these functions; the messages name the argument.

What the Pallas kernels cover is their own statement (:func:`gdn_jax.ops.pallas.supports`, with
:func:`~gdn_jax.ops.pallas.check_supported` and :func:`~gdn_jax.ops.pallas.config.check_type` for
the op's errors), which the rules here ask; the kernel package imports nothing from this module.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from ._common import GateForms

BACKENDS = ("auto", "scan", "chunk", "pallas")
AUTO_F32_MIN_DIM = 32  # float32 inputs on GPU: auto picks pallas from this max(K, V) on (measured) ...
AUTO_F32_MAX_DIM = 128  # ... up to this one (head dim 256: chunk, measured 2.7x faster)

# what follows the reason of an explicit backend that does not take a layer's or config's options
_OPTION_HINTS = {"chunk": " (beta_per_channel=True); use backend='scan' or 'auto'", "pallas": ""}


def _pallas_module():
    from . import pallas as _pallas  # imported lazily: the kernels pull in jax.experimental.pallas

    return _pallas


def check_name(backend) -> str:
    """``backend`` must be one of :data:`BACKENDS` (``ValueError`` naming it otherwise)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def check_kernel_config(kernel_config, backend) -> None:
    """``kernel_config`` must be None, or a ``gdn_jax.ops.KernelConfig`` with a backend that runs
    the Pallas kernels ("pallas" or "auto").

    Raises:
      ValueError: a kernel_config with another backend.
      TypeError: a kernel_config that is not a ``KernelConfig``.
    """
    if kernel_config is None:
        return
    if backend not in ("pallas", "auto"):
        raise ValueError(f"kernel_config configures the Pallas kernels; backend={backend!r} takes none "
                         "(use backend='pallas' or 'auto')")
    _pallas_module().check_type(kernel_config)


def unsupported(backend: str, forms: GateForms, *, chunk_size: int, K: int, V: int, dtype) -> Optional[str]:
    """None when an explicit ``backend`` takes a call with these options, else why not (naming the
    option): ``"scan"`` takes every call, ``"chunk"`` no per-value-channel beta, ``"pallas"`` what
    its kernels take (:func:`gdn_jax.ops.pallas.supports`); ``"auto"`` always finds one.
    :func:`resolve_backend` raises on the same rules at the op's call."""
    if backend == "chunk" and forms.beta_per_channel:
        return "does not take per-value-channel beta"
    if backend == "pallas":
        return _pallas_module().supports(forms, chunk_size=chunk_size, K=K, V=V, dtype=dtype)
    return None


def check_options(backend: str, *, chunk_size: int, K: int, V: int, decay_per_channel: bool,
                  beta_per_channel: bool, dtype, owner: str = "") -> None:
    """A layer's or config's options must be ones its explicit ``backend`` takes (checked when the
    layer or config is built, not at its first call): ``ValueError`` with the reason of
    :func:`unsupported`, prefixed by ``owner`` (e.g. ``"GatedDeltaNet: "``)."""
    reason = unsupported(backend, GateForms(bool(decay_per_channel), bool(beta_per_channel)), chunk_size=chunk_size,
                         K=K, V=V, dtype=dtype)
    if reason is not None:
        raise ValueError(f"{owner}backend={backend!r} {reason}{_OPTION_HINTS[backend]}")


def resolve_backend(backend: str, forms: GateForms, *, chunk_size: int, K: int, V: int, dtype, platform: Optional[str] = None) -> str:
    """Map ``backend`` (``"auto"`` included) to the concrete backend that will run the call.

    ``"auto"``: ``"pallas"`` on GPU/TPU for 16-bit (bfloat16/float16) inputs its kernels cover,
    and on GPU for float32 inputs with :data:`AUTO_F32_MIN_DIM` (32) <= max(K, V) <=
    :data:`AUTO_F32_MAX_DIM` (128); else
    ``"chunk"``; ``"scan"`` for per-value-channel beta (the only backend that takes it).
    float32 on GPU: the kernels' float32 dots default to 1-pass TF32 (``Precision.gpu_f32_*``,
    XLA's default for float32 matmuls, which the chunk form runs with). Measured on an H200 (JAX
    0.11.2, ``benchmarks/bench_train_step.py``, 2-layer MQAR LM, L 512, B 128, 2 heads,
    float32; ``results/hopper_h200/``): a gdn training step takes 4.97 / 11.34 ms with pallas (1-pass
    TF32) against 8.90 ms with chunk at d 128 (K = V = 64) and 15.6 ms at d 256
    (K = V = 128); with 3-pass TF32 it took 19.2 / 57.9 ms. At K = V = 256 (d 512,
    ``results/hopper_h200/``) pallas (float32 runs the Triton kernels at every
    head dim; the Hopper kernels take bf16) took 91.7 ms against chunk's 34.0 ms (deltanet 91.4 /
    33.6), so float32 heads wider than 128 stay on chunk. At K = V = 32 (d 64,
    ``results/hopper_h200/``) pallas took 3.60 ms against chunk's 5.76 (deltanet 3.46 / 5.56).
    Float32 heads below 32 stay on chunk (not measured).

    Args:
      backend: ``"auto"``, ``"scan"``, ``"chunk"`` or ``"pallas"``.
      forms: the call's :class:`GateForms` (per-channel g / beta), from ``check_inputs``.
      chunk_size, K, V: the call's chunk and head dims (pallas covers only some).
      dtype: the dtype that decides ``"auto"``: :func:`gated_delta_rule` passes ``v.dtype``, or
        float64 when any input is float64 (so auto goes by v's dtype, not q's).
      platform: ``"gpu"`` / ``"cuda"`` / ``"rocm"`` / ``"tpu"`` / ``"cpu"``; None:
        ``jax.default_backend()``.

    Raises:
      ValueError: unknown backend name.
      NotImplementedError: an explicit backend that cannot take the call's options.
    """
    check_name(backend)
    if backend == "auto":
        platform = platform or jax.default_backend()
        gpu = platform in ("gpu", "cuda", "rocm")
        f32_ok = gpu and jnp.dtype(dtype) == jnp.float32 and AUTO_F32_MIN_DIM <= max(K, V) <= AUTO_F32_MAX_DIM
        if (gpu or platform == "tpu") and (jnp.dtype(dtype).itemsize == 2 or f32_ok):
            try:
                pl = _pallas_module()
            except ImportError:  # pragma: no cover - Pallas unavailable on this install
                pl = None
            if pl is not None and pl.supports(forms, chunk_size=chunk_size, K=K, V=V, dtype=dtype) is None:
                return "pallas"
        if forms.beta_per_channel:
            return "scan"
        return "chunk"
    if backend == "chunk" and forms.beta_per_channel:
        raise NotImplementedError(
            "backend='chunk' does not take per-value-channel beta [B,T,H,V]; use backend='scan' "
            "(or backend='auto', which picks it)"
        )
    if backend == "pallas":  # NotImplementedError with the reason of pallas.supports
        _pallas_module().check_supported(forms, chunk_size=chunk_size, K=K, V=V, dtype=dtype)
    return backend
