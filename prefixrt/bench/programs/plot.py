"""LM-program results as one picture (matplotlib, Agg backend): the shapes of the SGLang paper's figures 5 and 8.

Top: throughput (programs/s) of every ablation per workload, normalised to the workload's no-cache run (bars;
1.0 = no cache). Bottom: the full run's cache hit rate beside the ideal hit rate of its own request trace, and the
block cache's hit rate, per workload.
"""

from __future__ import annotations

from prefixrt.bench.programs.runner import ABLATIONS, ProgramResult

__all__ = ["plot_programs"]


def plot_programs(results: list[ProgramResult], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in results))
    ablations = [a for a in ABLATIONS if any(r.ablation == a for r in results)]
    by = {(r.workload, r.ablation): r for r in results}
    fig, (ax_tp, ax_hit) = plt.subplots(2, 1, figsize=(max(10, 1.3 * len(workloads) + 4), 9), constrained_layout=True)
    width = 0.8 / max(1, len(ablations))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, a in enumerate(ablations):
        xs, ys = [], []
        for i, w in enumerate(workloads):
            r, base = by.get((w, a)), by.get((w, "no-cache"))
            if r is not None and base is not None:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(r.programs_per_s / base.programs_per_s)
        ax_tp.bar(xs, ys, width, label=ABLATIONS[a].label, color=colors[j % len(colors)])
    ax_tp.axhline(1.0, color="black", linewidth=0.8)
    ax_tp.set_xticks(range(len(workloads)), workloads, rotation=20, fontsize=8)
    ax_tp.set_ylabel("throughput / no cache")
    ax_tp.set_title("programs/s normalised to the no-cache run")
    ax_tp.legend(fontsize=7, ncol=3)

    series = [("full", "hit rate (full)", "hit_rate"), ("full", "ideal hit rate", "ideal_hit_rate"),
              ("block-cache", "hit rate (block cache)", "hit_rate")]
    width = 0.8 / len(series)
    for j, (a, label, attr) in enumerate(series):
        xs, ys = [], []
        for i, w in enumerate(workloads):
            r = by.get((w, a))
            if r is not None:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(100 * getattr(r, attr))
        if xs:
            ax_hit.bar(xs, ys, width, label=label, color=colors[j % len(colors)])
    ax_hit.set_xticks(range(len(workloads)), workloads, rotation=20, fontsize=8)
    ax_hit.set_ylabel("% of prompt tokens")
    ax_hit.set_ylim(0, 100)
    ax_hit.set_title("cache hit rate vs the ideal hit rate of the same request trace")
    ax_hit.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)
