"""Grid sweeps of :func:`gdn_jax.recall.run`: (mixer, d_model, sequence length, kv pairs, learning
rate[, beta range]) -> a table of the best learning rate per cell and Zoology-style plots.

A *cell* is one (task, mixer, d_model, seq_len, num_kv_pairs, neg_eigval) point of the grid; each
cell trains once per learning rate in ``lrs`` (in that order; with ``skip_lrs_after_target`` the
remaining rates are skipped once one run reaches ``target_accuracy``) and keeps the run with the best
test accuracy. Runs write ``<out>/runs/<cell>/lr<lr>/results.json`` (plus their orbax checkpoints).
With ``seeds`` every (cell, rate) trains once per seed, in ``<out>/runs/<cell>/lr<lr>_seed<s>/``, and
the summaries report the mean ± standard deviation over the seeds (docs/loggers_and_sweeps.md):

* **resumable** -- a run whose ``results.json`` exists is skipped; an interrupted run resumes from its
  last checkpoint (taken at every evaluation). With ``time_budget_s`` the sweep stops by itself
  before that budget is spent: the run in progress checkpoints its current step (no results.json)
  and no new run starts, so the same command run again picks the grid up where it stopped, cell
  by cell, run by run and step by step (a grid run in pieces of one device call each);
* **several devices** -- with more than one local GPU/TPU (or ``workers > 1``) the sweep starts one
  worker process per device (``CUDA_VISIBLE_DEVICES``/``TPU_VISIBLE_CHIPS`` set to one device each,
  taken from the sweep's own list when it has one: ``CUDA_VISIBLE_DEVICES=1,2,3`` leaves device 0 free;
  ``workers_per_device > 1``: that many per device, each with its share of the device memory -- small
  models leave an H200 mostly idle, so several runs at once raise the throughput); workers claim
  cells through lock files, so cells are spread dynamically (``lrs_in_parallel``: single (cell,
  learning rate) runs, so one cell's rates train at once; a rate not started when another reached the
  target is skipped, a started one finishes);
* **progress** -- a tqdm bar over cells; in one process its postfix shows the run in flight (cell,
  rate, step, train loss / accuracy, test accuracy) at every train-curve point;
* **one compilation per shape** -- the runs of a process with the same model, optimizer settings but
  the rate, and devices share their compiled steps (:mod:`gdn_jax.step_cache`);
* **loggers** -- ``logger`` sends every run's metrics to TensorBoard or W&B (:mod:`gdn_jax.loggers`).

At the end :func:`summarize` writes ``runs.csv`` (one row per run), ``summary.csv`` and
``summary.json`` (the best learning rate of each cell) and ``accuracy_vs_dmodel.png`` (test accuracy,
or scaled accuracy for state tracking, against d_model: one panel per (seq_len, num_kv_pairs), one
line per mixer) and, with several learning rates, ``accuracy_vs_lr.png`` (every run against its
learning rate, one panel per (seq_len, num_kv_pairs, d_model)).

Mixer names are those of :data:`gdn_jax.models.MIXERS` plus ``"hybrid"``: GDN layers with every 4th
layer Qwen3-Next gated attention (3:1), at ``max(num_layers, 4)`` layers.

Which grid axes a task uses, a cell's name and the headline metric come from the task's config
(:data:`gdn_jax.data.TASK_CONFIGS`: the ``seq_len`` / ``num_kv_pairs`` fields it has, its ``metric``).
Bad settings raise ``ValueError`` naming the field (``SweepConfig.lrs``, ``RecallConfig.steps``);
``experiments/sweep.py`` turns them into exit messages. README "Recall suite: tasks, mixers, sweeps".
"""
from __future__ import annotations

import csv
import dataclasses
import glob
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, Iterable, List, Literal, Optional, Sequence, Tuple

__all__ = ["SweepConfig", "PRESETS", "Cell", "cells", "apply_preset", "run_config", "run_sweep", "summarize"]


@dataclasses.dataclass
class SweepConfig:
    """A sweep: the grid axes, the shared run settings (``base``: ``RecallConfig`` field=value
    overrides, e.g. ``("steps=2000", "batch_size=128")``, parsed by :func:`gdn_jax.cli.parse_overrides`),
    where to write, how to run.

    ``preset`` fills every field the command line did not set from :data:`PRESETS`."""

    preset: Optional[str] = None  # a named grid (PRESETS); flags given on the command line override its fields
    task: str = "mqar"  # mqar, niah or state_tracking
    mixers: Tuple[str, ...] = ("gdn", "deltanet", "mamba2", "gla", "attention")  # LM mixers; "hybrid": GDN 3:1 attention
    d_models: Tuple[int, ...] = (64, 128)  # model widths of the grid
    seq_lens: Tuple[int, ...] = (64,)  # sequence lengths of the grid
    num_kv_pairs: Tuple[int, ...] = (8,)  # MQAR key-value pairs of the grid
    lrs: Tuple[float, ...] = (3e-3,)  # learning rates; each cell reports its best
    # seeds (data and init) of every (cell, learning rate): runs lr<lr>_seed<s>, summaries mean ± std over them;
    # empty: one run per rate at RecallConfig.seed (--base seed=N), in lr<lr>
    seeds: Tuple[int, ...] = ()
    neg_eigval: Tuple[bool, ...] = (False,)  # beta in (0,1) / (0,2); True only for gdn, deltanet, hybrid
    # (seq_len, kv pairs[, batch size]) points "LxN" / "LxNxB" instead of the seq_lens x num_kv_pairs product
    shapes: Tuple[str, ...] = ()
    epochs: Optional[int] = None  # data_mode=fixed: steps = epochs x (train_examples // batch), eval once per epoch
    base: Tuple[str, ...] = ()  # RecallConfig field=value settings of every run (e.g. steps=2000 batch_size=128)
    skip_lrs_after_target: bool = True  # a cell's remaining learning rates are skipped once one reaches the target
    # workers claim single (cell, learning rate) runs, not whole cells: a cell's rates train at once
    # (a cell at four rates no longer runs four runs one after the other). With skip_lrs_after_target
    # a rate not yet started is skipped once another one reached the target; rates already running
    # finish (that compute is spent; use it where no rate is expected to reach the target early)
    lrs_in_parallel: bool = False
    out: str = "runs/sweep"  # the sweep's folder: runs/, summary.md / .json / .csv, plots
    ckpt_root: Optional[str] = None  # checkpoints under <ckpt_root>/<cell>/lr<lr> (default: inside each run's out)
    workers: int = 0  # 0: one per local accelerator when there are several, else run in this process
    workers_per_device: int = 1  # >1: that many worker processes share each accelerator (small models)
    progress: bool = True  # tqdm progress bar (in one process: also the step, loss and accuracy of the run in flight)
    # every run's metrics also to TensorBoard / W&B (RecallConfig.logger; docs/loggers_and_sweeps.md)
    logger: Literal["none", "tensorboard", "wandb"] = "none"
    time_budget_s: Optional[float] = None  # stop (checkpointing the current run) after this many seconds
    worker_index: Optional[int] = None  # internal: this process is worker i (started by the parent)
    deadline: Optional[float] = None  # internal: time.time() at which time_budget_s ends (set by the parent)


# Zoology's learning-rate grid, logspace(-4, -2, 4) = 1e-4, 4.64e-4, 2.15e-3, 1e-2, in the order tried
ZOOLOGY_LRS = (0.002154434690031882, 0.00046415888336127773, 0.01, 0.0001)
ZOOLOGY_BASE = ("vocab_size=8192", "num_heads=2", "batch_size=128", "data_mode=fixed", "train_examples=100000",
                "test_examples=3000", "eval_batch_size=250", "warmup=0", "weight_decay=0.1", "b2=0.999",
                "grad_clip=0", "min_lr_ratio=0", "lr_per_epoch=true", "target_accuracy=0.99",
                "random_non_queries=false", "backend=auto", "log_every=100")



