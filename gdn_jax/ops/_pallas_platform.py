"""Where the Pallas kernels of ``backend="pallas"`` run, and with which compiler parameters.

Everything platform-specific about the kernels lives here (one place):

* ``"gpu"``: the Triton lowering, selected by passing explicit
  ``jax.experimental.pallas.triton.CompilerParams(num_warps=..., num_stages=...)``.
  In jax 0.10/0.11 ``jax_pallas_use_mosaic_gpu`` is on by default, so a
  ``pallas_call`` *without* Triton parameters would go to Mosaic GPU instead.
  The Triton lowering is deprecated in jax 0.11; its deprecation warning is
  silenced for these calls only (filtered by message). f32 x f32 dots default
  to TF32 in Triton: the kernels ask for the precision they need explicitly
  (see :func:`dot_precision`).
* ``"tpu"``: Mosaic TPU (``pltpu.CompilerParams``); the kernels then use a
  head-major layout whose block shapes satisfy the (8, 128) rule.
* ``"interpret"``: ``interpret=True`` (CPU; how the tests run the GPU code path).
* ``"tpu_interpret"``: ``pltpu.InterpretParams()`` (CPU; TPU semantics: NaN-filled
  uninitialised memory, TPU block layout).

The platform is ``jax.default_backend()`` unless overridden with the
``GDN_PALLAS_PLATFORM`` environment variable, the module variable
``_FORCE_PLATFORM`` or the :func:`force_platform` context manager (tests use the
latter to run the TPU variant in interpret mode and to lower for TPU/GPU on a
CPU-only machine with ``jax.export``).
"""
from __future__ import annotations

import contextlib
import os
import re
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

PLATFORMS = ("gpu", "tpu", "interpret", "tpu_interpret")

_FORCE_PLATFORM: Optional[str] = None

JAX_VERSION = tuple(int(x) for x in re.findall(r"\d+", jax.__version__)[:3])

# Warnings about the (deprecated in jax 0.11) Triton lowering: silenced around our calls.
_TRITON_DEPRECATION = r"(?is).*(triton.*deprecat|deprecat.*triton).*"


def platform() -> str:
    """The platform the kernels are built for now: one of :data:`PLATFORMS`."""
    p = _FORCE_PLATFORM or os.environ.get("GDN_PALLAS_PLATFORM") or None
    if p is None:
        b = jax.default_backend()
        p = "gpu" if b in ("gpu", "cuda", "rocm") else "tpu" if b == "tpu" else "interpret"
    if p not in PLATFORMS:
        raise ValueError(f"GDN Pallas platform must be one of {PLATFORMS}, got {p!r}")
    return p


# Largest chunk the kernels use per platform and head dim. The result does not depend on the
# chunk size (the chunked form is exact), so the kernels may use a smaller chunk than
# ``chunk_size`` asks for. Measured on one H200, JAX 0.11.2, bf16 (2026-11-30):
#   (the "backward" figures timed jax.grad, from which XLA drops the unused forward kernels)
#   B4 T4096 H16 D128: C=64 backward 6.44 ms (the gradient kernel's C x C tiles spill
#   registers: 5.3 ms alone), C=32 3.05-3.30 ms; the forward ~1.0-1.1 ms either way. With
#   value_and_grad (true fwd+bwd): C=32 4.08 ms, C=16 4.98 ms (bench_value_and_grad_2026-11-30.txt).
#   B2 T8192 H8 D256:  C=64 backward 19.8 ms, C=16 6.96 ms with the whole-K gradient kernel (it spills at C=32: ~20 ms);
#   with that kernel split over two K blocks (pallas_kernels.Tuning.bk_grad) C=32 backward 5.1 ms vs 6.2-6.5
#   ms at C=16 (backward-only timings: results/bench_pallas_h200/bench_d256_ksplit_2026-11-30.txt).
MAX_KERNEL_CHUNK = {"gpu": ((128, 32), (256, 32))}  # (largest max(K, V), largest chunk)
# The forward kernels (intra + fused state pass/output) have no C x C gradient tiles, and the
# backward recomputes everything it needs from the inputs, so the forward may run at its own,
# larger chunk: half the sequential steps of the state pass. (B4 T4096 H16 D128 on an H200:
# forward 1.02 ms at C=64 vs 1.18 ms at C=32.) Applied to 16-bit inputs only (float32 inputs, with
# 3-pass TF32 dots, were not measured at C=64 and keep the backward's chunk; see pallas.prepare).
FWD_MAX_KERNEL_CHUNK = {"gpu": ((128, 64), (256, 32))}


