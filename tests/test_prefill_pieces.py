"""Short prefill chunks as padded 16-token steps that keep their GDN inputs and commit them (what the graph runner
replays for a chat turn's few new tokens), on the CPU: a stand-in runner pads each piece as a replayed graph does
(arbitrary ids in the padding, KV written past the sequence's end), and the result must equal a plain prefill's
logits, lengths and states, and the decode steps after it."""

import pytest
import torch

from engine import Engine, EngineConfig
from engine.runtime.generate import _steps, prefill

from .conftest import rel_error

PIECE = 16


class PaddedPieces:
    """The model's forward, with chunks of at most `short` tokens fed as padded pieces like `GraphRunner`'s."""

    def __init__(self, model, short: int) -> None:
        self.model, self.device, self.spec, self.short = model, model.device, model.spec, short
        self.padded_steps = 0

    def new_cache(self, max_len: int):
        return self.model.new_cache(max_len)

    def prefill_piece(self, tokens: int) -> int:
        return PIECE if tokens <= self.short else 0

    def forward(self, ids, cache, all_logits=False, capture=None, keep_steps=False, positions=None):
        if not keep_steps:
            return self.model.forward(ids, cache, all_logits, capture, keep_steps, positions)
        t, start = ids.shape[0], cache.length
        pad = torch.randint(0, self.spec.vocab_size, (PIECE - t,), generator=torch.Generator().manual_seed(t))
        logits = self.model.forward(torch.cat([ids, pad]), cache, all_logits=True, keep_steps=True)
        cache.length = start + t  # as after a replay: the padding's KV lies past the end
        self.padded_steps += 1
        return logits[:t]


@pytest.fixture(scope="module")
def model():
    return Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32")).model


def test_steps_split_short_chunks_into_pieces(model):
    runner = PaddedPieces(model, short=40)
    assert list(_steps(runner, 37, 512)) == [(0, 16, True), (16, 32, True), (32, 37, True)]
    # chunks of 32: each short, so in pieces; a 100-token prompt's last chunk of 4 too
    assert list(_steps(runner, 100, 32))[-2:] == [(80, 96, True), (96, 100, True)]
    assert list(_steps(runner, 100, 64)) == [(0, 64, False), (64, 80, True), (80, 96, True), (96, 100, True)]
    assert list(_steps(model, 37, 512)) == [(0, 37, False)]  # an eager model: one step


@pytest.mark.parametrize(("n", "chunk"), [(5, 512), (37, 512), (70, 32), (70, 48)])
def test_padded_pieces_give_the_plain_prefill(model, n, chunk):
    ids = torch.randint(0, model.spec.vocab_size, (n + 4,), generator=torch.Generator().manual_seed(n)).tolist()
    runner = PaddedPieces(model, short=40)
    plain, pieces = model.new_cache(256), model.new_cache(256)
    want, _ = prefill(model, ids[:n], plain, chunk)
    got, step = prefill(runner, ids[:n], pieces, chunk)
    assert runner.padded_steps > 0 and pieces.length == plain.length == n and pieces.steps is None
    assert step.ids == ids[(n - 1) // PIECE * PIECE if chunk > n else n - len(step.ids):n]
    assert rel_error(got, want) < 1e-5
    assert rel_error(pieces.states.recurrent, plain.states.recurrent) < 1e-5
    assert rel_error(pieces.states.conv, plain.states.conv) < 1e-5  # the last real inputs, not the padding's
    for token in ids[n:]:  # decode steps after it read the same KV and states
        a = model.forward(torch.tensor([token]), plain)
        b = model.forward(torch.tensor([token]), pieces)
        assert rel_error(b, a) < 1e-5
