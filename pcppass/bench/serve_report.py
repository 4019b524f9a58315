"""Summary, markdown and plot of ``pcppass bench serve`` (:mod:`pcppass.bench.serve`).

A run of the bench holds ``repeats`` rounds per hit rate (each mode once per round); single runs were
noisier than the differences between modes, so the report leads with per (hit rate, mode) medians and
min-max ranges over the rounds, and counts in how many rounds a mode beat that round's replicated run
(a gain whose sign flips between rounds is not a gain). Result files written before the rounds existed
(no ``repeat`` in their runs) read as one round.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from pcppass.bench.results import fmt, pyplot

#: modes whose replicas must be bitwise equal after a run: every cache row is written by one rank
#: and copied to the others. (``replicated``: every rank computes and writes its own copy of each
#: decode row, equal only where every kernel gives the same bits on every GPU; ``nosync`` leaves
#: decode rows unsynchronised.)
SYNCHRONISED = ("pcppass", "per_site")

#: the per-run numbers aggregated over the rounds (median, min, max)
AGGREGATED = ("request_throughput", "output_throughput", "mean_tpot_ms", "mean_ttft_ms", "mean_decode_step_ms",
              "mean_mixed_step_ms", "prefix_hit_rate")


def _round(run: dict) -> int:
    """The run's round (0 in files written before rounds were recorded)."""
    return run.get("repeat", 0)


def _group(runs: list[dict], key) -> dict[Any, list[dict]]:
    groups: dict[Any, list[dict]] = {}
    for r in runs:
        groups.setdefault(key(r), []).append(r)
    return groups


def spread(values: list[Any]) -> dict[str, float] | None:
    """Median, min and max of the values present (None where no run has the number)."""
    present = [v for v in values if isinstance(v, (int, float))]
    if not present:
        return None
    return {"median": statistics.median(present), "min": min(present), "max": max(present)}


def _vs(run: dict | None, base: dict | None, ideal: dict | None, metric: str = "request_throughput") -> dict:
    """req/s against replicated, and the gain as a share of the no-sync ideal's gain (only where the
    ideal gained: a share of a loss means nothing)."""
    out: dict[str, float] = {}
    if run is None or base is None or not base.get(metric):
        return out
    out["req_s_vs_replicated"] = run[metric] / base[metric] - 1
    if ideal is not None and ideal[metric] > base[metric]:
        out["gain_fraction_of_ideal"] = (run[metric] - base[metric]) / (ideal[metric] - base[metric])
    return out


def summarise(rank_results: list[dict]) -> dict[str, Any]:
    """Rank 0's numbers plus the checks across ranks, modes and rounds: every rank submitted and
    admitted the requests in the same order, every mode in every round served the same requests in
    the same order, every mode ran in every round, every request completed, synchronised replicas
    are bitwise equal; then each run against its round's replicated run, and the aggregates over the
    rounds (:func:`aggregate`)."""
    result = dict(rank_results[0])
    runs = result["runs"]
    same_on_ranks = all(
        [r["submitted"] for r in other["runs"]] == [r["submitted"] for r in runs]
        and [r["admitted"] for r in other["runs"]] == [r["admitted"] for r in runs]
        for other in rank_results[1:])
    by_hit: dict[float, list[dict]] = {}
    for r in runs:
        by_hit.setdefault(r["hit_rate_target"], []).append(r)
    same_order = all(len({tuple(r["submitted"]) for r in rs}) == 1 and len({tuple(r["admitted"]) for r in rs}) == 1
                     for rs in by_hit.values())
    n = result["config"]["num_requests"]
    result["checks"] = {
        "same_order_on_every_rank": same_on_ranks,
        "same_requests_and_order_in_every_mode": same_order,
        "every_mode_ran_every_round": _every_mode_every_round(runs, result["config"].get("repeats", 1)),
        "every_request_completed": all(r["completed"] == n for r in runs),
        "synchronised_replicas_equal": all(r["replicas_equal"] for r in runs if r["mode"] in SYNCHRONISED),
        "replicated_replicas_equal (reported, not required)":
            "yes" if all(r["replicas_equal"] for r in runs if r["mode"] == "replicated") else "no",
        "nosync_replicas_differ": all(not r["replicas_equal"] for r in runs if r["mode"] == "nosync")
        if result["config"]["world"] > 1 else None,
    }
    result["checks"]["same_outputs_in_every_round (reported, not required)"] = _same_outputs_across_rounds(runs)
    for rs in _group(runs, lambda r: (r["hit_rate_target"], _round(r))).values():
        base = next((r for r in rs if r["mode"] == "replicated"), None)
        ideal = next((r for r in rs if r["mode"] == "nosync"), None)
        for r in rs:
            r.update(_vs(r, base, ideal))
    result["aggregates"] = aggregate(runs)
    return result


