"""A batched decode step (`forward_batch`: one token for each of several sequences, the weights read once) gives
each sequence the logits and the cache its own single-sequence step gives: on the torch reference path (fp32,
the hybrid model and the llama-architecture default model), and on the kernel path in the Triton interpreter
with int8 KV and quantized weights (the matmuls then multiply 3 rows at once, attention and the GDN recurrence
run per sequence)."""
import pytest

from .conftest import defined, gpu_only, interpret

CHECK = """
import torch
from engine import Engine, EngineConfig
from engine.config import WeightFormats

def twin(m, cache):
    # a second cache of the sequence in `cache` (its own pool, the same blocks and state): what a second prefill
    # of the same prompt makes, without running it
    out = m.new_cache(32)
    assert out.kv.table.ids == cache.kv.table.ids
    for name in cache.kv.store.names():
        getattr(out.kv.store, name).copy_(getattr(cache.kv.store, name))
    if cache.states is not None:
        out.states.restore(cache.states)
    out.length = cache.length
    return out

def compare(kv_dtype, weights, device="cpu", model="synthetic:tiny"):
    eng = Engine(EngineConfig(model, device=device, dtype="float32", kv_dtype=kv_dtype, weights=weights,
                              cuda_graphs=False))
    m = eng.model
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (n,), generator=g).to(device) for n in (5, 12, 9)]  # different lengths
    nxt = torch.randint(0, 256, (3,), generator=g).to(device)
    with torch.inference_mode():
        alone, together = [], []
        for p in prompts:
            c = m.new_cache(32)
            m.forward(p, c)
            together.append(c)
            alone.append(twin(m, c))
        want = torch.cat([m.forward(nxt[b:b + 1], alone[b]) for b in range(3)])
        got = m.forward_batch(nxt, together)
        worst = ((got - want).norm() / want.norm()).item()
        for a, b in zip(alone, together):  # the caches moved on alike
            assert a.length == b.length
            if a.states is not None:
                worst = max(worst, ((a.states.recurrent - b.states.recurrent).norm()
                                    / a.states.recurrent.norm()).item())
            for layer in range(a.kv.store.spec.layers):
                ka, kb = a.kv.read(layer, a.length)[0], b.kv.read(layer, b.length)[0]
                worst = max(worst, (ka.float() - kb.float()).abs().max().item())
    return worst
"""


def test_batched_step_matches_single_steps_on_the_reference_path(default_model_path):
    from engine.config import WeightFormats

    scope = defined(CHECK)
    assert scope["compare"]("auto", WeightFormats()) < 1e-5
    assert scope["compare"]("auto", WeightFormats(), model=default_model_path) < 1e-5


PIN_INT8_MMA = """
from engine.kernels import qmatmul
every = qmatmul.candidates
# one kernel for 1 and 3 rows (the tile lists differ per row count; float-row and int8-row kernels round
# differently, which random tiny models amplify): int8_mma multiplies each row alike whatever the others are
qmatmul.candidates = lambda n, k, sms, fmt, rows=None, tiled=False: [
    c for c in every(n, k, sms, fmt) if c.kernel == "int8_mma"][:1]
"""


@pytest.mark.slow
def test_batched_step_matches_single_steps_on_the_kernel_path_in_the_interpreter():
    code = PIN_INT8_MMA + CHECK + "\nprint(compare('int8', WeightFormats(mlp='q8', gdn='q8')))"
    assert interpret(code) < 1e-4


@gpu_only
def test_batched_step_matches_single_steps_on_the_gpu(monkeypatch):
    from engine.config import WeightFormats
    from engine.kernels import qmatmul

    every = qmatmul.candidates
    monkeypatch.setattr(qmatmul, "candidates",  # as PIN_INT8_MMA, undone after the test
                        lambda n, k, sms, fmt, rows=None, tiled=False: [
                            c for c in every(n, k, sms, fmt) if c.kernel == "int8_mma"][:1])
    monkeypatch.setattr(qmatmul, "_chosen", {})
    assert defined(CHECK)["compare"]("int8", WeightFormats(mlp="q8", gdn="q8"), "cuda") < 1e-4
