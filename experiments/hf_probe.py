"""Load a local Hugging Face checkpoint directory (Qwen3.5 / Qwen3-Next) with gdn_jax and probe it
(docs/huggingface.md).

1. the op's backends on one prompt: logits of ``scan`` (the oracle) vs ``chunk`` / ``auto`` (and
   ``pallas`` on a GPU), RMS-relative;
2. a prompt, greedily continued (text through the directory's tokenizer if transformers is
   installed, else ``--prompt_ids``);
3. a NIAH-style recall probe: a random-token haystack of L tokens with a key -> value needle at a
   random depth, the key again at the end; scored on whether the greedy continuation is the value
   (in-context copying: a trained LM does it by induction, a random one is at chance)::

    python experiments/hf_probe.py /path/to/Qwen3.5-0.8B --prompt "The capital of France is" \
        --niah_lengths 512,2048 --trials 4 --out runs/hf_probe
"""
from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn_jax.cli import ArgumentParser, ListAction
from gdn_jax import hf
from gdn_jax.inference.generate import generate


def set_backend(model, backend: str):
    """Switch every GDN / KDA layer of ``model`` to ``backend`` (the op's argument; no reload)."""
    for blk in model.blocks:
        if hasattr(blk.mixer, "chunk_size"):
            blk.mixer.backend = backend


def rms_rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / max(np.mean(b ** 2), 1e-300)))


def backend_check(model, tokens, backends):
    """RMS-relative error of each backend's logits against ``scan``'s (one jit per backend)."""
    forward = nnx.jit(lambda m, t: m(t))
    set_backend(model, "scan")
    ref = forward(model, tokens)
    out = {}
    for b in backends:
        set_backend(model, b)
        out[b] = rms_rel(forward(model, tokens), ref)
    set_backend(model, "auto")
    return out


def niah_probe(model, length: int, trials: int, seed: int, lo: int, hi: int, key_len=4, value_len=4):
    """Fraction of value tokens the greedy continuation gets right, over ``trials`` haystacks."""
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(trials):
        hay = rng.integers(lo, hi, length - 2 * key_len - value_len)
        key, value = rng.integers(lo, hi, key_len), rng.integers(lo, hi, value_len)
        depth = int(rng.integers(0, len(hay) + 1))
        seq = np.concatenate([hay[:depth], key, value, hay[depth:], key])[None]
        new = generate(model, jnp.asarray(seq, jnp.int32), value_len, key=jax.random.key(0), temperature=0.0)
        hits += int((np.asarray(new)[0] == value).sum())
    return hits / (trials * value_len)


def main(argv=None):
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="checkpoint directory: config.json + *.safetensors")
    ap.add_argument("--prompt", default=None, help="text prompt (needs the directory's tokenizer)")
    ap.add_argument("--prompt_ids", action=ListAction, elem_type=int, nargs="*", default=[1, 2, 3, 4, 5, 6, 7, 8],
                    help="token ids without a tokenizer")
    ap.add_argument("--max_new_tokens", type=int, default=16)
    ap.add_argument("--backend", default="auto", choices=["auto", "chunk", "scan", "pallas"])
    ap.add_argument("--dtype", default="float32", help="compute dtype (parameters keep the checkpoint's dtype)")
    ap.add_argument("--niah_lengths", action=ListAction, elem_type=int, nargs="*", default=[256],
                    help="haystack lengths (none given, or '': no probe)")
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write probe.json here")
    args = ap.parse_args(argv)
    # the cheap arguments first: an error after loading and generating would lose that work
    prompt_ids = list(args.prompt_ids)
    if args.prompt is None and not prompt_ids:
        ap.error("--prompt_ids is empty (give ids, or --prompt with a tokenizer in the checkpoint folder)")
    lengths = list(args.niah_lengths)
    if any(L < 12 for L in lengths):  # the key twice (4 tokens each) and a 4-token value
        ap.error(f"--niah_lengths must be >= 12 each (keys, value and haystack), got {lengths}")
    for flag, value in (("--trials", args.trials), ("--max_new_tokens", args.max_new_tokens)):
        if value < 1:
            ap.error(f"{flag} must be >= 1, got {value}")
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        ap.error(f"--out {args.out!r} is a file, not a folder")

    t0 = time.time()
    try:  # a checkpoint gdn_jax cannot read is one line, not a traceback
        model = hf.load_pretrained(args.path, backend=args.backend, dtype=args.dtype)
    except (hf.CheckpointError, NotImplementedError, ValueError, TypeError) as e:
        ap.exit(1, f"{ap.prog}: error: {args.path}: {e}\n")
    cfg = model.cfg
    bad = [i for i in prompt_ids if not 0 <= i < cfg.vocab_size]
    if args.prompt is None and bad:
        ap.error(f"--prompt_ids must be in [0, vocab_size = {cfg.vocab_size}), got {bad}")
    print(f"loaded {args.path} in {time.time() - t0:.1f}s: {cfg.num_layers} layers {cfg.layer_mixers()}, "
          f"d {cfg.d_model}, vocab {cfg.vocab_size}")
    tok = None
    if args.prompt is not None:
        from transformers import AutoTokenizer  # only for text in / out

        tok = AutoTokenizer.from_pretrained(args.path)
        ids = tok(args.prompt, return_tensors="np")["input_ids"].astype(np.int32)
        if ids.size == 0:
            ap.error(f"--prompt: the tokenizer of {args.path} gave no ids (no tokenizer files there?); use "
                     f"--prompt_ids")
    else:
        ids = np.asarray([prompt_ids], np.int32)
    result = {"path": args.path, "config": {k: str(v) for k, v in vars(cfg).items()}}

    backends = ["chunk", "auto"] + (["pallas"] if jax.default_backend() != "cpu" else [])
    result["backend_rms_rel_vs_scan"] = backend_check(model, jnp.asarray(ids), backends)
    set_backend(model, args.backend)
    print("logits vs scan (RMS-relative):", result["backend_rms_rel_vs_scan"])

    new = np.asarray(generate(model, jnp.asarray(ids), args.max_new_tokens, key=jax.random.key(0), temperature=0.0))
    result["continuation_ids"] = new[0].tolist()
    if tok is not None:
        result["continuation"] = tok.decode(new[0])
        print(f"{args.prompt!r} -> {result['continuation']!r}")
    else:
        print(f"{ids[0].tolist()} -> {new[0].tolist()}")

    # haystack tokens: skip the low ids (special / byte tokens of large vocabularies)
    lo = 1000 if cfg.vocab_size > 20000 else 0
    hi = min(cfg.vocab_size, 30000) if cfg.vocab_size > 20000 else cfg.vocab_size
    result["niah"] = {}
    for L in lengths:
        acc = niah_probe(model, L, args.trials, args.seed, lo, hi)
        result["niah"][L] = acc
        print(f"NIAH L {L}: value-token accuracy {acc:.3f} over {args.trials} trials (chance ~{1 / (hi - lo):.1e})")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "probe.json"), "w") as fh:
            json.dump(result, fh, indent=2)
    return result


if __name__ == "__main__":
    main()
