"""Long context end to end against transformers' qwen3_5 (fp32, on the CPU) on the same files: a tiny hybrid
model with the real model's position range and rope (262,144 positions, theta 1e7, partial rotary 0.25), a random
prompt of 16K tokens (64K and 256K on a GPU: NINFER_TEST_DEVICE=cuda), run through the engine core as a request
(the prompt prefilled in chunks of the 256k-long profile's size) in each KV format: the last prompt token's
logits, the recurrent state after the prefill, greedy decoding, and the next turn served by the held
conversation. And a needle: a span at a 16K prompt's start that the greedy continuation depends on, decoded as
transformers decodes it with bf16 and int8 KV."""
import os
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams

from .conftest import gpu_only, rel_error, write_tiny

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # transformers' forward is the oracle

DEVICE = os.environ.get("NINFER_TEST_DEVICE", "cpu")
# The real config's position range and rope; two attention layers (interval 2) so both KV layers of a format
# and the GDN layers between them are on the path.
LONG = {"max_position_embeddings": 262144, "full_attention_interval": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}}
GREEDY, FOLLOW_UP, NEW_TURN = 64, 16, 32  # tokens decoded, decoded in the next turn, and the next turn's own


def _chunk() -> int:
    from ninfer_tui import profiles

    return profiles.load("256k-long").prefill_chunk


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("long"), seed=29, **LONG)


# The longest prompt leaves the position range room for the replies and the next turn (the engine refuses a
# prompt whose max_tokens would run past it).
ROOM = 256


@pytest.fixture(scope="module", params=[16384, pytest.param(65536, marks=gpu_only),
                                        pytest.param(262144 - ROOM, marks=gpu_only)], ids=lambda n: f"{-(-n // 1024)}k")
