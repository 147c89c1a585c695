"""``fuzz``: generated bad requests, raw bytes and odd-but-valid requests through real gateways.

Hypothesis draws every ``GenerateRequest`` field over the whole of its type (unset too:
any string, any ``uint32``, floats with NaN and infinities...). Three kinds of example:

* **bad**: one field (chosen at random) is given a value the gateway must refuse, every
  other field any value at all; the answer must be ``INVALID_ARGUMENT`` (or
  ``RESOURCE_EXHAUSTED``: shed or too large), whatever the others hold;
* **raw**: bytes sent as the message: random bytes, or a request's encoding with bytes
  flipped, dropped, inserted or cut off. Undecodable (or decoding to a bad request):
  ``INVALID_ARGUMENT``; decoding to a valid request: it streams (the call is cancelled
  after its first message);
* **valid**: every field within its bounds but otherwise arbitrary (any seed, priority,
  top-k, stop strings, penalties, logprobs...), at most 4 tokens: it must finish with
  ``stop`` or ``length``, so odd values reach the workers too.

Nothing may answer otherwise, no process may exit, and afterwards a plain greedy request
must give the reference tokens and every worker must hold nothing.
"""

from __future__ import annotations

import math
import time
from collections import Counter

import grpc

from pagefleet.client import Client, Completion
from pagefleet.common.model_config import load_model_spec
from pagefleet.protos import generation_pb2 as pb

from .cluster import ReliabilityCluster, Row, Settings
from .load import make_jobs, reference_tokens

U32, U64, I32 = (1 << 32) - 1, (1 << 64) - 1, 1 << 31
GENERATE = "/pagefleet.v1.Generation/Generate"
REFUSED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
_ID_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-"


