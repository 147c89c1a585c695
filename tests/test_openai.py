"""The OpenAI-compatible HTTP door of the gateway, driven by the real ``openai`` client.

One cluster for the module (a small random Llama checkpoint with a BPE tokenizer trained
here and a chat template in its tokenizer_config.json, one CPU worker, the gateway's HTTP
port). A second gateway with its own Redis and no scheduler shows the 429 (queue full)
and the 503 (Redis gone). Chat templates are compared with ``transformers`` without a
cluster; so are the request parser's refusals.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock
from urllib.parse import urlsplit

import grpc
import openai
import pytest
import redis as sync_redis
from cluster_fixtures import start_cluster, wait_for, worker_reports
from conftest import make_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st
from test_metrics import scrape
from test_tracing import serving_receiver

from pagefleet.client import Client
from pagefleet.common.chat_template import (
    TINY_CHAT_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    load_chat_template,
    read_chat_template,
)
from pagefleet.common.model_config import load_model_spec
from pagefleet.common.redis import Keys, OutEntry, RedisServer
from pagefleet.common.service import free_port
from pagefleet.gateway.openai_request import (
    BadParam,
    derived_seed,
    fan_out,
    parse_chat,
    parse_completion,
)

pytestmark = pytest.mark.timeout(240)

SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# A template in the style of the Hub's: bos_token, a system message taken out, roles that
# must alternate (raise_exception), a namespace, a {% generation %} block, tojson, eos_token.
CHAT_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(turns=0) %}
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}
    {% set loop_messages = messages[1:] %}
{% else %}
    {% set loop_messages = messages %}
{% endif %}
{% if system is defined %}<|system|>{{ system | trim }}<|end|>
{% endif %}
{% for message in loop_messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
    {% if message['role'] == 'assistant' %}
<|assistant|>{% generation %}{{ message['content'] }}{% endgeneration %}{{ eos_token }}
    {% else %}
<|user|>{% if message.name is defined %}{{ message.name | tojson }}: {% endif %}{{ message['content'] }}<|end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>{% endif %}"""
CONVERSATIONS = [
    [{"role": "user", "content": "hello world"}],
    [{"role": "system", "content": "  be brief  "}, {"role": "user", "content": "how are you today?"}],
    [{"role": "user", "content": "Bonjour à tous", "name": "José"}, {"role": "assistant", "content": "ça va"},
     {"role": "user", "content": "très bien"}],
]


def build_tokenizer(path: Path, added: tuple = ()) -> int:
    """A byte-level BPE tokenizer (BOS added like Llama's) trained here; its vocabulary size.
    ``added``: tokens added as text, not special (as Qwen's ``<think>``): strings, or
    ``tokenizers.AddedToken``s as they are."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, how are you today?",
              "Bonjour à tous, ça va très bien", "request 1: count to ten, then stop"] * 50
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([t if isinstance(t, AddedToken) else AddedToken(t, special=False, normalized=False) for t in added])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    return tok.get_vocab_size()


def write_tokenizer_config(path: Path, template: str | None = CHAT_TEMPLATE) -> None:
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True}, "unk_token": "<unk>", "model_max_length": 2048}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama-bpe")
    vocab_size = build_tokenizer(path)
    make_checkpoint(path, "llama", vocab_size=vocab_size, max_position_embeddings=2048)
    write_tokenizer_config(path)
    return path


@pytest.fixture(scope="module")
def hf_tokenizer(checkpoint):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(checkpoint)


# -- chat templates, as transformers renders them ----------------------------------------------
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_renders_and_tokenizes_as_transformers(checkpoint, hf_tokenizer, messages):
    template = read_chat_template(checkpoint)
    assert template.special_tokens["bos_token"] == "<s>" and template.special_tokens["eos_token"] == "</s>"
    want_text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want_ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                return_dict=False)
    assert template.render(messages) == want_text
    spec = load_model_spec(str(checkpoint))
    assert template.encode(spec.tokenizer, messages) == list(want_ids)
    assert want_ids[0] == 1 and want_ids[1] != 1  # the template's BOS, not a second one from the tokenizer


def test_chat_template_file_wins_and_refusals_are_errors(tmp_path, checkpoint):
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_bytes((checkpoint / name).read_bytes())
    write_tokenizer_config(tmp_path, template="ignored {{ messages }}")
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    template = load_chat_template(load_model_spec(str(tmp_path)))
    assert template.source == CHAT_TEMPLATE
    with pytest.raises(ChatTemplateError, match="must alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    write_tokenizer_config(tmp_path, template=None)
    (tmp_path / "chat_template.jinja").unlink()
    assert read_chat_template(tmp_path) is None


def test_template_variables_of_any_name_reach_the_template():
    """chat_template_kwargs named as the render's own arguments (``tokenizer``, ``self``) were a
    TypeError, a 500; they are the template's variables like any other."""
    template = ChatTemplate("{{ tokenizer }}|{{ messages[0].content }}")
    assert template.render([{"role": "user", "content": "hi"}], tokenizer="t", self=1) == "t|hi"
    spec = load_model_spec("tiny")
    assert template.encode(spec.tokenizer, [{"role": "user", "content": "hi"}], tokenizer="t", self=1) == \
        spec.tokenizer.encode("t|hi", add_special_tokens=False)


def test_tiny_has_a_builtin_template():
    spec = load_model_spec("tiny")
    template = load_chat_template(spec)
    assert template.source == TINY_CHAT_TEMPLATE
    text = template.render([{"role": "user", "content": "hi"}])
    assert text == "<|user|>\nhi\n<|assistant|>\n"
    assert template.encode(spec.tokenizer, [{"role": "user", "content": "hi"}]) == spec.tokenizer.encode(text)


