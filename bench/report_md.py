"""Markdown rendering of the summary document built by :mod:`bench.report`."""

from __future__ import annotations

from .targets import markdown as targets_md

LIMIT_LABEL = "limit: best of raw_1 / raw_2 / raw_d2"


def _s(x: float | None) -> str:
    return "–" if x is None else f"{x:.3g}"


def _stat(st: dict | None, scale: float = 1.0) -> str:
    if not st or st.get("median") is None:
        return "–"
    return f"{_s(st['median'] * scale)} [{_s(st['min'] * scale)}–{_s(st['max'] * scale)}]"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.0f}%"


def _label(doc: dict, method: str) -> str:
    if method == "limit":
        return LIMIT_LABEL
    return doc["methods"].get(method, {}).get("label", method)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out + [""]


def _machine(doc: dict) -> list[str]:
    m = doc["machine"]
    rows = [
        ["CPU", f"{m['cpu']} ({m['cores']} cores, {m['cores_usable']} usable)"],
        ["RAM", f"{m['ram_gib']} GiB ({m['ram_available_gib']} GiB available at start)"],
        ["disk", f"{m['disk_free_gib']} GiB free; {m['filesystem']}"],
        ["kernel / OS", f"{m['kernel']} / {m['os']}"],
        ["versions", f"python {m['python']}, torch {m['torch']}, safetensors {m['safetensors']}, "
                     f"numpy {m['numpy']}, trainguard {m['trainguard']}"],
        ["load average", f"start {m['loadavg_start']}, end {m.get('loadavg_end')}"],
    ]
    return ["## Machine", ""] + _table(["", ""], rows)


def _how(doc: dict) -> list[str]:
    infos = [s["info"] for s in doc["states"].values() if "peak_mode" in s["info"]]
    peak = infos[0]["peak_mode"] if infos else "–"
    cold = infos[0]["cold_how"] if infos else "–"
    c = doc["config"]
    return [
        "## How it was measured", "",
        f"- Repetitions: the first one (round 0) is shown apart; the steady figure is the median of "
        f"{c['reps']} more, with [min–max]. One process per rank holds the state; synchronous methods "
        "run round-robin (round r of each back to back); async methods run one after another, all "
        "rounds each, their stagers closed in between. Ratios pair the same round of both methods.",
        "- Save = call + fsync of every file written + fsync of the directory and its parent (durable), "
        "for every method alike. With 2 ranks: barrier to barrier.",
        "- Hot load: the checkpoint's files were read once just before (page cache). "
        f"Cold load: {cold}.",
        f"- Peak extra memory: {peak}, minus RSS at the start of the operation (after gc and "
        "malloc_trim), as % of the state's size; with 2 ranks the larger rank. Pages of a file the "
        "method mmaps count once touched (reclaimable page cache, but resident).",
        "- GB/s = the state's bytes (one replica with 2 ranks) / steady median time.",
        "- Every load is checked: in-place loads start from tensors overwritten with other data "
        "and must end holding the saved values.",
        f"- Async: a training loop with ~{c['step_seconds']} s steps (matmuls) that mutates every tensor "
        "in place after each step. Stall = time in the save call + waiting for `staged()` before the "
        "next mutation. Latency = call until durable. Slowdown = extra compute time of the steps that "
        "overlapped the save (CPU taken from training). Consistent = the checkpoint holds the values "
        "of the step it was called at. A method that keeps its staging buffers between saves shows "
        "their allocation in the first round's peak; they stay resident afterwards.",
        "",
    ]


def _save_rows(doc: dict, rows: list[dict]) -> list[str]:
    body = []
    for r in rows:
        if r["op"] != "save":
            continue
        m = r["metrics"]
        body.append([_label(doc, r["method"]), _s(m["seconds"]["first"]), _stat(m["seconds"]),
                     _s(r["gbps"]), f"{_pct(r['peak_pct']['first'])} / {_pct(r['peak_pct']['median'])}"])
    return ["### Save (durable)", ""] + _table(
        ["method", "first (s)", "steady (s) median [min–max]", "GB/s", "peak extra first / steady"], body)


