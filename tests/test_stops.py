import pytest

from engine import SamplingParams
from engine.runtime.stops import StopMatcher


def test_stop_string_split_across_pieces():
    m = StopMatcher(("STOP",))
    out = "".join(m.feed(p) for p in ["hello S", "TO", "P world"])
    assert out == "hello " and m.stopped


def test_no_stop_releases_everything():
    m = StopMatcher(("###",))
    out = "".join(m.feed(p) for p in ["a#", "b#", "#c"]) + m.flush()
    assert out == "a#b##c" and not m.stopped


@pytest.mark.parametrize("stop", ["\n", "Paris"])
def test_engine_stops_on_string(default_engine, stop):
    ids = default_engine.encode_chat([{"role": "user", "content": "What is the capital of France? Answer in a "
                                                                 "few lines."}])
    full = default_engine.complete(ids, SamplingParams(max_tokens=40, temperature=0))
    if stop not in full.text:
        pytest.skip(f"greedy answer has no {stop!r}")
    cut = default_engine.complete(ids, SamplingParams(max_tokens=40, temperature=0, stop=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
