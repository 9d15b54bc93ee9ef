"""Planning of the Hopper (Mosaic GPU) kernels, in plain Python: which calls they take
(:func:`fwd_covers` for the forward of :mod:`.wy` and :mod:`.state_fwd`, :func:`transition_covers`
for ``fwd_form="transition"`` in :mod:`.transition`, :func:`bwd_covers` for the backward of
:mod:`.wy`, :mod:`.state_bwd` and :mod:`.grads`), their shared-memory budgets and their value-block
choices. It imports no kernel, so that :mod:`gdn_jax.ops.pallas.config` plans a call without
importing the kernels."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ..call import KernelCall

BF16 = jnp.bfloat16
# shared memory per CTA on an H100 / H200 (227 KB usable)
SMEM_BYTES = 227 * 1024
SLOTS = 3  # TMA slots of the transition pass (transition.py)


def default_block(BH: int, V: int, platform: str = "gpu") -> int:
    """Value channels per CTA of the Hopper state passes before the shared-memory check of
    :func:`block_for` (the default, which ``TritonTuning.bv_state`` overrides): 64 (V = 128 runs two CTAs per head), on a GPU halved (down to 16) while that
    leaves fewer than 64 CTAs; interpret mode keeps 64 (fewer, larger programs). A state pass is a
    chain of dependent chunk steps per CTA, so with few (batch x head) rows more, narrower CTAs
    win. Measured on one H200 (forward state pass): BH 64, V 128: bv 64 / 32 = 0.129 / 0.223 ms;
    BH 32, V 64: bv 64 / 32 / 16 = 0.214 / 0.161 / 0.170 ms (results/hopper_h200/)."""
    bv = min(64, V)
    while platform == "gpu" and bv > 16 and BH * (V // bv) < 64:
        bv //= 2
    return bv


def single_q(call: KernelCall) -> bool:
    """Whether the forward state pass keeps one q tile (and, in the "wu" form, one W tile) instead
    of two TMA slots (K > 128, where two slots of q and k would not leave room for the rest): the
    next chunk's q (W) is copied once Q S (W S) has read this one, the rest of a chunk step ahead
    of its use."""
    return call.K > 128


def block_for(call: KernelCall) -> int:
    """The Hopper state pass's default value block for ``call`` (``TritonTuning.bv_state`` None):
    :func:`default_block`, then halved (down to 16) until :func:`smem_bytes` fits an SM's shared
    memory (K = V = 256 with ``fwd_form="t"``: 64 -> 32; K = 128 with ``state_slots`` 3: 32) and,
    with :func:`producer`, until ``state_warpgroups`` value blocks tile V."""
    bv = default_block(call.BH, call.V, call.platform)
    nc = call.state_wgs if producer(call) else 1
    while bv > 16 and (smem_bytes(call, bv) > SMEM_BYTES or call.V % (bv * nc)):
        bv //= 2
    return bv


def producer(call: KernelCall) -> bool:
    """Whether the state passes of ``call`` run warp-specialised (``HopperTuning.state_producer``,
    applied where K <= 128: at K = 256 the single q / W tiles of :func:`single_q` stay)."""
    return call.state_prod and not single_q(call)


def smem_bytes(call: KernelCall, bv: int) -> int:
    """Shared memory of :func:`.state_fwd.forward_states_and_output` (two TMA slots, or ``state_slots`` with
    :func:`producer`, whose ``state_warpgroups`` compute warpgroups each have their own value block
    of U and their own state tiles; ``HopperTuning.fwd_form`` "t": T's (hi, lo) tiles and v's value
    block in place of W and U; where :func:`single_q`, one q tile and, in "wu", one W tile). Counts
    the forward's tiles: the backward's recompute (no q, Aqk, o) needs less."""
    C, K = call.C, call.K
    isz = jnp.dtype(call.in_dt).itemsize
    one = single_q(call)
    D, nc = (call.state_slots, call.state_wgs) if producer(call) else (2, 1)
    state = K * bv * 2 + 2 * C * bv * 2 + C * bv * isz + K * bv * 4  # S (bf16), Vn, e^.. Vn, o, h0 / final
    if call.fwd_form == "t":
        shared = (1 + (not one)) * C * K * isz + 2 * C * C * 2 + C * C * 2 + 5 * C * 4
        return D * (shared + nc * C * bv * isz) + (C * K * isz if one else 0) + nc * state
    # "wu": q, k, W, U, Aqk, gates per slot (q and W single where single_q)
    shared = (1 + (not one)) * C * K * isz + (not one) * C * K * 2 + C * C * 2 + 3 * C * 4
    return D * (shared + nc * C * bv * 2) + (C * K * isz + C * K * 2 if one else 0) + nc * state


def fwd_covers(call: KernelCall) -> str | None:
    """None when the Hopper forward kernels take this call, else what they lack (the first that
    fails of): K in (64, 128, 256); the token layout; the fused output (``fuse_output``); bf16
    inputs; a forward kernel chunk of 64 (on GPU: ``chunk_size >= 64`` with head dims <= 256:
    the forward's chunk cap where the Hopper kernels are wanted); bf16 intermediates (the default for bf16); a
    value block (``TritonTuning.bv_state``, default :func:`default_block`) of 16, 32 or 64
    dividing V; shared memory (:func:`smem_bytes`, :func:`wy_smem_bytes`).
    :func:`gdn_jax.ops.pallas.forward_kernels` tells it for a call's arrays."""
    if call.K not in (64, 128, 256):
        return f"K={call.K} (needs 64, 128 or 256)"
    if call.layout != "bthd":
        return f"head-major layout of platform {call.platform!r} (Mosaic GPU runs on 'gpu' or 'interpret')"
    if not call.fuse_output:
        return "fuse_output=False"
    if jnp.dtype(call.in_dt) != jnp.dtype(BF16):
        return f"inputs {call.in_dt} (needs bfloat16)"
    if call.C != 64:
        return f"forward kernel chunk {call.C} (needs 64: chunk_size >= 64 on GPU, or KernelConfig.fwd_chunk=64)"
    for name in ("mid_dt", "u_dt", "out_dt", "state_dt"):
        if jnp.dtype(getattr(call, name)) != jnp.dtype(BF16):
            return f"{name} {getattr(call, name)} (needs bfloat16)"
    if call.bv_mosaic not in (16, 32, 64) or call.V % call.bv_mosaic:
        return f"value block {call.bv_mosaic} with V={call.V} (needs 16, 32 or 64 dividing V)"
    if producer(call) and call.V % (call.bv_mosaic * call.state_wgs):
        return (f"state_warpgroups={call.state_wgs} x value block {call.bv_mosaic} does not divide V={call.V} "
                f"(TritonTuning.bv_state={call.V // call.state_wgs} or state_warpgroups=1 does)")
    if call.fwd_form == "transition":
        why = transition_covers(call)
        if why is not None:
            return why
    elif smem_bytes(call, call.bv_mosaic) > SMEM_BYTES:
        fit = [b for b in (32, 16) if b < call.bv_mosaic and call.V % b == 0 and smem_bytes(call, b) <= SMEM_BYTES]
        return (f"shared memory: the state pass at value block {call.bv_mosaic} needs "
                f"{smem_bytes(call, call.bv_mosaic) // 1024} KB of {SMEM_BYTES // 1024} KB"
                + (f" (TritonTuning.bv_state={fit[0]} fits)" if fit else "")
                + (f"; with state_slots={call.state_slots}, state_warpgroups={call.state_wgs} (fewer fit)"
                   if producer(call) and (call.state_slots, call.state_wgs) != (2, 1) and not fit else ""))
    if wy_smem_bytes(call) > SMEM_BYTES:
        return f"shared memory: the WY kernel needs {wy_smem_bytes(call) // 1024} KB of {SMEM_BYTES // 1024} KB"
    return None


def wy_smem_bytes(call: KernelCall) -> int:
    """Shared memory of :func:`.wy.wy_forward` (the forward's; the backward's adds a dO tile): q, k, v
    tiles, Aqk's staging tile, T and L as bf16 (hi, lo) pairs (their lo tiles only where
    ``wy_precision`` uses them), and their compressed [C, 16] pairs with ``wy_inverse="blocked"``."""
    C, K, V = call.C, call.K, call.V
    isz = jnp.dtype(call.in_dt).itemsize
    hp_in, lo_any = call.wy_precision == "bf16x3", call.wy_precision != "bf16"
    blocked = (2 + 2 * hp_in) * C * 16 * 2 if call.wy_inverse == "blocked" else 0
    cc = (2 + 2 * lo_any) * C * C * 2  # T hi, L hi (Aqk's staging tile when compact), lo tiles
    if wy_compact(call):  # the forward's: v shares q's tile
        return 2 * C * K * isz + cc + 5 * C * 4 + blocked
    return (2 * C * K + C * V) * isz + C * C * 2 + cc + 5 * C * 4 + blocked


def wy_compact(call: KernelCall) -> bool:
    """Whether the forward WY kernel runs in its compact layout (``HopperTuning.wy_compact``, where
    K == V: v takes q's tile)."""
    return call.wy_compact and call.K == call.V


def transition_smem_bytes(call: KernelCall, bv: int) -> int:
    """Shared memory of :func:`.transition.forward_states_transition` at value block ``bv``: three slots of q, k,
    W, U's value block, Aqk and the gates; two K~ and two M tiles; the S, Vn, o and h0 / final tiles."""
    C, K = call.C, call.K
    isz = jnp.dtype(call.in_dt).itemsize
    slot = 2 * C * K * isz + C * K * 2 + C * bv * 2 + C * C * 2 + 3 * C * 4
    return SLOTS * slot + 2 * (C * K + K * K) * 2 + K * bv * 2 + C * bv * 2 + C * bv * isz + K * bv * 4


def transition_covers(call: KernelCall) -> str | None:
    """None when the transition pass takes ``call`` (after :func:`fwd_covers`), else why not."""
    if transition_smem_bytes(call, call.bv_mosaic) > SMEM_BYTES:
        return (f"shared memory: the transition pass (fwd_form='transition') at K={call.K}, value block "
                f"{call.bv_mosaic} needs {transition_smem_bytes(call, call.bv_mosaic) // 1024} KB of {SMEM_BYTES // 1024} KB "
                f"(it fits at K = 64)")
    return None


def bwd_covers(call: KernelCall) -> str | None:
    """None when the Hopper backward kernels take this (backward) call, else what they lack: the
    forward kernels' conditions (:func:`fwd_covers`, the fused-output one
    aside) at the backward's chunk (64: on GPU the default with ``gpu_kernels`` "mosaic" / None,
    bf16 inputs and head dims 64 .. 128), and the gradient kernel's shared memory."""
    if call.K not in (64, 128):
        return f"K={call.K} (the Hopper backward needs 64 or 128)"
    why = fwd_covers(dataclasses.replace(call, fuse_output=True))
    if why is not None:
        return why.replace("forward kernel chunk", "backward kernel chunk").replace("fwd_chunk", "bwd_chunk")
    if grads_smem_bytes(call) > SMEM_BYTES:
        return "shared memory (gradient kernel)"
    return None


def grads_smem_bytes(call: KernelCall) -> int:
    """Shared memory of :func:`.grads.chunk_grads`: the inputs (q, k, v, dO, Vn, dVn, h_n, dh_n, T hi / lo,
    gates), the output scalars and the phase scratch (dKK and the T phase's two [C, C] tiles); with
    two warpgroups (``call.grad_wgs == 2``) also the dk partial's [C, K] tile and nine output rows."""
    C, K, V = call.C, call.K, call.V
    inputs = (2 * C * K + 4 * C * V + 2 * K * V + 2 * C * C) * 2
    if call.grad_wgs == 2:
        return inputs + 14 * C * 4 + 3 * C * C * 2 + C * K * 2
    return inputs + 10 * C * 4 + 3 * C * C * 2


def block_call(call: KernelCall) -> KernelCall | None:
    """The sub-call :func:`.grads.chunk_grads_blocks` runs the two-warpgroup gradient kernel with for a
    K > 128 (backward) call -- key and value dims cut into blocks of 128 (``grad_blocks`` = their
    counts), one virtual head per (head, key block, value block) -- or None where that kernel does
    not take the blocks (:func:`bwd_covers`) or the call asks for options it lacks there
    (``grad_warpgroups=1``, ``grad_chunks_per_cta`` > 1, ``grad_t_phase="chain"`` with several key
    blocks: the chain's dT (dVn Vn^T)(I + A)^T needs the whole A, not a key block's part)."""
    nk, nv = max(1, call.K // 128), max(1, call.V // 128)
    if call.grad_wgs != 2 or call.grad_per_cta != 1 or call.K % nk or call.V % nv:
        return None
    if nk > 1 and call.grad_tp != "direct":
        # grad_t_phase="chain" forms dA through (I + A)^T with A from the CTA's own key block: not a
        # sum over key blocks (found in a review: dk 2.7e-2 against float64 at K = 256)
        return None
    sub = dataclasses.replace(call, K=call.K // nk, V=call.V // nv, BH=call.BH * nk * nv, H=call.H * nk * nv,
                              grad_blocks=(nk, nv))
    return sub if bwd_covers(sub) is None else None


def reverse_single_tiles(call: KernelCall) -> bool:
    """Whether :func:`.state_bwd.reverse_states` keeps q, k and W in one tile each instead of two TMA slots
    (K > 128, where two slots of the three [C, K] tiles alone would take 192 KB): k is refilled as
    soon as K dS has read it, q and W once the chunk's last wgmma has, so the next chunk's copies
    land during the rest of this step (k) or during the whole next step until its last wgmma (q, W)."""
    return call.K > 128


def reverse_smem_bytes(call: KernelCall, bv: int, own_dvl: bool = False) -> int:
    """Shared memory of :func:`.state_bwd.reverse_states` at value block ``bv`` (two TMA slots; ``own_dvl``:
    with the Aqk tile that forms dVl in the kernel instead of a dVl tile; q, k, W single where
    :func:`reverse_single_tiles`)."""
    C, K = call.C, call.K
    kw_tiles = 3 * C * K * 2
    one = reverse_single_tiles(call)
    per_slot = (0 if one else kw_tiles) + (C * C if own_dvl else C * bv) * 2 + C * bv * 2 + 3 * C * 4
    return 2 * per_slot + (kw_tiles if one else 0) + 2 * K * bv * 2 + 3 * C * bv * 2 + K * bv * 4 + K * 4


def reverse_block(call: KernelCall, own_dvl: bool = False) -> int:
    """The value block of :func:`.state_bwd.reverse_states`: the forward's block (``bv_mosaic``) or the largest
    smaller one whose two TMA slots fit in shared memory."""
    bv = call.bv_mosaic
    while bv > 16 and reverse_smem_bytes(call, bv, own_dvl) > SMEM_BYTES:
        bv //= 2
    return bv


# HopperTuning.fwd_form None at K = 128: "t" from this many forward state-pass CTAs (B*H x V / value block)
T_FORM_MIN_CTAS = 128


def t_form_default(call: KernelCall) -> bool:
    """Whether ``HopperTuning.fwd_form`` None takes "t" at K <= 128 for ``call`` (its ``bv_mosaic``
    set): K = 128 and at least :data:`T_FORM_MIN_CTAS` state-pass CTAs. There U's HBM round trip
    (and W's, undifferentiated) costs more than the state chain's extra wgmma; with fewer CTAs each
    CTA's chain is the bound and "wu" wins. Measured on one H200 (results/hopper_h200/, pipelined ms, "wu" vs "t"): 4x4096x16x128
    (128 CTAs) fwd 0.259 vs 0.215, fwd+bwd 0.967 vs 0.925; 1x16384x16x128 (64 CTAs) 0.443 vs
    0.435, 1.494 vs 1.576; 2x8192x16x64 (64 CTAs) 0.242 vs 0.253, 0.732 vs 0.764."""
    return call.K == 128 and call.BH * (call.V // call.bv_mosaic) >= T_FORM_MIN_CTAS
