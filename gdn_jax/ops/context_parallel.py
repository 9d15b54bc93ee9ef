"""Context parallelism: one sequence sharded along T over a mesh axis, exact.

Inside ``jax.shard_map`` every device holds a contiguous shard of T. Each shard maps the state
it starts from affinely, ``S_end = M S_start + N`` (:func:`gdn_jax.ops.state_maps.state_map`, one
augmented pass of the op). The shards all-gather their ``[M | N]`` over the axis, every device
composes the maps of the shards before its own in float32 (a P-step ``lax.scan`` of K x K by
K x (K + V) matmuls) into its true initial state, and then runs the ordinary op from it. The
backward is JAX's reverse mode through the same program: the all-gather's transpose
(a reduce-scatter) sends every shard's gradient of its initial state back to the shards whose
maps produced it, so the non-last shards' gradients are those of the unsharded op.

Collective per layer and direction (P devices, per batch element: ``H K (K + V)`` float32 words
per map): the all-gather receives ``(P - 1) B H K (K + V) 4`` bytes per device in ONE collective
(the backward's reduce-scatter the same). A prefix scan over ``ppermute`` would move
``log2(P) B H K (K + V) 4`` bytes but in ``log2(P)`` dependent steps, each followed by a K x K
by K x (K + V) matmul; for the P <= 8 of one host the all-gather's single step wins (latency,
not bytes, dominates maps of a few MiB), so the all-gather is used (docs/context_parallel.md).

Packed documents (``cu_seqlens``, B = 1) may cross shard boundaries: a document that starts
inside a shard makes that shard's M zero from there, and its N is that document's own state.
Per-document final states come from the shard holding each document's last token (a masked
``psum``).
"""
from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ._common import acc_dtype, check_cu_values, check_flags, poison_if_invalid
from .gated_delta_rule import gated_delta_rule
from .linear_attention import gated_linear_attention
from ._warnings import internal_call
from .piece_maps import affine_state_map, document_owners, entering_states, piece_documents
from .state_maps import state_map


def axis_size(axis_name, argument: str = "axis_name") -> int:
    """The size of mesh axis ``axis_name`` (a name or a tuple of names) of the enclosing
    ``jax.shard_map``; ``ValueError`` naming ``argument`` where no enclosing ``shard_map`` binds it
    (a misspelt axis, or a call outside ``shard_map``), instead of JAX's ``NameError``."""
    try:
        return jax.lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(f"{argument}={axis_name!r} is not a mesh axis of an enclosing jax.shard_map ({e}): call "
                         f"inside a shard_map whose mesh has that axis (a layer's or LM's context_axis, the "
                         f"context-parallel ops' axis_name)") from None


def _check_initial_state(initial_state, k, v, cu_seqlens) -> None:
    """``initial_state`` ``[B, H, K, V]`` (``[N, H, K, V]`` with ``cu_seqlens``), checked before the
    state maps use it (the op checks it only for the shard's own call, after them)."""
    if initial_state is None:
        return
    if not hasattr(initial_state, "shape"):
        raise TypeError(f"initial_state must be an array, got {type(initial_state).__name__}")
    n = v.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    want = (n, v.shape[2], k.shape[-1], v.shape[-1])
    if tuple(initial_state.shape) != want:
        what = "[N, H, K, V] (N = len(cu_seqlens) - 1)" if cu_seqlens is not None else "[B, H, K, V]"
        raise ValueError(f"initial_state must have shape {what} = {want}, got shape {tuple(initial_state.shape)}")


def _as_array(cu_seqlens):
    """A list or tuple of boundaries as a NumPy array (what :func:`gated_delta_rule` accepts)."""
    return np.asarray(cu_seqlens) if isinstance(cu_seqlens, (list, tuple)) else cu_seqlens


def _check_call(v, beta, cu_seqlens, mask_nonfinite, T_total):
    if beta.ndim == v.ndim:
        raise ValueError(f"context parallelism takes per-head beta [B, T, H]; per-value-channel beta of shape "
                         f"{tuple(beta.shape)} would need one state map per value column: not supported")
    if mask_nonfinite:
        raise ValueError("mask_nonfinite=True is not supported with context parallelism (its guard looks back "
                         "over the whole sequence); call without it")
    if cu_seqlens is not None:
        if not hasattr(cu_seqlens, "dtype") or not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
            got = getattr(cu_seqlens, "dtype", type(cu_seqlens).__name__)
            raise TypeError(f"cu_seqlens must be an integer array, got {got}")
        if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must have shape [N + 1] with N >= 1, got shape {tuple(cu_seqlens.shape)}")
        if v.shape[0] != 1:
            raise ValueError(f"cu_seqlens (packed sequences) needs batch size B = 1, got v of shape {tuple(v.shape)}")
        check_cu_values(cu_seqlens, T_total)


