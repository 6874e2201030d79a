"""Structured output through the official SDKs, on the in-process app serving a tiny random model (whose output
is valid only when the grammar makes it so): response formats, strict tools and tool choices answer valid JSON in
the OpenAI, Anthropic and Responses APIs; a schema the grammar library cannot use is a 400 in the API's shape."""
import json

import anthropic
import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from engine import Engine, EngineConfig

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
BAD = {"type": "object", "properties": {"z": {"type": "string", "format": "postcode"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}]
AN_TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
CHAT = [{"role": "user", "content": "Weather in Paris?"}]
# no thinking: a random model would reason until max_tokens before the constrained part
PLAIN = {"temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def client():
    from engine.server.app import create_app
    from engine.server.bridge import ServerSettings

    eng = Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", max_context=1024))
    with TestClient(create_app(ServerSettings(model_id="m"), lambda: eng, load_in_background=False)) as tc:
        yield tc


def oa(tc) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)


def an(tc) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=tc, max_retries=0)


def check_call(name: str, arguments: dict) -> None:
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
    jsonschema.validate(arguments, schema)


def test_openai_response_format_json_schema_streamed_and_not(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    r = oa(client).chat.completions.create(model="m", messages=CHAT, max_tokens=60, response_format=fmt,
                                           extra_body=PLAIN)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)
    chunks = oa(client).chat.completions.create(model="m", messages=CHAT, max_tokens=60, response_format=fmt,
                                                extra_body=PLAIN, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_openai_tool_choice_forces_calls_with_valid_arguments(client, choice):
    r = oa(client).chat.completions.create(model="m", messages=CHAT, max_tokens=150, tools=TOOLS,
                                           tool_choice=choice, extra_body=PLAIN)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        check_call(call.function.name, json.loads(call.function.arguments))
    if isinstance(choice, dict):
        assert [c.function.name for c in calls] == ["get_weather"]


def test_openai_tool_choice_none_leaves_the_tools_out(client):
    c = oa(client)
    none = c.chat.completions.create(model="m", messages=CHAT, max_tokens=1, tools=TOOLS, tool_choice="none",
                                     extra_body=PLAIN)
    auto = c.chat.completions.create(model="m", messages=CHAT, max_tokens=1, tools=TOOLS, extra_body=PLAIN)
    assert none.usage.prompt_tokens < auto.usage.prompt_tokens and not none.choices[0].message.tool_calls


def test_anthropic_tool_choice_any_and_tool(client):
    a = an(client)
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_time"}):
        m = a.messages.create(model="m", max_tokens=150, messages=CHAT, tools=AN_TOOLS, tool_choice=choice,
                              thinking={"type": "disabled"}, extra_body={"temperature": 0})
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and uses
        for block in uses:
            check_call(block.name, block.input)
        if choice["type"] == "tool":
            assert [b.name for b in uses] == ["get_time"]
    m = a.messages.create(model="m", max_tokens=2, messages=CHAT, tools=AN_TOOLS, tool_choice={"type": "none"},
                          thinking={"type": "disabled"})
    assert all(b.type != "tool_use" for b in m.content)


def test_responses_text_format_and_tool_choice(client):
    c = oa(client)
    r = c.responses.create(model="m", input="Weather in Paris?", max_output_tokens=60, extra_body=PLAIN,
                           text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), WEATHER)
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]
    r = c.responses.create(model="m", input="Weather in Paris?", max_output_tokens=150, tools=tools,
                           tool_choice="required", extra_body=PLAIN)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_a_schema_the_library_cannot_use_is_a_400_in_each_apis_shape(client):
    c = oa(client)
    fmt = {"type": "json_schema", "json_schema": {"name": "bad", "schema": BAD, "strict": True}}
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="m", messages=CHAT, max_tokens=5, response_format=fmt)
    err = info.value.body
    assert err["param"] == "response_format" and "Unknown format: postcode" in err["message"]
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": BAD, "strict": True}}]
    with pytest.raises(openai.BadRequestError, match="Unknown format"):
        c.chat.completions.create(model="m", messages=CHAT, max_tokens=5, tools=bad_tool, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="Unknown format"):
        c.responses.create(model="m", input="hi", max_output_tokens=5,
                           text={"format": {"type": "json_schema", "name": "b", "schema": BAD, "strict": True}})
    with pytest.raises(anthropic.BadRequestError) as info:
        an(client).messages.create(model="m", max_tokens=5, messages=CHAT, tool_choice={"type": "any"},
                                   tools=[{"name": "f", "input_schema": BAD, "strict": True}])
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "Unknown format" in info.value.body["error"]["message"]
    # not strict: keywords the library lacks are ignored
    fmt["json_schema"]["strict"] = False
    r = c.chat.completions.create(model="m", messages=CHAT, max_tokens=2, response_format=fmt, extra_body=PLAIN)
    assert r.choices[0].finish_reason in ("stop", "length")
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": CHAT,
                                                  "response_format": {"type": "xml"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
