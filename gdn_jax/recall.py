"""Train a small LM on one synthetic recall task and report test accuracy (the library side of
``experiments/recall.py``, ``experiments/mqar.py`` and ``experiments/sweep.py``).

:func:`run` trains (or resumes) one :class:`RecallConfig`: the task's stream (or fixed, MQAR)
training batches, AdamW with warmup + cosine (:func:`gdn_jax.training.make_optimizer`), a jitted
data-parallel step over every local device, test-set evaluations every ``eval_every`` steps with an
early stop at ``target_accuracy``, orbax checkpoints at each evaluation (``--resume`` continues them
bit-identically on CPU), a tqdm bar, and ``results.json`` + ``curves.png`` in ``out``.

Accuracy is the mean over scored positions (MQAR: the query positions; NIAH: the value tokens;
state tracking: every position); ``scaled accuracy`` = (acc - chance) / (1 - chance) (Grazzi et al.).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from typing import Any, Dict, List, Literal, Optional, Tuple

import jax
import numpy as np
from flax import nnx

from gdn_jax import training as T
from gdn_jax.data import MQARConfig, TaskLoader, make_test_set, scaled_accuracy
from gdn_jax.models import LM, LMConfig

__all__ = ["RecallConfig", "TASKS", "build", "make_task", "run", "scaled_accuracy", "task_label"]

TASKS = ("mqar", "niah", "state_tracking")


def max_labels(task) -> Optional[int]:
    """Most labelled positions in one example of ``task`` (MQAR: the pairs; NIAH: the value tokens),
    or None where most positions are labelled (state tracking): the loss then uses the dense head."""
    from gdn_jax.data import NIAHConfig

    if isinstance(task, MQARConfig):
        return task.num_kv_pairs
    if isinstance(task, NIAHConfig):
        return task.value_len
    return None


def mixer_label(cfg: "RecallConfig") -> str:
    """``cfg.mixer``, or e.g. ``gdn+gated_attention/4`` for a hybrid."""
    return f"{cfg.mixer}+{cfg.hybrid_mixer}/{cfg.hybrid_every}" if cfg.hybrid_every else cfg.mixer


def _finite_json(x):
    """``x`` with every non-finite float replaced by None (strict JSON has no NaN)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_json(v) for v in x]
    return x


def task_label(cfg: "RecallConfig") -> str:
    """A short description of the task parameters of ``cfg`` (for logs and plots)."""
    if cfg.task == "mqar":
        return f"L={cfg.seq_len} N={cfg.num_kv_pairs}"
    if cfg.task == "niah":
        return f"L={cfg.seq_len} key={cfg.key_len} value={cfg.value_len}" + ("" if cfg.depth is None else f" depth={cfg.depth}")
    return f"mod {cfg.modulus} train {cfg.train_min_len}-{cfg.train_max_len} test {cfg.test_min_len}-{cfg.test_max_len}"


