"""GGUF `qwen35` against llama.cpp itself: tiny random Qwen3.5 models written by transformers, converted by
llama.cpp's convert_hf_to_gguf.py, quantized by llama.cpp's quantizer, and run by llama.cpp (llama-cpp-python).

Needs a llama-cpp-python build and llama.cpp's source tree (for the converter) in LLAMA_CPP_SRC; otherwise every
test skips. Run it with scripts/check_gguf_oracle.sh, which prepares both (`-m llama_cpp`).

What is compared, for f32 files and each quantization (Q8_0, Q6_K, Q5_K, Q4_K, IQ4_XS, and a mixed Q4_K_M):
- every tensor ninfer loads (the file's blocks decoded) equals, bit for bit, what llama.cpp's own decoder makes of
  it (its quantizer asked for F32 output with re-quantization allowed);
- logits of an 88-token chunk and 8 one-token steps (on the CPU kernels' dot products): ninfer on the quantized
  file against llama.cpp on those decoded weights (both compute in fp32);
- logits: ninfer against llama.cpp on the quantized file itself. llama.cpp's CPU matmuls round the activations to
  8 bits (Q8_0 / Q8_K) in every quantized product, so it stands a few percent from its own decoded weights on these
  models; the check is that ninfer is no further from it than that;
- for f32: ninfer against llama.cpp and against transformers on the source folder.
"""
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import Engine, EngineConfig
from engine.loaders import load_model
from engine.models.qwen3_5 import mtp_shapes
from engine.models.spec import spec_from_hf_config
from engine.quant.gguf_blocks import GGUFWeight, dequantize

from .conftest import LLAMA_CPP_CONVERT, rel_error, write_tiny

pytestmark = pytest.mark.llama_cpp
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/check_gguf_oracle.sh)")
transformers = pytest.importorskip("transformers")
SRC = Path(os.environ.get("LLAMA_CPP_SRC", "/nonexistent"))
if not (SRC / "convert_hf_to_gguf.py").is_file():
    pytest.skip("LLAMA_CPP_SRC does not point at llama.cpp's source tree (scripts/check_gguf_oracle.sh)",
                allow_module_level=True)

# 256-wide rows throughout: the K-quants' super-block (narrower rows fall back to other types). llama.cpp's qwen35
# graph takes the GDN value heads to be as wide as the key heads.
BASE = {"hidden_size": 256, "intermediate_size": 512, "linear_key_head_dim": 64, "linear_value_head_dim": 64}
CONFIGS = {
    "gva2-mtp": {**BASE, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                 "linear_num_key_heads": 2, "linear_num_value_heads": 4, "mtp_num_hidden_layers": 1},
    "pattern-tied": {**BASE, "num_hidden_layers": 6, "layer_types": ["full_attention", "linear_attention",
                                                                     "linear_attention", "full_attention",
                                                                     "linear_attention", "full_attention"],
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
                     "linear_num_key_heads": 4, "linear_num_value_heads": 4,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
                     "tie_word_embeddings": True, "mtp_num_hidden_layers": 0},
}
# (file suffix, llama.cpp ftype, every tensor in the ftype's own type)
QUANTS = [("Q8_0", "Q8_0", True), ("Q6_K", "Q6_K", True), ("Q5_K", "Q5_K_M", True), ("Q4_K", "Q4_K_M", True),
          ("Q4_K_M", "Q4_K_M", False), ("IQ4_XS", "IQ4_XS", True)]
PROMPT = torch.randint(0, 256, (96,), generator=torch.Generator().manual_seed(0))
DECODE_STEPS = 8