def context_parallel_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    axis_name,
    scale: Optional[float] = None,
    initial_state: Optional[jax.Array] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[jax.Array] = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    backend: str = "auto",
    kernel_config=None,
    mask_nonfinite: bool = False,
) -> Tuple[jax.Array, Optional[jax.Array]]:
    """:func:`gated_delta_rule` on this device's shard of T, inside ``jax.shard_map``, exact.

    Call it in a ``shard_map`` whose ``in_specs`` split the T axis of q, k, v, g, beta over the
    mesh axis ``axis_name`` into equal contiguous shards (device i of the axis holds tokens
    ``[i T_s, (i + 1) T_s)``). Outputs and gradients equal the unsharded op's to float32
    rounding (docs/context_parallel.md gives the measured differences).

    Args:
      q, k: ``[B, T_s, Hk, K]`` this shard's queries and keys.
      v: ``[B, T_s, H, V]`` (H a multiple of Hk: grouped value heads).
      g: ``[B, T_s, H]`` or ``[B, T_s, H, K]`` (per key channel, where the backend takes it).
      beta: ``[B, T_s, H]`` (per-value-channel beta: ``ValueError``).
      axis_name: the mesh axis (or tuple of axes) T is split over.
      initial_state: ``[B, H, K, V]`` (``[N, H, K, V]`` with ``cu_seqlens``), the same on every
        shard of the axis (replicated over it); None: zeros.
      output_final_state: also return the final state (the last shard's; with ``cu_seqlens``
        each document's from the shard holding its last token), the same on every shard.
      cu_seqlens: integer ``[N + 1]`` GLOBAL boundaries (from 0 to ``P T_s``) of packed documents,
        replicated over the axis; documents may cross shard boundaries. Needs B = 1.
      scale, use_qk_l2norm, chunk_size, backend, kernel_config: as :func:`gated_delta_rule`
        (every backend: scan, chunk, pallas).
      mask_nonfinite: must be False (``ValueError``).

    Returns:
      ``(o, final_state)``: o ``[B, T_s, H, V]`` in ``v.dtype`` (this shard's outputs);
      final_state as :func:`gated_delta_rule`'s, or None.

    Raises:
      ValueError: ``axis_name`` not bound by an enclosing ``shard_map``; per-value-channel beta,
        ``mask_nonfinite=True``, concrete ``cu_seqlens`` not from 0 to ``P T_s`` or decreasing, B != 1
        with ``cu_seqlens``, ``initial_state`` not ``[B, H, K, V]`` (``[N, H, K, V]``); and what
        :func:`gated_delta_rule` raises for the shard's arguments.
      TypeError: non-integer ``cu_seqlens``, non-bool flags.

    Source: ``../shared/REFERENCE.md`` section 10 ("Across devices"); FLA's KCP and
    jax-linear-attention's ``context_parallel_linear_attention`` use the same maps.
    """
    check_flags(output_final_state=output_final_state, mask_nonfinite=mask_nonfinite)
    cu_seqlens = _as_array(cu_seqlens)
    _check_call(v, beta, cu_seqlens, mask_nonfinite, axis_size(axis_name) * v.shape[1])
    _check_initial_state(initial_state, k, v, cu_seqlens)
    op = dict(use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, backend=backend, kernel_config=kernel_config)

    def run(s, cu, fin):
        with internal_call():  # a shard's T is not the caller's: no head-first layout warning
            return gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=s, cu_seqlens=cu,
                                    output_final_state=fin, **op)

    def maps(init, cu, continues):
        return state_map(k, v, g, beta, initial_state=init, cu_seqlens=cu, continues=continues, **op)

    return sharded_recurrence(run, maps, k, v, axis_name=axis_name, dtype=acc_dtype(q, k, v, g, beta, initial_state),
                              initial_state=initial_state, output_final_state=output_final_state,
                              cu_seqlens=cu_seqlens)


