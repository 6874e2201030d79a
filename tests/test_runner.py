"""CUDA-graph runner (GPU only: NINFER_TEST_DEVICE=cuda): replayed steps give the eager path's tokens, with and
without speculative decoding, including verify steps padded to the graph's size and rolled back."""

import threading

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.config import WeightFormats
from engine.runtime.generate import generate
from engine.runtime.request import FinishEvent, TokenEvent

from .conftest import gpu_only
from .test_spec import DRAFTERS, GREEDY, Scripted, prompt

pytestmark = gpu_only  # CUDA graphs need a GPU


def engine(spec: str = "none", graphs: bool = True, dtype: str = "float32", kv: str = "auto",
           graph_prefill_tokens: int = 128) -> Engine:
    return Engine(EngineConfig("synthetic:tiny", device="cuda", dtype=dtype, kv_dtype=kv, spec=spec,
                               drafter=DRAFTERS.get(spec, ""), draft_tokens=7, cuda_graphs=graphs,
                               graph_prefill_tokens=graph_prefill_tokens))


def prefill(target, ids: list[int], cache, drafter=None):
    """The logits of a prompt's last token after the engine core's prefill step of it (one chunk: graphed
    pieces where the target replays them, else one step)."""
    from engine.runtime.core import run_rows
    from engine.runtime.scheduler import Work
    from engine.runtime.sequence import Sequence

    seq = Sequence(ids, GREEDY)
    seq.cache = cache
    return run_rows(getattr(target, "model", target), target, [Work(seq, ids, True)], drafter)[0][0][-1]


def borrowed_lane(eng: Engine):
    """Lane 0, empty, with blocks for a whole max_context sequence (what a request takes from the pool)."""
    lane = eng.lanes.caches[0]
    lane.reset()
    assert lane.kv.table.reserve(eng.max_context)
    return lane


@pytest.mark.parametrize("spec", ["none", *DRAFTERS])
def test_graph_steps_match_eager_steps(spec):
    eager = engine(spec, graphs=False).complete(prompt(), GREEDY)
    eng = engine(spec)
    graphs = eng.drafter.graphs if eng.drafter is not None else None
    captured = graphs.captures if graphs is not None else 0
    replayed = eng.complete(prompt(), GREEDY)
    assert eng.runner.replays > 0
    assert replayed.token_ids == eager.token_ids
    if spec != "none":  # the same drafts too (MTP drafts replay a graph of their own): a lossless check alone
        assert replayed.spec.accepted == eager.spec.accepted  # would pass with wrong drafts
    if graphs is not None:  # the drafter's graphs were all captured at load: none while the request ran
        drafts = range(2 if spec == "mtp" else 1, 8)  # MTP drafts one token without a graph
        assert graphs.keys == {("observe", n) for n in range(1, 9)} | {("propose", k) for k in drafts}
        assert graphs.captures == captured


@pytest.mark.parametrize("kv", ["bf16", "int8", "fp8"])
def test_graphs_on_bf16_with_8bit_kv(kv):
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    eager = engine(graphs=False, dtype="bfloat16", kv=kv).complete(prompt(), params)
    # the prefill eager on both sides: in bf16, 16-row pieces round differently from one 64-row chunk, and 64
    # greedy tokens of a random model can flip on that (the pieces' bf16 logits: the test below)
    eng = engine(dtype="bfloat16", kv=kv, graph_prefill_tokens=0)
    assert eng.complete(prompt(), params).token_ids == eager.token_ids


@pytest.mark.parametrize("spec", ["ngram", *DRAFTERS])
def test_speculative_requests_run_at_once_in_lanes_with_their_own_drafter_graphs(spec):
    """A drafter's engine runs a request per lane at once; each lane keeps its own drafter graphs (captured at
    load: none while the requests run), and each request gets the tokens it gets alone."""
    eng = Engine(EngineConfig("synthetic:tiny", device="cuda", dtype="float32", spec=spec,
                              drafter=DRAFTERS.get(spec, ""), draft_tokens=7, max_concurrency=3, max_context=256,
                              held_sequences=0))
    assert eng.stats()["lanes"] == 3 and eng.core.scheduler.max_running == 3
    prompts = [prompt()[i:] + [7 + i] * i for i in range(3)]
    alone = [eng.complete(p, GREEDY).token_ids for p in prompts]
    graphs = eng.drafter.graphs
    captured = graphs.captures if graphs is not None else 0
    assert _at_once(eng, prompts, GREEDY) == alone
    assert eng.core.largest_batch >= 2
    if graphs is not None:
        assert graphs.captures == captured


