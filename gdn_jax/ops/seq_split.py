"""The sequence split of ``backend="pallas"`` on one device (``KernelConfig.seq_split``).

With few, long sequences the state passes' programs (one per batch row, value head and block of
value columns, each a chain of chunk steps over the whole sequence) leave most SMs idle. The split
cuts every sequence into P pieces of equal length (a multiple of ``chunk_size``; the last one
padded with tokens of k = v = q = 0, beta = 0, g = 0, which leave the state as it is) and runs
them as extra batch rows, by composition of the Pallas op (above its ``custom_vjp``):

1. the maps ``S_end = M S_start + N`` of pieces 0 .. P - 2 from ONE call of the op on augmented
   values ``[0 | V]`` from ``[I | 0]`` (:func:`gdn_jax.ops.piece_maps.affine_state_map`; two calls
   where the width K + V is above what the kernels take), the final-state-only entry of the kernels
   (:func:`gdn_jax.ops.pallas.pallas_final_state`: no o of width K + V written);
2. a float32 scan over the pieces of each sequence (:func:`~gdn_jax.ops.piece_maps.entering_states`)
   from the true initial state: the state entering every piece;
3. the op on all pieces from those states: o, and the final state from the last piece.

The backward is JAX's reverse mode through the same program: the pieces' own backward kernels
(pieces as batch rows again) and the transposed scan and maps. Packed documents (``cu_seqlens``,
B = 1) may cross piece boundaries: each piece is one packed call of its own documents (the
boundaries clipped to it, :func:`~gdn_jax.ops.piece_maps.piece_documents`), the P calls batched with
``jax.vmap``; a document that starts inside a piece makes its M zero from there, and each
document's final state comes from the piece of its last token, as in
:mod:`gdn_jax.ops.context_parallel`. Exact to float32 rounding of the composed maps.

The final state alone (:func:`pallas_final_state`, the maps' pass of
:func:`gdn_jax.ops.state_maps.state_map` with the split asked for): the same maps and scan, then
the final-state-only entry on the last piece of each sequence (packed: on every piece, each
document's state from the piece of its last token).

Planning (how many pieces, or why none) is :func:`gdn_jax.ops.pallas.split_plan.decide`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import pallas as _pallas
from .pallas import split_plan
from .piece_maps import affine_state_map, document_owners, entering_states, piece_documents

F32 = jnp.float32


def pieces_for(q, v, *, chunk_size, forms, kernel_config):
    """``(pieces, reason)`` of :func:`gdn_jax.ops.pallas.split_plan.decide` for a call's arrays."""
    cfg = kernel_config
    if cfg is None or cfg.seq_split is None:
        return 1, None
    from .pallas.platform import default_platform, hopper_asked

    B, T, _, K = q.shape
    H, V = v.shape[2], v.shape[3]
    platform = cfg.platform or default_platform()
    return split_plan.decide(cfg.seq_split, B=B, T=T, H=H, K=K, V=V, chunk=chunk_size,
                             platform=platform, beta_per_channel=forms.beta_per_channel,
                             g_per_channel=forms.g_per_channel, hopper=hopper_asked(cfg.gpu_kernels, platform))


def pallas_op(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, use_qk_l2norm, chunk_size, forms,
              kernel_config=None):
    """``backend="pallas"`` with the sequence split where ``kernel_config.seq_split`` asks for it and
    :func:`pieces_for` takes the call, else :func:`gdn_jax.ops.pallas.pallas_gated_delta_rule`
    unchanged. Arguments and results as that function's (``(o, final_state, valid)``)."""
    pieces, _ = pieces_for(q, v, chunk_size=chunk_size, forms=forms, kernel_config=kernel_config)
    kw = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, forms=forms)
    if pieces == 1:
        return _pallas.pallas_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                               kernel_config=kernel_config, **kw)
    return split_gated_delta_rule(q, k, v, g, beta, pieces=pieces, initial_state=initial_state,
                                  cu_seqlens=cu_seqlens, kernel_config=kernel_config, **kw)


def pallas_final_state(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, use_qk_l2norm, chunk_size, forms,
                       kernel_config=None):
    """:func:`pallas_op`'s final state alone: ``(final_state, valid)``, from the final-state-only
    kernels (:func:`gdn_jax.ops.pallas.pallas_final_state`), with the sequence split where
    :func:`pallas_op` would split."""
    pieces, _ = pieces_for(q, v, chunk_size=chunk_size, forms=forms, kernel_config=kernel_config)
    kw = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, forms=forms)
    if pieces == 1:
        return _pallas.pallas_final_state(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                          kernel_config=kernel_config, **kw)
    _, fin, valid = split_gated_delta_rule(q, k, v, g, beta, pieces=pieces, initial_state=initial_state,
                                           cu_seqlens=cu_seqlens, kernel_config=kernel_config, final_only=True, **kw)
    return fin, valid


