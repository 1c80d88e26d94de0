"""Bar charts for the benchmarks' PNGs in docs/img (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

IMG = Path(__file__).resolve().parent.parent / "docs" / "img"


def bar_chart(name: str, title: str, ylabel: str, groups: dict[str, dict[str, float]], log: bool = False) -> Path:
    """One cluster of bars per group (x axis), one bar per series inside it; saved as docs/img/NAME.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(groups)
    series = list(dict.fromkeys(key for values in groups.values() for key in values))
    width = 0.8 / len(series)
    figure, axis = plt.subplots(figsize=(max(5.0, 1.6 * len(labels) + 2), 3.6))
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
    figure.tight_layout()
    IMG.mkdir(parents=True, exist_ok=True)
    path = IMG / f"{name}.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
