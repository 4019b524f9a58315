"""Markdown tables and the plot of the decode-step bench (:mod:`pcppass.bench.step`)."""

from __future__ import annotations

from pathlib import Path

from pcppass.bench.results import fmt, pyplot
from pcppass.bench.step_config import NOCHECKS, SYNCED, VARIANTS

LABELS = {"replicated": "replicated", "immediate": "per-site sync", "deferred": "pcppass deferred",
          "deferred_allgather": "pcppass, all-gather", "immediate_nochecks": "per-site, checks off",
          "deferred_nochecks": "pcppass, checks off", "deferred_allgather_nochecks": "all-gather, checks off",
          "nosync": "no sync"}


#: the order of the per-variant sync columns: pcppass first
SHARE_ORDER = ("deferred", "deferred_allgather", "immediate", "deferred_nochecks", "deferred_allgather_nochecks",
               "immediate_nochecks")


def checks_text(checks: dict) -> str:
    """``on: a, b; off: c; in the graph's sync ops: header, slot_conflicts``."""
    if not isinstance(checks, dict) or "in_graph" not in checks and "inputs" not in checks:
        return str(checks)
    on = [k for k, v in checks.items() if v is True]
    off = [k for k, v in checks.items() if v is False]
    in_graph = [k for k, v in checks.get("in_graph", {}).items() if v]
    return (f"on: {', '.join(on) or 'none'}; off: {', '.join(off) or 'none'}; "
            f"in the graph's sync ops: {', '.join(in_graph) or 'none'}")


def _sync_lines(m: dict) -> list[str]:
    lines = []
    if "caches_in_symmetric_memory" in m:
        lines.append(f"- caches in symmetric memory: **{m['caches_in_symmetric_memory']}**"
                     + (f" ({m['symmetric_memory_refused']})" if m.get("symmetric_memory_refused") else ""))
    for v, s in m.get("smoke", {}).items():
        line = f"- smoke `{v}`: replicas bitwise equal across ranks = **{s['replicas_equal']}**"
        if s.get("differing_caches"):
            line += f" (differing: {len(s['differing_caches'])} caches; {s.get('expected', 'UNEXPECTED')})"
        if "syncs_per_step" in s:
            line += (f"; sync per step (collectives, bytes sent, bytes gathered) = {s['syncs_per_step'][-1]}"
                     f"; transport **{s.get('transport')}**; checks {checks_text(s.get('checks'))}")
        lines.append(line)
    return lines


def _replay_lines(m: dict) -> list[str]:
    """Per captured variant: replicas and device status after the replays; why others were not captured."""
    lines = []
    for e in m.get("configs", []):
        where = f"N={e['rows_per_rank']} C={e['context']}"
        for vn, vd in e["variants"].items():
            g = vd.get("cuda_graph", {})
            if g and not g.get("captured"):
                lines.append(f"- {where} `{vn}`: not captured ({g['reason']})")
            elif g.get("captured") and "replicas_equal_after_replays" in g:
                expected = " (expected: no sync)" if vn == "nosync" else ""
                lines.append(f"- {where} `{vn}`: after the timed replays and one with rotated owners, replicas "
                             f"bitwise equal = **{g['replicas_equal_after_replays']}**{expected}; device status "
                             f"{g.get('device_status')}")
    return lines


def checks_cost(m: dict) -> list[str]:
    """Per captured pair ``X`` / ``X_nochecks``: what the checks add to a replayed step."""
    lines = []
    for e in m.get("configs", []):
        for v, d in e["variants"].items():
            off = e["variants"].get(v + NOCHECKS, {}).get("cuda_graph", {})
            on = d.get("cuda_graph", {})
            if on.get("captured") and off.get("captured"):
                cost = on["slowest_rank_ms"] - off["slowest_rank_ms"]
                lines.append(f"- N={e['rows_per_rank']} C={e['context']} {LABELS[v]}: checks add "
                             f"{1000 * cost:.1f} µs ({100 * cost / on['slowest_rank_ms']:.2f}% of the checked step)")
    return lines


