"""The public operator: ``gated_delta_rule`` and its backend dispatch; and :func:`final_state`, the op's
final state alone (internal: the state-map passes of :mod:`gdn_jax.ops.state_maps` and
:mod:`gdn_jax.ops.seq_split`)."""
from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from . import chunk as _chunk
from . import scan as _scan
from ._warnings import warn_head_first, warn_pallas_interpreter
from ._common import (acc_dtype, check_flags, check_inputs, chunk_for, clamp_log_decay, finish_outputs,
                      nonfinite_guard, poison_if_invalid, prepare, repeat_key_heads, value_group)

from .backends import (AUTO_F32_MAX_DIM, AUTO_F32_MIN_DIM, BACKENDS, _pallas_module,  # noqa: F401  (importable here)
                       check_kernel_config, resolve_backend)


def gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[jax.Array] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[jax.Array] = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    backend: str = "auto",
    mask_nonfinite: bool = False,
    kernel_config=None,
) -> Tuple[jax.Array, Optional[jax.Array]]:
    """Gated delta rule (Gated DeltaNet; Yang, Kautz & Hatamizadeh, ICLR 2025, eq. 10).

    Per batch element and head, with state S in R^{K x V} (float32; float64 for float64 inputs)::

        S   <- exp(g_t) * S                             # decay FIRST
        S   <- S + k_t (beta_t * (v_t - S^T k_t))^T      # delta-rule write; prediction from the decayed state
        o_t  = S^T (scale * q_t)

    i.e. S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T with a_t = exp(g_t). This is the
    paper's, FLA's and Qwen3-Next's order (reading the prediction from S_{t-1} before the decay
    differs measurably under strong gates; see the README's operator section). g = 0 gives DeltaNet.

    Under ``jax.jit`` on inputs split along the batch and / or the heads (``NamedSharding``), every
    backend keeps that sharding, forward and backward, with no all-gather (docs/data_parallel.md).

    Args:
      q, k: ``[B, T, Hk, K]`` queries and keys, any float dtype.
      v: ``[B, T, H, V]`` values; ``o`` is returned in ``v.dtype``. Grouped value heads (GVA, as in
        Qwen3-Next / Qwen3.5): H may be a multiple of the key heads Hk; value head j then reads
        query / key head ``j // (H // Hk)`` (HF's ``repeat_interleave`` order), g, beta and the
        state live on the H value heads, and dq, dk sum over each group. The pallas kernels read
        the shared key head through their index maps (q, k are not repeated in memory); scan and
        chunk (and ``mask_nonfinite``) repeat q, k. H = Hk is the usual one-to-one case.
      g: LOG-space decay (g <= 0; the state is multiplied by exp(g); -inf allowed, a full reset;
        a positive entry of a concrete g is a ``ValueError``, a traced g is not checked).
        The chunked backends (chunk, pallas) floor g at -87 with float32 accumulation (exp(-87) ~
        1.6e-38, the edge of float32's normal range) and at -1000 in float64, so that cumulative
        decays inside a chunk stay bounded; the scan floors nothing. Gradients are accurate
        relative to the float64 recurrence wherever their true value is a float32 normal number;
        below that (per-token gates under about -87, where dg ~ exp(g) underflows) they are 0,
        which is exact to float32's absolute resolution. ``[B, T, H]`` per head
        (GDN, Qwen3-Next) or ``[B, T, H, K]`` per key channel (Kimi Delta Attention: row c of S
        is scaled by exp(g[..., c])).
      beta: write strength, ``[B, T, H]`` per head or ``[B, T, H, V]`` per value channel
        (only ``backend="scan"`` takes it). Usually in (0, 1); (0, 2) allows
        negative eigenvalues (needs unit-norm keys).
      scale: query scale; ``None`` means ``K ** -0.5``.
      initial_state: ``[B, H, K, V]`` (``[N, H, K, V]`` with ``cu_seqlens``), default zeros.
      output_final_state: also return the final state.
      cu_seqlens: integer ``[N + 1]`` boundaries of N packed sequences, from 0 to T, non-decreasing
        (an empty sequence keeps its initial state); requires B = 1. The state restarts at every
        boundary from ``initial_state[n]`` (or zero). May be a traced value of static length
        under ``jit`` (packing can change every step without recompiling). Concrete values are
        validated (``ValueError``); traced values cannot be, so a malformed traced ``cu_seqlens``
        (not starting at 0, not ending at T, or decreasing) makes the op return an all-NaN ``o``
        and final state, whose gradients are NaN too, rather than silently wrong ones.
      use_qk_l2norm: L2-normalise q and k over the last axis inside the op
        (``x / sqrt(sum(x**2) + 1e-6)``), before the scale is applied.
      chunk_size: tokens per chunk for the chunked backends (16, 32, 64 or 128 are tested).
      backend: ``"scan"`` (token-by-token ``lax.scan``: the oracle, every gate form),
        ``"chunk"`` (WY/UT chunked matmuls; per-head or per-key-channel g, per-head beta),
        ``"pallas"`` (Pallas kernels of the chunked form; see its module for coverage) or
        ``"auto"`` (pallas on GPU/TPU for the bfloat16/float16 inputs it covers and on GPU for
        float32 inputs with 32 <= max(K, V) <= 128, scan for per-value-channel beta, chunk
        otherwise: see :func:`resolve_backend`).
      mask_nonfinite: make a NaN / inf input unable to reach back in time (default off).
        Off, non-finite inputs are not masked: a NaN or +inf in k, v, g or beta at token t makes
        the final state NaN and, through the chunk's matmuls (a zero weight times NaN is NaN), every
        output of t's chunk and after (the scan: outputs from t on; outputs of earlier chunks are
        unchanged) and, on the chunked backends, NaNs into the gradients of every earlier token of
        that sequence and head -- loud, never silently wrong. On, every backend zeroes such a token (and a non-finite q_t) before
        the recurrence and writes NaN into the outputs at and after it (q: o_t only) and into its
        sequence's final state; outputs before t, and the gradients of a loss that reads only
        them, are exactly those of the sequence without it, and a loss that reads a poisoned output
        gets NaN gradients. Costs a pass over q, k, v (measured on an H200: pallas fwd+bwd +8%
        at 4x4096x16x128, chunk +8% with per-channel g at 128x512x2x64), hence opt-in.
      kernel_config: a :class:`gdn_jax.ops.KernelConfig` (frozen, hashable: a static argument
        under ``jit``) with the Pallas kernels' options -- platform, chunk sizes, blocks, warps,
        intermediate precisions; None means the defaults. Only the pallas backend takes one: with
        ``backend="scan"`` / ``"chunk"`` it is a ``ValueError``; with ``"auto"`` it applies when
        auto picks pallas.

    Returns:
      ``(o, final_state)``: o ``[B, T, H, V]`` in ``v.dtype``; final_state ``[B, H, K, V]``
      (``[N, H, K, V]`` with ``cu_seqlens``) in float32 (float64 for float64 inputs), or ``None``
      unless ``output_final_state``.

    Warns (once per process; ``gdn_jax.ops._warnings``):
      HeadFirstLayoutWarning: ``1 < T < H`` in a direct call (a head-first ``[B, H, T, K]`` array
        read as ``[B, T, H, K]``?); the layers never trigger it.
      PallasInterpreterWarning: ``backend="pallas"`` on the CPU without ``KernelConfig.platform``
        (the kernels run in the slow interpreter).

    Raises:
      TypeError: non-floating q/k/v/g/beta/initial_state, non-integer cu_seqlens or chunk_size, a
        non-bool use_qk_l2norm / output_final_state / mask_nonfinite, a scale that is not a real
        number (Python, NumPy or 0-d array), a kernel_config that is not a :class:`KernelConfig`.
      ValueError: wrong ranks or mismatched B/T/H/K/V (the message names the argument and gives the
        shape received and expected), T = 0 or zero heads / channels, chunk_size <= 0, cu_seqlens
        with B != 1 or not from 0 to T or decreasing, a concrete g with a positive finite entry,
        initial_state of the wrong shape, a
        non-finite concrete scale, unknown backend, a kernel_config with a backend other than
        pallas / auto.
      NotImplementedError: an explicit backend that does not take the call: per-value-channel beta
        (pallas, chunk), per-key-channel g (pallas), and for pallas a chunk_size other than
        :data:`~gdn_jax.ops.pallas.SUPPORTED_CHUNK_SIZES`, a head dim K or V that is not a multiple
        of 16 up to the kernels' maximum, float64 inputs (the message names the option and the
        backend that takes it).
    """
    check_flags(use_qk_l2norm=use_qk_l2norm, output_final_state=output_final_state, mask_nonfinite=mask_nonfinite)
    (q, k, v, g, beta, initial_state, cu_seqlens), forms, dt, which = _checked_call(
        q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, scale, backend, kernel_config)
    group = value_group(q, v)
    if group > 1 and (which != "pallas" or mask_nonfinite):  # the Pallas kernels share key heads in-kernel
        q, k = repeat_key_heads(q, group), repeat_key_heads(k, group)
    if mask_nonfinite:
        (q, k, v, g, beta), guard_finish = nonfinite_guard(
            q, k, v, g, beta, cu_seqlens, g_pc=forms.g_per_channel, b_pc=forms.beta_per_channel
        )
    if which != "scan":  # the chunked forms floor g (see clamp_log_decay); the scan takes it as is
        g = clamp_log_decay(g, dt)
    if which == "pallas":
        pallas_op = _pallas_module().pallas_gated_delta_rule
        if getattr(kernel_config, "seq_split", None) is not None:  # the sequence split (gdn_jax.ops.seq_split)
            from .seq_split import pallas_op
        o, fin, valid = pallas_op(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
            use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, forms=forms, kernel_config=kernel_config,
        )
    else:
        qs, ks, vs, gs, bs = prepare(q, k, v, g, beta, scale, use_qk_l2norm, dt)
        h0 = None if initial_state is None else initial_state.astype(dt)
        if which == "scan":
            o, fin, valid = _scan.scan_forward(
                qs, ks, vs, gs, bs, h0, cu_seqlens, g_pc=forms.g_per_channel, b_pc=forms.beta_per_channel
            )
        else:
            o, fin, valid = _chunk.chunk_forward(
                qs, ks, vs, gs, bs, h0, cu_seqlens, chunk_size=chunk_for(chunk_size, q.shape[1]),
                g_pc=forms.g_per_channel, b_pc=forms.beta_per_channel,
            )
    return finish_outputs(o, fin, v.dtype, guard_finish=guard_finish if mask_nonfinite else None, valid=valid,
                          packed=cu_seqlens is not None, output_final_state=output_final_state)


