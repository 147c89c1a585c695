"""The PNG of ``pagefleet bench serve``: latency CDFs and output tokens per second, one line per run."""

from __future__ import annotations

from pathlib import Path

from .serve_metrics import RequestResult


def _cdf(ax, values: list[float], label: str) -> None:
    s = sorted(values)
    ax.step(s, [(i + 1) / len(s) for i in range(len(s))], where="post", label=label)


def _rate(results: list[RequestResult], width: float) -> list[float]:
    """Output tokens per second in buckets of ``width`` seconds from the first request."""
    ok = [r for r in results if r.success]
    if not ok:
        return []
    start = min(r.start_time for r in ok)
    counts: list[float] = []
    for r in ok:
        per_chunk = r.output_tokens / (len(r.itl) + 1)  # a chunk's tokens, spread evenly
        for t in r.token_times():
            b = int((t - start) / width)
            counts.extend([0.0] * (b + 1 - len(counts)))
            counts[b] += per_chunk / width
    return counts


def _bucket_width(runs: dict[str, list[RequestResult]]) -> float:
    """The widest of 0.1 s ... 10 s that still gives about 30 buckets over the longest run."""
    longest = max((r.start_time + r.latency for rs in runs.values() for r in rs if r.success), default=0.0) - min(
        (r.start_time for rs in runs.values() for r in rs if r.success), default=0.0)
    return next((w for w in (10.0, 5.0, 2.0, 1.0, 0.5, 0.25) if longest / w >= 30), 0.1)


def plot(runs: dict[str, list[RequestResult]], metrics: dict[str, dict], path: Path, title: str = "") -> bool:
    """Write the figure to ``path``; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    width = _bucket_width(runs)
    (ax_ttft, ax_itl), (ax_e2el, ax_tput) = axes
    for name, results in runs.items():
        ok = [r for r in results if r.success]
        if not ok:
            continue
        _cdf(ax_ttft, [r.ttft * 1e3 for r in ok], name)
        _cdf(ax_itl, [gap * 1e3 for r in ok for gap in r.itl] or [0.0], name)
        _cdf(ax_e2el, [r.latency * 1e3 for r in ok], name)
        rate = _rate(results, width)
        ax_tput.stairs(rate, [i * width for i in range(len(rate) + 1)],
                       label=f"{name} ({metrics[name]['output_throughput']:.0f} tok/s over the run)")
    for ax, xlabel in ((ax_ttft, "TTFT (ms)"), (ax_itl, "ITL (ms)"), (ax_e2el, "E2EL (ms)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of requests" if ax is not ax_itl else "fraction of gaps")
        ax.grid(alpha=0.3)
        ax.legend()
    ax_tput.set_xlabel("seconds since the first request")
    ax_tput.set_ylabel(f"output tokens per second ({width:g} s buckets)")
    ax_tput.grid(alpha=0.3)
    ax_tput.legend()
    fig.suptitle(title or "pagefleet bench serve")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
