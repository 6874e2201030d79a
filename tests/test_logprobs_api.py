"""logprobs and n > 1 through the official openai SDK, on the in-process app serving the tiny random model: the
shapes parse (chat, completions and Responses, streamed and not), top_logprobs come sorted with the chosen token
among them when it ranks there, n choices come with their indexes, and bad values are 400s in OpenAI's shape."""
import codecs

import openai
import pytest
from fastapi.testclient import TestClient

from engine import Engine, EngineConfig
from engine.runtime.request import FinishEvent, Timings, TokenEvent, TokenLogprob
from engine.server.responses_api import OutputReader, _Builder
from engine.tokenizer.output_parser import OutputParser

CHAT = [{"role": "user", "content": "Hi"}]
PLAIN = {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True}


@pytest.fixture(scope="module")
def setup():
    from engine.server.app import create_app
    from engine.server.bridge import ServerSettings

    eng = Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", max_context=512, max_concurrency=4))
    with TestClient(create_app(ServerSettings(model_id="m"), lambda: eng, load_in_background=False)) as tc:
        yield eng, openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)


def check_entries(entries, top: int) -> None:
    assert entries
    for e in entries:
        values = [t.logprob for t in e.top_logprobs]
        assert len(values) == top and values == sorted(values, reverse=True)
        assert e.logprob <= 0 and bytes(e.bytes).decode("utf-8", "backslashreplace") == e.token
        if e.logprob >= values[-1]:  # ranks among the top: it is there with the same value
            assert (e.token, e.logprob) in [(t.token, t.logprob) for t in e.top_logprobs]


def test_chat_logprobs_streamed_and_not(setup):
    _, client = setup
    args = dict(model="m", messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, extra_body=PLAIN)
    full = client.chat.completions.create(**args)
    check_entries(full.choices[0].logprobs.content, 3)
    assert len(full.choices[0].logprobs.content) == full.usage.completion_tokens == 8
    streamed = [e for c in client.chat.completions.create(**args, stream=True) for ch in c.choices
                if ch.logprobs is not None for e in ch.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in full.choices[0].logprobs.content]
    assert client.chat.completions.create(model="m", messages=CHAT, max_tokens=2).choices[0].logprobs is None


def test_completions_logprobs_streamed_and_not(setup):
    _, client = setup
    full = client.completions.create(model="m", prompt="Hello", max_tokens=6, temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True})
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    # a dict by text: ids past the tokenizer's vocabulary (padded embedding rows) all read "" and make one key
    assert all(1 <= len(t) <= 2 and list(t.values()) == sorted(t.values(), reverse=True) for t in lp.top_logprobs)
    text = full.choices[0].text
    raw = b"".join(codecs.escape_decode(t[len("bytes:"):])[0] if t.startswith("bytes:") else t.encode()
                   for t in lp.tokens)
    assert raw.decode("utf-8", "replace") == text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    chunks = list(client.completions.create(model="m", prompt="Hello", max_tokens=6, temperature=0, logprobs=2,
                                            stream=True, extra_body={"ignore_eos": True}))
    streamed = [ch.logprobs for c in chunks for ch in c.choices if ch.logprobs]
    assert [v for s in streamed for v in s.token_logprobs] == lp.token_logprobs
    assert [v for s in streamed for v in s.text_offset] == lp.text_offset


RESPONSES = dict(model="m", input="Hi", max_output_tokens=8, temperature=0, top_logprobs=3,
                 include=["message.output_text.logprobs"], extra_body=PLAIN)


def _triples(entries) -> list[tuple]:
    return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in entries]


