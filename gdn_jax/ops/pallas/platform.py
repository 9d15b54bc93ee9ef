"""Where the Pallas kernels run and the ``pallas_call`` arguments each platform needs.

Platforms (:data:`PLATFORMS`; ``KernelConfig.platform`` picks one, None means the platform of
``jax.default_backend()``):

* ``"gpu"``: the Triton lowering, selected by passing explicit
  ``jax.experimental.pallas.triton.CompilerParams(num_warps=..., num_stages=...)``. In JAX
  0.10/0.11 a ``pallas_call`` *without* Triton parameters goes to Mosaic GPU instead. The
  Triton lowering is deprecated in JAX 0.11; its deprecation warning is silenced for these calls
  only (filtered by message). float32 x float32 dots default to TF32 in Triton: the kernels ask
  for the precision they need explicitly (``KernelCall.f32_inv`` / ``f32_mm``).
* ``"tpu"``: Mosaic TPU (``pltpu.CompilerParams``); the kernels then use a head-major layout
  whose blocks satisfy the (8, 128) rule, and small int32 arrays live in SMEM.
* ``"interpret"``: ``interpret=True`` (CPU; how the tests run the GPU code path).
* ``"tpu_interpret"``: ``pltpu.InterpretParams()`` (CPU; TPU semantics: NaN-filled
  uninitialised memory, the TPU block layout).
"""
from __future__ import annotations

import warnings
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

PLATFORMS = ("gpu", "tpu", "interpret", "tpu_interpret")

# Warnings about the (deprecated in JAX 0.11) Triton lowering: silenced around our calls.
_TRITON_DEPRECATION = r"(?is).*(triton.*deprecat|deprecat.*triton).*"


def default_platform() -> str:
    """The kernel platform of ``jax.default_backend()``: "gpu", "tpu" or (CPU) "interpret"."""
    b = jax.default_backend()
    return "gpu" if b in ("gpu", "cuda", "rocm") else "tpu" if b == "tpu" else "interpret"


def is_hopper() -> bool:
    """True when JAX's first device is an NVIDIA GPU of compute capability 9.x (H100 / H200):
    the Mosaic GPU kernels of :mod:`gdn_jax.ops.pallas.hopper` need sm_90 (TMA, wgmma)."""
    try:
        d = jax.devices()[0]
    except RuntimeError:
        return False
    return d.platform == "gpu" and str(getattr(d, "compute_capability", "")).split(".")[0] == "9"


def hopper_asked(gpu_kernels, platform: str) -> bool:
    """The Hopper (Mosaic GPU) kernels are asked for on ``platform``: ``KernelConfig.gpu_kernels``
    "mosaic", or its default (None) on an sm_90 GPU. Whether they take a call is the path table's
    decision (:mod:`.paths`); this is what the sequence split's planner reads."""
    return platform == "gpu" and (gpu_kernels == "mosaic" or (gpu_kernels is None and is_hopper()))


def interpreted(p: str) -> bool:
    """The kernels of platform ``p`` run in an interpreter (on the CPU)."""
    return p in ("interpret", "tpu_interpret")


def is_tpu_layout(p: str) -> bool:
    """TPU and its interpreter use the head-major, (8, 128)-rule layout."""
    return p in ("tpu", "tpu_interpret")


