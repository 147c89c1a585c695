"""``pagefleet run``: generate in-process with one engine and stream the text as it comes."""

from __future__ import annotations

import argparse
import os
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagefleet run", description=__doc__)
    p.add_argument("prompt", nargs="*", default=["Paged attention keeps the GPU busy"])
    p.add_argument("--model", default="tiny", help="'tiny' or a Hugging Face checkpoint directory")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pagefleet import Engine, SamplingParams

    try:
        engine = Engine(args.model, device=args.device)
    except (ValueError, OSError) as e:  # a model that does not load, or a device not here: why, in one line
        blame = "--device" if str(e).startswith("device") else f"--model {args.model}"
        print(f"pagefleet run: {blame}: {e}", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    try:
        ids = [engine.add_request(p, params) for p in args.prompt]
    except ValueError as e:
        print(f"pagefleet run: {e}", file=sys.stderr)
        return 2
    names = dict(zip(ids, args.prompt, strict=True))
    try:
        return _stream(engine, names)
    except BrokenPipeError:  # its reader went away (`| head`): stop quietly, as a filter does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _stream(engine, names: dict[str, str]) -> int:
    start = time.perf_counter()
    tokens = 0
    while engine.has_unfinished_requests():
        for d in engine.step():
            tokens += len(d.token_ids)
            if d.token_ids:
                print(f"[{names[d.request_id][:24]}] +{d.token_ids} {d.text!r}", flush=True)
            if d.finished:
                print(f"[{names[d.request_id][:24]}] finished: {d.finish_reason}", flush=True)
    dt = time.perf_counter() - start
    print(f"{tokens} tokens in {dt:.2f}s ({tokens / dt:.1f} tok/s) on {engine.device}")
    return 0