def _checked_call(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, scale, backend, kernel_config):
    """The op's checks and backend choice: ``((q, k, v, g, beta, initial_state, cu_seqlens) as JAX
    arrays where NumPy ones came, forms, accumulation dtype, the backend that runs)``; warns as
    :func:`gated_delta_rule` says, naming the caller of the function that calls this."""
    # NumPy arrays as JAX would take them (float64 -> float32 unless jax_enable_x64), so that every
    # backend sees the same dtypes
    q, k, v, g, beta = (jnp.asarray(x) if isinstance(x, np.ndarray) else x for x in (q, k, v, g, beta))
    if isinstance(initial_state, np.ndarray):
        initial_state = jnp.asarray(initial_state)
    forms = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, scale)
    check_kernel_config(kernel_config, backend)
    # direct calls only (layers call inside _warnings.internal_call); stacklevel 3: the op's caller
    warn_head_first("gated_delta_rule", q, stacklevel=3)
    K, V = q.shape[-1], v.shape[-1]
    dt = acc_dtype(q, k, v, g, beta, initial_state)
    # any float64 input makes the call float64 (the kernels take none: pallas refuses, auto picks chunk)
    which = resolve_backend(backend, forms, chunk_size=chunk_size, K=K, V=V,
                            dtype=jnp.float64 if dt == jnp.float64 else v.dtype)
    if which == "pallas" and q.shape[0] == 0:  # an empty batch: nothing to compute, no kernel to launch
        which = "chunk"
    if which == "pallas":
        warn_pallas_interpreter(kernel_config, stacklevel=3)  # on the CPU: the slow interpreter
    if cu_seqlens is not None:
        cu_seqlens = jnp.asarray(cu_seqlens)
    return (q, k, v, g, beta, initial_state, cu_seqlens), forms, dt, which


