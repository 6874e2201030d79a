"""The benchmark drafter (engine/runtime/drafting/controlled.py): acceptance at the figure asked for, output unchanged.

The engine tests use only the public Engine API (Engine, complete, FinishEvent), so they hold whatever the round
loop inside looks like; Engine is imported by them alone, so the drafter's own tests run without it."""
from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch

import engine
from engine import EngineConfig, SamplingParams
from engine.errors import UserError
from engine.runtime.drafting.controlled import ControlledDrafter
from ninfer_tui import profiles

from .conftest import run_cli

DEVICE = os.environ.get("NINFER_TEST_DEVICE", "cpu")
VOCAB = 512  # synthetic:tiny's
# Enough rounds that the acceptance's spread is small: ~210 rounds of K = 3 at 0.6 (q = 0.766: a round keeps
# 1.8 +- 1.2 drafts, so the rate's sd is ~0.41 / sqrt(210) = 0.028). The first pass, ~1 token a round, is the
# cost: K = 3 keeps its verify steps short.
LONG = SamplingParams(max_tokens=600, temperature=0, ignore_eos=True)


def prompt() -> list[int]:
    return torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(5)).tolist()


class Sequence:
    """A stand-in for a SequenceCache: the drafter keys its progress by the object and (with no inner drafter)
    reads nothing of it."""


def run_rounds(drafter: ControlledDrafter, truth: list[int], start: int, k: int) -> tuple[int, int]:
    """Rounds as greedy verification runs them against a target whose output is `truth`: each keeps the leading
    run of right drafts plus the target's own token. Returns (accepted, drafted)."""
    history, cache = truth[:start], Sequence()
    accepted = drafted = 0
    while len(history) + k + 1 <= len(truth):
        drafts = drafter.propose(cache, history, k)
        assert len(drafts) == k
        kept = 0
        while kept < k and drafts[kept] == truth[len(history) + kept]:
            kept += 1
        accepted, drafted = accepted + kept, drafted + k
        history.extend(truth[len(history):len(history) + kept + 1])  # in place, as the round loop does
    return accepted, drafted


@pytest.mark.parametrize(("target", "k"), [(0.596, 7), (0.79, 3), (0.3, 1)])
def test_the_acceptance_is_the_one_asked_for_within_one_draft_however_few_the_rounds(target, k):
    rng = random.Random(k)
    truth = [rng.randrange(VOCAB) for _ in range(4000)]
    drafter = ControlledDrafter(None, target, VOCAB, seed=1)
    run_rounds(drafter, truth, 20, k)  # the first pass records the continuation (and drafts noise)
    for rounds in (20, 400):  # a benchmark request's ~20 rounds keep the rate as closely as many
        history, cache = truth[:20], Sequence()  # a new request
        accepted = 0
        for _ in range(rounds):
            drafts = drafter.propose(cache, history, k)
            kept = 0
            while kept < k and drafts[kept] == truth[len(history) + kept]:
                kept += 1
            accepted += kept
            history.extend(truth[len(history):len(history) + kept + 1])
        assert abs(accepted - target * k * rounds) <= 1


def test_an_unseen_continuation_drafts_noise_and_a_wrong_draft_is_never_the_truth():
    rng = random.Random(0)
    truth = [rng.randrange(VOCAB) for _ in range(5000)]
    first = ControlledDrafter(None, 0.596, VOCAB, seed=2)
    accepted, drafted = run_rounds(first, truth, 20, 7)
    assert accepted / drafted < 0.02  # nothing recorded yet: random tokens
    never = ControlledDrafter(None, 0.0, VOCAB, seed=3)
    run_rounds(never, truth, 20, 7)
    history, cache = truth[:20], Sequence()
    for _ in range(2000):  # at rate 0 every draft is wrong, though the truth is known
        drafts = never.propose(cache, history, 7)
        assert drafts[0] != truth[len(history)]
        history.append(truth[len(history)])


