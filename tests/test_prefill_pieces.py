"""Short prefill chunks as padded 16-token steps that keep their GDN inputs and commit them (what the graph runner
replays for a chat turn's few new tokens), on the CPU: a stand-in runner pads each piece as a replayed graph does
(arbitrary ids in the padding, KV written past the sequence's end), and the result must equal a plain prefill's
logits, lengths and states, and the decode steps after it."""

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.runtime.generate import generate

from .conftest import rel_error

PIECE = 16


class PaddedPieces:
    """The model's forward, with chunks of at most `short` tokens fed as padded pieces like `GraphRunner`'s."""

    def __init__(self, model, short: int) -> None:
        self.model, self.device, self.geometry, self.short = model, model.device, model.geometry, short
        self.padded_steps = 0

    def new_cache(self, max_len: int):
        return self.model.new_cache(max_len)

    def prefill_piece(self, tokens: int) -> int:
        return PIECE if tokens <= self.short else 0

    def graphed(self, cache) -> bool:
        return True

    def forward(self, ids, cache, all_logits=False, taps=None, keep_inputs=False, positions=None):
        if not keep_inputs:
            return self.model.forward(ids, cache, all_logits, taps, keep_inputs, positions)
        t, start = ids.shape[0], cache.length
        pad = torch.randint(0, self.geometry.vocab_size, (PIECE - t,), generator=torch.Generator().manual_seed(t))
        logits = self.model.forward(torch.cat([ids, pad]), cache, all_logits=True, keep_inputs=True)
        cache.length = start + t  # as after a replay: the padding's KV lies past the end
        self.padded_steps += 1
        return logits[:t]


@pytest.fixture(scope="module")
def eng():
    return Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32"))


@pytest.mark.parametrize(("n", "chunk"), [(5, 512), (37, 512), (70, 32), (70, 48)])
def test_padded_pieces_give_the_plain_prefill(eng, n, chunk):
    """The engine core's prefill through the stand-in runner (chunks of at most 40 tokens as padded pieces, longer
    ones in one step) leaves the cache a plain prefill leaves, and the greedy tokens after it are the same."""
    model, tok = eng.model, eng.tokenizer
    ids = torch.randint(0, model.geometry.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    runner = PaddedPieces(model, short=40)
    plain, pieces = model.new_cache(256), model.new_cache(256)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    want = [e for e in generate(model, tok, ids, params, plain, chunk)][-1]
    got = [e for e in generate(runner, tok, ids, params, pieces, chunk)][-1]
    assert runner.padded_steps >= (n + PIECE - 1) // PIECE * (chunk <= 40 or n <= 40)
    assert got.token_ids == want.token_ids and pieces.length == plain.length and pieces.kept is None
    assert rel_error(pieces.states.recurrent, plain.states.recurrent) < 1e-5
    assert rel_error(pieces.states.conv, plain.states.conv) < 1e-5  # the last real inputs, not the padding's
