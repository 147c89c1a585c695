"""``pagefleet bench sim-fit``: a simulated worker's profile, fitted to measured steps.

Reads the per-step timings ``pagefleet bench engine --json`` records (``step_timings`` of a
``pagefleet continuous`` result: batched tokens, KV tokens read, seconds of the whole step)
and fits ``seconds = a + b * batched tokens + c * KV tokens read`` by least squares
(``pagefleet.worker.sim_profile.fit_step_time``). The memory and swap figures, which a
step timing cannot tell, come from ``--base`` (a shipped profile or a file) or the flags.
Writes the profile as JSON (``pagefleet worker --engine sim --sim-profile FILE``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from pagefleet.worker.sim_profile import SimProfile, fit_step_time, load_profile


def timings_of(report: dict, system: str) -> list[list[float]]:
    """The step timings of result ``system`` in a ``bench engine`` report; ValueError if none."""
    for r in report.get("results", ()):
        if r.get("system") == system and r.get("step_timings"):
            return r["step_timings"]
    have = [r.get("system") for r in report.get("results", ()) if r.get("step_timings")]
    raise ValueError(f"no step timings for {system!r} (with timings: {have or 'none'}; "
                     "re-run `pagefleet bench engine` to record them)")


def fit_profile(report: dict, base: SimProfile, *, name: str, system: str = "pagefleet continuous",
                source_file: str = "") -> tuple[SimProfile, float, int]:
    """``base`` with its step-time model fitted to ``report``'s timings; the profile, R², steps."""
    samples = timings_of(report, system)
    step, r2 = fit_step_time(samples)
    source = (f"Fitted by `pagefleet bench sim-fit` to {len(samples)} steps of {system!r} in "
              f"{source_file or 'a bench engine report'} (`pagefleet bench engine`, {report.get('date', '?')}, "
              f"{report.get('machine', '?')}, model trace {report.get('trace', {})}); least squares, "
              f"R^2 = {r2:.3f}. Memory and swap figures from profile {base.name!r}.")
    return dataclasses.replace(base, name=name, step=step, source=source), r2, len(samples)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagefleet bench sim-fit", description=__doc__.split("\n")[0])
    p.add_argument("--from", dest="source", default="bench-results/engine.json",
                   help="a `pagefleet bench engine` JSON report")
    p.add_argument("--system", default="pagefleet continuous", help="which result's steps to fit")
    p.add_argument("--base", default="llama-3-8b-h100",
                   help="profile (name or file) whose memory and swap figures the fitted one keeps")
    p.add_argument("--name", default=None, help="the new profile's name (default: the output file's stem)")
    p.add_argument("--kv-bytes-per-token", type=int, default=None, help="instead of --base's")
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="instead of --base's")
    p.add_argument("--max-model-len", type=int, default=None, help="instead of --base's")
    p.add_argument("--out", default="bench-results/sim-profile.json", help="where to write the profile")
    args = p.parse_args(argv)
    report = json.loads(Path(args.source).read_text())
    base = load_profile(args.base)
    overrides = {k: v for k, v in (("kv_bytes_per_token", args.kv_bytes_per_token),
                                   ("kv_cache_bytes", args.kv_cache_bytes),
                                   ("max_model_len", args.max_model_len)) if v is not None}
    base = dataclasses.replace(base, **overrides)
    out = Path(args.out)
    try:
        profile, r2, n = fit_profile(report, base, name=args.name or out.stem, system=args.system,
                                     source_file=args.source)
    except ValueError as e:
        p.error(str(e))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    s = profile.step
    print(f"{n} steps: a = {s.a * 1e3:.4f} ms, b = {s.b * 1e6:.4f} us/token, c = {s.c * 1e9:.4f} ns/KV token; "
          f"R^2 = {r2:.3f}")
    print(f"profile: {out} (pagefleet worker --engine sim --sim-profile {out})")
    return 0
