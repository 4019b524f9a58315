"""What the fail-closed checks cost on the host (CPU reference ops, one process).

    python bench/failclosed_costs.py [--rows 8,32,128] [--reps 20] [--out bench/results --tag cpu]

1. The deferred sync's host ops for 61 DeepSeek-V3.2 layers (MLA fp8_ds_mla rows of 656 B, indexer
   rows of 132 B block-split, 122 caches), two ranks simulated in one process (both pack, the
   packs are concatenated as the all-gather would, the scatter runs as rank 1): the earlier
   checked scatter (``sync_scatter_rows_all`` checking its own slots) against the snapshot before
   the first write + the verdict + the scatter that takes it. The collective itself is not timed.
2. The state digest of one checked call: every cache and buffer (``tensor_digest``), and the scan
   of live tensors outside the graph (``gc``) at this process's object count.

Medians of ``--reps`` runs, one thread. Writes ``failclosed_costs_<tag>.json`` / ``.md`` / ``.png``
under ``--out``; the numbers depend on the host and its load (recorded with them).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from pcppass.bench.environment import environment
from pcppass.bench.results import pyplot, write
from pcppass.engine.launch import free_port
from pcppass.sync import rows
from pcppass.runtime import state_checks
from pcppass.spec import ResolvedLayout

LAYERS, BS, NB = 61, 64, 64
MLA = ResolvedLayout("paged_rows", BS, 656)
INDEXER = ResolvedLayout("block_split", BS, 132, segments=((0, 128, 128), (BS * 128, 4, 4)))
FP = "5eed" * 8


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _caches() -> list[torch.Tensor]:
    out = []
    for _ in range(LAYERS):
        out += [torch.zeros(NB, BS, 656, dtype=torch.uint8), torch.zeros(NB, BS * 132, dtype=torch.uint8)]
    return out


def sync_costs(rows_per_rank: int, reps: int, group_name: str) -> dict[str, float]:
    caches = _caches()
    layouts = [MLA, INDEXER] * LAYERS
    encoded = [x for lay in layouts for x in rows.encode_layout(lay)]
    n = len(caches)
    slots = [torch.arange(r * rows_per_rank, (r + 1) * rows_per_rank) for r in range(2)]
    packed = [rows.sync_pack(FP, caches, [slots[r]] * n, encoded, [slots[r]]) for r in range(2)]
    gathered = torch.cat(packed)
    index = rows.sync_read_header(gathered, 2, FP, n + 1, False)
    rows_segs, slot_segs, labels = list(range(n)), [n] * n, "\n".join(f"layer site {i}" for i in range(n))
    rows._group_rank = lambda _group: 1  # the scatter runs as rank 1

    def checked_scatter():
        rows.sync_scatter_rows_all(caches, gathered, index, rows_segs, slot_segs, encoded, group_name, labels, True)

    def snapshot_verdict_scatter():
        snap = rows.sync_snapshot(caches, [slots[1]] * n, encoded)
        verdict = rows.sync_verdict(caches, gathered, index, 2, FP, n + 1, True, list(range(n)), slot_segs, encoded,
                                    labels, True, [snap], [slots[1]] * n, list(range(n)), encoded, [n], group_name)
        rows.sync_scatter_rows_all(caches, gathered, index, rows_segs, slot_segs, encoded, group_name, labels, True,
                                   verdict)

    return {"pack": _median_ms(lambda: rows.sync_pack(FP, caches, [slots[1]] * n, encoded, [slots[1]]), reps),
            "snapshot": _median_ms(lambda: rows.sync_snapshot(caches, [slots[1]] * n, encoded), reps),
            "checked scatter (before)": _median_ms(checked_scatter, reps),
            "snapshot + verdict + scatter (now)": _median_ms(snapshot_verdict_scatter, reps)}


def digest_costs(reps: int) -> dict[str, float]:
    caches = _caches()
    state_bytes = sum(c.numel() for c in caches)
    return {f"digest of {LAYERS * 2} caches ({state_bytes / 2**20:.0f} MiB)":
            _median_ms(lambda: [state_checks.tensor_digest(c) for c in caches], max(3, reps // 4)),
            f"scan of live tensors ({len(gc.get_objects())} objects)":
            _median_ms(lambda: state_checks.outside_tensors(caches), max(3, reps // 4))}


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def markdown(result: dict) -> str:
    env = result["environment"]
    counts = sorted(result["sync"], key=int)
    names = list(result["sync"][counts[0]])
    lines = [f"# Fail-closed checks on the host: {env.get('cpu', '')}", "",
             f"{env.get('date', '')} · torch {env.get('torch', '')} · one thread · load {result['load']:.1f} on "
             f"{result['cores']} cores · median ms of {result['reps']} runs", "",
             "Deferred sync of 61 DeepSeek-V3.2 layers (122 caches), CPU reference ops, the collective not timed:",
             "", "| op | " + " | ".join(f"{n} rows/rank" for n in counts) + " |", "|---|" + "---|" * len(counts)]
    lines += [f"| {name} | " + " | ".join(f"{result['sync'][n][name]:.2f}" for n in counts) + " |" for name in names]
    lines += ["", "State digest of one checked call:", "", "| what | ms |", "|---|---|"]
    lines += [f"| {name} | {ms:.2f} |" for name, ms in result["digest"].items()]
    return "\n".join(lines) + "\n"


def plot(result: dict, path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    counts = sorted(result["sync"], key=int)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name in result["sync"][counts[0]]:
        ax.plot([int(n) for n in counts], [result["sync"][n][name] for n in counts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows per rank")
    ax.set_ylabel("ms (median, one thread)")
    ax.set_title(f"Deferred sync host ops, 122 caches: {result['environment'].get('cpu', '')}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="8,32,128")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    result = {"environment": {**environment(), "cpu": cpu_model()},
              "load": os.getloadavg()[0], "cores": os.cpu_count(), "reps": args.reps, "sync": {}}
    for n in (int(r) for r in args.rows.split(",")):
        result["sync"][n] = sync_costs(n, args.reps, dist.group.WORLD.group_name)
        print(n, {k: round(v, 2) for k, v in result["sync"][n].items()}, flush=True)
    result["digest"] = digest_costs(args.reps)
    dist.destroy_process_group()
    print(write(args.out, f"failclosed_costs_{args.tag}", result, markdown, plot))


if __name__ == "__main__":
    main()
