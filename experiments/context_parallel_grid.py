"""Context parallelism on CPU, a bigger grid than CI: every backend x packed or not x 2 / 4 / 8
simulated devices, with GVA and per-key-channel g (where the backend takes it), T = 32; and
gated_linear_attention (op "la": no decay, per-head and per-key-channel decay) on scan and chunk.
Each device count runs tests/ops/cp_check.py in a process of its own; the max relative differences
(sharded vs unsharded: o, final state, every gradient, each gradient shard by shard) go to
``<out>/grid.jsonl`` and a Markdown summary to ``<out>/summary.md``.

Usage:  python experiments/context_parallel_grid.py [--out results/context_parallel_cpu]
"""
import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK = os.path.join(REPO, "tests", "ops", "cp_check.py")
FIELDS = ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "ds0")


def cases():
    out = []
    for backend in ("scan", "chunk", "pallas"):
        for packed in (False, True):
            out.append(dict(backend=backend, packed=packed, B=1 if packed else 2, Hk=1, H=2,
                            g_pc=backend != "pallas" and packed))
    for backend in ("scan", "chunk"):  # gated_linear_attention: none / per-head (mamba2) / per-key-channel (gla)
        for kind in ("none", "mamba2", "gla"):
            packed = kind != "mamba2"
            out.append(dict(op="la", backend=backend, packed=packed, B=1 if packed else 2, no_decay=kind == "none",
                            g_pc=kind == "gla"))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(REPO, "results", "context_parallel_cpu"))
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for devices in (2, 4, 8):
        r = subprocess.run([sys.executable, CHECK, "--devices", str(devices), "--cases", json.dumps(cases())],
                           capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        if r.returncode:
            sys.exit(r.stdout[-2000:] + r.stderr[-4000:])
        rows += [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    with open(os.path.join(a.out, "grid.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    lines = ["| devices | op | backend | packed | GVA | g | " + " | ".join(FIELDS) + " | worst shard (grads) |",
             "|---" * (7 + len(FIELDS)) + "|"]
    for r in rows:
        c = r["case"]
        worst = max(max(r.get(f + "_per_shard", [0])) for f in FIELDS)
        gate = "none" if c.get("no_decay") else "per key channel" if c["g_pc"] else "per head"
        lines.append(f"| {r['devices']} | {c['op']} | {c['backend']} | {c['packed']} | {c['H'] // c['Hk']} | {gate} | "
                     + " | ".join(f"{r[f]:.1e}" if f in r else "-" for f in FIELDS) + f" | {worst:.1e} |")
    worst = max(r[f] for r in rows for f in FIELDS if f in r)
    lines.append(f"\nmax over the grid: {worst:.1e} (max |sharded - unsharded| / max |unsharded|, float32)")
    with open(os.path.join(a.out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
