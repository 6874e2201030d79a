"""The DFlash block forward as its CUDA graph runs it (block K/V written after the context, attention by the
device-position kernel: non-causal full layers, causal sliding-window layers) against the reference forward
(cached context + block K/V concatenated, masked SDPA): in the Triton interpreter on the CPU; the graphs
themselves are checked on a GPU by tests/test_runner.py (same accepted drafts with and without graphs)."""
import pytest

from .conftest import interpret

CHECK = """
import torch
from engine import Engine, EngineConfig, SamplingParams
from engine.runtime.generate import generate

eng = Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", spec="dflash",
                          drafter="synthetic:dflash-tiny", draft_tokens=7))
dr = eng.drafter
cache = eng.model.new_cache(128)
params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)  # rounds with drafts, past the window
with torch.inference_mode():
    list(generate(eng.model, eng.tokenizer, list(range(5, 29)), params, cache, 16, drafter=dr, draft_tokens=7))
    seq = cache.draft
    start = seq.length  # past the tiny drafter's sliding window (16): the window matters
    b = max(dr.d.block_size, 8)
    block = torch.tensor([3] + [dr.d.mask_token_id] * (b - 1))
    pos = torch.arange(start, start + b)
    want = dr._block([seq.kv], block, pos, 7, eager_starts=[start])[1]
    got = dr._block([seq.kv], block, pos, 7)[1]
print(((got - want).norm() / want.norm()).item() if start > 16 else -1.0)
"""


@pytest.mark.slow
def test_block_forward_on_the_kernel_path_matches_the_reference_in_the_interpreter():
    assert 0.0 <= interpret(CHECK) < 1e-5
