"""The targets of issues 6 and 4, judged from one run's results:
``python -m bench.targets [bench/results/latest.json] [--stall bench/results/stall.json]
[--per-byte bench/results/per_byte.json]``.

``bench.run`` calls :func:`judge` on its summary (``report.build``) and ``report_md`` prints the
verdicts first in ``latest.md``; run as a module it judges saved files again (for the README).
Every comparison pairs the same round of both methods (back to back, same data), the steady
rounds only (round 0 is the first repetition, reported apart), and a "best of" other side takes
its best configuration round by round (DCP's thread_count=1 or 2, the raw limit's 1 stream,
2 streams or 2 O_DIRECT streams). A target is met when the median of those paired figures meets
it; ``rounds`` says in how many steady rounds it held, since this machine is noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

DCP = ("dcp_t1", "dcp_t2")
ST_COPY = ("safetensors", "load_file+copy_")


def _seconds(doc: dict, state: str, method: str, op: str, variant: str = "") -> dict[int, float]:
    """Steady rounds of one row's time (``metrics.seconds.by_round`` without round 0)."""
    for r in doc["states"].get(state, {}).get("rows", []):
        if (r["method"], r["op"], r["variant"]) == (method, op, variant):
            metric = r["metrics"].get("seconds", {})
            return {int(k): v for k, v in metric.get("by_round", {}).items() if int(k) > 0 and v}
    return {}


def _other_best(doc: dict, state: str, op: str, others: list[tuple[str, str]]) -> dict[int, float]:
    """Per round, the fastest of ``others`` ((method, variant) pairs) that ran that round."""
    series = [_seconds(doc, state, m, op, v) for m, v in others]
    series = [s for s in series if s]
    rounds = set.intersection(*(set(s) for s in series)) if series else set()
    return {r: min(s[r] for s in series) for r in rounds}


def _row(target: str, state: str, required: float, per_round: list[float], unit: str = "×",
         higher_is_better: bool = True, note: str = "") -> dict[str, Any]:
    """One verdict: ``per_round`` are the paired figures (e.g. speed-ups) of the steady rounds."""
    if not per_round:
        return {"target": target, "state": state, "required": required, "median": None, "min": None,
                "max": None, "rounds": "0 of 0", "met": None, "unit": unit, "note": note or "not measured"}
    def meets(x: float) -> bool:
        return x >= required if higher_is_better else x <= required

    med = statistics.median(per_round)
    return {"target": target, "state": state, "required": required, "median": med, "min": min(per_round),
            "max": max(per_round), "rounds": f"{sum(map(meets, per_round))} of {len(per_round)}",
            "met": meets(med), "unit": unit, "note": note}


def _speedup(doc: dict, state: str, op: str, others: list[tuple[str, str]], tg_variant: str) -> list[float]:
    """Paired other ÷ trainguard time (> 1: trainguard faster), round by round."""
    mine = _seconds(doc, state, "trainguard", op, tg_variant)
    best = _other_best(doc, state, op, others)
    return [best[r] / mine[r] for r in sorted(set(mine) & set(best))]


def _peak(doc: dict, state: str) -> list[float]:
    """trainguard's sync save: peak extra memory in % of the state, every round (first included)."""
    for r in doc["states"].get(state, {}).get("rows", []):
        if (r["method"], r["op"]) == ("trainguard", "save"):
            peak = r["metrics"].get("peak_extra", {}).get("by_round", {})
            nbytes = doc["states"][state]["info"]["bytes"]
            return [100.0 * v / nbytes for v in peak.values()]
    return []


