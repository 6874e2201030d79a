"""The batch verify graph's replay (`GraphRunner._replay_verify`) on the CPU, its graph a stand-in whose logits and
taps record the ids and positions they were replayed with: each row's tokens land at its lane's places, every
lane's positions follow its length, the wanted logits and taps' rows come back in row order, and the step's
indices reach the device in one copy."""
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from engine.models.decoder import Row
from engine.models.taps import Taps
from engine.runtime import runner as runner_module
from engine.runtime.runner import GraphRunner, _Graph

K = 2  # drafts: a lane has K + 1 places
T = K + 1
LANES = 3


@dataclass
class _Cache:
    length: int
    kept: object = None
    media: object = None  # no images
    commits: list = field(default_factory=list)

    def commit(self, fed: int, kept: int) -> None:
        self.commits.append((fed, kept))
        self.length -= fed - kept


class _Recording:
    """A graph whose replay writes, for each place, its id * 1000 + its position into logits and taps."""

    def __init__(self, g: _Graph) -> None:
        self.g = g

    def replay(self) -> None:
        g = self.g
        value = (g.ids * 1000 + g.positions).float()
        g.logits.copy_(value[:, None].expand_as(g.logits))
        g.taps.layers[0].copy_(value[:, None].expand_as(g.taps.layers[0]))
        g.taps.hidden.copy_(-value[:, None].expand_as(g.taps.hidden))


def _runner(caches: list[_Cache]) -> tuple[GraphRunner, _Graph]:
    runner = GraphRunner.__new__(GraphRunner)  # the replay alone: no model, no capture
    runner.draft_tokens, runner.device, runner.verify_replays = K, torch.device("cpu"), 0
    runner.lanes = SimpleNamespace(caches=caches)
    n = LANES * T
    taps = Taps((0,), True, {0: torch.zeros(n, 2)}, torch.zeros(n, 2))
    g = _Graph(None, torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long), torch.zeros(n, 4),
               taps, [f"kept{i}" for i in range(LANES)])
    g.graph = _Recording(g)
    return runner, g


def test_rows_land_at_their_lanes_places_and_come_back_in_row_order(monkeypatch):
    copies = []

    def counted(values, device, dtype=torch.long):
        copies.append(list(values))
        return torch.tensor(values, dtype=dtype, device=device)

    monkeypatch.setattr(runner_module, "to_device", counted)
    caches = [_Cache(10), _Cache(20), _Cache(30)]
    runner, g = _runner(caches)
    # lane 2 verifies two drafts, lane 0 is a plain decode row (one token, last logits, committed at once)
    rows = [Row(caches[2], 3, keep_inputs=True, all_logits=True), Row(caches[0], 1)]
    ids = torch.tensor([7, 8, 9, 5])
    taps = Taps((0,), True)
    logits = runner._replay_verify(g, [2, 0], ids, rows, taps)

    assert len(copies) == 1  # places, positions and wanted rows in one host-to-device copy
    fed = [(7, 30), (8, 31), (9, 32), (5, 10)]  # (id, position) of each fed token, in row order
    want = torch.tensor([float(i * 1000 + p) for i, p in fed])
    assert torch.equal(logits[:, 0], want) and logits.shape == (4, 4)
    assert torch.equal(taps.layers[0][:, 0], want) and torch.equal(taps.hidden[:, 0], -want)
    assert g.positions.tolist() == [10, 11, 12, 20, 21, 22, 30, 31, 32]
    assert runner.verify_replays == 1
    assert (caches[2].length, caches[2].kept, caches[2].commits) == (33, "kept2", [])
    assert (caches[0].length, caches[0].kept, caches[0].commits) == (11, "kept0", [(1, 1)])
    assert caches[1].length == 20  # a lane with no row keeps its length


def test_a_decode_row_alone_gives_its_last_logits():
    caches = [_Cache(4), _Cache(0), _Cache(0)]
    runner, g = _runner(caches)
    logits = runner._replay_verify(g, [1], torch.tensor([3, 6]), [Row(caches[1], 2, keep_inputs=True)], None)
    assert logits[:, 0].tolist() == [6 * 1000 + 1]  # the row's last token, at position 1