def _load_rows(doc: dict, rows: list[dict]) -> list[str]:
    by = {(r["method"], r["op"], r["variant"]): r for r in rows}
    body = []
    for r in rows:
        if r["op"] != "load_hot":
            continue
        cold = by.get((r["method"], "load_cold", r["variant"]))
        cells = [_label(doc, r["method"]), r["variant"] or "–"]
        for x in (r, cold):
            if x is None:
                cells += ["–", "–", "–"]
            else:
                cells += [_s(x["metrics"]["seconds"]["first"]), _stat(x["metrics"]["seconds"]), _s(x["gbps"])]
        cells.append(_pct(r["peak_pct"]["median"]))
        body.append(cells)
    return ["### Load", ""] + _table(
        ["method", "load", "hot first (s)", "hot steady (s)", "hot GB/s", "cold first (s)",
         "cold steady (s)", "cold GB/s", "peak extra (hot)"], body)


def _async_rows(doc: dict, rows: list[dict], step: float | None) -> list[str]:
    body = []
    for r in rows:
        if r["op"] != "async":
            continue
        m = r["metrics"]
        ok = m.get("consistent", {}).get("by_round", {})
        body.append([
            _label(doc, r["method"]), _s(m["stall_s"]["first"]), _stat(m["stall_s"]), _stat(m["call_s"]),
            _stat(m["wait_s"]), _stat(m["latency_s"]), _stat(m["slowdown_s"]),
            f"{_pct(r['peak_pct']['first'])} / {_pct(r['peak_pct']['median'])}", "yes" if ok and all(v == 1.0 for v in ok.values()) else "**NO**",
        ])
    if not body:
        return []
    head = f"### Async save: training stall (step ≈ {_s(step)} s)" if step else "### Async save"
    return [head, ""] + _table(
        ["method", "stall first (s)", "stall steady (s)", "in call (s)", "waiting staged (s)",
         "latency to durable (s)", "training slowdown (s)", "peak extra first / steady", "consistent"], body)


def _limit_rows(doc: dict, rows: list[dict]) -> list[str]:
    body = []
    for r in rows:
        if r["method"] in ("limit", "memcpy"):
            what = {"save": "write + fsync", "load_hot": "read, hot", "load_cold": "read, cold",
                    "copy": "memcpy (copy_ into existing tensors)"}[r["op"]]
            body.append([what, _s(r["gbps"]), _stat(r["metrics"]["seconds"])])
    return (["### Limits (no serialization)", ""] + _table(["", "GB/s", "steady (s)"], body)) if body else []


def _ratio_cell(x: dict | None) -> str:
    return "–" if x is None else f"{_stat(x)} (first {_s(x['first'])})"


def _ratio_rows(doc: dict, ratios: list[dict]) -> list[str]:
    if not ratios:
        return []
    find = {(x["op"], x["metric"], x["other"], x["other_variant"]): x for x in ratios}
    base = doc["ratio_base"]
    out: list[str] = []
    keys = list(dict.fromkeys((x["other"], x["other_variant"]) for x in ratios
                              if x["op"] in ("load_hot", "load_cold")))
    keys += [(x["other"], "") for x in ratios if x["op"] == "save" and not any(k[0] == x["other"] for k in keys)]
    if keys:
        body = [[_label(doc, m) + (f" / {v}" if v else ""), _ratio_cell(find.get(("save", "seconds", m, ""))),
                 _ratio_cell(find.get(("load_hot", "seconds", m, v))),
                 _ratio_cell(find.get(("load_cold", "seconds", m, v)))] for m, v in keys]
        out += [f"### Ratios `{base[0]}` ÷ other, time (same round; < 1: {base[0]} faster)", ""]
        out += _table(["other", "save", "load hot", "load cold"], body)
    others = list(dict.fromkeys(x["other"] for x in ratios if x["op"] == "async"))
    if others:
        body = [[_label(doc, m), _ratio_cell(find.get(("async", "stall_s", m, ""))),
                 _ratio_cell(find.get(("async", "latency_s", m, "")))] for m in others]
        out += [f"### Ratios `{base[-1]}` ÷ other, async (same round)", ""]
        out += _table(["other", "stall", "latency to durable"], body)
    return out


