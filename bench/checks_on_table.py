"""Print the summary table (markdown) of one or more ``pcppass bench`` JSON results.

    python bench/checks_on_table.py bench/results/bench_h200x2_checks_on_l2.json [more.json ...]
"""

import json
import sys
from pathlib import Path

from pcppass.bench.step_report import summary_table

if __name__ == "__main__":
    found = [Path(p) for p in sys.argv[1:] if Path(p).exists()]
    print(summary_table([json.loads(p.read_text()) for p in found]) if found else "no results")
