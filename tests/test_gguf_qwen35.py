"""GGUF `qwen35` files: a tiny transformers model written the way llama.cpp's converter writes it (its conventions
re-stated here from `conversion/qwen.py`), loaded by ninfer and run against transformers on the source folder.
The check against llama.cpp's own converter and quantizer is tests/test_gguf_llama_cpp_oracle.py."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import Engine, EngineConfig, ModelFormatError
from engine.loaders import load_model
from engine.models.qwen3_5 import mtp_shapes
from engine.models.spec import spec_from_hf_config
from engine.quant.gguf_blocks import GGUFWeight, dequantize

from .conftest import hf_greedy, rel_error, run_cli, write_tiny

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
          "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
          "mlp.down_proj.weight": "ffn_down.weight", "self_attn.q_proj.weight": "attn_q.weight",
          "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
          "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
          "self_attn.k_norm.weight": "attn_k_norm.weight", "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
          "linear_attn.in_proj_z.weight": "attn_gate.weight", "linear_attn.in_proj_b.weight": "ssm_beta.weight",
          "linear_attn.in_proj_a.weight": "ssm_alpha.weight", "linear_attn.conv1d.weight": "ssm_conv1d.weight",
          "linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias",
          "linear_attn.norm.weight": "ssm_norm.weight", "linear_attn.out_proj.weight": "ssm_out.weight"}
_NEXTN = {"fc.weight": "nextn.eh_proj.weight", "pre_fc_norm_embedding.weight": "nextn.enorm.weight",
          "pre_fc_norm_hidden.weight": "nextn.hnorm.weight", "norm.weight": "nextn.shared_head_norm.weight"}
QUANTIZED = {"blk.0.ffn_up.weight": Q.Q8_0, "blk.3.attn_v.weight": Q.Q8_0}  # the rest stays F32


def gguf_name(hf: str, layers: int) -> str:
    if hf in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}[hf]
    if hf.startswith("mtp.layers."):
        i, rest = hf[len("mtp.layers."):].split(".", 1)
        return f"blk.{layers + int(i)}.{_LAYER[rest]}"
    if hf.startswith("mtp."):
        return f"blk.{layers}.{_NEXTN[hf[len('mtp.'):]]}"
    i, rest = hf[len("model.layers."):].split(".", 1)
    return f"blk.{i}.{_LAYER[rest]}"


def tiled_value_heads(t: torch.Tensor, dim: int, keys: int, per_key: int, size: int) -> torch.Tensor:
    """The converter's `_reorder_v_heads`: value heads grouped by key head -> tiled."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], keys, per_key, size, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


def zero_centred(name: str) -> bool:
    return (name.endswith("norm.weight") or name.startswith("mtp.pre_fc_norm")) and "linear_attn.norm" not in name