def _state(doc: dict, name: str, st: dict) -> list[str]:
    info = st["info"]
    if "bytes" not in info:
        return [f"## State `{name}`: FAILED — {info['failed']}", ""]
    head = (f"## State `{name}`: {info['bytes'] / 1e9:.3g} GB, {info['tensors']} tensors, "
            f"{info['world']} rank(s)" + (f" (each a replica of `{info['base_state']}`)" if info["world"] > 1 else ""))
    out = [head, ""]
    if "failed" in info:
        out += [f"**FAILED — {info['failed']}; the figures below are what was measured before.**", ""]
    out += _save_rows(doc, st["rows"]) + _load_rows(doc, st["rows"])
    out += _async_rows(doc, st["rows"], info.get("step_seconds"))
    out += _limit_rows(doc, st["rows"]) + _ratio_rows(doc, st["ratios"])
    for k, v in info.get("skipped", {}).items():
        out.append(f"- skipped `{k}`: {v}")
    for k, v in info.get("errors", {}).items():
        out.append(f"- **error** in `{k}`: `{v.strip().splitlines()[-1]}`")
    for k, ws in info.get("warnings", {}).items():
        out.append(f"- warnings from `{k}`: " + "; ".join(f"`{w}`" for w in ws[:3]))
    return out + [""]


def _per_byte(doc: dict) -> list[str]:
    pb = doc["per_byte"]
    if not pb["rows"]:
        return []
    body = [[_label(doc, r["method"]), r["op"] + (f" {r['variant']}" if r["variant"] else ""),
             _s(r["large_gbps"]), _s(r["small_gbps"]), f"{r['small_over_large']:.2f}"] for r in pb["rows"]]
    small = doc["states"]["small10k"]["info"].get("tensors", "many")
    large = doc["states"][pb["large_state"]]["info"].get("tensors", "few")
    return [f"## Per byte: {small} small tensors (`small10k`) vs {large} large ones (`{pb['large_state']}`)", "",
            "GB/s = state bytes / steady median time; a ratio well below 1 is per-tensor overhead. The two "
            "states run in separate processes minutes apart, so the machine's drift is in these ratios; "
            "`python -m bench.per_byte` pairs trainguard's two saves round by round in one process.", ""] + _table(
        ["method", "op", f"GB/s `{pb['large_state']}`", "GB/s `small10k`", "small ÷ large"], body)


def _methods(doc: dict) -> list[str]:
    out = ["## What each method does", ""]
    for name, d in doc["methods"].items():
        line = f"- `{name}` ({d['label']}): {d['save']}"
        if d.get("loads"):
            line += f". Loads: {d['loads']}"
        if d.get("multi_rank"):
            line += f". 2 ranks: {d['multi_rank']}"
        out.append(line + ".")
    return out + ["- `limit`: per round, the fastest of `raw_1`, `raw_2` and `raw_d2` (O_DIRECT).", ""]


def markdown(doc: dict) -> str:
    c = doc["config"]
    out = [f"# trainguard benchmark — {doc['created']}", "",
           f"`{doc['command']}` — scale {c['scale']}, {c['reps']} steady reps + 1 first, states "
           f"{', '.join(c['states'])}; {doc['wall_s']:.0f} s in all.", ""]
    out += [f"- note: {n}" for n in c.get("notes", [])] + ([""] if c.get("notes") else [])
    if doc.get("targets"):
        out += ["## Targets (issue 6)", "",
                "Judged by `bench/targets.py` on this run's paired rounds (`python -m bench.targets` adds the "
                "async targets of issue 4 from `bench.stall` and the paired per-byte run of `bench.per_byte`).",
                ""] + targets_md(doc["targets"])
    if doc.get("targets_error"):
        out += [f"**The targets could not be judged: {doc['targets_error']}** (`python -m bench.targets`).", ""]
    out += _machine(doc) + _how(doc)
    for name, st in doc["states"].items():
        out += _state(doc, name, st)
    out += _per_byte(doc) + _methods(doc)
    return "\n".join(out) + "\n"