def tpu_vmem_bytes(blocks) -> Optional[int]:
    """Scoped-VMEM limit for a TPU kernel whose blocks [(BlockSpec, dtype)] are double-buffered:
    None (compiler default) when they fit in 12 MiB, else their padded size * 1.25, capped at
    100 MiB (VMEM is 128 MiB on v5e/v5p/v6e). Every TPU kernel streams per-chunk blocks
    (:mod:`.state_tpu`), so at the shapes measured (``benchmarks/vmem_budget.py``) this is None."""
    total = 0
    for spec, dt in blocks:
        shape = [d for d in (getattr(spec, "block_shape", None) or ()) if d is not None]
        if not shape:
            continue
        item = jnp.dtype(dt).itemsize
        shape = [1] * max(0, 2 - len(shape)) + list(shape)
        shape[-1] = -(-shape[-1] // 128) * 128
        sub = 8 * max(1, 4 // item)
        shape[-2] = -(-shape[-2] // sub) * sub
        n = 1
        for d in shape:
            n *= int(d)
        total += 2 * n * item
    if total <= 12 * 2**20:
        return None
    return int(min(total * 1.25, 100 * 2**20))


def call_kwargs(p: str, *, num_warps: int, num_stages: int, n_grid: int, blocks=None, semantics=None) -> dict:
    """``interpret`` / ``compiler_params`` arguments of a ``pallas_call`` for platform ``p``;
    ``blocks`` [(BlockSpec, dtype)] sizes the TPU VMEM limit, ``semantics`` the TPU grid's
    dimension semantics (default: every axis "parallel")."""
    if p == "gpu":
        from jax.experimental.pallas import triton as plt

        return dict(compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages))
    if p == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        vmem = tpu_vmem_bytes(blocks) if blocks else None
        return dict(compiler_params=pltpu.CompilerParams(dimension_semantics=tuple(semantics or ("parallel",) * n_grid),
                                                         vmem_limit_bytes=vmem))
    if p == "tpu_interpret":
        from jax.experimental.pallas import tpu as pltpu

        return dict(interpret=pltpu.InterpretParams())
    return dict(interpret=True)


def smem_spec(p: str, shape):
    """BlockSpec of a small int32 array read with dynamic scalar indices inside a kernel
    (TPU: scalar memory; elsewhere the whole array as one block)."""
    if is_tpu_layout(p):
        from jax.experimental.pallas import tpu as pltpu

        return pl.BlockSpec(memory_space=pltpu.SMEM)
    nd = len(shape)
    return pl.BlockSpec(tuple(shape), lambda *_: (0,) * nd)


def dot_precision(p: str, operand_dtype, f32_name: str):
    """Precision argument of an in-kernel dot of ``operand_dtype`` operands: None (tensor cores,
    float32 accumulation) for 16-bit operands; for float32 operands HIGHEST off GPU and on GPU the
    Triton input precision ``f32_name``: "tf32", "tf32x3" (3-pass TF32, ~float32 accurate) or
    "ieee" (no tensor cores; slow)."""
    if jnp.dtype(operand_dtype) != jnp.float32:
        return None
    if p != "gpu":
        return jax.lax.Precision.HIGHEST
    presets = {"tf32": jax.lax.DotAlgorithmPreset.TF32_TF32_F32,
               "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
               "ieee": jax.lax.DotAlgorithmPreset.F32_F32_F32}
    return presets[f32_name]


def invoke(p: str, fn, *args):
    """Invoke a built ``pallas_call`` (Triton deprecation warnings silenced on GPU).

    Raises:
      ValueError: an interpreted platform (CPU) inside ``jax.shard_map(..., check_vma=True)`` (its
        arguments typed varying over mesh axes): JAX's Pallas interpreter (0.10, 0.11) evaluates the
        kernel body without those types and fails when the program is lowered; the compiled kernels
        (GPU, TPU) are typed (:func:`gdn_jax.ops._vma.varying_struct`) and run there.
    """
    if interpreted(p):
        from .._vma import varying_axes

        axes = set().union(*(varying_axes(a) for a in args))
        if axes:
            raise ValueError(f"backend='pallas' runs its kernels in the Pallas interpreter here (platform {p!r}), "
                             f"which JAX cannot run inside jax.shard_map(..., check_vma=True) (the arguments vary "
                             f"over mesh axes {sorted(axes, key=str)}): pass check_vma=False to that shard_map, or "
                             f"use backend='chunk' on the CPU (gdn_jax.ops.context_parallel.shard_gated_delta_rule "
                             f"sets check_vma itself)")
    if p != "gpu":
        return fn(*args)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION)
        return fn(*args)


def silence_triton_deprecation_at_lowering() -> None:
    """Warnings raised while a jitted caller is *lowered* escape :func:`invoke`'s local filter
    (lowering happens later, outside our frame). On the GPU path we therefore also install one
    process-wide filter, restricted by message to the Triton-lowering deprecation."""
    warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION)
