"""Packed sequences (``cu_seqlens``), shared by every backend: per-token sequence ids and
boundary flags, the state-reset scan, the re-layout that puts every sequence on chunk boundaries
and the per-chunk flags the Pallas kernels read.

``cu_seqlens`` is an integer ``[N + 1]`` array of boundaries from 0 to T (non-decreasing; an
empty sequence keeps its initial state) of N sequences packed along T with batch size 1, as in
FLA and varlen FlashAttention. It may be traced: everything here works on traced values, and
``valid`` flags say whether a traced one was well formed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ._vma import match_vma


def seq_info(cu_seqlens, T: int):
    """Per-token sequence ids and start flags for packed sequences.

    Returns (seq_id [T] int32, is_start [T] bool, is_last [T] bool, valid scalar bool).
    ``valid`` is False when the (possibly traced) cu_seqlens is malformed.
    """
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    t = jnp.arange(T, dtype=jnp.int32)
    # index n of the sequence holding token t: number of ends <= t.
    seq_id = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
    seq_id = jnp.minimum(seq_id, cu.shape[0] - 2)
    is_start = t == cu[seq_id]
    is_last = t == cu[seq_id + 1] - 1
    valid = (cu[0] == 0) & (cu[-1] == T) & jnp.all(jnp.diff(cu) >= 0)
    return seq_id, is_start, is_last, valid


def token_resets(cu_seqlens, T: int):
    """``(resets, n_seq, valid)`` for a token-by-token :func:`scan_with_resets` (``(None, None,
    True)`` without ``cu_seqlens``)."""
    if cu_seqlens is None:
        return None, None, jnp.asarray(True)
    seq_id, is_start, is_last, valid = seq_info(cu_seqlens, T)
    return (seq_id, is_start, is_last), cu_seqlens.shape[0] - 1, valid


def scan_with_resets(step, xs, initial_state, *, state_shape, dtype, resets=None, n_seq=None):
    """``lax.scan`` of ``step(S, x) -> (S, y)`` over the leading axis of ``xs`` (tokens or chunks).

    Without ``resets``: S starts from ``initial_state`` (zeros ``state_shape`` if None). With
    ``resets = (seq, first, last)`` ([steps] arrays: sequence id, first / last step of it), S
    restarts from ``initial_state[seq]`` (``[n_seq, ...]``, zeros if None) at every first step
    and is stored as sequence ``seq``'s final state after its last step; a sequence without steps
    keeps its initial state. Returns ``(final_state, ys)``: final_state ``state_shape`` or
    ``[n_seq] + state_shape[1:]``.
    """
    if resets is None:
        S0 = jnp.zeros(state_shape, dtype) if initial_state is None else initial_state.astype(dtype)
        return jax.lax.scan(step, S0, xs)
    seq, first, last = resets
    h0 = jnp.zeros((n_seq,) + tuple(state_shape[1:]), dtype) if initial_state is None else initial_state.astype(dtype)

    def body(carry, x):
        S, fin = carry
        sid, is_first, is_last, xt = x
        S = jnp.where(is_first, h0[sid][None], S)
        S, y = step(S, xt)
        fin = fin.at[sid].set(jnp.where(is_last, S[0], fin[sid]))
        return (S, fin), y

    S0 = match_vma(jnp.zeros(state_shape, dtype), h0, *jax.tree.leaves(xs))  # varying like them under shard_map
    (_, fin), ys = jax.lax.scan(body, (S0, match_vma(h0, *jax.tree.leaves(xs))), (seq, first, last, xs))
    return fin, ys


def _chunk_layout(cu_seqlens, T: int, C: int):
    """Static padded length and index maps that put every packed sequence on chunk boundaries."""
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    N = cu.shape[0] - 1
    lens = cu[1:] - cu[:-1]
    plen = ((lens + C - 1) // C) * C
    pstart = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(plen)]).astype(jnp.int32)
    T_pad = -(-(T + N * (C - 1)) // C) * C
    t = jnp.arange(T, dtype=jnp.int32)
    seq_id = jnp.minimum(jnp.searchsorted(cu[1:], t, side="right"), N - 1).astype(jnp.int32)
    pos = t - cu[seq_id] + pstart[seq_id]
    n_chunks = T_pad // C
    p = jnp.arange(n_chunks, dtype=jnp.int32) * C
    cseq = jnp.minimum(jnp.searchsorted(pstart[1:], p, side="right"), N - 1).astype(jnp.int32)
    used = p < pstart[-1]
    first = used & (p == pstart[cseq])
    last = used & (p + C == pstart[cseq + 1])
    return T_pad, pos, cseq, first, last


def to_chunk_layout(xs, cu_seqlens, C: int):
    """Pad (or, with ``cu_seqlens``, re-lay) the ``[B, T, ...]`` arrays ``xs`` onto whole chunks.

    Padding is zeros (g = 0, beta = 0, q = k = v = 0 leave the state untouched). With packed
    sequences every sequence starts on a chunk boundary (at most N (C - 1) extra tokens). Returns
    ``(xs, T_pad, packing, valid)``: ``packing`` is None or ``(pos, chunk_seq, first, last)``
    (token positions in the new layout; per chunk: sequence id, first / last chunk of it);
    ``valid`` is False for a malformed traced ``cu_seqlens``.
    """
    B, T = xs[0].shape[:2]
    if cu_seqlens is None:
        T_pad = -(-T // C) * C
        pad = T_pad - T
        padf = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) if pad else x
        return tuple(map(padf, xs)), T_pad, None, jnp.asarray(True)
    valid = seq_info(cu_seqlens, T)[3]
    T_pad, pos, cseq, cfirst, clast = _chunk_layout(cu_seqlens, T, C)
    scat = lambda x: jnp.zeros((B, T_pad) + x.shape[2:], x.dtype).at[:, pos].set(x)
    return tuple(map(scat, xs)), T_pad, (pos, cseq, cfirst, clast), valid


def from_chunk_layout(o, T: int, packing):
    """Inverse of :func:`to_chunk_layout` for an output ``[B, T_pad, ...]``."""
    return o[:, :T] if packing is None else o[:, packing[0]]


def chunk_resets(packing):
    """The ``resets`` of a chunk-by-chunk :func:`scan_with_resets` from :func:`to_chunk_layout`'s
    ``packing`` (None without packed sequences)."""
    return None if packing is None else tuple(packing[1:])


def n_seq(cu_seqlens):
    """Number of packed sequences (None without ``cu_seqlens``)."""
    return None if cu_seqlens is None else cu_seqlens.shape[0] - 1


def chunk_flags(chunk_seq, first, last):
    """Per-chunk int32 flags ``seq * 4 + first + 2 * last`` (one SMEM-friendly array for the
    kernels; decoded by ``gdn_jax.ops.pallas.tiles.chunk_flags``)."""
    return (chunk_seq * 4 + first.astype(jnp.int32) + 2 * last.astype(jnp.int32)).astype(jnp.int32)


def split_chunk_flags(flags, r: int):
    """The flags of a chunking split ``r`` ways: sequence ids repeat, ``first`` stays on the first
    piece, ``last`` on the last."""
    if r == 1:
        return flags
    sub = jnp.arange(r, dtype=jnp.int32)[None, :]
    i = flags[:, None]
    out = (i >> 2) * 4 + (i & 1) * (sub == 0) + (i & 2) * (sub == r - 1)
    return out.reshape(-1).astype(jnp.int32)


def sequences_with_chunks(flags, n_seq: int):
    """[n_seq] bool: the sequence owns at least one chunk (an empty one passes its state through)."""
    first = (flags & 1) != 0
    return jnp.zeros((n_seq,), jnp.int32).at[flags >> 2].max(first.astype(jnp.int32)) > 0