def reference(request, folder):
    """transformers' run of the prompt: its last logits, the GDN layers' states after it, its greedy
    continuation, and its greedy reply to the next turn (the prompt, the continuation and new tokens)."""
    n = request.param
    g = torch.Generator().manual_seed(n)
    # a span at the start comes back at the end: the continuation of a repeated span from 16K (to 256K) back
    span = torch.randint(256, 512, (64,), generator=g).tolist()
    prompt = span + torch.randint(0, 256, (n - 2 * len(span),), generator=g).tolist() + span
    new_turn = torch.randint(0, 256, (NEW_TURN,), generator=g).tolist()
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():
        res = ref(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        logits, past = res.logits[0, -1].clone(), res.past_key_values
        gdn = [layer for layer in past.layers if hasattr(layer, "recurrent_states")]
        states = (torch.stack([layer.recurrent_states[0][0].clone() for layer in gdn]),
                  torch.stack([layer.conv_states[0][0].clone() for layer in gdn]))
        out = _greedy(ref, past, logits, [], GREEDY)
        # the next turn: the last output token (not yet fed) and the new tokens, then its reply
        turn = ref(torch.tensor([[out[-1], *new_turn]]), past_key_values=past, use_cache=True, logits_to_keep=1)
        reply = _greedy(ref, turn.past_key_values, turn.logits[0, -1], [], FOLLOW_UP)
    return {"prompt": prompt, "logits": logits, "states": states, "greedy": out,
            "next_turn": prompt + out + new_turn, "reply": reply}


def _greedy(model, past, logits: torch.Tensor, out: list[int], n: int) -> list[int]:
    """n greedy tokens from the logits of the last token fed, each fed back through transformers' cache."""
    out.append(int(logits.argmax()))
    while len(out) < n:
        logits = model(torch.tensor([[out[-1]]]), past_key_values=past, use_cache=True).logits[0, -1]
        out.append(int(logits.argmax()))
    return out


class PrefillSpy:
    """The engine core's forward target, passed through: it keeps the sizes of the prompt's prefill steps and the
    logits of the step that ends the prompt (the engine hands out tokens, not logits)."""

    def __init__(self, target, prompt_tokens: int) -> None:
        self._target, self._prompt = target, prompt_tokens
        self.steps: list[int] = []
        self.logits: torch.Tensor | None = None

    def __getattr__(self, name: str):
        return getattr(self._target, name)

    def forward(self, ids: torch.Tensor, cache, **kwargs) -> torch.Tensor:
        before = cache.length
        out = self._target.forward(ids, cache, **kwargs)
        if before < self._prompt:
            self.steps.append(ids.shape[0])
            if cache.length == self._prompt:
                self.logits = out[-1].clone()
        return out


def _engine(folder: Path, kv_dtype: str, tokens: int) -> Engine:
    return Engine(EngineConfig(model=str(folder), device=DEVICE, dtype="float32", kv_dtype=kv_dtype,
                               max_context=tokens + GREEDY + NEW_TURN + FOLLOW_UP + 64, prefill_chunk=_chunk(),
                               held_sequences=1))


def _prefill(eng: Engine, prompt: list[int], max_tokens: int):
    """Run the prompt as a request; the last prompt token's logits, the GDN state the engine kept at the prompt's
    end (its checkpoint there), and the output."""
    spy = eng.core.target = PrefillSpy(eng.core.target, len(prompt))
    done = eng.complete(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    chunk = eng.config.prefill_chunk
    assert spy.steps == [chunk] * (len(prompt) // chunk) + ([len(prompt) % chunk] if len(prompt) % chunk else [])
    (held,) = list(eng.held)
    return spy.logits, held.checkpoints[len(prompt)], done


def _state_error(got, want: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    """Relative errors of the recurrent states and of the conv windows (transformers keeps K inputs, the engine
    the last K-1: the K-th is never read again)."""
    recurrent, conv = want
    return (rel_error(got.recurrent, recurrent),
            rel_error(got.conv, conv[..., -got.conv.shape[1]:].transpose(1, 2)))


# The bounds, as relative L2 errors against the fp32 reference. fp32 KV: only the engine's own fp32 rounding in
# another order (chunked WY-form GDN, blocked attention). bf16 KV rounds each K/V element to 2^-9 of itself, int8
# to 1/254 of its (token, head) absmax, fp8 e4m3 to 2^-4 of itself; those roundings are independent across the
# thousands of keys an attention row averages, so the logits and the state move by a small fraction of one
# element's error. Each bound is about 10x the error of the 16K run on the CPU and still fails a
# misplaced block, a wrong scale or a lost position (errors of order 1).
BOUNDS = {"auto": 1e-5, "bf16": 3e-4, "int8": 1e-3, "fp8": 5e-3}


@pytest.mark.parametrize("kv_dtype", ["auto", "bf16"])
def test_long_prompt_greedy_and_next_turn_match_transformers(reference, folder, kv_dtype):
    prompt = reference["prompt"]
    eng = _engine(folder, kv_dtype, len(prompt))
    logits, state, done = _prefill(eng, prompt, GREEDY)
    logit_error, (recurrent_error, conv_error) = rel_error(logits, reference["logits"]), _state_error(
        state, reference["states"])
    print(f"{len(prompt)} tokens, {kv_dtype} KV: logits {logit_error:.2e}, recurrent state {recurrent_error:.2e}, "
          f"conv window {conv_error:.2e}")
    assert max(logit_error, recurrent_error, conv_error) < BOUNDS[kv_dtype]
    assert done.token_ids == reference["greedy"]
    # the next turn continues the held conversation: only its new tokens are prefilled
    reply = eng.complete(reference["next_turn"], SamplingParams(max_tokens=FOLLOW_UP, temperature=0,
                                                                ignore_eos=True))
    assert reply.cached_tokens == len(prompt) + GREEDY - 1
    assert reply.token_ids == reference["reply"]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_long_prompt_with_8bit_kv_within_its_bound(reference, folder, kv_dtype):
    prompt = reference["prompt"]
    logits, state, _ = _prefill(_engine(folder, kv_dtype, len(prompt)), prompt, 1)
    logit_error, (recurrent_error, conv_error) = rel_error(logits, reference["logits"]), _state_error(
        state, reference["states"])
    print(f"{len(prompt)} tokens, {kv_dtype} KV: logits {logit_error:.2e}, recurrent state {recurrent_error:.2e}, "
          f"conv window {conv_error:.2e}")
    assert max(logit_error, recurrent_error, conv_error) < BOUNDS[kv_dtype]


# ---- a needle in a haystack ------------------------------------------------------------------------------------
# A random span at the start of a prompt whose filler is one token repeated, and the span's first NEEDLE_CUE tokens
# again at the end: the haystack carries nothing of its own, so what the continuation takes from far back is the
# span's (among random filler a random model's greedy tokens did not move with it). The seed's needle is one the
# reference's continuation depends on within NEEDLE_GREEDY tokens, with no near tie among them (each step's top two
# logits at least 7e-4 of the logits' norm apart, several times the bf16 and int8 KV formats' error): the test
# asserts the dependence, so a path that lost the early context, which gives the haystack's continuation, fails it.
NEEDLE, NEEDLE_CUE, NEEDLE_GREEDY = 64, 8, 8


def _reference_greedy(folder: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            res = ref(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
            out.append(_greedy(ref, res.past_key_values, res.logits[0, -1], [], n))
    return out


@pytest.fixture(scope="module")
def needle(folder):
    """The needle prompt (16K tokens, on the CPU), transformers' greedy continuation of it, and of the haystack
    alone (the span replaced by filler, the cue kept)."""
    n = 16384
    g = torch.Generator().manual_seed(n + 17)
    span = torch.randint(256, 512, (NEEDLE,), generator=g).tolist()
    filler = [int(torch.randint(0, 256, (1,), generator=g))] * (n - NEEDLE - NEEDLE_CUE)
    prompt = span + filler + span[:NEEDLE_CUE]
    greedy, without = _reference_greedy(folder, [prompt, filler[:NEEDLE] + filler + span[:NEEDLE_CUE]],
                                        NEEDLE_GREEDY)
    return {"prompt": prompt, "greedy": greedy, "without": without}


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_a_needle_far_back_steers_the_greedy_continuation_as_in_transformers(needle, folder, kv_dtype):
    assert needle["greedy"] != needle["without"]  # the reference's continuation depends on the far span
    prompt = needle["prompt"]
    done = _engine(folder, kv_dtype, len(prompt)).complete(
        prompt, SamplingParams(max_tokens=NEEDLE_GREEDY, temperature=0, ignore_eos=True))
    assert done.token_ids == needle["greedy"]
