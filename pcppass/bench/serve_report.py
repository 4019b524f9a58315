"""Summary, markdown and plot of ``pcppass bench serve`` (:mod:`pcppass.bench.serve`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pcppass.bench.results import fmt, pyplot

#: modes whose replicas must be bitwise equal after a run: every cache row is written by one rank
#: and copied to the others. (``replicated``: every rank computes and writes its own copy of each
#: decode row, equal only where every kernel gives the same bits on every GPU; ``nosync`` leaves
#: decode rows unsynchronised.)
SYNCHRONISED = ("pcppass", "per_site")


def summarise(rank_results: list[dict]) -> dict[str, Any]:
    """Rank 0's numbers plus the checks across ranks and modes: every rank submitted and admitted
    the requests in the same order, every mode served the same requests in the same order, every
    request completed, synchronised replicas are bitwise equal."""
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
        "every_request_completed": all(r["completed"] == n for r in runs),
        "synchronised_replicas_equal": all(r["replicas_equal"] for r in runs if r["mode"] in SYNCHRONISED),
        "replicated_replicas_equal (reported, not required)":
            "yes" if all(r["replicas_equal"] for r in runs if r["mode"] == "replicated") else "no",
        "nosync_replicas_differ": all(not r["replicas_equal"] for r in runs if r["mode"] == "nosync")
        if result["config"]["world"] > 1 else None,
    }
    for rs in by_hit.values():
        base = next((r for r in rs if r["mode"] == "replicated"), None)
        ideal = next((r for r in rs if r["mode"] == "nosync"), None)
        for r in rs:
            if base and base["request_throughput"]:
                r["req_s_vs_replicated"] = r["request_throughput"] / base["request_throughput"] - 1
            if ideal and base and ideal["request_throughput"] > base["request_throughput"]:
                gain, ideal_gain = (r["request_throughput"] - base["request_throughput"],
                                    ideal["request_throughput"] - base["request_throughput"])
                r["gain_fraction_of_ideal"] = gain / ideal_gain
    return result


def passed_checks(result: dict) -> bool:
    return not result.get("errors") and all(v is not False for v in result["checks"].values())


def markdown(result: dict) -> str:
    env, cfg = result["environment"], result["config"]
    lines = [f"# pcppass bench serve: {cfg['model']} ({cfg['size']}, {cfg['layers']} layers), P = {cfg['world']}, "
             f"{env.get('device')}", "",
             f"{env['date']} · torch {env['torch']} · triton {env.get('triton')} · NCCL {env.get('nccl')} · "
             f"inner compiler {cfg['inner']}", "",
             f"Workload: {cfg['num_requests']} requests per run, prompts of {cfg['prompt_len']} tokens sharing a "
             f"prefix at the target hit rate, {cfg['output_len']} output tokens each, concurrency "
             f"{cfg['concurrency']}, max_num_batched_tokens {cfg['max_num_batched_tokens']}; same requests and "
             "order in every mode; one warm-up request per run (fills the prefix cache, not measured).", "",
             "| hit (target / actual) | mode | req/s | vs replicated | of ideal gain | output tok/s | "
             "TPOT mean / p99 ms | TTFT mean / p99 ms | decode step ms | mixed step ms | replicas equal | "
             "decode sync transport |",
             "|" + "---|" * 12]
    for r in result["runs"]:
        vs = r.get("req_s_vs_replicated")
        frac = r.get("gain_fraction_of_ideal")
        transport = r.get("sync", {}).get("decode", {}).get("transport", "–")
        lines.append(
            f"| {r['hit_rate_target']:.0%} / {100 * r['prefix_hit_rate']:.2f}% | {r['mode']} | "
            f"{fmt(r['request_throughput'], '.3f')} | {fmt(100 * vs if vs is not None else None, '+.2f')}% | "
            f"{fmt(100 * frac if frac is not None else None, '.0f')}% | {fmt(r['output_throughput'], '.1f')} | "
            f"{fmt(r.get('mean_tpot_ms'), '.2f')} / {fmt(r.get('p99_tpot_ms'), '.2f')} | "
            f"{fmt(r.get('mean_ttft_ms'), '.0f')} / {fmt(r.get('p99_ttft_ms'), '.0f')} | "
            f"{fmt(r.get('mean_decode_step_ms'), '.2f')} | {fmt(r.get('mean_mixed_step_ms'), '.1f')} | "
            f"{r['replicas_equal']} | {transport} |")
    lines += ["", "Checks: " + ", ".join(f"{k} = **{v}**" for k, v in result.get("checks", {}).items()), ""]
    sync = next((r["sync"] for r in result["runs"] if r["mode"] == "pcppass"), None)
    if sync:
        lines.append(f"pcppass sync: decode {sync['decode'].get('transport')} "
                     f"({sync['decode'].get('collectives')} collective(s) per step), mixed "
                     f"{sync['mixed'].get('transport')}; checks {sync['decode'].get('checks')}")
    for err in result.get("errors", []):
        lines += [f"### error in {err['mode']} at hit {err['hit_rate']}", "", "```", err["traceback"][-1500:], "```"]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> bool:
    plt = pyplot()
    runs = result.get("runs", [])
    if plt is None or not runs:
        return False
    hits = sorted({r["hit_rate_target"] for r in runs})
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for metric, ax, label in (("request_throughput", axes[0], "req/s"), ("mean_tpot_ms", axes[1], "mean TPOT, ms")):
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            vals = [next((r.get(metric) or 0 for r in runs if r["mode"] == mode and r["hit_rate_target"] == h), 0)
                    for h in hits]
            ax.bar([x + i * width for x in range(len(hits))], vals, width, label=mode)
        ax.set_xticks([x + width * (len(modes) - 1) / 2 for x in range(len(hits))], [f"{h:.0%}" for h in hits])
        ax.set_xlabel("prefix-hit rate")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    cfg = result["config"]
    fig.suptitle(f"{cfg['model']} x{cfg['layers']} layers, P={cfg['world']}, prompts {cfg['prompt_len']}, "
                 f"concurrency {cfg['concurrency']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
