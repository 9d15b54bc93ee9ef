"""Metric loggers: TensorBoard (``tensorboardX``) and Weights & Biases behind one option.

:func:`make_logger` returns a :class:`Logger` for ``kind`` in :data:`LOGGERS`:

* ``"none"``: a :class:`Logger` that does nothing (the default of ``RecallConfig.logger``);
* ``"tensorboard"``: :class:`TensorBoardLogger`, a ``tensorboardX.SummaryWriter`` event file in
  ``logdir`` (``tensorboard --logdir <folder>`` shows every run below the folder);
* ``"wandb"``: :class:`WandbLogger`, a ``wandb`` run whose files go under ``logdir/wandb/``. It runs
  offline without a network when ``WANDB_MODE=offline`` is set (``wandb sync <logdir>/wandb/offline-run-*``
  uploads it later); online it needs ``wandb login`` (or ``WANDB_API_KEY``) first.

Both writers come with the optional extra ``pip install -e '.[loggers]'``; asking for one that is
not installed is an ``ImportError`` naming the extra. Every logger takes scalars as Python numbers,
NumPy or JAX scalars (``float()`` of each) at an integer step::

    from gdn_jax.loggers import make_logger

    with make_logger("tensorboard", logdir="runs/my_run/tb", config={"lr": 3e-3}) as logger:
        for step in range(num_steps):
            state, metrics = train_step(state, batch)   # gdn_jax.training.make_train_step
            if step % 10 == 0:
                logger.log({"train/loss": metrics["loss"], "train/accuracy": metrics["accuracy"]}, step)

:func:`gdn_jax.recall.run` opens one from ``RecallConfig.logger`` and logs ``train/loss``,
``train/accuracy`` and ``train/lr`` at every train-curve point, ``test/loss`` and
``test/accuracy`` (``test/scaled_accuracy``) at every evaluation and the results' headline numbers
as the run's summary (docs/loggers_and_sweeps.md).
"""
from __future__ import annotations

import json
import math
import numbers
import os
from typing import Any, Callable, Mapping, Optional, Sequence

__all__ = ["LOGGERS", "CallbackLogger", "Logger", "MultiLogger", "TensorBoardLogger", "WandbLogger", "make_logger",
           "require"]

#: The values of ``RecallConfig.logger`` / ``SweepConfig.logger``.
LOGGERS = ("none", "tensorboard", "wandb")

_PACKAGES = {"tensorboard": "tensorboardX", "wandb": "wandb"}


def require(kind: str) -> None:
    """Import the package that logger ``kind`` writes with, or raise ``ImportError`` naming the
    ``loggers`` extra; ``ValueError`` for a ``kind`` not in :data:`LOGGERS`."""
    if kind not in LOGGERS:
        raise ValueError(f"logger must be one of {LOGGERS}, got {kind!r}")
    if kind == "none":
        return
    try:
        __import__(_PACKAGES[kind])
    except ImportError as e:
        raise ImportError(f"logger {kind!r} needs the package {_PACKAGES[kind]!r}: pip install -e '.[loggers]' "
                          f"(or pip install {_PACKAGES[kind]})") from e


def _scalars(metrics: Mapping[str, Any]) -> dict:
    """``{name: float}`` of ``metrics``; None values are left out (a metric not measured yet)."""
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a mapping of name -> scalar, got {type(metrics).__name__}")
    out = {}
    for k, v in metrics.items():
        if v is None:
            continue
        try:
            out[str(k)] = float(v)
        except (TypeError, ValueError):
            raise TypeError(f"metric {k!r} must be a scalar (a number, NumPy or JAX scalar), got {v!r}") from None
    return out


def _step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    return int(step)


