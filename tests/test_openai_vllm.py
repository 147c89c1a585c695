"""The HTTP door as vLLM's users drive it: vLLM's request extensions, /tokenize and
/detokenize, malformed bodies (always 400, never 5xx), slow and greedy connections.

One cluster for the module: a small random Llama checkpoint with a BPE tokenizer trained
here (test_openai.py's), one CPU worker, short HTTP timeouts and a small connection bound.
Outputs are steered with ``logit_bias`` and ``allowed_token_ids`` so that what a parameter
does shows in the text of a random model; the text is compared with ``transformers``'
``decode`` of the same tokens.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest
from cluster_fixtures import start_cluster
from conftest import make_checkpoint
from test_metrics import scrape
from test_openai import build_tokenizer, write_tokenizer_config

pytestmark = pytest.mark.timeout(240)

MODEL = "llama-vllm"
# Roles, a generation prompt, and enable_thinking (a chat_template_kwargs variable) as Qwen3's.
TEMPLATE = ("{{ bos_token }}{% if tools %}<|system|>{{ tools | tojson }}<|end|>\n{% endif %}"
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
            "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|end|>\n"
            "{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>"
            "{% if enable_thinking is defined and not enable_thinking %}<|system|><|end|>{% endif %}{% endif %}")
HEADER_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 48


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama-vllm")
    vocab_size = build_tokenizer(path)
    make_checkpoint(path, "llama", vocab_size=vocab_size, max_position_embeddings=2048)
    write_tokenizer_config(path, TEMPLATE)
    return path


@pytest.fixture(scope="module")
def hf(checkpoint):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, checkpoint):
    c = start_cluster(tmp_path_factory.mktemp("vllm-door-logs"), num_workers=1, model=str(checkpoint), http_port=0,
                      metrics_port=0, worker_args=["--num-blocks", "256"],
                      gateway_args=["--served-model-name", MODEL, "--http-header-timeout", str(HEADER_TIMEOUT_S),
                                    "--http-body-timeout", "1", "--max-connections", str(MAX_CONNECTIONS),
                                    "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _post(cluster, path: str, body, raw: bytes | None = None) -> tuple[int, dict]:
    import http.client

    u = urlsplit(cluster.http_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        data = raw if raw is not None else json.dumps(body).encode()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read()
        return resp.status, json.loads(text) if text else {}
    finally:
        conn.close()


def _id(hf, token: str) -> int:
    t = hf.convert_tokens_to_ids(token)
    assert t is not None and t != hf.unk_token_id, token
    return t


# -- vLLM's request extensions -------------------------------------------------------------------
def test_guidellm_stream_options_usage_in_every_chunk(client):
    """GuideLLM's body: continuous usage stats, max_completion_tokens, ignore_eos, list-of-parts content."""
    chunks = list(client.completions.create(
        model=MODEL, prompt="hello world", stream=True, temperature=0,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"max_completion_tokens": 7, "ignore_eos": True}))
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 7
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 7
    chat = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "hello"},
                                                            {"type": "text", "text": "world"}]}],
        stream=True, max_completion_tokens=5, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}))
    assert all(c.usage is not None for c in chat) and chat[-1].usage.completion_tokens == 5
    # n > 1: a choice's chunk carries that choice's counts (as vLLM's), the last chunk the sums
    many = list(client.completions.create(
        model=MODEL, prompt="hello world", stream=True, n=3, max_tokens=4, temperature=1.0, seed=7,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    prompt = many[-1].usage.prompt_tokens
    for c in many[:-1]:
        assert len(c.choices) == 1 and c.usage.prompt_tokens == prompt and c.usage.completion_tokens <= 4
    assert not many[-1].choices and many[-1].usage.completion_tokens == 12
    assert max(c.usage.completion_tokens for c in many[:-1]) == 4


def test_length_cut_in_a_character_ends_as_decode_gives(client, hf):
    """Two-byte characters' first byte only, cut by max_tokens: U+FFFD, as decode gives."""
    lead = _id(hf, "Ã")  # ByteLevel's symbol for the byte 0xC3 (é's first byte)
    for stream in (False, True):
        kwargs = dict(model=MODEL, prompt="hello", max_tokens=3, temperature=0,
                      extra_body={"allowed_token_ids": [lead], "ignore_eos": True})
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
        else:
            text = client.completions.create(**kwargs).choices[0].text
        assert text == hf.decode([lead] * 3) and text.endswith("\ufffd")


def test_logit_bias_allowed_token_ids_and_bad_words(client, hf):
    the, quick = _id(hf, "the"), _id(hf, "Ġ")
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=6, temperature=0,
                                    logit_bias={str(the): 100}, extra_body={"ignore_eos": True})
    assert out.choices[0].text == "the" * 6
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True, "allowed_token_ids": [quick, the]})
    assert out.choices[0].text.replace("the", "").replace(" ", "") == ""
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=6, temperature=0, logprobs=0,
                                    logit_bias={str(the): 100}, extra_body={"ignore_eos": True, "bad_words": ["the"]})
    assert "the" not in out.choices[0].logprobs.tokens and len(out.choices[0].logprobs.tokens) == 6