def final_state(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[jax.Array] = None,
    cu_seqlens: Optional[jax.Array] = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    backend: str = "auto",
    kernel_config=None,
) -> jax.Array:
    """The final state of :func:`gated_delta_rule` alone (internal: the maps' pass of
    :func:`gdn_jax.ops.state_maps.state_map`, which reads nothing else).

    Where the backend resolves to ``"pallas"`` it runs the kernels' final-state-only forward
    (:func:`gdn_jax.ops.pallas.pallas_final_state`, with the sequence split where
    ``kernel_config.seq_split`` asks for it: :func:`gdn_jax.ops.seq_split.pallas_final_state`): no
    o is written, and the query-side work is skipped on the kernel paths that have that mode
    (:mod:`gdn_jax.ops.pallas.paths`). The scan and chunk backends run :func:`gated_delta_rule`
    itself, whose o XLA drops as dead code. Differentiable as the op.

    Args: as :func:`gated_delta_rule` (no ``output_final_state``, ``mask_nonfinite``: off).

    Returns:
      final_state ``[B, H, K, V]`` (``[N, H, K, V]`` with ``cu_seqlens``) in float32 (float64 for
      float64 inputs); the op's to float32 rounding (bit for bit on the kernel paths tested,
      ``tests/ops/test_final_state.py``); all-NaN for a malformed traced ``cu_seqlens``.

    Raises: as :func:`gated_delta_rule`.
    """
    check_flags(use_qk_l2norm=use_qk_l2norm)
    (q, k, v, g, beta, initial_state, cu_seqlens), forms, dt, which = _checked_call(
        q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, scale, backend, kernel_config)
    if which != "pallas":
        return gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
                                cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
                                backend=backend, kernel_config=kernel_config)[1]
    from .seq_split import pallas_final_state

    fin, valid = pallas_final_state(q, k, v, clamp_log_decay(g, dt), beta, scale=scale, initial_state=initial_state,
                                    cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
                                    forms=forms, kernel_config=kernel_config)
    return poison_if_invalid(fin, valid) if cu_seqlens is not None else fin
