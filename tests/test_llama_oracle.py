"""Our GGUF llama path against transformers' own GGUF loader and llama implementation (fp32, CPU)."""
import pytest
import torch

from engine import SamplingParams

from .conftest import hf_greedy

PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n",
    "Q: Why is the sky blue during the day but red at sunset? Explain it simply for a child.\nA:",
]


@pytest.fixture(scope="module")
def hf_model(default_model_path):
    transformers = pytest.importorskip("transformers")
    from pathlib import Path

    p = Path(default_model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    model.eval()
    return model


def _prompt_64(engine, text: str) -> list[int]:
    ids = engine.tokenizer.encode(text * 8)[:64]
    assert len(ids) == 64
    return ids


@pytest.mark.parametrize("text", PROMPTS)
def test_logits_match_transformers(default_engine, hf_model, text):
    ids = _prompt_64(default_engine, text)
    cache = default_engine.model.new_cache(64)
    with torch.inference_mode():
        ours = default_engine.model.forward(torch.tensor(ids), cache, all_logits=True).double()
        ref = hf_model(torch.tensor([ids])).logits[0].double()
    rel = ((ours - ref).norm() / ref.norm()).item()
    assert rel < 1e-4, rel


@pytest.mark.parametrize("text", PROMPTS)
def test_greedy_continuation_matches_transformers(default_engine, hf_model, text):
    ids = default_engine.tokenizer.encode(text)
    ours = default_engine.complete(ids, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)).token_ids
    assert ours == hf_greedy(hf_model, ids, 32)