@dataclasses.dataclass
class RecallConfig:
    """One training run on a synthetic task. Every field is also a command-line flag (``gdn_jax.cli``).

    Defaults: MQAR with a 2-layer GDN, d_model 128, and a 3000-step cosine (measured to cross 0.99
    in ~500 steps on 2 CPU cores). ``task`` selects the generator; the task fields that do not
    belong to it are ignored:

    * ``"mqar"`` (:class:`gdn_jax.data.MQARConfig`): vocab_size, seq_len, num_kv_pairs, power_a,
      random_non_queries;
    * ``"niah"`` (:class:`gdn_jax.data.NIAHConfig`): vocab_size, seq_len, key_len, value_len, depth;
    * ``"state_tracking"`` (:class:`gdn_jax.data.StateTrackingConfig`; parity is modulus 2):
      modulus, train_min_len, train_max_len, test_min_len, test_max_len.
    """

    task: Literal["mqar", "niah", "state_tracking"] = "mqar"
    # task: MQAR (Zoology) and NIAH
    vocab_size: int = 256
    seq_len: int = 64
    num_kv_pairs: int = 8
    power_a: float = 0.01
    random_non_queries: bool = True  # MQAR: non-query tokens of the query region random (True) or 0 (False)
    # task: NIAH
    key_len: int = 1
    value_len: int = 1
    depth: Optional[float] = None  # None: random needle depth; else fixed relative depth in [0, 1]
    # task: state tracking (running sum mod `modulus` at every position; parity = 2)
    modulus: int = 2
    train_min_len: int = 3
    train_max_len: int = 40
    test_min_len: int = 40
    test_max_len: int = 256
    # model
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 2
    mixer: str = "gdn"  # gdn, deltanet, mamba2, gla, linear, attention, gated_attention (gdn_jax.models.MIXERS)
    hybrid_every: int = 0  # > 0: every hybrid_every-th layer is `hybrid_mixer` (4 with 4 layers: 3:1)
    hybrid_mixer: str = "gated_attention"
    allow_neg_eigval: bool = False  # GDN/DeltaNet: beta in (0, 2) (negative eigenvalues)
    mlp_ratio: float = 0.0
    use_short_conv: bool = True
    backend: str = "auto"  # GDN op backend: auto / scan / chunk / pallas
    chunk_size: int = 64
    # optimisation (AdamW, warmup + cosine; no decay on 1-D params)
    lr: float = 3e-3
    warmup: int = 200
    steps: int = 3000  # cosine horizon (and the default number of steps)
    max_steps: Optional[int] = None  # stop here instead of at `steps` (the schedule is unchanged)
    batch_size: int = 64
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.98
    grad_clip: float = 1.0
    min_lr_ratio: float = 0.1
    # data
    data_mode: Literal["stream", "fixed"] = "stream"  # fresh batch every step / Zoology's fixed train set (MQAR)
    train_examples: int = 100_000  # size of the fixed training set (data_mode="fixed", MQAR only)
    test_examples: int = 1000
    eval_batch_size: int = 200
    # loop / output
    eval_every: int = 250
    target_accuracy: float = 0.99  # early stop once test accuracy reaches this
    max_time_s: Optional[float] = None  # stop (then evaluate) once this run's wall time exceeds this
    log_every: int = 10  # steps between progress-bar / train-curve updates
    seed: int = 0  # data (MQAR seed) and model init
    out: Optional[str] = None  # output dir (default runs/<task>)
    ckpt_dir: Optional[str] = None  # default <out>/ckpt
    resume: bool = False
    keep_checkpoints: int = 3
    progress: bool = True  # tqdm bar


# Fields that may differ between a run and its resumption without changing the result.
_RESUME_FREE = {"max_steps", "max_time_s", "out", "ckpt_dir", "resume", "keep_checkpoints", "progress", "log_every",
                "eval_every", "target_accuracy", "eval_batch_size", "backend", "chunk_size"}


def make_task(cfg: RecallConfig):
    """The task config (:mod:`gdn_jax.data`) that ``cfg`` describes."""
    if cfg.task == "mqar":
        return MQARConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, num_kv_pairs=cfg.num_kv_pairs,
                          power_a=cfg.power_a, random_non_queries=cfg.random_non_queries,
                          train_examples=cfg.train_examples,
                          test_examples=cfg.test_examples, seed=cfg.seed)
    if cfg.task == "niah":
        from gdn_jax.data import NIAHConfig

        return NIAHConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, key_len=cfg.key_len,
                          value_len=cfg.value_len, depth=cfg.depth, test_examples=cfg.test_examples, seed=cfg.seed)
    if cfg.task == "state_tracking":
        from gdn_jax.data import StateTrackingConfig

        return StateTrackingConfig(modulus=cfg.modulus, train_min_len=cfg.train_min_len,
                                   train_max_len=cfg.train_max_len, test_min_len=cfg.test_min_len,
                                   test_max_len=cfg.test_max_len, test_examples=cfg.test_examples, seed=cfg.seed)
    raise ValueError(f"task must be one of {TASKS}, got task={cfg.task!r}")


