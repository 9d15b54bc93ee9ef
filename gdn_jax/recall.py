"""Train a small LM on one synthetic recall task and report test accuracy (the library side of
``experiments/recall.py``, ``experiments/mqar.py`` and ``experiments/sweep.py``; README "Experiments
and results" and "Recall suite").

:func:`run` trains (or resumes) one :class:`RecallConfig` in named steps: restore or init (the
latest orbax checkpoint with ``resume``, else a fresh state), the train loop (the task's stream, or
fixed for MQAR, training batches; AdamW with warmup + cosine, :func:`gdn_jax.training.make_optimizer`;
a jitted data-parallel step over every local device, or data x sequence with ``context_parallel``;
the fixed set kept on the devices; train metrics fetched one log interval late; a tqdm bar, or in
a log a line per evaluation), evaluation on the test set every
``eval_every`` steps with an early stop at ``target_accuracy`` and a checkpoint each time (a resumed
run is bit-identical on CPU), and the outputs ``results.json`` + ``curves.png`` in ``out``.

Run folders (docs/experiment_tools.md): each run writes to its own folder, by default a new
``runs/<task>/<mixer>-<date>-<time>`` with ``runs/<task>/latest`` pointing to it; a fresh run refuses
a folder that holds files unless ``overwrite``; ``config.json`` records the settings, which
:func:`resume_config` (``--resume``) and :func:`load_run` read back.

The task config (:data:`gdn_jax.data.TASK_CONFIGS`) and the :class:`gdn_jax.models.LMConfig` are
built from the :class:`RecallConfig` fields of the same names (:func:`make_task`,
:func:`make_lm_config`). Bad settings raise ``ValueError``/``TypeError`` naming the field
(``RecallConfig.lr``); the scripts turn them into exit messages (:func:`gdn_jax.cli.exit_on_error`).

Accuracy is the mean over scored positions (MQAR: the query positions; NIAH: the value tokens;
state tracking: every position); ``scaled accuracy`` = (acc - chance) / (1 - chance) (Grazzi et al.
2025).
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import re
import shutil
import signal
import sys
import threading
import time
import typing
import warnings
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple

import jax
import numpy as np
from flax import nnx

from gdn_jax import training as T
from gdn_jax.data import TASK_CONFIGS, TaskLoader, make_test_set, scaled_accuracy
from gdn_jax.loggers import LOGGERS, Logger, MultiLogger, make_logger, require as require_logger
from gdn_jax.models import LM, LMConfig
from gdn_jax.step_cache import shared_steps

__all__ = ["CONFIG_FILE", "LoadedRun", "RESUME_FREE_FIELDS", "RecallConfig", "TASKS", "build", "find_run", "load_run",
           "make_lm_config", "make_run_mesh", "make_task", "read_latest", "resume_config", "run", "saved_config",
           "scaled_accuracy", "sequence_widths", "task_label", "task_options", "validate"]

TASKS = tuple(TASK_CONFIGS)


def max_labels(task) -> Optional[int]:
    """``task.max_labels``: the most labelled positions in one example (MQAR: the pairs; NIAH: the value
    tokens), or None where most positions are labelled (state tracking): the loss then uses the dense head."""
    return task.max_labels


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
    """A short description of the task parameters of ``cfg`` (for logs and plots): ``make_task(cfg).label``."""
    return make_task(cfg).label


@dataclasses.dataclass
class RecallConfig:
    """One training run on a synthetic task. Every field is also a command-line flag (``gdn_jax.cli``).

    Defaults: MQAR with a 2-layer GDN, d_model 128, and a 3000-step cosine (measured to cross 0.99
    in ~500 steps on 2 CPU cores). ``task`` selects the generator (:data:`gdn_jax.data.TASK_CONFIGS`),
    which takes the fields of its config's names; a task field that does not belong to it is refused
    (ValueError) when set away from its default (:func:`task_options`):

    * ``"mqar"`` (:class:`gdn_jax.data.MQARConfig`): vocab_size, seq_len, num_kv_pairs, power_a,
      random_non_queries;
    * ``"niah"`` (:class:`gdn_jax.data.NIAHConfig`): vocab_size, seq_len, key_len, value_len, depth;
    * ``"state_tracking"`` (:class:`gdn_jax.data.StateTrackingConfig`; parity is modulus 2):
      modulus, train_min_len, train_max_len, test_min_len, test_max_len.
    """

    task: Literal["mqar", "niah", "state_tracking"] = "mqar"  # the synthetic task (gdn_jax.data.TASK_CONFIGS)
    # -- task: MQAR (Zoology) and NIAH --
    vocab_size: int = 256  # MQAR / NIAH: token ids in [0, vocab_size) (also the model's vocabulary)
    seq_len: int = 64  # tokens per example
    num_kv_pairs: int = 8  # MQAR: key-value pairs per example
    power_a: float = 0.01  # MQAR: query-position power law p(i) ~ (i + 1)^(power_a - 1) (Zoology)
    random_non_queries: bool = True  # MQAR: non-query tokens of the query region random (True) or 0 (False)
    # -- task: NIAH --
    key_len: int = 1  # NIAH: tokens of the needle's key
    value_len: int = 1  # NIAH: tokens of the needle's value
    depth: Optional[float] = None  # NIAH: None: random needle depth; else fixed relative depth in [0, 1]
    # -- task: state tracking --
    modulus: int = 2  # state tracking: the running sum mod `modulus` at every position (parity: 2)
    train_min_len: int = 3  # state tracking: shortest training sequence
    train_max_len: int = 40  # state tracking: longest training sequence
    test_min_len: int = 40  # state tracking: shortest test sequence (length generalisation)
    test_max_len: int = 256  # state tracking: longest test sequence
    # -- model --
    d_model: int = 128  # model width
    num_layers: int = 2  # mixer blocks
    num_heads: int = 2  # heads of each mixer
    # gdn, deltanet, kda, mamba2, gla, linear, attention, gated_attention (gdn_jax.models.MIXERS), or hybrid:
    # gdn with every 4th layer gated_attention (3:1; at least 4 layers), as the sweep's mixer name
    mixer: str = "gdn"
    hybrid_every: int = 0  # > 0: every hybrid_every-th layer is `hybrid_mixer` (4 with 4 layers: 3:1)
    hybrid_mixer: str = "gated_attention"  # the mixer of every hybrid_every-th layer
    allow_neg_eigval: bool = False  # GDN/DeltaNet: beta in (0, 2) (negative eigenvalues)
    mlp_ratio: float = 0.0  # MLP hidden size / d_model after each mixer (0: no MLP, as Zoology)
    use_short_conv: bool = True  # the mixers' short causal convolution on q, k, v
    backend: str = "auto"  # GDN op backend: auto / scan / chunk / pallas
    chunk_size: int = 64  # the chunked / Pallas backends' chunk
    head_dim: Optional[int] = None  # per-head key dim (default d_model // num_heads)
    # -- baselines as published (gdn_jax.models.LMConfig; defaults keep gdn_jax's forms) --
    attn_bias: str = ""  # attention projections with a bias, letters of "qkvo" ("qkvo": Zoology's MHA)
    pos_embedding: str = "none"  # "learned": absolute position embeddings (Zoology), max_seq_len from the task
    rope_fraction: Optional[float] = None  # attention's RoPE share (0: no RoPE, as Zoology's MHA)
    la_qk_l2norm: Optional[bool] = None  # mamba2/gla/linear q,k L2 norm (None: mixer default)
    mamba2_dt_input: bool = False  # mamba2: input scaled by dt (Mamba2's discretisation)
    gla_gate_low_rank: int = 16  # gla: rank of the forget gate's projection
    gla_gate_normalizer: float = 16.0  # gla: tau of log sigmoid(.) / tau
    gla_expand_k: Optional[float] = None  # gla key dim / d_model (None: 1; the GLA paper: 0.5)
    # -- optimisation (AdamW, warmup + cosine; no decay on 1-D params) --
    lr: float = 3e-3  # peak learning rate (AdamW)
    warmup: int = 200  # linear warmup steps
    steps: int = 3000  # cosine horizon (and the default number of steps)
    max_steps: Optional[int] = None  # stop here instead of at `steps` (the schedule is unchanged)
    batch_size: int = 64  # training examples per step
    weight_decay: float = 0.1  # AdamW decoupled weight decay (not on 1-D parameters)
    b1: float = 0.9  # Adam first-moment decay
    b2: float = 0.98  # Adam second-moment decay
    grad_clip: float = 1.0  # global gradient-norm clip (0: none)
    min_lr_ratio: float = 0.1  # the cosine's final lr / peak lr
    lr_per_epoch: bool = False  # data_mode="fixed": the schedule stepped once per epoch (Zoology's cosine)
    # -- data --
    data_mode: Literal["stream", "fixed"] = "stream"  # fresh batch every step / Zoology's fixed train set (MQAR)
    train_examples: int = 100_000  # size of the fixed training set (data_mode="fixed", MQAR only)
    test_examples: int = 1000  # held-out test set size
    eval_batch_size: int = 200  # test examples per evaluation batch
    # -- loop / output --
    eval_every: int = 250  # steps between evaluations (each followed by a checkpoint)
    # once a train-curve point's accuracy reaches target_accuracy: evaluate every this many steps
    # (at log points) until the test accuracy does too (0: only every eval_every)
    eval_every_near_target: int = 50
    target_accuracy: float = 0.99  # early stop once test accuracy reaches this
    max_time_s: Optional[float] = None  # stop (then evaluate) once this run's wall time exceeds this
    log_every: int = 10  # steps between progress-bar / train-curve updates
    seed: int = 0  # data (MQAR seed) and model init
    # the run's folder (default: a new runs/<task>/<mixer>-<date>-<time>; runs/<task>/latest points to it);
    # a folder that holds files is refused unless resume or overwrite
    out: Optional[str] = None
    ckpt_dir: Optional[str] = None  # default <out>/ckpt
    resume: bool = False  # continue from the latest checkpoint of the run in out (default: runs/<task>/latest)
    # a fresh run in an out / ckpt_dir that holds a run: replace its results and checkpoints
    overwrite: bool = False
    keep_checkpoints: int = 3  # checkpoints kept on disk (the latest ones)
    keep_best_checkpoint: bool = True  # also keep the best evaluation's checkpoint (load_run(params="best"))
    progress: bool = True  # tqdm bar
    session_time_s: Optional[float] = None  # stop this session after this many s: checkpoint, no results.json
    device_data: bool = True  # data_mode="fixed": keep the training set on the devices (same batches)
    # devices each sequence is split over (context parallelism, mesh axis "seq"; docs/context_parallel.md):
    # the local devices form a (devices / context_parallel) x context_parallel mesh, batch over the first
    context_parallel: int = 1
    # -- metric loggers (gdn_jax.loggers; pip install -e '.[loggers]') --
    # also log the metrics to TensorBoard (<out>/tb) or W&B (<out>/wandb; WANDB_MODE=offline: no network)
    logger: Literal["none", "tensorboard", "wandb"] = "none"
    wandb_project: str = "gdn_jax"  # logger wandb: the W&B project
    wandb_group: Optional[str] = None  # logger wandb: the W&B group (a sweep sets its folder's name)


    def __post_init__(self):
        # NumPy scalars (np.int64(40), np.float32(3e-3), np.bool_) as Python ones: a field is written
        # to JSON (results, checkpoint metadata), which takes no NumPy scalar
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, np.generic):
                setattr(self, f.name, value.item())
        if self.mixer == "hybrid":  # the sweep's mixer name: gdn 3:1 gated attention (gdn_jax.sweep)
            self.mixer = "gdn"
            self.hybrid_every = self.hybrid_every or 4
            if isinstance(self.num_layers, int) and not isinstance(self.num_layers, bool):
                if self.num_layers < self.hybrid_every:
                    warnings.warn(f"RecallConfig.mixer='hybrid' (gdn with every {self.hybrid_every}th layer "
                                  f"{self.hybrid_mixer}): num_layers {self.num_layers} -> {self.hybrid_every}, the "
                                  f"fewest with one {self.hybrid_mixer} layer (set hybrid_every for another ratio)",
                                  UserWarning, stacklevel=3)
                self.num_layers = max(self.num_layers, self.hybrid_every)


#: Fields that may differ between a run and its resumption without changing the result.
RESUME_FREE_FIELDS = frozenset({"max_steps", "max_time_s", "out", "ckpt_dir", "resume", "overwrite", "keep_checkpoints",
                                "keep_best_checkpoint", "progress", "log_every", "eval_every", "eval_every_near_target",
                                "target_accuracy", "eval_batch_size", "backend", "chunk_size", "session_time_s",
                                "device_data", "logger", "wandb_project", "wandb_group", "context_parallel"})


def _shared_fields(cls, cfg: RecallConfig) -> Dict[str, Any]:
    """The values in ``cfg`` of the fields that dataclass ``cls`` has under the same names."""
    ours = {f.name for f in dataclasses.fields(cfg)}
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls) if f.init and f.name in ours}


def make_task(cfg: RecallConfig):
    """The task config (:data:`gdn_jax.data.TASK_CONFIGS`) that ``cfg`` describes, from the fields of
    ``cfg`` that the task's config has (e.g. MQAR: vocab_size, seq_len, num_kv_pairs, ...)."""
    if cfg.task not in TASK_CONFIGS:
        raise ValueError(f"RecallConfig.task must be one of {TASKS}, got {cfg.task!r}")
    cls = TASK_CONFIGS[cfg.task]
    return cls(**_shared_fields(cls, cfg))


