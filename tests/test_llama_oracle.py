"""Our GGUF llama path against transformers' own GGUF loader and llama implementation (fp32, CPU)."""
import pytest
import torch

from engine import SamplingParams

from .conftest import hf_greedy

pytestmark = pytest.mark.slow  # transformers' GGUF loader and forward are the oracle

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


def test_hf_llama_folder_loads_like_the_gguf(default_engine, hf_model, tmp_path):
    # transformers' dequantized copy of the GGUF, written as a HF llama folder; ours must read it identically.
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous().clone() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, tmp_path / "model.safetensors")

    from transformers import AutoTokenizer

    src = Path(default_engine.model_name)
    AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name).save_pretrained(tmp_path)
    from engine import Engine, EngineConfig

    folder = Engine(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32"))
    ids = default_engine.tokenizer.encode(PROMPTS[1])
    assert folder.tokenizer.encode(PROMPTS[1]) == ids
    with torch.inference_mode():
        a = folder.model.forward(torch.tensor(ids), folder.model.new_cache(len(ids)), all_logits=True)
        b = default_engine.model.forward(torch.tensor(ids), default_engine.model.new_cache(len(ids)), all_logits=True)
    assert ((a - b).norm() / b.norm()).item() < 1e-5