def test_responses_logprobs_streamed_and_not_equal_chats(setup):
    _, client = setup
    full = client.responses.create(**RESPONSES)
    assert full.top_logprobs == 3
    part = full.output[0].content[0]
    check_entries(part.logprobs, 3)
    events = list(client.responses.create(**RESPONSES, stream=True))
    deltas = [e for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]
    done = next(ev for ev in events if ev.type == "response.output_text.done")
    streamed_part = events[-1].response.output[0].content[0]
    assert _triples(deltas) == _triples(done.logprobs) == _triples(streamed_part.logprobs) == _triples(part.logprobs)
    # chat's are every token's; the Responses text leaves out the whitespace the text would start with
    chat = client.chat.completions.create(model="m", messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                          top_logprobs=3, extra_body=PLAIN).choices[0]
    assert chat.message.content == part.text
    entries = chat.logprobs.content
    first = next(i for i, e in enumerate(entries) if not e.token.isspace())
    assert [(e.token, e.logprob) for e in part.logprobs] == [(e.token, e.logprob) for e in entries[first:]]
    assert [t.token for e in part.logprobs for t in e.top_logprobs] == \
        [t.token for e in entries[first:] for t in e.top_logprobs]
    plain = client.responses.create(**{**RESPONSES, "include": []})  # top_logprobs alone asks for none
    assert plain.output[0].content[0].logprobs == [] and plain.output[0].content[0].text == part.text


def test_a_whole_response_builds_no_stream_events(setup, monkeypatch):
    from engine.server import responses_api

    _, client = setup
    lines = []
    sse = responses_api.sse
    monkeypatch.setattr(responses_api, "sse", lambda *args: lines.append(args[0]["type"]) or sse(*args))
    full = client.responses.create(**RESPONSES)
    assert full.output[0].content[0].logprobs and lines == []  # the items alone, each token's entry built once
    events = list(client.responses.create(**RESPONSES, stream=True))
    assert lines == [e.type for e in events]


class _Tokens:
    """A tokenizer whose token i is TEXTS[i]."""

    TEXTS = ["Let me think", "</think>", "\n\n", "Hello", " world", "\n", "<tool_call>",
             "<function=f><parameter=a>1</parameter></function>", "</tool_call>", "\n", "Bye"]

    def token_text(self, token: int) -> str:
        return self.TEXTS[token]

    def token_bytes(self, token: int) -> bytes:
        return self.TEXTS[token].encode()


def test_responses_logprobs_are_the_output_texts_alone():
    b = _Builder("resp_1", "m", 0, 1)
    reader = OutputReader(b, OutputParser(in_reasoning=True, tools=True), _Tokens())
    for i, text in enumerate(_Tokens.TEXTS):
        reader.feed(TokenEvent(i, text, TokenLogprob(-1.0 - i, ((i, -1.0 - i),))))
    reader.feed(FinishEvent("stop", 1, len(_Tokens.TEXTS), list(range(len(_Tokens.TEXTS))), "".join(_Tokens.TEXTS),
                            Timings(0, 0, 0, 0)))
    b.finish()
    assert [item["type"] for item in b.items] == ["reasoning", "message", "function_call", "message"]
    # no reasoning, tag, call or the whitespace around them: the text's own tokens, in their messages
    texts = [[e["token"] for e in item["content"][0]["logprobs"]] for item in b.items if item["type"] == "message"]
    assert texts == [["Hello", " world"], ["Bye"]]
    assert [item["content"][0]["text"] for item in b.items if item["type"] == "message"] == ["Hello world", "Bye"]


def _items(reader: OutputReader) -> list[dict]:
    """The reader's output items without their random ids."""
    reader.builder.finish()
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in reader.builder.items]


