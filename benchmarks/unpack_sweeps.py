"""Merge what a device call's sweep steps sent back (``benchmarks/run_h200.sh``'s
``sweeps.tgz.part-*``) into this checkout, then rewrite each sweep's summary::

    python benchmarks/unpack_sweeps.py /path/to/files_at          # the folder holding the parts

For every sweep in the archive (its folder name is its preset, e.g. ``zoology_mqar``):
its runs go to ``results/<name>/runs/`` (a run folder that came back replaces the local one), its
worker logs to ``results/<name>/``, its unfinished runs' checkpoints replace ``.base/ckpt_<name>/``
(carry ``.base`` in the next call to resume them; ``results/resume/ckpt_<name>/``, committed
checkpoints a call without ``.base`` starts from, is removed: superseded), the device's ``locks/`` and its (restricted)
``sweep_config.json`` are dropped when a local one exists, and ``summarize`` of the whole preset
rewrites ``summary.md`` / ``.json`` / ``.csv``, ``runs.csv`` and the plot. Prints each sweep's log tail
and, per unfinished run, its step and best test accuracy so far (from its checkpoint).
"""
from __future__ import annotations

import argparse
import glob
import io
import os
import shutil
import sys
import tarfile
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files_at", help="folder with sweeps.tgz.part-* (the run tool's files_at)")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--root", default=repo, help="checkout root (results/ and .base/ live here; default: this "
                                                 "script's checkout, wherever it is run from)")
    args = ap.parse_args(argv)
    parts = sorted(glob.glob(os.path.join(args.files_at, "**", "sweeps.tgz.part-*"), recursive=True))
    if not parts:
        raise SystemExit(f"unpack_sweeps.py: no sweeps.tgz.part-* under {args.files_at}")
    data = b"".join(open(p, "rb").read() for p in parts)
    from gdn_jax.sweep import PRESETS, SweepConfig, apply_preset, summarize

    with tempfile.TemporaryDirectory() as tmp:
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
                names = tar.getnames()
                if len({os.path.dirname(p) for p in parts}) > 1:
                    raise SystemExit(f"unpack_sweeps.py: sweeps.tgz.part-* in several folders under {args.files_at} "
                                     f"(several calls' archives?): pass the folder of one call")
                # members stay inside tmp (the "data" filter where this Python has it)
                kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                if any(os.path.isabs(n) or ".." in n.split("/") for n in names):
                    raise SystemExit("unpack_sweeps.py: the archive has paths outside its folder")
                tar.extractall(tmp, **kw)
        except (tarfile.TarError, EOFError, OSError) as e:
            raise SystemExit(f"unpack_sweeps.py: the parts under {args.files_at} are not one whole archive "
                             f"({type(e).__name__}: {e}); fetch the call's files again") from None
        names = open(os.path.join(tmp, "sweep_logs", "names")).read().split()
        for name in dict.fromkeys(names):
            if name not in PRESETS:
                raise SystemExit(f"unpack_sweeps.py: {name!r} is not a sweep preset")
            src, dst = os.path.join(tmp, name), os.path.join(args.root, "results", name)
            os.makedirs(os.path.join(dst, "runs"), exist_ok=True)
            for run in glob.glob(os.path.join(src, "runs", "*", "*")):
                rel = os.path.relpath(run, os.path.join(src, "runs"))
                shutil.rmtree(os.path.join(dst, "runs", rel), ignore_errors=True)
                shutil.copytree(run, os.path.join(dst, "runs", rel))
            for f in glob.glob(os.path.join(src, "worker*.log")):
                shutil.copy(f, dst)
            if not os.path.exists(os.path.join(dst, "sweep_config.json")) and os.path.exists(
                    os.path.join(src, "sweep_config.json")):
                shutil.copy(os.path.join(src, "sweep_config.json"), dst)
            ckpt = os.path.join(args.root, ".base", f"ckpt_{name}")
            shutil.rmtree(ckpt, ignore_errors=True)
            if os.path.isdir(os.path.join(tmp, f"ckpt_{name}")):
                shutil.copytree(os.path.join(tmp, f"ckpt_{name}"), ckpt)
            resume = os.path.join(args.root, "results", "resume", f"ckpt_{name}")
            if os.path.isdir(resume):  # the call started from these; what came back supersedes them
                shutil.rmtree(resume)
                print(f"removed results/resume/ckpt_{name} (superseded by .base/ckpt_{name}): commit the removal, "
                      f"carry .base next call")
            log = open(os.path.join(tmp, "sweep_logs", f"{name}.txt")).read().splitlines()
            print(f"--- {name}: log tail\n" + "\n".join(log[-6:]))
            summarize(apply_preset(SweepConfig(preset=name, out=dst), set()))
            print(open(os.path.join(dst, "summary.md")).read())
            left = sorted(os.path.relpath(d, ckpt) for d in glob.glob(os.path.join(ckpt, "*", "lr*")))
            print(f"unfinished (checkpoints in .base/ckpt_{name}): {', '.join(left) or 'none'}")
            for row in in_flight(ckpt):
                print("  " + row)


def in_flight(ckpt: str):
    """One line per unfinished run under the checkpoint folder ``ckpt`` (``<cell>/lr<lr>/<step>/``):
    its latest checkpointed step, best and last test accuracy so far and training wall time, read
    from the checkpoint's metadata (the run's history, as ``recall.run`` saves it)."""
    import json

    rows = []
    for d in sorted(glob.glob(os.path.join(ckpt, "*", "lr*"))):
        steps = sorted((int(x) for x in os.listdir(d) if x.isdigit()), reverse=True)
        meta = os.path.join(d, str(steps[0]), "meta", "metadata") if steps else None
        if meta is None or not os.path.isfile(meta):
            rows.append(f"{os.path.relpath(d, ckpt)}: no readable checkpoint")
            continue
        with open(meta) as f:
            m = json.load(f)
        ev = (m.get("history") or {}).get("evals") or []
        acc = [e["test_accuracy"] for e in ev]
        rows.append(f"{os.path.relpath(d, ckpt)}: step {steps[0]}, best test acc "
                    + (f"{max(acc):.4f}, last {acc[-1]:.4f}" if acc else "- (no evaluation yet)")
                    + f", wall {float(m.get('wall_s', 0.0)):.0f} s")
    return rows


if __name__ == "__main__":
    main()
