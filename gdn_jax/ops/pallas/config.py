"""Kernel configuration of ``backend="pallas"``: the user's options (:class:`KernelConfig`) and the
one place that turns them, with the call's platform, shapes and dtype, into the concrete settings
every kernel reads (:func:`kernel_chunk`, :func:`resolve` -> :class:`KernelCall`).

Nothing here is global or mutable: a :class:`KernelConfig` is a frozen, hashable value passed
to ``gated_delta_rule(..., kernel_config=...)``, so ``jax.jit`` keys its cache on it like on any
other static argument. None of its fields changes the result beyond floating-point rounding. The
measurements behind the defaults are in docs/kernels.md, in each field's
docstring below, in ``results/hopper_h200/`` (KERNELS.md option by option, NOTE.md, HISTORY.md) and in
``results/bench_pallas_h200/``.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from .call import KernelCall
from .platform import PLATFORMS, is_tpu_layout

F32 = jnp.float32
SUPPORTED_CHUNK_SIZES = (16, 32, 64, 128)  # chunk sizes the kernels take (forward and backward)
MAX_DIM = 256  # largest head dim K or V the kernels take

# Largest kernel chunk per platform and head dim max(K, V), as ((largest head dim, largest chunk),
# ...). The chunked form is exact, so the kernels may run at a smaller chunk than ``chunk_size``.
# GPU backward: at C = 64 the gradient kernel's C x C tiles spill registers (H200, D = 128:
# backward 6.4 ms at C = 64, 3.1-3.3 ms at C = 32). The forward kernels have no such tiles and
# the backward recomputes what it needs from the inputs, so the forward runs at its own, larger
# chunk for 16-bit inputs (half the sequential steps of the state pass: 1.02 vs 1.18 ms at
# B4 T4096 H16 D128); float32 inputs (3-pass TF32 dots) keep the backward's chunk. The Hopper
# backward (Mosaic GPU, hopper/) runs at 64 (:func:`kernel_chunk`).
_MAX_CHUNK = {
    ("gpu", "bwd"): ((128, 32), (256, 32)),
    ("gpu", "fwd"): ((128, 64), (256, 32)),
}
# Smallest max(K, V) at which bf16 inputs get bf16 intermediates (``mid_dtype="auto"``). Below it
# the bf16 rounding of W, U, Vn and the state dots is not averaged over enough channels (CPU,
# B2 T200 H2, chunk 64, g = 0, beta = 1.9, K = V = 16 / 32 vs the float64 reference: o 1.2e-2 /
# 9.2e-3 and dg 2.7e-2 with bf16 intermediates, 1.7e-3 with float32 ones); small heads are cheap
# either way (bound by reading q, k, v).
BF16_MID_MIN_DIM = 64

_CHOICES = {"mid_dtype": ("auto", "f32", "bf16"), "u_dtype": ("f32", "mid"), "state_dot": ("f32", "mid"),
            "out_dot": ("f32", "mid"), "gpu_f32_inv": (None, "tf32", "tf32x3", "ieee"),
            "gpu_f32_mm": (None, "tf32", "tf32x3", "ieee"), "platform": (None,) + PLATFORMS,
            "gpu_kernels": (None, "triton", "mosaic"), "f32_inputs": ("keep", "bf16"), "f16_inputs": ("keep", "bf16"),
            "wy_inverse": ("dense", "blocked"), "wy_precision": ("bf16x3", "bf16_blocks", "bf16"),
            "grad_precision": ("bf16x3", "bf16"), "grad_t_phase": ("chain", "direct"), "fwd_form": (None, "wu", "t", "transition"),
            "wide_backward": (None, "triton", "hopper_xla", "hopper")}
_OPTIONAL_INTS = ("fwd_chunk", "bwd_chunk", "bv_state", "bv_out", "bv_grad", "bk_grad", "warps_grad", "num_stages",
                  "grad_chunks_per_cta", "wy_chunks_per_cta")
_INTS = ("warps_wy", "warps_state", "warps_out")
_BOOLS = ("fuse_output", "wy_compact", "approx_math", "late_o_store", "state_producer", "reverse_producer")
_OPTIONAL_BOOLS = ("save_t", "merge_state", "save_wy", "save_states", "auto_barriers")
# the Hopper kernels that can place their own barriers (KernelConfig.auto_barriers), and those that do
# by default: all but the reverse pass, which measured 9 % slower without Pallas' barriers
OWN_BARRIER_KERNELS = ("wy", "state", "reverse", "grads")
DEFAULT_OWN_BARRIERS = ("wy", "state", "grads")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Options of the Pallas kernels (``gated_delta_rule(..., backend="pallas", kernel_config=...)``).

    Every field's default (None, "auto" or the value shown) is resolved per call by
    :func:`resolve` from the platform, head dims, dtype and batch * heads; no field changes the
    result beyond rounding.

    Where:
      platform: "gpu" (Triton), "tpu" (Mosaic TPU), "interpret" (CPU, GPU code path) or
        "tpu_interpret" (CPU, TPU semantics); None: that of ``jax.default_backend()``.
    Chunking (tokens per kernel chunk; one of 16, 32, 64, 128; the forward and backward chunks
    must divide one another):
      fwd_chunk: chunk of the forward kernels; None: ``min(chunk_size, cap)`` with the
        platform's forward cap (GPU: 64 up to head dim 128, 32 above -- 64 up to head dim 256
        where the Hopper forward is wanted, for bf16 inputs with bf16 intermediates and the fused
        output; float32 inputs use the backward's cap).
      bwd_chunk: chunk of the backward kernels (which recompute what the forward did not keep:
        ``save_wy``, ``save_states``);
        None: ``min(chunk_size, cap)`` (GPU: 32; 64 where the Hopper backward is wanted:
        ``gpu_kernels`` "mosaic" or None on sm_90, bf16 inputs, head dims 64 .. 128,
        ``chunk_size >= 64``).
    Blocking:
      bv_state, bv_out, bv_grad: value-channel block of the state passes (grid B*H x V/bv), of
        the unfused output kernel and of the V loop of the gradient kernel; None: automatic
        (state passes: at least ~256 programs on GPU; TPU: V, or 128 when V is a multiple of 128).
        A value above the (padded) V is clipped to V. ``bv_state`` also sets the Hopper state
        pass's block, as given (16, 32 or 64 dividing V, and fitting shared memory; None:
        :func:`gdn_jax.ops.pallas.hopper.plan.block_for`: 64, halved on a GPU while B*H*V/bv < 64,
        and halved until the state pass fits shared memory -- 32 at K = 256): another value,
        one above V included, sends the forward to the Triton kernels (see
        ``gdn_jax.ops.pallas.forward_kernels``, whose reason names the value).
      bk_grad: key-channel block of the gradient kernel; below K the kernel runs on the grid
        (B*H, chunks, K/bk_grad) (at D = 256 the whole-K kernel spills registers at C = 32);
        None: K up to 128, 128 above (TPU: K).
    GPU kernels:
      gpu_kernels: "triton" (every stage in Pallas' Triton lowering), "mosaic" (the forward's
        and the backward's stages in the Hopper kernels of the package :mod:`gdn_jax.ops.pallas.hopper`
        -- Mosaic GPU: TMA, wgmma -- for the calls they
        cover, see ``hopper.plan.fwd_covers`` / ``hopper.plan.bwd_covers``; Triton for the rest); None:
        "mosaic" on an sm_90 GPU (H100 / H200), else "triton". With ``platform="interpret"``,
        "mosaic" runs those kernels in Mosaic GPU's interpret mode (CPU).
      wide_backward: the backward where max(K, V) is 129-256 and the forward runs the Hopper
        kernels (the Mosaic GPU gradient kernel's tiles do not fit in shared memory there):
        "triton" (every backward stage in Triton at its own chunk, 32 on GPU, recomputing the
        forward's intermediates) or "hopper_xla" (at the forward's chunk, 64, on the forward's
        saved residuals -- ``save_wy`` and ``save_states`` on -- the Mosaic GPU reverse pass
        :func:`.hopper.state_bwd.reverse_states` and the local gradients as batched XLA matmuls,
        :func:`.grads_xla.chunk_grads_xla`; bf16 inputs on sm_90 or Mosaic GPU's interpret
        mode) or "hopper" (the same, with the local gradients from the Hopper gradient kernel run
        on 128 x 128 (key block, value block) tiles of h_n and dh_n and summed:
        :func:`.hopper.grads.chunk_grads_blocks`; "hopper_xla" where the blocks do not fit or
        with ``grad_warpgroups=1``, ``grad_chunks_per_cta`` > 1 or ``grad_t_phase="chain"``);
        None: "hopper" (measured on the H200 at 2x8192x8x256, fwd+bwd ms: "triton" 3.92,
        "hopper_xla" 3.72, "hopper" 1.99, jax-linear-attention 2.23;
        results/hopper_h200/). Either Hopper option also moves the backward's chunk to 64 on sm_90: a
        call whose forward then runs at another chunk (an explicit ``fwd_chunk``) keeps the Triton
        backward, at chunk 64.
    Triton (GPU) launch settings: warps_wy, warps_state, warps_out (default 4), warps_grad
      (None: 8 for head dims >= 128, else 4), num_stages (None: 2).
    Precision (the kernels accumulate in float32 in every case):
      mid_dtype: intermediates written to HBM (W, Vn, h_n, dVl, dVn, dh_n) and operands of most
        in-kernel dots: "auto" (bf16 for bf16 inputs with max(K, V) >= 64, else float32),
        "f32" or "bf16".
      u_dtype: U in HBM, "mid" (= mid_dtype) or "f32"; state_dot / out_dot: operand dtype of the
        state passes' dots / of the output dots, "mid" or "f32" (float32 keeps U = W S + Vn, a
        small residual of O(|v|) terms, wider: rel. rms of o vs the float32 chunk backend 2.6e-3
        instead of 3.8e-3 at D = 128, 5-11% slower on an H200).
      f32_inputs: float32 q, k, v as given ("keep": float32 kernels, dots per ``gpu_f32_*``) or
        rounded to bfloat16 before the kernels ("bf16": the 16-bit path, Hopper kernels included;
        o, the final state and the gradients are still returned in float32, accumulation is
        float32 throughout -- the precision of bf16 inputs: rel. rms of o ~4e-3).
      f16_inputs: float16 q, k, v as given ("keep": float16 kernels -- Triton, the Hopper kernels
        take bf16 only) or rounded to bfloat16 before the kernels ("bf16": the Hopper kernels on
        sm_90; o, the final state and the gradients are returned in float16 -- 3 fewer mantissa
        bits on the inputs than float16 keeps: the precision of bf16 inputs).
      gpu_f32_inv, gpu_f32_mm: Triton precision of float32 dots in the triangular inverse / in
        the others: "tf32", "tf32x3" or "ieee"; None: "tf32" (1-pass, like XLA's float32 matmuls
        on GPU; H200, 2-layer MQAR LM at K = V = 64 / 128: a training step 4.97 / 11.34 ms vs 19.2 /
        57.9 ms with "tf32x3", which is ~float32 accurate).
    Structure:
      fuse_output: the forward state pass also writes o (no h_n / Vn round trip through HBM)
        instead of a separate output kernel.
      save_t: the backward WY kernel writes T = (I + A)^-1 for the gradient kernel instead of a
        second inverse there; None: on for the whole-K gradient kernel, off for the K-split one.
      save_wy: on the Hopper kernels (forward and backward both Mosaic GPU at one chunk size), the
        forward keeps its WY products Aqk and T = (I + A)^-1 (as a bf16 hi / lo pair) as residuals,
        so that the backward's WY stage only forms W, U and Aqk^T dO (no K K^T / Q K^T, no
        inverse: 2 of its ~13 dependent wgmma rounds); costs 24 KB per chunk and head of residual
        memory (C = 64) and 16 KB per chunk of forward HBM writes. None: on (H200, 4x4096x16x128:
        the backward's WY stage 0.300 -> 0.140 ms for +0.017 ms in the forward's); False: the
        residuals are the inputs only (the backward recomputes the WY, inverse included).
      wy_inverse: how the Hopper WY kernels form T = (I + A)^-1 (C = 64): "dense" (five doubling
        rounds, every product a dense 64x64x64 bf16x3 wgmma: 15.7 of the kernel's 22 MFLOP per
        chunk) or "blocked" (the three rounds inside the 16x16 diagonal blocks on the diagonal
        blocks alone, as m64n16k16 wgmmas over a compressed [C, 16] form of T, then T expanded
        exactly, and the last two rounds contracting only over the half of K where their
        operands are nonzero: 6.6 MFLOP; same bf16x3 products, so the same T). Default "blocked"
        (H200, 4x4096x16x128: the forward WY 0.276 -> 0.255 ms; GPU check 16 of 16).
      wy_precision: the products inside the Hopper WY kernels' doubling rounds of T = (I + A)^-1:
        "bf16x3" (each operand split into bf16 hi + lo, three wgmmas per product: hi hi + lo hi +
        hi lo, ~2^-16 relative), "bf16" (the operands rounded to bf16 once, one wgmma per
        product, float32 accumulation -- XLA's default precision for bf16 matmuls) or
        "bf16_blocks" (bf16 in the three rounds inside the 16 x 16 diagonal blocks, T_2 -> T_16,
        bf16x3 in the two rounds across them). The rounds start from T_2 exact and every round's
        float32 accumulator carries T forward. The products forming W, U (T hi + lo against the
        scaled K, V) and T's expansion stay exact. Measured: H200, 4x4096x16x128,
        forward WY 0.261 -> 0.175 ms with "bf16" (WY + T 0.265 -> 0.183); T within 1.7e-4 RMS
        relative of bf16x3's. The rounding shows most at beta near 2 (I + A furthest from I):
        against float64 (GPU check, bf16 inputs) o 5.1e-3 -> 6.1e-3, dk 6.8e-3 -> 8.8e-3, dbeta
        6.8e-3 -> 9.2e-3, and dg of the initial-state case 7.6e-3 -> 1.1e-2 (all within the
        suite's tolerances); "bf16_blocks" keeps most of bf16x3's accuracy there (GPU, beta near
        2: o 5.3e-3, dk 7.3e-3, dbeta 7.2e-3, dg 5.4e-3 against bf16x3's 5.1 / 6.8 / 6.8 / 3.4e-3
        and bf16's 6.1 / 8.8 / 9.2 / 7.2e-3) at 0.217 ms: the rounds across the blocks carry most
        of the rounding. Default "bf16" (fwd+bwd 1.209 -> 1.111 ms pipelined at 4x4096x16x128
        with ``wy_compact``; GPU check 16 of 16 within the suite's tolerances,
        results/hopper_h200/); "bf16x3" for the near-float32 T (~2^-16).
      wy_compact: the Hopper forward WY kernel (without and with ``save_wy``'s T) in less shared
        memory and fewer live registers, for three CTAs per SM instead of two (Nsight Compute,
        H200: two CTAs of one warpgroup per SM, held there by BOTH its 196 registers and its 99 KB
        of shared memory; the kernel is latency-bound, 5.4 cycles per issued instruction): v is
        loaded into q's tile once Q K^T has read it, Aqk's staging tile becomes the inverse's L hi
        tile once Aqk has left, W leaves through K's tile and U through v's, and W and U are formed
        one after the other (one [C, K] accumulator live instead of two). 73 KB at K = V = 128.
        Same products, so the same values (bit for bit in interpret mode). Applies where K == V;
        other calls keep the separate tiles. Default True: H200, 4x4096x16x128, forward WY 0.261
        -> 0.252 ms (0.252 -> 0.248 in a second call), the outputs bit-equal to the separate
        layout's on the GPU too (results/hopper_h200/); ptxas: 166-196
        registers, so still two CTAs per SM -- the gain is small.
      fwd_form: how the Hopper forward hands the WY representation to its state pass: "wu" (the
        WY kernel writes W = T (beta e^gamma K) and U = T (beta V), the state pass forms
        Vn = U - W S) or "t" (the WY kernel writes T = (I + A)^-1 as its bf16 (hi, lo) pair and
        reads no v; the state pass forms Vn = T (beta V - beta e^gamma (K S)): one more dependent
        wgmma per chunk on the state chain, U's HBM write and read gone -- 134 MB at
        4x4096x16x128 -- and, in a call that is not differentiated, W's too; W is still written
        where the backward reuses it, ``save_states``). The product with T is bf16x2 (T hi + lo
        against the bf16-rounded beta (V - e^gamma K S)), as W and U are in "wu". At K = 256 the
        state pass keeps one q tile ("t") or one q and one W tile ("wu", not yet
        run on a GPU: one dependent wgmma less per chunk than "t", for W and U's HBM traffic),
        refilled once Q S / W S have read them (:func:`gdn_jax.ops.pallas.hopper.plan.single_q`). None
        (default): "t" where K > 128 and at K = 128 with at least 128 state-pass CTAs
        (:func:`gdn_jax.ops.pallas.hopper.plan.t_form_default`: 4x4096x16x128 fwd 0.259 -> 0.215 ms), else "wu". Measured on one H200 (results/hopper_h200/, pipelined ms):
        4x4096x16x128 WY 0.169 / WY + T 0.180 ("wu") vs 0.144 / 0.156 with W ("t"), state
        pass 0.131 / + h, Vn 0.170 vs
        0.160 / 0.180 (230 registers: one more dependent wgmma per chunk), whole op fwd 0.295 vs
        0.293, fwd+bwd 1.106 vs 1.087; 2x8192x16x64 fwd 0.310 vs 0.342, fwd+bwd 0.924 vs 0.963;
        2x8192x8x256 fwd 0.404 against the Triton forward's 1.380 (jax-linear-attention 0.370;
        0.408 vs 0.367 in the next call, results/hopper_h200/).
        GPU check 16 of 16 with "t" (beta near 2: o 5.7e-3 vs 6.1e-3, dg 1.1e-2 vs 7.2e-3).
        "transition" (opt-in, K <= 128 where its three slots fit shared memory -- K = 64): the state pass of
        :mod:`gdn_jax.ops.pallas.hopper.transition`, one dependent wgmma group per chunk on the S
        chain (S' = e^{gamma_C} S + K~^T U + M S with M = -K~^T W formed a chunk ahead in the pass),
        the outputs off the chain (results/hopper_h200/NOTE.md item 28). On one H200 (results/hopper_h200/) correct (GPU check 10 of 10 at
        K = 64) but slower: 2x8192x16x64 state pass 0.255 vs 0.157 ms (~1.75x the wgmma work per
        chunk on one warpgroup), so it stays opt-in.
      approx_math: compile the Hopper (Mosaic GPU) kernels with ``approx_math``: exp as
        ``ex2.approx.ftz`` of x log2(e) (one SFU instruction and a multiply, ~2^-22 relative; values
        below float32's normal range flush to 0) instead of libdevice's expf. The WY and gradient
        kernels exponentiate C x C decay matrices per chunk and are bound by their instruction count
        (Nsight Compute, results/hopper_h200/). Default True: H200, 4x4096x16x128, pipelined (results/hopper_h200/)
        forward WY 0.160 -> 0.157 ms, whole op fwd 0.293 -> 0.282, fwd+bwd 1.099 -> 1.081;
        check_gpu bf16 of the new defaults 10 of 10 (results/hopper_h200/), the same errors as
        without it to the printed digits.
      auto_barriers: whether the Hopper WY kernels (the forward's and the backward's), the state
        pass (the forward's and the backward's recompute), the reverse pass and the two-warpgroup
        gradient kernel are compiled with Pallas' automatic barriers. Pallas (Mosaic GPU, JAX 0.10
        and 0.11) puts a warpgroup ``bar.sync`` before and after every store of registers to shared
        memory and before every TMA load, on top of the kernels' own ``commit_smem`` (a fence and
        one ``bar.sync``): ~11 stores per chunk in the forward WY kernel, ~22 barriers, of a kernel
        whose Nsight Compute profile shows barrier stalls as 1.5 of its 5.4 cycles per instruction
        (results/hopper_h200/); 6-8 barriers per chunk step on the state
        pass's sequential S chain, ~10 on the reverse pass's dS chain. Without them
        (``CompilerParams(unsafe_no_auto_barriers=True)``) the kernels' own ordering is enough:
        every store into a tile is followed by ``commit_smem`` before a wgmma or TMA reads it; the
        tiles threads store into are otherwise read by wgmma or TMA only; ``wait_smem_to_gmem``
        ends with a warpgroup ``bar.sync`` of its own (Mosaic GPU's ``await_async_copy``), which
        orders a TMA store's reads before threads overwrite the tile; every thread read of a slot
        that TMA refills comes before a ``commit_smem`` that precedes the refill (the state and
        reverse passes read their last gate of a step before that commit for this); the gradient
        kernel keeps one ``bar.sync`` (``hopper.common.sync_own_barriers``) between its threads' loads of v and their
        dv stores into the same tile (the same register layout, so insurance). True: all keep
        Pallas' barriers; False: none does; None (default): all but the reverse
        pass place their own (config.DEFAULT_OWN_BARRIERS). H200, JAX 0.11.2, pipelined, each
        kernel alone (results/hopper_h200/), automatic -> own barriers at
        4x4096x16x128 / 1x16384x16x128: gradient kernel 0.444 -> 0.428 / 0.472 -> 0.419 ms,
        state pass (+ h, Vn) 0.176 -> 0.173 / 0.439 -> 0.424, forward WY 0.143 -> 0.146 /
        0.147 -> 0.143, reverse pass 0.192 -> 0.210 / 0.496 -> 0.542 (slower: it keeps them by
        default); every kernel's outputs bit-equal to the automatic barriers' on the GPU. The
        backward's WY from the saved T (``save_wy`` with ``save_states=False``) counts as a "wy"
        kernel (0.156 -> 0.150 ms at 4x4096x16x128, bit-equal; results/hopper_h200/);
        the one-warpgroup gradient kernel always keeps the automatic barriers. Interpret mode has
        no barriers: the same values.
      wy_chunks_per_cta: chunks of one head per CTA of the Hopper forward WY kernel (compact
        layout, which "t" always uses). None / 1 (default): one CTA per chunk, its q, k and gates
        loaded before it computes (two CTAs per SM: ~194 registers). m > 1: grid (B*H,
        ceil(chunks / m)), each CTA looping over m consecutive chunks with q, k and the gates in two
        TMA slots, the next chunk's arriving while this one computes (its stores waited only until
        they have read their tiles). Same values (the arithmetic per chunk is unchanged). Applies
        where the forward WY runs its compact layout (``wy_compact`` with K == V, or ``fwd_form``
        "t"); elsewhere (and in the backward's WY) one chunk per CTA. H200 (results/hopper_h200/, pipelined): outputs equal to one chunk per CTA on the GPU;
        forward WY at 4x4096x16x128 0.160 (m = 1) vs 0.155 / 0.160 / 0.154 (m = 2 / 4 / 8), the
        T form at 2x8192x8x256 0.099 vs 0.116-0.118: no gain, so opt-in.
      late_o_store: the Hopper forward state pass stores chunk i's output during chunk i+1's first
        wgmmas (W S / K S and Q S) instead of before chunk i+1 starts: its conversion, shared-memory
        store, fence and TMA issue leave the S -> S' chain (the output is carried in registers, in
        the input dtype, for one step). Same values. Default True: H200 pipelined
        state pass 0.132 -> 0.127 ms at 4x4096x16x128, whole op fwd 0.293 -> 0.280; 2x8192x8x256
        fwd 0.403 -> 0.399 (results/hopper_h200/).
      state_producer: the Hopper state passes (the forward's and the backward's recompute, K <= 128)
        warp-specialised: a producer warpgroup issues every chunk's TMA copies ``state_slots``
        chunks ahead and waits for the compute warpgroups to release a slot, so the copies' issue
        and their waits leave the S -> S' chain; without it the one warpgroup issues chunk i+1's
        copies at the start of chunk i. Same values (bit for bit on the H200 too). Motive (H200,
        1x16384x16x128, results/hopper_h200/, pipelined): the state pass
        takes 0.430 ms; with no loads after the first 0.219, with the loads issued but never waited
        for 0.369. Default True (results/hopper_h200/,
        pipelined ms): 1x16384x16x128 state pass 0.430 -> 0.320 (3 slots 0.322, 2 warpgroups
        0.401), with h, Vn 0.489 -> 0.456, the backward's recompute 0.296 -> 0.280 (3 slots 0.264),
        whole op fwd 0.567 -> 0.466, fwd+bwd 1.704 -> 1.669; 4x4096x16x128 state pass 0.120 ->
        0.121, whole op fwd 0.277 -> 0.266, fwd+bwd 1.079 -> 1.081. check_gpu bf16 with two
        warpgroups 10 of 10, with 3 slots and the recompute 6 of 6 run, the same errors as the
        one-warpgroup pass (results/hopper_h200/). On the GPU only: in interpret mode the op runs the
        one-warpgroup pass, because Mosaic GPU's interpreter, inside a larger jitted program on
        XLA:CPU, can starve XLA's thread pool while one warpgroup blocks on another's barrier (a
        hang, seen on 2 cores with the CPU client's default one device); the warp-specialised
        kernel itself, with one and two compute warpgroups, is checked in interpret mode call by
        call inside jit (tests/ops/test_hopper.py::test_state_producer_kernel), in a process with
        4 CPU devices (``jax.config.update("jax_num_cpu_devices", 4)`` before JAX starts, as
        tests/conftest.py does), where the interpreter runs three warpgroups without hanging.
      state_warpgroups: compute warpgroups per CTA of a warp-specialised state pass (1, the default,
        or 2; 2 needs ``state_producer``; GPU only, K <= 128, like it): each takes its own block of
        ``bv_state`` value channels, and they share the chunk's q, k, W (T), Aqk tiles, so those are
        read from L2 once per two value blocks. The default value block halves until two blocks tile
        V. H200 1x16384x16x128: slower (state pass 0.401 vs 0.320 ms).
      state_slots: TMA slots (chunks in flight) of a warp-specialised state pass: 2 (default), 3
        or 4 (needs ``state_producer``; GPU only, K <= 128). The default value block halves until
        the slots fit shared memory (K = 128: 3 slots -> 32, 4 slots fit nowhere at K = 128 -- the
        call then runs Triton and :func:`gdn_jax.ops.pallas.forward_kernels` says why). H200
        1x16384x16x128: 3 slots 0.322 vs 0.320 ms.
      reverse_producer: the Hopper backward's reverse state pass (K <= 128) warp-specialised like
        ``state_producer``: a producer warpgroup issues each chunk's q, k, W, dVl (or Aqk), dO and
        gates copies into two slots, the consumer releases a slot after its step's last wgmma (h_n,
        read off the dS chain, is still copied by the consumer). Same values (bit-equal on the
        H200). Default True: H200 1x16384x16x128 reverse pass 0.529 -> 0.488 ms,
        whole op fwd+bwd 1.658 -> 1.642; 4x4096x16x128 0.206 -> 0.207, 1.084 -> 1.089 (noise);
        check_gpu bf16 10 of 10 (results/hopper_h200/). GPU only, like ``state_producer`` (interpret mode
        runs the one-warpgroup pass inside the op; tests/ops/test_hopper_bwd.py checks the kernel
        call by call).
      grad_t_phase: the gradient kernels' dA (T = (I + A)^-1): "direct" (default; dA =
        -strict((T^T dVn) Vn^T), exact since (I + A)^T T^T = I) or "chain" (dT = (dVn Vn^T)(I +
        A)^T, then dA = -strict(T^T dT T^T), three chained C x C x C products). Hopper: two
        products (the one-warpgroup kernel reuses its T^T dVn: one); Triton: the K-split kernel
        one T^T product instead of three, and the whole-K kernel, with float32 intermediates
        (``mid_dtype``) only, accumulates (T^T dVn) Vn^T over its value blocks from the dv product
        it has (one C x C x bv product per block; no dT, no dW X^T, no T products). With bf16
        intermediates the whole-K kernel keeps the chain: it reads v, X and h there, while the
        direct form reads the stored bf16 Vn, whose rounding is relative to |U| + |W S| -- where Vn
        cancels, dbeta came out 1.2-2x less accurate (in a review). The Hopper kernels and
        the K-split kernel read the stored Vn in both forms (no accuracy change). Default "direct":
        H200, Hopper gradient kernel 0.539 -> 0.464 ms at 4x4096x16x128 and
        0.544 -> 0.467 at 1x16384x16x128; whole op fwd+bwd 1.078 -> 1.008 and 1.668 -> 1.583 ms;
        2x8192x8x256 (Triton backward) 4.055 -> 3.996; check_gpu bf16 30 of 30 with it (Hopper and
        Triton) (results/hopper_h200/).
        The previous defaults are ``grad_t_phase="chain", grad_precision="bf16x3"``
        ("chain" alone now runs with the bf16 T phase: at beta 1.9 dk 9.1e-3, dbeta 9.5e-3 on the
        GPU against bf16x3's 8.8 / 9.2e-3).
      grad_precision: the products of the Hopper gradient kernels' T phase (``grad_t_phase``
        "direct": (T^T dVn) Vn^T -- T^T dVn itself is dv's product and keeps T's hi / lo pair;
        "chain": dT = (dVn Vn^T)(I + A)^T, T^T dT, (T^T dT) T^T -> dA): "bf16" (default; one wgmma each, the register operand rounded to bf16 once -- T's hi part in the
        chain --, float32 accumulation) or "bf16x3" (hi / lo pairs, two or three wgmmas each).
        With the direct dA: H200, 4x4096x16x128, gradient kernel 0.432 -> 0.393 ms (same lease,
        results/hopper_h200/, "bwd grads, bf16 T phase"); GPU check bf16 10 of 10
        (results/hopper_h200/), every error as with bf16x3 to the printed digits but at
        beta 1.9 dk 7.8e-3 -> 8.0e-3, dbeta 7.9e-3 -> 7.8e-3 (tolerance 1.2e-2; interpret mode
        gives the same: 7.83 -> 7.99e-3, 7.76 -> 7.68e-3). With the chain the same
        option cost more at beta 1.9 (dk 8.8 -> 9.1e-3, dbeta 9.2 -> 9.5e-3) and saved 0.549 ->
        0.489 ms. tests/ops/test_hopper.py bounds the change against bf16x3 at 3e-3.
      grad_warpgroups: warpgroups of the Hopper gradient kernel (:func:`.hopper.grads.chunk_grads`):
        1 (one warpgroup runs every phase in turn) or 2 (the Q path on one, dv, dKd, the T phase --
        on the first with ``grad_t_phase="chain"`` -- and the W phase on the other, side by side;
        the second warpgroup's dk partial as a single bf16 operand). Default 2 (H200, 4x4096x16x128: the gradient kernel 0.725 -> 0.544
        ms; GPU check 16 of 16). In interpret mode the two warpgroups' work runs in
        turn in one thread (Mosaic GPU's interpreter hung with two warpgroup threads on 2 cores).
      grad_chunks_per_cta: chunks of one head per CTA of the Hopper two-warpgroup gradient kernel.
        None / 1 (default): one CTA per chunk (its ~180 KB of input tiles arrive before it computes,
        and at 219 KB of shared memory one CTA fits an SM, so nothing hides that wait). m > 1: a
        persistent kernel, grid (B*H, ceil(chunks / m)), each CTA looping over m consecutive
        chunks and loading the next chunk's tiles while this one computes, each as soon as its
        tile is free (dO and dh after the first products, h after both warpgroups' products with
        it, q, Vn, dVn and T once warpgroup 1's T phase is done, v after dv has left; only k
        and the gates, 17 of ~180 KB, once dk has left). Same
        values (the arithmetic per chunk is unchanged). Needs ``grad_warpgroups=2``. Ran on the
        H200 (results/hopper_h200/NOTE.md items 12, 20): correct, slower than one chunk per CTA
        (0.59-0.66 vs 0.43 ms at 4x4096x16x128 in an earlier measurement), hence opt-in.
      save_states: on the Hopper kernels (as ``save_wy``: both directions Mosaic GPU at one chunk
        size), the forward's state pass also writes the state entering each chunk ``h`` [B*H,
        chunks, K, V] and ``Vn`` = U - W h [B*H, T, V] (bf16: what the backward's forward
        recompute forms) as residuals: the backward skips that recompute pass (0.127 of ~1.0 ms
        at 4x4096x16x128 on an H200) and, with ``save_wy``, its WY stage too (the forward also
        keeps W [B*H, T, K], and the reverse pass forms dVl = Aqk^T dO from the saved Aqk: the
        backward is two kernels, reverse pass and gradients). Costs bf16
        residual memory of K / C + 1 value tensors plus one key tensor (at K = V = 128, C = 64:
        4 times the size of v) and the forward's h / Vn writes. None (default) / True: on where
        both directions run the Hopper kernels, ignored elsewhere (like ``save_wy``); False: off
        (the backward recomputes them: less residual memory). H200, 4x4096x16x128:
        fwd+bwd 1.407 -> 1.204 ms pipelined, 1.847 -> 1.653 ms per call; GPU check 16 of 16.
        A call that is not differentiated writes none of these residuals (``save_wy`` neither).
      merge_state: run the two backward state passes (forward recompute, reverse) in one launch
        with twice the programs (GPU / interpret; never on TPU); None: on GPU when the state
        passes have at most 128 programs (fewer than an H200's 132 SMs).

    Raises:
      ValueError / TypeError: a field outside its choices, naming the field.
    """

    platform: Optional[str] = None
    fwd_chunk: Optional[int] = None
    bwd_chunk: Optional[int] = None
    bv_state: Optional[int] = None
    bv_out: Optional[int] = None
    bv_grad: Optional[int] = None
    bk_grad: Optional[int] = None
    warps_wy: int = 4
    warps_state: int = 4
    warps_out: int = 4
    warps_grad: Optional[int] = None
    num_stages: Optional[int] = None
    gpu_f32_inv: Optional[str] = None
    gpu_f32_mm: Optional[str] = None
    mid_dtype: str = "auto"
    u_dtype: str = "mid"
    state_dot: str = "mid"
    out_dot: str = "mid"
    fuse_output: bool = True
    save_t: Optional[bool] = None
    merge_state: Optional[bool] = None
    save_wy: Optional[bool] = None
    save_states: Optional[bool] = None
    wy_inverse: str = "blocked"
    wy_precision: str = "bf16"
    wy_compact: bool = True
    grad_precision: str = "bf16"
    grad_t_phase: str = "direct"
    fwd_form: Optional[str] = None
    approx_math: bool = True
    auto_barriers: Optional[bool] = None
    wy_chunks_per_cta: Optional[int] = None
    late_o_store: bool = True
    state_producer: bool = True
    state_warpgroups: int = 1
    state_slots: int = 2
    reverse_producer: bool = True
    grad_warpgroups: int = 2
    grad_chunks_per_cta: Optional[int] = None
    gpu_kernels: Optional[str] = None
    wide_backward: Optional[str] = None
    f32_inputs: str = "keep"
    f16_inputs: str = "keep"

    def __post_init__(self):
        for name, ok in _CHOICES.items():
            val = getattr(self, name)
            if val is not None and not isinstance(val, str):
                raise TypeError(f"KernelConfig.{name} must be one of {ok}, got {type(val).__name__} {val!r}")
            if val not in ok:
                raise ValueError(f"KernelConfig.{name} must be one of {ok}, got {val!r}")
        for name in _BOOLS + _OPTIONAL_BOOLS:
            val = getattr(self, name)
            if not (isinstance(val, bool) or (val is None and name in _OPTIONAL_BOOLS)):
                want = "True or False" if name in _BOOLS else "None, True or False"
                raise TypeError(f"KernelConfig.{name} must be {want}, got {val!r}")
        for name in _OPTIONAL_INTS + _INTS:
            val = getattr(self, name)
            if val is None and name in _OPTIONAL_INTS:
                continue
            want = f"a positive int{'' if name in _INTS else ' or None'}"
            if isinstance(val, (bool, np.bool_)) or not isinstance(val, numbers.Integral):
                raise TypeError(f"KernelConfig.{name} must be {want}, got {val!r}")
            if val < 1:
                raise ValueError(f"KernelConfig.{name} must be {want}, got {val!r}")
            object.__setattr__(self, name, int(val))  # NumPy ints as Python ints (hash, repr, static args)
            if name.startswith("warps_") and (val & (val - 1) or val > 32):
                raise ValueError(f"KernelConfig.{name} must be a power of two <= 32 (Triton's num_warps: at most "
                                 f"1024 threads), got {val!r}")
        if isinstance(self.grad_warpgroups, bool) or not isinstance(self.grad_warpgroups, int):
            raise TypeError(f"KernelConfig.grad_warpgroups must be 1 or 2, got {self.grad_warpgroups!r}")
        if self.grad_warpgroups not in (1, 2):
            raise ValueError(f"KernelConfig.grad_warpgroups must be 1 or 2, got {self.grad_warpgroups!r}")
        for name, ok in (("state_warpgroups", (1, 2)), ("state_slots", (2, 3, 4))):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int):
                raise TypeError(f"KernelConfig.{name} must be one of {ok}, got {val!r}")
            if val not in ok:
                raise ValueError(f"KernelConfig.{name} must be one of {ok}, got {val!r}")
            if val != ok[0] and not self.state_producer:
                raise ValueError(f"KernelConfig.{name}={val} needs the state pass's producer warpgroup "
                                 f"(state_producer=True)")
        if (self.grad_chunks_per_cta or 1) > 1 and self.grad_warpgroups != 2:
            raise ValueError(f"KernelConfig.grad_chunks_per_cta={self.grad_chunks_per_cta} needs the two-warpgroup "
                             f"gradient kernel (grad_warpgroups=2), got grad_warpgroups={self.grad_warpgroups}")
        for name in ("fwd_chunk", "bwd_chunk"):
            val = getattr(self, name)
            if val is not None and val not in SUPPORTED_CHUNK_SIZES:
                raise ValueError(f"KernelConfig.{name} must be one of {SUPPORTED_CHUNK_SIZES} or None, got {val!r}")


