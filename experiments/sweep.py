"""Sweep mixers x d_model x sequence length x kv pairs x learning rate on a synthetic task.

A thin script over :mod:`gdn_jax.sweep` (every flag is a field of :class:`gdn_jax.sweep.SweepConfig`;
``--base field=value ...`` sets any :class:`gdn_jax.recall.RecallConfig` field for every run)::

    python experiments/sweep.py --preset cpu_mqar --out runs/sweep_cpu          # ~5 min on 2 CPU cores
    python experiments/sweep.py --preset h200_mqar --out runs/mqar_h200         # L 512, 64 pairs, d 64-256
    python experiments/sweep.py --preset h200_parity --out runs/parity_h200     # beta (0,1) vs (0,2)
    python experiments/sweep.py --preset zoology_mqar --out runs/zoology_mqar --time_budget_s 500  # in pieces
    python experiments/sweep.py --preset zoology_fig2 --out runs/zoology_fig2 --time_budget_s 500
    python experiments/sweep.py --task niah --mixers gdn attention --d_models 64 128 \\
        --seq_lens 1024 2048 --lrs 1e-3 3e-3 --base vocab_size=128 steps=2000 --out runs/niah
    python experiments/sweep.py --preset cpu_mqar --seeds 0 1 2 --logger tensorboard --out runs/seeds  # mean ± std

Re-running the same command resumes (finished runs are skipped, interrupted ones continue from
their checkpoint; ``--time_budget_s`` stops the sweep by itself, checkpointing the run in progress).
With several GPUs, one worker per GPU (``--workers_per_device N``: N per device, also on the CPU);
``--lrs_in_parallel`` lets the workers take single (cell, learning rate) runs, so a cell's rates
train at once (in one process it changes nothing). Writes ``runs.csv``, ``summary.csv``, ``summary.json``,
``summary.md`` and ``accuracy_vs_dmodel.png`` in ``--out``.
A bad setting (the library's ``ValueError``/``TypeError``) exits with a message naming the flag.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Dict, Optional, Sequence

from gdn_jax.cli import exit_on_error, parse_dataclass
from gdn_jax.sweep import PRESETS, SweepConfig, apply_preset, run_sweep


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Parse ``argv`` into a :class:`SweepConfig` (preset first, explicit flags win) and run it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    desc = (__doc__.split("\n")[0] + f" Presets (--preset): {', '.join(sorted(PRESETS))}; "
            "--base field=value sets any gdn_jax.recall.RecallConfig field for every run; see README.md.")
    cfg = parse_dataclass(SweepConfig, argv, prog="sweep.py", description=desc)
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}  # --name value and --name=value
    explicit = {f.name for f in dataclasses.fields(SweepConfig)
                if f"--{f.name}" in given or f"--no-{f.name}" in given}
    with exit_on_error("sweep.py", SweepConfig):
        cfg = apply_preset(cfg, explicit)
        summary = run_sweep(cfg, argv=argv, script=os.path.abspath(__file__))
    scaled = summary.get("metric") == "best_scaled_accuracy"
    for b in summary.get("cells", []):
        print(f"{b['cell']:<44} lr {b['lr']:<7g} best acc {b['best_test_accuracy']:.4f}"
              + (f" (scaled {b['best_scaled_accuracy']:.3f})" if scaled else "")
              + f"  final {b['final_test_accuracy']:.4f}  steps {b['steps']}  {b['wall_s']:.0f}s"
              + ("  DIVERGED" if b.get("diverged") else ""))
    if summary.get("failed"):
        raise SystemExit(f"sweep.py: {len(summary['failed'])} run(s) failed (see error.txt in their folders): "
                         + ", ".join(summary["failed"][:10]))
    return summary


if __name__ == "__main__":
    main()