def test_stop_string_included_on_request(client, hf):
    kwargs = dict(model=MODEL, prompt="hello", max_tokens=8, temperature=0, stop=["ethe"],
                  logit_bias={str(_id(hf, "the")): 100})
    base = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert base.choices[0].text == "th" and base.choices[0].finish_reason == "stop"
    incl = client.completions.create(**kwargs, extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert incl.choices[0].text == "thethe" and incl.choices[0].finish_reason == "stop"


def test_stop_reason_names_the_stop_string_or_token_as_vllm(cluster, client, hf):
    """vLLM's ``stop_reason``: the stop string, or the stop token's id (one of the request's
    ``stop_token_ids``), that ended a choice; null when the length or the model's end did."""
    the = _id(hf, "the")
    kwargs = dict(model=MODEL, prompt="hello", max_tokens=8, temperature=0, logit_bias={str(the): 100})
    by_string = client.completions.create(**kwargs, stop=["ethe"], extra_body={"ignore_eos": True})
    assert (by_string.choices[0].finish_reason, by_string.choices[0].stop_reason) == ("stop", "ethe")
    by_token = client.completions.create(**kwargs, extra_body={"ignore_eos": True, "stop_token_ids": [the]})
    assert (by_token.choices[0].finish_reason, by_token.choices[0].stop_reason) == ("stop", the)
    by_length = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert (by_length.choices[0].finish_reason, by_length.choices[0].stop_reason) == ("length", None)
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0,
                                                 logit_bias={str(the): 100}, stop=["ethe"], stream=True,
                                                 extra_body={"ignore_eos": True}))
    ends = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [(e.finish_reason, e.stop_reason) for e in ends] == [("stop", "ethe")]
    from pagefleet.client import Client

    with Client(cluster.gateway_target) as c:  # gRPC: GenerateResponse.stop_string / stop_token_id
        free = c.generate("hello", model=MODEL, max_tokens=8, temperature=0, ignore_eos=True)
        cut = c.generate("hello", model=MODEL, max_tokens=8, temperature=0, ignore_eos=True, stop=[free.text[2:4]])
        token = c.generate("hello", model=MODEL, max_tokens=8, temperature=0, ignore_eos=True,
                           stop_token_ids=[free.token_ids[3]])
        rid = f"stop-replayed-{time.monotonic_ns()}"
        first, replayed = (c.generate("hello", model=MODEL, max_tokens=8, temperature=0, ignore_eos=True,
                                      stop=[free.text[2:4]], request_id=rid) for _ in range(2))  # the second: a retry
    assert (free.stop_reason, cut.stop_reason, token.stop_reason) == (None, free.text[2:4], free.token_ids[3])
    assert first.stop_reason == replayed.stop_reason == free.text[2:4]  # kept in the record a retry replays


def test_skip_special_tokens(client, hf):
    end = _id(hf, "<|end|>")
    kwargs = dict(model=MODEL, prompt="hello", max_tokens=3, temperature=0)
    skipped = client.completions.create(**kwargs, extra_body={"allowed_token_ids": [end], "ignore_eos": True})
    kept = client.completions.create(**kwargs, extra_body={"allowed_token_ids": [end], "ignore_eos": True,
                                                           "skip_special_tokens": False,
                                                           "spaces_between_special_tokens": True})
    assert skipped.choices[0].text == "" == hf.decode([end] * 3, skip_special_tokens=True)
    assert kept.choices[0].text == "<|end|>" * 3 == hf.decode([end] * 3, skip_special_tokens=False)


def test_logprobs_name_special_tokens_and_token_ids_as_vllm(client, hf):
    """A special token's logprob entry is its name (``</s>``, vLLM's ``decode([id])``), not the
    nothing it adds to the text; ``return_tokens_as_token_ids`` names every token ``token_id:<id>``."""
    end, the = _id(hf, "<|end|>"), _id(hf, "the")
    kwargs = dict(model=MODEL, prompt="hello", max_tokens=2, temperature=0, logprobs=1)
    out = client.completions.create(**kwargs, extra_body={"allowed_token_ids": [end], "ignore_eos": True})
    assert out.choices[0].logprobs.tokens == ["<|end|>", "<|end|>"] and out.choices[0].text == ""
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, logprobs=True, top_logprobs=1,
                                          extra_body={"allowed_token_ids": [end, the], "logit_bias": {str(end): 100},
                                                      "ignore_eos": True})
    assert [c.token for c in chat.choices[0].logprobs.content] == ["<|end|>", "<|end|>"]
    assert chat.choices[0].logprobs.content[0].bytes == list(b"<|end|>")
    ids = client.completions.create(**kwargs, extra_body={"allowed_token_ids": [the], "ignore_eos": True,
                                                           "return_tokens_as_token_ids": True})
    assert ids.choices[0].logprobs.tokens == [f"token_id:{the}"] * 2 and ids.choices[0].text == "thethe"
    assert ids.choices[0].logprobs.text_offset == [0, 3]


