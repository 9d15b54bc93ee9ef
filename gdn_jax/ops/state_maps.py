"""Affine state maps of a piece of a sequence: S_end = M S_start + N.

The gated delta rule is linear in the state and the values jointly: per (batch, head), with
per-head beta, every column of the K x V state evolves by the same K x K transitions
``a_t (I - beta_t k_t k_t^T)`` plus the write ``beta_t k_t v_t^T``. So a piece of a sequence maps
the state it starts from affinely, ``S_end = M S_start + N`` (M is K x K, N is K x V), and ONE
state pass of the op itself over the augmented values ``[0 | V]`` (width K + V) from the state
``[I | 0]`` yields ``[M | N]`` (``../shared/REFERENCE.md`` section 10, "Sequence split").
Maps of consecutive pieces compose, ``(M2, N2) o (M1, N1) = (M2 M1, M2 N1 + N2)``.

This module builds the maps with the op on any backend (scan, chunk, pallas), so it is
differentiable wherever the op is: :func:`gdn_jax.ops.gated_delta_rule.final_state`, the op's final
state alone -- on the pallas backend the kernels' final-state-only forward (no o of width K + V
written, no query-side work on the paths that have that mode: ``gdn_jax/ops/pallas/paths.py``), on
scan and chunk the op itself (XLA drops its o as dead code). It is used by :mod:`gdn_jax.ops.context_parallel`
(pieces on different devices). The algebra with no op in it (:func:`affine_state_map`,
:func:`compose`, :func:`apply_map`, the scan over pieces) lives in :mod:`gdn_jax.ops.piece_maps`,
which the one-device sequence split of the Pallas op (:mod:`gdn_jax.ops.seq_split`) also uses.

Not covered: per-value-channel beta ``[B, T, H, V]`` (each value column has its own transition,
so there would be one M per column): ``ValueError``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from ._warnings import internal_call
from ._common import GateForms, acc_dtype
from .gated_delta_rule import final_state as _final_state, resolve_backend
from .piece_maps import affine_state_map, apply_map, compose  # noqa: F401  (importable here)


def _check_beta(beta, v) -> None:
    if beta.ndim == v.ndim:
        raise ValueError(f"state maps need per-head beta [B, T, H]; per-value-channel beta of shape {tuple(beta.shape)} "
                         "gives every value column its own transition (one M per column): not supported")


def _augmented_widths(backend: str, forms: GateForms, chunk_size: int, K: int, V: int, dtype,
                      platform: Optional[str] = None) -> bool:
    """True when ``backend`` runs the augmented width K + V in one call on the same backend as the
    widths K and V (else M and N are two calls). ``"auto"`` resolves by width: at K = V = 256 the
    width 512 is beyond the Pallas kernels and would fall to the chunk form, which on one H100 made
    the map pass 5.85 ms where the plain forward takes 0.375 ms (2 x 8192 x 8 x 256, bf16;
    ``results/context_parallel_gpu/NOTE.md``); two Pallas calls of widths K and V keep it there."""
    try:
        wide = resolve_backend(backend, forms, chunk_size=chunk_size, K=K, V=K + V, dtype=dtype, platform=platform)
    except NotImplementedError:
        return False
    narrow = {resolve_backend(backend, forms, chunk_size=chunk_size, K=K, V=w, dtype=dtype, platform=platform)
              for w in (K, V)}
    return narrow == {wide}


def state_map(
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    initial_state: Optional[jax.Array] = None,
    cu_seqlens: Optional[jax.Array] = None,
    continues: Optional[jax.Array] = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    backend: str = "auto",
    kernel_config=None,
) -> Tuple[jax.Array, jax.Array]:
    """The affine map ``S_end = M S_start + N`` of a piece of a sequence, from one augmented pass.

    Without ``cu_seqlens``: the op's final state from any initial state S is ``M S + N`` (to
    rounding). With ``cu_seqlens`` (packed documents, B = 1): S_start is the state of the
    document holding the piece's first token, entering it (used only if ``continues``: that
    document started in an earlier piece); S_end is the state of the document holding the LAST
    token, after it. Documents that start inside the piece start from ``initial_state[n]`` (zero if
    None) and so land in N; when any document starts inside the piece, or ``continues`` is
    False, M is 0 from there on.

    Args:
      k: ``[B, T, Hk, K]`` keys (any float dtype).
      v: ``[B, T, H, V]`` values (H a multiple of Hk: grouped value heads).
      g: ``[B, T, H]`` or ``[B, T, H, K]`` log decay (per-key-channel where the backend takes it).
      beta: ``[B, T, H]`` (per-value-channel beta is a ``ValueError``).
      initial_state: with ``cu_seqlens`` only: ``[N, H, K, V]`` states the documents that start
        inside the piece start from (None: zeros). Without ``cu_seqlens`` it must be None (the
        map does not depend on it).
      cu_seqlens: integer ``[N + 1]`` boundaries of the documents inside the piece (from 0 to T).
      continues: with ``cu_seqlens``: a bool scalar (may be traced): the first document
        continues from an earlier piece (True: M maps its entering state; False: it starts from
        ``initial_state``, M = 0). Default True.
      use_qk_l2norm, chunk_size, backend, kernel_config: as :func:`gated_delta_rule` (the pass
        runs the op; q is not read by the map, k is passed as q).

    Returns:
      ``(M, N)``: M ``[B, H, K, K]`` and N ``[B, H, K, V]`` (``[1, H, ...]`` with ``cu_seqlens``)
      in the op's state dtype (float32; float64 for float64 inputs).

    Raises:
      ValueError: per-value-channel beta; an ``initial_state`` without ``cu_seqlens``; and
        whatever :func:`gated_delta_rule` raises for the arguments.

    Source: ``../shared/REFERENCE.md`` section 10; FlashQLA's sequence split and
    jax-linear-attention's context parallelism use the same maps.
    """
    _check_beta(beta, v)
    dt = acc_dtype(k, v, g, beta)
    forms = GateForms(g_per_channel=g.ndim == 4, beta_per_channel=False)
    K, V = k.shape[-1], v.shape[-1]
    vdt = jnp.float64 if dt == jnp.float64 else v.dtype
    kw = dict(use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, backend=backend, kernel_config=kernel_config)

    def final_state(values, start):
        with internal_call():  # k as the query of a state-only pass: no head-first layout warning
            return _final_state(k, k, values, g, beta, initial_state=start, cu_seqlens=cu_seqlens, **kw)

    return affine_state_map(final_state, k, v, g, beta, dtype=dt, initial_state=initial_state,
                            cu_seqlens=cu_seqlens, continues=continues,
                            augmented=_augmented_widths(backend, forms, chunk_size, K, V, vdt))