def test_padded_verify_steps_roll_back():
    plain = engine(graphs=False).complete(prompt(), GREEDY).token_ids
    eng = engine("ngram")  # graphs of T = 1 and 8; the scripted drafter proposes fewer guesses at times
    drafter = Scripted(len(prompt()), plain)
    lane = borrowed_lane(eng)
    events = list(generate(eng.runner, eng.tokenizer, prompt(), GREEDY, lane, 16, drafter=drafter,
                           draft_tokens=3))
    assert events[-1].token_ids == plain
    assert 0 < events[-1].spec.acceptance_rate < 1 and eng.runner.replays > 0


def _at_once(eng: Engine, prompts: list[list[int]], params: SamplingParams, late: int = 0) -> list[list[int]]:
    """Every prompt in a thread of its own, as the API server runs requests; the last `late` start once the
    others have decoded a few tokens (their prefill runs while the others' lanes are mid-sequence)."""
    out: dict[int, list[int]] = {}
    started = threading.Event()

    def run(i: int) -> None:
        tokens = 0
        for event in eng.generate(prompts[i], params):
            tokens += isinstance(event, TokenEvent) and event.token_id is not None
            if tokens >= 3:
                started.set()
            if isinstance(event, FinishEvent):
                out[i] = event.token_ids

    early = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts) - late)]
    for t in early:
        t.start()
    started.wait(60)
    rest = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts) - late, len(prompts))]
    for t in rest:
        t.start()
    for t in early + rest:
        t.join(300)
    return [out[i] for i in range(len(prompts))]


