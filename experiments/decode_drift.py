"""Drift of step-by-step decoding against one chunked forward over the same tokens (see docs/inference.md).

A small LM (random init; embeddings N(0, 1) so that logits are O(1)) prefills one token, then
decodes ``--steps`` tokens with teacher forcing (jitted ``lax.scan`` of ``LM.decode_step``); each
step's logits are compared with ``model(tokens)`` (the chunked op) at the same position:
RMS-relative error per step. For every activation dtype (``--dtypes``) and decode-state dtype
(``--state_dtypes``: ``LMConfig.state_dtype``; ``--decode_backend`` picks the step's backend), and
for a bfloat16 state also against the float32-state decode of the same model (the drift the bf16
state adds: keys ``.../bf16_state_vs_f32_state``). Writes ``drift.json`` and ``drift.png`` to
``--out`` (default runs/decode_drift)::

    python experiments/decode_drift.py --steps 1024 --out results/decode_drift_cpu
    python experiments/decode_drift.py --state_dtypes bfloat16 --dtypes float32
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
from flax import nnx

from gdn_jax.cli import ArgumentParser, ListAction
from gdn_jax.inference.generate import decode_drift, teacher_forced_logits
from gdn_jax.models import LM, LMConfig


def plot(out, path):
    """The per-step errors of ``out["runs"]`` (log y) against the decode step, legend beside the axes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for key, run in out["runs"].items():
        ax.semilogy(np.arange(1, len(run["rel"]) + 1), run["rel"], label=key, lw=0.6)
    ax.set_xlabel("decode step")
    ax.set_ylabel("RMS-relative logit error")
    ax.set_title("vs the chunked forward; .../bf16_state_vs_f32_state: vs the float32-state decode", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1024)
    ap.add_argument("--out", default="runs/decode_drift")
    ap.add_argument("--dtypes", action=ListAction, nargs="*", default=["float32", "bfloat16"],
                    help="activation / weight dtypes")
    ap.add_argument("--state_dtypes", action=ListAction, nargs="*", default=["float32", "bfloat16"],
                    help="decode-state dtypes (LMConfig.state_dtype)")
    ap.add_argument("--decode_backend", default="auto", help="auto | scan | pallas | fused_layer (CPU: interpret mode)")
    args = ap.parse_args(argv)
    state_dtypes = list(args.state_dtypes)
    bad = [s for s in state_dtypes if s not in ("float32", "bfloat16")]
    if bad or not state_dtypes:
        ap.error(f"--state_dtypes must be a subset of float32, bfloat16, got {args.state_dtypes!r}")
    dtypes = list(args.dtypes)
    if not dtypes:
        ap.error("--dtypes needs at least one dtype (e.g. float32,bfloat16)")
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    models = {"gdn": dict(mixer="gdn"), "hybrid_3to1": dict(hybrid_every=4, hybrid_mixer="gated_attention")}
    try:  # every model config checked before anything runs (LMConfig names the field)
        for dt in dtypes:
            for kw in models.values():
                for sdt in state_dtypes:
                    LMConfig(d_model=64, num_heads=2, num_layers=4, dtype=dt, decode_backend=args.decode_backend,
                             state_dtype=sdt, **kw)
    except (ValueError, TypeError) as e:
        ap.error(str(e))
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        ap.error(f"--out {args.out!r} is a file, not a folder")
    os.makedirs(args.out, exist_ok=True)
    tokens = jax.random.randint(jax.random.key(3), (1, args.steps + 1), 0, 256)
    out = dict(steps=args.steps, jax=jax.__version__, device=str(jax.devices()[0]), decode_backend=args.decode_backend,
               runs={})
    checkpoints = [1, 16, 64, 256, 1024, 4096]

    def report(key, r):
        # first / last 256 steps (the growth check); they overlap when the run has fewer than 512 steps
        out["runs"][key] = dict(rel=r.tolist(), max=float(r.max()), mean=float(r.mean()),
                                mean_first_256=float(r[:256].mean()), mean_last_256=float(r[-256:].mean()),
                                windows_overlap=len(r) < 512)
        at = ", ".join(f"step {s}: {r[s - 1]:.2e}" for s in checkpoints if s <= len(r))
        print(f"{key:44s} max {r.max():.2e}  mean {r.mean():.2e}  ({at})", flush=True)

    for dt in dtypes:
        for name, kw in models.items():
            f32_logits = None
            for sdt in state_dtypes:
                cfg = LMConfig(d_model=64, num_heads=2, num_layers=4, embed_init_std=1.0, dtype=dt,
                               decode_backend=args.decode_backend, state_dtype=sdt, **kw)
                model = LM(cfg, rngs=nnx.Rngs(0))  # the same parameters for every state dtype
                suffix = "" if sdt == "float32" else "/bf16_state"
                r, _ = decode_drift(model, tokens, n_prompt=1)
                report(f"{name}/{dt}{suffix}", r)  # against the chunked forward
                if sdt == "float32":
                    f32_logits = teacher_forced_logits(model, tokens, n_prompt=1)[0]
                else:
                    if f32_logits is None:
                        f32_logits = teacher_forced_logits(LM(dataclasses.replace(cfg, state_dtype="float32"),
                                                              rngs=nnx.Rngs(0)), tokens, n_prompt=1)[0]
                    r, _ = decode_drift(model, tokens, n_prompt=1, reference=f32_logits)
                    report(f"{name}/{dt}/bf16_state_vs_f32_state", r)
    with open(os.path.join(args.out, "drift.json"), "w") as f:
        json.dump(out, f)
    plot(out, os.path.join(args.out, "drift.png"))
    print(f"wrote {args.out}/drift.json, drift.png")


if __name__ == "__main__":
    main()