def check_type(kernel_config) -> None:
    """``kernel_config`` must be None or a :class:`KernelConfig` (``TypeError`` naming it otherwise)."""
    if kernel_config is not None and not isinstance(kernel_config, KernelConfig):
        raise TypeError(f"kernel_config must be a gdn_jax.ops.KernelConfig or None, got {type(kernel_config).__name__}")


def auto_mid_dtype(in_dt, K: int, V: int):
    """The intermediates' dtype of ``mid_dtype="auto"``: bfloat16 for bfloat16 inputs with
    max(K, V) >= :data:`BF16_MID_MIN_DIM`, else float32."""
    if jnp.dtype(in_dt) == jnp.bfloat16 and max(K, V) >= BF16_MID_MIN_DIM:
        return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(F32)


def kernel_chunk(config: KernelConfig, platform: str, direction: str, chunk_size: int, head_dim: int,
                 in_dt) -> int:
    """The chunk the kernels of ``direction`` ("fwd" or "bwd") run with for a requested
    ``chunk_size`` and ``head_dim = max(K, V)`` (the call's own head dims, before padding)."""
    explicit = config.fwd_chunk if direction == "fwd" else config.bwd_chunk
    if explicit is not None:
        return explicit
    if (direction == "bwd" and platform == "gpu" and _mosaic_wanted(config, platform)
            and jnp.dtype(in_dt) == jnp.dtype(jnp.bfloat16) and 64 <= head_dim <= 128 and chunk_size >= 64):
        return 64  # the Hopper backward's chunk (wgmma tiles are 64 rows)
    if (platform == "gpu" and _mosaic_wanted(config, platform) and jnp.dtype(in_dt) == jnp.dtype(jnp.bfloat16)
            and 128 < head_dim <= 256 and chunk_size >= 64 and config.fuse_output
            and config.mid_dtype in ("auto", "bf16") and "f32" not in (config.u_dtype, config.state_dot, config.out_dot)
            and (direction == "fwd" or _wide_hopper(config))):
        return 64  # the Hopper forward at K = 256 (hopper.plan.fwd_covers takes the call), and its mixed backward
    if direction == "fwd" and jnp.dtype(in_dt) == jnp.dtype(F32):
        direction = "bwd"  # the forward's own cap was measured with 16-bit inputs
    for d, c in _MAX_CHUNK.get((platform, direction), ()):
        if head_dim <= d:
            return min(int(chunk_size), c)
    return int(chunk_size)


