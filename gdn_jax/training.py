"""Training utilities: optimizer, masked losses, data-parallel mesh, jit-compiled steps, checkpoints.

Everything here is task-agnostic library code (:mod:`gdn_jax.recall`, :mod:`gdn_jax.sweep` and the
scripts in ``experiments/`` sit on top of it; README "Experiments and results"). The functional NNX style is used throughout::

    model = LM(cfg, rngs=nnx.Rngs(seed))
    tx = make_optimizer(3e-3, warmup_steps=200, total_steps=6000)
    mesh = make_mesh()
    graphdef, state = create_train_state(model, tx, seed=seed, mesh=mesh)
    train_step = make_train_step(graphdef, tx, mesh)          # compiled once
    eval_step = make_eval_step(graphdef, mesh)
    logger = make_logger("tensorboard", logdir="runs/my_run/tb")  # gdn_jax.loggers ("wandb", "none")
    for step in range(int(state.step), total_steps):
        state, metrics = train_step(state, shard_batch(loader.batch(step), mesh))
        if step % 10 == 0:                                   # a host sync: not every step
            logger.log({f"train/{k}": v for k, v in metrics.items()}, step)
    evaluate(eval_step, state, test_set, batch_size=256, mesh=mesh)
    logger.close()

Batches are ``(inputs, targets)`` pairs (e.g. :class:`gdn_jax.data.TaskBatch`) with
``targets[t]`` the label of ``logits[:, t]`` (no shift) and :data:`IGNORE_INDEX` (-100, the one
definition in :mod:`gdn_jax.data.common`) where there is no label.

Determinism / resume: the whole training state (params, optimizer state, step, PRNG key) is one
pytree (:class:`TrainState`) saved by :class:`Checkpointer`; data must come from a pure function
of the step (``TaskLoader.batch(step)``) and any randomness inside a step uses
``jax.random.fold_in(key, step)``. A run resumed from a checkpoint then produces bit-identical
parameters on CPU to an uninterrupted run (same devices, same XLA flags).
"""
from __future__ import annotations

import concurrent.futures
import math
import numbers
import os
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gdn_jax.data.common import IGNORE_INDEX
from gdn_jax.layers._checks import positive_int

__all__ = [
    "IGNORE_INDEX",
    "TrainState",
    "Checkpointer",
    "abstract_train_state",
    "create_train_state",
    "decay_mask",
    "evaluate",
    "lm_loss",
    "make_lm_loss",
    "make_eval_step",
    "make_context_parallel_lm_loss",
    "make_mesh",
    "make_optimizer",
    "make_schedule",
    "make_train_step",
    "masked_accuracy",
    "masked_cross_entropy",
    "merge_model",
    "prefetch_batches",
    "DeviceFixedLoader",
    "device_eval_batches",
    "replicated",
    "shard_batch",
]


# --------------------------------------------------------------------------
# Optimizer
# --------------------------------------------------------------------------