# -- the request parser ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("parse", "body", "param", "code"),
    [
        (parse_completion, {"prompt": "x", "logit_bias": {"five": 1}}, "logit_bias", "invalid_value"),
        (parse_completion, {"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs", "unsupported_parameter"),
        (parse_completion, {"prompt": "x", "best_of": 3}, "best_of", "unsupported_parameter"),
        (parse_completion, {"prompt": "x", "suffix": "end"}, "suffix", "unsupported_parameter"),
        (parse_completion, {"prompt": "x", "frobnicate": 1}, "frobnicate", "unknown_parameter"),
        (parse_completion, {"prompt": "x", "max_completion_tokens": -4}, "max_completion_tokens",
         "invalid_value"),
        (parse_completion, {"prompt": "x", "logprobs": 6}, "logprobs", "invalid_value"),
        (parse_completion, {"prompt": "x", "n": 0}, "n", "invalid_value"),
        (parse_completion, {"prompt": ["a"] * 5, "n": 30}, "n", "invalid_value"),
        (parse_completion, {"prompt": [1, "a"]}, "prompt", "invalid_value"),
        (parse_completion, {"prompt": []}, "prompt", "invalid_value"),
        (parse_completion, {"prompt": "x", "seed": -(2**63) - 1}, "seed", "invalid_value"),
        (parse_completion, {"prompt": "x", "seed": 2**64}, "seed", "invalid_value"),
        (parse_completion, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options",
         "invalid_value"),
        (parse_completion, {"prompt": "x", "stream": True, "stream_options": {"x": 1}}, "stream_options.x",
         "unknown_parameter"),
        (parse_completion, {"prompt": "x", "temperature": "hot"}, "temperature", "invalid_value"),
        # JSON integers have no bound: one past float's range is refused by name, not a 500.
        (parse_completion, {"prompt": "x", "temperature": 10**400}, "temperature", "invalid_value"),
        (parse_chat, {"messages": [{"role": "user", "content": "x"}], "top_p": -(10**309)}, "top_p",
         "invalid_value"),
        (parse_completion, {"prompt": "x", "logit_bias": {"5": 10**400}}, "logit_bias.5", "invalid_value"),
        (parse_completion, {"prompt": "x", "bad_words": ["w"] * 65}, "bad_words", "invalid_value"),
        (parse_completion, {"prompt": "x", "stop": [1]}, "stop", "invalid_value"),
        (parse_chat, {"messages": []}, "messages", "invalid_value"),
        (parse_chat, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
        (parse_chat, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content[0]", "invalid_value"),
        (parse_chat, {"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "1"}]}]},
         "messages[0].tool_calls", "invalid_value"),
        (parse_chat, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]",
         "invalid_value"),
        (parse_chat, {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, "functions",
         "unsupported_parameter"),
        (parse_chat, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
         "response_format.type", "invalid_value"),
        (parse_chat, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
         "invalid_value"),
        (parse_chat, {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
         "top_logprobs", "invalid_value"),
        (parse_chat, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": -1}, "top_logprobs",
         "invalid_value"),
    ],
)
def test_parser_refuses_by_name(parse, body, param, code):
    with pytest.raises(BadParam) as info:
        parse(body)
    assert (info.value.param, info.value.code) == (param, code), info.value.message


def test_openais_fields_about_the_call_are_taken_and_ignored():
    """store, metadata, service_tier, prompt_cache_key, safety_identifier say what OpenAI keeps,
    bills or tags, not what is generated: taken whatever their value, as vLLM takes them (a
    review found 400s); a misspelt name is still refused by name."""
    extra = {"store": True, "metadata": {"k": "v"}, "service_tier": "auto", "prompt_cache_key": "p",
             "safety_identifier": "u1"}
    plain = parse_chat({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3})
    taken = parse_chat({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, **extra})
    assert taken.sampling == plain.sampling
    parse_completion({"prompt": "x", **extra})
    with pytest.raises(BadParam) as info:
        parse_chat({"messages": [{"role": "user", "content": "x"}], "stor": True})
    assert info.value.param == "stor"


def test_what_vllm_takes_of_max_tokens_and_top_logprobs_is_taken():
    """As vLLM: max_completion_tokens wins over max_tokens when both are sent (a review found a
    refusal), and top_logprobs 0 without logprobs asks for nothing."""
    both = parse_chat({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "max_completion_tokens": 2})
    assert (both.sampling.max_tokens, both.max_tokens_param) == (2, "max_completion_tokens")
    none = parse_chat({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 0})
    assert none.logprobs is None and not none.sampling.HasField("logprobs")
    some = parse_chat({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3, "logprobs": True})
    assert (some.logprobs, some.sampling.logprobs) == (3, 3)


def test_min_p_reaches_the_sampling_params_and_a_bad_one_is_refused_by_name():
    from pagefleet.common.sampling_proto import from_proto

    chat = parse_chat({"messages": [{"role": "user", "content": "x"}], "temperature": 0.6, "top_p": 0.95,
                       "top_k": 20, "min_p": 0})  # Qwen3's recommended settings, as clients send them
    assert chat.sampling.HasField("min_p") and from_proto(chat.sampling).min_p == 0.0
    # vLLM takes any int64 seed; a negative one is its two's complement here (the proto's uint64).
    assert parse_completion({"prompt": "x", "seed": -1}).sampling.seed == 2**64 - 1
    assert from_proto(parse_completion({"prompt": "x", "min_p": 0.05}).sampling).min_p == pytest.approx(0.05)
    assert not parse_completion({"prompt": "x", "min_p": None}).sampling.HasField("min_p")
    with pytest.raises(ValueError, match="min_p"):
        from_proto(parse_completion({"prompt": "x", "min_p": 1.5}).sampling).validate()


def test_vllms_reasoning_fields_and_a_previous_answer_sent_back_are_taken():
    """A client built for vLLM sends include_reasoning, an assistant turn's reasoning (its newer
    name too), and the previous answer's message object as it came (annotations null)."""
    history = [{"role": "user", "content": "x"},
               {"role": "assistant", "content": "y", "reasoning": "because", "annotations": None, "refusal": None},
               {"role": "assistant", "content": "z", "reasoning_content": "so", "annotations": []},
               {"role": "user", "content": "w"}]
    chat = parse_chat({"messages": history, "include_reasoning": False})
    assert chat.include_reasoning is False and parse_chat({"messages": history}).include_reasoning is True
    assert chat.messages[1] == {"role": "assistant", "content": "y", "reasoning_content": "because",
                                "reasoning": "because"}
    assert chat.messages[2]["reasoning_content"] == chat.messages[2]["reasoning"] == "so"
    with pytest.raises(BadParam) as info:
        parse_chat({"messages": [{"role": "user", "content": "x", "annotations": [{"type": "url_citation"}]}]})
    assert info.value.param == "messages[0].annotations"
    with pytest.raises(BadParam) as info:
        parse_chat({"messages": history, "include_reasoning": "no"})
    assert info.value.param == "include_reasoning"
    # disable_any_whitespace asks for what this server's JSON always is: taken, true or false.
    for value in (True, False):
        chat = parse_chat({"messages": history, "structured_outputs": {"json": {"type": "object"},
                                                                      "disable_any_whitespace": value}})
        assert chat.sampling.structured_outputs.json


def test_required_tool_choice_wins_over_response_format():
    """As vLLM: the tool call's schema is the constraint; response_format gives way to it."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": "required",
                       "response_format": {"type": "json_object"}})
    assert chat.structured_param == "tools" and json.loads(chat.sampling.structured_outputs.json)["type"] == "array"


def test_parser_accepts_nulls_off_values_and_fans_out():
    req = parse_completion({"model": "m", "prompt": ["a", "b"], "n": 3, "seed": 7, "echo": False, "best_of": 1,
                            "logit_bias": None, "suffix": None, "top_k": -1, "stop": "x", "user": "u"})
    assert (req.n, req.num_choices, req.sampling.top_k, list(req.sampling.stop)) == (3, 6, 0, ["x"])
    out = fan_out(req, "base")
    assert [r.request_id for r in out] == [f"base-{i}" for i in range(6)]
    assert [r.prompt for r in out] == ["a"] * 3 + ["b"] * 3
    seeds = [r.sampling.seed for r in out]
    assert seeds[:3] == [7, derived_seed(7, 1), derived_seed(7, 2)] and seeds[3:] == seeds[:3]
    assert len(set(seeds[:3])) == 3
    single = fan_out(parse_completion({"prompt": [[5, 6]]}), "one")
    assert [(r.request_id, list(r.prompt_token_ids.ids)) for r in single] == [("one", [5, 6])]
    chat = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                  {"type": "text", "text": "b"}]}],
                       "logprobs": True, "max_completion_tokens": 5, "tool_choice": "none"})
    assert chat.messages == [{"role": "user", "content": "a\nb"}]
    assert (chat.logprobs, chat.sampling.max_tokens, chat.max_tokens_param) == (0, 5, "max_completion_tokens")


def test_closing_relays_cancels_what_has_not_finished():
    """Closed before a message was read (the client went away first), or in the middle."""
    import asyncio

    from pagefleet.gateway.core import Queued, Relays
    from pagefleet.protos import generation_pb2 as pb

    class FakeCore:
        def __init__(self):
            self.cancelled = []

        def cancel_soon(self, request_id):
            self.cancelled.append(request_id)

        def leave(self, q):  # as GatewayCore.leave does while not shutting down
            self.cancel_soon(q.request_id)

        async def relay(self, q):
            try:
                yield pb.GenerateResponse(request_id=q.request_id, token_ids=[1])
                if q.request_id == "done":
                    yield pb.GenerateResponse(request_id=q.request_id, finish_reason=pb.FINISH_REASON_STOP)
                    return
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancel_soon(q.request_id)  # as GatewayCore.relay does
                raise

    async def main():
        core = FakeCore()
        await Relays(core, [Queued("a", 1, True), Queued("b", 1, True)]).aclose()
        assert sorted(core.cancelled) == ["a", "b"]
        core = FakeCore()
        relays = Relays(core, [Queued("done", 1, True), Queued("open", 1, True)])
        seen = [await relays.__anext__() for _ in range(3)]
        assert {(i, m.request_id) for i, m in seen} == {(0, "done"), (1, "open")}
        await relays.aclose()
        await relays.aclose()  # idempotent
        assert core.cancelled == ["open"]

    asyncio.run(main())


def test_a_streams_choices_keep_no_logprobs_once_sent():
    """A stream's log-probabilities go out in its chunks and are not kept (what a stream holds
    does not grow with its output); a whole response keeps them for its body, the same entries."""
    from pagefleet.common.tokenizer import ByteTokenizer
    from pagefleet.gateway.openai_request import parse_chat
    from pagefleet.gateway.openai_response import Choices, TokenPieces
    from pagefleet.protos import generation_pb2 as pb

    def msg(k):
        return pb.GenerateResponse(index=k, token_ids=[65 + k % 26], text=chr(65 + k % 26), logprobs=[
            pb.TokenLogprobs(logprob=-0.5, top_logprobs=[pb.TopLogprob(token_id=t, logprob=-1.0) for t in range(20)])])

    sent = {}
    for stream in (True, False):
        req = parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": stream,
                          "logprobs": True, "top_logprobs": 20, "max_tokens": 300})
        req.prompts = ["<the rendered chat>"]  # as the door sets it
        choices = Choices(req, "chatcmpl-1", "tiny", TokenPieces(ByteTokenizer()))
        chunks = [chunk for k in range(300) for chunk in choices.add(0, msg(k))]
        sent[stream] = [e for c in chunks for e in c["choices"][0]["logprobs"]["content"]]
        assert len(sent[stream]) == 300
        if stream:
            assert choices._choices[0].logprobs == []
        else:
            assert choices.body()["choices"][0]["logprobs"]["content"] == sent[stream]
    assert sent[True] == sent[False]


@settings(max_examples=60, deadline=None)
@given(chat=st.booleans(), usage=st.sampled_from([None, False, True]), n=st.integers(1, 3),
       texts=st.lists(st.text(max_size=6), min_size=1, max_size=8),
       reason=st.sampled_from([0, 1, 2, 3]), model=st.text(min_size=1, max_size=8))
def test_a_streams_events_are_its_chunks_as_sse(chat, usage, n, texts, reason, model):
    """``Choices.events`` writes the common message from a template: byte for byte the
    ``sse`` of ``add``'s chunks (text with quotes, backslashes, control and non-ASCII
    characters; chat and completions; with and without usage), and the same record kept."""
    from pagefleet.common.tokenizer import ByteTokenizer
    from pagefleet.gateway import openai_response
    from pagefleet.gateway.openai_request import parse_chat, parse_completion
    from pagefleet.gateway.openai_response import Choices, TokenPieces, sse
    from pagefleet.protos import generation_pb2 as pb

    body = {"model": "tiny", "stream": True, "max_tokens": 300, "n": n}
    if usage is not None:
        body["stream_options"] = {"include_usage": usage}
    if chat:
        req = parse_chat({**body, "messages": [{"role": "user", "content": "hi"}]})
        req.prompts = ["<the rendered chat>"]
    else:
        req = parse_completion({**body, "prompt": "hi"})
    with mock.patch.object(openai_response.time, "time", lambda: 1700000000.5):  # both created the same second
        twins = [Choices(req, 'cmpl-"1\\', model, TokenPieces(ByteTokenizer())) for _ in range(2)]
    finish = [pb.FINISH_REASON_UNSPECIFIED, pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_ABORT]
    for k, text in enumerate(texts):
        last = k == len(texts) - 1
        msg = pb.GenerateResponse(index=k, token_ids=[65] * len(text), text=text,
                                  finish_reason=finish[reason] if last else pb.FINISH_REASON_UNSPECIFIED)
        index = k % n
        expected = [sse(chunk) for chunk in twins[0].add(index, msg)]
        assert twins[1].events(index, msg) == expected
        for e in expected:
            json.loads(e.removeprefix(b"data: "))
    assert twins[1].body() == twins[0].body()
    assert [sse(c) for c in twins[1].closing()] == [sse(c) for c in twins[0].closing()]


def test_relays_pull_a_message_only_when_it_is_asked_for():
    """A caller that stops reading leaves the messages in the relays (whose own bound then keeps
    the backlog in Redis), never in a queue here: at most one message a request waits."""
    import asyncio

    from pagefleet.gateway.core import Queued, Relays
    from pagefleet.protos import generation_pb2 as pb

    class FakeCore:
        def __init__(self):
            self.pulled: dict[str, int] = {}

        def cancel_soon(self, request_id):
            pass

        def leave(self, q):
            pass

        async def relay(self, q):
            for k in range(1000):  # a request that always has a message ready
                self.pulled[q.request_id] = k + 1
                yield pb.GenerateResponse(request_id=q.request_id, index=k, token_ids=[k])
                await asyncio.sleep(0)

    async def main():
        for n in (1, 3):
            core = FakeCore()
            relays = Relays(core, [Queued(f"r{j}", 1, True) for j in range(n)])
            seen = [await relays.__anext__() for _ in range(5)]
            for _ in range(50):  # the caller reads nothing more while the loop runs on
                await asyncio.sleep(0)
            assert all(v <= 5 + 1 for v in core.pulled.values()), (n, core.pulled)
            assert sum(core.pulled.values()) <= 5 + n, (n, core.pulled)
            by_request = {}
            for i, m in seen:  # each request's messages in order
                by_request.setdefault(i, []).append(m.index)
            assert all(v == list(range(len(v))) for v in by_request.values())
            await relays.aclose()

    asyncio.run(main())


# -- a cluster ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def receiver():
    with serving_receiver(2) as rx:
        yield rx


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, checkpoint, receiver):
    log_dir = tmp_path_factory.mktemp("openai-cluster-logs")
    mp = pytest.MonkeyPatch()
    for k, v in {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
                 "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "200"}.items():
        mp.setenv(k, v)  # the cluster's processes inherit it
    for k in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME"):
        mp.delenv(k, raising=False)
    try:
        c = start_cluster(log_dir, num_workers=1, model=str(checkpoint), http_port=0, metrics_port=0,
                          worker_args=["--num-blocks", "256"], gateway_args=["--served-model-name", "llama-bpe"])
    finally:
        mp.undo()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


MODEL = "llama-bpe"
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def _raw(url: str, method: str, path: str, body: dict | None = None, headers: dict | None = None,
         timeout: float = 30) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A request on its own connection (the caller reads and closes it)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    data = None if body is None else json.dumps(body)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    return conn, conn.getresponse()


def _idle(cluster) -> bool:
    """No request holds blocks or a place on any worker."""
    return all(not r.request_ids and not r.blocks_per_request and r.num_running == 0
               for r in worker_reports(cluster).values())


def _last_out_entry(cluster, request_id: str) -> OutEntry | None:
    """The last message of the request's own record (its finish, once it finished)."""
    from pagefleet.common.fencing import entry_of
    from pagefleet.protos import cluster_pb2

    r = sync_redis.Redis.from_url(cluster.redis_url)
    try:
        record = r.hget(Keys(cluster.cfg.namespace).owner(request_id), "fin")
    finally:
        r.close()
    return entry_of(cluster_pb2.StepOutputs.FromString(record).outputs[-1]) if record else None


def test_models_health_and_version(cluster, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    for path, want in (("/health", b""), ("/version", None)):
        conn, resp = _raw(cluster.http_url, "GET", path)
        body = resp.read()
        conn.close()
        assert resp.status == 200, path
        if want is not None:
            assert body == want
        else:
            assert json.loads(body)["version"]


def test_ping_metrics_and_cors_on_the_api_port(cluster, client):
    """As vLLM serves them on its API port: ``/ping`` (GET and POST) as ``/health``, ``/metrics``
    (the gateway's, counting the requests just made), and CORS for browsers (every origin by
    default: a preflight answered 200, the origin echoed on the answer)."""
    client.completions.create(model=MODEL, prompt="x", max_tokens=1, **GREEDY)
    for method in ("GET", "POST"):
        conn, resp = _raw(cluster.http_url, method, "/ping")
        resp.read()
        conn.close()
        assert resp.status == 200, method
    conn, resp = _raw(cluster.http_url, "GET", "/metrics")
    text = resp.read().decode()
    conn.close()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/plain")
    assert 'pagefleet:gateway_http_requests_total{route="/v1/completions",status="200"}' in text
    conn, resp = _raw(cluster.http_url, "OPTIONS", "/v1/chat/completions",
                      headers={"Origin": "http://example.com", "Access-Control-Request-Method": "POST",
                               "Access-Control-Request-Headers": "authorization, content-type"})
    resp.read()
    conn.close()
    assert resp.status == 200 and resp.getheader("access-control-allow-origin") == "*"
    assert "POST" in resp.getheader("access-control-allow-methods")
    conn, resp = _raw(cluster.http_url, "GET", "/v1/models", headers={"Origin": "http://example.com"})
    resp.read()
    conn.close()
    assert resp.status == 200 and resp.getheader("access-control-allow-origin") == "*"


def test_cors_flags_are_json_lists_as_vllms():
    from pagefleet.gateway.server import build_parser

    args = build_parser().parse_args(["--allowed-origins", '["https://a.example"]', "--allow-credentials"])
    from pagefleet.gateway.http import cors_options

    assert cors_options(args) == {"allow_origins": ["https://a.example"], "allow_methods": ["*"],
                                  "allow_headers": ["*"], "allow_credentials": True}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--allowed-origins", "https://a.example"])


def test_greedy_completion_matches_grpc(cluster, client, checkpoint):
    prompt = "the quick brown fox"
    with Client(cluster.gateway_target) as g:
        want = g.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True, timeout=60)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, logprobs=0, **GREEDY)
    (choice,) = out.choices
    assert choice.text == want.text and choice.finish_reason == "length"
    tok = load_model_spec(str(checkpoint)).tokenizer
    assert choice.logprobs.tokens == [tok.decode([t]) for t in want.token_ids]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (want.prompt_tokens, 12)
    assert out.usage.total_tokens == want.prompt_tokens + 12
    # The prompt as token ids gives the same tokens too.
    by_ids = client.completions.create(model=MODEL, prompt=tok.encode(prompt), max_tokens=12, **GREEDY)
    assert by_ids.choices[0].text == want.text


def test_streaming_completion_ends_with_usage_and_done(cluster, client):
    chunks = list(client.completions.create(model=MODEL, prompt="hello world", max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert all(c.usage is None for c in body) and body[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in body)
    whole = client.completions.create(model=MODEL, prompt="hello world", max_tokens=10, **GREEDY)
    assert text == whole.choices[0].text
    # On the wire: server-sent events, the last one [DONE].
    conn, resp = _raw(cluster.http_url, "POST", "/v1/completions",
                      {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": True})
    raw = resp.read().decode()
    conn.close()
    assert resp.getheader("content-type").startswith("text/event-stream")
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_chat_uses_the_checkpoints_template(client, hf_tokenizer):
    messages = CONVERSATIONS[1]
    want_ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                return_dict=False)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8, **GREEDY)
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(want_ids) and out.usage.completion_tokens == 8
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    # The template's raise_exception refuses the messages.
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"},
                                                              {"role": "user", "content": "b"}])
    assert info.value.body["param"] == "messages" and "alternate" in info.value.body["message"]


def test_n_and_prompt_lists_fan_out(client):
    out = client.completions.create(model=MODEL, prompt=["hello", "the quick"], n=3, max_tokens=6,
                                    temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == list(range(6))
    texts = [c.text for c in out.choices]
    assert len(set(texts[:3])) > 1 and len(set(texts[3:])) > 1, texts  # seeds derived per choice
    assert out.usage.completion_tokens == 36
    again = client.completions.create(model=MODEL, prompt=["hello", "the quick"], n=3, max_tokens=6,
                                      temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == texts
    alone = client.completions.create(model=MODEL, prompt="the quick", max_tokens=6, temperature=1.0, seed=11,
                                      extra_body={"ignore_eos": True})
    assert alone.choices[0].text == texts[3]  # choice 0 of each prompt keeps the seed itself
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=4, stream=True, stream_options={"include_usage": True},
                                          temperature=1.0, extra_body={"ignore_eos": True})
    chunks = list(chat)
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert chunks[-1].usage.completion_tokens == 8


def test_logprobs_in_each_apis_shape(client):
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=5, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    # the 3 most likely and the chosen one, by text (pieces of one character may share "\ufffd")
    assert all(1 <= len(top) <= 4 and tok in top for top, tok in zip(lp.top_logprobs, lp.tokens, strict=True))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # greedy: the chosen token is the most likely one
    assert all(max(top.values()) == pytest.approx(v, abs=1e-5) for top, v in zip(lp.top_logprobs,
                                                                                  lp.token_logprobs, strict=True))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and isinstance(entry.bytes, list) and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           logprobs=True, **GREEDY)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    streamed = list(client.completions.create(model=MODEL, prompt="hello", max_tokens=5, logprobs=1, stream=True,
                                              **GREEDY))
    assert sum(len(c.choices[0].logprobs.tokens) for c in streamed) == 5


def test_penalties_and_vllm_extras_are_accepted(client):
    out = client.completions.create(
        model=MODEL, prompt="the quick brown fox", max_tokens=8, temperature=0.8, top_p=0.9, seed=3,
        presence_penalty=0.5, frequency_penalty=0.5, stop=["zzz"], user="tester",
        extra_body={"top_k": 20, "min_tokens": 8, "repetition_penalty": 1.2, "ignore_eos": False, "priority": 5,
                    "stop_token_ids": [2]},
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8  # min_tokens: no early EOS
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=4, presence_penalty=-1.0, frequency_penalty=1.5,
                                          extra_body={"repetition_penalty": 0.9, "min_tokens": 1})
    assert chat.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("endpoint", "kwargs", "param"),
    [
        ("completions", dict(prompt="x", temperature=-1), "temperature"),
        ("completions", dict(prompt="x", max_tokens=0), "max_tokens"),
        ("completions", dict(prompt="x", top_p=0), "top_p"),
        ("completions", dict(prompt="x", presence_penalty=3), "presence_penalty"),
        ("completions", dict(prompt="x", extra_body={"repetition_penalty": 0}), "repetition_penalty"),
        ("completions", dict(prompt="x", max_tokens=4, extra_body={"min_tokens": 5}), "min_tokens"),
        ("completions", dict(prompt=""), "prompt"),
        ("completions", dict(prompt=[[1, 2], [100_000]]), "prompt"),
        ("completions", dict(prompt="x " * 1100, max_tokens=1000), "prompt"),
        ("completions", dict(prompt="x", logit_bias={"5": 101.0}), "logit_bias"),
        ("completions", dict(prompt="x", extra_body={"prompt_logprobs": 1}), "prompt_logprobs"),
        ("completions", dict(prompt="x", extra_body={"guided_json": {"type": "nope"}}), "guided_json"),
        ("completions", dict(prompt="x", extra_body={"guided_regex": ""}), "guided_regex"),
        ("completions", dict(prompt="x", extra_body={"min_p": 1.5}), "min_p"),
        ("completions", dict(prompt="x", temperature=10**400), "temperature"),
        ("chat", dict(messages=[{"role": "user", "content": "x"}], max_completion_tokens=0), "max_completion_tokens"),
        ("chat", dict(messages=[{"role": "user", "content": "x"}], tools=[{"type": "function", "function": {
            "name": "f", "parameters": {}}}]), "tool_choice"),  # auto needs --tool-call-parser
        ("chat", dict(messages=[{"role": "user", "content": "x"}], response_format={"type": "json_schema"}),
         "response_format.json_schema"),
    ],
)
def test_bad_requests_are_400_naming_the_parameter(client, endpoint, kwargs, param):
    create = client.completions.create if endpoint == "completions" else client.chat.completions.create
    with pytest.raises(openai.BadRequestError) as info:
        create(model=MODEL, **kwargs)
    err = info.value
    assert err.status_code == 400 and err.body["param"] == param, err.body
    assert err.body["type"] == "invalid_request_error" and err.body["message"]
    if param == "max_completion_tokens":  # the message names the parameter sent, not the one it maps to
        assert err.body["message"].startswith("max_completion_tokens"), err.body