def make_lm_config(cfg: RecallConfig, vocab_size: int) -> LMConfig:
    """The :class:`gdn_jax.models.LMConfig` of ``cfg``: its fields of LMConfig's names (d_model,
    num_layers, mixer, backend, ...), with the task's ``vocab_size`` (``model_vocab_size``)."""
    kw = dict(_shared_fields(LMConfig, cfg), vocab_size=vocab_size)
    if cfg.pos_embedding == "learned":
        kw["max_seq_len"] = max_seq_len(cfg)
    return LMConfig(**kw)


def max_seq_len(cfg: RecallConfig) -> int:
    """The longest sequence the task of ``cfg`` produces (learned position embeddings need it):
    ``seq_len`` (MQAR, NIAH) or ``max(train_max_len, test_max_len)`` (state tracking)."""
    if cfg.task == "state_tracking":
        return max(cfg.train_max_len, cfg.test_max_len)
    return cfg.seq_len


def _check_field_types(cfg) -> None:
    """TypeError naming ``Cls.field`` for a value that is not of its dataclass field's type: ``int``
    fields take integers (not bools), ``float`` fields real numbers (not bools), ``bool`` fields
    bools, ``str`` fields strings, ``Optional[...]`` also None (Literal fields: strings; their choices
    are checked by the value checks)."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        tp, value = hints.get(f.name), getattr(cfg, f.name)
        args = typing.get_args(tp)
        if type(None) in args:
            if value is None:
                continue
            rest = [a for a in args if a is not type(None)]
            tp = rest[0] if len(rest) == 1 else None
        if typing.get_origin(tp) is typing.Literal:
            tp = type(typing.get_args(tp)[0])
        ok = {int: lambda x: isinstance(x, numbers.Integral) and not isinstance(x, bool),
              float: lambda x: isinstance(x, numbers.Real) and not isinstance(x, bool),
              bool: lambda x: isinstance(x, (bool, np.bool_)),
              str: lambda x: isinstance(x, str)}.get(tp)
        if ok is not None and not ok(value):
            raise TypeError(f"{type(cfg).__name__}.{f.name} must be {'a' if tp is not int else 'an'} {tp.__name__}"
                            f"{' or None' if type(None) in args else ''}, got {type(value).__name__} {value!r}")


def check_out_dir(name: str, path: Optional[str]) -> None:
    """ValueError naming ``name`` when ``path`` (a folder the run will create or fill) is an existing
    file or lies under one -- checked before anything trains (a checkpoint folder that is a file used
    to fail at the first checkpoint, in orbax, after minutes)."""
    if path is None:
        return
    p = os.path.abspath(path)
    while True:
        if os.path.exists(p) and not os.path.isdir(p):
            where = "is a file" if p == os.path.abspath(path) else f"lies under the file {p!r}"
            raise ValueError(f"{name}={path!r} {where}, not a folder")
        parent = os.path.dirname(p)
        if parent == p or os.path.isdir(p):
            return
        p = parent


# the baseline options and the built-in mixers that read them (gdn_jax.models.LMConfig)
_MIXER_OPTIONS = {"attn_bias": ("attention", "gated_attention"), "rope_fraction": ("attention", "gated_attention"),
                  "la_qk_l2norm": ("mamba2", "gla", "linear"), "mamba2_dt_input": ("mamba2",),
                  "gla_gate_low_rank": ("gla",), "gla_gate_normalizer": ("gla",), "gla_expand_k": ("gla",)}


def _check_mixer_options(cfg: RecallConfig) -> None:
    """ValueError for a baseline option set away from its default when no layer of the run reads it
    (``--mixer gdn --attn_bias qkvo`` used to train plain gdn and record attn_bias in results.json).
    A sweep over several mixers with such an option: run the mixers that read it as their own sweep."""
    from gdn_jax.models.lm import check_unread_options

    check_unread_options(cfg, {cfg.mixer} | ({cfg.hybrid_mixer} if cfg.hybrid_every else set()), _MIXER_OPTIONS)


def task_options() -> Dict[str, Tuple[str, ...]]:
    """``{field: tasks that read it}`` for the :class:`RecallConfig` fields that only some tasks'
    configs (:data:`gdn_jax.data.TASK_CONFIGS`) have (e.g. ``num_kv_pairs``: ``("mqar",)``); the
    fields every task has (``test_examples``, ``seed``) are not listed."""
    ours = {f.name for f in dataclasses.fields(RecallConfig)}
    readers: Dict[str, List[str]] = {}
    for name, cls in TASK_CONFIGS.items():
        for f in dataclasses.fields(cls):
            if f.init and f.name in ours:
                readers.setdefault(f.name, []).append(name)
    return {k: tuple(v) for k, v in readers.items() if len(v) < len(TASK_CONFIGS)}


def _check_task_options(cfg: RecallConfig) -> None:
    """ValueError for a task option set away from its default when the run's task does not read it
    (``--task niah --num_kv_pairs 4`` used to train NIAH and record num_kv_pairs in results.json),
    and for the fixed training set's options (``train_examples``, ``device_data``) with stream data;
    likewise the W&B options without ``logger="wandb"``."""
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}

    def refuse(name: str, reader: str, why: str):
        raise ValueError(f"RecallConfig.{name} = {getattr(cfg, name)!r} is an option of {reader}; {why} (it would "
                         f"change nothing): leave it at {defaults[name]!r}")

    for name, users in task_options().items():
        if getattr(cfg, name) != defaults[name] and cfg.task not in users:
            refuse(name, f"the {' / '.join(users)} task", f"task {cfg.task!r} does not read it")
    if cfg.data_mode != "fixed":
        for name in ("train_examples", "device_data"):
            if getattr(cfg, name) != defaults[name]:
                refuse(name, "data_mode 'fixed' (the fixed training set)", f"data_mode {cfg.data_mode!r} does not "
                       f"read it")
    if cfg.logger != "wandb":
        for name in ("wandb_project", "wandb_group"):
            if getattr(cfg, name) != defaults[name]:
                refuse(name, "logger 'wandb'", f"logger {cfg.logger!r} does not read it")


def validate(cfg: RecallConfig) -> None:
    """Check the settings of ``cfg`` that the task and model configs do not check themselves (those
    are checked when :func:`build` makes them: the task's sizes, the model's backend options).

    Raises:
      TypeError: a field whose value is not of the field's type (``lr="x"``, ``steps=1.5``,
        ``resume="no"``), naming the field (``RecallConfig.<field>``).
      ValueError: naming the field and the rule it breaks.
    """
    from gdn_jax.models.lm import MIXERS
    from gdn_jax.ops import BACKENDS

    def bad(name: str, rule: str, note: str = ""):
        raise ValueError(f"RecallConfig.{name} must be {rule}, got {getattr(cfg, name)!r}{note}")

    _check_field_types(cfg)

    if cfg.task not in TASK_CONFIGS:
        bad("task", f"one of {TASKS}")
    if cfg.backend not in BACKENDS:
        bad("backend", f"one of {BACKENDS}")
    for name in ("mixer", "hybrid_mixer"):
        if getattr(cfg, name) not in MIXERS:
            bad(name, f"one of {sorted(MIXERS) + (['hybrid'] if name == 'mixer' else [])}")
    fixed_ok = "train_examples" in {f.name for f in dataclasses.fields(TASK_CONFIGS[cfg.task])}
    if cfg.data_mode == "fixed" and not fixed_ok:
        bad("data_mode", "'stream' for this task", f": 'fixed' is Zoology's fixed training set (MQAR, Arora et al. "
            f"2023); task {cfg.task!r} has none")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        bad("lr", "a positive finite number")
    for name in ("d_model", "num_layers", "num_heads", "steps", "batch_size", "eval_every", "eval_batch_size",
                 "test_examples", "log_every", "keep_checkpoints", "context_parallel"):
        if getattr(cfg, name) < 1:
            bad(name, ">= 1")
    if cfg.eval_every_near_target < 0:
        bad("eval_every_near_target", ">= 0 (0: evaluate only every RecallConfig.eval_every steps)")
    if cfg.resume and cfg.overwrite:
        bad("overwrite", "False with RecallConfig.resume", " (resume continues the run in the folder; overwrite "
            "replaces it)")
    if cfg.head_dim is None and cfg.d_model % cfg.num_heads:
        bad("d_model", f"divisible by RecallConfig.num_heads {cfg.num_heads}",
            " (head dim = d_model / num_heads; or set RecallConfig.head_dim)")
    if not 0 <= cfg.warmup < cfg.steps:
        bad("warmup", f"in [0, RecallConfig.steps) = [0, {cfg.steps})",
            " (the default warmup is 200 steps: pass a smaller RecallConfig.warmup with a short RecallConfig.steps)")
    if cfg.max_steps is not None and not 0 <= cfg.max_steps <= cfg.steps:
        bad("max_steps", f"in [0, RecallConfig.steps] = [0, {cfg.steps}]", " (it stops a run early; the schedule "
            "ends at RecallConfig.steps)")
    for name, lo, hi in (("b1", 0.0, 1.0), ("b2", 0.0, 1.0)):
        if not lo <= getattr(cfg, name) < hi:
            bad(name, f"in [{lo:g}, {hi:g})", " (an Adam moment decay)")
    if not (math.isfinite(cfg.weight_decay) and cfg.weight_decay >= 0):
        bad("weight_decay", ">= 0")
    if not (math.isfinite(cfg.grad_clip) and cfg.grad_clip >= 0):
        bad("grad_clip", ">= 0 (the global gradient-norm clip; 0: no clipping)")
    if not 0 <= cfg.min_lr_ratio <= 1:
        bad("min_lr_ratio", "in [0, 1] (the cosine schedule's final lr / peak lr)")
    if cfg.seed < 0:
        bad("seed", ">= 0")
    if cfg.max_time_s is not None and not cfg.max_time_s > 0:
        bad("max_time_s", "> 0 (seconds)")
    if cfg.session_time_s is not None and not cfg.session_time_s > 0:
        bad("session_time_s", "> 0 (seconds)")
    if cfg.lr_per_epoch and cfg.data_mode != "fixed":
        bad("lr_per_epoch", "False unless RecallConfig.data_mode is 'fixed'", " (epochs of the fixed training set)")
    if cfg.data_mode == "fixed" and cfg.train_examples < 1:
        bad("train_examples", ">= 1 with data_mode 'fixed' (the size of the fixed training set)")
    if cfg.data_mode == "fixed" and cfg.batch_size > cfg.train_examples:
        bad("batch_size", f"<= RecallConfig.train_examples = {cfg.train_examples} with data_mode 'fixed'",
            " (each batch comes from the fixed training set)")
    if cfg.lr_per_epoch and cfg.warmup:
        bad("warmup", "0 with RecallConfig.lr_per_epoch", " (a warmup stepped once per epoch would hold the first "
            "epoch at lr 0)")
    if not 0 < cfg.target_accuracy <= 1:
        bad("target_accuracy", "in (0, 1]")
    check_out_dir("RecallConfig.out", cfg.out)
    check_out_dir("RecallConfig.ckpt_dir", cfg.ckpt_dir)
    _check_mixer_options(cfg)
    if cfg.logger not in LOGGERS:
        bad("logger", f"one of {LOGGERS}")
    _check_task_options(cfg)
    if cfg.logger != "none":
        try:
            require_logger(cfg.logger)
        except ImportError as e:
            raise ValueError(f"RecallConfig.logger={cfg.logger!r}: {e}") from None
    if cfg.hybrid_every < 0 or (cfg.hybrid_every > cfg.num_layers):
        bad("hybrid_every", f"in [0, RecallConfig.num_layers] = [0, {cfg.num_layers}]",
            f": else no layer would be {cfg.hybrid_mixer!r} (4 layers for 3:1)")
    if cfg.context_parallel > 1:
        _check_context_parallel(cfg)


def sequence_widths(cfg: RecallConfig) -> Dict[str, int]:
    """``{field: width}``: the token widths of the task's batches, named by the field that sets each
    (MQAR, NIAH: ``seq_len``; state tracking: ``train_max_len`` for the training batches,
    ``test_max_len`` for the test set, both right-padded to that width)."""
    if cfg.task == "state_tracking":
        return {"train_max_len": cfg.train_max_len, "test_max_len": cfg.test_max_len}
    return {"seq_len": cfg.seq_len}


def _check_context_parallel(cfg: RecallConfig) -> None:
    """ValueError naming the field for settings that cannot split sequences over
    ``cfg.context_parallel`` devices: a width not a multiple of it, shards shorter than the short
    convolution's halo (``conv_size - 1`` tokens from the previous shard), learned position
    embeddings. (The device count is checked where the mesh is built, :func:`run`.)"""
    cp = cfg.context_parallel
    halo = LMConfig.__dataclass_fields__["conv_size"].default - 1
    layers = {cfg.mixer} | ({cfg.hybrid_mixer} if cfg.hybrid_every else set())
    conv = cfg.use_short_conv and bool(layers - {"attention", "gated_attention"})  # attention has no short conv
    for name, width in sequence_widths(cfg).items():
        if width % cp:
            raise ValueError(f"RecallConfig.{name} = {width} must be a multiple of RecallConfig.context_parallel = "
                             f"{cp} (each device holds a contiguous 1/{cp} of every sequence)")
        if conv and width // cp < halo:
            raise ValueError(f"RecallConfig.{name} = {width} over RecallConfig.context_parallel = {cp} devices gives "
                             f"shards of {width // cp} tokens, fewer than the short convolution's halo of {halo} "
                             f"(taken from the previous shard only): use fewer devices or "
                             f"RecallConfig.use_short_conv=False")
    if cfg.pos_embedding == "learned":
        raise ValueError(f"RecallConfig.pos_embedding = 'learned' is not supported with RecallConfig.context_parallel "
                         f"= {cp} (use 'none': rotary or no positions)")


def make_run_mesh(cfg: RecallConfig, devices: Optional[Sequence[jax.Device]] = None):
    """The mesh of a run of ``cfg`` over ``devices`` (default: the local devices):
    :func:`gdn_jax.training.make_mesh` with ``seq=cfg.context_parallel`` -- axis ``"data"`` over
    every device, or ``("data", "seq")`` of shape ``(devices / context_parallel, context_parallel)``.

    Raises:
      ValueError: ``context_parallel`` does not divide the number of devices.
    """
    devices = list(jax.local_devices() if devices is None else devices)
    if len(devices) % cfg.context_parallel:
        raise ValueError(f"RecallConfig.context_parallel = {cfg.context_parallel} must divide the {len(devices)} "
                         f"devices ({jax.default_backend()}; the rest of the mesh splits the batch)")
    return T.make_mesh(devices, seq=cfg.context_parallel)


def build(cfg: RecallConfig):
    """``(task, loader, lm_cfg, model_fn, optimizer)`` of ``cfg`` (after :func:`validate`).

    Raises:
      ValueError, TypeError: a bad setting; the message names the ``RecallConfig`` field (or, for the
        task's own checks, the task and the field of the same name).
    """
    validate(cfg)
    try:
        task = make_task(cfg)
    except (TypeError, ValueError) as e:
        raise type(e)(f"RecallConfig task {cfg.task!r}: {e}") from None
    loader = TaskLoader(task, cfg.batch_size, mode=cfg.data_mode)
    layer_mixers = (cfg.mixer,) + ((cfg.hybrid_mixer,) if cfg.hybrid_every else ())  # before LMConfig's own check
    if cfg.allow_neg_eigval and not set(layer_mixers) & {"gdn", "deltanet"}:
        raise ValueError(f"RecallConfig.allow_neg_eigval needs a delta-rule layer (gdn, deltanet); the layers are "
                         f"{list(layer_mixers)}")
    lm_cfg = make_lm_config(cfg, task.model_vocab_size)
    model_fn = lambda: LM(lm_cfg, rngs=nnx.Rngs(cfg.seed))
    tx = T.make_optimizer(cfg.lr, **optimizer_settings(cfg, loader))
    return task, loader, lm_cfg, model_fn, tx


def optimizer_settings(cfg: RecallConfig, loader: TaskLoader) -> Dict[str, Any]:
    """The keyword arguments of :func:`gdn_jax.training.make_optimizer` but the learning rate for
    ``cfg`` (``loader``: the steps per epoch of ``lr_per_epoch``)."""
    return dict(warmup_steps=cfg.warmup, total_steps=cfg.steps, weight_decay=cfg.weight_decay,
                min_lr_ratio=cfg.min_lr_ratio, b1=cfg.b1, b2=cfg.b2, grad_clip=cfg.grad_clip,
                steps_per_epoch=loader.steps_per_epoch if cfg.lr_per_epoch else None)


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



# -- run folders ------------------------------------------------------------------------------------

#: The file in each run's folder that records its :class:`RecallConfig` (``out`` resolved).
CONFIG_FILE = "config.json"
#: The root of the default run folders: ``runs/<task>/<mixer>-<date>-<time>`` (relative to the working dir).
RUNS_ROOT = "runs"
#: The pointer in ``runs/<task>/`` to the newest default run folder (a symlink, or a text file naming it).
LATEST = "latest"
# what a fresh run with overwrite removes from an old run's folder (anything else stays)
_RUN_OUTPUTS = (CONFIG_FILE, "results.json", "curves.png")
_RUN_LOG_DIRS = ("tb", "wandb")  # TensorBoard event files / W&B offline files of a run (gdn_jax.loggers)
_CKPT_ENTRY = re.compile(r"\d+(\.orbax-checkpoint-tmp.*)?")  # orbax step folders (and unfinished writes)


def _folder_label(cfg: RecallConfig) -> str:
    """The mixer part of a default run folder's name: ``gdn``, ``hybrid`` (gdn 3:1 gated attention),
    or e.g. ``gdn+attention4``."""
    if not cfg.hybrid_every:
        return cfg.mixer
    if (cfg.mixer, cfg.hybrid_mixer, cfg.hybrid_every) == ("gdn", "gated_attention", 4):
        return "hybrid"
    return f"{cfg.mixer}+{cfg.hybrid_mixer}{cfg.hybrid_every}"


def read_latest(folder: str) -> Optional[str]:
    """The run folder (an absolute path) that ``folder/latest`` (:data:`LATEST`: a symlink, or a text
    file holding the run folder's name) points to, or None when there is none or it names no folder."""
    p = os.path.join(folder, LATEST)
    if os.path.islink(p) or os.path.isdir(p):
        target = os.path.realpath(p)
    elif os.path.isfile(p):
        with open(p) as f:
            name = f.read().strip()
        target = os.path.abspath(name if os.path.isabs(name) else os.path.join(folder, name))
    else:
        return None
    return target if os.path.isdir(target) else None


def _point_latest(folder: str, name: str) -> None:
    """``folder/latest`` -> ``name`` (a relative symlink, replaced atomically; where the OS allows no
    symlink, a text file holding ``name``). A real folder named ``latest`` is left alone."""
    p = os.path.join(folder, LATEST)
    if os.path.isdir(p) and not os.path.islink(p):
        print(f"warning: {p} is a folder, not a pointer; not updated", file=sys.stderr)
        return
    tmp = os.path.join(folder, f".{LATEST}.{os.getpid()}")
    try:
        if os.path.lexists(tmp):
            os.remove(tmp)
        os.symlink(name, tmp, target_is_directory=True)
    except (OSError, NotImplementedError):  # no symlinks here (Windows without the privilege): a text file
        with open(tmp, "w") as f:
            f.write(name + "\n")
    os.replace(tmp, p)


def _run_folder(cfg: RecallConfig) -> str:
    """The folder of the run ``cfg``: ``cfg.out``; with ``resume`` and no ``out`` the newest default
    run of the task (``runs/<task>/latest``); else a new ``runs/<task>/<mixer>-<date>-<time>[-n]``,
    created here (two runs started in the same second get different folders), printed, and
    ``runs/<task>/latest`` pointed at it."""
    if cfg.out is not None:
        return cfg.out
    root = os.path.join(RUNS_ROOT, cfg.task)
    if cfg.resume:
        latest = read_latest(root)
        if latest is None:
            raise ValueError(f"RecallConfig.resume: no run of task {cfg.task!r} to resume ({os.path.join(root, LATEST)} "
                             f"names no run folder); name the run's folder with RecallConfig.out")
        print(f"resuming the latest {cfg.task} run: {latest}", file=sys.stderr, flush=True)
        return latest
    check_out_dir("RecallConfig.out", root)
    os.makedirs(root, exist_ok=True)
    base = f"{_folder_label(cfg)}-{time.strftime('%Y%m%d-%H%M%S')}"
    for i in range(1, 10_000):
        name = base if i == 1 else f"{base}-{i}"
        try:
            os.mkdir(os.path.join(root, name))
        except FileExistsError:
            continue
        _point_latest(root, name)
        out = os.path.join(root, name)
        print(f"run folder: {out} (also {os.path.join(root, LATEST)})", flush=True)
        return out
    raise RuntimeError(f"no free run folder name {base}-<n> in {root}")


def _files_under(path: str) -> List[str]:
    """The files under folder ``path`` (relative paths; empty folders do not count)."""
    out = []
    for d, _, files in os.walk(path):
        out.extend(os.path.relpath(os.path.join(d, f), path) for f in files)
    return sorted(out)


def _claim_folder(cfg: RecallConfig, out: str, ckpt_dir: str) -> None:
    """A fresh run's check of its folders: ``out`` and ``ckpt_dir`` must hold no files (no other
    run's results or checkpoints are ever replaced), unless ``cfg.overwrite``: then the old run's
    outputs (``config.json``, ``results.json``, ``curves.png``) and its orbax checkpoints go, and a
    checkpoint folder holding anything else is still refused."""
    held = [f for f in (_files_under(out) if os.path.isdir(out) else [])]
    ck_entries = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
    outside = os.path.relpath(os.path.abspath(ckpt_dir), os.path.abspath(out)).startswith("..")
    if not cfg.overwrite:
        if held:
            raise ValueError(f"RecallConfig.out={out!r} already holds files ({', '.join(held[:3])}"
                             f"{' ...' if len(held) > 3 else ''}): a run never replaces another run's results or "
                             f"checkpoints. Continue that run with RecallConfig.resume, replace it with "
                             f"RecallConfig.overwrite, or pick another RecallConfig.out (the default is a new folder)")
        if outside and ck_entries:
            raise ValueError(f"RecallConfig.ckpt_dir={ckpt_dir!r} already holds {sorted(ck_entries)[:3]}: a run never "
                             f"replaces another run's checkpoints. Continue that run with RecallConfig.resume, "
                             f"replace its checkpoints with RecallConfig.overwrite, or pick another RecallConfig.ckpt_dir")
        return
    foreign = sorted(e for e in ck_entries if not _CKPT_ENTRY.fullmatch(e))
    if foreign:
        raise ValueError(f"RecallConfig.ckpt_dir={ckpt_dir!r} holds files that are not checkpoints "
                         f"({foreign[:3]}{' ...' if len(foreign) > 3 else ''}); RecallConfig.overwrite replaces "
                         f"checkpoints only: use an empty or checkpoint-only folder, or RecallConfig.resume")
    gone = [os.path.join(ckpt_dir, e) for e in ck_entries] + [os.path.join(out, n) for n in _RUN_OUTPUTS
                                                              if os.path.isfile(os.path.join(out, n))]
    if gone:
        print(f"overwrite: removing the old run's {len(ck_entries)} checkpoint(s) in {ckpt_dir} and its outputs in "
              f"{out}", file=sys.stderr)
    for e in ck_entries:
        shutil.rmtree(os.path.join(ckpt_dir, e))
    for n in _RUN_OUTPUTS:
        if os.path.isfile(os.path.join(out, n)):
            os.remove(os.path.join(out, n))
    for d in _RUN_LOG_DIRS:  # the old run's logger files (RecallConfig.logger)
        if os.path.isdir(os.path.join(out, d)):
            shutil.rmtree(os.path.join(out, d))


def _newest_run(root: str, overrides: Dict[str, Any]) -> Optional[str]:
    """The newest default run folder in ``root`` (``<label>-<date>-<time>[-n]``) of the mixer that
    ``overrides`` names (its folder label, e.g. ``gdn`` or ``hybrid``), or None."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probe = RecallConfig(**{k: v for k, v in overrides.items() if k in ("mixer", "hybrid_every", "hybrid_mixer")})
    pattern = re.compile(re.escape(_folder_label(probe)) + r"-(\d{8}-\d{6})(?:-(\d+))?")
    found = []
    for n in os.listdir(root) if os.path.isdir(root) else []:
        m = pattern.fullmatch(n)
        if m and os.path.isdir(os.path.join(root, n)):
            found.append(((m.group(1), int(m.group(2) or 1)), n))
    return os.path.abspath(os.path.join(root, max(found)[1])) if found else None


def find_run(path: str) -> str:
    """The run folder that ``path`` names: a run's folder itself, a ``latest`` pointer, or a task
    folder ``runs/<task>`` (its ``latest`` run).

    Raises:
      FileNotFoundError: ``path`` names no folder or no run folder can be found from it.
    """
    p = os.fspath(path)
    if os.path.isfile(p) and os.path.basename(p) == LATEST:  # the text-file pointer itself
        found = read_latest(os.path.dirname(p) or ".")
        if found:
            return found
    if not os.path.isdir(p):
        raise FileNotFoundError(f"no run folder at {p!r}")
    if _saved_config(p) is None:
        latest = read_latest(p)
        if latest is not None:
            return latest
    return p


def _checkpoint_meta(ckpt_dir: str) -> Optional[Dict[str, Any]]:
    """The JSON metadata of the newest finished checkpoint in ``ckpt_dir`` (its ``meta`` item), or None."""
    try:
        steps = sorted((int(e) for e in os.listdir(ckpt_dir) if e.isdigit()), reverse=True)
    except OSError:
        return None
    for st in steps:
        try:
            with open(os.path.join(ckpt_dir, str(st), "meta", "metadata")) as f:
                return json.load(f)
        except (OSError, ValueError):
            continue
    return None


def _saved_config(folder: str) -> Optional[Dict[str, Any]]:
    """The config a run saved in ``folder``: ``config.json``, else ``results.json``'s, else its newest
    checkpoint's (runs from before ``config.json``); None when the folder holds no run."""
    for name, key in ((CONFIG_FILE, None), ("results.json", "config")):
        try:
            with open(os.path.join(folder, name)) as f:
                d = json.load(f)
            return d if key is None else d[key]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    meta = _checkpoint_meta(os.path.join(folder, "ckpt"))
    return meta.get("config") if meta else None


def saved_config(path: str) -> RecallConfig:
    """The :class:`RecallConfig` of the run in ``path`` (:func:`find_run`), as saved (``out`` set to the
    folder found; ``resume`` and ``overwrite`` False). Fields the saved record lacks (older runs) keep
    their defaults; fields it has that this version lacks are dropped.

    Raises:
      FileNotFoundError: no run in ``path``.
    """
    folder = find_run(path)
    d = _saved_config(folder)
    if d is None:
        raise FileNotFoundError(f"no run in {folder!r} (no {CONFIG_FILE}, results.json or checkpoint)")
    names = {f.name for f in dataclasses.fields(RecallConfig)}
    kw = {k: (None if v is None else v) for k, v in d.items() if k in names}
    kw.update(out=folder, resume=False, overwrite=False)
    return RecallConfig(**kw)


def resume_config(path: Optional[str], overrides: Optional[Dict[str, Any]] = None, *,
                  task: str = "mqar") -> RecallConfig:
    """The config that continues the run in ``path`` (a run folder, its ``latest`` pointer, or None:
    ``runs/<task>/latest``): the run's saved config with ``overrides`` (e.g. the flags given on the
    command line) applied, ``resume=True``.

    An override may change a field of :data:`RESUME_FREE_FIELDS` (``max_steps``, ``eval_every``,
    ``backend``, ...); any other must equal the saved value.

    Raises:
      ValueError: overrides that conflict with the saved run (every one named, ``RecallConfig.field``),
        or no run to resume.
    """
    overrides = dict(overrides or {})
    if path is None:
        root = os.path.join(RUNS_ROOT, overrides.get("task", task))
        path = _newest_run(root, overrides) if "mixer" in overrides else read_latest(root)
        if path is None:
            raise ValueError(f"RecallConfig.resume: no run to resume ({os.path.join(root, LATEST)} names no run "
                             f"folder); name the run's folder with RecallConfig.out")
    try:
        saved = saved_config(path)
    except FileNotFoundError as e:
        raise ValueError(f"RecallConfig.resume: {e}") from None
    probe = dataclasses.replace(RecallConfig(), **{k: v for k, v in overrides.items() if k not in ("out",)})
    conflicts = []
    for k in overrides:
        if k in RESUME_FREE_FIELDS:
            continue
        if getattr(probe, k) != getattr(saved, k):
            conflicts.append(f"RecallConfig.{k}={getattr(probe, k)!r} (the run has {getattr(saved, k)!r})")
    if conflicts:
        raise ValueError(f"RecallConfig.resume: the run in {saved.out} was trained with other settings: "
                         f"{'; '.join(conflicts)}. Leave them out (they are read from its {CONFIG_FILE}) or start a "
                         f"new run without RecallConfig.resume")
    free = {k: v for k, v in overrides.items() if k in RESUME_FREE_FIELDS}
    return dataclasses.replace(saved, **{**free, "out": saved.out, "resume": True, "overwrite": False})


@dataclasses.dataclass
class LoadedRun:
    """A finished or interrupted run read back by :func:`load_run`.

    Attributes:
      config: the run's :class:`RecallConfig`.
      model: the :class:`gdn_jax.models.LM` with the parameters of checkpoint ``step``.
      step: the training step of those parameters.
      history: ``{"train": [[step, loss, accuracy], ...], "evals": [{"step", "loss", "test_loss",
        "test_accuracy", "wall_s"}, ...]}``.
      results: the run's ``results.json`` record, or None when the run is unfinished.
      path: the run's folder.
    """

    config: RecallConfig
    model: LM
    step: int
    history: Dict[str, Any]
    results: Optional[Dict[str, Any]]
    path: str


def load_run(path: str, params: Literal["best", "last"] = "best") -> LoadedRun:
    """Read a run back: its config, the model with the ``best`` (the checkpoint of the highest test
    accuracy; ``keep_best_checkpoint`` keeps it on disk) or ``last`` (the newest checkpoint)
    parameters, and its history.

    Args:
      path: the run's folder (``out``), a ``latest`` pointer, or a task folder ``runs/<task>`` (its
        newest run).
      params: ``"best"`` or ``"last"``.

    Returns:
      :class:`LoadedRun`. With ``"best"``, when the best evaluation's checkpoint is not on disk (a run
      with ``keep_best_checkpoint=False``), the best of the checkpoints kept, with a warning.

    Raises:
      ValueError: ``params`` not ``"best"``/``"last"``.
      FileNotFoundError: no run, or no checkpoint, in ``path``.
    """
    if params not in ("best", "last"):
        raise ValueError(f"params must be 'best' or 'last', got {params!r}")
    cfg = saved_config(path)
    folder = os.path.realpath(find_run(path))  # the run's own folder, also when named through ``latest``
    cfg = dataclasses.replace(cfg, out=folder)
    ckpt_dir = cfg.ckpt_dir or os.path.join(folder, "ckpt")
    results = None
    try:
        with open(os.path.join(folder, "results.json")) as f:
            results = json.load(f)
    except (OSError, ValueError):
        pass
    _, _, _, model_fn, tx = build(cfg)
    mesh = T.make_mesh()
    graphdef, abstract = T.abstract_train_state(model_fn, tx, mesh=mesh)
    ck = T.Checkpointer(ckpt_dir, max_to_keep=None)
    try:
        steps = sorted(ck.all_steps())
        if not steps:
            raise FileNotFoundError(f"no checkpoint of the run in {ckpt_dir!r}")
        meta = (_checkpoint_meta(ckpt_dir) or {}) if results is None else {}
        history = ({"train": results["train_curve"], "evals": results["evals"]} if results is not None
                   else meta.get("history", {"train": [], "evals": []}))
        step = steps[-1]
        if params == "best" and history["evals"]:
            acc = {e["step"]: e["test_accuracy"] for e in history["evals"]}
            best = max(history["evals"], key=lambda e: (e["test_accuracy"], e["step"]))["step"]
            kept = [s for s in steps if s in acc]
            if best in steps:
                step = best
            elif kept:
                step = max(kept, key=lambda s: (acc[s], s))
                warnings.warn(f"load_run: the best evaluation (step {best}) has no checkpoint in {ckpt_dir}; "
                              f"using the best one kept (step {step})", stacklevel=2)
        state, _ = ck.restore(step, abstract)
    finally:
        ck.close()
    return LoadedRun(config=cfg, model=T.merge_model(graphdef, state), step=int(step), history=history,
                     results=results, path=folder)


def live_progress(bar_cls) -> bool:
    """A progress bar of ``bar_cls`` (``tqdm.auto.tqdm``) is seen live: a notebook's widget, or
    tqdm's text bar on a stderr that is a terminal (not a log file or a pipe)."""
    if any(c.__module__ == "tqdm.notebook" for c in bar_cls.__mro__):
        return True  # the notebook widget (tqdm.auto in Jupyter): no '\r' lines anywhere
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError, OSError):  # a closed or replaced stream
        return False


class _Run:
    """One call of :func:`run`: the state its steps share (setup here, then :meth:`restore_or_init`,
    :meth:`train`, :meth:`finish`, :meth:`results` and :meth:`write_outputs`)."""

    def __init__(self, cfg: RecallConfig):
        self.cfg = cfg
        self.stop = cfg.max_steps if cfg.max_steps is not None else cfg.steps
        self.task, self.loader, _, self.model_fn, self.tx = build(cfg)  # validates cfg (out, ckpt_dir too)
        self.mesh = make_run_mesh(cfg)
        self.n_dev = self.mesh.size
        n_data = self.mesh.shape["data"]
        for name in ("batch_size", "eval_batch_size"):
            if getattr(cfg, name) % n_data:
                where = (f"{n_data} devices of the data axis ({self.n_dev} devices / RecallConfig.context_parallel "
                         f"{cfg.context_parallel})" if cfg.context_parallel > 1 else f"{n_data} devices")
                raise ValueError(f"RecallConfig.{name}={getattr(cfg, name)} is not divisible by the {where}")
        self.out = _run_folder(cfg)  # a new runs/<task>/<mixer>-<time> by default (claimed, latest -> it)
        self.ckpt_dir = cfg.ckpt_dir or os.path.join(self.out, "ckpt")
        check_out_dir("RecallConfig.out", self.out)
        if not cfg.resume:
            _claim_folder(cfg, self.out, self.ckpt_dir)  # refuses another run's files unless overwrite
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, CONFIG_FILE), "w") as f:  # what --resume and load_run read back
            json.dump(_finite_json(dict(dataclasses.asdict(cfg), out=self.out)), f, indent=1)
        self.ckpt = T.Checkpointer(self.ckpt_dir, max_to_keep=cfg.keep_checkpoints,
                                   best_metric="test_accuracy" if cfg.keep_best_checkpoint else None)
        self.history: Dict[str, Any] = {"train": [], "evals": []}
        self.wall_before = 0.0
        self.resumed = False
        self.pending: List[Dict[str, jax.Array]] = []  # train metrics of steps since the last log point
        self.staged: List[Tuple[int, Dict[str, jax.Array]]] = []  # stacked on the device, not yet fetched
        self.since_eval: List[float] = []  # train losses since the last evaluation
        self.eval_s = 0.0  # time in evaluations (incl. their compile) this session
        self.ckpt_s = 0.0  # time in checkpoint saves (orbax: device->host copy, then async write) this session
        self.data_wait_s = 0.0  # time the loop waited for its next batch this session
        self.fetch_s = 0.0  # time spent fetching train metrics to the host this session
        self.first_step_s: Optional[float] = None
        self.stopped_by_time = self.diverged = False
        self.interrupted: Optional[str] = None  # "session_time" or "sigint": checkpointed, unfinished
        self.sigint = False  # a Ctrl-C arrived during train()
        self.eval_lines = False  # a line per evaluation on stderr (progress on, no live bar: train())
        self.logger: Logger = Logger()  # RecallConfig.logger and run()'s loggers (open_logger); no-op until then
        self.lr_at = None  # step -> learning rate, for the loggers

    def open_logger(self, extra: Sequence[Logger] = ()) -> None:
        """``self.logger``: the ``RecallConfig.logger`` (TensorBoard in ``<out>/tb``, W&B in
        ``<out>/wandb``, its run id fixed by the output folder so that a resumed session continues
        it) and the ``extra`` loggers (e.g. a sweep's progress bar)."""
        cfg = self.cfg
        loggers = list(extra)
        if cfg.logger != "none":
            import hashlib

            out = os.path.abspath(self.out)
            loggers.append(make_logger(
                cfg.logger, logdir=os.path.join(out, "tb") if cfg.logger == "tensorboard" else out,
                config=dataclasses.asdict(cfg), project=cfg.wandb_project, group=cfg.wandb_group,
                name=f"{cfg.task} {mixer_label(cfg)} d={cfg.d_model} lr={cfg.lr:g} seed={cfg.seed}",
                run_id=hashlib.sha1(out.encode()).hexdigest()[:16]))
        if loggers:
            self.logger = loggers[0] if len(loggers) == 1 else MultiLogger(loggers)
            schedule = T.make_schedule(cfg.lr, warmup_steps=cfg.warmup, total_steps=cfg.steps,
                                       min_lr_ratio=cfg.min_lr_ratio,
                                       steps_per_epoch=self.loader.steps_per_epoch if cfg.lr_per_epoch else None)
            self.lr_at = lambda step: float(schedule(max(step - 1, 0)))  # the rate of the point's last step

    # -- restore or init ----------------------------------------------------------------------------

    def restore_or_init(self) -> None:
        """The latest checkpoint (``resume``; with its history and wall time) or a fresh train state;
        then the jitted train/eval steps (sparse LM head where the task has few labels) and the test set."""
        cfg = self.cfg
        restored = None
        if cfg.resume:
            self.graphdef, abstract = T.abstract_train_state(self.model_fn, self.tx, mesh=self.mesh)
            try:
                restored = self.ckpt.restore_latest(abstract)
            except ValueError as e:  # orbax: saved tree does not match this model
                raise ValueError(
                    f"RecallConfig.resume: the checkpoint in {self.ckpt_dir} does not match this run's "
                    f"model/optimizer (saved with other settings, e.g. another RecallConfig.mixer, "
                    f"RecallConfig.d_model or RecallConfig.num_layers?). Use the original settings, another "
                    f"RecallConfig.out/RecallConfig.ckpt_dir, or drop RecallConfig.resume. "
                    f"({str(e).splitlines()[0]})") from None
            if restored is None:
                print(f"--resume: no checkpoint in {self.ckpt_dir}; starting from scratch", file=sys.stderr)
        if restored is not None:
            self.state, meta = restored
            self.resumed = True
            self.history = meta.get("history", self.history)
            self.wall_before = float(meta.get("wall_s", 0.0))
            # a session suspended between log points: its train losses since the last evaluation and
            # the metrics of the steps since the last log point, as if it had not stopped
            self.since_eval = [float(x) for x in meta.get("since_eval", [])]
            self.pending = [{k: jax.numpy.asarray(v, jax.numpy.float32 if k != "unscored" else jax.numpy.int32)
                             for k, v in m.items()} for m in meta.get("pending", [])]
            old = meta.get("config", {})
            diff = {k: (old[k], v) for k, v in dataclasses.asdict(cfg).items()
                    if k in old and old[k] != v and k not in RESUME_FREE_FIELDS}
            if diff:
                print(f"warning: resuming with changed settings {diff}", file=sys.stderr)
        else:
            self.graphdef, self.state = T.create_train_state(self.model_fn(), self.tx, seed=cfg.seed, mesh=self.mesh)
        self.start = self.step = int(jax.device_get(self.state.step))
        if restored is not None:
            print(f"resumed from step {self.start} ({self.ckpt_dir})", file=sys.stderr)
        # sparse LM head: logits only where something is scored (with sequences split over devices the
        # dense head: make_eval_step takes no max_scored there; the loss and accuracy are the same)
        n_labels = self.task.max_labels if cfg.context_parallel == 1 else None
        # compiled once per process for runs of the same model, optimizer settings and devices (the
        # learning rate is an argument): a sweep's rates and seeds reuse them (gdn_jax.step_cache)
        self.train_step, self.eval_step = shared_steps(self.graphdef, self.mesh, lr=cfg.lr, max_scored=n_labels,
                                                       optimizer=optimizer_settings(cfg, self.loader))
        self.test_set = make_test_set(self.task)
        self.test_batches = T.device_eval_batches(self.test_set, batch_size=cfg.eval_batch_size, mesh=self.mesh)

    # -- train loop ---------------------------------------------------------------------------------

    def wall(self) -> float:
        """Wall time of the run so far (earlier sessions included)."""
        return self.wall_before + time.perf_counter() - self.t0

    def stage(self) -> None:
        """Stack the pending train metrics on the device (asynchronous: no host sync) for one
        train-curve point at the current step; :meth:`fetch` brings them to the host later."""
        if not self.pending:
            return
        keys = ("loss", "accuracy", "unscored")
        stacked = {k: jax.numpy.stack([m[k] for m in self.pending]) for k in keys if k in self.pending[0]}
        self.staged.append((self.step, stacked))
        self.pending.clear()

    def fetch(self, keep: int = 0) -> Optional[Tuple[float, float]]:
        """Fetch all staged train-curve points but the newest ``keep`` (those whose steps have long
        finished, so that the device queue never drains for a log line); returns the last fetched
        point's (loss, accuracy)."""
        if len(self.staged) <= keep:
            return None
        t = time.perf_counter()
        todo, self.staged = self.staged[:len(self.staged) - keep], self.staged[len(self.staged) - keep:]
        vals = jax.device_get([v for _, v in todo])
        self.fetch_s += time.perf_counter() - t
        la = None
        for (step, _), v in zip(todo, vals):
            if int(np.max(v.get("unscored", 0))):
                raise RuntimeError(f"training batches have more labels per row than max_labels={self.task.max_labels}")
            la = float(np.mean(v["loss"])), float(np.mean(v["accuracy"]))
            self.history["train"].append([step, *la])
            if self.lr_at is not None:
                self.logger.log({"train/loss": la[0], "train/accuracy": la[1], "train/lr": self.lr_at(step)}, step)
            self.since_eval.extend(float(x) for x in np.ravel(v["loss"]))
        return la

    def flush(self) -> Optional[Tuple[float, float]]:
        """Stage the pending train metrics and fetch everything staged (a host sync: before an
        evaluation, a checkpoint and at the end); (loss, accuracy) of the last point."""
        self.stage()
        return self.fetch()

    def batches(self):
        """``(step, batch on the devices)`` from the current step to ``stop``: fixed data from the
        device-resident set (:class:`gdn_jax.training.DeviceFixedLoader`, ``device_data``), else the
        loader's batches made and copied in a background thread (:func:`gdn_jax.training.prefetch_batches`)."""
        steps = range(self.start, self.stop)
        if self.cfg.data_mode == "fixed" and self.cfg.device_data:
            # the set's copy to the devices and the gather's compile happen here, once, not in the loop
            dl = T.DeviceFixedLoader(self.loader, self.mesh)
            first = jax.block_until_ready(dl.batch(self.start)) if len(steps) else None
            return ((s, first if s == self.start else dl.batch(s)) for s in steps)
        # numpy's generators release the GIL: up to 4 threads where the host has the cores (H200
        # host, MQAR L 512: one thread makes ~240 batches/s against ~206 steps/s of the step)
        workers = max(2, min(4, (os.cpu_count() or 2) // 2))
        return T.prefetch_batches(self.loader.batch, steps, self.mesh, workers=workers)

    def train(self) -> None:
        """Train from the current step to ``stop``: evaluate every ``eval_every`` steps; stop early at
        ``target_accuracy``, on a non-finite loss (``diverged``) or past ``max_time_s``."""
        from tqdm.auto import tqdm

        cfg, history = self.cfg, self.history
        done = bool(history["evals"]) and history["evals"][-1]["test_accuracy"] >= cfg.target_accuracy
        batches = self.batches() if not done else iter(())  # one-off data setup: before the clock starts
        self.t0 = time.perf_counter()
        # the bar where it is seen live (a terminal, a notebook); in a log (stderr not a terminal) its
        # redrawn '\r' lines would pile up: one line per evaluation instead (evaluate)
        live = cfg.progress and live_progress(tqdm)
        self.eval_lines = cfg.progress and not live
        bar = tqdm(total=self.stop, initial=min(self.start, self.stop), disable=not live,
                   dynamic_ncols=True, desc=f"{cfg.task} {mixer_label(cfg)}")
        # Ctrl-C (SIGINT) stops at the end of the step in flight and run() checkpoints it; a second
        # Ctrl-C aborts at once (no checkpoint). Only the main thread can take signals.
        sigint: List[bool] = []
        previous = None
        if threading.current_thread() is threading.main_thread():
            def on_sigint(signum, frame):
                if sigint:
                    raise KeyboardInterrupt
                sigint.append(True)
                print(f"\n{cfg.task} {mixer_label(cfg)}: interrupted; checkpointing after this step (Ctrl-C again "
                      f"to abort without a checkpoint)", file=sys.stderr, flush=True)
            previous = signal.signal(signal.SIGINT, on_sigint)
        try:
            while True:
                t_wait = time.perf_counter()
                nxt = next(batches, None)
                if nxt is None:
                    break
                s, batch = nxt
                t_step = time.perf_counter()
                self.data_wait_s += t_step - t_wait
                self.state, metrics = self.train_step(self.state, batch)
                if self.first_step_s is None:
                    jax.block_until_ready(metrics)
                    self.first_step_s = time.perf_counter() - t_step
                self.pending.append(metrics)
                self.step = s + 1
                bar.update(1)
                if self._after_step(bar):
                    break
                if sigint and self.step < self.stop:  # at the last step the run finishes instead
                    self.interrupted = "sigint"
                    break
        finally:
            self.sigint = bool(sigint)  # also when the step that ended the run saw the Ctrl-C
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            if hasattr(batches, "close"):
                batches.close()
            if not bar.disable and not self.interrupted and bar.n < bar.total:
                bar.total = bar.n  # stopped early (target, divergence, max_time_s): the bar ends at its last step
                bar.refresh()
            bar.close()

    def _after_step(self, bar) -> bool:
        """Log, evaluate and decide after a step; True: stop training."""
        cfg, history, step = self.cfg, self.history, self.step
        out_of_time = cfg.max_time_s is not None and self.wall() > cfg.max_time_s
        is_eval = step % cfg.eval_every == 0
        if step % cfg.log_every == 0 or is_eval or step == self.stop:
            self.stage()
            la = self.flush() if is_eval or step == self.stop else self.fetch(keep=1)
            if la is not None:
                bar.set_postfix(loss=f"{la[0]:.3f}", acc=f"{la[1]:.3f}",
                                test=f"{history['evals'][-1]['test_accuracy']:.3f}" if history["evals"] else "-")
        is_eval = is_eval or self._near_target(step)
        # after the log point (a stop on a log step used to leave its metrics to the resumed run's next
        # point, merging two curve points); an evaluation step evaluates first, the last step finishes
        if (cfg.session_time_s is not None and time.perf_counter() - self.t0 > cfg.session_time_s and not is_eval
                and step < self.stop):
            self.interrupted = "session_time"  # run() checkpoints; the run stays unfinished (a resume continues it)
            return True
        if is_eval:
            rec = self.evaluate()
            bar.set_postfix(loss=f"{history['train'][-1][1]:.3f}", acc=f"{history['train'][-1][2]:.3f}",
                            test=f"{rec['test_accuracy']:.3f}")
            if rec["test_accuracy"] >= cfg.target_accuracy:
                return True
            if not (math.isfinite(rec["test_loss"]) and (rec["loss"] is None or math.isfinite(rec["loss"]))):
                self.diverged = True  # NaN/inf loss: further steps cannot recover
                print(f"{cfg.task} {mixer_label(cfg)} lr={cfg.lr:g}: loss is not finite at step {step}; "
                      f"stopping (diverged)", file=sys.stderr)
                return True
        if out_of_time:
            self.stopped_by_time = True
            return True
        return False

    def _near_target(self, step: int) -> bool:
        """An extra evaluation at this log point: the newest train-curve point reached
        ``target_accuracy`` and ``eval_every_near_target`` steps passed since the last evaluation (a
        run stops close to the step it reaches the target, not at the next ``eval_every``)."""
        cfg, history = self.cfg, self.history
        n = cfg.eval_every_near_target
        if not n or step % cfg.log_every or not history["train"] or history["train"][-1][2] < cfg.target_accuracy:
            return False
        last = history["evals"][-1]["step"] if history["evals"] else 0
        return step - last >= n

    # -- evaluation ---------------------------------------------------------------------------------

    def evaluate(self) -> Dict[str, Any]:
        """Test loss and accuracy at the current step (appended to the history), then a checkpoint."""
        step = self.step
        self.flush()
        t_eval = time.perf_counter()
        ev = T.evaluate(self.eval_step, self.state, batches=self.test_batches)
        rec = {"step": step, "loss": float(np.mean(self.since_eval)) if self.since_eval else None,
               "test_loss": ev["loss"], "test_accuracy": ev["accuracy"], "wall_s": round(self.wall(), 3)}
        self.since_eval.clear()
        self.history["evals"].append(rec)
        if self.lr_at is not None:
            test = {"test/loss": rec["test_loss"], "test/accuracy": rec["test_accuracy"]}
            if self.task.metric == "scaled_accuracy":
                test["test/scaled_accuracy"] = scaled_accuracy(rec["test_accuracy"], self.task.chance)
            self.logger.log(test, step)
        self.eval_s += time.perf_counter() - t_eval
        if self.eval_lines:
            cfg, tr = self.cfg, self.history["train"]
            train = f"loss {tr[-1][1]:.4f} acc {tr[-1][2]:.4f}, " if tr else ""
            print(f"{cfg.task} {mixer_label(cfg)} step {step}/{self.stop}: {train}test loss {rec['test_loss']:.4f} "
                  f"acc {rec['test_accuracy']:.4f} ({rec['wall_s']:.0f} s)", file=sys.stderr, flush=True)
        self.save()
        return rec

    def save(self, pending: Optional[List[Dict[str, float]]] = None) -> None:
        """A checkpoint of the current state (with the history, the train losses since the last
        evaluation, ``pending`` per-step metrics not yet in a train-curve point, and the wall time),
        timed in ``ckpt_s``."""
        cfg, step = self.cfg, self.step
        t = time.perf_counter()
        evals = self.history["evals"]
        metrics = {"test_accuracy": evals[-1]["test_accuracy"]} if evals and evals[-1]["step"] == step else None
        self.ckpt.save(self.state, {"config": dataclasses.asdict(cfg), "history": self.history, "wall_s": self.wall(),
                                    "loader_step": step, "data_mode": cfg.data_mode,
                                    "since_eval": list(self.since_eval), "pending": pending or []}, step=step,
                       metrics=metrics)
        self.ckpt_s += time.perf_counter() - t

    def suspend(self) -> Dict[str, Any]:
        """End an interrupted session (``session_time_s`` spent, or Ctrl-C): fetch the metrics,
        checkpoint the current step, write no results.json; returns a short record (``interrupted: True``)."""
        self.fetch()  # the finished train-curve points; the steps since the last one stay per step:
        pending = [{k: v.item() for k, v in m.items()} for m in jax.device_get(self.pending)]
        self.save(pending)  # a resumed run makes the same curve points and evaluation losses
        self.ckpt.close()
        why = (f"session time {self.cfg.session_time_s:g} s used" if self.interrupted == "session_time"
               else "interrupted")
        print(f"{self.cfg.task} {mixer_label(self.cfg)} d={self.cfg.d_model} lr={self.cfg.lr:g}: {why}; checkpointed "
              f"at step {self.step} in {self.ckpt.directory} (resume to continue)", file=sys.stderr, flush=True)
        return {"interrupted": True, "steps": self.step, "out": os.path.abspath(self.out),
                "ckpt_dir": self.ckpt.directory, "wall_s": round(self.wall(), 3)}

    def finish(self) -> None:
        """The last train-curve point and, unless the last step was just evaluated, a final evaluation."""
        self.flush()
        if not self.history["evals"] or self.history["evals"][-1]["step"] != self.step:
            self.evaluate()
        t = time.perf_counter()
        self.ckpt.close()  # waits for the last asynchronous write: checkpoint time too
        self.ckpt_s += time.perf_counter() - t
        self.train_wall = time.perf_counter() - self.t0

    # -- outputs ------------------------------------------------------------------------------------

    def results(self) -> Dict[str, Any]:
        """The ``results.json`` record of the run (README "Experiments and results")."""
        cfg, evals, task = self.cfg, self.history["evals"], self.task
        final, best = evals[-1], max(e["test_accuracy"] for e in evals)
        backends = resolved_backends(T.merge_model(self.graphdef, self.state))
        ran, wall, first = self.step - self.start, self.train_wall, self.first_step_s
        busy = wall - self.eval_s - self.ckpt_s

        def rate(busy: float):  # steps/s after the first (compile) step over ``busy`` seconds
            return round((ran - 1) / (busy - first), 2) if first is not None and ran > 1 and busy > first else None

        return {
            "config": dataclasses.asdict(cfg),
            "jax_version": jax.__version__,
            "platform": jax.default_backend(),
            "backend_requested": cfg.backend,
            "backend_resolved": sorted(set(backends)) if backends else None,
            "device_kind": jax.devices()[0].device_kind,
            "num_devices": self.n_dev,
            "mesh_shape": {str(k): int(v) for k, v in self.mesh.shape.items()},
            "evals": evals,
            "eval_columns": ["step", "loss", "test_loss", "test_accuracy", "wall_s"],
            "task": cfg.task,
            "chance": task.chance,
            "final_test_accuracy": final["test_accuracy"],
            "best_test_accuracy": best,
            "final_scaled_accuracy": scaled_accuracy(final["test_accuracy"], task.chance),
            "best_scaled_accuracy": scaled_accuracy(best, task.chance),
            "reached_target": final["test_accuracy"] >= cfg.target_accuracy,
            "stopped_by_time": self.stopped_by_time,
            "diverged": self.diverged,
            "steps": self.step,
            "resumed_from": self.start if self.resumed else None,
            "wall_s": round(self.wall_before + wall, 3),
            "session_wall_s": round(wall, 3),
            "first_step_s": None if first is None else round(first, 3),
            "steps_per_s": rate(wall),
            "eval_s": round(self.eval_s, 3),
            "ckpt_s": round(self.ckpt_s, 3),
            "data_wait_s": round(self.data_wait_s, 3),
            "metrics_fetch_s": round(self.fetch_s, 3),
            "train_steps_per_s": rate(busy),
            "num_params": int(sum(np.size(x) for x in jax.tree.leaves(self.state.params))),
            "train_curve": self.history["train"],
            "out": os.path.abspath(self.out),
            "ckpt_dir": self.ckpt.directory,
        }

    def write_outputs(self, results: Dict[str, Any]) -> None:
        """``results.json`` (strict JSON: NaN/inf as null), ``curves.png`` and a one-line summary."""
        cfg, out = self.cfg, self.out
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(_finite_json(results), f, indent=1, allow_nan=False)
        plot_curves(os.path.join(out, "curves.png"), self.history, cfg.target_accuracy)
        print(f"{cfg.task} {mixer_label(cfg)} d={cfg.d_model} {self.task.label} lr={cfg.lr:g}: "
              f"test_acc={results['final_test_accuracy']:.4f} (best {results['best_test_accuracy']:.4f}) at step "
              f"{self.step}{' [target reached]' if results['reached_target'] else ''}, wall {results['wall_s']:.1f}s, "
              f"backend={','.join(results['backend_resolved'] or ['-'])} on {self.n_dev}x {results['device_kind']} "
              f"-> {os.path.join(out, 'results.json')}", flush=True)


def run(cfg: RecallConfig, *, loggers: Sequence[Logger] = ()) -> Tuple[Dict[str, Any], T.TrainState]:
    """Train (or resume) according to ``cfg``; write results.json, curves.png and checkpoints.

    Returns ``(results, final TrainState)``. Timing fields of ``results`` (this session):
    ``first_step_s`` (the first step, compile included), ``steps_per_s`` (the other steps over
    the rest of the wall time, evaluations and checkpoint saves included), ``eval_s`` (time in
    evaluations, their compile included), ``ckpt_s`` (checkpoint saves: orbax copies the state to
    the host, then writes asynchronously; the wait for the last write included), ``train_steps_per_s`` (the same steps over the wall time
    without ``eval_s`` and ``ckpt_s``), ``data_wait_s`` (the loop waiting for its next batch) and
    ``metrics_fetch_s`` (train metrics fetched to the host, one log interval late so that the
    device queue does not drain).

    With ``session_time_s`` a session that runs out of time checkpoints its step and returns
    ``({"interrupted": True, "steps": ..., ...}, state)`` without writing results.json: the run is
    unfinished, and a ``resume`` continues it (:mod:`gdn_jax.sweep` runs a grid in pieces so).
    Ctrl-C (SIGINT, in the main thread) does the same at the end of the step in flight, then raises
    ``KeyboardInterrupt`` (its message names the checkpoint; a Ctrl-C in the step that ends the run
    lets it finish and write its results first); a second Ctrl-C aborts without a new checkpoint
    (a checkpoint write in flight completes). A resumed run's history (train curve, evaluation
    losses) is the uninterrupted run's: the per-step metrics since the last curve point and the
    losses since the last evaluation travel in the checkpoint.

    Raises:
      ValueError, TypeError: a bad setting (:func:`build`), a batch size not divisible by the devices,
        a fresh run's ``out`` / ``ckpt_dir`` that holds files (without ``overwrite``), ``resume``
        without ``out`` and no ``runs/<task>/latest``, or a ``resume`` checkpoint that does not match
        the model; messages name ``RecallConfig`` fields.
    """
    r = _Run(cfg)
    r.restore_or_init()
    r.open_logger(loggers)
    try:
        return _train_and_report(r)
    finally:
        r.logger.close()


def _train_and_report(r: _Run) -> Tuple[Dict[str, Any], T.TrainState]:
    """:func:`run` after the restore: train, then suspend (interrupted) or finish and write the outputs."""
    try:
        r.train()
    except KeyboardInterrupt:  # a second Ctrl-C: no new checkpoint, but a write in flight completes
        r.ckpt.close()
        raise
    if r.interrupted:
        rec = r.suspend()
        if r.interrupted == "sigint":  # the caller is interrupted too, once the step is safe on disk
            raise KeyboardInterrupt(f"checkpointed at step {rec['steps']} in {rec['ckpt_dir']}; resume to continue")
        return rec, r.state
    r.finish()
    done = os.path.join(r.out, "results.json")
    if r.resumed and r.step == r.start and os.path.isfile(done):
        # nothing trained in this session (the run had finished): its record, timings included, stays as it is
        with open(done) as f:
            results = json.load(f)
        print(f"the run in {os.path.abspath(r.out)} had finished at step {r.step}: nothing to train, its "
              f"results.json is kept (raise RecallConfig.max_steps to train on)", flush=True)
        return results, r.state
    results = r.results()
    r.logger.log_summary(results)
    r.write_outputs(results)
    if r.sigint:  # Ctrl-C in the run's last step: it finished and wrote its results; stop the caller
        raise KeyboardInterrupt(f"the run finished at step {r.step} (results in {os.path.abspath(r.out)})")
    return results, r.state
