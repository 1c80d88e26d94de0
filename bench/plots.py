"""The benchmarks' plots (matplotlib, no display needed). A run writes them only when given ``--plot DIR``
(``make bench`` and docs/benchmarks.md pass ``--plot docs/img``, where the docs' figures live), so running a
benchmark leaves the work tree as it was."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_plot_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plot",
        metavar="DIR",
        type=Path,
        default=None,
        help="write the plot(s) as PNG files into DIR (the docs' figures: docs/img); default: no plot",
    )


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(figure: Any, folder: Path, name: str) -> Path:
    """Write ``figure`` as FOLDER/NAME.png (FOLDER made if need be), close it, and say where."""
    figure.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    figure.savefig(path, dpi=100)
    pyplot().close(figure)
    print(f"plot: {path}")
    return path


def bar_chart(
    folder: Path, name: str, title: str, ylabel: str, groups: dict[str, dict[str, float]], log: bool = False
) -> Path:
    """One cluster of bars per group (x axis), one bar per series inside it; saved as FOLDER/NAME.png."""
    labels = list(groups)
    series = list(dict.fromkeys(key for values in groups.values() for key in values))
    width = 0.8 / len(series)
    figure, axis = pyplot().subplots(figsize=(max(5.0, 1.6 * len(labels) + 2), 3.6))
    for index, key in enumerate(series):
        offsets = [i + (index - (len(series) - 1) / 2) * width for i in range(len(labels))]
        values = [groups[label].get(key, 0.0) for label in labels]
        bars = axis.bar(offsets, values, width, label=key)
        axis.bar_label(bars, fmt="%.3g", fontsize=7)
    axis.set_xticks(range(len(labels)), labels)
    axis.set_ylabel(ylabel)
    if log:
        axis.set_yscale("log")
    if len(series) > 1:
        axis.legend(fontsize=8)
    axis.set_title(title, fontsize=10)
    return save(figure, folder, name)