def _table(m: dict, variants: list[str], graph: bool) -> list[str]:
    """Per (N, C): each variant's step time, the ideal speedup (replicated / no sync), and per synced
    variant its sync cost (variant - no sync) and its speedup as a share of the ideal."""
    prefix = "graph_" if graph else ""
    synced = sorted((v for v in SYNCED if v in variants), key=SHARE_ORDER.index)
    head = (["N/rank", "context"] + [f"{LABELS[v]} ms" for v in variants] + ["ideal speedup"]
            + [f"{LABELS[v]}: sync ms / % of ideal" for v in synced])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in m.get("configs", []):
        d = e.get("derived", {})

        def t(v):
            data = e["variants"].get(v, {})
            if graph:
                data = data.get("cuda_graph", {})
                if not data.get("captured"):
                    return "–"
            return fmt(data.get("slowest_rank_ms"))

        def share(v):
            frac = d.get(f"{prefix}{v}_fraction_of_ideal")
            pct = fmt(100 * frac if frac is not None else None, ".1f")
            return f"{fmt(d.get(f'{prefix}{v}_sync_ms'))} / **{pct}**"

        lines.append("| " + " | ".join([str(e["rows_per_rank"]), str(e["context"])] + [t(v) for v in variants]
                                      + [fmt(d.get(prefix + "ideal_speedup"))] + [share(v) for v in synced]) + " |")
    return lines


