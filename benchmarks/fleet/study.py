"""``pagefleet bench study``: goodput against request rate, by queue policy and placement.

A fleet of ``--workers`` simulated workers (``--profile``; default Llama-3-8B on H100) run
with the scheduler's own ledger on one virtual clock (``sim.FleetSim``), under
traces generated from ``--seed``:

* ``sharegpt``: ShareGPT-like lengths. No dataset can be downloaded here, so lengths are
  drawn from log-normals with the means published for ShareGPT (161 prompt and 338 output
  tokens: Kwon et al., "Efficient Memory Management for Large Language Model Serving with
  PagedAttention", SOSP 2023, fig. 11) and pruned as ``vllm bench serve`` prunes ShareGPT
  (4..1024 prompt tokens, at most 2048 in all); prompts are random bytes (nothing shared).
* ``shared-prefix``: SGLang's generated-shared-prefix shape through ``datasets.py``'s
  generator: ``--gsp-num-groups`` system prompts of ``--gsp-system-prompt-len`` tokens, each
  followed by a question of ``--gsp-question-len``; ``--gsp-output-len`` out (``--sp-*`` still
  accepted).

Arrivals are Poisson, or gamma with shape ``--burstiness`` (``loadgen.arrival_times``).
For the policy suite, ``--priority-fraction`` of the requests have priority 1 and every
request has a deadline: its arrival plus the TTFT SLO plus max_tokens TPOT SLOs (the last
moment its last token can still arrive within both SLOs).

Goodput is the rate of requests that finished within both SLOs (``--slo-ttft``,
``--slo-tpot``), as ``vllm bench serve --goodput`` counts it; the knee of a curve is the
highest rate at which at least ``--knee-attainment`` of the requests met them
(interpolated between measured rates). The ideal bound is one engine the size of the
fleet (``FleetConfig.ideal``).

Suites (``--suites``): ``policy`` (fcfs, priority, deadline; prefix placement; sharegpt),
``placement`` (prefix, least-loaded, round-robin; fcfs; shared-prefix), ``bursty``
(fcfs + prefix vs round-robin; sharegpt with ``--burstiness``). Rates are multiples
(``--rate-factors``) of the suite's base rate (``--sharegpt-rate``, ``--shared-prefix-rate``).
``--curves`` runs only the named curves of those suites (each point is a simulated run, so a
point re-run alone gives the figures it gives among the others). The JSON is written after every
point: a study stopped early keeps what it measured.

KV that moves (``scheduler/moves.py``; transfers over the profile's ``kv_transfer_bytes_per_s``):

* ``disagg-prefill`` and ``disagg-decode``: colocated workers against disaggregated fleets
  (a quarter and half of the workers of role prefill, the rest decode; conditional: prompts
  of at most ``--short-prompt`` tokens prefill on a decode worker) on a prefill-heavy trace
  (prompts log-normal around 3,000 tokens, 1,024..6,144; 32..256 out, mean 96) and a
  decode-heavy one (prompts around 200 tokens; 128..2,048 out, mean 700);
* ``migrate``: load-balance migration (``--migrate-above``, ``--migrate-below``) against
  none under a skewed load: 64 system prompts of 1,024 tokens drawn Zipf(1.1) (prefix
  placement draws each hot group to the workers caching it), a 20 % minority of answers of
  2,000..4,000 tokens among answers of 32..128: the memory a worker's requests will take is
  not known when they are placed.

Their base rates are per worker (``--prefill-heavy-rate``, ``--decode-heavy-rate``,
``--skewed-rate``) times ``--workers``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagefleet.bench.datasets import add_shared_prefix_args
from pagefleet.bench.loadgen import arrival_times
from pagefleet.scheduler.moves import MoveConfig

from ..results import header
from .sim import FleetConfig, FleetSim, Outcome, TraceRequest

SHAREGPT_MEAN_PROMPT, SHAREGPT_MEAN_OUTPUT = 161, 338
BOS = 256
TPOT_SLOS_MS = (15, 20, 25, 35, 50, 100)


# -- traces --------------------------------------------------------------------------------------
def sharegpt_like(n: int, seed: int) -> list[tuple[list[int], int]]:
    """``n`` (prompt ids, output length) pairs with ShareGPT-like lengths (see the module docstring)."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        p = int(rng.lognormal(math.log(SHAREGPT_MEAN_PROMPT) - 0.5, 1.0))
        o = int(rng.lognormal(math.log(SHAREGPT_MEAN_OUTPUT) - 0.405, 0.9))
        if 4 <= p <= 1024 and o >= 4 and p + o <= 2048:
            out.append(([BOS, *rng.integers(32, 127, p - 1).tolist()], o))
    return out