def decay_mask(params) -> Any:
    """Weight-decay mask: True for parameters with ``ndim >= 2`` (matrices, embeddings, conv kernels).

    Everything 1-D or scalar is excluded: RMSNorm scales, biases, ``A_log``, ``dt_bias``
    (per-head / per-channel vectors of the GDN gates). Works on any params pytree, including an
    ``nnx.State`` (the mask has the same structure, with bool leaves).
    """
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def _finite(name: str, value, *, low: Optional[float] = None, high: Optional[float] = None, strict: bool = False,
            open_high: bool = False) -> float:
    """A finite real number in the given range (TypeError / ValueError naming ``name``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    v = float(value)
    bad = not math.isfinite(v) or (low is not None and (v <= low if strict else v < low)) or \
        (high is not None and (v >= high if open_high else v > high))
    if bad:
        lo = "" if low is None else ("(" if strict else "[") + f"{low:g}"
        hi = "" if high is None else f"{high:g}" + (")" if open_high else "]")
        where = f" in {lo or '(-inf'}, {hi or 'inf)'}" if (low is not None or high is not None) else ""
        raise ValueError(f"{name} must be a finite number{where}, got {value!r}")
    return v


def make_optimizer(
    lr: float,
    *,
    warmup_steps: int,
    total_steps: int,
    weight_decay: float = 0.1,
    min_lr_ratio: float = 0.1,
    b1: float = 0.9,
    b2: float = 0.98,
    eps: float = 1e-8,
    grad_clip: Optional[float] = 1.0,
    steps_per_epoch: Optional[int] = None,
) -> optax.GradientTransformation:
    """AdamW with linear warmup + cosine decay and global-norm gradient clipping.

    The learning rate rises linearly from 0 to ``lr`` over ``warmup_steps``, then follows a
    cosine down to ``lr * min_lr_ratio`` at ``total_steps`` (the cosine horizon, counted from
    step 0 and including the warmup; constant afterwards), via
    ``optax.warmup_cosine_decay_schedule``. Gradients are clipped to global norm ``grad_clip``
    first (``None`` or ``<= 0`` disables clipping).

    Decoupled weight decay ``weight_decay`` is applied only where :func:`decay_mask` is True,
    i.e. to parameters with ``ndim >= 2``; norms, biases, ``A_log`` and ``dt_bias`` (all 1-D)
    are not decayed.

    ``steps_per_epoch``: the schedule is stepped once per epoch instead of every step (lr at step s
    is the schedule's value at ``(s // steps_per_epoch) * steps_per_epoch``): with
    ``warmup_steps=0``, ``min_lr_ratio=0`` and ``total_steps = epochs * steps_per_epoch`` this is
    torch's ``CosineAnnealingLR(T_max=epochs)`` stepped per epoch, Zoology's schedule (Arora et al.
    2023, its paper-era code).

    Raises TypeError / ValueError for the schedule's arguments (:func:`make_schedule`), ``b1`` or
    ``b2`` outside ``[0, 1)``, ``eps`` not > 0, ``weight_decay`` not >= 0, a non-finite ``grad_clip``.
    """
    schedule = make_schedule(lr, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio,
                             steps_per_epoch=steps_per_epoch)
    for name, value in (("b1", b1), ("b2", b2)):
        _finite(name, value, low=0.0, high=1.0, open_high=True)
    _finite("eps", eps, low=0.0, strict=True)
    _finite("weight_decay", weight_decay, low=0.0)
    if grad_clip is not None:
        _finite("grad_clip", grad_clip)
    adamw = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask)
    if grad_clip is not None and grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(grad_clip), adamw)
    return adamw


def make_schedule(lr: float, *, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1,
                  steps_per_epoch: Optional[int] = None) -> optax.Schedule:
    """The learning-rate schedule of :func:`make_optimizer` (``optax.warmup_cosine_decay_schedule``,
    stepped once per epoch with ``steps_per_epoch``).

    Raises TypeError / ValueError unless ``lr`` is a finite number > 0, ``total_steps`` an int >= 1,
    ``warmup_steps`` an int in ``[0, total_steps)``, ``min_lr_ratio`` in ``[0, 1]`` and
    ``steps_per_epoch`` None or an int >= 1 -- and ``warmup_steps`` 0 with ``steps_per_epoch`` (a
    warmup stepped once per epoch would hold the first epoch at lr 0)."""
    _finite("lr", lr, low=0.0, strict=True)
    positive_int("total_steps", total_steps)
    positive_int("warmup_steps", warmup_steps, minimum=0)
    if warmup_steps >= total_steps:
        raise ValueError(f"warmup_steps must be < total_steps (the cosine horizon), got {warmup_steps} >= {total_steps}")
    _finite("min_lr_ratio", min_lr_ratio, low=0.0, high=1.0)
    if steps_per_epoch is not None:
        positive_int("steps_per_epoch", steps_per_epoch)
        if warmup_steps:
            raise ValueError(f"warmup_steps must be 0 with steps_per_epoch (the schedule is stepped once per epoch, "
                             f"so a warmup would hold the first epoch at lr 0), got warmup_steps={warmup_steps}")
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=lr,
        warmup_steps=warmup_steps,
        decay_steps=max(total_steps, warmup_steps + 1),
        end_value=lr * min_lr_ratio,
    )
    if steps_per_epoch is not None:
        per_step, spe = schedule, int(steps_per_epoch)
        schedule = lambda count: per_step((count // spe) * spe)  # noqa: E731
    return schedule


# --------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------


def _ce_terms(logits, targets, ignore_index):
    mask = targets != ignore_index
    safe = jnp.where(mask, targets, 0)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), safe)
    correct = (jnp.argmax(logits, axis=-1) == safe) & mask
    return jnp.where(mask, ce, 0.0), correct, mask


def masked_cross_entropy(logits, targets, ignore_index: int = IGNORE_INDEX):
    """Mean cross-entropy over positions whose target is not ``ignore_index``.

    ``logits [..., V]`` (computed in float32), ``targets [...]`` int. Returns 0 if nothing is
    labelled.
    """
    ce, _, mask = _ce_terms(logits, targets, ignore_index)
    return ce.sum() / jnp.maximum(mask.sum(), 1)


def masked_accuracy(logits, targets, ignore_index: int = IGNORE_INDEX):
    """Fraction of labelled positions where ``argmax(logits) == targets`` (0 if none labelled)."""
    _, correct, mask = _ce_terms(logits, targets, ignore_index)
    return correct.sum() / jnp.maximum(mask.sum(), 1)


def scored_logits(model, inputs, targets, max_scored: int, ignore_index: int = IGNORE_INDEX):
    """``(logits [B, M, V], targets [B, M])`` at the first ``M = max_scored`` labelled positions of
    each row (in order; rows with fewer are padded with ``ignore_index``), computing the LM head only
    there (:meth:`gdn_jax.models.LM.features` + :meth:`~gdn_jax.models.LM.logits`). Scored against
    each other they give exactly the dense loss and accuracy when no row has more than ``M`` labels
    (MQAR: ``num_kv_pairs`` of ``seq_len``; at vocab 8192 the head is most of a small model's step).
    Also returns the number of labels beyond ``M`` (0 unless ``max_scored`` is too small)."""
    mask = targets != ignore_index
    M = min(int(max_scored), targets.shape[1])
    idx = jnp.argsort(~mask, axis=1, stable=True)[:, :M]  # labelled positions first, in order
    valid = jnp.take_along_axis(mask, idx, axis=1)
    tgt = jnp.where(valid, jnp.take_along_axis(targets, idx, axis=1), ignore_index)
    h = jnp.take_along_axis(model.features(inputs), idx[..., None], axis=1)
    dropped = mask.sum() - valid.sum()
    return model.logits(h), tgt, dropped


def make_lm_loss(max_scored: Optional[int] = None, ignore_index: int = IGNORE_INDEX) -> "LossFn":
    """:func:`lm_loss`, or with ``max_scored`` its sparse-head equivalent (:func:`scored_logits`):
    same loss and accuracy, the head computed only at labelled positions; the aux metric
    ``unscored`` counts labels beyond ``max_scored`` (must stay 0)."""
    if max_scored is None:
        return lm_loss

    def loss(model, batch, key):
        inputs, targets = batch
        logits, tgt, dropped = scored_logits(model, inputs, targets, max_scored, ignore_index)
        return (masked_cross_entropy(logits, tgt, ignore_index),
                {"accuracy": masked_accuracy(logits, tgt, ignore_index), "unscored": dropped})

    return loss


def lm_loss(model, batch, key) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """Default loss: ``model(inputs)`` scored against ``targets`` (no shift), masked CE + accuracy.

    ``batch`` is an ``(inputs, targets)`` pair; ``key`` (unused here) is the per-step PRNG key
    for stochastic models. Returns ``(loss, {"accuracy": ...})``.
    """
    inputs, targets = batch
    logits = model(inputs)
    return masked_cross_entropy(logits, targets), {"accuracy": masked_accuracy(logits, targets)}


# --------------------------------------------------------------------------
# Mesh / sharding
# --------------------------------------------------------------------------


SEQ_AXIS = "seq"  # the mesh axis T is split over (context parallelism, docs/context_parallel.md)


def make_mesh(devices: Optional[Sequence[jax.Device]] = None, *, seq: int = 1) -> Mesh:
    """A data-parallel mesh with axis ``"data"`` over ``devices`` (default ``jax.local_devices()``);
    with ``seq > 1`` a 2-D mesh ``("data", "seq")`` whose ``"seq"`` axis (``seq`` devices) splits
    every sequence (context parallelism: :func:`make_train_step` / :func:`make_eval_step` then run
    the model with ``context_axis="seq"``). ValueError if ``seq`` does not divide the devices."""
    devices = list(jax.local_devices() if devices is None else devices)
    positive_int("seq", seq)
    if seq == 1:
        return Mesh(np.array(devices), ("data",))
    if len(devices) % seq:
        raise ValueError(f"seq={seq} must divide the {len(devices)} devices")
    return Mesh(np.array(devices).reshape(-1, seq), ("data", SEQ_AXIS))


def _context_parallel(mesh: Optional[Mesh]) -> bool:
    return mesh is not None and SEQ_AXIS in mesh.axis_names and mesh.shape[SEQ_AXIS] > 1


def _sharded_lm_terms(mesh: Mesh, model, inputs, targets, ignore_index):
    """(sum of CE, correct, count) over the whole batch, the LM run with B over "data" and T over
    "seq" inside ``shard_map`` (each device its block; the sums reduced over both axes)."""
    B, T = inputs.shape
    if B % mesh.shape["data"] or T % mesh.shape[SEQ_AXIS]:
        raise ValueError(f"batch [B, T] = {(B, T)}: B must be a multiple of {mesh.shape['data']} (mesh axis 'data') "
                         f"and T of {mesh.shape[SEQ_AXIS]} (mesh axis {SEQ_AXIS!r})")
    graphdef, state = nnx.split(model)
    axes = ("data", SEQ_AXIS)

    def body(state, x, y):
        ce, correct, mask = _ce_terms(nnx.merge(graphdef, state)(x, context_axis=SEQ_AXIS), y, ignore_index)
        return tuple(jax.lax.psum(a.sum(), axes) for a in (ce, correct, mask))

    spec = P("data", SEQ_AXIS)
    # check_vma off: the Pallas kernels' output types carry no varying mesh axes (the gradients
    # are the same: tests/ops/test_context_parallel.py runs this path)
    return jax.shard_map(body, mesh=mesh, in_specs=(P(), spec, spec), out_specs=(P(), P(), P()),
                         check_vma=False)(state, inputs, targets)


def make_context_parallel_lm_loss(mesh: Mesh, *, ignore_index: int = IGNORE_INDEX) -> Callable:
    """:func:`lm_loss` with the batch split over ``mesh``'s ``"data"`` axis and every sequence over
    its ``"seq"`` axis (context parallelism): each device runs ``LM(..., context_axis="seq")`` on
    its ``[B / D, T / S]`` block (exact: the recurrent layers exchange state maps and conv halos,
    attention all-gathers K, V); loss and accuracy are sums of token terms and label counts over
    both axes divided once, equal to the unsharded values to float32 rounding, as are the
    gradients. :func:`make_train_step` uses it for ``lm_loss`` on a mesh with a ``"seq"`` axis.

    Raises: ValueError (at call time) for B not a multiple of the data axis or T of the seq axis."""

    def loss_fn(model, batch, key):
        ce, correct, count = _sharded_lm_terms(mesh, model, *batch, ignore_index)
        n = jnp.maximum(count, 1)
        return ce / n, {"accuracy": correct / n}

    return loss_fn


def replicated(mesh: Mesh) -> NamedSharding:
    """Fully replicated sharding on ``mesh`` (used for params and optimizer state)."""
    return NamedSharding(mesh, P())


def _batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P("data"))


def shard_batch(batch, mesh: Mesh):
    """Put every array of ``batch`` (any pytree) on ``NamedSharding(mesh, P("data"))``.

    The leading (batch) dimension is split over the ``"data"`` axis.

    The transfer is waited for before returning: on jaxlib 0.10 CPU, feeding a still-in-flight
    ``device_put`` result into a jitted step intermittently hung the process forever (all XLA
    worker threads idle; about 1 run in 5 of a 40-step loop here). Blocking here costs nothing
    measurable and, with :func:`prefetch_batches`, happens in the background thread anyway.

    Raises:
      ValueError: a leading dimension is not divisible by the number of devices of the mesh.
    """
    n = mesh.shape["data"]
    for x in jax.tree.leaves(batch):
        if np.ndim(x) == 0 or np.shape(x)[0] % n:
            raise ValueError(
                f"batch leading dimension {np.shape(x)[:1]} is not divisible by the {n} devices of the "
                f"'data' mesh axis; choose a batch size that is a multiple of {n}"
            )
    return jax.block_until_ready(jax.device_put(batch, _batch_sharding(mesh)))


def prefetch_batches(batch_fn: Callable[[int], Any], steps: Sequence[int], mesh: Mesh, *,
                     depth: int = 3, workers: int = 2) -> Iterator[Tuple[int, Any]]:
    """Yield ``(step, shard_batch(batch_fn(step), mesh))`` for ``steps``, keeping the next
    ``max(depth, workers) + 1`` batches in production in ``workers`` background threads
    (``batch_fn`` is never called from the consumer's thread; it must be safe to call from several
    threads at once when ``workers > 1``). ``depth <= 0``: no threads, each batch made when it is
    asked for (synchronous).

    Since ``batch_fn`` is a pure function of the step, prefetching (with any number of workers)
    does not change the data or its order. Two workers by default: with one, on one H200 at the
    MQAR L 512 shape, the loop waited 8 s of 30 for its batches; numpy's generators and sorts
    release the GIL, so a second thread can overlap the first (not yet measured on the GPU).

    Raises (when called, before the first batch):
      TypeError / ValueError: ``workers`` not an integer >= 1, ``depth`` not an integer.
    """
    if isinstance(workers, bool) or not isinstance(workers, numbers.Integral):
        raise TypeError(f"prefetch_batches: workers must be an integer >= 1, got {workers!r}")
    if workers < 1:
        raise ValueError(f"prefetch_batches: workers must be an integer >= 1, got {workers!r}")
    if isinstance(depth, bool) or not isinstance(depth, numbers.Integral):
        raise TypeError(f"prefetch_batches: depth must be an integer, got {depth!r}")
    return _prefetch(batch_fn, list(steps), mesh, int(depth), int(workers))


def _prefetch(batch_fn, steps, mesh, depth, workers):
    if depth <= 0:
        for s in steps:
            yield s, shard_batch(batch_fn(s), mesh)
        return
    ex = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prefetch")
    futs: Dict[int, concurrent.futures.Future] = {}
    try:
        for i, s in enumerate(steps):
            for j in range(i, min(i + max(depth, workers) + 1, len(steps))):
                if j not in futs:
                    futs[j] = ex.submit(lambda t=steps[j]: shard_batch(batch_fn(t), mesh))
            yield s, futs.pop(i).result()
    finally:  # also runs when the consumer stops early (generator closed)
        for f in futs.values():
            f.cancel()
        ex.shutdown(wait=True)


class DeviceFixedLoader:
    """A fixed-mode :class:`gdn_jax.data.TaskLoader` whose training set lives on the devices.

    The whole set (``inputs``/``targets`` ``[n, T]`` int32; 100k x 512 is 410 MB) is copied to the
    devices once (replicated on ``mesh``), each epoch's shuffle order once per epoch (``n`` int32),
    and :meth:`batch` is one jitted gather, ``set[perm[i * B:(i + 1) * B]]``, with the result split
    along ``"data"``: no host work and no host-to-device copy per step. The batches are exactly
    ``loader.batch(step)`` (same permutation, :meth:`TaskLoader._epoch_perm`), so a run gives the
    same result with or without it.
    """

    def __init__(self, loader, mesh: Mesh):
        if loader.mode != "fixed":
            raise ValueError(f"DeviceFixedLoader needs a TaskLoader in mode='fixed', got mode={loader.mode!r}")
        n = mesh.shape["data"]
        if loader.batch_size % n:
            raise ValueError(f"batch_size={loader.batch_size} is not divisible by the {n} devices of the mesh")
        self.loader, self.mesh = loader, mesh
        train = loader.train_set
        rep = replicated(mesh)
        self._rep = rep
        self.inputs = jax.device_put(np.asarray(train.inputs), rep)
        self.targets = jax.device_put(np.asarray(train.targets), rep)
        self._epoch, self._perm = None, None
        self._next, self._i = None, None  # the step the device-side batch index is valid for; that index
        B = loader.batch_size

        def gather(x, y, perm, i):
            idx = jax.lax.dynamic_slice_in_dim(perm, i * B, B)
            return jnp.take(x, idx, axis=0), jnp.take(y, idx, axis=0), i + 1

        bs = _batch_sharding(mesh)
        self._gather = jax.jit(gather, in_shardings=(rep, rep, rep, rep), out_shardings=(bs, bs, rep))

    @property
    def steps_per_epoch(self) -> int:
        return self.loader.steps_per_epoch

    def batch(self, step: int):
        """``(inputs, targets)`` of global ``step`` on the devices (split along ``"data"``).

        Consecutive steps within an epoch take the batch index from a counter that stays on the
        devices (the gather returns it incremented): no host-to-device copy per step; a new epoch
        or a jump copies the permutation / the index once."""
        step = int(step)
        epoch, i = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self._perm = jax.device_put(np.asarray(self.loader._epoch_perm(epoch), np.int32), self._rep)
            self._epoch = epoch
        if step != self._next or self._i is None:
            self._i = jax.device_put(np.int32(i), self._rep)
        x, y, self._i = self._gather(self.inputs, self.targets, self._perm, self._i)
        self._next = step + 1 if i + 1 < self.steps_per_epoch else None
        return x, y


def device_eval_batches(dataset, *, batch_size: int, mesh: Optional[Mesh] = None,
                        ignore_index: int = IGNORE_INDEX):
    """A held-out ``(inputs, targets)`` set cut into fixed batches of ``batch_size`` (the last one
    padded with ignored targets) and copied to the devices once: pass it as ``batches=`` to
    :func:`evaluate` so that an evaluation copies nothing from the host."""
    inputs, targets = (np.asarray(a) for a in dataset)
    out = []
    for start in range(0, inputs.shape[0], batch_size):
        x, y = inputs[start:start + batch_size], targets[start:start + batch_size]
        if x.shape[0] < batch_size:
            pad = batch_size - x.shape[0]
            x = np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)])
            y = np.concatenate([y, np.full((pad,) + y.shape[1:], ignore_index, y.dtype)])
        out.append(shard_batch((x, y), mesh) if mesh is not None else jax.block_until_ready(jax.device_put((x, y))))
    return out


# --------------------------------------------------------------------------
# Train state, steps, evaluation
# --------------------------------------------------------------------------


@struct.dataclass
class TrainState:
    """Everything a run needs to continue exactly: a pytree.

    Attributes:
      step: ``int32 []`` number of optimizer steps taken (= next loader step).
      params: ``nnx.State`` of the model's ``nnx.Param`` variables.
      opt_state: optax state of ``tx``.
      rest: ``nnx.State`` of all other model variables (empty for the LM; carried unchanged).
      rng: ``uint32 [2]`` raw PRNG key data (``jax.random.key_data``); a step's key is
        ``fold_in(wrap_key_data(rng), step)``.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rest: Any
    rng: jax.Array


def create_train_state(model: nnx.Module, tx: optax.GradientTransformation, *, seed: int = 0,
                       mesh: Optional[Mesh] = None) -> Tuple[nnx.GraphDef, TrainState]:
    """Split ``model`` into ``(graphdef, TrainState)`` with a fresh optimizer state at step 0.

    ``rng`` is ``key_data(jax.random.key(seed))``. With ``mesh``, the state is replicated on it.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                       rest=rest, rng=jax.random.key_data(jax.random.key(seed)))
    if mesh is not None:
        state = jax.device_put(state, replicated(mesh))
    return graphdef, jax.block_until_ready(state)


def abstract_train_state(model_fn: Callable[[], nnx.Module], tx: optax.GradientTransformation, *,
                         mesh: Optional[Mesh] = None) -> Tuple[nnx.GraphDef, TrainState]:
    """``(graphdef, abstract TrainState)`` without allocating anything (``nnx.eval_shape``).

    Leaves are ``jax.ShapeDtypeStruct`` (replicated on ``mesh`` if given): the target for
    :meth:`Checkpointer.restore_latest`.
    """
    abstract_model = nnx.eval_shape(model_fn)
    graphdef, params, rest = nnx.split(abstract_model, nnx.Param, ...)
    state = jax.eval_shape(
        lambda p, r: TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p), rest=r,
                                rng=jax.random.key_data(jax.random.key(0))),
        params, rest,
    )
    if mesh is not None:
        sh = replicated(mesh)
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state)
    return graphdef, state


def merge_model(graphdef: nnx.GraphDef, state: TrainState) -> nnx.Module:
    """Rebuild the ``nnx.Module`` from ``graphdef`` and a :class:`TrainState`."""
    return nnx.merge(graphdef, state.params, state.rest)


def _global_norm(tree):
    norm = getattr(getattr(optax, "tree", None), "norm", None)  # optax >= 0.2.5; global_norm is deprecated
    return norm(tree) if norm is not None else optax.global_norm(tree)


LossFn = Callable[[nnx.Module, Any, jax.Array], Tuple[jax.Array, Dict[str, jax.Array]]]


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, mesh: Optional[Mesh] = None,
                    *, loss_fn: LossFn = lm_loss, donate: bool = False, lr_arg: bool = False):
    """Return ``train_step(state, batch) -> (state, metrics)``, one ``jax.jit``-compiled function.

    ``lr_arg``: the step is ``train_step(state, batch, lr)`` instead and multiplies ``tx``'s updates
    by ``lr`` (a float32 scalar array, replicated on ``mesh``). With ``tx`` made at learning rate 1
    (``make_optimizer(1.0, ...)``) that is the optimizer at peak rate ``lr`` (AdamW's update, weight
    decay included, is proportional to the schedule, and the warmup + cosine schedule to its peak;
    equal up to float32 rounding), and one compiled step serves every learning rate
    (:mod:`gdn_jax.step_cache`: a sweep's runs compile once per shape).

    ``loss_fn(model, batch, key) -> (loss, aux_metrics)`` (default :func:`lm_loss`), with
    ``key = fold_in(wrap_key_data(state.rng), state.step)``. ``metrics`` has ``loss``,
    ``grad_norm`` (before clipping) and the aux metrics (``accuracy`` for :func:`lm_loss`), as
    device scalars (no host sync).

    With ``mesh`` the state is replicated and the batch split along ``"data"`` (use
    :func:`shard_batch`); gradients are reduced across devices by XLA. ``donate`` donates the
    input state's buffers (saves memory on accelerators; then don't reuse the old state).
    A mesh with a ``"seq"`` axis (``make_mesh(seq=S)``) also splits every sequence over it: the
    default :func:`lm_loss` becomes :func:`make_context_parallel_lm_loss`; a custom ``loss_fn``
    must run its model with ``context_axis="seq"`` inside ``jax.shard_map`` itself.
    """
    if loss_fn is lm_loss and _context_parallel(mesh):
        loss_fn = make_context_parallel_lm_loss(mesh)

    def step(state: TrainState, batch, lr=None):
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

        def loss(params):
            model = nnx.merge(graphdef, params, state.rest)
            return loss_fn(model, batch, key)

        (l, aux), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        if lr is not None:
            updates = jax.tree.map(lambda u: u * lr.astype(u.dtype), updates)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": l, "grad_norm": _global_norm(grads), **aux}
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    def train_step(state: TrainState, batch):
        return step(state, batch)

    fn = step if lr_arg else train_step
    kw = {}
    if mesh is not None:
        rep = replicated(mesh)
        ins = (rep, _batch_sharding(mesh), rep) if lr_arg else (rep, _batch_sharding(mesh))
        kw = dict(in_shardings=ins, out_shardings=(rep, rep))
    return jax.jit(fn, donate_argnums=(0,) if donate else (), **kw)


def make_eval_step(graphdef: nnx.GraphDef, mesh: Optional[Mesh] = None, *,
                   ignore_index: int = IGNORE_INDEX, max_scored: Optional[int] = None):
    """Return ``eval_step(state, batch) -> {"loss_sum", "correct", "count", "unscored"}`` (jit-compiled).

    Sums (not means) over the labelled positions of an ``(inputs, targets)`` batch, so batches
    can be accumulated exactly; used by :func:`evaluate`. ``max_scored``: compute the LM head only
    at the first ``max_scored`` labelled positions of each row (:func:`scored_logits`); labels
    beyond it are counted in ``unscored``.
    """

    cp = _context_parallel(mesh)
    if cp and max_scored is not None:
        raise ValueError("make_eval_step: max_scored with a mesh that splits sequences ('seq' axis) is not supported")

    def step(state: TrainState, batch):
        inputs, targets = batch
        model = merge_model(graphdef, state)
        if cp:
            ce, correct, count = _sharded_lm_terms(mesh, model, inputs, targets, ignore_index)
            return {"loss_sum": ce, "correct": correct, "count": count, "unscored": jnp.zeros((), jnp.int32)}
        if max_scored is None:
            logits, dropped = model(inputs), jnp.zeros((), jnp.int32)
        else:
            logits, targets, dropped = scored_logits(model, inputs, targets, max_scored, ignore_index)
        ce, correct, mask = _ce_terms(logits, targets, ignore_index)
        return {"loss_sum": ce.sum(), "correct": correct.sum(), "count": mask.sum(), "unscored": dropped}

    kw = {}
    if mesh is not None:
        rep = replicated(mesh)
        kw = dict(in_shardings=(rep, _batch_sharding(mesh)), out_shardings=rep)
    return jax.jit(step, **kw)


def evaluate(eval_step, state: TrainState, dataset=None, *, batch_size: int = 0, mesh: Optional[Mesh] = None,
             ignore_index: int = IGNORE_INDEX, batches=None) -> Dict[str, float]:
    """Loss and accuracy of ``state`` on a held-out ``(inputs, targets)`` set of NumPy arrays.

    The set is cut into fixed batches of ``batch_size`` (the last one padded with ignored
    targets, so one compiled shape serves every batch); metrics are averaged over all labelled
    positions. Returns ``{"loss", "accuracy", "count"}`` as Python numbers. ``batches``: the
    batches already on the devices (:func:`device_eval_batches`) instead of ``dataset``.

    Raises:
      ValueError: neither ``batches`` nor a ``dataset`` with ``batch_size >= 1``; labelled positions
        beyond the eval step's ``max_scored`` (they would be left out of the metrics silently).
    """
    if batches is None:
        if dataset is None or batch_size < 1:
            raise ValueError(f"evaluate needs a dataset and batch_size >= 1 (got batch_size={batch_size}), or batches=")
        batches = device_eval_batches(dataset, batch_size=batch_size, mesh=mesh, ignore_index=ignore_index)
    totals = None
    for batch in batches:
        out = eval_step(state, batch)
        totals = out if totals is None else jax.tree.map(jnp.add, totals, out)
    totals = jax.device_get(totals)
    count = int(totals["count"])
    if int(totals.get("unscored", 0)):
        raise ValueError(f"{int(totals['unscored'])} labelled positions were beyond the eval step's max_scored: "
                         f"raise max_scored to the largest number of labels in a row")
    return {"loss": float(totals["loss_sum"]) / max(count, 1),
            "accuracy": float(totals["correct"]) / max(count, 1), "count": count}


# --------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------


class Checkpointer:
    """Orbax ``CheckpointManager`` for a :class:`TrainState` plus a JSON metadata dict.

    Each checkpoint (directory ``<dir>/<step>``) holds item ``state`` (the whole TrainState:
    params, optimizer state, step, PRNG key) and item ``meta`` (JSON: e.g. loader position,
    metric history). Only the last ``max_to_keep`` checkpoints are kept, and with ``best_metric``
    also the one whose ``metrics[best_metric]`` (given to :meth:`save`) is the highest (orbax's
    ``LatestN`` + ``BestN`` preservation policies). Saves are asynchronous (the arrays are copied to
    host before :meth:`save` returns); :meth:`close` waits for them.

    Args:
      directory: checkpoint root (created if missing; made absolute).
      max_to_keep: number of most recent checkpoints kept (None: all).
      async_save: use Orbax's asynchronous checkpointing.
      best_metric: a key of the ``metrics`` given to :meth:`save` (e.g. ``"test_accuracy"``): the
        checkpoint with its highest value is kept too (ties: the newest); checkpoints saved without
        metrics never count as best.
    """

    def __init__(self, directory: str, *, max_to_keep: Optional[int] = 3, async_save: bool = True,
                 best_metric: Optional[str] = None):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = os.path.abspath(os.fspath(directory))
        if best_metric is None:
            options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                                   enable_async_checkpointing=async_save)
        else:
            pp = ocp.checkpoint_managers
            policy = pp.AnyPreservationPolicy([
                pp.LatestN(n=max_to_keep),
                pp.BestN(get_metric_fn=lambda m: m[best_metric], n=1, keep_checkpoints_without_metrics=False)])
            options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=async_save,
                                                   preservation_policy=policy)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def latest_step(self) -> Optional[int]:
        """Step of the most recent checkpoint, or None."""
        return self.manager.latest_step()

    def all_steps(self) -> Sequence[int]:
        """Steps of all kept checkpoints."""
        return list(self.manager.all_steps())

    def save(self, state: TrainState, meta: Optional[Mapping[str, Any]] = None, *, step: Optional[int] = None,
             force: bool = True, metrics: Optional[Mapping[str, float]] = None) -> bool:
        """Save ``state`` (+ JSON-serialisable ``meta``) under ``step`` (default ``int(state.step)``);
        ``metrics`` (floats) rank it for ``best_metric``.

        Returns whether a checkpoint was written (False if one exists at that step already).
        """
        ocp = self._ocp
        step = int(jax.device_get(state.step)) if step is None else int(step)
        if step in self.manager.all_steps():
            return False
        meta = dict(meta or {})
        meta.setdefault("step", step)
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        if metrics is not None:
            return bool(self.manager.save(step, args=args, force=force, metrics=dict(metrics)))
        return bool(self.manager.save(step, args=args, force=force))

    def restore(self, step: int, target: TrainState) -> Tuple[TrainState, Dict[str, Any]]:
        """Restore checkpoint ``step`` into the structure/dtypes/shardings of ``target``.

        ``target`` is an abstract state (:func:`abstract_train_state`) or a concrete one (only its
        shapes, dtypes and shardings are used). Returns ``(state, meta)``.
        """
        ocp = self._ocp
        abstract = jax.tree.map(_abstract_leaf, target)
        restored = self.manager.restore(int(step), args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return jax.block_until_ready(restored["state"]), dict(restored["meta"] or {})

    def restore_latest(self, target: TrainState) -> Optional[Tuple[TrainState, Dict[str, Any]]]:
        """:meth:`restore` the latest checkpoint, or return None if there is none.

        Rebuild the model afterwards with ``merge_model(graphdef, state)`` (or
        ``nnx.update(model, state.params)``).
        """
        self.manager.wait_until_finished()
        step = self.latest_step()
        if step is None:
            return None
        return self.restore(step, target)

    def wait(self) -> None:
        """Block until pending asynchronous saves are written."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Wait for pending saves and release the manager."""
        self.manager.wait_until_finished()
        self.manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _abstract_leaf(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        if x.sharding is None:  # default: replicated on the first local device
            return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                        sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
        return x
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)