def build(cfg: RecallConfig):
    """Task, loader, LM config, model factory and optimizer of ``cfg``."""
    from gdn_jax.models.lm import MIXERS
    from gdn_jax.ops import BACKENDS

    if cfg.backend not in BACKENDS:
        raise SystemExit(f"--backend must be one of {BACKENDS}, got {cfg.backend!r}")
    for name in ("mixer", "hybrid_mixer"):
        if getattr(cfg, name) not in MIXERS:
            raise SystemExit(f"--{name} must be one of {sorted(MIXERS)}, got {getattr(cfg, name)!r}")
    if cfg.data_mode == "fixed" and cfg.task != "mqar":
        raise SystemExit(f"--data_mode fixed is the Zoology MQAR protocol; task {cfg.task!r} streams (--data_mode stream)")
    if cfg.task not in TASKS:
        raise SystemExit(f"--task must be one of {TASKS}, got {cfg.task!r}")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        raise SystemExit(f"--lr must be a positive finite number, got {cfg.lr!r}")
    for name in ("d_model", "num_layers", "num_heads", "steps", "batch_size", "eval_every", "eval_batch_size",
                 "test_examples", "log_every", "keep_checkpoints"):
        if getattr(cfg, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.d_model % cfg.num_heads:
        raise SystemExit(f"--d_model {cfg.d_model} must be divisible by --num_heads {cfg.num_heads} "
                         f"(head dim = d_model / num_heads)")
    if not 0 <= cfg.warmup < cfg.steps:
        raise SystemExit(f"--warmup must be in [0, --steps) = [0, {cfg.steps}), got {cfg.warmup} "
                         f"(the default warmup is 200 steps: pass a smaller --warmup with a short --steps)")
    if cfg.max_steps is not None and cfg.max_steps < 0:
        raise SystemExit(f"--max_steps must be >= 0, got {cfg.max_steps}")
    if cfg.max_time_s is not None and not cfg.max_time_s > 0:
        raise SystemExit(f"--max_time_s must be > 0 (seconds), got {cfg.max_time_s}")
    if not 0 < cfg.target_accuracy <= 1:
        raise SystemExit(f"--target_accuracy must be in (0, 1], got {cfg.target_accuracy}")
    if cfg.hybrid_every < 0 or (cfg.hybrid_every > cfg.num_layers):
        raise SystemExit(f"--hybrid_every {cfg.hybrid_every} with --num_layers {cfg.num_layers}: no layer would be "
                         f"{cfg.hybrid_mixer!r} (need 0 <= hybrid_every <= num_layers; 4 layers for 3:1)")
    try:
        task = make_task(cfg)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"task {cfg.task!r}: {e}") from None
    loader = TaskLoader(task, cfg.batch_size, mode=cfg.data_mode)
    layer_mixers = LMConfig(num_layers=cfg.num_layers, mixer=cfg.mixer, hybrid_every=cfg.hybrid_every,
                            hybrid_mixer=cfg.hybrid_mixer).layer_mixers()
    if cfg.allow_neg_eigval and not set(layer_mixers) & {"gdn", "deltanet"}:
        raise SystemExit(f"--allow_neg_eigval needs a delta-rule layer (gdn, deltanet); the layers are {layer_mixers}")
    lm_cfg = LMConfig(vocab_size=task.model_vocab_size, d_model=cfg.d_model, num_layers=cfg.num_layers,
                      num_heads=cfg.num_heads, mixer=cfg.mixer, hybrid_every=cfg.hybrid_every,
                      hybrid_mixer=cfg.hybrid_mixer, allow_neg_eigval=cfg.allow_neg_eigval,
                      mlp_ratio=cfg.mlp_ratio, use_short_conv=cfg.use_short_conv,
                      backend=cfg.backend, chunk_size=cfg.chunk_size)
    model_fn = lambda: LM(lm_cfg, rngs=nnx.Rngs(cfg.seed))
    tx = T.make_optimizer(cfg.lr, warmup_steps=cfg.warmup, total_steps=cfg.steps,
                          weight_decay=cfg.weight_decay, min_lr_ratio=cfg.min_lr_ratio,
                          b1=cfg.b1, b2=cfg.b2, grad_clip=cfg.grad_clip)
    return task, loader, lm_cfg, model_fn, tx


