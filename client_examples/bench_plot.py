"""Latency-vs-load figure for the benchmark (matplotlib, file output only)."""
from __future__ import annotations

from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # no display on servers/CI
import matplotlib.pyplot as plt  # noqa: E402

from client_examples.bench_stats import LevelResult  # noqa: E402

METRICS = (("ttft_ms", "TTFT (ms)"), ("itl_ms", "inter-token latency (ms)"), ("e2e_ms", "end-to-end latency (ms)"))
MODE_TITLES = {"concurrency": "closed loop: concurrency", "rate": "open loop: Poisson rate (req/s)"}


def plot_latency_vs_load(levels: Sequence[LevelResult], path: str, title: str = "") -> None:
    modes = [m for m in MODE_TITLES if any(lv.mode == m for lv in levels)]
    if not modes:
        return
    fig, axes = plt.subplots(len(METRICS), len(modes), figsize=(5.5 * len(modes), 9), squeeze=False)
    for col, mode in enumerate(modes):
        runs = sorted((lv for lv in levels if lv.mode == mode), key=lambda lv: lv.load)
        # Categorical x positions: load levels are few and rate may be inf.
        xs = list(range(len(runs)))
        labels = [lv.label.split(" ", 1)[1] for lv in runs]
        for row, (attr, ylabel) in enumerate(METRICS):
            ax = axes[row][col]
            for stat, style in (("p50", "o-"), ("p99", "s--")):
                ax.plot(xs, [getattr(getattr(lv, attr), stat) for lv in runs], style, label=stat)
            ax.set_xticks(xs, labels)
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
            if row == 0:
                ax.set_title(MODE_TITLES[mode])
            if row == len(METRICS) - 1:
                ax.set_xlabel(MODE_TITLES[mode].split(": ")[1])
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