def sharded_recurrence(run, maps, k, v, *, axis_name, dtype, initial_state, output_final_state, cu_seqlens):
    """The shared part of the context-parallel ops (inside ``shard_map``): ``run(initial_state,
    cu_seqlens, output_final_state) -> (o, final)`` runs the op on this shard and ``maps(initial_state,
    cu_seqlens, continues) -> (M, N)`` gives its state map (:func:`~gdn_jax.ops.state_maps.state_map`);
    the rest (all-gather, float32 composition, packed-document bookkeeping, final states) as
    :func:`context_parallel_gated_delta_rule`."""
    n_dev = jax.lax.axis_size(axis_name)
    me = jax.lax.axis_index(axis_name)
    Ts = v.shape[1]
    dt = dtype
    K, V, H = k.shape[-1], v.shape[-1], v.shape[-2]
    valid = jnp.asarray(True)
    if cu_seqlens is None:
        M, N = maps(None, None, None)
        x0 = jnp.zeros((v.shape[0], H, K, V), dt) if initial_state is None else initial_state.astype(dt)
    else:
        cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
        n_docs = cu.shape[0] - 1
        valid = (cu[0] == 0) & (cu[-1] == n_dev * Ts) & jnp.all(jnp.diff(cu) >= 0)
        # continues: the document of this shard's first token started on an earlier shard
        local_cu, first, continues = piece_documents(cu, me * Ts, Ts)
        init = jnp.zeros((n_docs, H, K, V), dt) if initial_state is None else initial_state.astype(dt)
        M, N = maps(init, local_cu, continues)
        x0 = jnp.zeros((1, H, K, V), dt)  # shard 0 never continues (its M is 0): any start
    # every shard's map, in shard order (one all-gather), composed in float32
    Ms = jax.lax.all_gather(M.astype(dt), axis_name)
    Ns = jax.lax.all_gather(N.astype(dt), axis_name)
    x_last, entering = entering_states(Ms, Ns, x0)
    entry = entering[me]  # the state entering this shard
    if cu_seqlens is None:
        o, _ = run(entry, None, False)
        if not output_final_state:
            return o, None
        # the last shard's value on every shard (an all-reduce of B H K V words; psum's result is
        # replicated over the axis for shard_map's out_specs, the all-gather's is not)
        return o, jax.lax.psum(jnp.where(me == n_dev - 1, x_last, 0), axis_name)
    local_init = init.at[first].set(jnp.where(continues, entry[0], init[first]))
    o, fin = run(local_init, local_cu, True)
    o = poison_if_invalid(o, valid)
    if not output_final_state:
        return o, None
    mine = (document_owners(cu, Ts) == me)[:, None, None, None]  # the shard of each document's last token
    fin = jax.lax.psum(jnp.where(mine, fin, 0), axis_name)
    return o, poison_if_invalid(fin, valid)


