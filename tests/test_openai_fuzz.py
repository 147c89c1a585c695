"""The door's request parsers under arbitrary JSON: every body is parsed or refused with a
``BadParam`` (a 400 naming a parameter), never another exception (a 500). No cluster: the
parsers are what a body meets before anything is queued."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagefleet.common import grammar
from pagefleet.common.sampling_proto import from_proto
from pagefleet.gateway.limits import Limits
from pagefleet.gateway.openai_request import (
    CHAT_PARAMS,
    COMPLETION_PARAMS,
    BadParam,
    parse_chat,
    parse_completion,
    parse_json_body,
)
from pagefleet.gateway.responses_api import RESPONSES_PARAMS, parse_responses

# Integers past float's range too (JSON's have no bound): float() of one raised OverflowError, a 500.
SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.sampled_from([10**400, -(10**309)])
           | st.floats(allow_nan=False) | st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8) | st.sampled_from(["type", "function", "name", "parameters", "role", "content", "json",
                                           "schema", "json_schema", "choice", "regex", "include_usage"]),
    inner, max_size=4), max_leaves=12)
ROUTES = {
    "completions": (parse_completion, sorted(COMPLETION_PARAMS), {"prompt": "hi"}),
    "chat": (parse_chat, sorted(CHAT_PARAMS), {"messages": [{"role": "user", "content": "hi"}]}),
    "responses": (parse_responses, sorted(RESPONSES_PARAMS), {"input": "hi"}),
}


@st.composite
def bodies(draw, names, good):
    body = dict(good)
    for _ in range(draw(st.integers(1, 3))):
        body[draw(st.sampled_from(names))] = draw(VALUES)
    return body


@pytest.mark.timeout(120)
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_any_body_is_parsed_or_refused_by_name(route):
    parse, names, good = ROUTES[route]
    outcomes = {"parsed": 0, "refused": 0}

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(bodies(names, good))
    def run(body):
        try:
            req = parse(parse_json_body(json.dumps(body).encode()), Limits())
        except BadParam as e:
            assert e.message
            outcomes["refused"] += 1
            return
        outcomes["parsed"] += 1
        params = from_proto(req.sampling)  # what the gateway's check and the worker read
        try:
            params.validate()
        except ValueError:
            return
        if params.structured_outputs is not None:
            with contextlib.suppress(grammar.GrammarError):  # refused by name at the gateway's check
                grammar.check(params.structured_outputs)

    run()
    assert outcomes["parsed"] and outcomes["refused"], outcomes  # both ways were taken


@given(st.binary(max_size=64) | st.text(max_size=64).map(lambda s: s.encode("utf-8", "surrogatepass")))
@settings(max_examples=300, deadline=None)
def test_any_bytes_are_json_or_a_bad_param(raw):
    try:
        parse_json_body(raw)
    except BadParam as e:
        assert e.message
