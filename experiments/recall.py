"""Train a small LM on one synthetic task (MQAR, needle-in-a-haystack, parity / modular arithmetic)
and report test accuracy.

A thin wrapper of :func:`gdn_jax.commands.recall` (installed as the command ``gdn-recall``). Every
setting is a field of :class:`gdn_jax.recall.RecallConfig` (the one place for defaults) and a
command-line flag (dashes or underscores; lists space- or comma-separated; ``--help``)::

    python experiments/recall.py --steps 50 --warmup 5 --eval_every 25      # MQAR, 2-layer GDN
    python experiments/recall.py --mixer attention --lr 1e-3                 # its own new folder
    python experiments/recall.py --mixer hybrid --num-layers 4               # GDN 3:1 gated attention
    python experiments/recall.py --task niah --seq_len 1024 --vocab_size 128
    python experiments/recall.py --task state_tracking --mixer deltanet --allow_neg_eigval
    python experiments/recall.py --resume --max_steps 3000                   # continue the newest mqar run
    python experiments/recall.py --out runs/mine --resume                    # continue the run in runs/mine
    python experiments/recall.py --logger tensorboard      # or wandb (WANDB_MODE=offline); docs/loggers_and_sweeps.md

Each run writes to its own folder (default ``runs/<task>/<mixer>-<date>-<time>``, printed at the
start; ``runs/<task>/latest`` points to the newest): ``config.json``, ``results.json``,
``curves.png`` and orbax checkpoints in ``ckpt/`` (or ``--ckpt_dir``). A folder that holds files is
refused unless ``--resume`` (continue it, with the settings saved in its ``config.json``: flags
given must not conflict) or ``--overwrite`` (replace it). ``gdn_jax.recall.load_run(folder)`` reads
a run back. A bad setting exits with a message naming the flag. docs/experiment_tools.md.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from gdn_jax.commands import recall as _recall
from gdn_jax.recall import RecallConfig as Config, build, run  # noqa: F401  (re-exported for scripts/tests)


def main(argv: Optional[Sequence[str]] = None, *, prog: str = "recall.py") -> Dict[str, Any]:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run it (:func:`gdn_jax.commands.recall`); returns the results."""
    return _recall(argv, prog=prog)


if __name__ == "__main__":
    main()