def markdown(result: dict) -> str:
    env, cfg = result["environment"], result["config"]
    lines = [f"# pcppass bench: {env.get('device')} × {cfg['world']}", "",
             f"{env['date']} · torch {env['torch']} · triton {env.get('triton')} · NCCL {env.get('nccl')} · "
             f"CUDA {env.get('cuda')} · sync kernels: {cfg['sync_kernels']} · "
             f"hidden all-gather in sharded steps: {cfg['gather_hidden']} · caches in symmetric memory asked for: "
             f"{cfg.get('symmetric_caches', False)}", "",
             "Checks: every synced variant runs with `SyncChecks()` (every check on) except the `*_nochecks` "
             "ones, which run with every check off beside it.", ""]
    for key, m in result.get("models", {}).items():
        variants = [v for v in VARIANTS if any(v in e["variants"] for e in m.get("configs", []))]
        lines += [f"## {m['model']} ({cfg['size']} width, {m['layers']} layers, {m['params'] / 1e9:.2f} B params)", ""]
        lines += _sync_lines(m)
        lines += [f"- compile + first step (s): {m.get('compile_s')}", "", "Eager launch (slowest rank's median):", ""]
        lines += _table(m, variants, graph=False)
        if any("cuda_graph" in d for e in m.get("configs", []) for d in e["variants"].values()):
            lines += ["", "CUDA-graph replay (slowest rank's median):", ""]
            lines += _table(m, variants, graph=True) + [""] + _replay_lines(m) + checks_cost(m)
        lines.append("")
    micro = result.get("sync_microbench")
    if micro:
        lines += [f"## Sync cost: {micro['layers']} layers, DeepSeek-V3.2 rows (MLA {micro['mla_row_bytes']} B + "
                  f"indexer {micro['indexer_row_bytes']} B), real `pcppass::sync_*` ops, µs per step", "",
                  "per_cache = one scatter op per cache (torch kernels); batched = one pack launch + one "
                  "`sync_scatter_rows_all` launch per collective (Triton). graph = CUDA-graph replay.", "",
                  "| rows/rank | B/rank | per-site per_cache graph | deferred per_cache eager | deferred per_cache graph | "
                  "per-site batched graph | deferred batched eager | deferred batched graph | bare per-site graph | "
                  "bare single eager | bare single graph | deferred batched graph / bare graph | replicas equal |",
                  "|" + "---|" * 13]
        for r, e in micro["rows"].items():
            g, b = e.get("deferred_batched_graph_us"), e.get("bare_single_graph_us")
            ratio = g / b if isinstance(g, float) and isinstance(b, float) else None
            equal = all(e.get(f"{i}_replicas_equal_after_sync") and e.get(f"{i}_replicas_differ_before_sync")
                        for i in ("per_cache", "batched"))
            lines.append(
                f"| {r} | {e['bytes_per_rank_deferred']} | {fmt(e.get('per_site_per_cache_graph_us'), '.0f')} | "
                f"{fmt(e.get('deferred_per_cache_eager_us'), '.0f')} | {fmt(e.get('deferred_per_cache_graph_us'), '.0f')} | "
                f"{fmt(e.get('per_site_batched_graph_us'), '.0f')} | {fmt(e.get('deferred_batched_eager_us'), '.0f')} | "
                f"{fmt(g, '.1f')} | {fmt(e.get('bare_per_site_graph_us'), '.0f')} | "
                f"{fmt(e.get('bare_single_eager_us'), '.1f')} | {fmt(b, '.1f')} | {fmt(ratio, '.2f')}× | {equal} |")
        if any("deferred_reference_eager_us" in e for e in micro["rows"].values()):
            lines += ["", "| rows/rank | per-site ref+checks | deferred ref+checks | per-site ref | deferred ref |",
                      "|" + "---|" * 5]
            for r, e in micro["rows"].items():
                lines.append(f"| {r} | " + " | ".join(fmt(e.get(f"{k}_eager_us"), ".0f") for k in (
                    "per_site_reference_checked", "deferred_reference_checked", "per_site_reference",
                    "deferred_reference")) + " |")
        lines.append("")
    for err in result.get("errors", []):
        lines += [f"### error in {err['stage']}", "", "```", err["traceback"][-1500:], "```", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> bool:
    plt = pyplot()
    models = [m for m in result.get("models", {}).values() if m.get("configs")]
    if plt is None or not models:
        return False
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        labels = [f"N={e['rows_per_rank']}\nC={e['context'] // 1024}k" for e in m["configs"]]
        names = [v for v in VARIANTS if any(v in e["variants"] for e in m["configs"])]
        width = 0.8 / max(1, len(names))
        for i, v in enumerate(names):
            vals = []
            for e in m["configs"]:
                d = e["variants"].get(v, {})
                g = d.get("cuda_graph", {})
                vals.append(g["slowest_rank_ms"] if g.get("captured") else d.get("slowest_rank_ms", 0))
            ax.bar([x + i * width for x in range(len(labels))], vals, width, label=LABELS[v])
        ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(labels))], labels)
        ax.set_ylabel("decode step, ms (slowest rank; CUDA graph where captured)")
        ax.set_title(f"{m['model']} ({m['layers']} layers)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


#: the columns of the summary table, in order (those a run has)
SUMMARY = ("replicated", "deferred_allgather", "deferred_allgather_nochecks", "deferred", "deferred_nochecks",
           "immediate", "nosync")


def summary_table(results: list[dict]) -> str:
    """One row per (model, layers, N, C) of every result: each variant's CUDA-graph replay (slowest
    rank's median, ms) under a header naming the transport it actually ran with and its checks (so a
    deferred variant on ordinary caches lands in the all-gather column, not the peer-store one), the
    ideal speedup (replicated / no sync), each checked pcppass column's share of it, and whether the
    replicas were bitwise equal after the synced variants' replays."""
    entries = [(m, e) for r in results for m in r.get("models", {}).values() for e in m.get("configs", [])]
    cols: list[str] = []
    for v in SUMMARY:
        for _, e in entries:
            name = _column(v, e["variants"].get(v, {}))
            if _graph_ms(e, v) and name not in cols:
                cols.append(name)
    seen = list(cols)
    cols = sorted(cols, key=lambda c: _column_order(c, seen))
    checked = [c for c in cols if c.startswith("pcppass") and c.endswith("checks on")]
    rows = []
    for m, e in entries:
        ms = {_column(v, e["variants"].get(v, {})): _graph_ms(e, v) for v in SUMMARY if _graph_ms(e, v)}
        rep, nos = ms.get(LABELS["replicated"]), ms.get(LABELS["nosync"])
        shares = [fmt(100 * nos / ms[c] if nos and ms.get(c) else None, ".1f") for c in checked]
        equal = all(e["variants"][v]["cuda_graph"].get("replicas_equal_after_replays", False)
                    for v in SUMMARY if v in SYNCED and _graph_ms(e, v))
        rows.append([m["model"], str(m["layers"]), str(e["rows_per_rank"]), f"{e['context'] // 1024}k"]
                    + [fmt(ms.get(c)) for c in cols] + [fmt(rep / nos if rep and nos else None, ".2f") + "×"]
                    + shares + [str(equal)])
    head = (["model", "layers", "N/rank", "context"] + [f"{c} ms" for c in cols] + ["ideal"]
            + [f"% of ideal, {c}" for c in checked] + ["replicas equal after replays"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _column_order(name: str, seen: list[str]) -> tuple:
    """replicated, pcppass (all-gather, then peer stores; checks on before off), per-site, no sync."""
    group = 0 if name == LABELS["replicated"] else 1 if name.startswith("pcppass") else \
        3 if name == LABELS["nosync"] else 2
    transport = 0 if "all-gather" in name else 1 if "peer stores" in name else 2
    return group, transport, name.endswith("checks off"), seen.index(name)


def _graph_ms(entry: dict, variant: str) -> float | None:
    g = entry["variants"].get(variant, {}).get("cuda_graph", {})
    return g.get("slowest_rank_ms") if g.get("captured") else None


def _column(variant: str, data: dict) -> str:
    if variant not in SYNCED:
        return LABELS[variant]
    transport = str(data.get("transport", "")).split(" (")[0] or "?"
    checks = "checks off" if variant.endswith(NOCHECKS) else "checks on"
    kind = "per-site" if variant.startswith("immediate") else "pcppass"
    return f"{kind} {transport}, {checks}"