def tiny_folder(out: Path, name: str) -> Path:
    cfg = CONFIGS[name]
    folder = write_tiny(out, seed=len(name), **cfg)
    # llama.cpp wants at least one BPE merge in a gpt2 vocabulary: bytes, one merge, then the specials (the
    # converter numbers a vocabulary the way transformers reads it, which wants the added tokens last)
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from engine.tokenizer.byte_level import SPECIALS, byte_alphabet

    alphabet = byte_alphabet()
    backend = Tokenizer(models.BPE(vocab={**{alphabet[b]: b for b in range(256)}, "Ġt": 256}, merges=[("Ġ", "t")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    backend.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": backend.token_to_id("<|im_end|>")}))
    if cfg["mtp_num_hidden_layers"]:  # transformers writes no MTP weights; a checkpoint has them
        tensors = load_file(folder / "model.safetensors")
        g = torch.Generator().manual_seed(7)
        for key, shape in mtp_shapes(spec_from_hf_config(json.loads((folder / "config.json").read_text()))).items():
            tensors[key] = torch.randn(shape, generator=g) * (0.1 if len(shape) == 1 else shape[-1] ** -0.5)
        save_file(tensors, folder / "model.safetensors")
    return folder


def convert(folder: Path, out: Path, mtp: bool) -> Path:
    args = [sys.executable, "-c", LLAMA_CPP_CONVERT, str(SRC), str(folder), "--outfile", str(out), "--outtype", "f32"]
    r = subprocess.run(args + ([] if mtp else ["--no-mtp"]), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def quantize(src: Path, out: Path, ftype: str, pure: bool = False, requantize: bool = False) -> Path:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_" + ftype)
    params.pure, params.allow_requantize, params.nthread = pure, requantize, 2
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)) == 0
    return out


def llama_logits(path: Path) -> torch.Tensor:
    # fp32 KV (llama.cpp's default is f16) so that only the weights' formats differ between the runs
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=256, n_batch=256, n_threads=2,
                          type_k=0, type_v=0, verbose=False)
    llm.eval(PROMPT.tolist())
    out = torch.from_numpy(np.array(llm.scores[:len(PROMPT)], dtype=np.float32))
    llm.close()
    return out


def ninfer_logits(path: Path) -> torch.Tensor:
    """A prefill-sized chunk, then one-token decode steps (on the CPU they take the kernels' dot products)."""
    model = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32")).model
    cache, split = model.new_cache(len(PROMPT)), len(PROMPT) - DECODE_STEPS
    with torch.inference_mode():
        rows = [model.forward(PROMPT[:split], cache, all_logits=True)]
        rows += [model.forward(PROMPT[i:i + 1], cache) for i in range(split, len(PROMPT))]
    return torch.cat(rows)


def dense(weights: dict) -> dict:
    return {k: dequantize(v) if isinstance(v, GGUFWeight) else v for k, v in weights.items()}


@pytest.fixture(scope="module", params=list(CONFIGS))
def files(request, tmp_path_factory):
    base = tmp_path_factory.mktemp(request.param)
    folder = tiny_folder(base / "hf", request.param)
    f32 = convert(folder, base / "f32.gguf", mtp=bool(CONFIGS[request.param]["mtp_num_hidden_layers"]))
    quants = {}
    for suffix, ftype, pure in QUANTS:
        q = quantize(f32, base / f"{suffix}.gguf", "MOSTLY_" + ftype, pure=pure)
        quants[suffix] = (q, quantize(q, base / f"{suffix}-decoded.gguf", "ALL_F32", requantize=True))
    return folder, f32, quants


def test_f32_matches_llama_cpp_and_transformers(files):
    folder, f32, _ = files
    from .conftest import oracle_on_torch_paths

    oracle_on_torch_paths()
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():
        want = ref(PROMPT[None]).logits[0]
    ours = ninfer_logits(f32)
    vs_llama, vs_hf = rel_error(ours, llama_logits(f32)), rel_error(ours, want)
    print(f"f32: ninfer vs llama.cpp {vs_llama:.2e}, vs transformers {vs_hf:.2e}")
    assert vs_llama < 1e-4 and vs_hf < 1e-4


def test_mtp_and_tokenizer_from_the_converted_file(files):
    folder, f32, _ = files
    loaded = load_model(str(f32), torch.float32, torch.device("cpu"))
    source = load_file(folder / "model.safetensors")
    mtp = {k: v for k, v in source.items() if k.startswith("mtp.")}
    assert sorted(k for k in loaded.weights if k.startswith("mtp.")) == sorted(mtp)
    for k, v in mtp.items():  # norms are stored as 1 + w
        norm = v.dim() == 1 and "norm" in k
        assert torch.equal(loaded.weights[k] + norm, v + norm), k
    llm = llama_cpp.Llama(model_path=str(f32), vocab_only=True, verbose=False)
    for text in ("hello world, the end", "<|im_start|>user\nhéllo 42<|im_end|>\n", "  tt\t t  "):
        assert loaded.tokenizer.encode(text) == llm.tokenize(text.encode(), add_bos=False, special=True), text
    assert loaded.chat_template == (folder / "chat_template.jinja").read_text()


@pytest.mark.parametrize("quant", [q[0] for q in QUANTS])
def test_quantized_file_matches_llama_cpp(files, quant):
    _, _, quants = files
    path, decoded = quants[quant]
    ours_w = dense(load_model(str(path), torch.float32, torch.device("cpu")).weights)
    theirs_w = load_model(str(decoded), torch.float32, torch.device("cpu")).weights
    assert sorted(ours_w) == sorted(theirs_w)
    for k, v in theirs_w.items():
        assert torch.equal(ours_w[k], v), k
    ours, on_decoded, on_blocks = ninfer_logits(path), llama_logits(decoded), llama_logits(path)
    same_weights, llama_own = rel_error(ours, on_decoded), rel_error(on_blocks, on_decoded)
    vs_blocks = rel_error(ours, on_blocks)
    print(f"{quant}: ninfer vs llama.cpp on its decoded weights {same_weights:.2e}; vs llama.cpp on the file "
          f"{vs_blocks:.2e} (llama.cpp's 8-bit activations alone: {llama_own:.2e})")
    assert same_weights < 1e-4
    assert vs_blocks < 1.5 * llama_own