def strategies(vocab_size: int, max_model_len: int):
    """``example``: a strategy of ``(kind, field, request or bytes)``."""
    from hypothesis import strategies as st

    def opt(s):
        return st.none() | s

    floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
    any_text = st.text(max_size=40)
    any_fields = dict(
        request_id=st.just("") | st.text(alphabet=_ID_CHARS, min_size=1, max_size=128) | st.text(max_size=140),
        input=st.none() | st.tuples(st.just("prompt"), st.text(max_size=200))
        | st.tuples(st.just("ids"), st.lists(st.integers(0, U32), max_size=64)),
        max_tokens=opt(st.integers(0, U32)), temperature=opt(floats), top_p=opt(floats), top_k=opt(st.integers(0, U32)),
        seed=opt(st.integers(0, U64)), stop=st.lists(any_text, max_size=70),
        stop_token_ids=st.lists(st.integers(0, U32), max_size=16), ignore_eos=st.booleans(),
        presence_penalty=opt(floats), frequency_penalty=opt(floats), repetition_penalty=opt(floats),
        min_tokens=opt(st.integers(0, U32)), logprobs=opt(st.integers(0, U32)),
        priority=st.integers(-I32, I32 - 1), deadline_ms=opt(st.integers(0, U32)),
    )
    too_long = max_model_len + 1
    bad_fields = dict(
        request_id=st.text(alphabet=_ID_CHARS, min_size=129, max_size=160)
        | st.text(min_size=1, max_size=20).filter(lambda s: any(c not in _ID_CHARS for c in s)),
        input=st.sampled_from([None, ("prompt", ""), ("ids", []), ("ids", [1] * too_long), ("prompt", "x" * too_long)])
        | st.tuples(st.just("ids"), st.lists(st.integers(vocab_size, U32), min_size=1, max_size=4)),
        max_tokens=st.just(0) | st.integers(max_model_len, U32),
        temperature=st.floats(max_value=-2**-10, width=32) | st.sampled_from([math.nan, math.inf]),
        top_p=st.floats(max_value=0.0, width=32) | st.floats(min_value=1.015625, width=32) | st.just(math.nan),
        stop=st.lists(st.text(min_size=1, max_size=4), min_size=65, max_size=80)
        | st.lists(st.text(min_size=257, max_size=300), min_size=1, max_size=2) | st.just([""]),
        stop_token_ids=st.integers(1025, 1100).map(lambda n: [7] * n),
        presence_penalty=st.floats(min_value=2.015625, width=32) | st.floats(max_value=-2.015625, width=32)
        | st.just(math.nan),
        frequency_penalty=st.floats(min_value=2.015625, width=32) | st.floats(max_value=-2.015625, width=32)
        | st.just(math.nan),
        repetition_penalty=st.floats(max_value=0.0, width=32) | st.sampled_from([math.nan, math.inf]),
        min_tokens=st.integers(1, 1000),  # added to the request's max_tokens: always past it
        logprobs=st.integers(21, U32),
        deadline_ms=st.just(0),
    )
    valid_fields = dict(
        request_id=st.just(""),  # each valid request is new
        input=st.tuples(st.just("prompt"), st.text(min_size=1, max_size=40))
        | st.tuples(st.just("ids"), st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=40)),
        max_tokens=st.integers(1, 4), temperature=opt(st.floats(0, 5, width=32)),
        top_p=opt(st.floats(2**-20, 1.0, width=32)), top_k=opt(st.integers(0, U32)), seed=opt(st.integers(0, U64)),
        stop=st.lists(st.text(min_size=1, max_size=8), max_size=4), stop_token_ids=st.lists(st.integers(0, U32),
                                                                                          max_size=8),
        ignore_eos=st.booleans(), presence_penalty=opt(st.floats(-2, 2, width=32)),
        frequency_penalty=opt(st.floats(-2, 2, width=32)), repetition_penalty=opt(st.floats(2**-7, 10, width=32)),
        min_tokens=opt(st.integers(0, 1)), logprobs=opt(st.integers(0, 20)),
        priority=st.integers(-I32, I32 - 1), deadline_ms=opt(st.integers(60_000, U32)),
    )

    @st.composite
    def bad(draw):
        values = {k: draw(s) for k, s in any_fields.items()}
        field = draw(st.sampled_from(sorted(bad_fields)))
        values[field] = draw(bad_fields[field])
        if field == "min_tokens":
            max_tokens = values["max_tokens"] if values["max_tokens"] is not None else 16
            values["min_tokens"] = min(U32, max_tokens + values["min_tokens"])
        return "bad", field, _request(values)

    @st.composite
    def valid(draw):
        return "valid", "", _request({k: draw(s) for k, s in valid_fields.items()})

    @st.composite
    def raw(draw):
        if draw(st.booleans()):
            return "raw", "random", draw(st.binary(max_size=200))
        data = bytearray(draw(bad().map(lambda e: e[2]) | valid().map(lambda e: e[2])).SerializeToString())
        for _ in range(draw(st.integers(1, 4))):
            how = draw(st.sampled_from(["flip", "drop", "insert", "cut"]))
            at = draw(st.integers(0, len(data)))
            if how == "flip" and at < len(data):
                data[at] ^= draw(st.integers(1, 255))
            elif how == "drop" and at < len(data):
                del data[at]
            elif how == "insert":
                data.insert(at, draw(st.integers(0, 255)))
            else:
                del data[at:]
        return "raw", "mutated", bytes(data)

    kinds = st.sampled_from(["bad"] * 40 + ["raw"] * 9 + ["valid"])
    return kinds.flatmap(lambda k: {"bad": bad(), "raw": raw(), "valid": valid()}[k])


def _request(v: dict) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=v["request_id"], priority=v["priority"])
    if v["input"] is not None:
        kind, value = v["input"]
        if kind == "prompt":
            req.prompt = value
        else:
            req.prompt_token_ids.ids.extend(value)
    s = req.sampling
    s.stop.extend(v["stop"])
    s.stop_token_ids.extend(v["stop_token_ids"])
    s.ignore_eos = v["ignore_eos"]
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_tokens", "logprobs"):
        if v[name] is not None:
            setattr(s, name, v[name])
    if v["deadline_ms"] is not None:
        req.deadline_ms = v["deadline_ms"]
    return req


