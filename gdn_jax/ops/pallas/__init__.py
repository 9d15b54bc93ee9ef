"""``backend="pallas"``: the chunked gated delta rule as Pallas kernels, forward and backward.

Same semantics as ``backend="chunk"`` (decay first; GDN paper §3.3, DeltaNet paper §3; see
``gdn_jax/ops/chunk.py`` for the math in plain JAX). Modules, one per stage:

* :mod:`.config`: :class:`KernelConfig` (the options, a frozen value passed as
  ``gated_delta_rule(..., kernel_config=...)``: platform and chunks at the top, then the groups
  :class:`~.config.Precision`, :class:`~.tuning.TritonTuning` (beside the portable kernels) and
  :class:`~.hopper.tuning.HopperTuning` (beside the Hopper kernels)) and :func:`~.config.resolve`,
  the one place that turns it into the settings of a call (:class:`~.config.KernelCall`);
* :mod:`.call`: :class:`~.call.KernelCall`, the record every kernel reads;
* :mod:`.platform`: GPU (Triton) / TPU (Mosaic) / interpret rules of a ``pallas_call``;
* :mod:`.wy`: the intra-chunk WY / UT representation (A, T = (I + A)^-1, W, U; Aqk or dVl);
* :mod:`.state_fwd`: the forward state pass (fused with the output) and the output kernel;
* :mod:`.state_bwd`: the backward state passes (reverse dS pass; merged with the recompute);
* :mod:`.grads`: the per-chunk gradient kernel (dq, dk, dv, dbeta, gate terms);
* :mod:`.hopper`: a package of Mosaic GPU kernels for sm_90 (TMA, wgmma) split by the same stage
  names (``wy``, ``state_fwd``, ``state_bwd``, ``transition``, ``grads``; shared helpers in
  ``common``, and ``plan``: which calls they take, their shared memory and value blocks, plain
  Python, no kernel), chosen by ``KernelConfig.gpu_kernels`` (default: on
  Hopper GPUs, for the calls they cover);
* :mod:`.split_plan`: the sequence split's planning (``KernelConfig.seq_split``: how many pieces a
  sequence, or why none; plain Python; the split itself is :mod:`gdn_jax.ops.seq_split`, above this
  package);
* :mod:`.paths`: the table of kernel paths (which kernels run each direction, tried in a stated
  order, each entry with ``covers(call)`` and ``run``);
* :mod:`.vjp`: preparation in plain JAX and the ``custom_vjp`` wiring (the op's, and the
  final-state-only forward's, :func:`pallas_final_state`);
* :mod:`.partition`: the kernels' sharding rules (``custom_partitioning``): under ``jit`` on
  inputs split along the batch and / or the heads each device runs its own block, nothing is
  gathered (docs/data_parallel.md);
* :mod:`.layout`, :mod:`.tiles`: block specs and in-kernel helpers.

Coverage (:func:`supports`; :func:`gdn_jax.ops.backends.resolve_backend` asks it): per-head g and beta, initial / final state, ``cu_seqlens``, any T,
K and V multiples of 16 up to 256 (non powers of two are zero-padded to the next one),
chunk_size 16 / 32 / 64 / 128, float32 / bfloat16 / float16 inputs with float32 accumulation.
Declined with a reason: per-key-channel g, per-value-channel beta, float64.

Precision: the kernels read q, k, v, dO in the input dtype and accumulate in float32. With
bf16 inputs and max(K, V) >= 64 (``config.BF16_MID_MIN_DIM``) the intermediates written to HBM
(W, U, Vn, h_n, dVl, dVn, dh_n) are bf16 and the state / output dots take bf16 operands (rel.
rms of o vs the float32 chunk backend 3.8e-3 at D = 128; ``KernelConfig(precision=Precision(
u_dtype="f32", state_dot="f32", out_dot="f32"))`` gives 2.6e-3). float32 inputs keep everything
float32 (on GPU as 1-pass TF32 dots by default, like XLA's; ``Precision(gpu_f32_*="tf32x3")`` for
~float32 accuracy; ``Precision(f32_inputs="bf16")`` for the 16-bit path; float16 inputs run float16
kernels, or with ``Precision(f16_inputs="bf16")`` the bf16 path, Hopper kernels included). The in-chunk triangular inverse is float32 (Triton)
or bf16x3 (the Hopper kernels) in every case.

Platforms: see :mod:`.platform`. The TPU variant is checked by interpretation and by lowering
(``jax.export``) only; every TPU kernel streams per-chunk blocks (the state passes of
:mod:`.state_tpu` carry the state across the chunk axis in VMEM scratch), so its VMEM use does not
depend on T (``benchmarks/vmem_budget.py``).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

from .._common import GateForms
from .._vma import match_vma
from . import paths
from .hopper import plan as hopper_plan
from .config import (BF16_MID_MIN_DIM, MAX_DIM, SUPPORTED_CHUNK_SIZES, KernelCall, KernelConfig, Precision, auto_mid_dtype,
                     check_type)
from .hopper.tuning import HopperTuning
from .tuning import TritonTuning
from . import split_plan
from .platform import PLATFORMS, default_platform, hopper_asked
from .vjp import KernelInputs, chunk_final_state, chunk_gated_delta_rule, to_kernel_inputs

__all__ = ["KernelConfig", "Precision", "TritonTuning", "HopperTuning", "KernelCall", "KernelInputs", "KernelsReport", "supports", "check_supported", "check_type", "forward_kernels", "backward_kernels", "pallas_gated_delta_rule",
           "pallas_final_state",
           "to_kernel_inputs",
           "auto_mid_dtype", "BF16_MID_MIN_DIM", "SUPPORTED_CHUNK_SIZES", "MAX_DIM", "PLATFORMS"]


def supports(forms: GateForms, *, chunk_size: int, K: int, V: int, dtype) -> Optional[str]:
    """None when ``backend="pallas"`` covers a call, else the reason (names the option)."""
    if forms.beta_per_channel:
        return "does not take per-value-channel beta [B,T,H,V] (use backend='scan')"
    if forms.g_per_channel:
        return "does not take per-key-channel g [B,T,H,K] (Kimi Delta Attention; use backend='chunk')"
    if chunk_size not in SUPPORTED_CHUNK_SIZES:
        return (f"does not take chunk_size={chunk_size} (supported: {', '.join(map(str, SUPPORTED_CHUNK_SIZES))}; "
                f"backend='chunk' takes any chunk_size)")
    for name, d in (("K", K), ("V", V)):
        if d % 16 or d < 16 or d > MAX_DIM:
            return (f"does not take head dim {name}={d} (needs a multiple of 16 from 16 to {MAX_DIM}; "
                    f"use backend='chunk')")
    dt = jnp.dtype(dtype)
    if dt == jnp.float64:
        return "does not take float64 inputs (kernels accumulate in float32; use backend='chunk')"
    if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"does not take dtype {dt}"
    return None


def check_supported(forms: GateForms, *, chunk_size: int, K: int, V: int, dtype) -> None:
    """``NotImplementedError`` with the reason of :func:`supports` unless ``backend="pallas"`` takes
    the call (the op's error for an explicit ``backend="pallas"``)."""
    reason = supports(forms, chunk_size=chunk_size, K=K, V=V, dtype=dtype)
    if reason is not None:
        raise NotImplementedError(f"backend='pallas' {reason}; backend='auto' picks one that takes the call")


class KernelsReport(NamedTuple):
    """What :func:`forward_kernels` / :func:`backward_kernels` report for a call.

    ``kernels``: "hopper" (the Mosaic GPU kernels of :mod:`.hopper`), for the backward also
    "hopper-blocks" / "hopper+xla" (K or V above 128: the Hopper reverse pass with the local
    gradients from the Hopper gradient kernel on 128 x 128 blocks / as XLA matmuls), else the
    platform's ("triton" on GPU, "tpu", "interpret", "tpu_interpret"); ``reason``: where the
    Hopper kernels were asked for (``gpu_kernels`` "mosaic", or None on an sm_90 GPU) and do not
    run, why not (:func:`.hopper.plan.fwd_covers` / :func:`.hopper.plan.bwd_covers`), else None;
    ``path``: the :mod:`.paths` entry that runs; ``not_taken``: ((entry, why not), ...) for every
    other entry of the table, in its order; ``pieces``: the sequence split (``KernelConfig.seq_split``,
    :mod:`gdn_jax.ops.seq_split`): 1 where it does not run, else the pieces a sequence (the other
    fields then describe the pieces' call, B * P rows of T / P tokens; the maps' call runs the same
    kernels at value width K + V); ``split_reason``: where the split was asked for and does not run,
    why not (:func:`.split_plan.decide`), else None."""

    kernels: str
    reason: Optional[str]
    path: str
    not_taken: Tuple[Tuple[str, str], ...]
    pieces: int = 1
    split_reason: Optional[str] = None


def forward_kernels(q, k, v, g, beta, *, chunk_size: int = 64, cu_seqlens=None, use_qk_l2norm: bool = False,
                    kernel_config: Optional[KernelConfig] = None) -> KernelsReport:
    """Which forward kernels ``gated_delta_rule(..., backend="pallas")`` runs for these arrays
    (shapes and dtypes are what count, and ``use_qk_l2norm``: the gate-free path takes unit-norm
    keys only): a :class:`KernelsReport` -- the entry of
    :data:`.paths.FORWARD` that runs and why the others do not; ``[:2]`` is ``("hopper", None)``
    for the Mosaic GPU kernels, else ``(platform kernels, why the Hopper kernels do not take the
    call)`` (None where they were not asked for: ``gpu_kernels`` "triton", or a non-Hopper device
    under the default).

    Raises: as ``gated_delta_rule(..., backend="pallas")``: TypeError / ValueError for arguments
    that do not fit its layout (the message names the argument and the expected shape), or a
    ``kernel_config`` that is not a :class:`KernelConfig`; NotImplementedError for a call the
    kernels do not take (:func:`supports`)."""
    return _kernels("fwd", q, k, v, g, beta, chunk_size, cu_seqlens, kernel_config, use_qk_l2norm)


def backward_kernels(q, k, v, g, beta, *, chunk_size: int = 64, cu_seqlens=None, use_qk_l2norm: bool = False,
                     kernel_config: Optional[KernelConfig] = None) -> KernelsReport:
    """:func:`forward_kernels` for the backward (the entries of :data:`.paths.BACKWARD`):
    ``kernels`` "hopper", "hopper-blocks", "hopper+xla" or the platform's.

    Raises: as :func:`forward_kernels`."""
    return _kernels("bwd", q, k, v, g, beta, chunk_size, cu_seqlens, kernel_config, use_qk_l2norm)


def _kernels(direction, q, k, v, g, beta, chunk_size, cu_seqlens, kernel_config, use_qk_l2norm=False):
    from .._common import check_inputs

    forms = check_inputs(q, k, v, g, beta, None, cu_seqlens, chunk_size, None)  # the op's checks
    check_type(kernel_config)
    check_supported(forms, chunk_size=chunk_size, K=q.shape[-1], V=v.shape[-1], dtype=v.dtype)
    cfg = KernelConfig() if kernel_config is None else kernel_config
    pieces, split_reason = 1, None
    if cfg.seq_split is not None:
        platform = cfg.platform or default_platform()
        pieces, split_reason = split_plan.decide(cfg.seq_split, B=q.shape[0], T=q.shape[1], H=v.shape[2],
                                                 K=q.shape[-1], V=v.shape[-1], chunk=chunk_size, platform=platform,
                                                 hopper=hopper_asked(cfg.gpu_kernels, platform))
    if pieces > 1:  # the pieces' call: its route, traced on shapes only
        route = _route(*_piece_shapes(q, k, v, g, beta, cu_seqlens, pieces, chunk_size), chunk_size, cfg,
                       use_qk_l2norm)
    else:
        route = to_kernel_inputs(q, k, v, g, beta, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
                                 use_qk_l2norm=use_qk_l2norm, config=cfg).route
    chosen = route[0] if direction == "fwd" else route[1]
    table = paths.FORWARD_BY_NAME if direction == "fwd" else paths.BACKWARD_BY_NAME
    name = paths.kernels_name(chosen)
    reason = None
    if not table[chosen.path].hopper:
        call = chosen.call
        asked = cfg.gpu_kernels == "mosaic" or hopper_asked(cfg.gpu_kernels, call.platform)
        covers = hopper_plan.fwd_covers if direction == "fwd" else hopper_plan.bwd_covers
        reason = covers(paths.hopper_call(call) if call.hopper else call) if asked else None
    return KernelsReport(name, reason, chosen.path, chosen.not_taken, pieces, split_reason)


def _piece_shapes(q, k, v, g, beta, cu_seqlens, pieces, chunk_size):
    """Shape stand-ins of the pieces' call of the sequence split: B * P rows of its piece length
    (packed: one row of it per piece, the documents and a padding one)."""
    L = split_plan.piece_length(q.shape[1], pieces, chunk_size)
    rows = 1 if cu_seqlens is not None else q.shape[0] * pieces
    sds = lambda x: jax.ShapeDtypeStruct((rows, L) + tuple(x.shape[2:]), x.dtype)
    cu = None if cu_seqlens is None else jax.ShapeDtypeStruct((cu_seqlens.shape[0] + 1,), jnp.int32)
    return sds(q), sds(k), sds(v), sds(g), sds(beta), cu


def _route(q, k, v, g, beta, cu_seqlens, chunk_size, cfg, use_qk_l2norm=False):
    """The route of :func:`to_kernel_inputs` for these arrays (or shape stand-ins), traced."""
    box = []
    jax.eval_shape(lambda *a: box.append(to_kernel_inputs(*a[:5], chunk_size=chunk_size, cu_seqlens=a[5],
                                                          use_qk_l2norm=use_qk_l2norm, config=cfg).route) or 0,
                   q, k, v, g, beta, cu_seqlens)
    return box[0]


def pallas_gated_delta_rule(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, use_qk_l2norm, chunk_size,
                            forms, kernel_config: Optional[KernelConfig] = None):
    """The ``backend="pallas"`` implementation behind ``gated_delta_rule`` (which validates the
    arguments and calls :func:`supports` first).

    Returns (o [B,T,H,V] in the inputs' dtype (float32 for mixed dtypes), final_state
    [B,H,K,V] or [N,H,K,V] float32, valid: bool scalar, False for a malformed traced
    ``cu_seqlens``).
    """
    prep, args = _kernel_args(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, chunk_size, forms,
                              kernel_config)
    o, fin = chunk_gated_delta_rule(prep.route, *args)
    o, fin = prep.finish(o, fin)
    return o, fin, prep.valid


def pallas_final_state(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, use_qk_l2norm, chunk_size, forms,
                       kernel_config: Optional[KernelConfig] = None):
    """The final state of :func:`pallas_gated_delta_rule` alone, from the forward kernels' final-state-only
    runs (:func:`.vjp.chunk_final_state`; per kernel path, :data:`.paths.FORWARD`'s ``run_final``: no o
    written, no query-side work where the path has that mode). The pass that builds the state maps of
    :func:`gdn_jax.ops.state_maps.state_map` and of the sequence split reads only the final state.
    Same arguments (q is read only where Aqk is still formed -- the Hopper WY kernel -- or the path
    falls back to the full forward; a caller with no query may pass k); the same kernel path as the
    full op for these arrays; differentiable (the full op's backward with a zero output cotangent).

    Returns (final_state [B,H,K,V] or [N,H,K,V] float32 -- to float32 rounding the full op's, bit for
    bit on the paths tested --, valid: bool scalar, False for a malformed traced ``cu_seqlens``).

    Raises: NotImplementedError for a call the kernels do not take (:func:`supports`)."""
    prep, args = _kernel_args(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, chunk_size, forms,
                              kernel_config)
    _, fin = prep.finish(None, chunk_final_state(prep.route, *args))
    return fin, prep.valid


def _kernel_args(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, chunk_size, forms, kernel_config):
    """:func:`to_kernel_inputs` of a call the kernels take, and the custom_vjp's array arguments."""
    reason = supports(forms, chunk_size=chunk_size, K=q.shape[-1], V=v.shape[-1], dtype=v.dtype)
    if reason is not None:
        raise NotImplementedError(f"backend='pallas' {reason}")
    prep = to_kernel_inputs(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                            use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
                            config=KernelConfig() if kernel_config is None else kernel_config)
    # under shard_map(check_vma=True): every differentiable input varying like the others, so that the
    # custom_vjp's cotangents have their inputs' types (an invariant input, e.g. a zero state, is
    # made varying outside it; that cast's transpose sums its gradient over the axes)
    args = list(prep.args)
    args[:6] = [match_vma(a, *args[:6]) for a in args[:6]]
    return prep, args