def _pad_time(x, Tp):
    return jnp.pad(x, [(0, 0), (0, Tp - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def split_gated_delta_rule(q, k, v, g, beta, *, pieces: int, scale, initial_state, cu_seqlens, use_qk_l2norm,
                           chunk_size, forms, kernel_config, final_only: bool = False):
    """The Pallas op with every sequence cut into ``pieces`` (the module docstring says how).

    Args: as :func:`gdn_jax.ops.pallas.pallas_gated_delta_rule` (validated, g floored; q, k
    ``[B, T, Hk, K]``, v ``[B, T, H, V]``, g, beta ``[B, T, H]``), ``pieces`` >= 2; ``final_only``:
    the final state alone (o None; the pieces' runs are final-state-only too).

    Returns:
      ``(o [B, T, H, V] in the kernels' output dtype, final state [B | N, H, K, V] float32, valid)``.
    """
    B, T, Hk, K = q.shape
    H, V = v.shape[2], v.shape[3]
    P = int(pieces)
    L = split_plan.piece_length(T, P, chunk_size)
    Tp = P * L
    inner = dataclasses.replace(kernel_config, seq_split=None)
    kw = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, forms=forms, kernel_config=inner)
    augmented = _pallas.supports(forms, chunk_size=chunk_size, K=K, V=K + V, dtype=v.dtype) is None
    q, k, v, g, beta = (_pad_time(x, Tp) for x in (q, k, v, g, beta))
    if cu_seqlens is None:
        return _split_dense(q, k, v, g, beta, B, T, P, L, initial_state, augmented, kw, final_only)
    return _split_packed(q, k, v, g, beta, T, P, L, initial_state, cu_seqlens, augmented, kw, final_only)


def _op(q, k, v, g, beta, start, cu, kw):
    return _pallas.pallas_gated_delta_rule(q, k, v, g, beta, initial_state=start, cu_seqlens=cu, **kw)


def _final(q, k, v, g, beta, start, cu, kw):
    """The final-state-only op: ``(None, final state, valid)``, as :func:`_op`'s results."""
    return (None,) + tuple(_pallas.pallas_final_state(q, k, v, g, beta, initial_state=start, cu_seqlens=cu, **kw))


def _split_dense(q, k, v, g, beta, B, T, P, L, initial_state, augmented, kw, final_only=False):
    H, K, V = v.shape[2], k.shape[-1], v.shape[-1]
    rows = lambda x: x.reshape(B * P, L, *x.shape[2:])  # row b P + p: piece p of sequence b
    head = lambda x: x.reshape(B, P, L, *x.shape[2:])[:, :P - 1].reshape(B * (P - 1), L, *x.shape[2:])
    km, vm, gm, bm = (head(x) for x in (k, v, g, beta))

    def final_state(values, start):  # k as the query of a state-only pass
        return _final(km, km, values, gm, bm, start, None, kw)[1]

    M, N = affine_state_map(final_state, km, vm, dtype=F32, augmented=augmented)
    to_pieces = lambda x: jnp.swapaxes(x.reshape(B, P - 1, *x.shape[1:]), 0, 1)  # [P - 1, B, H, ...]
    x0 = jnp.zeros((B, H, K, V), F32) if initial_state is None else initial_state.astype(F32)
    x_last, entering = entering_states(to_pieces(M), to_pieces(N), x0)
    if final_only:  # the last piece of each sequence alone, from the state entering it
        last = lambda x: x.reshape(B, P, L, *x.shape[2:])[:, -1]
        return _final(*(last(x) for x in (q, k, v, g, beta)), x_last, None, kw)
    starts = jnp.concatenate([entering, x_last[None]], 0)  # [P, B, H, K, V]
    starts = jnp.swapaxes(starts, 0, 1).reshape(B * P, H, K, V)
    o, fin, valid = _op(*(rows(x) for x in (q, k, v, g, beta)), starts, None, kw)
    o = o.reshape(B, P * L, H, V)[:, :T]
    return o, fin.reshape(B, P, H, K, V)[:, -1], valid


def _split_packed(q, k, v, g, beta, T, P, L, initial_state, cu_seqlens, augmented, kw, final_only=False):
    H, K, V = v.shape[2], k.shape[-1], v.shape[-1]
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    N = cu.shape[0] - 1
    valid = (cu[0] == 0) & (cu[-1] == T) & jnp.all(jnp.diff(cu) >= 0)
    cu = jnp.concatenate([cu, jnp.array([P * L], jnp.int32)])  # one more document: the padding
    init = jnp.zeros((N, H, K, V), F32) if initial_state is None else initial_state.astype(F32)
    init = jnp.concatenate([init, jnp.zeros((1, H, K, V), F32)])
    pcs = lambda x: x.reshape(P, 1, L, *x.shape[2:])  # [P, 1, L, ...]: piece p as a call of batch 1
    q, k, v, g, beta = (pcs(x) for x in (q, k, v, g, beta))
    local_cu, first, continues = jax.vmap(lambda off: piece_documents(cu, off, L))(jnp.arange(P) * L)

    def piece_map(kp, vp, gp, bp, lcu, cont):
        def final_state(values, start):
            return _final(kp, kp, values, gp, bp, start, lcu, kw)[1]
        return affine_state_map(final_state, kp, vp, dtype=F32, initial_state=init, cu_seqlens=lcu, continues=cont,
                                augmented=augmented)

    M, Nm = jax.vmap(piece_map)(k[:-1], v[:-1], g[:-1], beta[:-1], local_cu[:-1], continues[:-1])  # [P-1, 1, H, ..]
    x_last, entering = entering_states(M, Nm, jnp.zeros((1, H, K, V), F32))  # piece 0 never continues
    starts = jnp.concatenate([entering, x_last[None]], 0)[:, 0]  # [P, H, K, V]

    def piece_run(qp, kp, vp, gp, bp, lcu, f, cont, s):
        local_init = init.at[f].set(jnp.where(cont, s, init[f]))
        if final_only:
            return _final(qp, kp, vp, gp, bp, local_init, lcu, kw)[1:]
        return _op(qp, kp, vp, gp, bp, local_init, lcu, kw)

    if final_only:
        o, (fin, ok) = None, jax.vmap(piece_run)(q, k, v, g, beta, local_cu, first, continues, starts)
    else:
        o, fin, ok = jax.vmap(piece_run)(q, k, v, g, beta, local_cu, first, continues, starts)
        o = o.reshape(1, P * L, H, V)[:, :T]
    fin = fin[document_owners(cu, L)[:N], jnp.arange(N)]  # each document's from the piece of its last token
    return o, fin, valid & jnp.all(ok)
