"""Turn the workers' raw records into the summary document (latest.json) and its markdown.

Statistics: round 0 is reported alone as "first"; the steady figure is the median of rounds
1..reps with their min and max. Ratios base / other are taken round by round (same round, same
data, back to back) and then summarised the same way. GB/s = state bytes / steady median time.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

from .config import Config
from .report_md import markdown
from .targets import judge

__all__ = ["build", "markdown"]

METRICS = {
    "save": ("seconds", "peak_extra"),
    "load_hot": ("seconds", "peak_extra"),
    "load_cold": ("seconds", "peak_extra"),
    "copy": ("seconds", "peak_extra"),
    "async": ("stall_s", "call_s", "wait_s", "latency_s", "slowdown_s", "peak_extra", "steps_in_flight"),
}
TIME_METRIC = {"save": "seconds", "load_hot": "seconds", "load_cold": "seconds", "copy": "seconds",
               "async": "stall_s"}
LIMIT_SOURCES = ("raw_1", "raw_2", "raw_d2")


def stats(by_round: dict[int, float]) -> dict[str, object]:
    steady = [v for r, v in sorted(by_round.items()) if r > 0] or [v for r, v in by_round.items() if r == 0]
    return {
        "first": by_round.get(0),
        "median": statistics.median(steady) if steady else None,
        "min": min(steady) if steady else None,
        "max": max(steady) if steady else None,
        "n": len(steady),
        "by_round": {str(r): v for r, v in sorted(by_round.items())},
    }


Key = tuple[str, str, str]  # method, op, variant


def _collect(records: list[dict]) -> dict[Key, dict[str, dict[int, float]]]:
    out: dict[Key, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for rec in records:
        key = (rec["method"], rec["op"], rec["variant"])
        for m in METRICS[rec["op"]]:
            if m in rec:
                out[key][m][rec["round"]] = float(rec[m])
        if rec["op"] == "async":
            out[key]["consistent"][rec["round"]] = 1.0 if rec.get("consistent") else 0.0
    return out


def _add_limits(coll: dict[Key, dict[str, dict[int, float]]]) -> None:
    """The limit row: per round, the best of the raw 1-stream and 2-stream figures."""
    for op in ("save", "load_hot", "load_cold"):
        srcs = [v for k, v in coll.items() if k[0] in LIMIT_SOURCES and k[1] == op]
        if not srcs:
            continue
        rounds = set.intersection(*(set(s["seconds"]) for s in srcs))
        best = {r: min(range(len(srcs)), key=lambda i, r=r: srcs[i]["seconds"][r]) for r in rounds}
        coll[("limit", op, "")] = {
            m: {r: srcs[best[r]][m][r] for r in rounds} for m in ("seconds", "peak_extra")
        }


def _rows(coll: dict[Key, dict[str, dict[int, float]]], nbytes: int) -> list[dict]:
    rows = []
    for (method, op, variant), metrics in coll.items():
        row: dict = {"method": method, "op": op, "variant": variant,
                     "metrics": {m: stats(v) for m, v in metrics.items()}}
        t = row["metrics"].get("seconds", {}).get("median")
        row["gbps"] = nbytes / t / 1e9 if t else None
        peak = row["metrics"].get("peak_extra", {})
        row["peak_pct"] = {k: (100.0 * peak[k] / nbytes if peak.get(k) is not None else None)
                           for k in ("first", "median", "max")}
        rows.append(row)
    return rows


def _ratios(coll: dict[Key, dict[str, dict[int, float]]], base: tuple[str, ...]) -> list[dict]:
    sync_base = base[0] if base else "trainguard"
    async_base = base[1] if len(base) > 1 else "trainguard_async"
    out = []
    for (bm, bop, bvar), bmet in coll.items():
        if bm not in (sync_base, async_base) or (bop == "async") != (bm == async_base):
            continue
        for (om, oop, ovar), omet in coll.items():
            if oop != bop or om == bm:
                continue
            for metric in ((TIME_METRIC[bop], "latency_s") if bop == "async" else ("seconds",)):
                pair = {r: bmet[metric][r] / omet[metric][r] for r in bmet.get(metric, {})
                        if omet.get(metric, {}).get(r)}
                if pair:
                    out.append({"base": bm, "base_variant": bvar, "other": om, "other_variant": ovar,
                                "op": bop, "metric": metric, **stats(pair)})
    return out


def summarize_state(raw: dict, ratio_base: tuple[str, ...]) -> dict:
    if "records" not in raw:
        return {"info": {"failed": raw.get("failed", "no results")}, "rows": [], "ratios": []}
    coll = _collect(raw["records"])
    _add_limits(coll)
    info = {k: v for k, v in raw.items() if k not in ("records", "methods")}
    return {"info": info, "rows": _rows(coll, raw["bytes"]), "ratios": _ratios(coll, ratio_base),
            "records": raw["records"]}


def per_byte(states: dict[str, dict]) -> dict:
    """GB/s of every (method, op, variant) on the many-small-tensor state vs the large-tensor one."""
    small = states.get("small10k")
    large_name = "gpt" if "gpt" in states else "100mb"
    large = states.get(large_name)
    if not small or not large or not small["rows"] or not large["rows"]:
        return {"large_state": large_name, "rows": []}
    big = {(r["method"], r["op"], r["variant"]): r for r in large["rows"] if r.get("gbps")}
    rows = []
    for r in small["rows"]:
        k = (r["method"], r["op"], r["variant"])
        if k in big and r.get("gbps"):
            rows.append({"method": k[0], "op": k[1], "variant": k[2], "large_gbps": big[k]["gbps"],
                         "small_gbps": r["gbps"], "small_over_large": r["gbps"] / big[k]["gbps"]})
    return {"large_state": large_name, "rows": rows}


def build(cfg: Config, machine: dict, results: dict[str, dict], *, ratio_base: tuple[str, ...],
          argv: list[str], wall_s: float) -> dict:
    states = {name: summarize_state(raw, ratio_base) for name, raw in results.items()}
    described = next((raw["methods"] for raw in results.values() if "methods" in raw), {})
    doc = {
        "created": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": "python -m bench.run " + " ".join(argv),
        "config": {k: v for k, v in vars(cfg).items() if k != "tmp"},
        "machine": machine,
        "ratio_base": list(ratio_base),
        "wall_s": wall_s,
        "methods": described,
        "states": states,
        "per_byte": per_byte(states),
    }
    try:  # issue 6's, from this run alone (bench.targets adds bench.stall's)
        doc["targets"] = judge(doc)
    except Exception as e:  # a run's figures are worth more than its verdicts: never lose them to a bug here
        doc["targets_error"] = f"{type(e).__name__}: {e}"
    return doc