def test_unknown_model_is_404_and_bad_json_is_400(cluster, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="x")
    assert info.value.body["param"] == "model" and info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as info:  # a huge name is cut short (it was echoed whole)
        client.completions.create(model="x" * 100_000, prompt="x")
    assert len(info.value.body["message"]) < 400
    u = urlsplit(cluster.http_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    conn.request("POST", "/v1/completions", body=b"{not json", headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    body = json.loads(resp.read())
    conn.close()
    assert resp.status == 400 and set(body["error"]) == {"message", "type", "param", "code"}


def test_x_request_id_is_the_idempotency_key(cluster, client):
    kwargs = dict(model=MODEL, prompt="hello", max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True},
                  extra_headers={"X-Request-Id": "http-idem-1"})
    first = client.completions.with_raw_response.create(**kwargs)
    second = client.completions.create(**kwargs)  # unseeded: only the same request gives the same text
    assert first.headers["x-request-id"] == "http-idem-1"
    assert first.parse().choices[0].text == second.choices[0].text
    assert first.parse().id == "cmpl-http-idem-1"  # as vLLM names it
    # gRPC sees the same request under that id
    with Client(cluster.gateway_target) as g:
        again = g.generate("hello", max_tokens=6, temperature=1.0, ignore_eos=True, request_id="http-idem-1",
                           timeout=30)
        assert again.text == second.choices[0].text
        # the id with another request: refused by name over gRPC, never another request's answer
        with pytest.raises(grpc.RpcError) as info:
            g.generate("hello", max_tokens=5, request_id="http-idem-1", timeout=30)
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS and "http-idem-1" in info.value.details()
    # Over HTTP one X-Request-Id may come with several requests (a mesh forwards its own on each
    # of one call's requests): each is its own, and each one's retry finds it again.
    other = dict(kwargs, prompt="a different prompt", max_tokens=7)
    third = client.completions.with_raw_response.create(**other)
    assert third.headers["x-request-id"] == "http-idem-1"
    third = third.parse()
    assert third.usage.completion_tokens == 7 and third.id != first.parse().id
    assert client.completions.create(**other).choices[0].text == third.choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == second.choices[0].text
    # the first one's claim gone (its TTL after its finish), the second's retry still finds its own
    r = sync_redis.Redis.from_url(cluster.redis_url)
    try:
        assert r.delete(Keys(cluster.cfg.namespace).idempotency("http-idem-1")) == 1
    finally:
        r.close()
    again = client.completions.create(**other)
    assert (again.id, again.choices[0].text) == (third.id, third.choices[0].text)
    # Any header is an id (vLLM takes any: braces, '/', '=', long ones), its retries the same request.
    for odd in ("{bad id!}", "a/b+c==", "L" * 300):
        once = client.completions.with_raw_response.create(**dict(kwargs, extra_headers={"X-Request-Id": odd}))
        assert once.headers["x-request-id"] == odd
        assert client.completions.create(**dict(kwargs, extra_headers={"X-Request-Id": odd})).choices[0].text \
            == once.parse().choices[0].text
    # The longest id a client may give, with choices: each choice's id is longer (-<i> after it).
    long_id = "L" * 128
    got = client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=2, extra_headers={"X-Request-Id": long_id})
    assert len(got.choices) == 2


