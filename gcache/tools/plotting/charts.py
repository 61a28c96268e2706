"""Bar charts with min..max spread and line charts, written as PNG files.

matplotlib is imported here only (the optional `bench` extra); without it the
caller gets a clear error naming the package to install.
"""

from __future__ import annotations

from collections.abc import Sequence


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend."""
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install 'gcache[bench]' (or pip install matplotlib)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bar_panel(ax, title: str, unit: str, bars: Sequence[tuple[str, list[float] | None]], limits=()) -> None:
    """One panel: a bar per (label, [min, median, max]) with the spread as an error bar;
    `limits`: (label, value) drawn as dashed horizontal lines (the machine's ceilings)."""
    shown = [(label, spread) for label, spread in bars if spread]
    xs = range(len(shown))
    ours = ["#2b6cb0", "#3182ce", "#63b3ed", "#90cdf4"]  # gcache's bars in blues, peers in other hues
    theirs = ["#dd6b20", "#805ad5", "#38a169", "#718096"]
    colors: list[str] = []
    for label, _ in shown:
        pick = ours if label.startswith("gcache") else theirs
        colors.append(pick[sum(1 for c in colors if c in pick) % len(pick)])
    for x, (label, (lo, med, hi)) in zip(xs, shown):
        ax.bar(x, med, color=colors[x], width=0.7)
        ax.errorbar(x, med, yerr=[[med - lo], [hi - med]], color="black", capsize=4, linewidth=1)
        ax.annotate(f"{med:.3g}", (x, hi), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
    for k, (label, value) in enumerate(limits):
        if value:
            ax.axhline(value, linestyle="--", linewidth=1, color=["#e53e3e", "#d69e2e", "#319795"][k % 3])
            ax.annotate(f"{label} {value:.3g}", (len(shown) - 0.5, value), fontsize=7, ha="right", va="bottom")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([label for label, _ in shown], rotation=20, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(unit)
    ax.grid(axis="y", alpha=0.3)


def line_panel(ax, title: str, xlabel: str, ylabel: str, series: dict[str, tuple[list, list]]) -> None:
    """One panel of curves: {name: (xs, ys)}."""
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", markersize=3, label=name, linestyle="--" if name in ("clairvoyant", "lru") else "-")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
