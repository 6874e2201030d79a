"""Reasoning and tool-call parsing, whole and streamed in every split, plus the wire shapes through the SDKs."""
import json

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from engine.runtime.request import FinishEvent, Timings, TokenEvent
from engine.tokenizer.output_parser import OutputParser, parse_all

XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>")
CASES = [
    # (text, in_reasoning, reasoning, visible text, [(name, args)])
    ("Hello world", False, "", "Hello world", []),
    ("<think>plan it</think>\n\nThe answer.", False, "plan it", "The answer.", []),
    ("still thinking</think>Done.", True, "still thinking", "Done.", []),
    ("Let me check.\n" + XML_CALL, False, "", "Let me check.", [("get_weather", {"city": "Paris", "days": 3})]),
    ('<tool_call>{"name": "f", "arguments": {"a": [1, 2]}}</tool_call>\n<tool_call>{"name": "g", "arguments": '
     '"{\\"b\\": true}"}</tool_call>', False, "", "", [("f", {"a": [1, 2]}), ("g", {"b": True})]),
    # a call inside an unclosed <think> ends the reasoning and is still a call
    ("hmm <tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>", True, "hmm ", "", [("f", {})]),
    # one malformed call does not drop the next
    ("<tool_call>{oops}</tool_call>" + XML_CALL, False, "", "<tool_call>{oops}</tool_call>",
     [("get_weather", {"city": "Paris", "days": 3})]),
    # truncated arguments come back as text, never as a call
    ("<tool_call>\n<function=f>\n<parameter=x>\n1", False, "", "<tool_call>\n<function=f>\n<parameter=x>\n1", []),
    ("a < b, <tool and <think are text", False, "", "a < b, <tool and <think are text", []),
]


def _run(text: str, in_reasoning: bool, split) -> tuple[str, str, list]:
    p = OutputParser(in_reasoning)
    pieces = []
    for part in split(text):
        pieces += p.feed(part)
    pieces += p.finish()
    return ("".join(x.text for x in pieces if x.kind == "reasoning"),
            "".join(x.text for x in pieces if x.kind == "text"),
            [(x.call.name, x.call.arguments) for x in pieces if x.kind == "tool_call"])


@pytest.mark.parametrize("text,in_reasoning,reasoning,visible,calls", CASES)
def test_parser_whole_and_streamed(text, in_reasoning, reasoning, visible, calls):
    r, t, c = parse_all(text, in_reasoning)
    assert (r, t, [(x.name, x.arguments) for x in c]) == (reasoning, visible, calls)
    for size in (1, 2, 3, 7):
        split = lambda s, n=size: [s[i:i + n] for i in range(0, len(s), n)]  # noqa: E731
        assert _run(text, in_reasoning, split) == (reasoning, visible, calls)


def test_without_tools_calls_are_text():
    r, t, c = parse_all(XML_CALL, tools=False)
    assert not c and t == XML_CALL


# ---- the wire: scripted model output through the real app and the official SDKs ---------------------------

class _Tok:
    def encode(self, text, add_special=False):
        return list(range(len(text.split())))


class _Stream:
    def __init__(self, pieces):
        self.pieces = pieces

    def __iter__(self):
        for p in self.pieces:
            yield TokenEvent(1, p)
        yield FinishEvent("stop", 5, len(self.pieces), [1] * len(self.pieces), "".join(self.pieces),
                          Timings(0.01, 0.01, 5, len(self.pieces)))

    def cancel(self):
        pass


class ScriptedEngine:
    """Answers every request with a fixed completion, in small pieces (the parser sees tags split)."""

    max_context = 4096
    tokenizer = _Tok()

    def __init__(self, text: str) -> None:
        self.pieces = [text[i:i + 3] for i in range(0, len(text), 3)]

    def render_chat(self, messages, tools=None, add_generation_prompt=True, **kw):
        return json.dumps(messages) + json.dumps(tools)

    def check_fits(self, n, m):
        pass

    def encode_rendered(self, text, media=()):
        return self.tokenizer.encode(text, add_special=True)

    def prompt_tokens(self, ids, images):
        return len(ids)

    def submit(self, ids, params):
        return _Stream(self.pieces)

    def submit_choices(self, ids, params, n, images=(), embeds=None):
        return [self.submit(ids, params) for _ in range(n)]

    def stats(self):
        return {"running": 0, "pending": 0, "held_sequences": 0, "kv_tokens_in_use": 0, "kv_tokens_free": 0,
                "batched_steps": 0}


def scripted_client(text: str) -> TestClient:
    from engine.server.app import create_app
    from engine.server.bridge import ServerSettings

    return TestClient(create_app(ServerSettings(model_id="m"), lambda: ScriptedEngine(text), load_in_background=False))


TOOLS_OA = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
TOOLS_AN = [{"name": "get_weather", "input_schema": {"type": "object"}}]
ANSWER = "<think>need weather</think>\n\nChecking.\n" + XML_CALL


