"""Loading Qwen3.5 folders: the multimodal wrapper, the Qwen tokenizer and template, and bad folders."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import Engine, EngineConfig, ModelFormatError, SamplingParams
from engine.loaders import load_model

from .conftest import run_cli, write_tiny

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny"), seed=1)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_multimodal_wrapper_prefixes(tiny, tmp_path):
    folder = _copy(tiny, tmp_path / "mm")
    text_cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text_cfg,
                                                    "tie_word_embeddings": False}))
    tensors = load_file(folder / "model.safetensors")
    renamed = {(k if k == "lm_head.weight" else "model.language_model." + k[len("model."):]): v
               for k, v in tensors.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.randn(4, 4)  # vision tower: skipped, not an error
    renamed["mtp.fc.weight"] = torch.randn(64, 128)
    save_file(renamed, folder / "model.safetensors")
    wrapped = Engine(EngineConfig(model=str(folder), device="cpu", dtype="float32"))
    plain = Engine(EngineConfig(model=str(tiny), device="cpu", dtype="float32"))
    ids = list(range(30, 60))
    p = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert wrapped.complete(ids, p).token_ids == plain.complete(ids, p).token_ids
    from engine.loaders import load_model

    assert "mtp.fc.weight" in load_model(str(folder), torch.float32, torch.device("cpu")).weights  # kept by name
    assert not wrapped.model.mtp  # and freed by the engine unless spec = "mtp" drafts with it


def test_sharded_index_and_missing_shard(tiny, tmp_path):
    folder = _copy(tiny, tmp_path / "sharded")
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, folder / fname)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    loaded = load_model(str(folder), torch.float32, torch.device("cpu"))
    assert len(loaded.weights) == len(tensors)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="missing shard model-00002-of-00002.safetensors"):
        load_model(str(folder), torch.float32, torch.device("cpu"))


def test_unknown_model_type_is_exit_2(tiny, tmp_path):
    folder = _copy(tiny, tmp_path / "unknown")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "mamba2"}))
    r = run_cli("generate", "--model", str(folder), "--prompt-ids", "1,2")
    assert r.returncode == 2 and "model_type 'mamba2' is not supported" in r.stderr and "Traceback" not in r.stderr


def test_shape_mismatch_names_the_tensor(tiny, tmp_path):
    folder = _copy(tiny, tmp_path / "shape")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(ModelFormatError, match=r"tensor 'layers\.0\.mlp\.gate_proj\.weight' has shape \(128, 64\)"):
        Engine(EngineConfig(model=str(folder), device="cpu"))


def test_missing_tensor_is_named(tiny, tmp_path):
    folder = _copy(tiny, tmp_path / "missing")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.linear_attn.A_log"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelFormatError, match="layers.1.linear_attn.A_log"):
        Engine(EngineConfig(model=str(folder), device="cpu"))


def test_qwen_tiktoken_special_ids():
    from engine.tokenizer.qwen_tiktoken import QwenTiktokenTokenizer

    tok = QwenTiktokenTokenizer()
    assert tok.encode("<|im_start|>") == [248045]
    assert tok.encode("<think>") == [248068] and tok.encode("</think>") == [248069]
    assert tok.vocab_size == 248044 + 33
    text = "def f(x):\n    return 日本語 🚀  x"
    assert tok.decode(tok.encode(text)) == text
    stream = tok.stream()
    assert "".join(stream.push(i) for i in tok.encode(text)) == text
    # ids in the checkpoint's padded embedding rows (past 248,077) decode to nothing, in a stream too
    padded = [*tok.encode("ab"), 248225, 248319, *tok.encode("c")]
    assert tok.decode(padded) == "abc"
    stream = tok.stream()
    assert "".join(stream.push(i) for i in padded) == "abc"


def test_builtin_template_formats_tools_and_thinking():
    from engine.tokenizer.chat_template import ChatTemplate
    from engine.tokenizer.hf_folder import BUILTIN_TEMPLATES

    tpl = ChatTemplate((BUILTIN_TEMPLATES / "qwen3_5.jinja").read_text())
    tools = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Open a.py"},
        {"role": "assistant", "content": "", "reasoning_content": "I should read it.",
         "tool_calls": [{"function": {"name": "read", "arguments": '{"path": "a.py"}'}}]},
        {"role": "tool", "content": "print(1)"},
    ]
    out = tpl.render(messages, tools=tools)
    assert out.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '{"name": "read", "parameters": {"type": "object"}}' in out
    assert "<think>\nI should read it.\n</think>\n\n" in out
    assert "<tool_call>\n<function=read>\n<parameter=path>\na.py\n</parameter>\n</function>\n</tool_call>" in out
    assert "<|im_start|>user\n<tool_response>\nprint(1)\n</tool_response>\n<|im_end|>" in out
    assert out.endswith("<|im_start|>assistant\n<think>\n")
    no_think = tpl.render(messages[:2], enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_synthetic_preset_runs():
    eng = Engine(EngineConfig(model="synthetic:tiny", device="cpu"))
    ids = eng.encode_chat([{"role": "user", "content": "hi"}])
    out = eng.complete(ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert out.completion_tokens == 8