def judge(doc: dict, stall: dict | None = None, per_byte: dict | None = None) -> list[dict[str, Any]]:
    """Issue 6's targets from a ``bench.run`` summary (``report.build``'s document), then issue 4's
    from a ``bench.stall`` result when given. Called by ``report.build`` and by :func:`main`."""
    states = doc.get("states", {})
    big = "gpt" if "gpt" in states else "100mb"  # a run with --only 100mb judges on that state
    small = "small10k"
    dcp_save = [(m, "") for m in DCP]
    dcp_load = [(m, "dcp.load") for m in DCP]
    out = [
        _row("sync save speed ÷ raw write+fsync limit", big, 0.85,
             _speedup(doc, big, "save", [("limit", "")], "")),
        _row("sync save: times faster than DCP's best", big, 1.25, _speedup(doc, big, "save", dcp_save, "")),
        _row("sync save: times faster than DCP's best", small, 3.0, _speedup(doc, small, "save", dcp_save, "")),
        _row("hot load in place: times faster than DCP's", big, 4.0, _speedup(doc, big, "load_hot", dcp_load, "tg.load")),
        *(_row("hot load in place: speed ÷ safetensors load_file+copy_", state, 1.0,
               _speedup(doc, state, "load_hot", [ST_COPY], "tg.load"), note="trainguard verifies checksums; it does not")
          for state in (big, small)),
        _row("cold load in place: speed ÷ raw read limit", big, 0.85,
             _speedup(doc, big, "load_cold", [("limit", "")], "tg.load")),
    ]
    per_byte_target = ("sync save per byte: 10,000 small ÷ large tensors", f"{small} vs {big}", 1 / 1.5)
    rates = {r["op"]: r for r in doc.get("per_byte", {}).get("rows", []) if r["method"] == "trainguard"}
    if "save" in rates:
        out.append(_row(*per_byte_target, [rates["save"]["small_over_large"]],
                        note="medians of two processes minutes apart (not paired)"))
    paired = [r["ratio"] for r in (per_byte or {}).get("rounds", []) if r.get("round", 0) > 0]
    if paired:
        out.append(_row(*per_byte_target, paired, note="`bench.per_byte`: paired round by round in one process"))
    for state in (big, small):
        out.append(_row("sync save: peak extra memory, % of the state", state, 10.0, _peak(doc, state),
                        unit="%", higher_is_better=False, note="every round, the first included"))
    if stall:
        out += judge_stall(stall)
    return out


def judge_stall(stall: dict) -> list[dict[str, Any]]:
    """Issue 4's targets from ``bench.stall``'s result: trainguard's async stall ≤ 5% of DCP
    async_save's (its default, and its best staging options), end-to-end overhead ≤ 3%."""
    out = []
    for size, r in stall.get("sizes", {}).items():
        tg = r.get("tg_async")
        if not tg:
            continue
        for other, label in (("dcp_async", "default"), ("dcp_async_bg", "reused stager, background staging")):
            if r.get(other, {}).get("stall_median_s"):
                out.append(_row(f"async stall, % of DCP async_save's ({label})", size, 5.0,
                                [100.0 * tg["stall_median_s"] / r[other]["stall_median_s"]], unit="%",
                                higher_is_better=False, note="medians of the run's saves"))
        out.append(_row("async save: training time lost, % (from the steps)", size, 3.0,
                        [100.0 * tg["overhead_from_steps"]], unit="%", higher_is_better=False,
                        note=f"a save every {stall['config'].get('every')} steps, {stall['config'].get('device')}"))
    return out


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.3g}"


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The verdicts as a markdown table (``report_md.markdown`` puts it first; README copies it)."""
    out = ["| target | state | required | measured: median [min–max] | rounds meeting it | verdict |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        sign = "≥" if r["unit"] == "×" else "≤"
        verdict = {True: "met", False: "**missed**", None: "not measured"}[r["met"]]
        measured = "–" if r["median"] is None else (
            f"{_fmt(r['median'])}{r['unit']}" + (f" [{_fmt(r['min'])}–{_fmt(r['max'])}]" if r["min"] != r["max"] else ""))
        note = f" ({r['note']})" if r["note"] else ""
        out.append(f"| {r['target']}{note} | `{r['state']}` | {sign} {_fmt(r['required'])}{r['unit']} | {measured} "
                   f"| {r['rounds']} | {verdict} |")
    return out + [""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.targets", description=__doc__.split("\n\n")[0])
    p.add_argument("summary", nargs="?", type=Path, default=Path("bench/results/latest.json"))
    p.add_argument("--stall", type=Path, help="a bench.stall result (bench/results/stall.json)")
    p.add_argument("--per-byte", type=Path, help="a bench.per_byte result (bench/results/per_byte.json)")
    a = p.parse_args(argv)
    try:
        doc = json.loads(a.summary.read_text())
        stall = json.loads(a.stall.read_text()) if a.stall else None
        pb = json.loads(a.per_byte.read_text()) if a.per_byte else None
    except (OSError, ValueError) as e:
        print(f"error: {e}: pass the JSON files bench.run, bench.stall and bench.per_byte wrote", file=sys.stderr)
        return 2
    print("\n".join(markdown(judge(doc, stall, pb))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