def _zoology_variant(mixer: str, *settings: str) -> Dict[str, Any]:
    """A preset of one mixer at Zoology's MQAR protocol (L 512, 64 pairs, d 64 / 128) with extra run settings."""
    return dict(mixers=(mixer,), d_models=(64, 128), seq_lens=(512,), num_kv_pairs=(64,), lrs=ZOOLOGY_LRS, epochs=64,
                workers_per_device=2, base=ZOOLOGY_BASE + settings)


# Presets: sweep fields + base run settings. The H200 ones are the reduced protocols of the README.
PRESETS: Dict[str, Dict[str, Any]] = {
    # CI smoke test: every mixer on one task for a few steps (tests/experiments/test_sweep.py runs each task)
    "cpu_smoke": dict(mixers=("gdn", "deltanet", "mamba2", "gla", "linear", "kda", "attention", "gated_attention",
                              "hybrid"),
                      d_models=(16,), seq_lens=(32,), num_kv_pairs=(4,), lrs=(3e-2,),
                      base=("vocab_size=32", "num_heads=2", "steps=24", "warmup=2", "batch_size=8",
                            "eval_every=24", "test_examples=16", "eval_batch_size=16", "backend=chunk",
                            "chunk_size=16", "train_min_len=3", "train_max_len=12", "test_min_len=12",
                            "test_max_len=24", "log_every=1")),
    # a short CPU recall comparison (~5-6 min on 2 cores): MQAR L 64, 8 pairs, d 64
    "cpu_mqar": dict(mixers=("gdn", "deltanet", "mamba2", "gla", "attention"), d_models=(64,), seq_lens=(64,),
                     num_kv_pairs=(8,), lrs=(3e-3,),
                     base=("vocab_size=256", "steps=3000", "max_steps=500", "warmup=200", "batch_size=64",
                           "eval_every=100")),
    # H200: the DeltaNet-paper MQAR setting (L 512, 64 pairs, d 64/128/256), reduced protocol (README):
    # stream data, lr 3e-3 then 1e-3 (the second only if the first misses 0.99), <= 10k steps and
    # <= 100 s of training per run, early stop at 0.99; the query region's other tokens are 0 as in
    # Zoology's configs for this figure; two runs share each GPU (these models leave an H200 mostly
    # idle). results/mqar_h200_v2 is this preset's run; the first attempt, results/mqar_h200, used
    # one lr, 3000 steps, 40 s and random fillers (its sweep_config.json has the exact settings).
    "h200_mqar": dict(mixers=("gdn", "deltanet", "mamba2", "gla", "attention"), d_models=(64, 128, 256),
                      seq_lens=(512,), num_kv_pairs=(64,), lrs=(3e-3, 1e-3), workers_per_device=2,
                      base=("vocab_size=8192", "num_heads=2", "steps=10000", "warmup=300", "batch_size=128",
                            "eval_every=500", "test_examples=1000", "eval_batch_size=250", "max_time_s=100",
                            "random_non_queries=false", "backend=auto")),
    # H200: Zoology's own protocol for the DeltaNet-paper MQAR figure (Arora et al. 2023, its
    # paper-era code): L 512, 64 pairs, vocab 8192, batch 128, a fixed set of 100k training
    # examples for up to 64 epochs (781 steps each), 3k test examples evaluated once per epoch, early stop at
    # 0.99, lr from logspace(-4, -2, 4) (tried likeliest first; the rest skipped once one reaches 0.99 --
    # --no-skip_lrs_after_target for all four), best per cell; AdamW b2 0.999, wd 0.1, cosine to 0 stepped
    # once per epoch, no warmup, no clipping; fillers 0. Differences from Zoology kept: our 2-head mixers and
    # blocks (RMSNorm, no biases, RoPE attention), no decay on 1-D parameters. Resumable in pieces
    # (--time_budget_s). Our models at d 64-512; the published variants are options (README).
    "zoology_mqar": dict(mixers=("gdn", "deltanet", "mamba2", "gla", "attention"), d_models=(64, 128, 256, 512),
                         seq_lens=(512,), num_kv_pairs=(64,), lrs=ZOOLOGY_LRS, epochs=64, workers_per_device=2,
                         base=ZOOLOGY_BASE),
    # H200: the published-variant baselines (README "Baseline mixers") at the zoology_mqar protocol, d 64 / 128:
    # GLA as in its paper / FLA (no short convolution, key dim d/2), Mamba2's discretisation (dt-scaled input,
    # no q/k norm), Zoology's MHA (q/k/v/o biases, learned absolute positions, no RoPE, one head)
    "zoology_gla_published": _zoology_variant("gla", "use_short_conv=false", "gla_expand_k=0.5"),
    "zoology_mamba2_published": _zoology_variant("mamba2", "la_qk_l2norm=false", "mamba2_dt_input=true"),
    "zoology_attention_zoo": _zoology_variant("attention", "attn_bias=qkvo", "pos_embedding=learned",
                                              "rope_fraction=0", "num_heads=1"),
    # which of Zoology's MHA's three differences from our attention holds it back at d 128 (ours 99.99 % at
    # lr 1e-2, zoology_attention_zoo 1.5 %): each alone on our block (run with --d_models 128 --lrs 0.01)
    "zoology_attention_abspos": _zoology_variant("attention", "pos_embedding=learned", "rope_fraction=0"),
    "zoology_attention_bias": _zoology_variant("attention", "attn_bias=qkvo"),
    "zoology_attention_1head": _zoology_variant("attention", "num_heads=1"),
    # which of the published GLA's two differences from ours moves MQAR at d 64: each alone, an ablation at one
    # width and one rate (d 64, lr 2.15e-3, the rate of our gla's best there), not a grid
    "zoology_gla_noconv": dict(_zoology_variant("gla", "use_short_conv=false"), d_models=(64,), lrs=ZOOLOGY_LRS[:1]),
    "zoology_gla_halfk": dict(_zoology_variant("gla", "gla_expand_k=0.5"), d_models=(64,), lrs=ZOOLOGY_LRS[:1]),
    # H200: Zoology fig. 2 cells, the same protocol at (L, pairs, batch) = (64, 4, 512), (128, 8, 512), (256, 16, 256)
    "zoology_fig2": dict(mixers=("attention", "gdn", "mamba2"), d_models=(64, 128), shapes=("64x4x512", "128x8x512",
                                                                                        "256x16x256"),
                         lrs=ZOOLOGY_LRS, epochs=64, workers_per_device=2, base=ZOOLOGY_BASE),
    # CPU smoke test of the Zoology presets' machinery (fixed set, epochs, per-epoch cosine, shapes, budget)
    "cpu_zoology_smoke": dict(mixers=("gdn", "attention"), d_models=(16,), shapes=("32x4x8", "16x2x16"),
                              lrs=(1e-2, 1e-3), epochs=2,
                              base=("vocab_size=32", "num_heads=2", "data_mode=fixed", "train_examples=32",
                                    "test_examples=16", "eval_batch_size=16", "warmup=0", "b2=0.999",
                                    "grad_clip=0", "min_lr_ratio=0", "lr_per_epoch=true", "backend=chunk",
                                    "chunk_size=16", "random_non_queries=false", "log_every=1")),
    # H200: parity, beta in (0,1) vs (0,2) for deltanet and gdn (Grazzi et al.), reduced protocol
    "h200_parity": dict(task="state_tracking", mixers=("deltanet", "gdn"), d_models=(128,), seq_lens=(40,),
                        num_kv_pairs=(0,), lrs=(1e-3,), neg_eigval=(False, True),
                        base=("modulus=2", "num_heads=2", "steps=2000", "warmup=100", "batch_size=256",
                              "eval_every=250", "test_examples=1000", "eval_batch_size=250", "max_time_s=50",
                              "backend=chunk")),
}


