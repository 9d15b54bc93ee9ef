"""The settings of one direction of one ``backend="pallas"`` call (:class:`KernelCall`): a plain
record that the kernels, the planning module (:mod:`.hopper.plan`) and :mod:`.config` (which
builds it) all read; it imports nothing of theirs."""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """Everything static the kernels of one direction (forward or backward) of one call read:
    shapes, dtypes and the resolved settings of :class:`~.config.KernelConfig` (hashable: it keys the
    custom_vjp and the jit cache). Built by :func:`.config.resolve` only."""

    platform: str
    layout: str  # "bthd": token arrays [B, T, H, D] as given; "hm": head-major [B*H, T, D] (TPU)
    BH: int
    H: int  # value heads (the kernels' bh axis is batch x value heads)
    group: int  # value heads per key head (grouped value heads; 1: one key head per value head)
    n: int  # chunks
    C: int  # tokens per chunk
    K: int  # key / value head dims as the kernels see them (powers of two >= 16)
    V: int
    scale: float  # query scale, applied in-kernel
    in_dt: str  # dtype of q, k, v, do as read (and of o, dq, dk, dv as written)
    mid_dt: str  # intermediates in HBM and operands of most dots
    u_dt: str
    state_dt: str
    out_dt: str
    f32_inv: str  # Triton precision of float32 dots: triangular inverse / others
    f32_mm: str
    packed: bool  # cu_seqlens: per-chunk reset / readout flags
    nseq: int  # states per (batch x head) row: 1, or N with cu_seqlens
    bv_state: int
    bv_out: int
    bv_grad: int
    grad_nk: int  # key-channel blocks of the gradient kernel (1: the whole-K kernel)
    warps_wy: int
    warps_state: int
    warps_out: int
    warps_grad: int
    num_stages: int
    fuse_output: bool
    save_t: bool
    merge_state: bool
    gatefree: bool = False  # TritonTuning.gatefree: the gate-free forward (path "gatefree") asked for
    unit_keys: bool = False  # the keys are unit-norm: use_qk_l2norm, or KernelConfig.keys_unit_norm (the caller's promise)
    hopper: bool = False  # KernelConfig.gpu_kernels: the Hopper (Mosaic GPU) kernels are asked for on this platform
    bv_given: Optional[int] = None  # TritonTuning.bv_state as given (the Hopper state pass's block; None: plan.block_for)
    bv_mosaic: int = 64  # value block of the Hopper state pass (set by the Hopper paths: paths.hopper_call)
    save_wy: bool = True  # HopperTuning.save_wy (used where both directions run the Hopper kernels)
    wy_inverse: str = "blocked"  # HopperTuning.wy_inverse (the Hopper WY kernels)
    wy_precision: str = "bf16"  # HopperTuning.wy_precision (the Hopper WY kernels' doubling rounds)
    grad_precision: str = "bf16"  # HopperTuning.grad_precision (the Hopper gradient kernels' T phase)
    grad_tp: str = "direct"  # HopperTuning.grad_t_phase
    fwd_form: str = "wu"  # HopperTuning.fwd_form (the Hopper forward: W, U or T to the state pass)
    fwd_form_auto: bool = False  # HopperTuning.fwd_form None: the Hopper paths pick the form (plan.t_form_default)
    wide_backward: Optional[str] = None  # HopperTuning.wide_backward (the Hopper backward at K or V above 128)
    approx_math: bool = False  # HopperTuning.approx_math (the Hopper kernels' exp)
    own_barriers: Tuple[str, ...] = ()  # HopperTuning.auto_barriers: the Hopper kernels (OWN_BARRIER_KERNELS) without Pallas' barriers
    wy_per_cta: int = 1  # HopperVariants.wy_chunks_per_cta (the Hopper forward WY kernel)
    late_o: bool = False  # HopperTuning.late_o_store (the Hopper forward state pass)
    state_prod: bool = False  # HopperTuning.state_producer (the Hopper state passes)
    state_wgs: int = 1  # HopperVariants.state_warpgroups (compute warpgroups of a state pass CTA)
    state_slots: int = 2  # HopperVariants.state_slots (TMA slots of the state passes)
    rev_prod: bool = False  # HopperTuning.reverse_producer (the Hopper reverse pass)
    wy_compact: bool = True  # HopperTuning.wy_compact (the Hopper forward WY kernel)
    grad_wgs: int = 2  # HopperTuning.grad_warpgroups (the Hopper gradient kernel)
    grad_per_cta: int = 1  # HopperVariants.grad_chunks_per_cta (the Hopper gradient kernel)
    save_states: bool = False  # HopperTuning.save_states (used where both directions run the Hopper kernels)
    # the path "hopper_blocks" (paths.py): the local gradients of a K > 128 call from the Hopper gradient
    # kernel on (key block, value block) tiles; set on the sub-call that kernel runs: its K, V are one
    # block, its bh axis has grad_blocks[0] * grad_blocks[1] virtual heads per head (hopper.grads.chunk_grads_blocks)
    grad_blocks: Tuple[int, int] = (1, 1)

    @property
    def Tp(self) -> int:
        return self.n * self.C