def kernel_chunk(p: str, chunk_size: int, head_dim: int = 128, direction: str = "bwd") -> int:
    """The chunk the kernels run with on platform ``p`` for a requested ``chunk_size`` and
    ``head_dim = max(K, V)``; ``direction`` "fwd" (forward kernels) or "bwd" (backward)."""
    table = FWD_MAX_KERNEL_CHUNK if direction == "fwd" else MAX_KERNEL_CHUNK
    for d, c in table.get(p, ()):
        if head_dim <= d:
            return min(int(chunk_size), c)
    return int(chunk_size)


@contextlib.contextmanager
def force_platform(p: Optional[str]):
    """Temporarily build the kernels for platform ``p`` (None: automatic)."""
    global _FORCE_PLATFORM
    if p is not None and p not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {p!r}")
    old = _FORCE_PLATFORM
    _FORCE_PLATFORM = p
    try:
        yield
    finally:
        _FORCE_PLATFORM = old


def is_tpu_layout(p: str) -> bool:
    """TPU and its interpreter use the head-major, (8,128)-rule layout."""
    return p in ("tpu", "tpu_interpret")


def pallas_call_kwargs(p: str, *, num_warps: int = 4, num_stages: int = 2, n_grid: int = 2,
                       sequential_last: bool = False, vmem_bytes: Optional[int] = None) -> dict:
    """``interpret`` / ``compiler_params`` arguments of a ``pallas_call`` for platform ``p``."""
    if p == "gpu":
        from jax.experimental.pallas import triton as plt

        return dict(compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages))
    if p == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        sem = ["parallel"] * n_grid
        if sequential_last:
            sem[-1] = "arbitrary"
        return dict(compiler_params=pltpu.CompilerParams(dimension_semantics=tuple(sem), vmem_limit_bytes=vmem_bytes))
    if p == "tpu_interpret":
        from jax.experimental.pallas import tpu as pltpu

        return dict(interpret=pltpu.InterpretParams())
    return dict(interpret=True)


def tpu_vmem_bytes(blocks) -> Optional[int]:
    """Scoped-VMEM limit for a TPU kernel whose blocks [(BlockSpec, dtype)] are double-buffered:
    None (compiler default) when they fit in 12 MiB, else their padded size * 1.25, capped at
    100 MiB. (The state passes keep whole sequences in VMEM; VMEM is 128 MiB on v5e/v5p/v6e.)"""
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


def smem_spec(p: str, shape):
    """BlockSpec of a small int32 array read with dynamic scalar indices inside a kernel
    (TPU: scalar memory; elsewhere the whole array as one block)."""
    if is_tpu_layout(p):
        from jax.experimental.pallas import tpu as pltpu

        return pl.BlockSpec(memory_space=pltpu.SMEM)
    nd = len(shape)
    return pl.BlockSpec(tuple(shape), lambda *_: (0,) * nd)


def dot_precision(p: str, operand_dtype, role: str, tuning) -> object:
    """Precision argument for an in-kernel dot of ``operand_dtype`` operands.

    ``role`` is ``"inv"`` (the triangular inverse) or ``"mm"`` (everything else).
    Low-precision operands: default (tensor cores, f32 accumulation). f32 operands:
    HIGHEST off GPU; on GPU a Triton input precision (``tuning.gpu_f32_inv`` /
    ``tuning.gpu_f32_mm``): ``"tf32"``, ``"tf32x3"`` (3-pass TF32, ~f32 accurate) or
    ``"ieee"`` (no tensor cores; slow).
    """
    if jnp.dtype(operand_dtype) != jnp.float32:
        return None
    if p != "gpu":
        return jax.lax.Precision.HIGHEST
    name = tuning.gpu_f32_inv if role == "inv" else tuning.gpu_f32_mm
    if name == "tf32":
        return jax.lax.DotAlgorithmPreset.TF32_TF32_F32
    if name == "tf32x3":
        return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    if name == "ieee":
        return jax.lax.DotAlgorithmPreset.F32_F32_F32
    raise ValueError(f"unknown GPU f32 dot precision {name!r} (tf32, tf32x3, ieee)")


def call(p: str, fn, *args):
    """Invoke a built ``pallas_call`` (Triton deprecation warnings silenced on GPU)."""
    if p != "gpu":
        return fn(*args)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION)
        return fn(*args)


def silence_triton_deprecation_at_lowering() -> None:
    """Warnings raised while a jitted caller is *lowered* escape :func:`call`'s local filter
    (lowering happens later, outside our frame). On the GPU path we therefore also install
    one process-wide filter, restricted by message to the Triton-lowering deprecation."""
    warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION)