class Logger:
    """A logger that does nothing (``kind="none"``); the base of the others.

    Methods: :meth:`log` (scalars at a step), :meth:`log_config` (the run's settings, once),
    :meth:`log_summary` (the run's final numbers), :meth:`close`. A logger is a context manager
    (``close`` on exit)."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record the scalars ``metrics`` (name -> number) at ``step`` (int >= 0).

        Raises: TypeError for a value that is not a scalar, ValueError for a bad step."""
        _scalars(metrics), _step(step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Record the run's settings (a JSON-serialisable mapping)."""

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """Record the run's final numbers (name -> number; other values are skipped)."""

    def close(self) -> None:
        """Flush and release the writer (idempotent)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _numbers_only(summary: Mapping[str, Any]) -> dict:
    return {k: float(v) for k, v in summary.items()
            if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v))}


class TensorBoardLogger(Logger):
    """Scalars to a TensorBoard event file in ``logdir`` (``tensorboardX.SummaryWriter``): one
    ``add_scalar`` per metric (its tag the metric's name, e.g. ``train/loss``); the config and the
    summary as text (tags ``config`` and ``summary``, JSON). Raises ImportError without tensorboardX."""

    def __init__(self, logdir: str):
        require("tensorboard")
        from tensorboardX import SummaryWriter

        self.logdir = os.path.abspath(logdir)
        self.writer = SummaryWriter(self.logdir)
        self._closed = False

    def log(self, metrics, step):
        vals, step = _scalars(metrics), _step(step)
        for k, v in vals.items():
            self.writer.add_scalar(k, v, step)

    def log_config(self, config):
        self.writer.add_text("config", "```\n" + json.dumps(dict(config), indent=1, default=str) + "\n```", 0)

    def log_summary(self, summary):
        self.writer.add_text("summary", "```\n" + json.dumps(_numbers_only(summary), indent=1) + "\n```", 0)

    def close(self):
        if not self._closed:
            self.writer.close()
            self._closed = True


class WandbLogger(Logger):
    """Scalars to a Weights & Biases run (``wandb.init``; files under ``logdir/wandb/``).

    Args:
      logdir: the folder of the run's W&B files (created).
      project: the W&B project.
      name: the run's display name; group: its group (a sweep's runs share one).
      run_id: a stable id resumes the same W&B run (``resume="allow"``; online), None a new one.
      config: the run's settings.
      mode: ``"online"``, ``"offline"`` or ``"disabled"``; None: W&B's own default (the
        ``WANDB_MODE`` environment variable, else online).

    Raises ImportError without wandb (``wandb.init``'s own errors, e.g. no login online, pass through).
    """

    def __init__(self, logdir: str, *, project: str = "gdn_jax", name: Optional[str] = None,
                 group: Optional[str] = None, run_id: Optional[str] = None,
                 config: Optional[Mapping[str, Any]] = None, mode: Optional[str] = None):
        require("wandb")
        import wandb

        self.logdir = os.path.abspath(logdir)
        os.makedirs(self.logdir, exist_ok=True)
        kw = dict(project=project, dir=self.logdir, name=name, group=group, config=dict(config or {}))
        if run_id is not None:
            kw.update(id=run_id, resume="allow")
        if mode is not None:
            kw["mode"] = mode
        self.run = wandb.init(**kw)
        self._closed = False

    def log(self, metrics, step):
        vals, step = _scalars(metrics), _step(step)
        if vals:
            self.run.log(vals, step=step)

    def log_config(self, config):
        self.run.config.update(dict(config), allow_val_change=True)

    def log_summary(self, summary):
        self.run.summary.update(_numbers_only(summary))

    def close(self):
        if not self._closed:
            self.run.finish()
            self._closed = True


class CallbackLogger(Logger):
    """Calls ``fn(metrics: dict of floats, step: int)`` at every :meth:`log` (e.g. a progress bar's
    postfix: :func:`gdn_jax.sweep.run_sweep` shows the run in flight so)."""

    def __init__(self, fn: Callable[[dict, int], None]):
        if not callable(fn):
            raise TypeError(f"CallbackLogger needs a callable fn(metrics, step), got {fn!r}")
        self.fn = fn

    def log(self, metrics, step):
        self.fn(_scalars(metrics), _step(step))


class MultiLogger(Logger):
    """Every call goes to each of ``loggers`` in turn; :meth:`close` closes them all (the first
    error raised afterwards)."""

    def __init__(self, loggers: Sequence[Logger]):
        self.loggers = list(loggers)

    def log(self, metrics, step):
        for lg in self.loggers:
            lg.log(metrics, step)

    def log_config(self, config):
        for lg in self.loggers:
            lg.log_config(config)

    def log_summary(self, summary):
        for lg in self.loggers:
            lg.log_summary(summary)

    def close(self):
        first = None
        for lg in self.loggers:
            try:
                lg.close()
            except Exception as e:  # close the others first
                first = first or e
        if first is not None:
            raise first


def make_logger(kind: str, *, logdir: str, config: Optional[Mapping[str, Any]] = None, project: str = "gdn_jax",
                name: Optional[str] = None, group: Optional[str] = None, run_id: Optional[str] = None) -> Logger:
    """The logger of ``kind`` (:data:`LOGGERS`) writing under ``logdir`` (TensorBoard: the event
    files there; W&B: ``logdir/wandb/``), with ``config`` recorded. ``project``, ``name``,
    ``group``, ``run_id``: W&B only (:class:`WandbLogger`).

    Raises:
      ValueError: ``kind`` not in :data:`LOGGERS`.
      ImportError: the writer's package is not installed (``pip install -e '.[loggers]'``).
    """
    require(kind)
    if kind == "none":
        return Logger()
    if kind == "tensorboard":
        lg: Logger = TensorBoardLogger(logdir)
        if config is not None:
            lg.log_config(config)
        return lg
    return WandbLogger(logdir, project=project, name=name, group=group, run_id=run_id, config=config)
