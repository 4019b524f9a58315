"""Writing a bench's results: ``<out>/<name>.json`` (everything), ``.md`` (tables), ``.png`` (plot)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable


def fmt(x: Any, spec: str = ".3f") -> str:
    """A number in a table cell, ``–`` where it is missing."""
    return format(x, spec) if isinstance(x, (int, float)) else "–"


def write(out: str | Path, name: str, result: dict, markdown: Callable[[dict], str],
          plot: Callable[[dict, Path], bool] | None = None) -> str:
    """Write the three files; returns the markdown (plus the plot's path when one was drawn)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    text = markdown(result)
    (out / f"{name}.md").write_text(text)
    if plot is not None and plot(result, out / f"{name}.png"):
        text += f"\n(plot: {out / f'{name}.png'})\n"
    partial = out / f"{name}.partial.json"
    if partial.exists():
        partial.unlink()
    return text


def save_partial(out: str | Path, name: str, result: dict) -> None:
    """What a long run has so far (survives a timeout)."""
    path = Path(out) / f"{name}.partial.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))


def pyplot():
    """matplotlib's pyplot with a file backend, or None where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
