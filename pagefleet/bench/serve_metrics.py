"""What one request's timings add up to, as ``vllm bench serve`` computes it.

Per request (``RequestResult``), times taken at the client with ``time.perf_counter``:
TTFT (sent -> first chunk with a token), ITL (between consecutive token chunks; a chunk
carrying several tokens is one gap), E2EL (sent -> last token chunk), TPOT
``(E2EL - TTFT) / (output_tokens - 1)`` for requests of more than one token.

Over the run (``calculate_metrics``): throughput per second of the whole run's duration
(requests, output tokens, input + output tokens), goodput (requests/s meeting every
``--goodput`` limit: TTFT, TPOT (0 for a one-token request) and E2EL at most the given
milliseconds), and for TTFT, TPOT, ITL and E2EL the mean, median, standard deviation and
``--metric-percentiles`` (numpy's linear interpolation). An empty list counts as 0, as
vLLM's does. Only successful requests count, failed ones are counted apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
TITLES = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
          "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it (seconds; ``start_time`` on ``perf_counter``'s clock)."""

    success: bool = False
    start_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    prompt_len: int = 0  # as the server counted it when it says, else the dataset's
    output_tokens: int = 0  # as the server counted it when it says, else the tokens streamed
    expected_output_len: int = 0
    generated_text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float:
        """0 for a request of at most one token (as goodput counts it)."""
        n = self.output_tokens
        return (self.latency - self.ttft) / (n - 1) if n > 1 else 0.0

    def token_times(self) -> list[float]:
        """When each token chunk arrived (``perf_counter`` seconds)."""
        t = self.start_time + self.ttft
        out = [t]
        for gap in self.itl:
            t += gap
            out.append(t)
        return out


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> ``{"ttft": 200.0, "tpot": 50.0}`` (milliseconds)."""
    out: dict[str, float] = {}
    for pair in pairs or ():
        name, sep, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = float("nan")
        if not sep or name not in GOODPUT_METRICS or not ms >= 0:
            raise ValueError(f"--goodput {pair!r}: expected KEY:MS with KEY one of "
                             f"{', '.join(GOODPUT_METRICS)} and MS >= 0")
        out[name] = ms
    return out


def parse_list(text: str, allowed: tuple[str, ...] | None = None) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if allowed is not None and x not in allowed]
    if bad:
        raise ValueError(f"unknown metric {bad[0]!r}; choose from {', '.join(allowed or ())}")
    return items


def is_good(r: RequestResult, goodput_ms: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
    return all(values[k] <= ms / 1000 for k, ms in goodput_ms.items())


def _stats(values: list[float], percentiles: list[float]) -> dict[str, float]:
    v = np.asarray(values or [0.0], dtype=float) * 1000
    out = {"mean": float(np.mean(v)), "median": float(np.median(v)), "std": float(np.std(v))}
    for p in percentiles:
        out[f"p{_pct_word(p)}"] = float(np.percentile(v, p))
    return out


def _pct_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def calculate_metrics(results: list[RequestResult], duration_s: float, *,
                      percentile_metrics: Sequence[str] = METRICS, metric_percentiles: Sequence[float] = (99.0,),
                      goodput_ms: dict[str, float] | None = None) -> dict:
    """The run's figures under vLLM's JSON names (``mean_ttft_ms``, ``p99_itl_ms``, ...)."""
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    out: dict = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": (sum(is_good(r, goodput_ms) for r in ok) / duration_s) if goodput_ms else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    out.update(peak_output_throughput(ok))
    for name in percentile_metrics:
        for stat, value in _stats(series[name], list(metric_percentiles)).items():
            out[f"{stat}_{name}_ms"] = value
    return out


def peak_output_throughput(ok: list[RequestResult]) -> dict:
    """vLLM's peak figures: the most token chunks in one second (buckets from the first send)
    and the most requests in flight at once."""
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    start = min(r.start_time for r in ok)
    counts: dict[int, int] = {}
    for r in ok:
        for t in r.token_times():
            counts[int(t - start)] = counts.get(int(t - start), 0) + 1
    events = sorted([(r.start_time, 1) for r in ok] + [(r.start_time + r.latency, -1) for r in ok])
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return {"max_output_tokens_per_s": float(max(counts.values())), "max_concurrent_requests": peak}


def length_checks(results: list[RequestResult], prompt_lens: list[int] | None) -> dict:
    """How many successful requests came back with another output length than asked (they
    should not when EOS is ignored), or were counted by the server with another prompt length."""
    ok = [(i, r) for i, r in enumerate(results) if r.success]
    out = {"num_output_len_mismatch": sum(r.output_tokens != r.expected_output_len for _, r in ok)}
    if prompt_lens is not None:
        out["num_prompt_len_mismatch"] = sum(r.prompt_len != prompt_lens[i] for i, r in ok)
    return out


def format_report(name: str, m: dict, *, max_concurrency: int | None, request_rate: float,
                  percentile_metrics: Sequence[str]) -> str:
    """The result block in ``vllm bench serve``'s layout."""
    lines = [f"{' Serving Benchmark Result: ' + name + ' ':=^60}"]

    def row(label: str, value, fmt: str = "") -> None:
        lines.append(f"{label:<44} {value:{fmt}}")

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if request_rate != float("inf"):
        row("Request rate configured (RPS):", request_rate, ".2f")
    row("Benchmark duration (s):", m["duration"], ".2f")
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"], ".2f")
    if m["request_goodput"] is not None:
        row("Request goodput (req/s):", m["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", m["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", m["max_concurrent_requests"])
    row("Total token throughput (tok/s):", m["total_token_throughput"], ".2f")
    for name_ in percentile_metrics:
        short, title = TITLES[name_]
        lines.append(f"{' ' + title + ' ':-^60}")
        for key in [k for k in m if k.endswith(f"_{name_}_ms") and not k.startswith("std_")]:
            stat = key.split("_")[0]
            label = {"mean": "Mean", "median": "Median"}.get(stat, stat.upper())
            row(f"{label} {short} (ms):", m[key], ".2f")
    lines.append("=" * 60)
    return "\n".join(lines)
