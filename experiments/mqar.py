"""Train a small LM on MQAR (Zoology multi-query associative recall) and report test accuracy.

The same script as ``experiments/recall.py`` (whose default task is MQAR), kept under this name for
the README's default run::

    python experiments/mqar.py --steps 50 --warmup 5 --eval_every 25
    python experiments/mqar.py --mixer attention --lr 1e-3 --out runs/mqar_attn
    python experiments/mqar.py --out runs/mqar_attn --resume          # continue from the latest ckpt

Installed as the command ``gdn-mqar`` (:func:`gdn_jax.commands.mqar`). Every flag is a field of
:class:`gdn_jax.recall.RecallConfig`; outputs (``--out``, default a new ``runs/mqar/<mixer>-<date>-<time>``,
``runs/mqar/latest`` pointing to it): ``config.json``, ``results.json``, ``curves.png`` and orbax
checkpoints in ``ckpt/``.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from recall import Config, build, main as _main, run  # noqa: E402,F401  (re-exported for scripts/tests)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Parse ``argv`` (default ``sys.argv[1:]``) into a :class:`Config` and :func:`run` it; returns the results."""
    return _main(argv, prog="mqar.py")


if __name__ == "__main__":
    main()