def test_a_response_without_logprobs_parses_its_text_at_once_as_token_by_token(setup, monkeypatch):
    final = FinishEvent("stop", 1, len(_Tokens.TEXTS), list(range(len(_Tokens.TEXTS))), "".join(_Tokens.TEXTS),
                        Timings(0, 0, 0, 0))
    by_token, whole = (OutputReader(_Builder("resp_1", "m", 0, None, stream=False),
                                    OutputParser(in_reasoning=True, tools=True), _Tokens()) for _ in range(2))
    for i, text in enumerate(_Tokens.TEXTS):
        by_token.feed(TokenEvent(i, text))
    by_token.feed(final)
    whole.whole(final)
    assert _items(whole) == _items(by_token)
    assert [item["type"] for item in _items(whole)] == ["reasoning", "message", "function_call", "message"]
    # the route: the parser is fed the text once without logprobs, a token at a time with them
    fed = []
    feed = OutputParser.feed
    monkeypatch.setattr(OutputParser, "feed", lambda parser, text: fed.append(text) or feed(parser, text))
    _, client = setup
    plain = client.responses.create(**{**RESPONSES, "include": []})
    assert len(fed) == 1
    fed.clear()
    with_logprobs = client.responses.create(**RESPONSES)
    assert len(fed) == with_logprobs.usage.output_tokens == 8
    assert plain.output[0].content[0].text == with_logprobs.output[0].content[0].text


def _gauges(eng: Engine) -> tuple:
    s = eng.stats()
    return s["running"], s["pending"], s["kv_tokens_free"], eng._reserved


def test_n_choices_share_one_prefill(setup):
    eng, client = setup
    start, prefilled = _gauges(eng), eng.stats()["prefill_tokens"]
    out = client.chat.completions.create(model="m", messages=CHAT, max_tokens=6, temperature=0, n=3,
                                         extra_body=PLAIN)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.message.content for c in out.choices}) == 1  # greedy: identical
    assert out.usage.completion_tokens == 18
    assert eng.stats()["prefill_tokens"] - prefilled == out.usage.prompt_tokens  # held reuse aside: once
    seeded = dict(model="m", prompt="Hello", max_tokens=6, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    texts = {}
    for c in client.completions.create(**seeded, n=3, stream=True):
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    alone = [client.completions.create(**{**seeded, "seed": 5 + i}).choices[0].text for i in range(3)]
    assert [texts[i] for i in range(3)] == alone
    with client.chat.completions.create(model="m", messages=CHAT, max_tokens=300, n=3, stream=True,
                                        extra_body=PLAIN) as stream:
        next(iter(stream))  # the client goes away mid-stream
    for _ in range(200):
        if _gauges(eng) == start:
            break
        import time
        time.sleep(0.05)
    assert _gauges(eng) == start


def _metrics(client) -> dict[str, float]:
    import httpx2

    text = client.get("http://testserver/metrics", cast_to=httpx2.Response).text
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))}


def test_n_choices_count_as_one_request(setup):
    _, client = setup
    before = _metrics(client)
    out = client.chat.completions.create(model="m", messages=CHAT, max_tokens=5, temperature=0, n=3, extra_body=PLAIN)
    after = _metrics(client)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew('ninfer_requests_total{route="chat.completions",status="length"}') == 1
    assert grew("ninfer_prompt_tokens_total") == out.usage.prompt_tokens  # the shared prompt once
    assert grew("ninfer_completion_tokens_total") == out.usage.completion_tokens == 15  # every choice's tokens
    assert grew("ninfer_time_to_first_token_seconds_count") == grew("ninfer_decode_tokens_per_second_count") == 1
    assert "ninfer_preemptions" in after and grew("ninfer_preemptions") == 0  # several choices are never preempted


@pytest.mark.parametrize(("api", "extra", "param"), [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"n": 17}, "n"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"n": 0}, "n"),
    ("responses", {"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ("responses", {"top_logprobs": -1}, "top_logprobs"),
    ("responses", {"include": "message.output_text.logprobs"}, "include")])
def test_bad_values_are_400s(setup, api, extra, param):
    _, client = setup
    with pytest.raises(openai.BadRequestError) as err:
        if api == "chat":
            client.chat.completions.create(model="m", messages=CHAT, max_tokens=2, extra_body=extra)
        elif api == "responses":
            client.responses.create(model="m", input="x", max_output_tokens=2, extra_body=extra)
        else:
            client.completions.create(model="m", prompt="x", max_tokens=2, extra_body=extra)
    assert err.value.body["param"] == param