def convert(name: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
    """llama.cpp's qwen35 conventions for one transformers tensor."""
    keys, values = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    per_key, dv, qk = values // keys, cfg["linear_value_head_dim"], 2 * keys * cfg["linear_key_head_dim"]
    if "linear_attn." in name and keys != values:
        if "in_proj_qkv" in name or "conv1d" in name:
            t = torch.cat([t[:qk], tiled_value_heads(t[qk:], 0, keys, per_key, dv)])
        elif "in_proj_z" in name:
            t = tiled_value_heads(t, 0, keys, per_key, dv)
        elif "in_proj_b" in name or "in_proj_a" in name or "A_log" in name or "dt_bias" in name:
            t = tiled_value_heads(t, 0, keys, per_key, 1)
        elif "out_proj" in name:
            t = tiled_value_heads(t, 1, keys, per_key, dv)
    if name.endswith("A_log"):
        return -torch.exp(t)
    if "conv1d" in name:
        return t.squeeze()
    if zero_centred(name):
        return t + 1
    return t


def write_qwen35_gguf(folder, path, quantized=QUANTIZED):
    cfg = json.loads((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    layers, mtp = cfg["num_hidden_layers"], cfg["mtp_num_hidden_layers"]
    w = gguf.GGUFWriter(str(path), "qwen35")
    a = "qwen35."
    for key, value in (("block_count", layers + mtp), ("context_length", cfg["max_position_embeddings"]),
                       ("embedding_length", cfg["hidden_size"]), ("feed_forward_length", cfg["intermediate_size"]),
                       ("attention.head_count", cfg["num_attention_heads"]),
                       ("attention.head_count_kv", cfg["num_key_value_heads"]),
                       ("attention.key_length", cfg["head_dim"]), ("attention.value_length", cfg["head_dim"]),
                       ("ssm.conv_kernel", cfg["linear_conv_kernel_dim"]),
                       ("ssm.state_size", cfg["linear_key_head_dim"]),
                       ("ssm.group_count", cfg["linear_num_key_heads"]),
                       ("ssm.time_step_rank", cfg["linear_num_value_heads"]),
                       ("ssm.inner_size", cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]),
                       ("full_attention_interval", 4), ("nextn_predict_layers", mtp),
                       ("rope.dimension_count",
                        int(cfg["head_dim"] * cfg["rope_parameters"]["partial_rotary_factor"]))):
        w.add_uint32(a + key, value)
    w.add_float32(a + "rope.freq_base", cfg["rope_parameters"]["rope_theta"])
    w.add_float32(a + "attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_array(a + "attention.recurrent_layers", [t == "linear_attention" for t in cfg["layer_types"]] + [False] * mtp)
    w.add_array(a + "rope.dimension_sections", [11, 11, 10, 0])
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    names = [f"[PAD{i}]" for i in range(cfg["vocab_size"])]
    types = [5] * cfg["vocab_size"]  # unused padding, as the converter pads the vocabulary
    for text, i in vocab.items():
        names[i], types[i] = text, 3 if any(t["content"] == text for t in tok["added_tokens"]) else 1
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(names)
    w.add_token_types(types)
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_chat_template((folder / "chat_template.jinja").read_text())
    for name, t in tensors.items():
        g = gguf_name(name, layers)
        data = convert(name, t.float(), cfg).numpy()
        if g in quantized:
            w.add_tensor(g, gguf.quants.quantize(data, quantized[g]), raw_dtype=quantized[g])
        else:
            w.add_tensor(g, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny folder with MTP weights (1 key per 2 value heads: the converter reorders them), its GGUF, and
    transformers' model of the folder with the GGUF's quantized tensors set to their dequantized values."""
    base = tmp_path_factory.mktemp("qwen35-gguf")
    folder = write_tiny(base / "hf", seed=5)
    cfg = json.loads((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(6)
    for name, shape in mtp_shapes(spec_from_hf_config(cfg)).items():
        tensors[name] = torch.randn(shape, generator=g) * (0.1 if len(shape) == 1 else shape[-1] ** -0.5)
    save_file(tensors, folder / "model.safetensors")
    path = write_qwen35_gguf(folder, base / "tiny.gguf")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    reader = gguf.GGUFReader(str(path))
    state = ref.state_dict()
    for t in reader.tensors:
        if t.name in QUANTIZED:
            hf = next(k for k in state if gguf_name(k, cfg["num_hidden_layers"]) == t.name)
            value = torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data), Q(t.tensor_type)).copy())
            state[hf].copy_(value.reshape(state[hf].shape))
    return folder, path, ref, tensors


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def dense(w) -> torch.Tensor:
    return dequantize(w) if isinstance(w, GGUFWeight) else w


def test_logits_and_greedy_match_transformers(pair):
    _, path, ref, _ = pair
    ours = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32"))
    assert ours.geometry.arch == "qwen3_5" and ours.geometry.mtp_layers == 1
    ids = prompt(120)
    with torch.inference_mode():
        want = ref(ids[None]).logits[0]
        got = ours.model.forward(ids, ours.model.new_cache(len(ids)), all_logits=True)
    assert rel_error(got, want) < 1e-4
    short = prompt(24, seed=1).tolist()
    from engine import SamplingParams

    assert ours.complete(short, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)).token_ids == \
        hf_greedy(ref, short, 16)


def test_tensors_are_transformers_own(pair):
    """Every tensor under transformers' name with transformers' value: norms back from 1 + w, A_log from
    -exp(A_log), the value heads regrouped, the conv kernel reshaped, the MTP layer under mtp.*; the Q8_0 tensors
    kept as the file's blocks on the CPU."""
    folder, path, _, tensors = pair
    loaded = load_model(str(path), torch.float32, torch.device("cpu")).weights
    want = {("lm_head.weight" if k == "lm_head.weight" else k.removeprefix("model.")): v for k, v in tensors.items()}
    assert sorted(loaded) == sorted(want)
    for name, value in want.items():
        got = dense(loaded[name])
        if name.endswith("A_log"):  # log(-(-exp(x))) rounds twice
            assert torch.allclose(got, value, rtol=1e-6, atol=1e-6), name
        elif name in ("layers.0.mlp.up_proj.weight", "layers.3.self_attn.v_proj.weight"):
            assert isinstance(loaded[name], GGUFWeight), name
            assert rel_error(got, value) < 1e-2, name  # Q8_0's rounding
        elif zero_centred(name):  # the file holds 1 + w in fp32: that is what the model multiplies by
            assert torch.equal(got + 1, value + 1), name
        else:
            assert torch.equal(got, value.float()), name


def test_tokenizer_and_template_from_metadata(pair):
    folder, path, _, _ = pair
    loaded = load_model(str(path), torch.float32, torch.device("cpu"))
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = "<|im_start|>user\nhéllo wörld 42<|im_end|>\n"
    assert loaded.tokenizer.encode(text) == hf.encode(text).ids
    assert loaded.tokenizer.decode(hf.encode(text).ids) == text
    assert loaded.tokenizer.eos_ids == (258,)
    assert loaded.chat_template == (folder / "chat_template.jinja").read_text()


def test_cli_generate_on_the_gguf(pair):
    _, path, ref, _ = pair
    ids = prompt(12, seed=2).tolist()
    r = run_cli("generate", "--model", str(path), "--device", "cpu", "--prompt-ids", ",".join(map(str, ids)),
                "--temperature", "0", "--repeat-penalty", "1", "-n", "10", "--json")
    assert r.returncode == 0, r.stderr
    expected = hf_greedy(ref, ids, 10)
    expected = expected[:expected.index(258)] if 258 in expected else expected
    assert json.loads(r.stdout)["token_ids"] == expected


def test_bad_qwen35_files_are_named(pair, tmp_path):
    folder = pair[0]
    extra = write_qwen35_gguf(folder, tmp_path / "extra.gguf")
    data = extra.read_bytes().replace(b"blk.1.ssm_beta.weight", b"blk.1.ssm_zeta.weight")
    (tmp_path / "renamed.gguf").write_bytes(data)
    with pytest.raises(ModelFormatError, match="unexpected tensor 'blk.1.ssm_zeta.weight' in a qwen35 GGUF"):
        load_model(str(tmp_path / "renamed.gguf"), torch.float32, torch.device("cpu"))
    data = extra.read_bytes().replace(b"qwen35.ssm.time_step_rank", b"qwen35.ssm.time_step_rant")
    (tmp_path / "nokey.gguf").write_bytes(data)
    with pytest.raises(ModelFormatError, match="lacks 'qwen35.ssm.time_step_rank'"):
        Engine(EngineConfig(model=str(tmp_path / "nokey.gguf"), device="cpu"))


def test_a_tokenizer_whose_merges_and_tokens_disagree_is_named():
    from engine.tokenizer.gguf_vocab import tokenizer_from_gguf

    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35", "tokenizer.ggml.tokens": ["a", "b"],
            "tokenizer.ggml.merges": ["a b"]}
    with pytest.raises(ModelFormatError, match="merge 'a b' joins tokens its vocabulary lacks"):
        tokenizer_from_gguf(meta)