def _every_mode_every_round(runs: list[dict], repeats: int) -> bool:
    """Each (hit rate, mode) ran once in each of the ``repeats`` rounds (else its median would be over
    fewer rounds than its neighbours')."""
    groups = _group(runs, lambda r: (r["hit_rate_target"], r["mode"]))
    return all(sorted(_round(r) for r in rs) == list(range(repeats)) for rs in groups.values())


def _same_outputs_across_rounds(runs: list[dict]) -> str:
    """Whether each (hit rate, mode) produced the same tokens in every round: the same requests in
    the same order on fresh caches should; a "no" says a kernel is not deterministic from run to run
    (reported: the timing comparison does not need it)."""
    groups = _group(runs, lambda r: (r["hit_rate_target"], r["mode"]))
    if all(len(rs) < 2 for rs in groups.values()):
        return "n/a (one round)"
    return "yes" if all(len({r.get("outputs_digest") for r in rs}) == 1 for rs in groups.values()) else "no"


def _median_run(req_s: dict | None) -> dict | None:
    """A stand-in run holding the median req/s, for :func:`_vs`."""
    return {"request_throughput": req_s["median"]} if req_s else None


def aggregate(runs: list[dict]) -> list[dict[str, Any]]:
    """Per (hit rate, mode), in the order of the first round: median, min and max of each number in
    :data:`AGGREGATED` over the rounds; req/s against replicated and the share of the ideal gain from
    the medians; and the per-round comparison against that round's replicated run
    (``rounds_above_replicated``: in how many rounds this mode served more req/s)."""
    ordered = sorted(runs, key=_round)  # stable: the first round's order leads
    by_mode = _group(ordered, lambda r: (r["hit_rate_target"], r["mode"]))
    by_round = _group(runs, lambda r: (r["hit_rate_target"], _round(r), r["mode"]))
    medians = {key: spread([r.get("request_throughput") for r in rs]) for key, rs in by_mode.items()}
    rows = []
    for (hit, mode), rs in by_mode.items():
        row: dict[str, Any] = {"hit_rate_target": hit, "mode": mode, "rounds": len(rs),
                               **{m: spread([r.get(m) for r in rs]) for m in AGGREGATED},
                               "replicas_equal": all(r["replicas_equal"] for r in rs)}
        row.update(_vs(*(_median_run(medians.get((hit, m))) for m in (mode, "replicated", "nosync"))))
        if mode != "replicated":
            per_round = [_vs(r, by_round.get((hit, _round(r), "replicated"), [None])[0], None) for r in rs]
            by_round_vs = [v["req_s_vs_replicated"] for v in per_round if "req_s_vs_replicated" in v]
            row["req_s_vs_replicated_by_round"] = by_round_vs
            above = sum(v > 0 for v in by_round_vs)
            row["rounds_above_replicated"] = f"{above}/{len(by_round_vs)}" if by_round_vs else None
        rows.append(row)
    return rows


def passed_checks(result: dict) -> bool:
    return not result.get("errors") and all(v is not False for v in result["checks"].values())