def _wrote_tokens(cluster, request_id: str) -> bool:
    """Whether the request's worker has written tokens of it (its steps stream, latest entries)."""
    from pagefleet.common.fencing import outputs_of

    keys = Keys(cluster.cfg.namespace)
    r = sync_redis.Redis.from_url(cluster.redis_url)
    try:
        worker = r.hget(keys.owner(request_id), "worker")
        steps = r.get(keys.steps_of(worker.decode())) if worker else None
        entries = r.xrevrange(steps, count=64) if steps else []
    finally:
        r.close()
    return any(o.request_id == request_id and o.token_ids for _, f in entries for o in outputs_of(f))


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_cancels_the_request_and_frees_its_blocks(cluster, stream):
    rid = f"http-gone-{int(stream)}"
    conn, resp = None, None
    try:
        u = urlsplit(cluster.http_url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json", "X-Request-Id": rid},
                     body=json.dumps({"model": MODEL, "prompt": "count to ten", "max_tokens": 1900,
                                      "temperature": 0, "ignore_eos": True, "stream": stream}))
        if stream:
            resp = conn.getresponse()
            assert resp.status == 200 and resp.readline().startswith(b"data: ")
        wait_for(lambda: _wrote_tokens(cluster, rid), 30, "the request's first tokens")
    finally:
        conn.close()  # the client goes away mid-generation
    wait_for(lambda: _idle(cluster), 20, "blocks freed after the disconnect")
    last = wait_for(lambda: _last_out_entry(cluster, rid), 10, "the request's last output")
    assert last.finish_reason == "abort" and last.index < 1900


