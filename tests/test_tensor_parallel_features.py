"""Tensor parallelism on the CPU (two processes over gloo) with what runs beside the sharded target: the MTP and
DFlash drafters (on rank 0 alone, over the target's taps and its whole embedding and LM head) make the same
guesses and keep the same drafts round for round as in one process, with the same tokens and logprobs; prompts
with images (the tower on rank 0, their embeddings sent to the other ranks) give one process's logits and
tokens; held conversations in the host tier (each rank its heads' KV in host memory) serve the next turns as in
one process, and so do those written to the disk tier, whose files (gathered on rank 0) are one process's."""
from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, FinishEvent, SamplingParams

from .conftest import admitted_together, rel_error
from .test_tensor_parallel import same_output

SETTINGS = dict(device="cpu", dtype="float32", threads=1, adaptive_drafts=False, draft_tokens=3,
                draft_acceptance=0.6)  # drafts learned from the first pass, right at a set rate: rounds keep some


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return rel_error(got.double(), want.double()) if want.any() else float(got.any())


def drafting(engine: Engine) -> list[list[int]]:
    """The real drafter's guesses, each call's rows as host ids, as the engine runs (the controlled drafter in
    front of it drafts from what the first pass learned)."""
    inner, guesses = engine.drafter.inner, []
    propose = inner.propose_rows

    def spy(*args):
        out = propose(*args)
        guesses.extend(torch.as_tensor(row).tolist() for row in out)
        return out

    inner.propose_rows = spy
    return guesses


@pytest.mark.parametrize("spec, drafter", [("mtp", ""), ("dflash", "synthetic:dflash-tiny")])
def test_drafter_rounds_over_two_ranks_are_one_process_rounds(spec, drafter):
    """Two passes of one request: the second one's rounds keep part of their drafts (the drafter observes the
    kept runs, its KV cut back past them); each pass gives the one-process tokens, logprobs, drafted and accepted
    counts, and the real drafter's guesses are the one-process ones throughout."""
    prompt, params = list(range(40, 80)), SamplingParams(temperature=0, logprobs=0, max_tokens=16)
    runs = []
    for n in (1, 2):
        engine = Engine(EngineConfig("synthetic:tiny", spec=spec, drafter=drafter, tensor_parallel=n, **SETTINGS))
        try:
            guesses = drafting(engine)
            runs.append(([engine.complete(prompt, params) for _ in range(2)], guesses))
        finally:
            engine.close()
    (want, want_guesses), (got, got_guesses) = runs
    for a, b in zip(want, got, strict=True):
        assert same_output(a, b)
        assert (b.spec.drafted, b.spec.accepted) == (a.spec.drafted, a.spec.accepted)
    assert got[1].spec.accepted > 0
    assert got_guesses == want_guesses and len(got_guesses) > 10


def test_prompts_with_images_over_two_ranks_are_one_process_prompts(vl_folder):
    """Prompt logits with two images, whole and in chunks of 7 that cut them, equal one process's (< 1e-5
    relative); a request with an image decoding beside a text request (rows with M-RoPE positions and rows
    without in one step) gets one process's tokens and logprobs."""
    from engine.media.prompt import expand_pads

    from .test_vision_oracle import our_logits, pads, random_image, template_ids

    images = [random_image((1, 6, 4), 3), random_image((1, 4, 8), 4)]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    results = []
    for n in (1, 2):
        engine = Engine(EngineConfig(str(vl_folder), device="cpu", dtype="float32", threads=1,
                                     image_max_pixels=64 * 64, max_concurrency=2, tensor_parallel=n))
        try:
            ids = expand_pads(template_ids(engine, images), pads(engine), images)
            logits = [our_logits(engine, ids, images, chunk) for chunk in (len(ids), 7)]
            with admitted_together(engine):
                streams = [engine.submit(template_ids(engine, images[:1], seed=4), greedy, images[:1]),
                           engine.submit(list(range(30, 60)), greedy)]
            results.append((logits, [[e for e in s if isinstance(e, FinishEvent)][0] for s in streams]))
        finally:
            engine.close()
    (want_logits, want), (got_logits, got) = results
    for a, b in zip(want_logits, got_logits, strict=True):
        assert rel_error(b, a) < 1e-5
    assert all(same_output(a, b) for a, b in zip(want, got, strict=True))


def test_host_tier_over_two_ranks_serves_next_turns_as_one_process():
    """A conversation held in the host tier, an edited reply that shares it from its prompt-end checkpoint (each
    rank's KV copied back into the sharer's blocks; it stays held), then the next turn that takes it over: the
    one-process tokens, logprobs and cached counts."""
    from engine.parallel.leader import SharedHostKV

    prompt = list(range(120, 190))
    greedy = SamplingParams(max_tokens=8, temperature=0, logprobs=0)
    runs = []
    for n in (1, 2):
        engine = Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", threads=1, host_kv_mib=1,
                                     host_state_slots=4, tensor_parallel=n))
        try:
            first = engine.complete(prompt, greedy)
            assert n == 1 or all(isinstance(h.cache.kv, SharedHostKV) for h in engine.held)
            edited = engine.complete(prompt + [(first.token_ids[0] + 1) % 256, 8], greedy)
            runs.append([first, edited, engine.complete(prompt + first.token_ids + [5, 6, 7], greedy)])
        finally:
            engine.close()
    want, got = runs
    for a, b in zip(want, got, strict=True):
        assert same_output(a, b) and b.cached_tokens == a.cached_tokens
    assert got[1].cached_tokens == len(prompt) and got[2].cached_tokens == len(prompt) + 7


@pytest.mark.parametrize("host_kv_mib", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_disk_tier_over_two_ranks_writes_and_reads_one_process_files(tmp_path, host_kv_mib):
    """One held place: a conversation evicted by the next goes to disk (its KV and states gathered from every
    rank), a next turn reads it back (each rank taking its heads), and the engine's close writes what it holds.
    Tokens, logprobs and cached counts are one process's; so are the files: the same names (the same identity)
    and the same tensors (up to the ranks' partial sums). With the host tier the held KV goes to disk from host
    memory."""
    from safetensors.torch import load_file

    a, b = list(range(120, 200)), list(range(10, 60))
    greedy = SamplingParams(max_tokens=8, temperature=0, logprobs=0)
    runs = []
    for n in (1, 2):
        engine = Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", threads=1, held_sequences=1,
                                     held_dir=str(tmp_path / str(n)), held_disk_mib=64, host_kv_mib=host_kv_mib,
                                     tensor_parallel=n))
        try:
            first = engine.complete(a, greedy)
            outputs = [first, engine.complete(b, greedy)]  # a goes to disk
            engine.held.disk.flush()
            outputs.append(engine.complete(a + first.token_ids + [5, 6], greedy))  # read back; b goes to disk
        finally:
            engine.close()
        runs.append(outputs)
    for want, got in zip(*runs, strict=True):
        assert same_output(want, got) and got.cached_tokens == want.cached_tokens
    assert runs[1][2].cached_tokens == len(a) + 7
    files = [sorted(p.name for p in (tmp_path / str(n)).glob("*.safetensors")) for n in (1, 2)]
    assert files[0] == files[1] and len(files[0]) == 2
    for name in files[0]:
        want, got = (load_file(tmp_path / str(n) / name) for n in (1, 2))
        assert want.keys() == got.keys()
        for key, t in want.items():
            assert got[key].shape == t.shape and relative(got[key], t) < 1e-5, key
