"""Packed sequences (``cu_seqlens``): per-token sequence ids and boundary flags, the re-layout
that puts every sequence on chunk boundaries, and the state-reset scan shared by every backend."""
from __future__ import annotations

import jax.numpy as jnp


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
