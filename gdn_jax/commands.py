"""The command-line programs: ``gdn-recall``, ``gdn-mqar`` and ``gdn-sweep`` (console entry points of
``pip install .``; ``experiments/recall.py``, ``experiments/mqar.py`` and ``experiments/sweep.py`` are
thin wrappers of the same functions; ``python -m gdn_jax.commands recall|mqar|sweep ...`` too).

Every flag is a field of the program's config dataclass (:class:`gdn_jax.recall.RecallConfig`,
:class:`gdn_jax.sweep.SweepConfig`), parsed by :mod:`gdn_jax.cli` in its convention
(:data:`gdn_jax.cli.CONVENTION`: dashes = underscores; lists space- or comma-separated). A bad
setting (the library's ``ValueError``/``TypeError``) exits with status 1 and a message naming the
flag; Ctrl-C checkpoints the run in progress and exits with status 130.

``recall --resume`` continues a run from its folder (``--out``, default the task's newest run,
``runs/<task>/latest``) with the settings saved in its ``config.json``: only the flags given on the
command line are applied, and one that conflicts with the run (any but
:data:`gdn_jax.recall.RESUME_FREE_FIELDS` such as ``--max_steps``, ``--eval_every``) is refused.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Sequence

__all__ = ["main", "mqar", "mqar_main", "recall", "recall_main", "sweep", "sweep_main"]

_RECALL_DESCRIPTION = ("Train a small LM on one synthetic task (MQAR, needle-in-a-haystack, state tracking) and report "
                       "test accuracy. Each run writes to its own folder (default runs/<task>/<mixer>-<date>-<time>, "
                       "runs/<task>/latest points to the newest): results.json, curves.png, config.json and orbax "
                       "checkpoints in ckpt/. --resume continues a run with its saved settings (flags given are "
                       "applied; conflicting ones refused); --overwrite replaces the run in an existing --out.")


def recall(argv: Optional[Sequence[str]] = None, *, prog: str = "gdn-recall") -> Dict[str, Any]:
    """Parse ``argv`` (default ``sys.argv[1:]``) into a :class:`gdn_jax.recall.RecallConfig` and
    :func:`gdn_jax.recall.run` it (``--resume``: :func:`gdn_jax.recall.resume_config` of the run's
    folder with the flags given); returns the results (or the interrupted session's record).

    Raises:
      SystemExit: a bad flag (status 2), a bad setting (1), Ctrl-C (130).
    """
    from gdn_jax.cli import dataclass_from_args, exit_on_error, make_parser
    from gdn_jax.recall import RecallConfig, resume_config, run

    parser = make_parser(RecallConfig, prog=prog, description=_RECALL_DESCRIPTION)
    ns = parser.parse_args(None if argv is None else list(argv))
    given = dict(vars(ns))  # the flags on the command line only (the parser's defaults are SUPPRESS)
    with exit_on_error(prog, RecallConfig):
        cfg = dataclass_from_args(RecallConfig, ns)
        if cfg.resume:
            given.pop("resume")
            cfg = resume_config(given.pop("out", None), {k: getattr(cfg, k) for k in given}, task=cfg.task)
        return run(cfg)[0]


def mqar(argv: Optional[Sequence[str]] = None, *, prog: str = "gdn-mqar") -> Dict[str, Any]:
    """:func:`recall` under the name of the README's default run (the default task is MQAR)."""
    return recall(argv, prog=prog)


def sweep(argv: Optional[Sequence[str]] = None, *, prog: str = "gdn-sweep",
          script: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Parse ``argv`` into a :class:`gdn_jax.sweep.SweepConfig` (``--preset`` first, explicit flags win),
    :func:`gdn_jax.sweep.run_sweep` it, print each cell's best run; returns the summary. ``script``:
    the command line that starts this program again (the sweep's worker processes; default
    ``python -m gdn_jax.commands sweep``).

    Raises:
      SystemExit: a bad flag or setting, a run that failed (status 1), Ctrl-C (130).
    """
    from gdn_jax.cli import dataclass_from_args, exit_on_error, make_parser
    from gdn_jax.sweep import PRESETS, SweepConfig, apply_preset, run_sweep

    argv = list(sys.argv[1:] if argv is None else argv)
    desc = ("Sweep mixers x d_model x sequence length x kv pairs x learning rate on a synthetic task. Presets "
            f"(--preset): {', '.join(sorted(PRESETS))}; --base field=value sets any gdn_jax.recall.RecallConfig "
            "field for every run. Re-running the same command resumes the sweep.")
    parser = make_parser(SweepConfig, prog=prog, description=desc)
    ns = parser.parse_args(argv)
    explicit = set(vars(ns))  # the flags given (the parser's defaults are SUPPRESS)
    cfg = dataclass_from_args(SweepConfig, ns)
    with exit_on_error(prog, SweepConfig):
        cfg = apply_preset(cfg, explicit)
        summary = run_sweep(cfg, argv=argv, script=list(script or [sys.executable, "-m", "gdn_jax.commands", "sweep"]))
    scaled = summary.get("metric") == "best_scaled_accuracy"
    for b in summary.get("cells", []):
        print(f"{b['cell']:<44} lr {b['lr']:<7g} best acc {b['best_test_accuracy']:.4f}"
              + (f" (scaled {b['best_scaled_accuracy']:.3f})" if scaled else "")
              + f"  final {b['final_test_accuracy']:.4f}  steps {b['steps']}  {b['wall_s']:.0f}s"
              + ("  DIVERGED" if b.get("diverged") else ""))
    if summary.get("failed"):
        raise SystemExit(f"{prog}: {len(summary['failed'])} run(s) failed (see error.txt in their folders): "
                         + ", ".join(summary["failed"][:10]))
    return summary


def recall_main() -> None:
    """Console entry point ``gdn-recall`` (:func:`recall`; exit status 0 when it finishes)."""
    recall()


def mqar_main() -> None:
    """Console entry point ``gdn-mqar`` (:func:`mqar`)."""
    mqar()


def sweep_main() -> None:
    """Console entry point ``gdn-sweep`` (:func:`sweep`)."""
    sweep()


_PROGRAMS = {"recall": recall, "mqar": mqar, "sweep": sweep}


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m gdn_jax.commands PROGRAM [flags]``: PROGRAM one of recall, mqar, sweep."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in _PROGRAMS:
        raise SystemExit(f"usage: python -m gdn_jax.commands {{{','.join(_PROGRAMS)}}} [flags] (--help for each)")
    _PROGRAMS[argv[0]](argv[1:], prog=f"gdn-{argv[0]}")


if __name__ == "__main__":
    main()