def resolved_backends(model: LM) -> List[str]:
    """The GDN op backend each GDN layer of ``model`` actually runs (``[]`` without GDN layers)."""
    from gdn_jax.layers import GatedDeltaNet
    from gdn_jax.ops import resolve_backend
    from gdn_jax.ops._common import GateForms

    out = []
    for blk in model.blocks:
        m = blk.mixer
        if isinstance(m, GatedDeltaNet):
            try:
                out.append(resolve_backend(
                    m.backend, GateForms(g_per_channel=m.decay_per_channel, beta_per_channel=m.beta_per_channel),
                    chunk_size=m.chunk_size, K=m.head_dim, V=m.value_head_dim, dtype=m.dtype))
            except Exception as e:  # pragma: no cover - report rather than crash
                out.append(f"error: {e}")
    return out


def plot_curves(path: str, history: Dict[str, Any], target: float) -> None:
    """Loss and accuracy against step (train curve + test evals) to ``path`` (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = np.array(history["train"], dtype=float).reshape(-1, 3)
    ev = history["evals"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    if len(tr):
        a1.plot(tr[:, 0], tr[:, 1], lw=1, label="train")
        a2.plot(tr[:, 0], tr[:, 2], lw=1, label="train")
    if ev:
        a1.plot([e["step"] for e in ev], [e["test_loss"] for e in ev], "o-", ms=3, label="test")
        a2.plot([e["step"] for e in ev], [e["test_accuracy"] for e in ev], "o-", ms=3, label="test")
    a2.axhline(target, color="gray", ls="--", lw=0.8)
    a1.set(xlabel="step", ylabel="loss (query positions)", title="loss")
    a2.set(xlabel="step", ylabel="accuracy", title="accuracy", ylim=(0, 1.02))
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(cfg: RecallConfig) -> Tuple[Dict[str, Any], T.TrainState]:
    """Train (or resume) according to ``cfg``; write results.json, curves.png and checkpoints.

    Returns ``(results, final TrainState)``. Timing fields of ``results`` (this session):
    ``first_step_s`` (the first step, compile included), ``steps_per_s`` (the other steps over
    the rest of the wall time, evaluations and checkpoint saves included), ``eval_s`` (time in
    evaluations, their compile included, and checkpoint saves) and ``train_steps_per_s`` (the
    same steps over the wall time without ``eval_s``).
    """
    out = cfg.out or os.path.join("runs", cfg.task)
    ckpt_dir = cfg.ckpt_dir or os.path.join(out, "ckpt")
    os.makedirs(out, exist_ok=True)
    stop = cfg.max_steps if cfg.max_steps is not None else cfg.steps

    task, loader, lm_cfg, model_fn, tx = build(cfg)
    mesh = T.make_mesh()
    n_dev = mesh.shape["data"]
    for name in ("batch_size", "eval_batch_size"):
        if getattr(cfg, name) % n_dev:
            raise ValueError(f"{name}={getattr(cfg, name)} is not divisible by the {n_dev} devices")

    if not cfg.resume and os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
        print(f"starting fresh: removing old checkpoints in {ckpt_dir} (use --resume to continue them)",
              file=sys.stderr)
        shutil.rmtree(ckpt_dir)
    ckpt = T.Checkpointer(ckpt_dir, max_to_keep=cfg.keep_checkpoints)

    history: Dict[str, Any] = {"train": [], "evals": []}
    wall_before = 0.0
    restored = None
    if cfg.resume:
        graphdef, abstract = T.abstract_train_state(model_fn, tx, mesh=mesh)
        try:
            restored = ckpt.restore_latest(abstract)
        except ValueError as e:  # orbax: saved tree does not match this model
            raise SystemExit(
                f"--resume: the checkpoint in {ckpt_dir} does not match this run's model/optimizer "
                f"(saved with other settings, e.g. --mixer/--d_model/--num_layers?). Use the original "
                f"flags, another --out/--ckpt_dir, or drop --resume. ({str(e).splitlines()[0]})"
            ) from None
        if restored is None:
            print(f"--resume: no checkpoint in {ckpt_dir}; starting from scratch", file=sys.stderr)
    if restored is not None:
        state, meta = restored
        history = meta.get("history", history)
        wall_before = float(meta.get("wall_s", 0.0))
        old = meta.get("config", {})
        diff = {k: (old[k], v) for k, v in dataclasses.asdict(cfg).items()
                if k in old and old[k] != v and k not in _RESUME_FREE}
        if diff:
            print(f"warning: resuming with changed settings {diff}", file=sys.stderr)
    else:
        graphdef, state = T.create_train_state(model_fn(), tx, seed=cfg.seed, mesh=mesh)
    start = int(jax.device_get(state.step))
    if restored is not None:
        print(f"resumed from step {start} ({ckpt_dir})", file=sys.stderr)

    n_labels = max_labels(task)  # sparse LM head: logits only where something is scored
    train_step = T.make_train_step(graphdef, tx, mesh, loss_fn=T.make_lm_loss(n_labels))
    eval_step = T.make_eval_step(graphdef, mesh, max_scored=n_labels)
    test_set = make_test_set(task)

    t0 = time.perf_counter()
    first_step_s = None
    stopped_by_time = diverged = False
    done = bool(history["evals"]) and history["evals"][-1]["test_accuracy"] >= cfg.target_accuracy
    pending: List[Dict[str, jax.Array]] = []
    since_eval: List[float] = []
    eval_s = [0.0]  # time spent in do_eval (evaluation incl. its compile, checkpoint save) this session

    def wall() -> float:
        return wall_before + time.perf_counter() - t0

    def flush(step: int):
        if not pending:
            return None
        vals = jax.device_get(pending)
        pending.clear()
        if any(int(v.get("unscored", 0)) for v in vals):
            raise RuntimeError(f"training batches have more labels per row than max_labels={n_labels}")
        loss = float(np.mean([v["loss"] for v in vals]))
        acc = float(np.mean([v["accuracy"] for v in vals]))
        history["train"].append([step, loss, acc])
        since_eval.extend(float(v["loss"]) for v in vals)
        return loss, acc

    def do_eval(step: int) -> Dict[str, Any]:
        t_eval = time.perf_counter()
        ev = T.evaluate(eval_step, state, test_set, batch_size=cfg.eval_batch_size, mesh=mesh)
        rec = {"step": step, "loss": float(np.mean(since_eval)) if since_eval else None,
               "test_loss": ev["loss"], "test_accuracy": ev["accuracy"], "wall_s": round(wall(), 3)}
        since_eval.clear()
        history["evals"].append(rec)
        ckpt.save(state, {"config": dataclasses.asdict(cfg), "history": history, "wall_s": wall(),
                          "loader_step": step, "data_mode": cfg.data_mode}, step=step)
        eval_s[0] += time.perf_counter() - t_eval
        return rec

    from tqdm.auto import tqdm

    bar = tqdm(total=stop, initial=min(start, stop), disable=not cfg.progress, dynamic_ncols=True,
               desc=f"{cfg.task} {mixer_label(cfg)}")
    step = start
    batches = T.prefetch_batches(loader.batch, range(start, stop), mesh) if not done else iter(())
    try:
        for s, batch in batches:
            t_step = time.perf_counter()
            state, metrics = train_step(state, batch)
            if first_step_s is None:
                jax.block_until_ready(metrics)
                first_step_s = time.perf_counter() - t_step
            pending.append(metrics)
            step = s + 1
            bar.update(1)
            out_of_time = cfg.max_time_s is not None and wall() > cfg.max_time_s
            is_eval = step % cfg.eval_every == 0
            if step % cfg.log_every == 0 or is_eval or step == stop:
                la = flush(step)
                if la is not None:
                    bar.set_postfix(loss=f"{la[0]:.3f}", acc=f"{la[1]:.3f}",
                                    test=f"{history['evals'][-1]['test_accuracy']:.3f}" if history["evals"] else "-")
            if is_eval:
                rec = do_eval(step)
                bar.set_postfix(loss=f"{history['train'][-1][1]:.3f}", acc=f"{history['train'][-1][2]:.3f}",
                                test=f"{rec['test_accuracy']:.3f}")
                if rec["test_accuracy"] >= cfg.target_accuracy:
                    done = True
                    break
                if not (math.isfinite(rec["test_loss"]) and (rec["loss"] is None or math.isfinite(rec["loss"]))):
                    diverged = True  # NaN/inf loss: further steps cannot recover
                    print(f"{cfg.task} {mixer_label(cfg)} lr={cfg.lr:g}: loss is not finite at step {step}; "
                          f"stopping (diverged)", file=sys.stderr)
                    break
            if out_of_time:
                stopped_by_time = True
                break
    finally:
        if hasattr(batches, "close"):
            batches.close()
        bar.close()
    flush(step)
    if not history["evals"] or history["evals"][-1]["step"] != step:
        do_eval(step)
    ckpt.close()
    train_wall = time.perf_counter() - t0

    final = history["evals"][-1]
    backends = resolved_backends(T.merge_model(graphdef, state))
    dev = jax.devices()[0]
    ran = step - start
    results = {
        "config": dataclasses.asdict(cfg),
        "jax_version": jax.__version__,
        "platform": jax.default_backend(),
        "backend_requested": cfg.backend,
        "backend_resolved": sorted(set(backends)) if backends else None,
        "device_kind": dev.device_kind,
        "num_devices": n_dev,
        "evals": history["evals"],
        "eval_columns": ["step", "loss", "test_loss", "test_accuracy", "wall_s"],
        "task": cfg.task,
        "chance": task.chance,
        "final_test_accuracy": final["test_accuracy"],
        "best_test_accuracy": max(e["test_accuracy"] for e in history["evals"]),
        "final_scaled_accuracy": scaled_accuracy(final["test_accuracy"], task.chance),
        "best_scaled_accuracy": scaled_accuracy(max(e["test_accuracy"] for e in history["evals"]), task.chance),
        "reached_target": final["test_accuracy"] >= cfg.target_accuracy,
        "stopped_by_time": stopped_by_time,
        "diverged": diverged,
        "steps": step,
        "resumed_from": start if restored is not None else None,
        "wall_s": round(wall_before + train_wall, 3),
        "session_wall_s": round(train_wall, 3),
        "first_step_s": None if first_step_s is None else round(first_step_s, 3),
        "steps_per_s": round((ran - 1) / (train_wall - first_step_s), 2)
        if first_step_s is not None and ran > 1 and train_wall > first_step_s else None,
        "eval_s": round(eval_s[0], 3),
        "train_steps_per_s": round((ran - 1) / (train_wall - first_step_s - eval_s[0]), 2)
        if first_step_s is not None and ran > 1 and train_wall > first_step_s + eval_s[0] else None,
        "num_params": int(sum(np.size(x) for x in jax.tree.leaves(state.params))),
        "train_curve": history["train"],
        "out": os.path.abspath(out),
        "ckpt_dir": ckpt.directory,
    }
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(_finite_json(results), f, indent=1, allow_nan=False)  # NaN/inf -> null: strict JSON
    plot_curves(os.path.join(out, "curves.png"), history, cfg.target_accuracy)
    print(f"{cfg.task} {mixer_label(cfg)} d={cfg.d_model} {task_label(cfg)} lr={cfg.lr:g}: "
          f"test_acc={final['test_accuracy']:.4f} (best {results['best_test_accuracy']:.4f}) at step {step}"
          f"{' [target reached]' if results['reached_target'] else ''}, wall {results['wall_s']:.1f}s, "
          f"backend={','.join(results['backend_resolved'] or ['-'])} on {n_dev}x {dev.device_kind} "
          f"-> {os.path.join(out, 'results.json')}", flush=True)
    return results, state