def test_a_bodys_request_id_is_the_clients_own_id(cluster):
    """vLLM's ``request_id`` field: as an X-Request-Id header, the request's id (sent back), and
    a second request of the same id and body is its retry (the same answer, not a new run)."""
    import http.client

    u = urlsplit(cluster.http_url)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 1.0, "request_id": "body-rid-7"}
    answers = []
    for _ in range(2):
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            answers.append((resp.status, resp.getheader("X-Request-Id"), json.loads(resp.read())))
        finally:
            conn.close()
    (s1, h1, a1), (s2, h2, a2) = answers
    assert (s1, s2, h1, h2) == (200, 200, "body-rid-7", "body-rid-7")
    assert a1["choices"][0]["text"] == a2["choices"][0]["text"]
    # An id no header can carry as it is (any string is one in vLLM): answered, the header the id
    # chosen from it (it was a 500 after the request was queued, which then ran for no one).
    for rid, stream in (("请求-1", True), ("a\nb", False)):
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        try:
            conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                         body=json.dumps({**body, "request_id": rid, "stream": stream}))
            resp = conn.getresponse()
            text = resp.read().decode()
            assert resp.status == 200 and resp.getheader("X-Request-Id", "").startswith("xrid-"), (rid, text)
            assert '"finish_reason":"length"' in text.replace(" ", ""), text
        finally:
            conn.close()


def test_echo_and_truncate_prompt_tokens(client):
    out = client.completions.create(model=MODEL, prompt="hello world", max_tokens=3, temperature=0, echo=True,
                                    extra_body={"ignore_eos": True})
    plain = client.completions.create(model=MODEL, prompt="hello world", max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert out.choices[0].text == "hello world" + plain.choices[0].text
    cut = client.completions.create(model=MODEL, prompt="the quick brown fox jumps over the lazy dog", max_tokens=2,
                                    temperature=0, extra_body={"ignore_eos": True, "truncate_prompt_tokens": 3})
    assert cut.usage.prompt_tokens == 3
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Bonjour"}],
        max_tokens=2, temperature=0, extra_body={"echo": True, "ignore_eos": True, "continue_final_message": True,
                                                 "add_generation_prompt": False})
    assert chat.choices[0].message.content.startswith("Bonjour")


def test_chat_template_options_match_transformers(cluster, client, hf):
    convo = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "ça va"}]
    cases = [
        ({"add_generation_prompt": True}, dict(add_generation_prompt=True)),
        ({"add_generation_prompt": False}, dict(add_generation_prompt=False)),
        ({"continue_final_message": True, "add_generation_prompt": False}, dict(continue_final_message=True)),
        ({"chat_template_kwargs": {"enable_thinking": False}}, dict(add_generation_prompt=True, enable_thinking=False)),
    ]
    for body, kwargs in cases:
        status, out = _post(cluster, "/tokenize", {"model": MODEL, "messages": convo, **body})
        assert status == 200, out
        want = hf(hf.apply_chat_template(convo, tokenize=False, **kwargs), add_special_tokens=False)["input_ids"]
        assert out["tokens"] == list(want), body
        assert out["count"] == len(want)
        chat = client.chat.completions.create(model=MODEL, messages=convo, max_tokens=1, extra_body=body)
        assert chat.usage.prompt_tokens == len(want)


def test_tokenize_and_detokenize_as_vllm(cluster, hf):
    status, out = _post(cluster, "/tokenize", {"model": MODEL, "prompt": "Bonjour à tous", "return_token_strs": True})
    assert status == 200
    assert out["tokens"] == hf("Bonjour à tous")["input_ids"]
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 2048
    # the vocabulary's own strings, as vLLM's convert_ids_to_tokens (not each token's text)
    assert out["token_strs"] == hf.convert_ids_to_tokens(out["tokens"])
    status, out2 = _post(cluster, "/tokenize", {"prompt": "Bonjour", "add_special_tokens": False})
    assert out2["tokens"] == hf("Bonjour", add_special_tokens=False)["input_ids"]
    status, back = _post(cluster, "/detokenize", {"model": MODEL, "tokens": out["tokens"]})
    # as vLLM's: special tokens are text too (the inverse of /tokenize)
    assert status == 200 and back == {"prompt": hf.decode(out["tokens"], skip_special_tokens=False)}
    for path, body, param in [("/detokenize", {"tokens": [10 ** 6]}, "tokens"),
                              ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
                              ("/tokenize", {"prompt": 3}, "prompt")]:
        status, err = _post(cluster, path, body)
        assert status == 400 and err["error"]["param"] == param
    assert _post(cluster, "/tokenize", {"model": "other", "prompt": "x"})[0] == 404