def context_parallel_linear_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: Optional[jax.Array] = None,
    *,
    axis_name,
    scale: Optional[float] = None,
    initial_state: Optional[jax.Array] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[jax.Array] = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    backend: str = "auto",
) -> Tuple[jax.Array, Optional[jax.Array]]:
    """:func:`gdn_jax.ops.gated_linear_attention` (no delta rule: linear attention, Mamba2-style
    per-head decay, GLA per-key-channel decay) on this device's shard of T inside ``shard_map``,
    exact: the same state maps (M is the diagonal decay product here) and collectives as
    :func:`context_parallel_gated_delta_rule`, whose arguments these are (``g`` None: no decay).

    Raises: as :func:`gdn_jax.ops.gated_linear_attention` for the shard's arguments; ValueError for
    ``axis_name`` not bound by an enclosing ``shard_map``, a concrete ``cu_seqlens`` not from 0 to
    ``P T_s``, an ``initial_state`` not ``[B, H, K, V]`` (``[N, H, K, V]`` with ``cu_seqlens``)."""
    check_flags(output_final_state=output_final_state)
    cu_seqlens = _as_array(cu_seqlens)
    n_dev = axis_size(axis_name)
    if cu_seqlens is not None:
        check_cu_values(cu_seqlens, n_dev * v.shape[1])
    _check_initial_state(initial_state, k, v, cu_seqlens)
    op = dict(use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, backend=backend)

    def run(s, cu, fin):
        with internal_call():  # a shard's T is not the caller's: no head-first layout warning
            return gated_linear_attention(q, k, v, g, scale=scale, initial_state=s, cu_seqlens=cu,
                                          output_final_state=fin, **op)

    dt = acc_dtype(*[x for x in (q, k, v, g, initial_state) if x is not None])

    def maps(init, cu, continues):
        def final_state(values, start):
            with internal_call():
                return gated_linear_attention(k, k, values, g, initial_state=start, cu_seqlens=cu,
                                              output_final_state=True, **op)[1]
        return affine_state_map(final_state, k, v, g, dtype=dt, initial_state=init, cu_seqlens=cu, continues=continues)

    return sharded_recurrence(run, maps, k, v, axis_name=axis_name, dtype=dt, initial_state=initial_state,
                              output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def shard_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    mesh,
    axis,
    batch_axis=None,
    initial_state: Optional[jax.Array] = None,
    cu_seqlens: Optional[jax.Array] = None,
    check_vma: Optional[bool] = None,
    **kwargs,
) -> Tuple[jax.Array, Optional[jax.Array]]:
    """:func:`gated_delta_rule` on GLOBAL ``[B, T, ...]`` arrays with T split over ``mesh``'s ``axis``.

    A ``jax.shard_map`` around :func:`context_parallel_gated_delta_rule`: T must be a multiple of
    the axis size; ``batch_axis`` (optional) splits B over another mesh axis (data parallelism).
    Other keywords as :func:`gated_delta_rule` (``output_final_state``, ``scale``, ``backend``...).
    ``check_vma``: the ``shard_map``'s; None (default) turns it on except where the Pallas kernels
    run in JAX's interpreter (``backend="pallas"`` on the CPU, or a ``kernel_config`` whose platform
    is an interpreter), which cannot run under it. A ``shard_map`` of your own around
    :func:`context_parallel_gated_delta_rule` needs ``check_vma=False`` there too (else
    ``ValueError`` naming it); the compiled kernels' outputs (Triton, Hopper, Mosaic TPU) carry the
    varying mesh axes and type-check under ``check_vma=True`` (docs/context_parallel.md).

    Returns:
      ``(o, final_state)`` as :func:`gated_delta_rule` (o sharded like v, the state over
      ``batch_axis``).

    Raises:
      ValueError: ``axis`` or ``batch_axis`` not axes of ``mesh`` (or sharing one); T not a multiple
        of the size of ``axis``; as :func:`context_parallel_gated_delta_rule`.
    """
    axes, batch_axes = _mesh_axes(mesh, "axis", axis), _mesh_axes(mesh, "batch_axis", batch_axis)
    if not axes:
        raise ValueError(f"axis must name the mesh axis (or axes) T is split over, got None; the mesh's axes are "
                         f"{tuple(mesh.axis_names)}")
    if set(axes) & set(batch_axes):
        raise ValueError(f"axis={axis!r} and batch_axis={batch_axis!r} must be different mesh axes (T and B "
                         f"cannot be split over the same devices)")
    n = int(np.prod([mesh.shape[a] for a in axes]))
    if v.shape[1] % n:
        raise ValueError(f"T = {v.shape[1]} must be a multiple of the {n} devices of mesh axis {axis!r}")
    cu_seqlens = _as_array(cu_seqlens)
    if cu_seqlens is not None:  # concrete values checked here: inside shard_map they are traced
        _check_call(v, beta, cu_seqlens, False, v.shape[1])
    seq = P(batch_axis, axis)
    st = P(batch_axis) if cu_seqlens is None else P()
    args = (q, k, v, g, beta, initial_state, cu_seqlens)
    specs = (seq,) * 5 + (None if initial_state is None else st, None if cu_seqlens is None else P())

    def body(q, k, v, g, beta, s, cu):
        return context_parallel_gated_delta_rule(q, k, v, g, beta, axis_name=axis, initial_state=s, cu_seqlens=cu,
                                                 **kwargs)

    out_fin = st if kwargs.get("output_final_state", False) else None
    check = not _kernels_interpreted(kwargs) if check_vma is None else check_vma
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(seq, out_fin), check_vma=check)(*args)


def _mesh_axes(mesh, argument: str, value) -> Tuple[str, ...]:
    """``value`` (None, a mesh axis name or a tuple of them) as a tuple of names; ``ValueError``
    naming ``argument`` for a name that is not one of ``mesh``'s axes."""
    axes = () if value is None else (value,) if isinstance(value, str) else tuple(value) \
        if isinstance(value, (tuple, list)) else (value,)
    if any(a not in mesh.axis_names for a in axes):
        raise ValueError(f"{argument}={value!r} is not an axis of the mesh, whose axes are {tuple(mesh.axis_names)}")
    return axes


def _kernels_interpreted(kwargs) -> bool:
    """Whether a call with these keywords runs the Pallas kernels in JAX's interpreter, which cannot
    run inside ``shard_map(check_vma=True)``: ``backend="pallas"`` (or ``"auto"``, which takes the
    kernels only on a GPU or TPU) where the kernel platform (``kernel_config.platform``, else the
    default device's) is an interpreter."""
    from .pallas.platform import default_platform, interpreted

    backend = kwargs.get("backend", "auto")
    if backend in ("scan", "chunk") or (backend == "auto" and interpreted(default_platform())):
        return False
    config = kwargs.get("kernel_config")
    platform = getattr(config, "platform", None) or default_platform()
    return interpreted(platform)