def shared_prefix(n: int, seed: int, groups: int, system_len: int, question_len: int,
                  output_len: int) -> list[tuple[list[int], int]]:
    """``n`` prompts from ``datasets.shared_prefix_requests`` (as many groups, cycled), byte tokens."""
    from pagefleet.bench.datasets import shared_prefix_requests
    from pagefleet.bench.tokenizer import ByteTokenizer

    reqs = shared_prefix_requests(ByteTokenizer(), groups, math.ceil(n / groups), system_len, question_len,
                                  output_len, seed)[:n]
    return [([BOS, *r.prompt.encode()], r.expected_output_len) for r in reqs]


def lognormal_lengths(n: int, seed: int, prompt: tuple[float, int, int], output: tuple[float, int, int],
                      max_len: int = 8192) -> list[tuple[list[int], int]]:
    """``n`` (prompt ids, output length) pairs, each length log-normal (sigma 0.5) around its
    median and clipped to its range: ``(median, lo, hi)``; random byte prompts."""
    rng = np.random.default_rng(seed)
    out = []

    def draw(median: float, lo: int, hi: int) -> int:
        return int(min(hi, max(lo, rng.lognormal(math.log(median), 0.5))))

    while len(out) < n:
        p, o = draw(*prompt), draw(*output)
        if p + o <= max_len:
            out.append(([BOS, *rng.integers(32, 127, p - 1).tolist()], o))
    return out


def skewed(n: int, seed: int, groups: int = 64, system_len: int = 1024) -> list[tuple[list[int], int]]:
    """Hot and cold system prompts (Zipf 1.1 over ``groups``) and a minority of long answers
    (see the module docstring): the load a placement cannot foresee."""
    rng = np.random.default_rng(seed)
    systems = [[BOS, *rng.integers(32, 127, system_len - 1).tolist()] for _ in range(groups)]
    weights = 1.0 / np.arange(1, groups + 1) ** 1.1
    picks = rng.choice(groups, size=n, p=weights / weights.sum())
    out = []
    for g in picks:
        question = rng.integers(32, 127, 64).tolist()
        o = int(rng.integers(2000, 4001)) if rng.random() < 0.2 else int(rng.integers(32, 129))
        out.append(([*systems[g], *question], o))
    return out


@dataclass(frozen=True)
class Curve:
    name: str  # the legend
    trace: str  # sharegpt | shared-prefix
    policy: str = "fcfs"
    placement: str = "prefix"
    burstiness: float = 1.0
    priorities: bool = False  # priority classes and deadlines (the policy suite)
    ideal: bool = False
    prefill_fraction: float = 0.0  # of the workers, role prefill (the others decode); 0: colocated
    migrate: bool = False  # load-balance migration


SUITES = {
    "policy": [Curve("fcfs", "sharegpt", priorities=True), Curve("priority", "sharegpt", "priority", priorities=True),
               Curve("deadline", "sharegpt", "deadline", priorities=True),
               Curve("ideal (one pool)", "sharegpt", priorities=True, ideal=True)],
    "placement": [Curve("prefix", "shared-prefix"), Curve("least-loaded", "shared-prefix", placement="least-loaded"),
                  Curve("round-robin", "shared-prefix", placement="round-robin"),
                  Curve("ideal (one pool)", "shared-prefix", ideal=True)],
    "bursty": [Curve("prefix", "sharegpt", burstiness=0.25),
               Curve("round-robin", "sharegpt", placement="round-robin", burstiness=0.25),
               Curve("ideal (one pool)", "sharegpt", burstiness=0.25, ideal=True)],
    "disagg-prefill": [Curve("colocated", "prefill-heavy"),
                       Curve("disaggregated 1P:3D", "prefill-heavy", prefill_fraction=0.25),
                       Curve("disaggregated 1P:1D", "prefill-heavy", prefill_fraction=0.5),
                       Curve("disaggregated 3P:1D", "prefill-heavy", prefill_fraction=0.75)],
    "disagg-decode": [Curve("colocated", "decode-heavy"),
                      Curve("disaggregated 1P:3D", "decode-heavy", prefill_fraction=0.25),
                      Curve("disaggregated 1P:1D", "decode-heavy", prefill_fraction=0.5)],
    "migrate": [Curve("no migration", "skewed"), Curve("load-balance migration", "skewed", migrate=True)],
}


