"""Shared-memory wavefronts per instruction kind from Nsight Compute's source page, to see where a
kernel's shared-memory traffic goes (and how much of it is bank conflicts).

    ncu --set full --import-source yes -k regex:dense_mla_kernel -o prof python bench/profile_attention.py ...
    ncu -i prof.ncu-rep --page source --csv --print-source sass > prof.csv
    python bench/ncu_wavefronts.py prof.csv [more.csv ...] --tiles 16384

Per CSV (one kernel each, or the first of several): every opcode's ``L1 Wavefronts Shared``
against its ``Ideal`` (the excess is bank conflicts or misaligned lines) and the instructions
executed, as a markdown table; ``--tiles`` adds wavefronts per tile.
"""

from __future__ import annotations

import argparse
import collections
import csv
from pathlib import Path


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def wavefronts(path: Path) -> dict[str, tuple[float, float, float]]:
    """opcode -> (wavefronts, ideal wavefronts, instructions executed) of the file's first kernel."""
    rows = list(csv.reader(path.open()))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header, totals = rows[start], collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    col = {name: i for i, name in enumerate(header)}
    for row in rows[start + 1:]:
        if len(row) < len(header) or row[0] == "Kernel Name":
            break
        words = row[col["Source"]].split()
        if not words:
            continue
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        t = totals[op]
        t[0] += _number(row[col["L1 Wavefronts Shared"]])
        t[1] += _number(row[col["L1 Wavefronts Shared Ideal"]])
        t[2] += _number(row[col["Instructions Executed"]])
    return {op: tuple(v) for op, v in totals.items() if v[0]}


def table(path: Path, tiles: int) -> str:
    counts = wavefronts(path)
    total, ideal = sum(v[0] for v in counts.values()), sum(v[1] for v in counts.values())
    per = " | per tile" if tiles else ""
    lines = [f"### {path.name}: {total / 1e6:.1f} M wavefronts (ideal {ideal / 1e6:.1f} M)", "",
             f"| opcode | wavefronts (M) | ideal (M) | instructions (M){per} |",
             "|---|---|---|---|" + ("---|" if tiles else "")]
    for op, (w, i, n) in sorted(counts.items(), key=lambda kv: -kv[1][0]):
        extra = f" | {w / tiles:.0f}" if tiles else ""
        lines.append(f"| {op} | {w / 1e6:.2f} | {i / 1e6:.2f} | {n / 1e6:.2f}{extra} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+", type=Path)
    parser.add_argument("--tiles", type=int, default=0, help="key tiles the launch processed (0: no column)")
    args = parser.parse_args()
    print("\n".join(table(p, args.tiles) for p in args.csv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