def test_http_requests_are_counted(cluster, client):
    url = cluster.metrics_url("gateway")
    before = scrape(url)
    client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-2)

    def grew(name, labels):
        return scrape(url).get((name, labels), 0) - before.get((name, labels), 0)

    route = ("route", "/v1/completions")
    wait_for(lambda: grew("pagefleet:gateway_http_requests_total", (route, ("status", "400"))) == 1, 5, "a 400")
    assert grew("pagefleet:gateway_http_requests_total", (route, ("status", "200"))) == 1
    assert grew("pagefleet:gateway_requests_total", (("code", "OK"),)) == 1
    assert grew("pagefleet:gateway_requests_total", (("code", "INVALID_ARGUMENT"),)) == 1


def test_a_request_is_one_trace_from_the_http_span(cluster, client, receiver):
    trace_id, parent = "5bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    out = client.completions.create(model=MODEL, prompt="trace me", n=2, max_tokens=3, **GREEDY,
                                    extra_headers={"traceparent": f"00-{trace_id}-{parent}-01",
                                                   "X-Request-Id": "http-traced"})
    assert len(out.choices) == 2

    def spans():
        found = [s for _, s in receiver.snapshot() if s.trace_id.hex() == trace_id]
        names = [s.name for s in found]
        done = names.count("POST /v1/completions") == 1 and names.count("worker.request") == 2
        return found if done else None

    found = wait_for(spans, 30, "the request's spans from gateway and worker")
    (server,) = [s for s in found if s.name == "POST /v1/completions"]
    assert server.kind == server.SPAN_KIND_SERVER and server.parent_span_id.hex() == parent
    attrs = {kv.key: kv.value for kv in server.attributes}
    assert attrs["http.response.status_code"].int_value == 200
    assert attrs["gen_ai.request.model"].string_value == MODEL
    assert attrs["gen_ai.usage.output_tokens"].int_value == 6
    assert attrs["pagefleet.request_id"].string_value == "http-traced"
    sends = [s for s in found if s.name == "send pf:{s0}:requests"]
    assert len(sends) == 2 and all(s.parent_span_id == server.span_id for s in sends)