def apply_preset(cfg: SweepConfig, explicit: Iterable[str] = ()) -> SweepConfig:
    """``cfg`` with the fields of ``PRESETS[cfg.preset]`` except those named in ``explicit``; the
    preset's ``base`` settings come first so that ``cfg.base`` overrides them."""
    if cfg.preset is None:
        return cfg
    if cfg.preset not in PRESETS:
        raise ValueError(f"SweepConfig.preset must be one of {sorted(PRESETS)}, got {cfg.preset!r}")
    explicit = set(explicit)
    p = dict(PRESETS[cfg.preset])
    upd = {k: v for k, v in p.items() if k not in explicit and k != "base"}
    base = _task_settings(p.get("base", ()), upd.get("task", cfg.task)) + tuple(cfg.base)
    return dataclasses.replace(cfg, **upd, base=base)


def _task_settings(base: Sequence[str], task: str) -> Tuple[str, ...]:
    """A preset's ``base`` settings without the task options that ``task`` does not read
    (:func:`gdn_jax.recall.task_options`): a preset such as ``cpu_smoke`` serves every task, while
    a run refuses an option its task does not read."""
    from gdn_jax.recall import task_options

    opts = task_options()
    return tuple(x for x in base if not (x.split("=", 1)[0] in opts and task not in opts[x.split("=", 1)[0]]))


_TASK_AXES = ("seq_len", "num_kv_pairs")  # the grid's task axes; a task uses those its config has


def _line_label(mixer: str, neg_eigval: bool) -> str:
    """A plot line's label: the mixer, with the beta range where it was swept."""
    return mixer + (" β∈(0,2)" if neg_eigval else "")


def _task_axes(task: str) -> Tuple[str, ...]:
    """The grid's task axes (``seq_len``, ``num_kv_pairs``) that ``task``'s config has as fields."""
    from gdn_jax.data import TASK_CONFIGS

    if task not in TASK_CONFIGS:
        raise ValueError(f"SweepConfig.task must be one of {tuple(TASK_CONFIGS)}, got {task!r}")
    names = {f.name for f in dataclasses.fields(TASK_CONFIGS[task])}
    return tuple(a for a in _TASK_AXES if a in names)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One grid point."""

    task: str
    mixer: str
    d_model: int
    seq_len: int
    num_kv_pairs: int
    neg_eigval: bool = False
    batch_size: Optional[int] = None  # from SweepConfig.shapes "LxNxB" (not part of the name)

    @property
    def name(self) -> str:
        """E.g. ``mqar_gdn_d64_L64_N8``: the task axes its task uses (``_L``, ``_N``), ``_neg`` for beta in (0, 2)."""
        tag = {"seq_len": f"_L{self.seq_len}", "num_kv_pairs": f"_N{self.num_kv_pairs}"}
        axes = "".join(tag[a] for a in _task_axes(self.task))
        return f"{self.task}_{self.mixer}_d{self.d_model}{axes}" + ("_neg" if self.neg_eigval else "")

    @property
    def label(self) -> str:
        """Line label in plots: the mixer, with the beta range where it was swept."""
        return _line_label(self.mixer, self.neg_eigval)


_NEG_OK = ("gdn", "deltanet", "hybrid")


def cells(cfg: SweepConfig) -> List[Cell]:
    """The grid of ``cfg``. ``neg_eigval=True`` only for mixers with a delta rule (gdn, deltanet,
    hybrid); a task whose config lacks ``seq_len`` / ``num_kv_pairs`` takes one value of that axis
    and ignores it (``niah`` has no ``num_kv_pairs``; ``state_tracking`` neither: its lengths are the
    task fields train/test_min/max_len, set with ``base``; more than one value is a ValueError in
    :func:`validate`, and summaries leave the axis out)."""
    from gdn_jax.models.lm import MIXERS

    for m in cfg.mixers:
        if m not in MIXERS and m != "hybrid":
            raise ValueError(f"unknown mixer {m!r} in SweepConfig.mixers; expected one of {sorted(MIXERS) + ['hybrid']}")
    out = []
    axes = _task_axes(cfg.task)
    if cfg.shapes:
        points = [parse_shape(x) for x in cfg.shapes]
    else:
        seq_lens = cfg.seq_lens if "seq_len" in axes else cfg.seq_lens[:1]
        pairs = cfg.num_kv_pairs if "num_kv_pairs" in axes else cfg.num_kv_pairs[:1]
        points = [(L, n, None) for L in seq_lens for n in pairs]
    for L, n, b in points:
        for d in cfg.d_models:
            for m in cfg.mixers:
                for neg in cfg.neg_eigval:
                    if neg and m not in _NEG_OK:
                        continue
                    out.append(Cell(cfg.task, m, int(d), int(L), int(n), bool(neg), b))
    return out


def parse_shape(text: str) -> Tuple[int, int, Optional[int]]:
    """``"512x64"`` -> (seq_len 512, kv pairs 64, None); ``"64x4x512"`` -> (64, 4, batch size 512)."""
    parts = str(text).lower().split("x")
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        vals = []
    if len(vals) not in (2, 3) or min(vals) < 1:
        raise ValueError(f"SweepConfig.shapes entries must be 'LxN' or 'LxNxB' (seq_len x kv pairs [x batch size], "
                         f"positive ints), got {text!r}")
    return vals[0], vals[1], (vals[2] if len(vals) == 3 else None)


# RecallConfig fields that the sweep sets itself (-> the SweepConfig field to use instead)
_SET_BY_SWEEP = {"task": "SweepConfig.task", "mixer": "SweepConfig.mixers", "d_model": "SweepConfig.d_models",
                 "seq_len": "SweepConfig.seq_lens", "num_kv_pairs": "SweepConfig.num_kv_pairs", "lr": "SweepConfig.lrs",
                 "allow_neg_eigval": "SweepConfig.neg_eigval", "out": "SweepConfig.out",
                 "ckpt_dir": "SweepConfig.ckpt_root", "resume": None, "overwrite": None, "logger": "SweepConfig.logger",
                 "hybrid_every": "the mixer name 'hybrid' in SweepConfig.mixers"}


def _parse_base(base: Sequence[str]) -> Dict[str, Any]:
    """The ``RecallConfig`` overrides of ``base`` (:func:`gdn_jax.cli.parse_overrides`); ValueError for a
    bad one or for a field that the sweep sets itself."""
    from gdn_jax.cli import parse_overrides
    from gdn_jax.recall import RecallConfig

    try:
        kw = parse_overrides(RecallConfig, base)
    except ValueError as e:
        raise ValueError(f"bad SweepConfig.base setting: {e}") from None
    for k in kw:
        if k in _SET_BY_SWEEP:
            use = _SET_BY_SWEEP[k]
            raise ValueError(f"SweepConfig.base setting {k!r} is set by the sweep" + (f"; use {use}" if use else ""))
    return kw


def seeds(cfg: SweepConfig) -> List[Optional[int]]:
    """The seeds of every (cell, learning rate): ``cfg.seeds``, or ``[None]`` (one run at the base's
    ``RecallConfig.seed``) without a seed axis."""
    return list(cfg.seeds) or [None]


def run_name(lr: float, seed: Optional[int] = None) -> str:
    """A run's folder under its cell: ``lr<lr>`` or, on the seed axis, ``lr<lr>_seed<seed>``."""
    return f"lr{lr:g}" + ("" if seed is None else f"_seed{seed}")