def test_the_inner_drafter_runs_and_its_hooks_are_forwarded():
    calls: list[str] = []

    class Inner:
        reads_target_cache = True
        kv_store = ("inner", None)
        graphs = None

        def taps(self):
            calls.append("taps")

        def prepare(self, cache):
            calls.append("prepare")

        def observe(self, cache, ids, taps, next_token):
            calls.append("observe")

        def propose_rows(self, caches, histories, ks):
            calls.append("propose_rows")
            return [torch.full((k,), 7) for k in ks]

    d = ControlledDrafter(Inner(), 0.5, VOCAB)
    assert d.reads_target_cache and d.kv_store == ("inner", None) and d.graphs is None
    d.taps(), d.prepare(Sequence()), d.observe(Sequence(), [1], None, 2)
    drafts = d.propose(Sequence(), [1, 2, 3], 4)
    assert calls == ["taps", "prepare", "observe", "propose_rows"]
    assert isinstance(drafts, list) and len(drafts) == 4
    bare = ControlledDrafter(None, 0.5, VOCAB)
    assert not bare.reads_target_cache and bare.kv_store is None and bare.taps() is None


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, math.nan])
def test_a_rate_outside_0_to_1_is_refused(bad):
    with pytest.raises(UserError, match=r"draft_acceptance must be in \[0, 1\)"):
        EngineConfig("synthetic:tiny", spec="ngram", draft_acceptance=bad)


def test_profiles_and_set_take_the_rate():
    base = profiles.Profile(name="t", model="synthetic:tiny", spec="ngram")
    p = profiles.with_overrides(base, profiles.parse_set(["draft_acceptance=0.596"]))
    assert p.draft_acceptance == 0.596 and p.engine_config("synthetic:tiny").draft_acceptance == 0.596
    assert profiles.with_overrides(base, {"draft_acceptance": 0}).draft_acceptance == 0.0
    for bad in ("1", "1.0", "-0.5"):
        with pytest.raises(UserError, match=r"'draft_acceptance' = .* out of range; allowed: a finite number >= 0 "
                                            r"and < 1"):
            profiles.with_overrides(base, profiles.parse_set([f"draft_acceptance={bad}"]))


def make_engine(**settings) -> engine.Engine:
    return engine.Engine(EngineConfig("synthetic:tiny", device=DEVICE, dtype="float32", **settings))


@pytest.fixture(scope="module")
def plain() -> list[int]:
    return make_engine().complete(prompt(), LONG).token_ids


def test_a_second_identical_request_drafts_at_the_rate_asked_for_and_output_is_unchanged(plain):
    # every round drafts K = 3 (adaptive drafts would leave some rounds plain where a busy machine's step times
    # say drafting does not pay, and fewer rounds spread the acceptance wider)
    eng = make_engine(spec="ngram", draft_tokens=3, draft_acceptance=0.6, adaptive_drafts=False)
    first = eng.complete(prompt(), LONG)
    second = eng.complete(prompt(), LONG)
    assert first.token_ids == plain and second.token_ids == plain
    assert first.spec.acceptance_rate < 0.1  # nothing recorded yet
    assert second.spec.rounds > 150
    assert second.spec.acceptance_rate == pytest.approx(0.6, abs=0.08)  # ~3 sd


def test_with_spec_none_the_rate_does_nothing(plain):
    eng = make_engine(draft_acceptance=0.6)
    final = eng.complete(prompt(), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert final.spec is None and final.token_ids == plain[:40]


def test_cli_generate_records_first_and_reports_the_second_run():
    args = ("generate", "--model", "synthetic:tiny", "--device", "cpu", "--spec", "ngram", "--prompt-ids",
            ",".join(map(str, prompt())), "--max-tokens", "120", "--temperature", "0", "--repeat-penalty", "1",
            "--json")
    # every round drafts (with adaptive drafts a busy machine's step times could leave only a few rounds drafting)
    r = run_cli(*args, "--set", "draft_acceptance=0.6", "--set", "adaptive_drafts=false")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["spec"]["drafted"] > 0 and out["spec"]["acceptance_rate"] > 0.3
    assert out["token_ids"] == json.loads(run_cli(*args[:6], "none", *args[7:]).stdout)["token_ids"]
