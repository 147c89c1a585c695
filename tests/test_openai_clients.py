"""Real clients of OpenAI-compatible servers, unmodified, against the door: LangChain's
``ChatOpenAI`` (structured output with a Pydantic model, bound tools, the Responses API) and
LiteLLM's ``openai/`` provider. They share test_openai_vllm.py's cluster (one per module)."""

from __future__ import annotations

import json
import os
from typing import Literal

import pytest
from pydantic import BaseModel, Field
from test_openai_vllm import MODEL, WEATHER, checkpoint, cluster  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(240)


class Person(BaseModel):
    name: str = Field(max_length=5)
    age: int = Field(ge=0, le=99)


class GetWeather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=5)
    unit: Literal["c", "f"]


@pytest.fixture(scope="module")
def chat(cluster):  # noqa: F811
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=cluster.http_url + "/v1", api_key="unused", max_tokens=200,
                      temperature=0, max_retries=0, timeout=60)


def test_langchain_structured_output_with_a_pydantic_model(chat):
    structured = chat.with_structured_output(Person)  # OpenAI's json_schema, strict
    people = [structured.invoke("Describe a person."), structured.bind(seed=4).invoke("Another one.")]
    assert all(isinstance(p, Person) for p in people)
    via_tool = chat.with_structured_output(Person, method="function_calling", include_raw=True).invoke("A person.")
    assert isinstance(via_tool["parsed"], Person) and via_tool["raw"].tool_calls[0]["name"] == "Person"


def test_langchain_bind_tools(chat):
    import jsonschema

    for choice in ("GetWeather", "any"):
        msg = chat.bind_tools([GetWeather], tool_choice=choice, strict=True).invoke("What's the weather in Paris?")
        assert len(msg.tool_calls) == 1, (msg, msg.response_metadata, msg.invalid_tool_calls)
        (call,) = msg.tool_calls
        assert call["name"] == "GetWeather" and call["id"]
        jsonschema.validate(call["args"], GetWeather.model_json_schema())
    streamed = None
    for piece in chat.bind_tools([GetWeather], tool_choice="GetWeather", strict=True).stream("Weather in Oslo?"):
        streamed = piece if streamed is None else streamed + piece
    assert [c["name"] for c in streamed.tool_calls] == ["GetWeather"]
    GetWeather(**streamed.tool_calls[0]["args"])


def test_langchain_on_the_responses_api(cluster):  # noqa: F811
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=cluster.http_url + "/v1", api_key="unused", max_tokens=8, temperature=0,
                     use_responses_api=True, max_retries=0, timeout=60)
    msg = llm.invoke("hello world")
    assert msg.text and msg.response_metadata.get("status") in ("completed", "incomplete")
    pieces = list(llm.stream("hello world"))
    assert "".join(p.text for p in pieces) == msg.text
    roomy = ChatOpenAI(model=MODEL, base_url=cluster.http_url + "/v1", api_key="unused", max_tokens=200,
                       temperature=0, use_responses_api=True, max_retries=0, timeout=60)
    person = roomy.with_structured_output(Person).invoke("Describe a person.")
    assert isinstance(person, Person)


def test_litellm_openai_provider(cluster):  # noqa: F811
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from outside
    import litellm

    base = dict(model=f"openai/{MODEL}", api_base=cluster.http_url + "/v1", api_key="unused", max_tokens=6,
                temperature=0, messages=[{"role": "user", "content": "hello world"}], ignore_eos=True)
    out = litellm.completion(**base)
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in litellm.completion(stream=True, **base))
    assert text == out.choices[0].message.content
    forced = litellm.completion(**{**base, "max_tokens": 60}, tools=[WEATHER],
                                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    args = json.loads(forced.choices[0].message.tool_calls[0].function.arguments)
    assert set(args) == {"city", "unit"}
    # a context overflow is told as OpenAI's and vLLM's servers tell it: LiteLLM's context-window
    # fallbacks key on it (a plain BadRequestError before)
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(**{**base, "max_tokens": 4000})
