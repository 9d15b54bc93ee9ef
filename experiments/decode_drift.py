"""Drift of step-by-step decoding against one chunked forward over the same tokens (see the README, "Inference").

A small LM (random init; embeddings N(0, 1) so that logits are O(1)) prefills one token, then
decodes ``--steps`` tokens with teacher forcing (jitted ``lax.scan`` of ``LM.decode_step``, the
float32-state recurrence); each step's logits are compared with ``model(tokens)`` (the chunked op)
at the same position: RMS-relative error per step. Writes ``drift.json`` and ``drift.png`` to
``--out`` (default runs/decode_drift)::

    python experiments/decode_drift.py --steps 1024 --out results/decode_drift_cpu
"""
from __future__ import annotations

import argparse
import json
import os

import jax
import numpy as np
from flax import nnx

from gdn_jax.inference.generate import decode_drift
from gdn_jax.models import LM, LMConfig


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1024)
    ap.add_argument("--out", default="runs/decode_drift")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    models = {"gdn": dict(mixer="gdn"), "hybrid_3to1": dict(hybrid_every=4, hybrid_mixer="gated_attention")}
    tokens = jax.random.randint(jax.random.key(3), (1, args.steps + 1), 0, 256)
    out = dict(steps=args.steps, jax=jax.__version__, device=str(jax.devices()[0]), runs={})
    checkpoints = [1, 16, 64, 256, 1024, 4096]
    for dt in args.dtypes.split(","):
        for name, kw in models.items():
            cfg = LMConfig(d_model=64, num_heads=2, num_layers=4, embed_init_std=1.0, dtype=dt, **kw)
            r, _ = decode_drift(LM(cfg, rngs=nnx.Rngs(0)), tokens, n_prompt=1)
            key = f"{name}/{dt}"
            out["runs"][key] = dict(rel=r.tolist(), max=float(r.max()), mean=float(r.mean()))
            at = ", ".join(f"step {s}: {r[s - 1]:.2e}" for s in checkpoints if s <= len(r))
            print(f"{key:22s} max {r.max():.2e}  mean {r.mean():.2e}  ({at})", flush=True)
    with open(os.path.join(args.out, "drift.json"), "w") as f:
        json.dump(out, f)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, run in out["runs"].items():
        ax.semilogy(np.arange(1, args.steps + 1), run["rel"], label=key, lw=0.8)
    ax.set_xlabel("decode step")
    ax.set_ylabel("RMS-relative logit error vs chunked forward")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "drift.png"), dpi=100)
    print(f"wrote {args.out}/drift.json, drift.png")


if __name__ == "__main__":
    main()