def run_config(cfg: SweepConfig, cell: Cell, lr: float, seed: Optional[int] = None):
    """The :class:`gdn_jax.recall.RecallConfig` of one run of ``cell`` at learning rate ``lr``
    (and ``seed`` on the seed axis, :attr:`SweepConfig.seeds`)."""
    from gdn_jax.recall import RecallConfig

    kw = _parse_base(cfg.base)
    explicit_eval = "eval_every" in kw
    kw.update(task=cell.task, d_model=cell.d_model, lr=float(lr), allow_neg_eigval=cell.neg_eigval,
              out=os.path.join(cfg.out, "runs", cell.name, run_name(lr, seed)), progress=False, keep_checkpoints=1)
    if seed is not None:
        kw["seed"] = int(seed)
    if cfg.logger != "none":
        kw["logger"] = cfg.logger
        if cfg.logger == "wandb":
            kw.setdefault("wandb_group", os.path.basename(os.path.normpath(cfg.out)))
    if cell.batch_size is not None:
        kw["batch_size"] = cell.batch_size
    if cfg.epochs is not None:  # steps per epoch of the fixed set; evaluate once per epoch (Zoology)
        spe = int(kw.get("train_examples", RecallConfig.train_examples)) // int(kw.get("batch_size",
                                                                                       RecallConfig.batch_size))
        kw["steps"] = cfg.epochs * max(spe, 1)
        if not explicit_eval:
            kw["eval_every"] = max(spe, 1)
        kw.setdefault("eval_every_near_target", 0)  # Zoology's protocol: evaluations once per epoch only
    if cfg.deadline is not None:  # this session's share of SweepConfig.time_budget_s
        kw["session_time_s"] = max(cfg.deadline - time.time(), 1e-3)
    if cfg.ckpt_root:
        kw["ckpt_dir"] = os.path.join(cfg.ckpt_root, cell.name, run_name(lr, seed))
    ckpt = kw.get("ckpt_dir") or os.path.join(kw["out"], "ckpt")
    kw["resume"] = os.path.isdir(ckpt) and bool(os.listdir(ckpt))  # an interrupted run continues
    # a run folder of the sweep is the sweep's: a fresh run replaces what a failed attempt left (recall.run
    # refuses a folder holding files otherwise); the sweep keeps one checkpoint per run, not the best too
    kw.update(overwrite=not kw["resume"], keep_best_checkpoint=False)
    kw.update({a: getattr(cell, a) for a in _task_axes(cell.task)})
    if cell.mixer == "hybrid":
        kw.update(mixer="gdn", hybrid_every=4, num_layers=max(int(kw.get("num_layers", RecallConfig.num_layers)), 4))
    else:
        kw["mixer"] = cell.mixer
    return RecallConfig(**kw)


def _results_path(cfg: SweepConfig, cell: Cell, lr: float, seed: Optional[int] = None) -> str:
    return os.path.join(cfg.out, "runs", cell.name, run_name(lr, seed), "results.json")


