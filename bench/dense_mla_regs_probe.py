"""What bounds the dense fp8_ds_mla Gluon kernels with register operands
(``gluon_dense.dense_mla_regs_kernel``; ``--kernel fp8``: ``gluon_dense_fp8.dense_mla_fp8_kernel``,
fp8 scores on the raw codes), timed on one GPU beside the warp-specialised kernel
(``gluon_kernels.dense_mla_kernel``).

    python bench/dense_mla_regs_probe.py [--kernel regs|fp8] [--rows 32] [--context 32768] [--splits 2048,4096]

``PROBE`` leaves a stage out of the kernel (its output is then wrong; only its time matters).
``regs``: 0 the kernel; 1 no values (neither their conversion nor their MMAs); 2 no scores (nor
their conversion or MMAs); 3 the MMAs on zero fragments (no codes read or converted for either).
``fp8``: 0 the kernel; 1 no values; 2 no scores MMAs; 3 neither (the TMA copies, the softmax and
the hand-overs between the warp groups remain). CUDA-graph replays, medians, into
``dense_mla_regs_probe_<tag>.*`` (``dense_mla_fp8_probe_<tag>.*``).
"""

from __future__ import annotations

import argparse

PROBES = {0: "the kernel", 1: "no values", 2: "no scores", 3: "MMAs on zero fragments, no codes read"}
FP8_PROBES = {0: "the kernel", 1: "no values", 2: "no scores MMAs", 3: "copies, softmax and hand-overs only"}
#: per --kernel: (launcher entry, kernel name, its probes)
KERNELS = {"regs": ("dense_mla_regs", "dense_mla_regs_kernel", PROBES),
           "fp8": ("dense_mla_fp8", "dense_mla_fp8_kernel", FP8_PROBES)}


def _time(call, reps: int) -> float:
    from pcppass.bench.timing import graph_median_us

    return graph_median_us(call, reps)


def measure(rows: int, context: int, splits: list[int], reps: int, kernel: str = "regs") -> list[dict]:
    from pcppass.bench.kernels import mla_inputs
    from pcppass.kernels.attention import launch

    entry, name, probes = KERNELS[kernel]
    run = getattr(launch, entry)
    q_lat, q_pe, step, caches = mla_inputs(rows, context)
    cache = caches[True]
    entries = []
    for split in splits:
        entries.append({"kernel": "dense_mla_kernel (warp-specialised)", "split": split, "us": _time(
            lambda: launch.dense_mla_gluon(q_lat, q_pe, cache, step, 0.07, split), reps)})
        for probe, what in probes.items():
            entries.append({"kernel": f"{name}: {what}", "split": split, "probe": probe, "us": _time(
                lambda probe=probe: run(q_lat, q_pe, cache, step, 0.07, split, PROBE=probe), reps)})
    floor = rows * context * 656 / 4.8e12 * 1e6
    return [dict(e, rows=rows, context=context, hbm_pct=round(100 * floor / e["us"], 1)) for e in entries]


def markdown(result: dict) -> str:
    titles = {"regs": "A operands in registers", "fp8": "fp8 scores on the raw codes"}
    title = titles[result["config"].get("kernel", "regs")]
    lines = [f"# Dense fp8_ds_mla MLA, {title}: stages left out",
             "", "| rows | context | keys per split | kernel | µs | % of HBM |", "|---|---|---|---|---|---|"]
    lines += [f"| {e['rows']} | {e['context']} | {e['split']} | {e['kernel']} | {e['us']:.1f} | {e['hbm_pct']} |"
              for e in result["entries"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=sorted(KERNELS), default="regs")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--splits", default="2048,4096")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="h200")
    args = parser.parse_args()
    from pcppass.bench.environment import environment
    from pcppass.bench.results import write

    entries = measure(args.rows, args.context, [int(s) for s in args.splits.split(",")], args.reps, args.kernel)
    result = {"environment": environment(), "config": vars(args), "entries": entries}
    print(write(args.out, f"dense_mla_{args.kernel}_probe_{args.tag}", result, markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