def test_a_context_overflow_is_told_as_openai_tells_it(client):
    """Clients tell a context overflow by OpenAI's code and vLLM's words (LangChain by
    ``context_length_exceeded``, LiteLLM by "maximum context length"); it names what to shrink."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4000)
    err = e.value.body
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens", err
    assert "maximum context length is 2048 tokens" in err["message"] and "4000 in the completion" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * 2095, max_tokens=1)
    err = e.value.body
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt", err
    assert "2095 input tokens" in err["message"]


def test_unsupported_extensions_are_refused_by_name(client):
    for name, value in [("prompt_logprobs", 1), ("best_of", 2), ("suffix", "x")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={name: value})
        assert e.value.body["param"] == name and name in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, echo=True, logprobs=1)
    assert e.value.body["param"] == "echo"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, logit_bias={"999999": 1})
    assert e.value.body["param"] == "logit_bias"


# -- structured output ---------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                           "n": {"type": "integer", "minimum": -5, "maximum": 500},
                                           "kind": {"enum": ["a", "b"]}},
          "required": ["city", "n", "kind"], "additionalProperties": False}


def test_response_format_json_schema_validates_streamed_and_not(client):
    import jsonschema

    rf = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "a place"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, response_format=rf, n=3, seed=11,
                                         max_tokens=60)
    texts = [c.message.content for c in out.choices]
    stream = client.chat.completions.create(model=MODEL, messages=messages, response_format=rf, seed=12,
                                            max_tokens=60, stream=True)
    texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    done = client.completions.create(model=MODEL, prompt="x", max_tokens=60, temperature=0,
                                     extra_body={"guided_json": SCHEMA})
    texts.append(done.choices[0].text)
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    obj = client.chat.completions.create(model=MODEL, messages=messages, response_format={"type": "json_object"},
                                         max_tokens=30, logit_bias={str(_brace(client)): 30})
    assert json.loads(obj.choices[0].message.content) == {}


def _brace(client) -> int:
    return client.post("/../tokenize", body={"prompt": "}", "add_special_tokens": False}, cast_to=object)["tokens"][0]


def test_guided_choice_regex_and_grammar(client):
    choices = ["red", "green", "blue sky"]
    out = client.completions.create(model=MODEL, prompt="colour:", n=8, seed=3, max_tokens=10,
                                    extra_body={"guided_choice": choices})
    picked = [c.text for c in out.choices]
    assert set(picked) <= set(choices) and len(set(picked)) > 1
    out = client.completions.create(model=MODEL, prompt="code:", n=3, seed=4, max_tokens=10,
                                    extra_body={"guided_regex": r"[a-c]{2}-[0-9]{3}"})
    assert all(__import__("re").fullmatch(r"[a-c]{2}-[0-9]{3}", c.text) for c in out.choices)
    out = client.completions.create(model=MODEL, prompt="n:", n=3, seed=5, max_tokens=10,
                                    extra_body={"guided_grammar": 'start: "n=" DIGIT DIGIT\nDIGIT: /[0-9]/'})
    assert all(__import__("re").fullmatch(r"n=[0-9]{2}", c.text) for c in out.choices)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "pick"}], seed=6,
                                         max_tokens=10, extra_body={"structured_outputs": {"choice": choices}})
    assert out.choices[0].message.content in choices


def test_grpc_structured_outputs_on_the_same_path(cluster):
    from pagefleet.client import Client
    from pagefleet.protos import generation_pb2 as pb

    with Client(cluster.gateway_target) as c:
        out = c.generate("pick", max_tokens=10, seed=8, temperature=1.0,
                         structured_outputs=pb.StructuredOutputs(choice=["left", "right"]))
        assert out.text in ("left", "right")
        import grpc

        with pytest.raises(grpc.RpcError) as e:
            c.generate("pick", max_tokens=10, structured_outputs=pb.StructuredOutputs(regex="a(b"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "structured_outputs.regex" in e.value.details()
        # Present and empty ("at most one of these is set"): free text, as unset (it was refused).
        free = c.generate("pick", max_tokens=4, temperature=0, ignore_eos=True,
                          structured_outputs=pb.StructuredOutputs())
        assert free.finish_reason == "length" and len(free.token_ids) == 4


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
        ({"extra_body": {"guided_json": {"type": "nope"}}}, "guided_json"),
        ({"extra_body": {"guided_grammar": "start: nothere"}}, "guided_grammar"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "guided_choice"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}},
         "structured_outputs.whitespace_pattern"),
        ({"extra_body": {"guided_decoding_backend": "xgrammar", "guided_regex": "a"}}, "guided_decoding_backend"),
    ],
)
def test_a_grammar_that_does_not_compile_is_a_400_naming_it(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                       **kwargs)
    assert e.value.body["param"] == param, e.value.body


# -- tools and reasoning ------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 6},
                                                "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "weather in Paris?"}]


def _streamed_calls(stream) -> tuple[str, list[dict], str | None]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


def test_named_and_required_tool_choice_always_parse_and_validate(client):
    import jsonschema

    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named, n=3,
                                         seed=1, max_tokens=40)
    for c in out.choices:
        (call,) = c.message.tool_calls
        assert call.function.name == "get_time" and c.finish_reason == "stop"  # named: as OpenAI and vLLM answer
        jsonschema.validate(json.loads(call.function.arguments), params["get_time"])
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                         parallel_tool_calls=False, n=4, seed=2, max_tokens=60)
    for c in out.choices:
        (call,) = c.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
        assert c.message.content is None and call.id.startswith("call_")
    content, calls, finish = _streamed_calls(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", seed=3, max_tokens=80, stream=True))
    assert content == "" and finish == "tool_calls" and calls
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), params[call["name"]])


def test_auto_tool_choice_parses_the_models_own_format(client):
    said = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    steer = {"guided_choice": [said]}  # the random model says what a tool-calling one would
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=200, extra_body=steer)
    message = out.choices[0].message
    assert message.content == "Checking." and out.choices[0].finish_reason == "tool_calls"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "c"}
    content, calls, finish = _streamed_calls(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=200, extra_body=steer, stream=True))
    assert (content, finish) == ("Checking.", "tool_calls")
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}]
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                          max_tokens=200, extra_body=steer)
    assert none.choices[0].message.content == said and not none.choices[0].message.tool_calls


def test_tool_turns_render_as_transformers_does(cluster, client, hf):
    turns = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    status, out = _post(cluster, "/tokenize", {"model": MODEL, "messages": turns, "tools": [WEATHER]})
    assert status == 200, out
    reference = [dict(m) for m in turns]
    reference[1]["tool_calls"] = [{**turns[1]["tool_calls"][0], "function": {"name": "get_weather",
                                                                            "arguments": {"city": "Paris"}}}]
    want = hf(hf.apply_chat_template(reference, tools=[WEATHER], tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]
    assert out["tokens"] == want
    chat = client.chat.completions.create(model=MODEL, messages=turns, tools=[WEATHER], tool_choice="none",
                                          max_tokens=2)
    assert chat.usage.prompt_tokens == len(want)


def test_reasoning_content_streamed_and_not(client):
    steer = {"guided_choice": ["<think>pondering it</think>the answer"]}
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, extra_body=steer)
    message = out.choices[0].message
    assert (message.reasoning_content, message.content) == ("pondering it", "the answer")
    assert message.reasoning == "pondering it"  # vLLM's newer name, sent beside the older
    reasoning, newer, content = "", "", ""
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, extra_body=steer,
                                                stream=True):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            newer += getattr(c.delta, "reasoning", None) or ""
            content += c.delta.content or ""
    assert (reasoning, newer, content) == ("pondering it", "pondering it", "the answer")
    left_out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40,
                                              extra_body={**steer, "include_reasoning": False})
    assert (getattr(left_out.choices[0].message, "reasoning_content", None),
            left_out.choices[0].message.content) == (None, "the answer")
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, extra_body={
        "guided_choice": ["no think"]})
    assert plain.choices[0].message.content == "no think"


# -- the Responses API --------------------------------------------------------------------------
def test_a_stream_sends_no_chunk_that_says_nothing(client, hf):
    """Text a parser holds back (``<think>``, a tool call being read) or a character not yet
    complete sends no chunk of its own, as vLLM's streams send none."""
    steer = {"guided_choice": ["<think>pondering it</think>the answer"]}
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, extra_body=steer,
                                                 stream=True))
    lead = _id(hf, "Ã")  # half of a two-byte character: a token whose text is not out yet
    chunks += list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0,
                                                  stream=True, extra_body={"allowed_token_ids": [lead],
                                                                           "ignore_eos": True}))
    for c in chunks:
        for choice in c.choices:
            d = choice.delta
            assert choice.finish_reason or d.role or d.content or getattr(d, "reasoning_content", None), c


