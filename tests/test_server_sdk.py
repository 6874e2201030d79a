"""`ninfer serve` against the official openai and anthropic SDKs (a real server on loopback, default model)."""
import json
import threading
import time

import anthropic
import httpx2
import openai
import pytest

from .server_util import Server

MODEL = "smollm2-135m"
KEY = "test-key-123"


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


@pytest.fixture(scope="module")
def busy_server():
    """One request at a time, two queued, an API key."""
    s = Server("--max-concurrency", "1", "--max-pending-requests", "2", "--api-key", KEY)
    yield s
    s.stop()


def oa(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


def an(server, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


CHAT = [{"role": "user", "content": "List three fruits."}]
GREEDY = {"temperature": 0}  # this anthropic SDK has no temperature argument; the field still goes on the wire


def test_openai_chat_stream_matches_non_stream(server):
    c = oa(server)
    r = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [m.id for m in c.models.list().data] == [MODEL]


def test_openai_completions(server):
    r = oa(server).completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens <= 5
    streamed = "".join(ch.choices[0].text for ch in oa(server).completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, stream=True))
    assert streamed == r.choices[0].text


def test_anthropic_messages_stream_matches_non_stream(server):
    c = an(server)
    m = c.messages.create(model=MODEL, max_tokens=20, system="You are terse.", messages=CHAT, extra_body=GREEDY)
    assert m.role == "assistant" and m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens")
    with c.messages.stream(model=MODEL, max_tokens=20, system="You are terse.", messages=CHAT,
                           extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert final.content[0].text == m.content[0].text and final.stop_reason == m.stop_reason
    counted = c.messages.count_tokens(model=MODEL, system="You are terse.", messages=CHAT).input_tokens
    assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_stop_sequence(server):
    m = an(server).messages.create(model=MODEL, max_tokens=40, messages=[
        {"role": "user", "content": "Count from 1 to 10 separated by commas."}],
        extra_body={**GREEDY, "repetition_penalty": 1.0}, stop_sequences=["4"])
    # greedy SmolLM2 without the profile's repetition penalty writes "1. 1\n2. 2\n3. 3\n4. 4…": the answer ends
    # where the "4" would start
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "4"
    assert m.content[0].text.startswith("1. 1") and "4" not in m.content[0].text


TOOLS_OA = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                              "parameters": {"type": "object",
                                                             "properties": {"city": {"type": "string"}}}}}]
TOOLS_AN = [{"name": "get_weather", "description": "Weather for a city",
             "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


def test_tools_reach_the_prompt_and_results_round_trip(server):
    c = oa(server)
    plain = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    tooled = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, tools=TOOLS_OA)
    assert tooled.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the definitions are in the prompt
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    r = c.chat.completions.create(model=MODEL, messages=history, tools=TOOLS_OA, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")

    a = an(server)
    base = a.messages.count_tokens(model=MODEL, messages=CHAT).input_tokens
    assert a.messages.count_tokens(model=MODEL, messages=CHAT, tools=TOOLS_AN).input_tokens > base + 20
    m = a.messages.create(model=MODEL, max_tokens=8, tools=TOOLS_AN, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}]}])
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_second_turn_reports_cached_tokens(server):
    c = oa(server)
    msgs = [{"role": "user", "content": "Name a color."}]
    first = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Another one?"}]
    second = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // 2

    a = an(server)
    turns = [{"role": "user", "content": "Name an animal."}]
    m1 = a.messages.create(model=MODEL, max_tokens=8, messages=turns, extra_body=GREEDY)
    turns += [{"role": "assistant", "content": m1.content[0].text}, {"role": "user", "content": "And a bird?"}]
    m2 = a.messages.create(model=MODEL, max_tokens=8, messages=turns, extra_body=GREEDY)
    assert m2.usage.cache_read_input_tokens > 0