def _load(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def validate(cfg: SweepConfig) -> List[Cell]:
    """Check the whole sweep before training anything: its own fields, then every run's settings
    (task, model, optimizer; the model is built abstractly). Returns the grid; raises ValueError
    listing every problem (each naming its ``SweepConfig`` or ``RecallConfig`` field)."""
    from flax import nnx

    from gdn_jax.recall import TASKS, build, check_out_dir

    errors = []
    if cfg.task not in TASKS:
        errors.append(f"SweepConfig.task must be one of {TASKS}, got {cfg.task!r}")
    if not cfg.lrs:
        errors.append("SweepConfig.lrs is empty")
    names = [f"lr{lr:g}" for lr in cfg.lrs]
    if len(set(names)) < len(names):  # one run folder per rate: rates that print alike would share it
        errors.append(f"SweepConfig.lrs has rates that repeat or agree to 6 significant digits "
                      f"(their runs would share a folder): {list(cfg.lrs)}")
    if cfg.workers < 0:
        errors.append(f"SweepConfig.workers must be >= 0, got {cfg.workers}")
    from gdn_jax.loggers import LOGGERS

    if cfg.logger not in LOGGERS:
        errors.append(f"SweepConfig.logger must be one of {LOGGERS}, got {cfg.logger!r}")
    if cfg.workers_per_device < 1:
        errors.append(f"SweepConfig.workers_per_device must be >= 1, got {cfg.workers_per_device}")
    for name in ("d_models", "seq_lens", "num_kv_pairs", "mixers", "neg_eigval", "shapes", "seeds"):
        values = list(getattr(cfg, name))
        if not values and name not in ("shapes", "seeds"):
            errors.append(f"SweepConfig.{name} is empty")
        elif len(set(values)) < len(values):  # cells that repeat would share a run folder
            errors.append(f"SweepConfig.{name} repeats a value: {values}")
    if not cfg.out:
        errors.append("SweepConfig.out must name a folder, got an empty string")
    for name in ("out", "ckpt_root"):
        try:
            check_out_dir(f"SweepConfig.{name}", getattr(cfg, name) or None)
        except ValueError as e:
            errors.append(str(e))
    for x in cfg.shapes:
        try:
            parse_shape(x)
        except ValueError as e:
            errors.append(str(e))
    if cfg.task in TASKS:  # an axis the task has not would collapse to its first value, silently
        axes = _task_axes(cfg.task)
        for name, field in (("seq_lens", "seq_len"), ("num_kv_pairs", "num_kv_pairs")):
            if field not in axes and len(getattr(cfg, name)) > 1:
                errors.append(f"SweepConfig.{name} has {len(getattr(cfg, name))} values but task {cfg.task!r} has no "
                              f"{field} (set its own length fields with SweepConfig.base); give one value")
        if cfg.shapes and len(axes) < 2:
            errors.append(f"SweepConfig.shapes sets (seq_len, num_kv_pairs) points; task {cfg.task!r} has only "
                          f"{list(axes)} of them: use SweepConfig.seq_lens / SweepConfig.base")
    if cfg.epochs is not None:
        if isinstance(cfg.epochs, bool) or not isinstance(cfg.epochs, int) or cfg.epochs < 1:
            errors.append(f"SweepConfig.epochs must be None or an int >= 1, got {cfg.epochs!r}")
        else:
            try:
                if _parse_base(cfg.base).get("data_mode") != "fixed":
                    errors.append("SweepConfig.epochs needs the fixed training set: add data_mode=fixed to "
                                  "SweepConfig.base")
            except ValueError:
                pass
    if cfg.time_budget_s is not None and not cfg.time_budget_s > 0:
        errors.append(f"SweepConfig.time_budget_s must be None or > 0 (seconds), got {cfg.time_budget_s!r}")
    try:
        if "seed" in _parse_base(cfg.base) and cfg.seeds:  # parsed once, not once per run
            errors.append("SweepConfig.base setting 'seed' is set by the sweep's seed axis; use SweepConfig.seeds")
    except ValueError as e:
        errors.append(str(e))
    if errors:
        raise ValueError("; ".join(errors))
    grid = cells(cfg)
    if not grid:
        raise ValueError(f"the grid is empty: SweepConfig.neg_eigval={list(cfg.neg_eigval)} applies only to "
                         f"{sorted(_NEG_OK)}, SweepConfig.mixers={list(cfg.mixers)}")
    for cell in grid:
        for lr in cfg.lrs:
            for seed in seeds(cfg):
                try:
                    model_fn = build(run_config(cfg, cell, lr, seed))[3]
                    if lr == cfg.lrs[0] and seed == seeds(cfg)[0]:
                        nnx.eval_shape(model_fn)
                except (TypeError, ValueError) as e:
                    errors.append(f"{cell.name} {_run_label(lr, seed)}: {e}")
    if not errors:
        errors += _changed_settings(cfg, grid)
    if errors:
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise ValueError("invalid sweep: " + "; ".join(errors[:5]) + more)
    return grid


def _changed_settings(cfg: SweepConfig, grid: Sequence[Cell]) -> List[str]:
    """Finished runs under ``cfg.out`` whose settings differ from what ``cfg`` would run now (a
    changed ``--base``, say): resuming would skip them and report their old results as the new
    sweep's. Fields that may change between a run and its resumption (``max_steps``, ``max_time_s``,
    ``eval_every``, ``backend``, ...) are not compared."""
    from gdn_jax.recall import RESUME_FREE_FIELDS

    ignore = RESUME_FREE_FIELDS
    errors = []
    for cell in grid:
        for lr, seed in _runs(cfg):
            r = _load(_results_path(cfg, cell, lr, seed))
            if r is None or "config" not in r:
                continue
            now = dataclasses.asdict(run_config(cfg, cell, lr, seed))
            diff = [f"{k}: {r['config'].get(k)!r} -> {v!r}" for k, v in now.items()
                    if k not in ignore and r["config"].get(k, v) != v]
            if diff:
                errors.append(f"{cell.name} {_run_label(lr, seed)} already finished in {cfg.out} with other settings "
                              f"({', '.join(diff)}); use a new SweepConfig.out, or the settings it was run with")
    return errors


def _runs(cfg: SweepConfig, lrs: Optional[Sequence[float]] = None) -> List[Tuple[float, Optional[int]]]:
    """The (learning rate, seed) runs of a cell, in the order they train: every seed of a rate, then the next rate."""
    return [(lr, seed) for lr in (cfg.lrs if lrs is None else lrs) for seed in seeds(cfg)]


def _run_label(lr: float, seed: Optional[int] = None) -> str:
    return f"lr {lr:g}" + ("" if seed is None else f" seed {seed}")


def _started(cfg: SweepConfig, cell: Cell, lr: float, seed: Optional[int] = None) -> bool:
    """The run has a checkpoint (it was interrupted and resumes from there)."""
    return bool(run_config(cfg, cell, lr, seed).resume)


def _checkpoint_step(cfg: SweepConfig, cell: Cell, lr: float, seed: Optional[int] = None) -> Optional[int]:
    """The latest checkpointed step of an interrupted run (its orbax step folders), or None."""
    rc = run_config(cfg, cell, lr, seed)
    ckpt = rc.ckpt_dir or os.path.join(rc.out, "ckpt")
    try:
        steps = [int(n) for n in os.listdir(ckpt) if n.isdigit()]
    except OSError:
        return None
    return max(steps) if steps else None


def _rate_reached(cfg: SweepConfig, cell: Cell, lr: float) -> bool:
    """Every seed of rate ``lr`` finished and reached the target."""
    rs = [_load(_results_path(cfg, cell, lr, seed)) for seed in seeds(cfg)]
    return all(r is not None and r.get("reached_target") for r in rs)


def _skipped(cfg: SweepConfig, cell: Cell, lr: float, seed: Optional[int] = None) -> bool:
    """With ``skip_lrs_after_target``: the run has no results, was never started, and another rate of
    the cell reached the target (with every seed). A started run (``--lrs_in_parallel``: running
    beside the rate that reached the target, then interrupted) is not skipped: it resumes and finishes."""
    if not cfg.skip_lrs_after_target or _load(_results_path(cfg, cell, lr, seed)) is not None:
        return False
    reached = any(_rate_reached(cfg, cell, x) for x in cfg.lrs if x != lr)
    return reached and not _started(cfg, cell, lr, seed)


def cell_done(cfg: SweepConfig, cell: Cell) -> bool:
    """Every run of the cell (rate x seed) is finished or skipped: with ``skip_lrs_after_target`` the
    runs not started when a rate reached the target are skipped (:func:`_skipped`)."""
    return all(_run_done(cfg, cell, lr, seed) for lr, seed in _runs(cfg))


def _run_done(cfg: SweepConfig, cell: Cell, lr: float, seed: Optional[int] = None) -> bool:
    return _load(_results_path(cfg, cell, lr, seed)) is not None or _skipped(cfg, cell, lr, seed)


def out_of_budget(cfg: SweepConfig) -> bool:
    """``time_budget_s`` is spent (``cfg.deadline`` has passed)."""
    return cfg.deadline is not None and time.time() >= cfg.deadline


def run_cell(cfg: SweepConfig, cell: Cell, lrs: Optional[Sequence[float]] = None, *,
             progress: Optional[Any] = None) -> bool:
    """Train ``cell`` at each learning rate (``lrs``, default ``cfg.lrs``) and each seed
    (``cfg.seeds``), skipping finished runs, and with ``skip_lrs_after_target`` every rate after one
    reached the target with every seed; write their results. A run that raises is reported (``<run
    out>/error.txt`` and stderr) and the sweep goes on. ``progress``: a tqdm bar whose postfix shows
    the run in flight (step, loss, accuracy, test accuracy). Returns False when the time budget ran
    out (the run in progress is checkpointed, unfinished)."""
    import traceback

    from gdn_jax import recall

    for lr in (cfg.lrs if lrs is None else lrs):
        for seed in seeds(cfg):
            r = _load(_results_path(cfg, cell, lr, seed))
            if r is not None:
                continue
            if _skipped(cfg, cell, lr, seed):  # another rate of this cell reached the target
                continue
            if out_of_budget(cfg):
                return False
            rc = run_config(cfg, cell, lr, seed)
            try:
                kw = {"loggers": [_progress_logger(progress, cell, lr, seed, rc)]} if progress is not None else {}
                r = recall.run(rc, **kw)[0]
            except Exception as e:  # keep the other cells going; the error is kept with the run
                os.makedirs(rc.out, exist_ok=True)
                with open(os.path.join(rc.out, "error.txt"), "w") as f:
                    f.write(traceback.format_exc())
                print(f"{cell.name} {_run_label(lr, seed)} FAILED: {type(e).__name__}: {str(e)[:300]}",
                      file=sys.stderr, flush=True)
                continue
            if r.get("interrupted"):  # the time budget ran out inside this run: resumed next time
                return False
            import shutil

            shutil.rmtree(r["ckpt_dir"], ignore_errors=True)  # finished: checkpoints no longer needed
        if cfg.skip_lrs_after_target and _rate_reached(cfg, cell, lr):
            break
    return True


def _progress_logger(bar, cell: Cell, lr: float, seed: Optional[int], rc):
    """A :class:`gdn_jax.loggers.CallbackLogger` that writes the run in flight into ``bar``'s postfix:
    its cell, rate (seed), step of its total, and the last train loss / accuracy and test accuracy."""
    from gdn_jax.loggers import CallbackLogger

    total = rc.max_steps if rc.max_steps is not None else rc.steps
    last: Dict[str, float] = {}

    def show(metrics: Dict[str, float], step: int) -> None:
        last.update(metrics)
        parts = [f"step {step}/{total}"] + [f"{name} {last[k]:.3f}" for k, name in (
            ("train/loss", "loss"), ("train/accuracy", "acc"), ("test/accuracy", "test")) if k in last]
        bar.set_postfix_str(f"{cell.name} {_run_label(lr, seed)}: " + ", ".join(parts))

    return CallbackLogger(show)


def _claim(cfg: SweepConfig, name: str) -> bool:
    path = os.path.join(cfg.out, "locks", name + ".lock")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def _worker(cfg: SweepConfig) -> None:
    for cell in cells(cfg):
        if out_of_budget(cfg):
            print(f"[worker {cfg.worker_index}] time budget spent; stopping", flush=True)
            return
        if not cfg.lrs_in_parallel:
            if not cell_done(cfg, cell) and _claim(cfg, cell.name):
                print(f"[worker {cfg.worker_index}] {cell.name}", flush=True)
                if not run_cell(cfg, cell):
                    print(f"[worker {cfg.worker_index}] time budget spent in {cell.name}; stopping", flush=True)
                    return
            continue
        for lr in cfg.lrs:  # one (cell, learning rate) at a time, its seeds one after the other
            if out_of_budget(cfg):
                print(f"[worker {cfg.worker_index}] time budget spent; stopping", flush=True)
                return
            if cell_done(cfg, cell):
                break
            if (not all(_run_done(cfg, cell, lr, seed) for seed in seeds(cfg))
                    and _claim(cfg, f"{cell.name}_lr{lr:g}")):
                print(f"[worker {cfg.worker_index}] {cell.name} lr {lr:g}", flush=True)
                if not run_cell(cfg, cell, lrs=(lr,)):
                    print(f"[worker {cfg.worker_index}] time budget spent in {cell.name} lr {lr:g}; stopping", flush=True)
                    return


def _accelerators() -> Tuple[int, str]:
    """(number of local accelerators, backend), asked in a subprocess: the parent of the workers
    must not open the GPUs itself (JAX would preallocate 75% of every GPU's memory in it)."""
    code = "import jax; print(jax.local_device_count(), jax.default_backend())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    n, backend = int(out[-2]), out[-1]
    return (n if backend in ("gpu", "cuda", "rocm", "tpu") else 1), backend


def visible_device_ids(visible: Optional[str], n_acc: int) -> List[str]:
    """The device ids the workers are spread over: the parent's own ``CUDA_VISIBLE_DEVICES`` /
    ``TPU_VISIBLE_CHIPS`` list when it has one (so that ``CUDA_VISIBLE_DEVICES=1,2,3 python
    experiments/sweep.py ...`` keeps device 0 free for other work), else ``0 .. n_acc - 1``."""
    if visible and visible.strip():
        ids = [x.strip() for x in visible.split(",") if x.strip()]
        if n_acc and len(ids) != n_acc:
            raise ValueError(f"visible devices {visible!r} name {len(ids)} devices but JAX sees {n_acc}")
        return ids
    return [str(i) for i in range(n_acc)]


def recorded_config(cfg: SweepConfig) -> Dict[str, Any]:
    """``cfg`` as ``sweep_config.json`` records it: with ``shapes``, ``seq_lens`` / ``num_kv_pairs``
    are the values the shapes run (in order of first appearance), not the unused fields."""
    d = dataclasses.asdict(cfg)
    if cfg.shapes:
        points = [parse_shape(x) for x in cfg.shapes]
        d["seq_lens"] = list(dict.fromkeys(L for L, _, _ in points))
        d["num_kv_pairs"] = list(dict.fromkeys(n for _, n, _ in points))
    return d


def run_sweep(cfg: SweepConfig, argv: Sequence[str] = (), script: Optional[str] = None) -> Dict[str, Any]:
    """Run every unfinished cell of ``cfg`` (in this process, or in one worker per device), then
    :func:`summarize`. ``argv``/``script``: how to start this sweep again as a worker process (``script``:
    a Python file run with this interpreter, or a whole command line such as ``[sys.executable, "-m",
    "gdn_jax.commands", "sweep"]``)."""
    from tqdm.auto import tqdm

    if cfg.worker_index is not None and cfg.worker_index < 0:
        raise ValueError(f"SweepConfig.worker_index (internal: set by the parent sweep for its workers) must be >= 0, "
                         f"got {cfg.worker_index}")
    grid = cells(cfg) if cfg.worker_index is not None else validate(cfg)
    if cfg.worker_index is None and cfg.time_budget_s is not None:
        cfg = dataclasses.replace(cfg, deadline=time.time() + float(cfg.time_budget_s))
        argv = [*argv, "--deadline", repr(cfg.deadline)]
    os.makedirs(os.path.join(cfg.out, "locks"), exist_ok=True)
    with open(os.path.join(cfg.out, "sweep_config.json"), "w") as f:
        json.dump(recorded_config(cfg), f, indent=1)
    if cfg.worker_index is not None:
        _worker(cfg)
        return {}
    print(f"sweep folder: {os.path.abspath(cfg.out)} (run the same command again to continue this grid there)",
          file=sys.stderr, flush=True)
    for p in glob.glob(os.path.join(cfg.out, "locks", "*.lock")):  # locks of a dead earlier sweep
        os.remove(p)
    n_acc, backend = _accelerators() if not cfg.workers else (0, "")
    wpd = cfg.workers_per_device
    n_workers = cfg.workers or (n_acc * wpd if n_acc > 1 or wpd > 1 else 0)
    from gdn_jax.recall import live_progress

    # a bar where it is seen live; in a log (stderr not a terminal) a line per finished cell instead of
    # the bar's redrawn '\r' lines (docs/experiment_tools.md "Progress output")
    live = cfg.progress and live_progress(tqdm)
    lines = cfg.progress and not live
    bar = tqdm(total=len(grid), disable=not live, desc=f"sweep {cfg.task}", unit="cell", dynamic_ncols=True)
    bar.update(sum(cell_done(cfg, c) for c in grid))
    if cfg.lrs_in_parallel and (n_workers <= 1 or script is None):
        print("sweep: --lrs_in_parallel needs several worker processes (workers_per_device > 1, or several "
              "devices); in one process the rates run one after the other", file=sys.stderr)
    if n_workers <= 1 or script is None:
        for cell in grid:
            if not cell_done(cfg, cell):
                bar.set_postfix_str(cell.name)
                try:
                    ok = run_cell(cfg, cell, progress=bar if live else None)
                except KeyboardInterrupt:  # Ctrl-C: the run checkpointed its step (recall.run); summary so far
                    bar.close()
                    summarize(cfg)
                    raise KeyboardInterrupt("the same command continues the sweep (the run in progress resumes "
                                            "from its checkpoint)") from None
                if not ok:
                    print(f"sweep: session time spent in {cell.name} (SweepConfig.time_budget_s or the run's "
                          f"session_time_s); run the same command again to continue", file=sys.stderr)
                    break
                bar.update(1)
                if lines:
                    print(f"sweep {cfg.task}: {cell.name} done ({sum(cell_done(cfg, c) for c in grid)}/{len(grid)} "
                          f"cells)", file=sys.stderr, flush=True)
    else:
        env_key = "TPU_VISIBLE_CHIPS" if backend == "tpu" else "CUDA_VISIBLE_DEVICES"
        ids = visible_device_ids(os.environ.get(env_key), n_acc)
        procs = []
        for i in range(n_workers):
            env = dict(os.environ, **{env_key: ids[i % len(ids)] if ids else str(i)})
            if wpd > 1 and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:
                env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.9 / wpd:.3f}"  # each its share of the device
            log = open(os.path.join(cfg.out, f"worker{i}.log"), "a")
            start = [sys.executable, script] if isinstance(script, str) else list(script)  # a file, or a command line
            procs.append((subprocess.Popen([*start, *argv, "--worker_index", str(i), "--no-progress"],
                                           env=env, stdout=log, stderr=subprocess.STDOUT), log))
        done = bar.n
        try:
            while any(p.poll() is None for p, _ in procs):
                time.sleep(2.0)
                now = sum(cell_done(cfg, c) for c in grid)
                bar.update(now - done)
                if lines and now != done:
                    print(f"sweep {cfg.task}: {now}/{len(grid)} cells done", file=sys.stderr, flush=True)
                done = now
        except KeyboardInterrupt:  # Ctrl-C reaches the workers too: each checkpoints its run; wait for them
            print("sweep: interrupted; waiting for the workers to checkpoint their runs (Ctrl-C again to kill them)",
                  file=sys.stderr, flush=True)
            try:
                for p, _ in procs:
                    p.wait()
            except KeyboardInterrupt:
                for p, _ in procs:
                    p.kill()
            for _, log in procs:
                log.close()
            summarize(cfg)
            raise KeyboardInterrupt("the same command continues the sweep") from None
        for p, log in procs:
            log.close()
        bar.update(sum(cell_done(cfg, c) for c in grid) - done)
        bad = [i for i, (p, _) in enumerate(procs) if p.returncode]
        if bad:
            print(f"workers {bad} failed; see {cfg.out}/worker<i>.log", file=sys.stderr)
        elif out_of_budget(cfg) and not all(cell_done(cfg, c) for c in grid):
            print("sweep: time budget spent (SweepConfig.time_budget_s); run the same command again to continue",
                  file=sys.stderr)
    bar.close()
    return summarize(cfg)


