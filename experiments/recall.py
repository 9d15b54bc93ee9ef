"""Train a small LM on one synthetic task (MQAR, needle-in-a-haystack, parity / modular arithmetic)
and report test accuracy.

A thin script over :func:`gdn_jax.recall.run`. Every setting is a field of
:class:`gdn_jax.recall.RecallConfig` (the one place for defaults) and a command-line flag::

    python experiments/recall.py --steps 50 --warmup 5 --eval_every 25                   # MQAR, 2-layer GDN
    python experiments/recall.py --mixer attention --lr 1e-3 --out runs/mqar_attn
    python experiments/recall.py --task niah --seq_len 1024 --vocab_size 128
    python experiments/recall.py --task state_tracking --mixer deltanet --allow_neg_eigval
    python experiments/recall.py --mixer attention --lr 1e-3 --out runs/mqar_attn --resume  # continue it
    python experiments/recall.py --logger tensorboard      # or wandb (WANDB_MODE=offline); docs/loggers_and_sweeps.md

``--resume`` continues the checkpoint in ``--out`` (or ``--ckpt_dir``) with the settings given on the
command line, not those of the stopped run: repeat its flags (a model or optimizer that does not
match the checkpoint is an error; other changed settings are listed in a warning).

Outputs (in ``--out``, default ``runs/<task>``): ``results.json``, ``curves.png`` and orbax
checkpoints in ``ckpt/`` (or ``--ckpt_dir``), written at every evaluation and at the end. A run
started without ``--resume`` deletes the old checkpoints of its checkpoint directory. A bad setting
(the library's ``ValueError``/``TypeError``) exits with a message naming the flag.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from gdn_jax.cli import exit_on_error, parse_dataclass
from gdn_jax.recall import RecallConfig as Config, build, run  # noqa: F401  (re-exported for scripts/tests)


def main(argv: Optional[Sequence[str]] = None, *, prog: str = "recall.py") -> Dict[str, Any]:
    """Parse ``argv`` (default ``sys.argv[1:]``) into a :class:`Config` and :func:`run` it; returns the results."""
    cfg = parse_dataclass(Config, argv, prog=prog)
    with exit_on_error(prog, Config):
        return run(cfg)[0]


if __name__ == "__main__":
    main()