def _state_block(BH, C, V, state_dt) -> int:
    """Default value block of the state passes: sequential chains want >= ~2 programs per SM
    (an H200 has 132); V > 128 halves at most to 32 when C <= 16 or with 16-bit state dots (B2
    T8192 H8 D256 on an H200: C16 forward 3.0 -> 2.0 ms from bv 16 to 32; C32 with bf16 state
    dots fwd+bwd 5.37 ms at bv 32 vs 6.24 ms at 16; with float32 ones bv 16 is faster)."""
    bv = min(V, 64)
    lo = 32 if (V > 128 and (C <= 16 or jnp.dtype(state_dt) != F32)) else 16
    while bv > lo and BH * (V // bv) < 256:
        bv //= 2
    return bv


def _block(name: str, explicit: Optional[int], default: int, total: int, given: Optional[int] = None) -> int:
    """``explicit`` (None: ``default``) clipped to the (padded) head dim ``total``; ``given``: the
    call's own head dim, named in the message where padding changed it.

    Raises:
      ValueError: a block that does not divide ``total``, naming the value the user gave.
    """
    b = min(explicit or default, total)
    if total % b:
        dim = name[1].upper()
        pad = f" ({dim}={given} zero-padded to a power of two)" if given not in (None, total) else ""
        raise ValueError(f"KernelConfig.{name}={explicit or default} must divide the head dim {total}{pad}")
    return b


def resolve(config: KernelConfig, *, platform: str, C: int, n: int, BH: int, H: int, K: int, V: int,
            K0: int, V0: int, scale: float, in_dt, packed: bool, nseq: int, group: int = 1) -> KernelCall:
    """Resolve ``config`` for one direction of a call: kernel chunk ``C`` (from
    :func:`kernel_chunk`) and ``n`` chunks, ``BH`` = batch * value heads ``H`` (``group`` value
    heads per key head), padded head dims ``K``, ``V``
    (the call's own ``K0``, ``V0`` pick the intermediates' dtype), ``in_dt`` the dtype q, k, v
    are read in.

    Raises:
      ValueError: a block size that does not divide its head dim.
    """
    tpu = is_tpu_layout(platform)
    if config.mid_dtype == "auto":
        mid = auto_mid_dtype(in_dt, K0, V0)
    else:
        mid = jnp.dtype({"f32": F32, "bf16": jnp.bfloat16}[config.mid_dtype])
    wide = lambda opt: jnp.dtype(F32) if opt == "f32" else mid
    u_dt, state_dt, out_dt = wide(config.u_dtype), wide(config.state_dot), wide(config.out_dot)
    f32_auto = "tf32"  # 1-pass TF32 (XLA's default for float32 matmuls); "tf32x3" on request

    def vdefault(kind):
        if tpu:
            return V if V <= 128 or V % 128 else 128
        if kind == "state":
            return _state_block(BH, C, V, state_dt)
        return min(V, 128) if kind == "out" else min(V, 64)

    bv_state = _block("bv_state", config.bv_state, vdefault("state"), V, V0)
    bv_out = _block("bv_out", config.bv_out, vdefault("out"), V, V0)
    bv_grad = _block("bv_grad", config.bv_grad, vdefault("grad"), V, V0)

    bk = _block("bk_grad", config.bk_grad, K if (tpu or K <= 128) else 128, K, K0)
    nk = K // bk
    if V % nk or V // nk < 16:  # each K block also writes dv for V/nk columns: >= 16 of them
        nk = 1
    save_t = (nk == 1) if config.save_t is None else config.save_t
    if tpu:
        merge = False  # each program of a merged launch writes only its own outputs: not on TPU
    elif config.merge_state is None:
        merge = platform == "gpu" and BH * (V // bv_state) <= 128
    else:
        merge = config.merge_state
    call = KernelCall(
        platform=platform, layout="hm" if tpu else "bthd", BH=BH, H=H, group=group, n=n, C=C, K=K, V=V, scale=float(scale),
        in_dt=jnp.dtype(in_dt).name, mid_dt=mid.name, u_dt=u_dt.name, state_dt=state_dt.name, out_dt=out_dt.name,
        f32_inv=config.gpu_f32_inv or f32_auto, f32_mm=config.gpu_f32_mm or f32_auto, packed=packed, nseq=nseq,
        bv_state=bv_state, bv_out=bv_out, bv_grad=bv_grad, grad_nk=nk,
        warps_wy=config.warps_wy, warps_state=config.warps_state, warps_out=config.warps_out,
        warps_grad=config.warps_grad or (8 if max(K, V) >= 128 else 4),
        num_stages=2 if config.num_stages is None else config.num_stages,
        fuse_output=config.fuse_output, save_t=bool(save_t), merge_state=bool(merge),
        save_wy=config.save_wy is not False, wy_inverse=config.wy_inverse, wy_precision=config.wy_precision,
        wy_compact=config.wy_compact, grad_precision=config.grad_precision, grad_tp=config.grad_t_phase,
        fwd_form=config.fwd_form or ("t" if K > 128 else "wu"), fwd_form_auto=config.fwd_form is None,
        approx_math=config.approx_math, own_barriers=_own_barriers(config.auto_barriers), wy_per_cta=config.wy_chunks_per_cta or 1, late_o=config.late_o_store,
        state_prod=config.state_producer, state_wgs=config.state_warpgroups, state_slots=config.state_slots,
        rev_prod=config.reverse_producer, grad_wgs=config.grad_warpgroups,
        grad_per_cta=config.grad_chunks_per_cta or 1,
        save_states=config.save_states is not False,
        hopper=_mosaic_wanted(config, platform), bv_given=config.bv_state, wide_backward=config.wide_backward,
    )
    return call


def _wide_hopper(config: KernelConfig) -> bool:
    """Whether ``config.wide_backward`` asks for a Hopper backward at K > 128 (None, "hopper_xla", "hopper")."""
    return (config.wide_backward in (None, "hopper_xla", "hopper") and config.save_wy is not False
            and config.save_states is not False)


def _own_barriers(auto_barriers: Optional[bool]) -> Tuple[str, ...]:
    """The Hopper kernels compiled without Pallas' automatic barriers for ``KernelConfig.auto_barriers``
    (True: none; False: all that can be; None: the measured default)."""
    if auto_barriers is None:
        return DEFAULT_OWN_BARRIERS
    return () if auto_barriers else OWN_BARRIER_KERNELS


def _mosaic_wanted(config: KernelConfig, platform: str) -> bool:
    """Whether ``config.gpu_kernels`` asks for the Hopper kernels on ``platform`` (None: on an sm_90
    GPU with a JAX whose Mosaic GPU API they use: checked on 0.10.2 (lowering) and 0.11.2)."""
    from .platform import is_hopper

    if platform not in ("gpu", "interpret"):
        return False
    if config.gpu_kernels is None:
        new_jax = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 10)
        return platform == "gpu" and new_jax and is_hopper()
    return config.gpu_kernels == "mosaic"