def summarize(cfg: SweepConfig) -> Dict[str, Any]:
    """Collect the finished runs of ``cfg``: ``runs.csv`` (one row per run), ``summary.csv`` /
    ``summary.json`` (best learning rate per cell; ``unfinished``: cells with runs still to finish,
    ``in_progress``: the interrupted runs and their checkpointed step, ``not_started``: cells with no
    run begun), ``summary.md``, ``accuracy_vs_dmodel.png`` and, with several learning rates,
    ``accuracy_vs_lr.png`` (every rate; :func:`plot_lrs`). Returns the summary (its ``metric``: the
    task's headline metric, ``best_test_accuracy`` or, for state tracking, ``best_scaled_accuracy``).

    With a seed axis (``cfg.seeds``) a cell's rate is the mean over its finished seeds (the best rate
    has the highest mean): the accuracies and steps of ``summary.*`` are means, with their standard
    deviation over the seeds (``<field>_std``, None for one seed), ``n_seeds`` and ``seeds``; the
    table and the plots show mean ± std. Without one, every field is the run's own (as before the
    seed axis)."""
    from gdn_jax.data import TASK_CONFIGS

    metric = "best_" + TASK_CONFIGS[cfg.task].metric
    scaled = metric == "best_scaled_accuracy"
    seeded = bool(cfg.seeds)
    rows, rates, best, failed, pending, in_progress = [], [], [], [], [], []
    for cell in cells(cfg):
        runs, started = [], False
        for lr in cfg.lrs:
            group = []
            for seed in seeds(cfg):
                path = _results_path(cfg, cell, lr, seed)
                r = _load(path)
                if r is None:
                    if os.path.exists(os.path.join(os.path.dirname(path), "error.txt")):
                        failed.append(f"{cell.name} {_run_label(lr, seed)}")
                    step = _checkpoint_step(cfg, cell, lr, seed)
                    if step is not None:  # interrupted (time budget, a stopped process): resumes from its checkpoint
                        in_progress.append(f"{cell.name} {_run_label(lr, seed)} (checkpoint at step {step})")
                        started = True
                    continue
                row = _run_row(cell, lr, r)
                if seeded:
                    row["seed"] = seed
                rows.append(row)
                group.append(row)
            if group:
                runs.append(_mean_over_seeds(group) if seeded else group[0])
        rates += runs
        if (runs or started) and not cell_done(cfg, cell):
            pending.append(cell.name)
        if runs:
            # best LR: highest best-over-evaluations test accuracy, then highest final accuracy, then fewest steps
            # (with seeds: their means)
            b = max(runs, key=lambda x: (x["best_test_accuracy"], x["final_test_accuracy"], -x["steps"]))
            best.append(dict(b, lrs_tried=[x["lr"] for x in runs]))
    for name, data in (("runs.csv", rows), ("summary.csv", best)):
        if data:
            with open(os.path.join(cfg.out, name), "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(data[0].keys()))
                w.writeheader()
                w.writerows(data)
    summary = {"task": cfg.task, "metric": metric,
               "failed": failed, "unfinished": pending, "in_progress": in_progress,
               "not_started": [c.name for c in cells(cfg) if c.name not in {b["cell"] for b in best}
                               and c.name not in pending],
               "cells": best, "sweep": dataclasses.asdict(cfg)}
    with open(os.path.join(cfg.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if best:
        plot(best, os.path.join(cfg.out, "accuracy_vs_dmodel.png"), scaled=scaled)
    if len({r["lr"] for r in rows}) > 1:
        plot_lrs(rates, os.path.join(cfg.out, "accuracy_vs_lr.png"), scaled=scaled, runs=rows if seeded else None)
    with open(os.path.join(cfg.out, "summary.md"), "w") as f:
        f.write(markdown_table(cfg, best, pending, metric))
    return summary


def _run_row(cell: Cell, lr: float, r: Dict[str, Any]) -> Dict[str, Any]:
    """One finished run's row of ``runs.csv`` (from its results.json ``r``)."""
    axes = _task_axes(cell.task)  # an axis the task has not: None (its run never used the value)
    return dict(cell=cell.name, task=cell.task, mixer=cell.mixer, d_model=cell.d_model,
                seq_len=cell.seq_len if "seq_len" in axes else None,
                num_kv_pairs=cell.num_kv_pairs if "num_kv_pairs" in axes else None,
                neg_eigval=cell.neg_eigval, lr=lr,
                best_test_accuracy=r["best_test_accuracy"], final_test_accuracy=r["final_test_accuracy"],
                best_scaled_accuracy=r.get("best_scaled_accuracy"),
                final_scaled_accuracy=r.get("final_scaled_accuracy"), steps=r["steps"],
                reached_target=r["reached_target"], stopped_by_time=r.get("stopped_by_time", False),
                diverged=r.get("diverged", False), epochs=_epochs(r), hit_budget=_hit_budget(r),
                wall_s=r["wall_s"], num_params=r["num_params"], device=r["device_kind"],
                backend=",".join(r.get("backend_resolved") or []) or "-")


#: The fields of a rate's row that are averaged over its seeds, with their standard deviation beside them.
SPREAD_FIELDS = ("best_test_accuracy", "final_test_accuracy", "best_scaled_accuracy", "final_scaled_accuracy",
                 "steps", "epochs")


def _mean_over_seeds(group: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One row for the seeds of a (cell, learning rate): :data:`SPREAD_FIELDS` as the mean and
    ``<field>_std`` (the sample standard deviation, ddof 1; None for one seed), ``wall_s`` the mean,
    ``reached_target`` only if every seed reached it, ``stopped_by_time`` / ``diverged`` /
    ``hit_budget`` if any seed did, ``n_seeds`` and ``seeds``."""
    import numpy as np

    out: Dict[str, Any] = {}
    for k, v in group[0].items():
        if k == "seed":
            continue
        if k not in SPREAD_FIELDS + ("wall_s",):
            out[k] = v
            continue
        vals = [g[k] for g in group if g[k] is not None]
        full = len(vals) == len(group)  # else not measured for every seed (e.g. epochs in stream mode)
        out[k] = float(np.mean(vals)) if full else None
        if k != "wall_s":
            out[k + "_std"] = float(np.std(vals, ddof=1)) if full and len(vals) > 1 else None
    out["reached_target"] = all(g["reached_target"] for g in group)
    for k in ("stopped_by_time", "diverged", "hit_budget"):
        out[k] = any(g[k] for g in group)
    out["n_seeds"] = len(group)
    out["seeds"] = [g["seed"] for g in group]
    return out


def _epochs(r: Dict[str, Any]) -> Optional[float]:
    """Epochs of the fixed training set a finished run trained (None in stream mode)."""
    c = r.get("config", {})
    if c.get("data_mode") != "fixed":
        return None
    spe = c["train_examples"] // c["batch_size"]
    return round(r["steps"] / spe, 2) if spe else None


def _hit_budget(r: Dict[str, Any]) -> bool:
    """The run trained to the end of its schedule (``steps``: the epoch budget with
    ``SweepConfig.epochs``) without reaching the target."""
    c = r.get("config", {})
    return (not r.get("reached_target")) and r["steps"] >= c.get("steps", float("inf"))


def markdown_table(cfg: SweepConfig, best: List[Dict[str, Any]], pending: Sequence[str], metric: str) -> str:
    """``summary.md``: one table per (seq_len, kv pairs), mixers x d_model, each cell its best run's
    accuracy % (steps or epochs, lr; with seeds: mean ± std over them, the number of seeds, the mean
    steps or epochs); ``‡``: hit the step / epoch budget without reaching the target (any seed);
    ``(partial)``: learning rates still to run; ``— (in progress)``: no run finished yet, one
    checkpointed; ``—``: not run yet."""
    key = metric
    grid = cells(cfg)
    by = {b["cell"]: b for b in best}
    mean = (f"mean ± std over seeds {', '.join(map(str, cfg.seeds))}, steps / epochs their mean; "
            if len(cfg.seeds) > 1 else f"seed {cfg.seeds[0]}; " if cfg.seeds else "")
    out = [f"# {cfg.task} sweep `{cfg.out}` ({mean}{metric}; ‡ = hit the {'epoch' if cfg.epochs else 'step'} budget "
           f"without reaching the target; (partial) = learning rates still to run; — (in progress) = no run "
           f"finished yet, one checkpointed; — = not run yet)\n"]
    axes = _task_axes(cfg.task)
    for L, n in sorted({(c.seq_len, c.num_kv_pairs) for c in grid}):
        sel = [c for c in grid if (c.seq_len, c.num_kv_pairs) == (L, n)]
        ds = sorted({c.d_model for c in sel})
        labels = list(dict.fromkeys(c.label for c in sel))
        head = ", ".join(([f"L {L}"] if "seq_len" in axes else []) + ([f"{n} pairs"] if "num_kv_pairs" in axes else []))
        out.append(f"\n## {head or 'lengths of the task config'}\n\n| mixer | " + " | ".join(f"d {d}" for d in ds) + " |\n|---|"
                   + "---|" * len(ds) + "\n")
        for lab in labels:
            row = []
            for d in ds:
                c = next((c for c in sel if c.label == lab and c.d_model == d), None)
                b = by.get(c.name) if c else None
                if b is None:
                    row.append("— (in progress)" if c is not None and c.name in pending else "—")
                    continue
                v, sd = b.get(key), b.get(key + "_std")
                amount = f"{b['epochs']:g} ep" if b.get("epochs") is not None else f"{b['steps']:.0f} steps"
                seeds_note = f"{b['n_seeds']} seeds, " if b.get("n_seeds", 1) > 1 else ""
                spread = f" ± {100 * sd:.1f}" if sd is not None else ""
                row.append(f"{100 * v:.1f}{spread} ({seeds_note}{amount}, lr {b['lr']:.3g})"
                           + (" ‡" if b.get("hit_budget") else "")
                           + (" (partial)" if c.name in pending else "") + (" diverged" if b.get("diverged") else ""))
            out.append(f"| {lab} | " + " | ".join(row) + " |\n")
    return "".join(out)


def _lr_ticks(ax, lrs: Sequence[float]) -> None:
    """Log-scale x ticks at the swept learning rates themselves, labelled ``%.2g`` (no minor labels:
    rates within a decade used to print overlapping ``2×10⁻³ 3×10⁻³`` labels), slanted when many."""
    import matplotlib.ticker as mticker

    lrs = sorted(set(lrs))
    ax.xaxis.set_major_locator(mticker.FixedLocator(lrs))
    ax.xaxis.set_major_formatter(mticker.FixedFormatter([f"{x:.2g}" for x in lrs]))
    ax.xaxis.set_minor_formatter(mticker.NullFormatter())
    if len(lrs) > 3:
        ax.tick_params(axis="x", labelrotation=35)


def plot_lrs(rows: List[Dict[str, Any]], path: str, *, scaled: bool = False,
             runs: Optional[List[Dict[str, Any]]] = None) -> None:
    """Accuracy against learning rate, one row per (cell, rate): one panel per (seq_len, kv pairs,
    d_model), one line per mixer; a filled marker where the run reached the target, an open one
    where it trained its whole step / epoch budget without (``‡``), a cross where it was cut short
    by its time limit. With seeds (``runs``: one row per seed run; ``rows``: their means with
    ``<metric>_std``), the mean with a ±std bar and every seed as a small dot. Shows how the cell's
    best in ``summary.csv`` was picked (Zoology's sweeps report the best learning rate per cell)."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "best_scaled_accuracy" if scaled else "best_test_accuracy"
    panels = sorted({(r["seq_len"], r["num_kv_pairs"], r["d_model"]) for r in rows})
    ncol = min(4, len(panels))
    nrow = -(-len(panels) // ncol)
    width = max(3.8 * ncol, 6.0)
    fig, axes = plt.subplots(nrow, ncol, figsize=(width, 3.3 * nrow + 0.5), squeeze=False)
    labels = sorted({_line_label(r["mixer"], r["neg_eigval"]) for r in rows})
    colors = {lab: f"C{i}" for i, lab in enumerate(labels)}
    all_lrs = [r["lr"] for r in rows]
    for ax, (L, n, d) in zip(axes.flat, panels):
        here = lambda r: (r["seq_len"], r["num_kv_pairs"], r["d_model"]) == (L, n, d)  # noqa: E731
        sel = [r for r in rows if here(r)]
        for lab in labels:
            pts = sorted(((r["lr"], r[key], r) for r in sel
                          if _line_label(r["mixer"], r["neg_eigval"]) == lab), key=lambda p: p[0])
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", color=colors[lab], label=lab)
            for lr, acc, r in pts:
                cut = r["stopped_by_time"] and not r["reached_target"]
                ax.plot([lr], [acc], "x" if cut else "o", color=colors[lab],
                        markerfacecolor=colors[lab] if r["reached_target"] else "none")
                if r.get(key + "_std") is not None:
                    ax.errorbar([lr], [acc], yerr=[r[key + "_std"]], color=colors[lab], capsize=3, lw=1)
            for r in runs or ():
                if here(r) and _line_label(r["mixer"], r["neg_eigval"]) == lab:
                    ax.plot([r["lr"]], [r[key]], ".", color=colors[lab], alpha=0.45, ms=4)
        ax.set_title(f"L={L}, {n} pairs, d={d}" if n else f"L={L}, d={d}", fontsize=10)
        ax.set(xlabel="learning rate", ylabel="scaled accuracy" if scaled else "test accuracy",
               ylim=(-0.05 if scaled else 0, 1.02))
        ax.set_xscale("log")
        ax.set_xlim(min(all_lrs) / 1.6, max(all_lrs) * 1.6)  # the same grid in every panel
        _lr_ticks(ax, all_lrs)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    what = "best test accuracy per rate" + (" (mean ± std over seeds; dots: each seed)" if runs else " (one run each)")
    note = "filled: reached the target; open: whole budget; x: time limit"
    fig.suptitle(textwrap.fill(f"{what}. {note}", width=int(width * 13)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot(best: List[Dict[str, Any]], path: str, *, scaled: bool = False) -> None:
    """Zoology-style figure: accuracy against d_model, one panel per (seq_len, kv pairs), one line per
    mixer (with seeds: the mean and a ±std bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gdn_jax.data import TASK_CONFIGS

    key = "best_scaled_accuracy" if scaled else "best_test_accuracy"
    panels = sorted({(b["seq_len"], b["num_kv_pairs"]) for b in best})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.7), squeeze=False)
    for ax, (L, n) in zip(axes[0], panels):
        sel = [b for b in best if (b["seq_len"], b["num_kv_pairs"]) == (L, n)]
        for label in sorted({_line_label(b["mixer"], b["neg_eigval"]) for b in sel}):
            pts = sorted((b["d_model"], b[key], b.get(key + "_std")) for b in sel
                         if _line_label(b["mixer"], b["neg_eigval"]) == label)
            if any(p[2] is not None for p in pts):
                ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] or 0.0 for p in pts], fmt="o-",
                            capsize=3, label=label)
            else:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
        task = sel[0]["task"]
        axes_ = _task_axes(task)
        title = (TASK_CONFIGS[task].title + (f" L={L}" if "seq_len" in axes_ else "")
                 + (f", {n} pairs" if "num_kv_pairs" in axes_ else ""))
        ax.set_title(title, fontsize=10)
        ax.set(xlabel="d_model", ylabel="scaled accuracy" if scaled else "test accuracy",
               ylim=(-0.05 if scaled else 0, 1.02))
        ax.set_xscale("log", base=2)
        ds = sorted({b["d_model"] for b in sel})
        ax.set_xticks(ds)
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
        if len(ds) == 1:
            ax.set_xlim(ds[0] / 2, ds[0] * 2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
