"""`prefixrt bench --plot out.png`: a run's results as one picture (matplotlib, Agg backend: no display).

Left: throughput per run (input and output tokens/s; req/s in the labels). Right: TTFT distributions as
empirical CDFs, split per run into cold requests (no prompt token reused from the cache) and hot ones (some
reused): for the shared-prefix workloads the hot curve sits left of the cold one when the radix cache works,
and a run without the cache has only cold requests. Runs without per-request records (the transformers
baseline) appear in the throughput panel only. matplotlib comes with the bench extra.
"""

from __future__ import annotations

from prefixrt.bench.runner import RequestRecord, Result

__all__ = ["split_cold_hot", "plot_results"]


def split_cold_hot(records: list[RequestRecord]) -> tuple[list[float], list[float]]:
    """(TTFTs of cold requests, TTFTs of hot requests) in seconds, sorted. Hot: cached_tokens > 0."""
    cold = sorted(r.ttft_s for r in records if r.cached_tokens == 0)
    hot = sorted(r.ttft_s for r in records if r.cached_tokens > 0)
    return cold, hot


def plot_results(results: list[Result], path: str, title: str = "") -> None:
    """Write the picture of `results` to `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_ttft) = plt.subplots(1, 2, figsize=(13, 5.2), constrained_layout=True)
    labels = [f"{r.label}\n{r.request_throughput:.2f} req/s" for r in results]
    xs = range(len(results))
    w = 0.38
    ax_tp.bar([x - w / 2 for x in xs], [r.input_throughput for r in results], w, label="input tok/s",
              color="#2c5aa0")
    ax_tp.bar([x + w / 2 for x in xs], [r.output_throughput for r in results], w, label="output tok/s",
              color="#f0ad4e")
    ax_tp.set_xticks(list(xs), labels, fontsize=8)
    ax_tp.set_ylabel("tokens / s")
    ax_tp.set_title("throughput")
    ax_tp.legend()

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    plotted = 0
    for i, r in enumerate(results):
        cold, hot = split_cold_hot(r.records)
        c = colors[i % len(colors)]
        for xs_s, style, kind in ((cold, "--", "cold"), (hot, "-", "hot")):
            if not xs_s:
                continue
            ms = [1000 * x for x in xs_s]
            ys = [(k + 1) / len(ms) for k in range(len(ms))]
            ax_ttft.step(ms, ys, where="post", linestyle=style, color=c,
                         label=f"{r.label}: {kind} (n={len(ms)}, p50 {ms[len(ms) // 2]:.1f} ms)")
            plotted += 1
    ax_ttft.set_xlabel("time to first token (ms)")
    ax_ttft.set_ylabel("fraction of requests")
    ax_ttft.set_ylim(0, 1.02)
    ax_ttft.set_title("TTFT: cold (no cached prefix, dashed) vs hot (cached prefix, solid)")
    if plotted:
        ax_ttft.legend(fontsize=7, loc="lower right")
    else:
        ax_ttft.text(0.5, 0.5, "no per-request records", ha="center", va="center", transform=ax_ttft.transAxes)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)
