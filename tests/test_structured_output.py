"""Grammar-constrained decoding on a tiny random model, where nothing but the grammar can make output valid: a
suite of JSON schemas validates with and without n-gram drafts (greedy output identical), constrained rows share
steps with unconstrained ones, the controlled drafter keeps its acceptance, and tool-call grammars give calls
the parser reads."""
import json

import jsonschema
import numpy as np
import pytest

from engine import Engine, EngineConfig, SamplingParams, UserError
from engine.runtime.request import Grammar
from engine.tokenizer.output_parser import parse_all

from .conftest import admitted_together
from .schema_suite import schemas

SCHEMAS = schemas()
PROMPT = list(b"JSON: ")
BUDGET = 160  # the longest suite output is ~155 byte tokens
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


def make(**settings) -> Engine:
    return Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", max_context=512, held_sequences=0,
                               max_concurrency=len(SCHEMAS), **settings))


@pytest.fixture(scope="module")
def plain() -> Engine:
    return make()


def run_all(eng: Engine, grammars: list[Grammar | None], max_tokens: int = BUDGET, **params) -> list:
    """Every request at once (their rows batched in each step); the FinishEvents in order."""
    with admitted_together(eng):  # a grammar compiled in `submit` would otherwise let the earlier ones run ahead
        streams = [eng.submit(PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0, grammar=g, **params))
                   for g in grammars]
    return [list(s)[-1] for s in streams]


def as_grammar(schema: dict) -> Grammar:
    return Grammar("json_schema", json.dumps(schema))


@pytest.fixture(scope="module")
def suite_plain(plain) -> list:
    return run_all(plain, [as_grammar(s) for s in SCHEMAS])


def test_every_schema_of_the_suite_validates_with_and_without_drafts(suite_plain):
    assert len(SCHEMAS) >= 100
    drafted = run_all(make(spec="ngram", draft_tokens=4, adaptive_drafts=False), [as_grammar(s) for s in SCHEMAS])
    for schema, final in zip(SCHEMAS, suite_plain, strict=True):
        assert final.finish_reason == "stop", (schema, final.text)
        jsonschema.validate(json.loads(final.text), schema, format_checker=FORMATS)
    assert [f.token_ids for f in drafted] == [f.token_ids for f in suite_plain]  # greedy: drafts change nothing
    assert sum(f.spec.accepted for f in drafted) > 0


def test_the_controlled_drafter_keeps_its_acceptance_under_a_grammar(suite_plain):
    """A second identical pass drafts the first pass's constrained output at the rate asked for: the grammar
    refuses none of those drafts, and the output is what constrained decoding without drafts gives."""
    picked = [i for i, f in enumerate(suite_plain) if f.completion_tokens >= 30][:6]
    eng = make(spec="ngram", draft_tokens=4, draft_acceptance=0.9, adaptive_drafts=False)
    grammars = [as_grammar(SCHEMAS[i]) for i in picked]
    first, second = run_all(eng, grammars), run_all(eng, grammars)
    want = [suite_plain[i].token_ids for i in picked]
    assert [f.token_ids for f in first] == want and [f.token_ids for f in second] == want
    drafted, accepted = (sum(getattr(f.spec, k) for f in second) for k in ("drafted", "accepted"))
    assert accepted / drafted > 0.6


def test_a_round_whose_drafts_the_grammar_refused_still_verifies(suite_plain, monkeypatch):
    """A round the grammar cuts to no drafts keeps its verify row: on a GPU a plain step computes a row with
    other kernels than a verify step, so the grammar's refusals would otherwise decide which kernels make a token
    (and a greedy pick at a near tie with them)."""
    from engine.runtime import scheduler

    rows = []
    plan = scheduler.Scheduler.plan

    def recording(self, propose):
        works = plan(self, propose)
        rows.extend((len(w.drafts), w.keep) for w in works if not w.prefill)
        return works

    monkeypatch.setattr(scheduler.Scheduler, "plan", recording)
    eng = make(spec="ngram", draft_tokens=4, draft_acceptance=0.3, adaptive_drafts=False)
    picked = [i for i, f in enumerate(suite_plain) if f.completion_tokens >= 30][:3]
    out = run_all(eng, [as_grammar(SCHEMAS[i]) for i in picked])  # the first pass: every draft a random byte
    assert [f.token_ids for f in out] == [suite_plain[i].token_ids for i in picked]
    assert (0, True) in rows  # all refused, still a verify row
    assert sum(f.spec.drafted for f in out) > 0


def test_constrained_and_unconstrained_rows_share_steps(plain):
    alone = run_all(plain, [None], max_tokens=24, ignore_eos=True)[0]
    before = plain.core.batched_steps
    mixed = run_all(plain, [None, as_grammar(SCHEMAS[0]), Grammar("regex", "[0-9]{4}-[a-f]{3}")], max_tokens=24,
                    ignore_eos=True)
    assert plain.core.batched_steps - before >= 8  # the three rows ran in the same steps
    assert mixed[0].token_ids == alone.token_ids  # the unconstrained row is untouched by the others' masks
    json.loads(mixed[1].text)
    assert mixed[2].finish_reason == "stop" and len(mixed[2].text) == 8