def test_responses_text_is_the_chats_streamed_and_not(client):
    kwargs = dict(model=MODEL, input="hello world", instructions="be brief", max_output_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})
    r = client.responses.create(**kwargs)
    chat = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
                                          messages=[{"role": "system", "content": "be brief"},
                                                    {"role": "user", "content": "hello world"}])
    assert r.output_text == chat.choices[0].message.content
    assert (r.status, r.incomplete_details.reason, r.store) == ("incomplete", "max_output_tokens", False)
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 8)
    assert r.id.startswith("resp_") and r.output[0].type == "message"
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == r.output_text
    for kind in ("response.output_item.added", "response.content_part.added", "response.output_text.done",
                 "response.content_part.done", "response.output_item.done"):
        assert kind in kinds


def test_responses_function_tools_and_reasoning_items(client):
    import jsonschema

    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    # Greedy: a sampled walk through the grammar may not close its JSON within the token budget.
    r = client.responses.create(model=MODEL, input="weather?", tools=[tool], tool_choice="required",
                                max_output_tokens=200, temperature=0)
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), tool["parameters"])
    events = list(client.responses.create(model=MODEL, input="weather?", tools=[tool], max_output_tokens=200,
                                          temperature=0, tool_choice={"type": "function", "name": "get_weather"},
                                          stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and jsonschema.validate(json.loads(done[0].arguments), tool["parameters"]) is None
    # the tool's answer goes back as input items
    follow = client.responses.create(model=MODEL, max_output_tokens=3, tools=[tool], tool_choice="none",
                                     temperature=0, extra_body={"ignore_eos": True}, input=[
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow.output[0].type == "message"
    steer = {"structured_outputs": {"choice": ["<think>mulling</think>done"]}}
    r = client.responses.create(model=MODEL, input="think", max_output_tokens=40, extra_body=steer)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "mulling" and r.output_text == "done"


def test_responses_refuse_state_by_name(client):
    for extra, param in [({"previous_response_id": "resp_1"}, "previous_response_id"), ({"background": True},
                                                                                         "background")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input="x", extra_body=extra)
        assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", max_output_tokens=0)
    assert e.value.body["param"] == "max_output_tokens"
    assert e.value.body["message"].startswith("max_output_tokens"), e.value.body  # the name the client sent


def test_priority_is_vllms_lower_first():
    """vLLM serves a lower ``priority`` first; the cluster's gRPC ``priority`` ranks a larger one
    first, so the door negates it (a vLLM client's urgent request was the last served)."""
    from pagefleet.gateway.limits import Limits
    from pagefleet.gateway.openai_request import BadParam, parse_chat, parse_completion

    urgent = parse_chat({"messages": [{"role": "user", "content": "x"}], "priority": -10}, Limits())
    background = parse_completion({"prompt": "x", "priority": 10}, Limits())
    assert urgent.priority > 0 > background.priority
    assert parse_completion({"prompt": "x"}, Limits()).priority == 0
    with pytest.raises(BadParam) as e:
        parse_completion({"prompt": "x", "priority": -2**31}, Limits())  # its negation is past int32
    assert e.value.param == "priority"


def test_responses_refuse_what_they_would_ignore():
    """Values of the wrong type (a "no" that streamed, a text or metadata that is not an
    object) are refused by name; store: true is taken as vLLM takes it when it keeps no
    responses (the answer says store false), and so are truncation and service_tier."""
    from pagefleet.gateway.limits import Limits
    from pagefleet.gateway.openai_request import BadParam
    from pagefleet.gateway.responses_api import parse_responses

    for body, param in [({"stream": "no"}, "stream"), ({"text": "json"}, "text"),
                        ({"metadata": ["a"]}, "metadata"), ({"stream_options": 1}, "stream_options"),
                        ({"store": "yes"}, "store"), ({"truncation": "middle"}, "truncation"),
                        ({"include": ["everything"]}, "include[0]"), ({"reasoning": {"effort": "max"}},
                                                                        "reasoning.effort"),
                        ({"input": []}, "input"), ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
                                                   "input[0].content[0]")]:
        with pytest.raises(BadParam) as e:
            parse_responses({"input": "x", **body}, Limits())
        assert e.value.param == param, body
        assert "messages" not in e.value.message, e.value.message  # a response's names, not a chat's
    req = parse_responses({"input": "x", "store": False, "stream": False, "metadata": {"k": "v"}}, Limits())
    assert req.stream is False
    req = parse_responses({"input": "x", "store": True, "truncation": "auto", "service_tier": "default",
                           "include": ["reasoning.encrypted_content"]}, Limits())
    assert req.messages == [{"role": "user", "content": "x"}]


def test_responses_input_items_reach_the_template_as_vllm_builds_them():
    """A response's own output replayed as input is one assistant turn (its text, then its
    calls); a tool's output given as text parts is their text; empty instructions are no system
    turn; an assistant message left incomplete is continued; reasoning.effort reaches the
    template; calls without their ids are refused by name."""
    from pagefleet.gateway.limits import Limits
    from pagefleet.gateway.openai_request import BadParam
    from pagefleet.gateway.responses_api import parse_responses

    req = parse_responses({"instructions": "", "reasoning": {"effort": "low"}, "input": [
        {"role": "user", "content": "weather?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me look"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "sunny"}]},
        {"type": "function_call_output", "call_id": "c2", "output": "noon"}]}, Limits())
    assert [m["role"] for m in req.messages] == ["user", "assistant", "tool", "tool"]
    assert req.messages[1]["content"] == "let me look"
    assert [c["id"] for c in req.messages[1]["tool_calls"]] == ["c1", "c2"]
    assert [m["content"] for m in req.messages[2:]] == ["sunny", "noon"]
    assert req.chat_template_kwargs == {"reasoning_effort": "low"}
    assert (req.continue_final_message, req.add_generation_prompt) == (False, True)
    req = parse_responses({"input": [{"role": "user", "content": "count"},
                                     {"type": "message", "role": "assistant", "status": "incomplete",
                                      "content": [{"type": "output_text", "text": "1 2"}]}]}, Limits())
    assert (req.continue_final_message, req.add_generation_prompt) == (True, False)
    for item, param in [({"type": "function_call_output", "output": "x"}, "input[0].call_id"),
                        ({"type": "function_call", "name": "f", "arguments": "{}"}, "input[0].call_id"),
                        ({"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]},
                         "input[0].output[0]")]:
        with pytest.raises(BadParam) as e:
            parse_responses({"input": [item]}, Limits())
        assert e.value.param == param, item


def test_responses_usage_counts_reasoning_and_logprobs_are_sent_when_included(client):
    steer = {"structured_outputs": {"choice": ["<think>mulling it over</think>done"]}}
    r = client.responses.create(model=MODEL, input="think", max_output_tokens=40, extra_body=steer)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    details = r.usage.output_tokens_details
    assert 0 < details.reasoning_tokens < r.usage.output_tokens, r.usage
    kwargs = dict(model=MODEL, input="hi", max_output_tokens=12, temperature=0, top_logprobs=2,
                  include=["message.output_text.logprobs"], extra_body={"structured_outputs": {"choice": ["sunny"]}})
    r = client.responses.create(**kwargs)
    (part,) = r.output[0].content
    assert part.text == "sunny" and all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    assert "".join(lp.token for lp in part.logprobs).startswith("sunny")  # (and the end of text's, if any)
    events = list(client.responses.create(stream=True, **kwargs))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.token for lp in done.logprobs] == [lp.token for lp in part.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs][:len(streamed)]
    # a byte-level token that is part of a character comes with the text that completes it
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=6, temperature=0,
                                include=["message.output_text.logprobs"], extra_body={"ignore_eos": True})
    assert len(r.output[0].content[0].logprobs) == r.usage.output_tokens == 6
    plain = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=True, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert plain.store is False and plain.output[0].content[0].logprobs == []


