"""The on-disk store of kernel tiles chosen by timing: a choice made by one launch is what the next launch on
the same GPU and Triton reads back; a changed candidate list or a damaged file means timing again, never a
stale or broken choice."""
import json

import pytest

pytest.importorskip("triton")

from engine.kernels import tiles  # noqa: E402
from engine.kernels.qmatmul import candidates  # noqa: E402


def test_a_choice_is_read_back_by_the_next_launch(tmp_path):
    path = tmp_path / "cache" / "kernel-tiles.json"
    options = candidates(17408, 5120, 132, "q4")
    k = tiles.key("NVIDIA H200", "qmatmul 17408x5120 q4 torch.bfloat16", options)
    tiles.use_file(str(path))
    assert tiles.lookup(k, options) is None
    tiles.record(k, options[3])
    tiles.use_file(str(path))  # a new launch reads the file
    assert tiles.lookup(k, options) == options[3]
    # another GPU, another problem or another candidate list are other keys
    assert tiles.lookup(tiles.key("NVIDIA GeForce RTX 4090", "qmatmul 17408x5120 q4 torch.bfloat16", options),
                        options) is None
    fewer = options[1:]
    assert tiles.lookup(tiles.key("NVIDIA H200", "qmatmul 17408x5120 q4 torch.bfloat16", fewer), fewer) is None
    assert json.loads(path.read_text())[k]["kernel"] == options[3].kernel


def test_a_damaged_file_is_an_empty_one(tmp_path):
    path = tmp_path / "kernel-tiles.json"
    path.write_text("{not json")
    tiles.use_file(str(path))
    options = candidates(5120, 17408, 132, "q5")
    k = tiles.key("NVIDIA H200", "qmatmul 5120x17408 q5 torch.bfloat16", options)
    assert tiles.lookup(k, options) is None
    tiles.record(k, options[0])  # and is replaced by a good one
    tiles.use_file(str(path))
    assert tiles.lookup(k, options) == options[0]
    tiles.use_file("")


def test_verify_steps_of_different_sizes_take_their_own_tiles():
    from engine.kernels.qmatmul import row_bucket

    assert row_bucket(1) == (1, "1 row")
    assert row_bucket(2) == (2, "2 rows")  # two batched sequences, K=1 verify
    assert row_bucket(3) == row_bucket(4) == (4, "3-4 rows")  # MTP K=3 verifies 4 rows
    assert row_bucket(5) == row_bucket(8) == (8, "5-8 rows")  # K=7 verifies 8
    assert row_bucket(9) == row_bucket(16) == (16, "9-16 rows")
    assert row_bucket(17) == row_bucket(32) == (32, "17-32 rows")  # four requests' K=7 verify rows
    assert row_bucket(33) == row_bucket(64) == (64, "33-64 rows")
