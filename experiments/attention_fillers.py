"""Where softmax attention looks on MQAR with zero fillers: attention mass at the query positions over
training, with and without a key-projection bias, at L 256 (32 pairs) and L 512 (64 pairs).

The question (docs/recall.md, "Attention on fillers"): gdn_jax's 2-layer attention LM
does not learn MQAR when the query region's other tokens are 0 (Zoology's configs for the L 512
figure), and in the failing runs layer-2 attention at the query positions puts most of its weight
on those 0 fillers. This script trains the attention LM (``gdn_jax.recall`` settings, stream data,
``random_non_queries=False``) once per (length, key bias) and, every ``--diag_every`` steps, measures
on ``--diag_examples`` held-out examples, per layer and head, the mean over query positions of the
attention weight on

* ``filler``: the 0 tokens (every 0 is a filler: keys are >= 1, values >= vocab/2);
* ``key``: the context position holding the queried key (``k_j`` with ``k_j`` = the query token);
* ``value``: the position after it (``v_j``, the answer: an induction head's target);
* ``after_value``: the position after that, the next pair's key ``k_{j+1}`` (none for the last
  pair);
* ``self``: the query position itself;
* ``context``: any of the 2N key-value positions (key, value and after_value of the queried pair
  included);

and the accuracy at the query positions. ``--key_bias`` variants: ``none`` (gdn_jax's attention:
no biases, RoPE) and ``k`` (a bias on the key projection, added before RoPE:
``LMConfig(attn_bias="k")``); ``qkvo`` (Zoology's biases) is accepted too. Outputs in ``--out``:
``attention_fillers.json`` (settings, environment and every curve) and ``attention_fillers.png``
(rows: lengths; columns: layer-2 filler mass, layer-2 mass on the answer's position, accuracy).

    python experiments/attention_fillers.py --out results/attention_fillers          # L 256 and 512 (GPU)
    python experiments/attention_fillers.py --tiny --out /tmp/af                     # CPU smoke, seconds

Only what is measured is reported: the curves say where attention looks while it trains, not why.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax.cli import ArgumentParser, ListAction
from gdn_jax import training as T
from gdn_jax.cli import exit_on_error
from gdn_jax.data import make_test_set
from gdn_jax.data.common import IGNORE_INDEX
from gdn_jax.recall import RecallConfig, build

FULL = dict(lengths=(256, 512), pairs=(32, 64), vocab_size=8192, d_model=64, num_heads=2, batch_size=128,
            lr=3e-3, warmup=200, steps=10000, diag_every=250, diag_examples=256, diag_batch=64)
TINY = dict(lengths=(16, 32), pairs=(2, 4), vocab_size=32, d_model=16, num_heads=2, batch_size=8,
            lr=1e-2, warmup=1, steps=4, diag_every=2, diag_examples=8, diag_batch=8)


def make_diag(graphdef, num_kv_pairs: int):
    """``diag(state, inputs, targets) -> sums`` (jitted): per layer and head the summed attention mass
    at the query positions on fillers / the queried key / its value / itself, the number of query
    positions, and the number answered correctly (argmax of the LM head)."""

    def diag(state, inputs, targets):
        model = T.merge_model(graphdef, state)
        B, L = inputs.shape
        qmask = targets != IGNORE_INDEX  # [B, T] query positions
        pos = jnp.arange(L)
        filler = (inputs == 0)[:, None, :]  # [B, 1, S]
        ctx = (pos < 2 * num_kv_pairs)[None, None, :]
        is_key = (inputs[:, None, :] == inputs[:, :, None]) & ctx & (pos % 2 == 0)[None, None, :]  # [B, T, S]
        is_value = jnp.pad(is_key, ((0, 0), (0, 0), (1, 0)))[:, :, :L]  # the position after the key
        is_after = jnp.pad(is_key, ((0, 0), (0, 0), (2, 0)))[:, :, :L] & ctx  # the next pair's key k_{j+1}
        is_self = jnp.eye(L, dtype=bool)[None]
        x = model.embed_tokens(inputs)
        layers = []
        for blk in model.blocks:
            w = blk.mixer.attention_weights(blk.norm1(x))  # [B, H, T, S]
            masses = {}
            for name, m in (("filler", filler), ("key", is_key), ("value", is_value), ("after_value", is_after),
                            ("self", is_self), ("context", ctx)):
                per_t = jnp.einsum("bhts,bts->bht", w, jnp.broadcast_to(m, (B, L, L)).astype(w.dtype))
                masses[name] = jnp.sum(per_t * qmask[:, None, :], axis=(0, 2))  # [H]
            layers.append(masses)
            x = blk(x)
        logits = model.logits(model.norm(x))
        correct = jnp.sum((jnp.argmax(logits, -1) == targets) & qmask)
        return {"layers": layers, "count": jnp.sum(qmask), "correct": correct}

    return jax.jit(diag)


def run_one(cfg: RecallConfig, *, diag_every: int, diag_examples: int, diag_batch: int,
            log=print) -> Dict[str, Any]:
    """Train ``cfg`` (attention) and record the attention masses every ``diag_every`` steps."""
    task, loader, lm_cfg, model_fn, tx = build(cfg)
    mesh = T.make_mesh()
    graphdef, state = T.create_train_state(model_fn(), tx, seed=cfg.seed, mesh=mesh)
    step_fn = T.make_train_step(graphdef, tx, mesh, loss_fn=T.make_lm_loss(task.max_labels))
    diag = make_diag(graphdef, cfg.num_kv_pairs)
    test = make_test_set(dataclasses.replace(task, test_examples=diag_examples))
    batches = T.device_eval_batches(test, batch_size=diag_batch, mesh=mesh)

    def measure(step: int, loss: Optional[float]) -> Dict[str, Any]:
        tot = None
        for b in batches:
            out = diag(state, *b)
            tot = out if tot is None else jax.tree.map(jnp.add, tot, out)
        tot = jax.device_get(tot)
        n = max(int(tot["count"]), 1)
        rec = {"step": step, "train_loss": loss, "accuracy": float(tot["correct"]) / n, "layers": []}
        for lay in tot["layers"]:
            rec["layers"].append({k: {"mean": float(np.mean(v) / n), "heads": [float(h / n) for h in v]}
                                  for k, v in lay.items()})
        last = rec["layers"][-1]
        log(f"  step {step:>6}: acc {rec['accuracy']:.3f}  layer {len(rec['layers'])} mass filler "
            f"{last['filler']['mean']:.3f} key {last['key']['mean']:.3f} value {last['value']['mean']:.3f} "
            f"after_value {last['after_value']['mean']:.3f} context {last['context']['mean']:.3f}")
        return rec

    curve = [measure(0, None)]
    t0 = time.perf_counter()
    losses: List[jax.Array] = []
    stop = cfg.max_steps if cfg.max_steps is not None else cfg.steps
    for s, batch in T.prefetch_batches(loader.batch, range(stop), mesh):
        state, met = step_fn(state, batch)
        losses.append(met["loss"])
        if (s + 1) % diag_every == 0 or s + 1 == stop:
            loss = float(np.mean(jax.device_get(losses)))
            losses.clear()
            curve.append(measure(s + 1, loss))
            if curve[-1]["accuracy"] >= cfg.target_accuracy:
                break
    return {"seq_len": cfg.seq_len, "num_kv_pairs": cfg.num_kv_pairs, "attn_bias": cfg.attn_bias or "none",
            "lr": cfg.lr, "steps": curve[-1]["step"], "wall_s": round(time.perf_counter() - t0, 2),
            "final_accuracy": curve[-1]["accuracy"], "best_accuracy": max(c["accuracy"] for c in curve),
            "curve": curve}


def plot(runs: Sequence[Dict[str, Any]], path: str) -> None:
    """Rows: lengths; columns: last-layer filler mass, last-layer mass on the answer, accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({(r["seq_len"], r["num_kv_pairs"]) for r in runs})
    fig, axes = plt.subplots(len(lengths), 3, figsize=(13, 3.3 * len(lengths)), squeeze=False)
    for row, (L, N) in zip(axes, lengths):
        for r in (r for r in runs if (r["seq_len"], r["num_kv_pairs"]) == (L, N)):
            st = [c["step"] for c in r["curve"]]
            lab = f"key bias: {r['attn_bias']}"
            row[0].plot(st, [c["layers"][-1]["filler"]["mean"] for c in r["curve"]], "o-", ms=2, label=lab)
            row[1].plot(st, [c["layers"][-1]["value"]["mean"] for c in r["curve"]], "o-", ms=2, label=lab)
            row[2].plot(st, [c["accuracy"] for c in r["curve"]], "o-", ms=2, label=lab)
        for ax, t in zip(row, ("last-layer attention on 0 fillers", "last-layer attention on the answer (v_j)",
                               "accuracy at the queries")):
            ax.set(title=f"L {L}, {N} pairs: {t}", xlabel="step", ylim=(-0.02, 1.02))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Defaults (--tiny's in brackets): " + ", ".join(
                                     f"--{k} {FULL[k] if not isinstance(FULL[k], tuple) else ' '.join(map(str, FULL[k]))}"
                                     f" [{TINY[k] if not isinstance(TINY[k], tuple) else ' '.join(map(str, TINY[k]))}]"
                                     for k in FULL) + ", --seed 0.")
    ap.add_argument("--out", default="runs/attention_fillers",
                    help="folder for attention_fillers.json / .png (default %(default)s, relative to the working directory)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke mode: tiny shapes, a few steps")
    ap.add_argument("--key_bias", action=ListAction, default=["none", "k"], help="attention biases: none, k, qkvo, ...")
    ap.add_argument("--lengths", action=ListAction, elem_type=int, default=None, help="sequence lengths (default 256 512)")
    ap.add_argument("--pairs", action=ListAction, elem_type=int, default=None, help="kv pairs per length (default 32 64)")
    for k in ("vocab_size", "d_model", "num_heads", "batch_size", "warmup", "steps", "diag_every", "diag_examples",
              "diag_batch", "seed"):
        ap.add_argument(f"--{k}", type=int, default=None, help="see the defaults below")
    ap.add_argument("--lr", type=float, default=None, help="see the defaults below")
    ap.add_argument("--max_steps", type=int, default=None, help="stop here (the cosine still ends at --steps)")
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args(argv)
    s = dict(TINY if args.tiny else FULL)
    for k in list(s) + ["seed"]:
        v = getattr(args, k, None)
        if v is not None:
            s[k] = tuple(v) if isinstance(v, list) else v
    s.setdefault("seed", 0)
    if len(s["pairs"]) != len(s["lengths"]):
        ap.error(f"--pairs needs one value per length: {s['lengths']} vs {s['pairs']}")
    if int(s["num_heads"]) >= 1 and int(s["d_model"]) % int(s["num_heads"]):  # this script has no --head_dim
        ap.error(f"--d_model must be divisible by --num_heads {s['num_heads']}, got {s['d_model']}")
    for k in ("diag_every", "diag_examples", "diag_batch"):
        if int(s[k]) < 1:
            ap.error(f"--{k} must be >= 1, got {s[k]}")
    for b in args.key_bias:
        if b != "none" and (set(b) - set("qkvo") or len(set(b)) != len(b)):
            ap.error(f"--key_bias takes 'none' or letters of 'qkvo', got {b!r}")
    # every run's config built and checked before the first one trains (a bad one would otherwise stop
    # the grid after hours), its errors written as this script's flags
    grid = []
    with exit_on_error("attention_fillers.py", RecallConfig):
        for L, N in zip(s["lengths"], s["pairs"]):
            for b in args.key_bias:
                cfg = RecallConfig(task="mqar", mixer="attention", vocab_size=s["vocab_size"], seq_len=L,
                                   num_kv_pairs=N, random_non_queries=False, d_model=s["d_model"],
                                   num_heads=s["num_heads"], attn_bias="" if b == "none" else b, lr=s["lr"],
                                   warmup=s["warmup"], steps=s["steps"], max_steps=args.max_steps,
                                   batch_size=s["batch_size"], seed=s["seed"], backend=args.backend, progress=False)
                build(cfg)
                grid.append((L, N, b, cfg))
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        ap.error(f"--out {args.out!r} is a file, not a folder")
    os.makedirs(args.out, exist_ok=True)
    runs: List[Dict[str, Any]] = []
    res = {"settings": s, "key_bias": list(args.key_bias), "tiny": args.tiny, "jax_version": jax.__version__,
           "platform": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
           "command": " ".join(["python", "experiments/attention_fillers.py", *(argv if argv is not None
                                                                               else sys.argv[1:])]),
           "runs": runs}

    def write():  # after every run: a time limit that stops the script keeps the runs done so far
        with open(os.path.join(args.out, "attention_fillers.json"), "w") as f:
            json.dump(res, f, indent=1)
        plot(runs, os.path.join(args.out, "attention_fillers.png"))

    for L, N, b, cfg in grid:
        print(f"L {L}, {N} pairs, bias {b}:", flush=True)
        with exit_on_error("attention_fillers.py", RecallConfig):
            runs.append(run_one(cfg, diag_every=s["diag_every"], diag_examples=s["diag_examples"],
                                diag_batch=s["diag_batch"]))
        write()
    print(f"wrote {args.out}/attention_fillers.json and .png")
    return res


if __name__ == "__main__":
    main()