def test_openai_wire_tool_calls_and_reasoning():
    with scripted_client(ANSWER) as tc:
        c = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)
        msgs = [{"role": "user", "content": "weather?"}]
        r = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS_OA)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
        assert choice.message.reasoning_content == "need weather"
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris",
                                                                                              "days": 3}
        chunks = list(c.chat.completions.create(model="m", messages=msgs, tools=TOOLS_OA, stream=True))
        deltas = [ch.choices[0].delta for ch in chunks]
        assert "".join(d.content or "" for d in deltas) == "Checking."
        tool_deltas = [t for d in deltas for t in (d.tool_calls or [])]
        assert len(tool_deltas) == 1 and tool_deltas[0].index == 0 and tool_deltas[0].id.startswith("call_")
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_anthropic_wire_tool_use_and_thinking():
    with scripted_client(ANSWER) as tc:
        a = anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=tc, max_retries=0)
        msgs = [{"role": "user", "content": "weather?"}]
        m = a.messages.create(model="m", max_tokens=50, messages=msgs, tools=TOOLS_AN)
        assert [b.type for b in m.content] == ["thinking", "text", "tool_use"] and m.stop_reason == "tool_use"
        assert m.content[2].input == {"city": "Paris", "days": 3}
        with a.messages.stream(model="m", max_tokens=50, messages=msgs, tools=TOOLS_AN) as s:
            final = s.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
        assert final.content[0].thinking == "need weather" and final.content[1].text == "Checking."
        assert final.content[2].input == {"city": "Paris", "days": 3} and final.stop_reason == "tool_use"


def test_loading_and_body_limit_errors():
    from engine.server.app import create_app
    from engine.server.bridge import ServerSettings

    def never():
        raise RuntimeError("no GPU today")

    with TestClient(create_app(ServerSettings(model_id="m", max_body_bytes=100), never,
                               load_in_background=False)) as tc:
        assert tc.get("/health").json()["status"] == "error"
        r = tc.post("/v1/messages", json={"model": "m", "max_tokens": 1, "messages": []})
        assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
        r = tc.post("/v1/chat/completions", content=b"x" * 500, headers={"content-type": "application/json"})
        assert r.status_code == 413


# ---- the known slips of models' tool calls: each read as the call meant, or returned as text -------------------

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array", "items": {"type": "number"}}, "where": {"type": "object"}}}}}]


def _xml(*params: tuple[str, str], close: str = "</function>\n</tool_call>") -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function=get_weather>\n{body}{close}"


SLIPS = [
    # (what the model wrote, the arguments meant)
    (_xml(("metric", "True"), ("where", "None")), {"metric": True, "where": None}),  # Python literals
    (_xml(("where", "{'lat': 1.5, 'ok': False}")), {"where": {"lat": 1.5, "ok": False}}),  # single quotes
    (_xml(("hours", "['1', 2.5]")), {"hours": [1, 2.5]}),  # an array's numbers as strings
    (_xml(("days", '"3"'), ("hours", '"[1, 2]"')), {"days": 3, "hours": [1, 2]}),  # numbers/arrays as strings
    (_xml(("days", "3.0")), {"days": 3}),  # an integral float for an integer
    (_xml(("city", "42")), {"city": "42"}),  # a string parameter stays a string, whatever it looks like
    (_xml(("city", '"Paris"')), {"city": "Paris"}),  # ...and a JSON string literal is decoded
    ("<tool_call>\n<function=get_weather>\n{\"city\": \"Paris\", \"days\": \"2\"}\n</function>\n</tool_call>",
     {"city": "Paris", "days": 2}),  # the arguments as one JSON object inside <function>
    (_xml(("city", "Paris"), close=""), {"city": "Paris"}),  # the output ends before </function></tool_call>
    (_xml(("city", "Paris"), close="</function>"), {"city": "Paris"}),  # ... before </tool_call>
    ("<tool_call>\n{'name': 'get_weather', 'arguments': {'days': '4', 'metric': True}}\n</tool_call>",
     {"days": 4, "metric": True}),  # the JSON form in Python's spelling
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}', {"city": "Rome"}),  # unclosed JSON
]


@pytest.mark.parametrize("text,args", SLIPS)
def test_known_slips_are_read_as_the_call_meant(text, args):
    for split in (lambda s: [s], lambda s: [s[i:i + 2] for i in range(0, len(s), 2)]):
        p = OutputParser(tools=WEATHER)
        pieces = [x for part in split(text) for x in p.feed(part)] + p.finish()
        assert [(x.kind, x.call.name, x.call.arguments) for x in pieces if x.kind != "text" or x.text.strip()] == [
            ("tool_call", "get_weather", args)]


def test_a_next_call_before_the_last_one_closed_ends_it():
    text = _xml(("city", "Oslo"), close="</function>\n") + _xml(("city", "Rome"))
    assert [c.arguments for c in parse_all(text, tools=WEATHER)[2]] == [{"city": "Oslo"}, {"city": "Rome"}]


@pytest.mark.parametrize("text", [
    _xml(("city", "Paris"), close="")[:-len("\n</parameter>\n")],  # cut off inside a value: arguments unknown
    "<tool_call>\n<function=get_weather>\nnot arguments\n</function>\n</tool_call>",
    "<tool_call>\n{'name': 'get_weather', 'arguments': {'a': b'bytes'}}\n</tool_call>",  # no JSON value
    "<tool_call>\n{'name': 'get_weather', 'arguments': " + "[" * 5000 + "}\n</tool_call>",  # too deep to read
])
def test_a_call_that_still_cannot_be_read_comes_back_as_text(text):
    reasoning, visible, calls = parse_all(text, tools=WEATHER)
    assert calls == [] and visible == text.strip() and reasoning == ""
