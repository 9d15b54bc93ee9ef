"""The algebra of affine state maps of pieces of a sequence, with no operator in it.

A piece of a sequence maps the state it starts from affinely, ``S_end = M S_start + N``
(:mod:`gdn_jax.ops.state_maps` says why, for the gated delta rule). Here: the map from any
recurrence that is linear in (state, values) jointly (:func:`affine_state_map`), composition
(:func:`compose`, :func:`apply_map`), the float32 scan that turns the maps of consecutive pieces
into the states entering each piece (:func:`entering_states`), and the bookkeeping of packed
documents (``cu_seqlens``) over pieces of equal length (:func:`piece_documents`,
:func:`document_owners`). Shared by :mod:`gdn_jax.ops.context_parallel` (pieces on devices) and
:mod:`gdn_jax.ops.seq_split` (pieces as extra batch rows of one kernel call). No import of an op,
so that the op's dispatch may use it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ._vma import match_vma


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


def entering_states(Ms, Ns, x0):
    """The states entering consecutive pieces: ``x_0 = x0``, ``x_{p+1} = M_p x_p + N_p`` (float32
    matmuls at full precision, a ``lax.scan`` over the leading axis of ``Ms`` [P, ..., K, K] and
    ``Ns`` [P, ..., K, V]). Returns ``(x_P, [x_0 .. x_{P-1}])``: the state after the last piece and
    the states entering each piece ([P, ..., K, V])."""
    def step(x, mn):
        return apply_map(mn[0], mn[1], x), x

    return jax.lax.scan(step, match_vma(x0, Ms, Ns), (Ms, Ns))


def piece_documents(cu, offset, length):
    """Packed documents (``cu`` int32 [N + 1], global boundaries) seen from the piece of tokens
    ``[offset, offset + length)``: ``(local_cu, first, continues)`` -- the boundaries clipped to the
    piece (an integer [N + 1] from 0 to ``length``; documents outside it are empty), the document of
    the piece's first token, and whether that document started in an earlier piece (then its state
    enters from there; else the piece's map has M = 0). ``offset`` may be traced."""
    n_docs = cu.shape[0] - 1
    local_cu = jnp.clip(cu - offset, 0, length)
    first = jnp.minimum(jnp.searchsorted(cu[1:], offset, side="right"), n_docs - 1)
    return local_cu, first, cu[first] < offset


def document_owners(cu, length):
    """The piece (of pieces of ``length`` tokens) holding each document's last token, [N] int32
    (an empty document: piece 0, whose run keeps its initial state)."""
    ends = cu[1:]
    return jnp.where(ends > cu[:-1], (ends - 1) // length, 0)