def test_a_side_request_on_the_same_system_prompt_leaves_the_conversation_cached(server):
    """A sub-agent's request (the same system prompt, other messages) shares the held conversation's prefix and
    leaves it held: the conversation's next turn still reads all of its earlier turns from the cache."""
    a = an(server)
    system = "You are a terse assistant for a software project. Answer in a few words. " * 3
    turns = [{"role": "user", "content": "Name an animal."}]
    m1 = a.messages.create(model=MODEL, max_tokens=8, system=system, messages=turns, extra_body=GREEDY)
    turns += [{"role": "assistant", "content": m1.content[0].text}, {"role": "user", "content": "And a bird?"}]
    m2 = a.messages.create(model=MODEL, max_tokens=8, system=system, messages=turns, extra_body=GREEDY)
    side = a.messages.create(model=MODEL, max_tokens=8, system=system, extra_body=GREEDY,
                             messages=[{"role": "user", "content": "List the files."}])
    assert side.usage.cache_read_input_tokens > 0  # the system prompt
    turns += [{"role": "assistant", "content": m2.content[0].text}, {"role": "user", "content": "And a fish?"}]
    m3 = a.messages.create(model=MODEL, max_tokens=8, system=system, messages=turns, extra_body=GREEDY)
    assert m3.usage.cache_read_input_tokens >= m2.usage.input_tokens + m2.usage.cache_read_input_tokens


def test_openai_errors(server, busy_server):
    c = oa(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=9000)
    assert "8192" in str(e.value) and "9000" in str(e.value)
    assert e.value.response.headers.get("x-should-retry") == "false"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-9", messages=CHAT, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature="hot")
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body={"speculate": "no"})
    assert "'speculate' must be of type bool" in str(e.value)
    ok = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body={"speculate": False})
    assert ok.usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        oa(busy_server, api_key="wrong").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    r = httpx2.post(server.url + "/v1/chat/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx2.get(server.url + "/v1/nope", timeout=10)
    assert r.status_code == 404 and "error" in r.json()


def test_anthropic_errors(server, busy_server):
    a = an(server)
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model=MODEL, max_tokens=9000, messages=CHAT)
    assert "8192" in str(e.value)
    with pytest.raises(anthropic.NotFoundError):
        a.messages.create(model="claude-x", max_tokens=2, messages=CHAT)
    with pytest.raises(anthropic.BadRequestError):
        a.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "tool", "content": "x"}])
    with pytest.raises(anthropic.AuthenticationError):
        an(busy_server, api_key="wrong").messages.create(model=MODEL, max_tokens=2, messages=CHAT)
    r = httpx2.post(server.url + "/v1/messages", json={"model": MODEL, "messages": CHAT}, timeout=10)
    assert r.status_code == 400 and r.json()["type"] == "error"


def _gauges(server) -> tuple[float, float, float, float]:
    m = server.metrics()
    return (m["ninfer_running_requests"], m["ninfer_pending_requests"], m["ninfer_held_sequences"],
            m["ninfer_kv_tokens_in_use"])


def test_cancelled_streams_leave_nothing_behind(busy_server):
    c = oa(busy_server, api_key=KEY)
    held_before, kv_before = _gauges(busy_server)[2:]
    for i in range(50):
        with c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Story {i}"}],
                                       max_tokens=200, stream=True) as s:
            for n, _ in enumerate(s):
                if n == 2:
                    break
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _gauges(busy_server)[:2] != (0, 0):
        time.sleep(0.2)
    running, pending, held, kv = _gauges(busy_server)
    assert (running, pending) == (0, 0) and held == held_before
    assert kv == kv_before  # every cancelled request gave its KV blocks back
    assert busy_server.metrics().get('ninfer_requests_total{route="chat.completions",status="cancelled"}', 0) >= 45


def test_queue_full_gives_overloaded_not_500(busy_server):
    results = []

    def one(i: int) -> None:
        try:
            if i % 2:
                r = oa(busy_server, api_key=KEY).chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"Tell a long story {i}"}], max_tokens=48)
                results.append(("ok", r.choices[0].finish_reason, r.usage.completion_tokens))
            else:
                m = an(busy_server, api_key=KEY).messages.create(
                    model=MODEL, max_tokens=48, messages=[{"role": "user", "content": f"Tell a long story {i}"}])
                results.append(("ok", m.stop_reason, m.usage.output_tokens))
        except openai.RateLimitError as exc:
            results.append(("overloaded", 429, exc.response.headers.get("retry-after")))
        except anthropic.APIStatusError as exc:
            results.append(("overloaded" if exc.status_code == 529 else "error", exc.status_code,
                            exc.response.headers.get("retry-after")))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
        time.sleep(0.02)
    for t in threads:
        t.join(120)
    ok = [r for r in results if r[0] == "ok"]
    over = [r for r in results if r[0] == "overloaded"]
    assert len(ok) == 3 and len(over) == 3, results
    assert all(r[1] in ("stop", "length", "end_turn", "max_tokens") and r[2] > 0 for r in ok)
    assert all(r[2] is not None for r in over)  # Retry-After