class Fuzzer:
    """Sends examples and keeps count; ``violations``: what answered otherwise than it must."""

    def __init__(self, targets: list[str], model: str = "tiny") -> None:
        from pagefleet.gateway.validate import BadField, check

        spec = load_model_spec(model)
        self._valid_locally = lambda req: _passes(check, BadField, req, spec, spec.max_model_len(None))
        self.channels = [grpc.insecure_channel(t) for t in targets]
        self.raw = [ch.unary_stream(GENERATE) for ch in self.channels]  # bytes in, bytes out
        self.codes: Counter = Counter()
        self.kinds: Counter = Counter()
        self.violations: list[str] = []
        self.num_conflicts = 0
        self._n = 0

    def close(self) -> None:
        for ch in self.channels:
            ch.close()

    def send(self, kind: str, field: str, message) -> None:
        self._n += 1
        self.kinds[kind] += 1
        call = self.raw[self._n % len(self.raw)]
        data = message if isinstance(message, bytes) else message.SerializeToString()
        if kind == "bad":
            allowed = REFUSED
        elif kind == "valid":
            allowed = {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
            if getattr(message, "request_id", ""):  # an id an earlier example gave another request
                allowed.add(grpc.StatusCode.ALREADY_EXISTS)
        else:
            try:
                decoded = pb.GenerateRequest.FromString(data)
            except Exception:
                decoded = None
            ok = decoded is not None and self._valid_locally(decoded)
            allowed = {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED} if ok else REFUSED
            if ok and decoded.request_id:  # an id an earlier example gave another request
                allowed = allowed | {grpc.StatusCode.ALREADY_EXISTS}
            if ok and decoded.HasField("deadline_ms"):  # it may run out before the first token
                allowed.add(grpc.StatusCode.DEADLINE_EXCEEDED)
        code, detail = self._call(call, data, stop_early=kind == "raw")
        self.codes[code.name] += 1
        if code not in allowed:
            self.violations.append(f"{kind} {field}: {code.name} {detail[:120]!r} for {data[:80]!r}")

    def _call(self, call, data: bytes, stop_early: bool) -> tuple[grpc.StatusCode, str]:
        stream = call(data, timeout=60)
        done = Completion()
        try:
            for raw in stream:
                msg = pb.GenerateResponse.FromString(raw)
                if msg.index != len(done.token_ids):
                    self.num_conflicts += 1
                    return grpc.StatusCode.DATA_LOSS, f"index {msg.index}, expected {len(done.token_ids)}"
                done.add(msg)
                if stop_early:
                    stream.cancel()
                    return grpc.StatusCode.OK, "streaming"
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
        if done.finish_reason not in ("stop", "length"):
            return grpc.StatusCode.UNKNOWN, f"finished with {done.finish_reason}: {done.error}"
        return grpc.StatusCode.OK, ""


def _passes(check, bad_field, req, spec, max_model_len) -> bool:
    try:
        check(req, spec, max_model_len)
    except bad_field:
        return False
    return True


def run(s: Settings) -> Row:
    from hypothesis import HealthCheck, Phase, given, settings

    name = "fuzz"
    num_examples = s.pick(200, 10_250)  # full: about 10,000 bad or raw, 250 valid
    spec = load_model_spec("tiny")
    final = make_jobs(1, name)[0]
    want = reference_tokens([final])[final.request_id]
    started = time.perf_counter()
    with ReliabilityCluster(s, name, num_workers=1, standby=False) as c:
        fuzzer = Fuzzer(c.gateway_targets)

        @settings(max_examples=num_examples, database=None, deadline=None, derandomize=True,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(strategies(spec.vocab_size, spec.max_model_len(None)))
        def send(example):
            fuzzer.send(*example)

        try:
            send()
        finally:
            fuzzer.close()
        exited = c.exited()
        with Client(c.gateway_targets[0]) as client:
            after = client.generate(list(final.prompt_token_ids), timeout=60, **final.kwargs())
        held = c.wait_idle()
    leaked = {k: v for k, v in held.items() if k != "workers" and v}
    sent = sum(fuzzer.kinds.values())
    figures = {"bad": fuzzer.kinds["bad"], "raw bytes": fuzzer.kinds["raw"], "odd but valid": fuzzer.kinds["valid"],
               "answers": dict(fuzzer.codes.most_common())}
    if fuzzer.violations:
        figures["unexpected"] = fuzzer.violations[:3]
    if leaked:
        figures["held at the end"] = leaked
    goals = {"only INVALID_ARGUMENT / RESOURCE_EXHAUSTED for bad ones": not fuzzer.violations,
             "no process exited": not exited, "the next valid request is served": after.finish_reason == "length",
             "nothing held at the end": not leaked}
    differing = sum(1 for a, b in zip(after.token_ids, want, strict=False) if a != b)
    return Row(name, sent=sent, completed=sent - len(fuzzer.violations), lost=len(fuzzer.violations),
               duplicated=fuzzer.num_conflicts, missing=max(0, len(want) - len(after.token_ids)),
               differing=differing, seconds=round(time.perf_counter() - started, 1), figures=figures, goals=goals)
