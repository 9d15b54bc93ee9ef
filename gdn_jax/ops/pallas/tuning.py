"""Options of the portable kernels (:mod:`.wy`, :mod:`.state_fwd`, :mod:`.state_bwd`, :mod:`.grads`,
:mod:`.state_tpu`: Triton on GPU, Mosaic TPU, interpret): :class:`TritonTuning`
(``KernelConfig(triton=...)``), blocks, launch settings and structure. Plain Python."""
from __future__ import annotations

import dataclasses
from typing import Optional

from .checks import check_bool, check_int


@dataclasses.dataclass(frozen=True)
class TritonTuning:
    """Blocks, launch settings and structure of the portable kernels; none changes the result beyond
    rounding. None: chosen per call by :func:`gdn_jax.ops.pallas.config.resolve`.

    Attributes:
      bv_state: value-channel block of the state passes (None: >= ~256 programs on GPU; TPU: V or
        128); also the Hopper state pass's block where given (16, 32 or 64 dividing V; another
        value sends the forward to these kernels, ``forward_kernels`` says why).
      bv_out: value block of the unfused output kernel (None: min(V, 128)).
      bv_grad: value block of the gradient kernel's V loop (None: min(V, 64)).
      bk_grad: key block of the gradient kernel (below K: a K-split grid; None: K up to 128, else 128).
      warps_wy, warps_state, warps_out: Triton ``num_warps`` of the WY, state and output kernels
        (a power of two <= 32; default 4).
      warps_grad: ``num_warps`` of the gradient kernel (None: 8 for head dims >= 128, else 4).
      num_stages: Triton ``num_stages`` (None: 2).
      fuse_output: the forward state pass also writes o (default True), else a separate output kernel.
      save_t: the backward WY kernel writes T for the gradient kernel (None: with the whole-K one).
      merge_state: the backward's two state passes in one launch (GPU / interpret; None: on GPU
        when they have at most 128 programs).
      gatefree: the forward in the gate-free form (path ``gatefree`` of :mod:`.paths`: the kernel of
        :func:`.inverse_gatefree.t0_and_aqk` writes T0 = (I + strictly_lower(diag(beta) K K^T))^-1
        and Aqk, and the state pass forms Vn from (T0 * D) in its loop; REFERENCE §10). Taken only
        where the keys are unit-norm (``use_qk_l2norm=True`` or ``KernelConfig(keys_unit_norm=True)``),
        one decay per head, forward kernel chunk 64 (``KernelConfig.fwd_chunk=64`` where the GPU's
        default caps it at 32), GPU / interpret layout (:func:`.inverse_gatefree.gatefree_covers`),
        and no Hopper forward taking the call (they come first: on an sm_90 GPU
        ``KernelConfig(gpu_kernels="triton")`` gives the call to this path); other calls keep
        the WY form, ``forward_kernels`` says why. Default False (opt-in until
        measured faster on a GPU; docs/gatefree.md has the benchmark command).

    Raises:
      TypeError / ValueError: a field outside its choices, naming it.
    """

    bv_state: Optional[int] = None
    bv_out: Optional[int] = None
    bv_grad: Optional[int] = None
    bk_grad: Optional[int] = None
    warps_wy: int = 4
    warps_state: int = 4
    warps_out: int = 4
    warps_grad: Optional[int] = None
    num_stages: Optional[int] = None
    fuse_output: bool = True
    save_t: Optional[bool] = None
    merge_state: Optional[bool] = None
    gatefree: bool = False

    def __post_init__(self):
        own = "TritonTuning"
        for name in ("bv_state", "bv_out", "bv_grad", "bk_grad", "warps_grad", "num_stages",
                     "warps_wy", "warps_state", "warps_out"):
            val = check_int(own, name, getattr(self, name), optional=name not in ("warps_wy", "warps_state", "warps_out"))
            object.__setattr__(self, name, val)
            if val is not None and name.startswith("warps_") and (val & (val - 1) or val > 32):
                raise ValueError(f"{own}.{name} must be a power of two <= 32 (Triton's num_warps: at most "
                                 f"1024 threads), got {val!r}")
        check_bool(own, "fuse_output", self.fuse_output)
        check_bool(own, "gatefree", self.gatefree)
        for name in ("save_t", "merge_state"):
            check_bool(own, name, getattr(self, name), optional=True)