@pytest.mark.parametrize(("n", "late"), [(4, 0), (3, 1)])
def test_concurrent_requests_step_together_in_batch_graphs(monkeypatch, n, late):
    """n requests at once in lanes of one engine: each gets the tokens it gets alone, and their decode steps
    replayed batch buckets' graphs (3 running lanes take bucket 4 with a free lane; a late request prefills while
    the others hold their lanes, so some steps take each lane's own graph). Every matmul is one int8 kernel (q8
    weights, int8_mma pinned), which computes a row alike whatever rows run beside it: random tiny models turn any
    rounding difference (cuBLAS picks other kernels for 1 and 4 rows) into other greedy tokens."""
    from engine.kernels import qmatmul

    every = qmatmul.candidates
    monkeypatch.setattr(qmatmul, "candidates", lambda n, k, sms, fmt, rows=None, tiled=False: [
        c for c in every(n, k, sms, fmt) if c.kernel == "int8_mma"][:1])
    monkeypatch.setattr(qmatmul, "_chosen", {})
    prompts = [prompt()[i:] + [7 + i] * i for i in range(n)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    eng = Engine(EngineConfig("synthetic:tiny", device="cuda", dtype="float32", max_concurrency=4,
                              max_context=256, held_sequences=0, weights=WeightFormats.uniform("q8")))
    assert eng.stats()["lanes"] == 4 and eng.stats()["cuda_graph_batches"] == [2, 4]
    assert eng.core.scheduler.max_running == 4
    alone = [eng.complete(p, params).token_ids for p in prompts]
    replays = eng.runner.batch_replays
    assert _at_once(eng, prompts, params, late) == alone
    assert eng.runner.batch_replays > replays and eng.stats()["batched_steps"] > 0


@pytest.mark.parametrize("spec", ["ngram", "mtp", "dflash"])
def test_speculative_rounds_of_two_requests_verify_in_one_graph(monkeypatch, spec):
    """Two requests drafting at once: their verify rows (K+1 each) run as one step, the batch verify graph of
    lanes 0-1, and each request gets the tokens it gets alone, its drafter reading its own rows of the step's
    taps (MTP the final hidden states, DFlash the tapped layers). Drafts come from the controlled drafter
    (right at a set rate) so rounds keep some and reject others; every matmul is one int8 kernel (q8 weights,
    int8_mma pinned), which computes a row alike whatever rows run beside it."""
    from engine.kernels import qmatmul

    every = qmatmul.candidates
    monkeypatch.setattr(qmatmul, "candidates", lambda n, k, sms, fmt, rows=None, tiled=False: [
        c for c in every(n, k, sms, fmt) if c.kernel == "int8_mma"][:1])
    monkeypatch.setattr(qmatmul, "_chosen", {})
    eng = Engine(EngineConfig("synthetic:tiny", device="cuda", dtype="float32", spec=spec,
                              drafter=DRAFTERS.get(spec, ""), draft_tokens=7, max_concurrency=2, max_context=256,
                              held_sequences=0, weights=WeightFormats.uniform("q8"), draft_acceptance=0.7,
                              adaptive_drafts=False))
    assert eng.runner.captured_verifies == (2,)
    prompts = [prompt()[i:] + [7 + i] * i for i in range(2)]
    for p in prompts:  # the first pass fills the controlled drafter's table
        eng.complete(p, GREEDY)
    alone = [eng.complete(p, GREEDY) for p in prompts]
    assert all(0 < r.spec.acceptance_rate < 1 for r in alone)
    replays = eng.runner.verify_replays
    assert _at_once(eng, prompts, GREEDY) == [r.token_ids for r in alone]
    assert eng.runner.verify_replays > replays


def test_dflash_guesses_for_several_lanes_in_one_captured_graph(monkeypatch):
    """Three requests drafting at once with DFlash: the drafter guesses for lanes 0-3 (the free one pads) in one
    replay of its batch graph, captured at load, and each request gets the tokens and the accepted drafts it gets
    alone (q8 weights, every matmul one int8 kernel: a row computes alike whatever rows run beside it)."""
    from engine.kernels import qmatmul

    every = qmatmul.candidates
    monkeypatch.setattr(qmatmul, "candidates", lambda n, k, sms, fmt, rows=None, tiled=False: [
        c for c in every(n, k, sms, fmt) if c.kernel == "int8_mma"][:1])
    monkeypatch.setattr(qmatmul, "_chosen", {})
    eng = Engine(EngineConfig("synthetic:tiny", device="cuda", dtype="float32", spec="dflash",
                              drafter=DRAFTERS["dflash"], draft_tokens=7, max_concurrency=4, max_context=256,
                              held_sequences=0, weights=WeightFormats.uniform("q8"), adaptive_drafts=False))
    prompts = [prompt()[i:] + [7 + i] * i for i in range(3)]
    alone = [eng.complete(p, GREEDY) for p in prompts]
    graphs = eng.drafter.graphs
    captured = graphs.captures
    batches: list[int] = []
    propose = eng.drafter.propose_rows

    def spy(caches, histories, ks):
        batches.append(len(caches))
        return propose(caches, histories, ks)

    monkeypatch.setattr(eng.drafter, "propose_rows", spy)
    together = _finished_at_once(eng, prompts)
    assert 4 in batches and graphs.captures == captured
    assert [f.token_ids for f in together] == [a.token_ids for a in alone]
    assert [f.spec.accepted for f in together] == [a.spec.accepted for a in alone]


@pytest.mark.parametrize("spec", ["mtp", "dflash"])
def test_plain_steps_of_speculating_requests_replay_the_batch_graph_with_the_taps(monkeypatch, spec):
    """Three speculating requests at once whose steps draft and not in turn (adaptive drafts at a load where they
    do not always pay): the plain steps replay the batch bucket's graph, their drafter's taps (MTP the final
    hidden states, DFlash the tapped layers) taken from it, and each request gets the tokens it gets alone and
    the drafts it gets when every plain step runs through its lane's own graph (q8 weights, every matmul one int8
    kernel: a row computes alike whatever rows run beside it)."""
    from engine.kernels import qmatmul
    from engine.runtime.drafts import LoadChoice

    every = qmatmul.candidates
    monkeypatch.setattr(qmatmul, "candidates", lambda n, k, sms, fmt, rows=None, tiled=False: [
        c for c in every(n, k, sms, fmt) if c.kernel == "int8_mma"][:1])
    monkeypatch.setattr(qmatmul, "_chosen", {})

    def every_other(self, running: int, promised: float) -> bool:
        self.steps += 1
        return self.steps % 2 == 0

    monkeypatch.setattr(LoadChoice, "drafting", every_other)
    eng = Engine(EngineConfig("synthetic:tiny", device="cuda", dtype="float32", spec=spec,
                              drafter=DRAFTERS[spec], draft_tokens=7, max_concurrency=4, max_context=256,
                              held_sequences=0, weights=WeightFormats.uniform("q8")))
    prompts = [prompt()[i:] + [7 + i] * i for i in range(3)]
    alone = [eng.complete(p, GREEDY).token_ids for p in prompts]
    drafts: list[list[list[int]]] = []
    propose = eng.drafter.propose_rows

    def spy(caches, histories, ks):
        guesses = propose(caches, histories, ks)
        drafts[-1].append([g.tolist() if hasattr(g, "tolist") else list(g) for g in guesses])
        return guesses

    monkeypatch.setattr(eng.drafter, "propose_rows", spy)
    outputs, batch_replays = [], []
    for lane_by_lane in (False, True):
        if lane_by_lane:  # every plain step through the lanes' own graphs
            monkeypatch.setattr(eng.runner, "_batches", {})
        drafts.append([])
        eng.core.load_choice.steps = 0  # both runs draft in the same steps
        replays = eng.runner.batch_replays
        outputs.append([f.token_ids for f in _finished_at_once(eng, prompts)])
        batch_replays.append(eng.runner.batch_replays - replays)
    assert outputs == [alone, alone]
    assert batch_replays[0] > 0 and batch_replays[1] == 0
    assert drafts[0] == drafts[1] and drafts[0]


def _finished_at_once(eng: Engine, prompts: list[list[int]]) -> list[FinishEvent]:
    """Each prompt's FinishEvent, all submitted before any is read (they start in the same step)."""
    streams = [eng.submit(p, GREEDY) for p in prompts]
    return [next(e for e in s if isinstance(e, FinishEvent)) for s in streams]


def test_held_conversation_continues_in_a_lane():
    eng = engine()
    first = eng.complete(prompt(), GREEDY)
    follow = prompt() + first.token_ids + [5, 6, 7]
    again = eng.complete(follow, GREEDY)
    assert again.cached_tokens >= len(prompt())
    fresh = engine(graphs=False)
    assert again.token_ids == fresh.complete(follow, GREEDY).token_ids


@pytest.mark.parametrize(("spec", "dtype", "kv", "tol", "state_tol"), [("none", "float32", "auto", 2e-3, 2e-3),
                                                                      ("dflash", "float32", "auto", 2e-3, 2e-3),
                                                                      ("none", "bfloat16", "int8", 2e-2, 5e-2)])
def test_short_prefill_replays_the_piece_graph(spec, dtype, kv, tol, state_tol):
    """A 37-token prompt: three replays of the 16-token piece graph (the last padded), then the same logits, state
    and decode steps as an eager prefill; a chunk longer than graph_prefill_tokens runs eagerly. (fp32: the
    pieces' attention kernel multiplies in TF32, the eager prefill's reference in fp32: 5e-4 apart on the H200.)"""
    import torch

    from .conftest import rel_error

    eng = engine(spec, dtype=dtype, kv=kv)
    ids = prompt()[:37]
    lane = borrowed_lane(eng)
    replays = eng.runner.replays
    drafter = eng.drafter
    with torch.inference_mode():
        if drafter is not None:
            drafter.prepare(lane)
        got = prefill(eng.runner, ids, lane, drafter)
        assert eng.runner.replays - replays == 3 and lane.length == 37 and lane.kept is None
        plain = eng.model.new_cache(256)
        want = prefill(eng.model, ids, plain)
        # the eager chunk's state: its chunked (WY) form and the pieces' token-by-token one (bf16: 2.7e-2 apart)
        assert rel_error(lane.states.recurrent, plain.states.recurrent) < state_tol
        # fp32: the pieces' logits against the eager chunk's, then decode steps on each cache. bf16: both against
        # the fp32 model (the same synthetic weights), the pieces no further off than the eager chunk (x1.5) or
        # within the bf16 bound (H200: 3.9e-2 and 2.8e-2; the tiny model's small logits give large relative errors)
        ref = eng.model if dtype == "float32" else engine(graphs=False).model
        exact_cache = plain if dtype == "float32" else ref.new_cache(256)
        exact = want if dtype == "float32" else prefill(ref, ids, exact_cache)
        for token in [None, *ids[:4]]:
            if token is not None:
                step = torch.tensor([token], device="cuda")
                got, want = eng.model.forward(step, lane), eng.model.forward(step, plain)
                exact = want if dtype == "float32" else ref.forward(step, exact_cache)
            off, eager_off = rel_error(got.reshape(-1), exact.reshape(-1)), rel_error(want.reshape(-1),
                                                                                      exact.reshape(-1))
            assert off < max(tol, 1.5 * eager_off), (token, off, eager_off)
        lane.reset()
        replays = eng.runner.replays
        prefill(eng.runner, prompt() * 3, lane)  # 192 tokens: more than graph_prefill_tokens (128)
        assert eng.runner.replays == replays
    lane.reset()


def test_held_conversation_in_host_memory_comes_back():
    """The host tier: a held conversation's KV and states wait in pinned host memory and are copied back into
    the lane for the next turn, which then gives a fresh run's tokens."""
    import torch

    eng = Engine(EngineConfig("synthetic:tiny", device="cuda", dtype="float32", host_kv_mib=64, host_state_slots=8))
    first = eng.complete(prompt(), GREEDY)
    (held,) = list(eng.held)
    torch.cuda.synchronize()
    rows = [t for store in held.cache.kv.rows.values() for t in store.values()]
    assert rows and all(t.device.type == "cpu" and t.is_pinned() for t in rows)
    assert held.cache.states.recurrent.device.type == "cpu" and held.cache.states.recurrent.is_pinned()
    follow = prompt() + first.token_ids + [5, 6, 7]
    again = eng.complete(follow, GREEDY)
    assert again.cached_tokens >= len(prompt())
    assert again.token_ids == engine(graphs=False).complete(follow, GREEDY).token_ids