# -- shed and unreachable: a gateway of its own ------------------------------------------------
@pytest.fixture
def lonely_gateway(tmp_path):
    """A gateway (HTTP, --max-queue 1) on its own Redis, with no scheduler: requests only wait."""
    redis = RedisServer().start()
    port, http_port = free_port(), free_port()
    log = open(tmp_path / "gateway.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagefleet", "gateway", "--host", "127.0.0.1", "--port", str(port),
         "--http-port", str(http_port), "--redis-url", redis.url, "--max-queue", "1", "--retry-after", "2"],
        stdout=log, stderr=log, start_new_session=True,
    )
    url = f"http://127.0.0.1:{http_port}"

    def healthy():
        assert proc.poll() is None, (tmp_path / "gateway.log").read_text()
        with contextlib.suppress(OSError):
            conn, resp = _raw(url, "GET", "/health", timeout=2)
            conn.close()
            return resp.status == 200
        return False

    try:
        wait_for(healthy, 60, "the gateway's HTTP port", every_s=0.2)
        yield url, redis
    finally:
        proc.kill()
        proc.wait(10)
        log.close()
        redis.stop()


def test_full_queue_is_429_with_retry_after_and_dead_redis_is_503(lonely_gateway):
    url, redis = lonely_gateway
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
    conn, resp = _raw(url, "POST", "/v1/completions", {"prompt": "waits", "max_tokens": 2, "stream": True},
                      headers={"X-Request-Id": "waiting-1"})
    try:
        assert resp.status == 200  # queued (nobody will place it)
        with pytest.raises(openai.RateLimitError) as info:
            c.completions.create(model="tiny", prompt="one too many", max_tokens=2)
        assert info.value.status_code == 429 and info.value.response.headers["retry-after"] == "2"
        assert info.value.body["code"] == "queue_full"
    finally:
        conn.close()  # gone while its request waits in the queue: the gateway queues a cancel for it

    def cancelled():
        r = sync_redis.Redis.from_url(redis.url)
        try:
            entries = r.xrange(Keys("pf").requests)
        finally:
            r.close()
        return [f for _, f in entries if f.get(b"kind") == b"cancel" and f.get(b"rid") == b"waiting-1"]

    wait_for(cancelled, 10, "the cancel entry of the abandoned request")
    redis.stop()
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as info:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert info.value.status_code == 503 and info.value.body["code"] == "queue_unavailable"
    assert time.monotonic() - started < 15
    conn, resp = _raw(url, "GET", "/health")
    conn.close()
    assert resp.status == 503


