"""Put MQAR sweep results beside the published L = 512, 64-pair numbers: one Markdown table, one plot.

Reads the ``summary.json`` of one or more sweeps (``experiments/sweep.py``); the first sweep is the
main protocol, later ones (``--extra``) are re-runs of some cells under another setting (a longer time
cap, another filler) and appear as extra lines and as "(extra: ...)" in the table. Published values
(read off the DeltaNet paper's MQAR figure, Yang et al. 2024; attention from Zoology, Arora et al.
2023; docs/recall.md) are accuracy in percent at d_model 64 / 128 / 256 / 512.
A cell whose best run trained its whole step / epoch budget without reaching the target is marked
``‡`` (``hit_budget`` in the sweep's summary; runs of ``--preset zoology_mqar`` report epochs), a cell
with learning rates still to run ``(partial)`` (its ``unfinished`` list)::

    python experiments/mqar_compare.py results/mqar_h200_v2 \\
        --extra "300 s=results/mqar_h200_long/gla" "300 s=results/mqar_h200_long/d64" \\
        --out results/mqar_h200_v2/compare
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Tuple

from gdn_jax.cli import ArgumentParser, ListAction
from gdn_jax.cli import parse_overrides
from gdn_jax.recall import RecallConfig

# (mixer -> {d_model: published accuracy %}); "mamba2" is compared with the paper's "Mamba" row
PUBLISHED: Dict[str, Dict[int, Tuple[float, float]]] = {
    "deltanet": {64: (100, 100), 128: (100, 100), 256: (100, 100), 512: (100, 100)},
    "mamba2": {64: (81, 81), 128: (100, 100), 256: (100, 100), 512: (100, 100)},
    "gla": {64: (22, 22), 128: (95, 95), 256: (100, 100), 512: (100, 100)},
    "attention": {64: (97, 100), 128: (97, 100), 256: (97, 100), 512: (97, 100)},  # Zoology: ~97-100 at every d
}


PUBLISHED_SETTING = (512, 64, 8192)  # (seq_len, num_kv_pairs, vocab_size) of the published figure


def load(path: str, shape: Optional[Tuple[int, int]] = None) -> Tuple[Tuple[int, int, int], Dict[Tuple[str, int], dict]]:
    """``((seq_len, num_kv_pairs, vocab_size), {(mixer, d_model): cell summary})`` of the MQAR sweep
    written under ``path``; ``shape`` = (seq_len, num_kv_pairs) selects one point of a sweep over
    several (``zoology_fig2``), else the sweep must have one.

    Raises:
      FileNotFoundError: no ``summary.json`` under ``path``.
      ValueError: not an MQAR sweep, its cells mix several (seq_len, num_kv_pairs) and no ``shape``
        is given, or no cell has ``shape``.
    """
    f = os.path.join(path, "summary.json")
    if not os.path.isfile(f):
        raise FileNotFoundError(f"{path}: no summary.json (the folder of a finished experiments/sweep.py run)")
    with open(f) as fh:
        try:
            s = json.load(fh)
        except json.JSONDecodeError as e:
            raise ValueError(f"{f}: not valid JSON ({e})") from None
    if s.get("task") != "mqar":
        raise ValueError(f"{path}: not an MQAR sweep (task={s.get('task')!r})")
    if not s.get("cells"):
        raise ValueError(f"{path}: no finished cell yet (summary.json lists none)")
    try:
        lengths = {(int(c["seq_len"]), int(c["num_kv_pairs"])) for c in s["cells"]}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{f}: a cell lacks seq_len / num_kv_pairs ({e!r})") from None
    if shape is not None:
        if tuple(shape) not in lengths:
            raise ValueError(f"{path}: no cell at (seq_len, num_kv_pairs) = {tuple(shape)}; it has {sorted(lengths)}")
        s = dict(s, cells=[c for c in s["cells"] if (int(c["seq_len"]), int(c["num_kv_pairs"])) == tuple(shape)])
        lengths = {tuple(shape)}
    if len(lengths) != 1:
        raise ValueError(f"{path}: cells at several (seq_len, num_kv_pairs) {sorted(lengths)}; pick one with "
                         f"--shape LxN (e.g. --shape {'x'.join(map(str, sorted(lengths)[0]))})")
    base = parse_overrides(RecallConfig, (s.get("sweep") or {}).get("base", []))  # the sweep's --base
    vocab = base.get("vocab_size", RecallConfig.vocab_size)
    pending = set(s.get("unfinished") or [])  # cells with learning rates still to run
    cells = {(c["mixer"], int(c["d_model"])): dict(c, partial=c.get("cell") in pending) for c in s["cells"]}
    return (*lengths.pop(), vocab), cells


def _pct(c: dict) -> str:
    return f"{100 * c['best_test_accuracy']:.1f}"


def _run(c: dict) -> str:
    """accuracy (steps or epochs[, capped: stopped by the time limit], lr)[ ‡: hit the step/epoch budget]
    [ (partial): the cell has learning rates still to run]"""
    capped = ", capped" if c.get("stopped_by_time") else ""
    amount = f"{c['epochs']:g} ep" if c.get("epochs") is not None else f"{c['steps']} steps"
    return (f"{_pct(c)} ({amount}{capped}, lr {c['lr']:.3g})" + (" ‡" if c.get("hit_budget") else "")
            + (" (partial)" if c.get("partial") else ""))


def table(main: Dict, extras: List[Tuple[str, Dict]], published: bool = True) -> str:
    ds = sorted({d for _, d in main})
    mixers = list(dict.fromkeys(m for m, _ in main))
    lines = ["| mixer | " + " | ".join(f"d {d}" for d in ds) + " |", "|---" * (len(ds) + 1) + "|"]
    for m in mixers:
        row = []
        for d in ds:
            c = main.get((m, d))
            s = "—" if c is None else _run(c)
            for label, ex in extras:
                e = ex.get((m, d))
                if e is not None:
                    s += f"; {label}: {_run(e)}"
            pub = PUBLISHED.get(m, {}).get(d)
            if published:
                s += " / " + ("—" if pub is None else (f"{pub[0]:g}" if pub[0] == pub[1] else f"≈{pub[0]:g}–{pub[1]:g}"))
            row.append(s)
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(main: Dict, extras: List[Tuple[str, Dict]], path: str, published: bool = True,
         title: str = "MQAR") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixers = list(dict.fromkeys(m for m, _ in main))
    fig, axes = plt.subplots(1, 2 if published else 1, figsize=(9 if published else 4.8, 3.6), sharey=True,
                             squeeze=False)
    axes = axes[0]
    colors = {m: f"C{i}" for i, m in enumerate(mixers)}
    for m in mixers:
        ds = sorted(d for mm, d in main if mm == m)
        axes[0].plot(ds, [main[(m, d)]["best_test_accuracy"] for d in ds], "o-", color=colors[m], label=m)
        for j, (label, ex) in enumerate(extras):
            eds = sorted(d for mm, d in ex if mm == m)
            if eds:  # only the cells this setting ran (not the main sweep's other widths)
                axes[0].plot(eds, [ex[(m, d)]["best_test_accuracy"] for d in eds], "s--", color=colors[m],
                             alpha=0.6, label=f"{m} ({label})")
        if published and m in PUBLISHED:
            pds = sorted(PUBLISHED[m])
            axes[1].plot(pds, [PUBLISHED[m][d][0] / 100 for d in pds], "o-", color=colors[m], label=m)
    ds_all = sorted({d for _, d in main} | {d for _, ex in extras for _, d in ex})
    for ax, t in zip(axes, (f"ours: {title}", "published (DeltaNet paper; Zoology)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ds_all, [str(d) for d in ds_all])
        ax.set_xlabel("d_model")
        ax.set_title(t, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("test accuracy")
    axes[0].set_ylim(-0.02, 1.02)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", help="folder of the main sweep (with summary.json)")
    ap.add_argument("--extra", action=ListAction, nargs="*", default=[], metavar="LABEL=FOLDER",
                    help="re-runs of some cells under another setting, as label=folder")
    ap.add_argument("--out", required=True, help="output prefix: <out>.md and <out>.png (its folder is created)")
    ap.add_argument("--shape", default=None, metavar="LxN",
                    help="the (seq_len x kv pairs) point to compare in a sweep over several, e.g. 128x8")
    args = ap.parse_args(argv)
    shape = None
    if args.shape is not None:
        try:
            shape = tuple(int(x) for x in args.shape.lower().split("x"))
        except ValueError:
            shape = ()
        if len(shape) != 2 or min(shape) < 1:
            ap.error(f"--shape takes LxN (positive seq_len x kv pairs), got {args.shape!r}")

    def read(folder):
        try:
            return load(folder, shape)
        except (OSError, ValueError) as e:
            ap.error(str(e))

    setting, main_ = read(args.sweep)
    extras = []
    for e in args.extra:
        label, sep, folder = e.partition("=")
        if not sep or not label or not folder:
            ap.error(f"--extra takes LABEL=FOLDER, got {e!r}")
        s2, cells = read(folder)
        if s2 != setting:
            ap.error(f"--extra {label}: its (seq_len, num_kv_pairs, vocab) {s2} differ from the main sweep's {setting}")
        extras.append((label, cells))
    if args.out.endswith(("/", os.sep)) or os.path.isdir(args.out):
        ap.error(f"--out {args.out!r} is a folder; --out is a prefix (writes <out>.md and <out>.png), e.g. "
                 f"{os.path.join(args.out, 'compare')}")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        ap.error(f"--out {args.out!r}: {out_dir} is a file, not a folder")
    os.makedirs(out_dir, exist_ok=True)
    published = setting == PUBLISHED_SETTING
    if not published:
        print(f"note: published numbers exist for (seq_len, num_kv_pairs, vocab) = {PUBLISHED_SETTING} only; "
              f"this sweep is {setting}: no published column")
    md = table(main_, extras, published=published)
    L, N, V = setting
    with open(args.out + ".md", "w") as f:
        f.write(f"MQAR, L = {L}, {N} pairs, vocab {V}: best test accuracy % (steps or epochs [capped = stopped by "
                f"the time limit], lr; ‡ = hit the step/epoch budget without reaching 0.99; (partial) = "
                f"learning rates still to run)"
                + (" ours / published" if published else "") + "\n\n" + md + "\n")
    plot(main_, extras, args.out + ".png", published=published, title=f"MQAR L={L}, {N} pairs, vocab {V}")
    print(md)
    print(f"wrote {args.out}.md and {args.out}.png")


if __name__ == "__main__":
    main()
