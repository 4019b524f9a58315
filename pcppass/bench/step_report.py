"""Markdown tables and the plot of the decode-step bench (:mod:`pcppass.bench.step`)."""

from __future__ import annotations

from pathlib import Path

from pcppass.bench.results import fmt, pyplot
from pcppass.bench.step import SYNCED, VARIANTS

LABELS = {"replicated": "replicated", "immediate": "per-site sync", "deferred": "pcppass deferred",
          "deferred_nochecks": "deferred, checks off", "nosync": "no sync"}


def _sync_lines(m: dict) -> list[str]:
    lines = []
    for v, s in m.get("smoke", {}).items():
        line = f"- smoke `{v}`: replicas bitwise equal across ranks = **{s['replicas_equal']}**"
        if s.get("differing_caches"):
            line += f" (differing: {len(s['differing_caches'])} caches; {s.get('expected', 'UNEXPECTED')})"
        if "syncs_per_step" in s:
            line += (f"; sync per step (collectives, bytes sent, bytes gathered) = {s['syncs_per_step'][-1]}"
                     f"; transport **{s.get('transport')}**; checks {s.get('checks')}")
        lines.append(line)
    return lines


def _table(m: dict, variants: list[str], graph: bool) -> list[str]:
    """Per (N, C): each variant's step time, the ideal speedup (replicated / no sync), and per synced
    variant its sync cost (variant - no sync) and its speedup as a share of the ideal."""
    prefix = "graph_" if graph else ""
    synced = [v for v in SYNCED if v in variants]
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
             f"hidden all-gather in sharded steps: {cfg['gather_hidden']}", ""]
    for key, m in result.get("models", {}).items():
        variants = [v for v in VARIANTS if any(v in e["variants"] for e in m.get("configs", []))]
        lines += [f"## {m['model']} ({cfg['size']} width, {m['layers']} layers, {m['params'] / 1e9:.2f} B params)", ""]
        lines += _sync_lines(m)
        lines += [f"- compile + first step (s): {m.get('compile_s')}", "", "Eager launch (slowest rank's median):", ""]
        lines += _table(m, variants, graph=False)
        if any("cuda_graph" in d for e in m.get("configs", []) for d in e["variants"].values()):
            lines += ["", "CUDA-graph replay (slowest rank's median):", ""]
            lines += _table(m, variants, graph=True)
            for e in m.get("configs", []):
                for vn, vd in e["variants"].items():
                    g = vd.get("cuda_graph", {})
                    if g and not g.get("captured"):
                        lines.append(f"- N={e['rows_per_rank']} C={e['context']} `{vn}`: not captured ({g['reason']})")
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