# vLLM's own request fields at the values its clients send when they mean nothing: taken.
VLLM_DEFAULTS = {"use_beam_search": False, "length_penalty": 1.0, "documents": None, "chat_template": None,
                 "mm_processor_kwargs": None, "kv_transfer_params": None, "return_tokens_as_token_ids": False,
                 "return_token_ids": False, "cache_salt": None, "logits_processors": None, "vllm_xargs": None,
                 "request_id": "abc"}


@pytest.mark.parametrize("name", sorted(VLLM_DEFAULTS))
def test_vllms_own_fields_at_their_defaults_are_taken(name):
    parse_chat({"messages": [{"role": "user", "content": "x"}], name: VLLM_DEFAULTS[name]})
    if name not in ("documents", "chat_template", "mm_processor_kwargs"):  # chat's alone
        parse_completion({"prompt": "x", name: VLLM_DEFAULTS[name]})


@pytest.mark.parametrize(("name", "value"), [("use_beam_search", True), ("length_penalty", 0.5),
                                             ("chat_template", "{{ messages }}"), ("cache_salt", "s"),
                                             ("return_token_ids", True)])
def test_vllms_own_fields_set_are_refused_by_name(name, value):
    with pytest.raises(BadParam) as info:
        parse_chat({"messages": [{"role": "user", "content": "x"}], name: value})
    assert (info.value.param, info.value.code) == (name, "unsupported_parameter")


def test_an_integral_float_is_an_integer_as_vllm_reads_it():
    assert parse_completion({"prompt": "x", "max_tokens": 2.0, "n": 1.0}).sampling.max_tokens == 2
    with pytest.raises(BadParam) as info:
        parse_completion({"prompt": "x", "max_tokens": 2.5})
    assert info.value.param == "max_tokens"