def _pct(x: float | None, spec: str) -> str:
    """A share as a percentage, ``–`` where it is missing."""
    return f"{100 * x:{spec}}%" if isinstance(x, (int, float)) else "–"


def _median(stats: dict | None, spec: str) -> str:
    return fmt(stats["median"] if stats else None, spec)


def _range(stats: dict | None, spec: str) -> str:
    return f"{fmt(stats['min'], spec)}–{fmt(stats['max'], spec)}" if stats else "–"


def _header(result: dict) -> list[str]:
    env, cfg = result["environment"], result["config"]
    runs = result.get("runs", [])
    graphs = {r.get("cuda_graphs") for r in runs}
    graphs_text = "not recorded (eager launch)" if graphs <= {None} else ", ".join(
        "captured" if g else "eager launch" for g in sorted(g for g in graphs if g is not None))
    rounds = max((_round(r) for r in runs), default=0) + 1
    return [f"# pcppass bench serve: {cfg['model']} ({cfg['size']}, {cfg['layers']} layers), P = {cfg['world']}, "
            f"{env.get('device')}", "",
            f"{env['date']} · torch {env['torch']} · triton {env.get('triton')} · NCCL {env.get('nccl')} · "
            f"inner compiler {cfg['inner']} · decode steps: {graphs_text}", "",
            f"Workload: {cfg['num_requests']} requests per run, prompts of {cfg['prompt_len']} tokens sharing a "
            f"prefix at the target hit rate, {cfg['output_len']} output tokens each, concurrency "
            f"{cfg['concurrency']}, max_num_batched_tokens {cfg['max_num_batched_tokens']}; same requests and "
            "order in every mode; one warm-up request per run (fills the prefix cache, not measured). "
            f"{rounds} round(s) per hit rate, every mode once per round, the modes' order rotated by one each "
            "round; numbers are medians over the rounds, req/s also its min–max; vs replicated and of ideal "
            "gain from the medians; above replicated: rounds in which the mode beat that round's replicated "
            "run.", ""]


def _summary_table(rows: list[dict], runs: list[dict]) -> list[str]:
    """One row per (hit rate, mode): the medians over the rounds, the req/s range, the sign count."""
    transport = {(r["hit_rate_target"], r["mode"]): r.get("sync", {}).get("decode", {}).get("transport", "–")
                 for r in runs}
    lines = ["| hit (target / actual) | mode | rounds | req/s median | req/s min–max | vs replicated | "
             "above replicated | of ideal gain | output tok/s | TPOT mean ms | TTFT mean ms | decode step ms | "
             "mixed step ms | replicas equal | decode sync transport |",
             "|" + "---|" * 15]
    for a in rows:
        hit = a["prefix_hit_rate"]
        lines.append(
            f"| {a['hit_rate_target']:.0%} / {_pct(hit['median'] if hit else None, '.2f')} | {a['mode']} | "
            f"{a['rounds']} | {_median(a['request_throughput'], '.3f')} | {_range(a['request_throughput'], '.3f')} | "
            f"{_pct(a.get('req_s_vs_replicated'), '+.2f')} | {a.get('rounds_above_replicated') or '–'} | "
            f"{_pct(a.get('gain_fraction_of_ideal'), '.0f')} | {_median(a['output_throughput'], '.1f')} | "
            f"{_median(a['mean_tpot_ms'], '.2f')} | {_median(a['mean_ttft_ms'], '.0f')} | "
            f"{_median(a['mean_decode_step_ms'], '.2f')} | {_median(a['mean_mixed_step_ms'], '.1f')} | "
            f"{a['replicas_equal']} | {transport.get((a['hit_rate_target'], a['mode']), '–')} |")
    return lines


