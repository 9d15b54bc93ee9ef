"""Affine state maps of a piece of a sequence: S_end = M S_start + N.

The gated delta rule is linear in the state and the values jointly: per (batch, head), with
per-head beta, every column of the K x V state evolves by the same K x K transitions
``a_t (I - beta_t k_t k_t^T)`` plus the write ``beta_t k_t v_t^T``. So a piece of a sequence maps
the state it starts from affinely, ``S_end = M S_start + N`` (M is K x K, N is K x V), and ONE
state pass of the op itself over the augmented values ``[0 | V]`` (width K + V) from the state
``[I | 0]`` yields ``[M | N]`` (``../shared/REFERENCE.md`` section 10, "Sequence split").
Maps of consecutive pieces compose, ``(M2, N2) o (M1, N1) = (M2 M1, M2 N1 + N2)``.

This module builds the maps with :func:`gated_delta_rule` on any backend (scan, chunk, pallas),
so it is differentiable wherever the op is. It is used by :mod:`gdn_jax.ops.context_parallel`
(pieces on different devices); an in-kernel sequence split can use the same function.

Not covered: per-value-channel beta ``[B, T, H, V]`` (each value column has its own transition,
so there would be one M per column): ``ValueError``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from ._warnings import internal_call
from ._common import GateForms, acc_dtype
from ._vma import match_vma
from .gated_delta_rule import gated_delta_rule, resolve_backend


def _check_beta(beta, v) -> None:
    if beta.ndim == v.ndim:
        raise ValueError(f"state maps need per-head beta [B, T, H]; per-value-channel beta of shape {tuple(beta.shape)} "
                         "gives every value column its own transition (one M per column): not supported")


def _augmented_widths(backend: str, forms: GateForms, chunk_size: int, K: int, V: int, dtype) -> bool:
    """True when ``backend`` takes the augmented width K + V in one call (else M and N are two calls)."""
    try:
        resolve_backend(backend, forms, chunk_size=chunk_size, K=K, V=K + V, dtype=dtype)
        return True
    except NotImplementedError:
        return False


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
    kw = dict(use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, backend=backend, kernel_config=kernel_config,
              output_final_state=True)

    def final_state(values, start):
        with internal_call():  # k as the query of a state-only pass: no head-first layout warning
            return gated_delta_rule(k, k, values, g, beta, initial_state=start, cu_seqlens=cu_seqlens, **kw)[1]

    return affine_state_map(final_state, k, v, g, beta, dtype=dt, initial_state=initial_state,
                            cu_seqlens=cu_seqlens, continues=continues,
                            augmented=_augmented_widths(backend, forms, chunk_size, K, V, vdt))


def affine_state_map(final_state, k, v, *rest, dtype, initial_state=None, cu_seqlens=None, continues=None,
                     augmented: bool = True):
    """The map ``(M, N)`` of any recurrence whose final state is linear in (initial state, values)
    jointly and acts on the state's columns alike: ``final_state(values [B, T, H, W], start
    [B or N, H, K, W]) -> [B or N, H, K, W]`` runs it (with the piece's ``cu_seqlens`` bound) for
    any width W. Arguments and result as :func:`state_map`; ``rest`` are the other inputs (for
    ``shard_map``'s varying-axes types only); ``augmented=False`` runs M and N as two calls."""
    if cu_seqlens is None and initial_state is not None:
        raise ValueError("state_map: initial_state is read only with cu_seqlens (documents that start inside "
                         "the piece); without it the map does not depend on a state")
    B, T, H, V = v.shape
    K = k.shape[-1]
    dt = dtype
    eye = jnp.broadcast_to(jnp.eye(K, dtype=dt), (H, K, K))
    if cu_seqlens is None:
        start_m = jnp.broadcast_to(eye, (B, H, K, K))
        start_n = jnp.zeros((B, H, K, V), dt)
    else:
        cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
        n_docs = cu.shape[0] - 1
        init = jnp.zeros((n_docs, H, K, V), dt) if initial_state is None else initial_state.astype(dt)
        first = jnp.minimum(jnp.searchsorted(cu[1:], 0, side="right"), n_docs - 1)
        cont = jnp.asarray(True if continues is None else continues)
        start_m = jnp.zeros((n_docs, H, K, K), dt).at[first].set(jnp.where(cont, eye, 0))
        start_n = init.at[first].set(jnp.where(cont, 0, init[first]))
        last = jnp.minimum(jnp.searchsorted(cu[1:], T - 1, side="right"), n_docs - 1)
    zeros = jnp.zeros(v.shape[:-1] + (K,), v.dtype)
    start_m, start_n, zeros = (match_vma(x, k, v, *[r for r in rest if r is not None])
                               for x in (start_m, start_n, zeros))
    if augmented:
        S = final_state(jnp.concatenate([zeros, v], -1), jnp.concatenate([start_m, start_n], -1))
        M, N = S[..., :K], S[..., K:]
    else:  # the columns are independent: the same maps from two calls of the backend's widths
        M, N = final_state(zeros, start_m), final_state(v, start_n)
    if cu_seqlens is not None:
        M, N = M[last][None], N[last][None]
    return M, N


def compose(M2, N2, M1, N1):
    """The map of piece 1 then piece 2: ``(M2 M1, M2 N1 + N2)`` (float32 matmuls at full precision)."""
    hi = jax.lax.Precision.HIGHEST
    return (jnp.einsum("...ij,...jk->...ik", M2, M1, precision=hi),
            jnp.einsum("...ij,...jk->...ik", M2, N1, precision=hi) + N2)


def apply_map(M, N, S):
    """``M S + N`` (float32 matmul at full precision)."""
    return jnp.einsum("...ij,...jk->...ik", M, S, precision=jax.lax.Precision.HIGHEST) + N