def make_trace(curve: Curve, rate: float, args) -> list[TraceRequest]:
    n = max(1, int(rate * args.duration))
    seed = args.seed
    if curve.trace == "sharegpt":
        pairs = sharegpt_like(n, seed)
    elif curve.trace == "prefill-heavy":
        pairs = lognormal_lengths(n, seed, (3000, 1024, 6144), (96, 32, 256))
    elif curve.trace == "decode-heavy":
        pairs = lognormal_lengths(n, seed, (200, 32, 1024), (700, 128, 2048))
    elif curve.trace == "skewed":
        pairs = skewed(n, seed)
    else:
        pairs = shared_prefix(n, seed, args.gsp_num_groups, args.gsp_system_prompt_len, args.gsp_question_len,
                              args.gsp_output_len)
    arrivals = arrival_times(n, rate, curve.burstiness, seed)
    rng = np.random.default_rng(seed + 1)
    high = rng.random(n) < args.priority_fraction
    out = []
    for i, ((prompt, max_tokens), at) in enumerate(zip(pairs, arrivals, strict=True)):
        priority, deadline = 0, None
        if curve.priorities:
            priority = int(high[i])
            deadline = at + args.slo_ttft + max_tokens * args.slo_tpot
        out.append(TraceRequest(f"r{i}", prompt, max_tokens, at, priority, deadline))
    return out


# -- one point -----------------------------------------------------------------------------------
def measure(outcomes: list[Outcome], rate: float, duration: float, args, end_s: float) -> dict:
    """Goodput and latencies of one run that stopped at ``end_s``.

    A request still running then (a long answer that arrived late) counts as within its SLOs
    if it is on track: its first token came in time and its tokens so far came at least as
    fast as the TPOT SLO (the load only falls after the arrivals end). One that never got a
    token, or was cut off at its deadline, is a miss.
    """
    n = len(outcomes)

    def good(o: Outcome, slo_tpot: float = args.slo_tpot) -> bool:
        if o.finish_reason in ("length", "stop"):
            return o.ttft_s <= args.slo_ttft and o.tpot_s is not None and o.tpot_s <= slo_tpot
        if o.finish_reason or o.first_token_s is None or o.ttft_s > args.slo_ttft:
            return False
        return o.num_tokens < 2 or (end_s - o.first_token_s) / (o.num_tokens - 1) <= slo_tpot

    done = [o for o in outcomes if o.finish_reason in ("length", "stop")]
    # TTFT over every request, finished or not (one still waiting for its first token counts
    # as infinite): over finished ones only, a run whose late arrivals cannot finish in time
    # would show the early, fast ones.
    ttft = np.array([o.ttft_s if o.first_token_s is not None else np.inf for o in outcomes]) if outcomes \
        else np.array([np.nan])
    tpot = np.array([o.tpot_s for o in done if o.tpot_s is not None]) if done else np.array([np.nan])
    hi = [o for o in outcomes if o.priority > 0]
    num_good = sum(map(good, outcomes))
    return {
        "rate": rate,
        "num_requests": n,
        "goodput": num_good / duration,
        "attainment": num_good / n if n else 0.0,
        # The same TTFT SLO with other TPOT SLOs (ms): a tighter one is where disaggregation pays.
        "attainment_by_tpot_ms": {ms: sum(good(o, ms / 1e3) for o in outcomes) / n if n else 0.0
                                  for ms in TPOT_SLOS_MS},
        "attainment_high_priority": sum(map(good, hi)) / len(hi) if hi else None,
        "finished": len(done) / n if n else 0.0,
        "running_at_end": sum(1 for o in outcomes if not o.finish_reason) / n if n else 0.0,
        "cut_at_deadline": sum(1 for o in outcomes if o.finish_reason == "deadline") / n if n else 0.0,
        "ttft_p50_s": float(np.nanpercentile(ttft, 50, method="higher")),
        "ttft_p99_s": float(np.nanpercentile(ttft, 99, method="higher")),  # inf: over 1 % got no token
        "tpot_p50_ms": float(np.nanpercentile(tpot, 50) * 1e3), "tpot_p99_ms": float(np.nanpercentile(tpot, 99) * 1e3),
        "output_tokens_per_s": sum(o.num_tokens for o in done) / duration,
    }


