"""PNG bar chart: per state, GB/s of save / hot load / cold load, and the async stall."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .report_md import LIMIT_LABEL  # noqa: E402

_OPS = (("save", "save (durable)"), ("load_hot", "load hot (in-place variant)"),
        ("load_cold", "load cold (in-place variant)"))


def _label(doc: dict, method: str) -> str:
    return LIMIT_LABEL if method == "limit" else doc["methods"].get(method, {}).get("label", method)


def _primary(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """Per method: its save row and its last load variant (the registry lists the in-place one last)."""
    out: dict[tuple[str, str], dict] = {}
    for r in rows:
        if r["op"] in ("save", "load_hot", "load_cold") and r["metrics"].get("seconds", {}).get("median"):
            out[(r["method"], r["op"])] = r
    return out


def _throughput(ax, doc: dict, name: str, st: dict) -> None:
    nbytes = st["info"]["bytes"]
    prim = _primary(st["rows"])
    methods = list(dict.fromkeys(m for m, _op in prim))
    width = 0.8 / len(_OPS)
    for i, (op, opname) in enumerate(_OPS):
        xs, ys, lo, hi = [], [], [], []
        for j, m in enumerate(methods):
            r = prim.get((m, op))
            if r is None:
                continue
            sec = r["metrics"]["seconds"]
            g = nbytes / sec["median"] / 1e9
            xs.append(j + (i - 1) * width)
            ys.append(g)
            lo.append(g - nbytes / sec["max"] / 1e9)
            hi.append(nbytes / sec["min"] / 1e9 - g)
        if xs:
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=opname)
    ax.set_xticks(range(len(methods)))
    ax.set_xticklabels([_label(doc, m) for m in methods], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("GB/s (median, min–max)")
    ax.set_title(f"{name}: {nbytes / 1e9:.3g} GB, {st['info']['tensors']} tensors, {st['info']['world']} rank(s)")
    ax.legend(fontsize=7)


def _stall(ax, doc: dict, name: str, st: dict) -> None:
    rows = [r for r in st["rows"] if r["op"] == "async"]
    if not rows:
        ax.set_axis_off()
        return
    labels = [_label(doc, r["method"]) for r in rows]
    for k, (metric, lab) in enumerate((("stall_s", "stall"), ("latency_s", "latency to durable"))):
        meds = [r["metrics"][metric]["median"] for r in rows]
        lo = [m - r["metrics"][metric]["min"] for m, r in zip(meds, rows, strict=True)]
        hi = [r["metrics"][metric]["max"] - m for m, r in zip(meds, rows, strict=True)]
        ax.bar([x + (k - 0.5) * 0.4 for x in range(len(rows))], meds, 0.4, yerr=[lo, hi], capsize=2, label=lab)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("seconds (median, min–max)")
    ax.set_title(f"{name}: async save")
    ax.legend(fontsize=7)


def save_png(doc: dict, path: Path) -> None:
    states = [(n, s) for n, s in doc["states"].items() if s["rows"]]
    if not states:
        return
    fig, axes = plt.subplots(len(states), 2, figsize=(16, 5.5 * len(states)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1]})
    for (name, st), (ax1, ax2) in zip(states, axes, strict=True):
        _throughput(ax1, doc, name, st)
        _stall(ax2, doc, name, st)
    fig.suptitle(f"trainguard benchmark {doc['created']} (scale {doc['config']['scale']})")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.25 / (5.5 * len(states))))  # a band on top for the suptitle
    fig.savefig(path, dpi=90)
    plt.close(fig)