def _runs_table(runs: list[dict]) -> list[str]:
    """Every run in the order it ran, against its own round's replicated run."""
    lines = ["| hit | round | position | mode | req/s | vs replicated (round) | output tok/s | TPOT mean / p99 ms | "
             "TTFT mean / p99 ms | decode step ms | mixed step ms | replicas equal |",
             "|" + "---|" * 12]
    for r in runs:
        lines.append(
            f"| {r['hit_rate_target']:.0%} | {_round(r) + 1} | {r.get('order_position', '–')} | {r['mode']} | "
            f"{fmt(r['request_throughput'], '.3f')} | {_pct(r.get('req_s_vs_replicated'), '+.2f')} | "
            f"{fmt(r['output_throughput'], '.1f')} | "
            f"{fmt(r.get('mean_tpot_ms'), '.2f')} / {fmt(r.get('p99_tpot_ms'), '.2f')} | "
            f"{fmt(r.get('mean_ttft_ms'), '.0f')} / {fmt(r.get('p99_ttft_ms'), '.0f')} | "
            f"{fmt(r.get('mean_decode_step_ms'), '.2f')} | {fmt(r.get('mean_mixed_step_ms'), '.1f')} | "
            f"{r['replicas_equal']} |")
    return lines


def markdown(result: dict) -> str:
    """The summary table (medians over the rounds), the checks, every run; also renders result files
    written before the rounds (aggregated on the fly, one round each)."""
    runs = result.get("runs", [])
    rows = result.get("aggregates") or aggregate(runs)
    lines = _header(result) + _summary_table(rows, runs)
    lines += ["", "Checks: " + ", ".join(f"{k} = **{v}**" for k, v in result.get("checks", {}).items()), ""]
    sync = next((r["sync"] for r in runs if r["mode"] == "pcppass"), None)
    if sync:
        lines.append(f"pcppass sync: decode {sync['decode'].get('transport')} "
                     f"({sync['decode'].get('collectives')} collective(s) per step), mixed "
                     f"{sync['mixed'].get('transport')}; checks {sync['decode'].get('checks')}")
    lines += ["", "### Every run, in the order run", ""] + _runs_table(runs)
    for err in result.get("errors", []):
        where = f" (round {err['repeat'] + 1})" if "repeat" in err else ""
        lines += [f"### error in {err.get('mode')} at hit {err.get('hit_rate')}{where}", "", "```",
                  err["traceback"][-1500:], "```"]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> bool:
    """req/s and mean TPOT per hit rate and mode: medians over the rounds, min–max as error bars."""
    plt = pyplot()
    runs = result.get("runs", [])
    if plt is None or not runs:
        return False
    rows = result.get("aggregates") or aggregate(runs)
    hits = sorted({a["hit_rate_target"] for a in rows})
    modes = list(dict.fromkeys(a["mode"] for a in rows))
    stats = {(a["hit_rate_target"], a["mode"]): a for a in rows}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(modes)
    for metric, ax, label in (("request_throughput", axes[0], "req/s"), ("mean_tpot_ms", axes[1], "mean TPOT, ms")):
        for i, mode in enumerate(modes):
            cells = [(stats.get((h, mode)) or {}).get(metric) or {"median": 0, "min": 0, "max": 0} for h in hits]
            medians = [c["median"] for c in cells]
            errors = [[c["median"] - c["min"] for c in cells], [c["max"] - c["median"] for c in cells]]
            ax.bar([x + i * width for x in range(len(hits))], medians, width, yerr=errors, capsize=2, label=mode)
        ax.set_xticks([x + width * (len(modes) - 1) / 2 for x in range(len(hits))], [f"{h:.0%}" for h in hits])
        ax.set_xlabel("prefix-hit rate")
        ax.set_ylabel(f"{label} (median, min–max)")
        ax.legend(fontsize=8)
    cfg = result["config"]
    rounds = max(a["rounds"] for a in rows)
    fig.suptitle(f"{cfg['model']} x{cfg['layers']} layers, P={cfg['world']}, prompts {cfg['prompt_len']}, "
                 f"concurrency {cfg['concurrency']}, {rounds} round(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