def test_regex_lark_gbnf_and_json_mode(plain):
    regex, lark, gbnf, json_mode = run_all(plain, [
        Grammar("regex", r"(yes|no|maybe), [A-Z][a-z]{1,4}!"),
        Grammar("lark", 'start: "n=" NUM (";" "n=" NUM)?\nNUM: /[1-9][0-9]?/'),
        Grammar("gbnf", 'root ::= "<" [a-c]+ ">" | "none"'),
        Grammar("json_object"),
    ], max_tokens=40)
    import re

    assert re.fullmatch(r"(yes|no|maybe), [A-Z][a-z]{1,4}!", regex.text)
    assert re.fullmatch(r"n=[1-9][0-9]?(;n=[1-9][0-9]?)?", lark.text)
    assert re.fullmatch(r"<[a-c]+>|none", gbnf.text)
    assert json_mode.text.startswith("{")  # an object that a random model may not finish in 40 tokens


@pytest.mark.parametrize("grammar,why", [
    (Grammar("json_schema", '{"type": "string", "format": "postcode"}'), "Unknown format: postcode"),
    (Grammar("json_schema", '{"$ref": "#/$defs/missing"}'), "missing"),
    (Grammar("json_schema", "{not json"), "not valid JSON"),
    (Grammar("regex", "(unclosed"), "regex"),
    (Grammar("gbnf", "root ::= ("), "GBNF"),
])
def test_a_grammar_that_cannot_compile_says_why(plain, grammar, why):
    with pytest.raises(UserError) as info:
        plain.check_grammar(grammar)
    assert why.lower() in str(info.value).lower() and "\n" not in str(info.value)
    with pytest.raises(UserError):
        plain.submit(PROMPT, SamplingParams(grammar=grammar))
    assert plain.stats()["running"] == 0 and plain.stats()["pending"] == 0


def test_a_non_strict_schema_ignores_keywords_the_library_lacks(plain):
    schema = {"type": "object", "properties": {"z": {"type": "string", "format": "postcode", "maxLength": 3}},
              "required": ["z"], "additionalProperties": False}
    final = run_all(plain, [Grammar("json_schema", json.dumps(schema), strict=False)], max_tokens=30)[0]
    jsonschema.validate(json.loads(final.text), schema)


def test_drafts_the_grammar_refuses_end_the_run_and_masks_leave_the_matcher_where_it_was(plain):
    tok = plain.tokenizer
    m = plain.grammars.matcher(Grammar("regex", "ab[0-9]{2}"))
    assert m.valid_drafts(tok.encode("ab1x2")) == 3 and m.valid_drafts(tok.encode("b")) == 0
    rows = np.zeros((3, m.words), dtype=np.int32)

    def allowed(row) -> set[int]:
        return {i for i in range(512) if row[i // 32] >> (i % 32) & 1}

    m.masks(tok.encode("ab"), rows)
    assert [allowed(r) for r in rows] == [{ord("a")}, {ord("b")}, set(range(ord("0"), ord("9") + 1))]
    m.masks([], rows[:1])
    assert allowed(rows[0]) == {ord("a")}  # rolled back
    assert not m.advance(ord("a")) and not m.advance(ord("b")) and not m.advance(ord("1"))
    assert m.advance(ord("2"))  # complete: nothing may follow


def test_reasoning_comes_before_the_constrained_part(plain):
    tok = plain.tokenizer
    m = plain.grammars.matcher(Grammar("json_schema", '{"type": "integer"}', reasoning=True))
    think_close = tok.special["</think>"]
    reasoning = tok.encode("let me think {not json}")
    assert m.valid_drafts(reasoning + [think_close] + tok.encode("\n\n42")) == len(reasoning) + 5
    assert m.valid_drafts(tok.encode("42") + [tok.eos_ids[0]]) == 2  # text: the end is not allowed before </think>


@pytest.mark.parametrize("xml", [True, False])
def test_forced_tool_calls_parse_with_arguments_under_the_schema(plain, monkeypatch, xml):
    monkeypatch.setattr(plain.chat_template, "calls_in_xml", xml)
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                             "units": {"enum": ["c", "f"]}},
            "required": ["city", "days"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city, "strict": True}},
             {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]
    named, required = run_all(plain, [plain.tool_call_grammar(tools, "get_weather"),
                                      plain.tool_call_grammar(tools)], max_tokens=220)
    calls = parse_all(named.text, tools=tools)[2]
    assert named.finish_reason == "stop" and [c.name for c in calls] == ["get_weather"]
    jsonschema.validate(calls[0].arguments, city)
    for call in parse_all(required.text, tools=tools)[2]:
        jsonschema.validate(call.arguments, city if call.name == "get_weather" else {"type": "object"})
    with pytest.raises(UserError, match="no tool named 'other'"):
        plain.tool_call_grammar(tools, "other")


def test_strict_tools_under_auto_allow_text_or_exact_calls(plain):
    tools = [{"type": "function", "function": {"name": "pick", "strict": True, "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
        "additionalProperties": False}}}]
    m = plain.grammars.matcher(plain.tool_call_grammar(tools, required=False))
    tok = plain.tokenizer
    call = [tok.special["<tool_call>"], *tok.encode("\n<function=pick>\n<parameter=n>\n")]
    assert m.valid_drafts(tok.encode("plain words") + [tok.eos_ids[0]]) == 12  # text, then the end
    assert m.valid_drafts(tok.encode("ok ") + call + tok.encode("7\n</parameter>\n")) == 3 + len(call) + 15
    assert m.valid_drafts(call + tok.encode("x")) == len(call)  # the call's argument is an integer