def test_text_offsets_move_by_what_a_token_adds_to_the_text_not_its_name():
    """A special token's logprob entry is its name (``</s>``); its text offset moves by the
    nothing it adds to the text (a review found offsets of [0, 2, 2, 2] for "abc")."""
    from pagefleet.common.tokenizer import ByteTokenizer
    from pagefleet.gateway.openai_response import Choices, TokenPieces
    from pagefleet.protos import generation_pb2 as pb

    req = parse_completion({"prompt": "x", "logprobs": 0, "max_tokens": 4, "ignore_eos": True})
    choices = Choices(req, "cmpl-1", "m", TokenPieces(ByteTokenizer()))
    for msg in (pb.GenerateResponse(request_id="r", index=0, token_ids=[ByteTokenizer.EOS, 97, 98], text="ab"),
                pb.GenerateResponse(request_id="r", index=3, token_ids=[99], text="c",
                                    finish_reason=pb.FINISH_REASON_LENGTH)):
        for _ in msg.token_ids:
            msg.logprobs.add().logprob = -0.1
        choices.add(0, msg)
    lp = choices.body()["choices"][0]["logprobs"]
    assert (lp["tokens"], lp["text_offset"]) == (["</s>", "a", "b", "c"], [0, 0, 1, 2])


def test_text_offsets_go_on_past_a_character_whose_bytes_were_held_back():
    """A byte the detokenizer holds back (the start of a character not yet whole) sends no text
    with its message; the next token's offset still counts it, as vLLM sums its tokens' strings
    (a review found [0, 1, 1] for "w\ufffd1": the third token restarted at the text sent so far)."""
    from pagefleet.common.tokenizer import ByteTokenizer
    from pagefleet.gateway.openai_response import Choices, TokenPieces
    from pagefleet.protos import generation_pb2 as pb

    for stream in (False, True):
        req = parse_completion({"prompt": "x", "logprobs": 0, "max_tokens": 3, "stream": stream})
        choices = Choices(req, "cmpl-1", "m", TokenPieces(ByteTokenizer()))
        offsets = []
        for i, (token, text) in enumerate(((119, "w"), (0xC3, ""), (49, "\ufffd1"))):
            msg = pb.GenerateResponse(request_id="r", index=i, token_ids=[token], text=text)
            msg.logprobs.add().logprob = -0.5
            if i == 2:
                msg.finish_reason = pb.FINISH_REASON_LENGTH
            for chunk in choices.add(0, msg):
                offsets += chunk["choices"][0]["logprobs"]["text_offset"]
        assert offsets == [0, 1, 2], stream
        if not stream:
            assert choices.body()["choices"][0]["logprobs"]["text_offset"] == [0, 1, 2]


def test_allowed_token_ids_are_bounded_before_each_is_checked():
    """1.5 million allowed ids were taken, each checked, and held the gateway's loop ~0.5 s."""
    from pagefleet.gateway.validate import BadField, check
    from pagefleet.protos import generation_pb2 as pb

    with pytest.raises(BadParam) as info:
        parse_completion({"prompt": "x", "allowed_token_ids": [1] * 300_000})
    assert info.value.param == "allowed_token_ids" and "at most" in info.value.message
    spec = load_model_spec("tiny")
    req = pb.GenerateRequest(request_id="r", prompt="hi", sampling=pb.SamplingParams(allowed_token_ids=[1] * 300_000))
    with pytest.raises(BadField) as bad:
        check(req, spec, 2048)
    assert "allowed_token_ids" in str(bad.value) and "at most 262144" in str(bad.value)
    # Ids may repeat (as vLLM takes them): more than the vocabulary of them is no error.
    check(pb.GenerateRequest(request_id="r", prompt="hi", sampling=pb.SamplingParams(allowed_token_ids=[1] * 300)),
          spec, 2048)


def test_masks_that_leave_no_token_to_draw_are_refused_by_name():
    """allowed_token_ids whose every id is a one-token bad word, or whose ids left are all held
    back by min_tokens, leave nothing to draw: a review saw a forbidden token (id 0) sent with
    NaN log-probabilities. Refused at the door, naming the field; a mask that leaves one id runs."""
    from pagefleet.gateway.validate import BadField, check
    from pagefleet.protos import generation_pb2 as pb

    spec = load_model_spec("tiny")
    eos = spec.config.eos_token_ids[0]

    def sampling(allowed, words, **kw):
        s = pb.SamplingParams(max_tokens=3, allowed_token_ids=allowed, **kw)
        for w in words:
            s.bad_words_token_ids.add(ids=w)
        return s

    for s, field in ((sampling([65], [[65]]), "sampling.bad_words_token_ids"),
                     (sampling([65, 66], [[66], [65]]), "sampling.bad_words_token_ids"),
                     (sampling([65, 66], [[66]], stop_token_ids=[65], min_tokens=2), "sampling.allowed_token_ids"),
                     (sampling([65, eos], [[65]], min_tokens=1), "sampling.allowed_token_ids")):
        with pytest.raises(BadField) as bad:
            check(pb.GenerateRequest(request_id="r", prompt="hi", sampling=s), spec, 2048)
        assert bad.value.field == field and "allow another token" in bad.value.reason, bad.value
    check(pb.GenerateRequest(request_id="r", prompt="hi", sampling=sampling([65, 66], [[66], [65, 65]])), spec, 2048)
    check(pb.GenerateRequest(request_id="r", prompt="hi", sampling=sampling([65, 66], [[66]], stop_token_ids=[65])),
          spec, 2048)


def test_an_empty_structured_outputs_is_not_passed_on_as_set():
    """Taken as none, and cleared before it is queued: a worker of the version before (which
    refused an empty one) runs the request too, in a rolling upgrade."""
    from pagefleet.gateway.validate import check
    from pagefleet.protos import generation_pb2 as pb

    req = pb.GenerateRequest(request_id="r", prompt="hi", sampling=pb.SamplingParams(
        structured_outputs=pb.StructuredOutputs()))
    assert req.sampling.HasField("structured_outputs")
    check(req, load_model_spec("tiny"), 2048)
    assert not req.sampling.HasField("structured_outputs")