# -- malformed bodies: 400, never 5xx ----------------------------------------------------------
MALFORMED = [
    b"[" * 1000 + b"]" * 1000,
    b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"model": "x", "prompt": "\\ud800", "max_tokens": 1}',
    b'{"prompt": "hi", "stop": ["\\udfff"], "max_tokens": 1}',
    b'{"model": "\\ud800", "prompt": "hi"}',
    b'{"\\ud800": 1, "prompt": "hi"}',
    b'{"prompt": "hi", "temperature": NaN}',
    b'{"prompt": "hi", "logit_bias": {"\\ud83d": 1}}',
    b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
    b"\xff\xfe",
    b'"just a string"',
    b'{"prompt": "hi", "stream_options": {"include_usage": "\\ud800"}, "stream": true}',
]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_malformed_bodies_are_400_in_openai_shape(cluster, route):
    for raw in MALFORMED:
        status, body = _post(cluster, route, None, raw=raw)
        assert status == 400, (raw[:60], body)
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"


def test_a_model_name_that_is_not_unicode_is_a_404_that_still_encodes(cluster):
    import http.client

    u = urlsplit(cluster.http_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    conn.request("GET", "/v1/models/%ED%A0%80")
    resp = conn.getresponse()
    assert resp.status == 404 and json.loads(resp.read())["error"]["code"] == "model_not_found"
    conn.close()


def test_client_hanging_up_mid_body_is_no_500(cluster):
    url = cluster.metrics_url("gateway")

    def errors() -> float:
        return sum(v for (name, labels), v in scrape(url).items()
                   if name == "pagefleet:gateway_http_requests_total" and dict(labels).get("status", "").startswith("5"))

    before = errors()
    u = urlsplit(cluster.http_url)
    for _ in range(5):
        with socket.create_connection((u.hostname, u.port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"prompt\": \"hel")
        time.sleep(0.05)
    time.sleep(0.5)
    assert errors() == before


# -- slow and greedy connections -----------------------------------------------------------------
def test_slow_headers_are_cut_and_connections_bounded(cluster, client):
    u = urlsplit(cluster.http_url)
    slow = [socket.create_connection((u.hostname, u.port)) for _ in range(20)]
    start = time.monotonic()
    try:
        for s in slow:
            s.settimeout(HEADER_TIMEOUT_S + 5)
        # A byte every 0.2 s: the trickle never ends on its own.
        for i in range(int(HEADER_TIMEOUT_S / 0.2) + 3):
            for s in slow:
                with contextlib.suppress(OSError):  # closed already: the door gave up on it
                    s.send(b"GET /v1/models HTTP/1.1\r\n"[i:i + 1] or b"X")
            time.sleep(0.2)
        for s in slow:
            data = s.recv(200)  # answered 408 and closed, well before the trickle would end
            assert data == b"" or data.startswith(b"HTTP/1.1 408")
        assert time.monotonic() - start < HEADER_TIMEOUT_S + 5
    finally:
        for s in slow:
            s.close()
    idle = [socket.create_connection((u.hostname, u.port)) for _ in range(MAX_CONNECTIONS + 5)]
    try:
        time.sleep(0.3)
        refused = 0
        for s in idle:
            s.settimeout(0.05)
            try:
                data = s.recv(200)
            except TimeoutError:
                continue
            assert data.startswith((b"HTTP/1.1 503", b"HTTP/1.1 408")), data  # 408: its headers timed out
            if data.startswith(b"HTTP/1.1 503"):  # and when to come back
                refused += 1
                assert b"retry-after: 1\r\n" in data.lower(), data
        assert refused >= 5
    finally:
        for s in idle:
            s.close()
    time.sleep(0.3)
    assert client.models.list().data[0].id == MODEL  # the door still answers


# -- real clients -------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_runs_unmodified(cluster, checkpoint, tmp_path, route):
    """GuideLLM (vLLM's load generator), as its users run it: no errors, and its token counts
    are the door's usage."""
    import subprocess
    import sys

    out = tmp_path / "report.json"
    cmd = [str(Path(sys.executable).parent / "guidellm"), "run",
           "--backend", f"kind=openai_http,target={cluster.http_url},model={MODEL},request_format={route}",
           "--profile", "kind=synchronous",
           "--constraint", "kind=max_requests,count=6",
           "--tokenizer", f"kind=huggingface_auto,model={checkpoint}",
           "--data", "kind=synthetic_text,prompt_tokens=12,output_tokens=5",
           "--output", f"kind=json,path={out}",
           "--disable-console-interactive"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (bench,) = json.loads(out.read_text())["benchmarks"]
    requests = bench["requests"]
    assert (len(requests["successful"]), requests["errored"], requests["incomplete"]) == (6, [], []), requests
    for r in requests["successful"]:
        body = json.loads(r["request_args"])["body"]
        assert body["stream_options"]["continuous_usage_stats"] and body["ignore_eos"]
        asked = {k: v for k, v in body.items() if k in ("prompt", "messages")}
        status, tokenized = _post(cluster, "/tokenize", {"model": MODEL, **asked})
        assert status == 200, tokenized
        assert r["input_metrics"]["text_tokens"] == tokenized["count"]
        assert r["output_metrics"]["text_tokens"] == 5


def test_a_responses_stream_that_fails_part_way_ends_with_response_failed():
    """A generation that fails mid-stream (a worker lost, a deadline) ends a Responses stream
    with its typed ``response.failed`` (the error named in the response), not a chat's error line."""
    import asyncio

    from openai.types.responses import ResponseFailedEvent

    from pagefleet.gateway.chat_output import ChatOutput
    from pagefleet.gateway.limits import Limits
    from pagefleet.gateway.openai_door import OpenAIDoor
    from pagefleet.gateway.responses_api import ResponseOutput, parse_responses
    from pagefleet.protos import generation_pb2 as pb

    class Relays:
        async def _gen(self):
            yield 0, pb.GenerateResponse(text="ab", token_ids=[97, 98])
            yield 0, pb.GenerateResponse(finish_reason=pb.FINISH_REASON_ERROR, error="worker lost")

        def __aiter__(self):
            return self._gen()

        async def aclose(self):
            pass

    class Call:
        def message(self, msg):
            pass

        def end(self, *args, **kwargs):
            pass

    req = parse_responses({"model": MODEL, "input": "hi", "stream": True}, Limits())
    output = ResponseOutput(req, "resp_x", MODEL, ChatOutput(None, None, None))
    door = OpenAIDoor.__new__(OpenAIDoor)

    async def events() -> list[bytes]:
        return [chunk async for chunk in door._events(output, Relays(), Call())]

    chunks = asyncio.run(events())
    last = chunks[-1].decode()
    assert last.startswith("event: response.failed\n"), last
    failed = ResponseFailedEvent.model_validate_json(last.split("data: ", 1)[1])
    assert failed.response.status == "failed" and failed.response.error.message == "worker lost"
    seqs = [json.loads(c.decode().split("data: ", 1)[1])["sequence_number"] for c in chunks]
    assert seqs == list(range(len(chunks)))


def test_an_unstreamed_answer_too_large_to_hold_is_refused_by_name(client):
    """128 choices x 1,900 tokens x 21 log-probabilities, unstreamed, took a gateway from 158
    MiB to 1.7 GiB, and several at once added up with nothing to stop them. Past
    ``MAX_HELD_LOGPROBS`` an unstreamed answer is a 400 naming what to change; streamed, the
    same request is served (its backlog waits in Redis)."""
    from pagefleet.gateway.openai_door import MAX_HELD_LOGPROBS

    n, max_tokens = 100, 1000
    assert n * max_tokens * 21 > MAX_HELD_LOGPROBS
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, n=n, max_tokens=max_tokens, logprobs=True,
                                       top_logprobs=20)
    assert e.value.body["code"] == "too_many_logprobs" and "stream" in e.value.body["message"]
    with client.chat.completions.create(model=MODEL, messages=messages, n=n, max_tokens=max_tokens, logprobs=True,
                                        top_logprobs=20, stream=True) as stream:
        assert next(iter(stream)).choices  # accepted; closed unread (its requests are cancelled)
    small = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=3, logprobs=True,
                                           top_logprobs=20, extra_body={"ignore_eos": True})
    assert len(small.choices) == 2 and len(small.choices[0].logprobs.content) == 3