def run_point(curve: Curve, rate: float, args, profile) -> dict:
    trace = make_trace(curve, rate, args)
    moves = MoveConfig(short_prompt_tokens=args.short_prompt,
                       migrate_above=args.migrate_above if curve.migrate else None, migrate_below=args.migrate_below)
    cfg = FleetConfig(num_workers=args.workers, profile=profile, policy=curve.policy, placement=curve.placement,
                      ideal=curve.ideal, num_prefill_workers=round(curve.prefill_fraction * args.workers), moves=moves,
                      num_blocks=args.num_blocks)
    t0 = time.process_time()
    sim = FleetSim(cfg)
    outcomes = sim.run(trace, until_s=args.duration + args.drain)
    point = measure(list(outcomes.values()), rate, args.duration, args, sim.now)
    point["num_preemptions"] = sim.ledger.num_preemptions
    point["num_worker_preemptions"] = sum(w.engine.stats().num_preemptions_total for w in sim.workers)
    point["moves"] = move_figures(sim)
    point["cpu_s"] = time.process_time() - t0
    return point


def move_figures(sim: FleetSim) -> dict:
    """What moving KV did in one run: transfers by reason, handed over, expired, bytes, times."""
    m = sim.moves

    def pct(xs: list[float], q: float) -> float | None:
        return float(np.percentile(xs, q)) * 1e3 if xs else None

    return {"started": dict(m.started), "done": m.num_done, "expired": m.num_expired, "refused": m.num_refused,
            "gb_moved": m.bytes_moved / 1e9, "transfer_p50_ms": pct(m.transfer_s, 50),
            "transfer_p99_ms": pct(m.transfer_s, 99), "downtime_p50_ms": pct(m.downtime_s, 50),
            "downtime_p99_ms": pct(m.downtime_s, 99)}


def knee(points: list[dict], target: float) -> float | None:
    """The highest rate at which attainment is still >= ``target``, interpolated linearly
    between the last rate above it and the first below (None if even the lowest misses)."""
    pts = sorted(points, key=lambda p: p["rate"])
    if not pts or pts[0]["attainment"] < target:
        return None
    for a, b in zip(pts, pts[1:], strict=False):
        if b["attainment"] < target <= a["attainment"]:
            return a["rate"] + (b["rate"] - a["rate"]) * (a["attainment"] - target) / (a["attainment"] - b["attainment"])
    return pts[-1]["rate"]  # never fell below: the knee is past the last rate measured


# -- the command ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagefleet bench study", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--profile", default="llama-3-8b-h100", help="the workers' sim profile")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker (default: the profile's pool)")
    p.add_argument("--suites", default="policy,placement,bursty", help="comma-separated: " + ", ".join(SUITES))
    p.add_argument("--curves", default="",
                   help="comma-separated curve names to run (e.g. 'prefix,ideal (one pool)'); default: every "
                        "curve of each suite")
    p.add_argument("--duration", type=float, default=8.0, help="seconds of arrivals per point (simulated)")
    p.add_argument("--drain", type=float, default=8.0, help="seconds after the last arrival before a run stops")
    p.add_argument("--rate-factors", default="0.6,0.85,1.0,1.15,1.3",
                   help="rates measured, as multiples of the trace's base rate")
    p.add_argument("--sharegpt-rate", type=float, default=3300.0, help="base rate (requests/s) of sharegpt")
    p.add_argument("--shared-prefix-rate", type=float, default=1200.0, help="base rate of shared-prefix")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.05, help="seconds")
    p.add_argument("--knee-attainment", type=float, default=0.9)
    p.add_argument("--priority-fraction", type=float, default=0.2)
    p.add_argument("--burstiness", type=float, default=0.25, help="the bursty suite's gamma shape")
    p.add_argument("--prefill-heavy-rate", type=float, default=6.0, help="base rate of prefill-heavy, per worker")
    p.add_argument("--decode-heavy-rate", type=float, default=8.0, help="base rate of decode-heavy, per worker")
    p.add_argument("--skewed-rate", type=float, default=15.0, help="base rate of skewed, per worker")
    p.add_argument("--short-prompt", type=int, default=512,
                   help="disaggregated fleets: prompts of at most this many tokens prefill on a decode worker")
    p.add_argument("--migrate-above", type=float, default=0.85, help="migrate suite: a worker this full sheds requests")
    p.add_argument("--migrate-below", type=float, default=0.7, help="migrate suite: to workers staying below this")
    p.add_argument("--plot-tag", default="", help="the PNGs are named study-SUITE-TAG.png (e.g. w16)")
    # 256 groups: more system prompts than one worker's pool holds; each group's prompts: the trace's share.
    add_shared_prefix_args(p, num_groups=256, prompts_per_group=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="bench-results/study.json")
    p.add_argument("--plot-dir", default="docs/results", help="where the PNGs go ('' for none)")
    return p


def main(argv: list[str] | None = None) -> int:
    from pagefleet.worker.sim_profile import load_profile

    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = [n for n in args.suites.split(",") if n not in SUITES]
    if unknown:
        parser.error(f"--suites: unknown {', '.join(unknown)} (choose from {', '.join(SUITES)})")
    wanted = [c for c in args.curves.split(",") if c]
    names = {c.name for n in args.suites.split(",") for c in SUITES[n]}
    if [c for c in wanted if c not in names]:
        parser.error(f"--curves: unknown {', '.join(c for c in wanted if c not in names)} in suites {args.suites} "
                     f"(choose from {', '.join(sorted(names))})")
    profile = load_profile(args.profile)
    factors = [float(x) for x in args.rate_factors.split(",")]
    base = {"sharegpt": args.sharegpt_rate, "shared-prefix": args.shared_prefix_rate,
            "prefill-heavy": args.prefill_heavy_rate * args.workers, "decode-heavy": args.decode_heavy_rate * args.workers,
            "skewed": args.skewed_rate * args.workers}
    suites: dict[str, list[dict]] = {}
    report = {
        **header("study", "pagefleet bench study", note="simulated time: the machine's speed only sets how long it runs"),
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "plot_dir")},
        "profile": profile.to_dict(),
        "suites": suites,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.suites.split(","):
        curves = suites[name] = []
        for c in SUITES[name]:
            if wanted and c.name not in wanted:
                continue
            if c.burstiness != 1.0:
                c = dataclasses.replace(c, burstiness=args.burstiness)
            points: list[dict] = []
            curves.append({"name": c.name, "trace": c.trace, "policy": c.policy, "placement": c.placement,
                           "burstiness": c.burstiness, "ideal": c.ideal, "prefill_fraction": c.prefill_fraction,
                           "migrate": c.migrate, "points": points, "knee_rate": None})
            for f in factors:
                pt = run_point(c, base[c.trace] * f, args, profile)
                points.append(pt)
                curves[-1]["knee_rate"] = knee(points, args.knee_attainment)
                print(f"{name:9} {c.name:17} rate {pt['rate']:7.1f}/s: goodput {pt['goodput']:7.1f}/s "
                      f"({pt['attainment']:.0%}), TTFT p99 {pt['ttft_p99_s']:.2f}s, TPOT p99 "
                      f"{pt['tpot_p99_ms']:.0f}ms, moves {pt['moves']['started']} [{pt['cpu_s']:.0f}s CPU]", flush=True)
                # Written after every point: a long study stopped early keeps what it measured.
                out.write_text(json.dumps(report, indent=2) + "\n")
    print(summary(report))
    if args.plot_dir:
        for path in plot(report, Path(args.plot_dir)):
            print(f"plot: {path}")
    print(f"JSON: {out}")
    return 0


def summary(report: dict) -> str:
    """The knees, as a markdown table."""
    lines = ["| suite | curve | knee (req/s at >= {:.0%} within SLO) | goodput at the highest rate |".format(
        report["config"]["knee_attainment"]), "|---|---|---|---|"]
    for suite, curves in report["suites"].items():
        for c in curves:
            k = c["knee_rate"]
            last = c["points"][-1]
            lines.append(f"| {suite} | {c['name']} | {'-' if k is None else f'{k:.0f}'} | "
                         f"{last['goodput']:.0f}/s of {last['rate']:.0f}/s |")
    return "\n".join(lines)


def plot(report: dict, folder: Path) -> list[Path]:
    """One PNG per suite: goodput against offered rate, the knees marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    cfg = report["config"]
    for suite, curves in report["suites"].items():
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for c in curves:
            xs = [p["rate"] for p in c["points"]]
            ys = [p["goodput"] for p in c["points"]]
            style = "--" if c["ideal"] else "-"
            (line,) = ax.plot(xs, ys, style, marker="o", ms=3, label=c["name"])
            if c["knee_rate"] is not None:
                ax.axvline(c["knee_rate"], color=line.get_color(), lw=0.6, ls=":")
        top = max(p["rate"] for c in curves for p in c["points"])
        ax.plot([0, top], [0, top], color="0.7", lw=0.6, label="offered")
        ax.set_xlabel("offered rate (requests/s)")
        ax.set_ylabel(f"goodput (requests/s within TTFT {cfg['slo_ttft']}s, TPOT {cfg['slo_tpot'] * 1e3:.0f}ms)")
        ax.set_title(f"{suite}: {cfg['workers']} simulated {cfg['profile']} workers")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        tag = cfg.get("plot_tag")
        path = folder / (f"study-{suite}-{tag}.png" if tag else f"study-{suite}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
