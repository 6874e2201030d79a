"""Vision projector GGUF files (`mmproj-*.gguf`) beside a GGUF `qwen35` model, against transformers'
Qwen3_5ForConditionalGeneration on a tiny random vision-language folder (fp32, CPU).

The CI tests write the projector the way llama.cpp's converter does (its conventions re-stated here from
`conversion/qwen3vl.py` and the type rules of `conversion/base.py`) in F32, F16, BF16 and Q8_0, and the text model
as tests/test_gguf_qwen35.py does; then the tower's embeddings, prompt logits and greedy tokens with an image, how
the file is found (beside the model, the `mmproj` setting) and the refusals. The last test (marker `llama_cpp`)
runs llama.cpp's own converter (`--mmproj`, and the text model) from LLAMA_CPP_SRC, and skips without it.
"""
import copy
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import Engine, EngineConfig, ModelFormatError, SamplingParams, UserError
from engine.config import WeightFormats
from engine.convert import convert
from engine.loaders import load_model, read_spec
from engine.loaders.gguf_file import read_header
from engine.loaders.gguf_mmproj import find_mmproj, load_tower, projector_config
from engine.loaders.manifest import MMPROJ_METADATA, read_manifest, sha256_file
from engine.media.prompt import expand_pads, prompt_media
from engine.models.vision import VisionTower

from .conftest import LLAMA_CPP_CONVERT, VISION, VISION_ROPE, rel_error, write_tiny
from .test_gguf_qwen35 import write_qwen35_gguf
from .test_vision_oracle import our_logits, pads, random_image, ref_inputs, template_ids

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]  # not the 0.5 defaults
FTYPES = {"F32": Q.F32, "F16": Q.F16, "BF16": Q.BF16, "Q8_0": Q.Q8_0}
GRIDS = [(1, 6, 4), (2, 4, 4), (1, 2, 8)]  # images, and a video's two temporal patches
_BLOCK = {"norm1": "ln1", "norm2": "ln2", "attn.qkv": "attn_qkv", "attn.proj": "attn_out",
          "mlp.linear_fc1": "ffn_up", "mlp.linear_fc2": "ffn_down"}
_OTHERS = {"merger.norm": "v.post_ln", "merger.linear_fc1": "mm.0", "merger.linear_fc2": "mm.2",
           "patch_embed.proj": "v.patch_embd", "pos_embed": "v.position_embd"}


def projector_name(name: str) -> str:
    """The converter's name of a tower tensor (transformers' `visual.*` name without the prefix)."""
    base, kind = name.rsplit(".", 1)
    if base.startswith("blocks."):
        _, i, rest = base.split(".", 2)
        return f"v.blk.{i}.{_BLOCK[rest]}.{kind}"
    return f"{_OTHERS[base]}.{kind}"


def stored_type(name: str, ndim: int, ftype: str):
    """The converter's type for a tensor: 1D ones and the learned positions in F32, the patch embedding in F16 in an
    F16 file and F32 otherwise, the rest in the file's type."""
    if ndim <= 1 or name == "v.position_embd.weight":
        return Q.F32
    if name.startswith("v.patch_embd.weight"):
        return Q.F16 if ftype == "F16" else Q.F32
    return FTYPES[ftype]


def write_mmproj(tower: dict[str, torch.Tensor], path: Path, ftype: str = "F32", text_hidden: int = 64,
                 eps: float = 1e-6, **meta) -> Path:
    """A projector file of the tower (transformers' names, fp32) as llama.cpp's converter writes it; `meta`
    replaces or adds keys."""
    depth = 1 + max(int(n.split(".")[1]) for n in tower if n.startswith("blocks."))
    hidden = tower["pos_embed.weight"].shape[1]
    patch = tower["patch_embed.proj.weight"].shape[-1]
    keys = {"general.type": "mmproj", "clip.has_vision_encoder": True, "clip.vision.projection_dim": text_hidden,
            "clip.vision.image_size": int(math.sqrt(tower["pos_embed.weight"].shape[0]) * patch),
            "clip.vision.patch_size": patch, "clip.vision.embedding_length": hidden,
            "clip.vision.feed_forward_length": tower["blocks.0.mlp.linear_fc1.weight"].shape[0],
            "clip.vision.block_count": depth, "clip.vision.attention.head_count": VISION["num_heads"],
            "clip.vision.image_mean": MEAN, "clip.vision.image_std": STD, "clip.projector_type": "qwen3vl_merger",
            "clip.use_gelu": True, "clip.vision.spatial_merge_size": 2,
            "clip.vision.attention.layer_norm_epsilon": eps, "clip.vision.is_deepstack_layers": [False] * depth,
            **meta}
    w = gguf.GGUFWriter(str(path), "clip")
    for key, value in keys.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    arrays = {}
    for name, t in tower.items():
        if name == "patch_embed.proj.weight":  # the 3D convolution split over its two temporal frames
            arrays["v.patch_embd.weight"], arrays["v.patch_embd.weight.1"] = t[:, :, 0], t[:, :, 1]
        else:
            arrays[projector_name(name)] = t
    for name, t in arrays.items():
        data, qtype = t.float().contiguous().numpy(), stored_type(name, t.dim(), ftype)
        if qtype == Q.F32:
            w.add_tensor(name, data)
        elif qtype == Q.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def file_values(path: Path) -> dict[str, torch.Tensor]:
    """The tower a projector file holds, read with the gguf package's own reader and decoder (transformers'
    names): what transformers' tower is given to compare against ninfer's on a quantized file."""
    reader, out = gguf.GGUFReader(str(path)), {}
    by_name = {t.name: t for t in reader.tensors}
    for name, t in by_name.items():
        if name == "v.patch_embd.weight.1":
            continue
        value = gguf.quants.dequantize(np.asarray(t.data), Q(t.tensor_type)).reshape(list(reversed(t.shape)))
        if name == "v.patch_embd.weight":
            second = by_name["v.patch_embd.weight.1"]
            value = np.stack([value, gguf.quants.dequantize(np.asarray(second.data), Q(second.tensor_type))
                              .reshape(value.shape)], axis=2)
        out[name] = torch.from_numpy(np.array(value, dtype=np.float32))
    return out


def text_gguf(folder: Path, src: Path, out: Path) -> Path:
    """The folder's text model as a qwen35 GGUF (tests/test_gguf_qwen35.py's writer, on the text half written to
    `src` as a text-only folder)."""
    src.mkdir()
    out.parent.mkdir(exist_ok=True)
    (src / "config.json").write_text(json.dumps(json.loads((folder / "config.json").read_text())["text_config"]))
    tensors = {k.replace("model.language_model.", "model.", 1): v
               for k, v in load_file(folder / "model.safetensors").items() if not k.startswith("model.visual.")}
    save_file(tensors, src / "model.safetensors")
    for name in ("tokenizer.json", "chat_template.jinja"):
        shutil.copy(folder / name, src / name)
    return write_qwen35_gguf(src, out, quantized={})


@pytest.fixture(scope="module")
def ref(vl_folder):
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(str(vl_folder), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tower(vl_folder) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model.visual."): v for k, v in load_file(vl_folder / "model.safetensors").items()
            if k.startswith("model.visual.")}


@pytest.fixture(scope="module")
def files(vl_folder, tower, tmp_path_factory):
    """The text model with an F32 projector beside it (`model/`), and a projector of each type elsewhere."""
    base = tmp_path_factory.mktemp("mmproj")
    model = text_gguf(vl_folder, base / "text", base / "model" / "Tiny-VL-F32.gguf")
    write_mmproj(tower, base / "model" / "mmproj-Tiny-VL-F32.gguf")
    typed = {t: write_mmproj(tower, base / f"mmproj-{t}.gguf", t) for t in FTYPES}
    return model, typed


@pytest.fixture(scope="module")
def vl_gguf(files):
    """One engine on the GGUF, its projector found beside it (images up to 64x64 pixels)."""
    return Engine(EngineConfig(model=str(files[0]), device="cpu", dtype="float32", image_max_pixels=64 * 64))


def embeddings(tower: VisionTower | torch.nn.Module, pixels: torch.Tensor, grid: tuple[int, int, int]):
    with torch.inference_mode():
        if isinstance(tower, VisionTower):
            return tower(pixels, [grid])
        return tower(pixels, grid_thw=torch.tensor([grid])).pooler_output


def check_tower(path: Path, ref_tower: torch.nn.Module, engine: Engine) -> float:
    """The largest relative error of the file's tower (as ninfer loads it for `engine`'s text model) against
    `ref_tower` over GRIDS."""
    config, _ = projector_config(path, engine.geometry, read_header(Path(engine.model_name)).metadata)
    ours = VisionTower(config.spec, {k.removeprefix("visual."): v
                                     for k, v in load_tower(path, torch.float32, torch.device("cpu")).items()})
    worst = 0.0
    for i, grid in enumerate(GRIDS):
        pixels = torch.randn(math.prod(grid), 3 * 2 * 16, generator=torch.Generator().manual_seed(i))
        worst = max(worst, rel_error(embeddings(ours, pixels, grid), embeddings(ref_tower, pixels, grid)))
    return worst


def on_file_values(ref_tower: torch.nn.Module, path: Path) -> torch.nn.Module:
    """A copy of transformers' tower holding the values of a projector file's tensors."""
    values, theirs = file_values(path), copy.deepcopy(ref_tower)
    theirs.load_state_dict({name: values["v.patch_embd.weight" if name == "patch_embed.proj.weight"
                                         else projector_name(name)] for name in theirs.state_dict()})
    return theirs


def hf_greedy_with_images(ref, engine: Engine, ids: list[int], images, n: int) -> list[int]:
    """Greedy decoding through transformers' forward and cache (n steps, no EOS handling)."""
    out, past, inputs = [], None, ref_inputs(engine, ids, images)
    with torch.inference_mode():
        for _ in range(n):
            res = ref(**inputs, past_key_values=past, use_cache=True)
            past = res.past_key_values
            out.append(int(res.logits[0, -1].argmax()))
            inputs = {"input_ids": torch.tensor([[out[-1]]])}
    return out


@pytest.mark.parametrize("ftype", list(FTYPES))
def test_tower_of_each_type_equals_transformers(files, ref, vl_gguf, ftype):
    """The file's tensors dequantized (as the gguf package decodes them) in transformers' tower give ninfer's
    embeddings; in F32 that is transformers' own tower."""
    path = files[1][ftype]
    same = check_tower(path, ref.model.visual if ftype == "F32" else on_file_values(ref.model.visual, path), vl_gguf)
    checkpoint = check_tower(path, ref.model.visual, vl_gguf)
    print(f"{ftype}: tower vs transformers on the file's values {same:.2e}, on the fp32 checkpoint {checkpoint:.2e}")
    assert same < 1e-5
    assert checkpoint < {"F32": 1e-5, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 2e-2}[ftype]  # the type's rounding, no more


def test_metadata_is_the_vision_config(vl_gguf, vl_folder):
    """Image ids from the text model's vocabulary, normalisation and eps from the projector, the M-RoPE sections
    from the text model; the tower's shape as the checkpoint's vision_config gives it."""
    from engine.loaders import vision_config

    v = vl_gguf.vision
    want = vision_config(json.loads((vl_folder / "config.json").read_text()), {})
    assert (v.image_token_id, v.video_token_id, v.vision_start_id, v.vision_end_id) == \
        (want.image_token_id, want.video_token_id, want.vision_start_id, want.vision_end_id)
    assert v.spec == replace(want.spec, eps=v.spec.eps) and v.spec.eps == np.float32(1e-6)
    assert np.allclose(v.mean, MEAN) and np.allclose(v.std, STD) and v.min_pixels == want.min_pixels
    assert vl_gguf.geometry.rope.mrope_section == (11, 11, 10)  # what the text writer states
    spec = read_spec(str(vl_gguf.model_name))
    assert spec.vision_params == sum(t.numel() for t in vl_gguf.images.tower.w.values())
    assert spec.vision_params == read_spec(str(vl_folder)).vision_params


def test_prompt_with_an_image_equals_transformers(vl_gguf, ref):
    """Prompt logits and 16 greedy tokens with two images (their pads spliced in, M-RoPE positions) through the
    engine on the GGUF pair, against transformers on the source folder."""
    images = [random_image((1, 6, 4), 3), random_image((1, 4, 8), 4)]
    prompt = template_ids(vl_gguf, images, seed=2)
    ids = expand_pads(prompt, pads(vl_gguf), images)
    model = vl_gguf.model
    cache = model.new_cache(len(ids))
    cache.media = prompt_media(ids, pads(vl_gguf), images, vl_gguf.images.encode(images), 2)
    with torch.inference_mode():
        got = model.forward(torch.tensor(ids), cache, all_logits=True)
        want = ref(**ref_inputs(vl_gguf, ids, images)).logits[0]
    print(f"prompt logits with two images vs transformers: {rel_error(got, want):.2e}")
    assert rel_error(got, want) < 1e-4
    out = vl_gguf.complete(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), images)
    assert out.token_ids == hf_greedy_with_images(ref, vl_gguf, ids, images, 16)


def test_the_projector_is_found_beside_the_model_or_named(files, tmp_path):
    model, typed = files
    lone = tmp_path / "alone" / model.name  # no projector beside it: text only
    lone.parent.mkdir()
    shutil.copy(model, lone)
    assert read_spec(str(lone)).vision_params == 0
    named = read_spec(str(lone), mmproj=str(typed["Q8_0"]))  # the setting names one elsewhere
    assert named.vision_params == read_spec(str(model)).vision_params > 0
    engine = Engine(EngineConfig(model=str(lone), device="cpu", dtype="float32"))
    assert engine.vision is None
    with pytest.raises(UserError, match="has no vision tower") as err:
        engine.image(b"\x89PNG", "messages[0].content[1]")
    assert "mmproj" in err.value.hint
    for name in ("mmproj-a.gguf", "MMPROJ-b.gguf"):  # two beside it: which one is the user's to say
        shutil.copy(typed["F32"], lone.parent / name)
    with pytest.raises(ModelFormatError, match=r"2 vision projector files beside .*MMPROJ-b.gguf, mmproj-a.gguf"):
        read_spec(str(lone))
    assert read_spec(str(lone), mmproj=str(lone.parent / "mmproj-a.gguf")).vision_params > 0
    assert read_spec(str(lone), vision=False).vision_params == 0  # no images taken: no projector read
    with pytest.raises(ModelFormatError, match="mmproj file .*nope.gguf' does not exist"):
        read_spec(str(model), mmproj=str(tmp_path / "nope.gguf"))


def test_mmproj_is_a_setting_and_a_flag():
    import argparse

    from ninfer_tui import profiles
    from ninfer_tui.launch import add_engine_args, profile_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["-P", "cpu-default", "--mmproj", "/models/mmproj-F16.gguf"])
    assert profile_from_args(args, announce=False).engine_config("m.gguf").mmproj == "/models/mmproj-F16.gguf"
    assert profiles.load("cpu-default").engine_config("m.gguf").mmproj == ""


def test_wrong_files_are_refused_in_one_line(files, tower, vl_folder, tmp_path, vl_gguf):
    model, typed = files
    spec, meta = vl_gguf.geometry, {"general.architecture": "qwen35"}
    cases = {
        "text model as projector": (model, r"is not a vision projector \(a GGUF qwen35 model"),
        "other projector": (write_mmproj(tower, tmp_path / "a.gguf", **{"clip.projector_type": "qwen2vl_merger"}),
                            "is a 'qwen2vl_merger' projector, not a Qwen3.5/3.6 vision projector"),
        "Qwen3-VL": (write_mmproj(tower, tmp_path / "b.gguf", **{"clip.vision.is_deepstack_layers": [True, False]}),
                     "is a Qwen3-VL vision projector"),
        "width": (write_mmproj({**tower, "merger.linear_fc2.weight": tower["merger.linear_fc2.weight"][:32],
                                "merger.linear_fc2.bias": tower["merger.linear_fc2.bias"][:32]}, tmp_path / "c.gguf",
                               text_hidden=32),
                  "makes embeddings of width 32, the model's hidden size is 64"),
        "shape": (write_mmproj(tower, tmp_path / "d.gguf", **{"clip.vision.block_count": 3}),
                  "lacks tensor 'v.blk.2.ln1.weight'"),
        "metadata": (write_mmproj(tower, tmp_path / "e.gguf", **{"clip.vision.feed_forward_length": 128}),
                     r"tensor 'v.blk.0.ffn_up.weight' of e.gguf has shape \(96, 64\), its metadata implies "
                     r"\(128, 64\)"),
    }
    renamed = tmp_path / "f.gguf"
    renamed.write_bytes(typed["F32"].read_bytes().replace(b"v.post_ln.bias", b"v.post_lx.bias"))
    cases["tensor"] = (renamed, "unexpected tensor 'v.post_lx.bias' in the vision projector f.gguf")
    for what, (path, message) in cases.items():
        with pytest.raises(ModelFormatError, match=message) as err:
            projector_config(path, spec, meta)
        assert "\n" not in str(err.value) and "mmproj" in err.value.hint, what
    with pytest.raises(ModelFormatError, match="vocabulary lacks <\\|image_pad\\|>"):
        projector_config(typed["F32"], spec, {"tokenizer.ggml.tokens": ["a", "<|video_pad|>"]})
    with pytest.raises(ModelFormatError, match="is a vision projector \\(mmproj\\), not a model"):
        read_spec(str(typed["F32"]))
    with pytest.raises(ModelFormatError, match="loads with Qwen3.5/3.6 GGUF models only; m.gguf is a llama model"):
        find_mmproj(Path("m.gguf"), str(typed["F32"]), {"general.architecture": "llama"})
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        read_spec(str(vl_folder), mmproj=str(typed["F32"]))


# ---- `ninfer convert` carries the projector --------------------------------------------------------------------


def same_tower(folder: Path, gguf_file: Path, mmproj: str = "") -> None:
    """The converted folder loads the vision side the GGUF file loads with its projector: the vision config, the
    geometry (the tower counted) and the tower's tensors bit for bit."""
    cpu = torch.device("cpu")
    ours, direct = load_model(str(folder), torch.float32, cpu), load_model(str(gguf_file), torch.float32, cpu,
                                                                           mmproj=mmproj)
    assert ours.vision is not None and ours.vision == direct.vision and ours.geometry == direct.geometry
    tower = {k: w for k, w in direct.weights.items() if k.startswith("visual.")}
    assert tower and all(torch.equal(ours.weights[k], w) for k, w in tower.items())
    assert not any(k.startswith("visual.") for k in load_model(str(folder), torch.float32, cpu, vision=False).weights)


def test_a_gguf_converts_with_the_projector_beside_it(files, vl_gguf, tmp_path):
    """The tower in the shards, the projector's metadata as a GGUF file without tensors, its hash among the
    sources; prompt logits with two images equal those of the GGUF pair."""
    model, _ = files
    projector = model.parent / "mmproj-Tiny-VL-F32.gguf"
    out = convert(str(model), tmp_path / "vl", WeightFormats(), torch.float32).folder
    m = read_manifest(out)
    assert m.mmproj == str(projector.resolve()) and (out / MMPROJ_METADATA).is_file()
    assert {f.name: f.sha256 for f in m.source_files} == {p.name: sha256_file(p) for p in (model, projector)}
    same_tower(out, model)
    assert read_spec(str(out)) == vl_gguf.geometry
    engine = Engine(EngineConfig(model=str(out), device="cpu", dtype="float32", image_max_pixels=64 * 64))
    images = [random_image((1, 6, 4), 3), random_image((1, 4, 8), 4)]
    ids = expand_pads(template_ids(vl_gguf, images, seed=2), pads(vl_gguf), images)
    assert torch.equal(our_logits(engine, ids, images, len(ids)), our_logits(vl_gguf, ids, images, len(ids)))
    (out / MMPROJ_METADATA).unlink()
    with pytest.raises(ModelFormatError, match=f"vl: its vision tower lacks {MMPROJ_METADATA}") as err:
        read_spec(str(out))
    assert "ninfer convert" in err.value.hint and f"--mmproj {projector.resolve()}" in err.value.hint


def test_convert_takes_a_named_projector_and_refuses_a_wrong_one(files, tower, vl_folder, tmp_path, capsys):
    from ninfer_tui.cli import main

    model, typed = files
    lone = tmp_path / "alone" / model.name  # nothing beside it: converted text only
    lone.parent.mkdir()
    shutil.copy(model, lone)
    text = convert(str(lone), tmp_path / "text", WeightFormats(), torch.float32)
    assert text.manifest.mmproj == "" and not (text.folder / MMPROJ_METADATA).exists()
    assert load_model(str(text.folder), torch.float32, torch.device("cpu")).vision is None
    named = tmp_path / "named"
    assert main(["convert", str(lone), str(named), "-P", "cpu-default", "--mmproj", str(typed["Q8_0"])]) == 0
    capsys.readouterr()
    same_tower(named, lone, str(typed["Q8_0"]))
    narrow = write_mmproj({**tower, "merger.linear_fc2.weight": tower["merger.linear_fc2.weight"][:32],
                           "merger.linear_fc2.bias": tower["merger.linear_fc2.bias"][:32]}, tmp_path / "narrow.gguf",
                          text_hidden=32)
    never = tmp_path / "never"
    for wrong, message in ((model, r"is not a vision projector \(a GGUF qwen35 model"),
                           (narrow, "makes embeddings of width 32, the model's hidden size is 64")):
        with pytest.raises(ModelFormatError, match=message) as err:
            convert(str(lone), never, WeightFormats(), torch.float32, mmproj=str(wrong))
        assert "\n" not in str(err.value) and "--mmproj FILE" in err.value.hint
        assert main(["convert", str(lone), str(never), "-P", "cpu-default", "--mmproj", str(wrong)]) == 2
        error, hint = capsys.readouterr().err.strip().splitlines()[-2:]
        assert error.startswith("error:") and err.value.args[0] in error and hint.startswith("hint:")
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        convert(str(vl_folder), never, WeightFormats(), torch.float32, mmproj=str(typed["F32"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alone", "named", "narrow.gguf", "text"]  # nothing left


# ---- llama.cpp's own converter ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny vision-language folder converted by llama.cpp: the text model (f32) and its projector in f32 and
    Q8_0, the f32 one beside the model."""
    src = Path(os.environ.get("LLAMA_CPP_SRC", "/nonexistent"))
    if not (src / "convert_hf_to_gguf.py").is_file():
        pytest.skip("LLAMA_CPP_SRC does not point at llama.cpp's source tree (scripts/check_gguf_oracle.sh)")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from engine.tokenizer.byte_level import SPECIALS, byte_alphabet

    base = tmp_path_factory.mktemp("llama-cpp-mmproj")
    folder = write_tiny(base / "hf", seed=11, vision=VISION, rope_parameters=VISION_ROPE, mtp_num_hidden_layers=0)
    # llama.cpp wants a BPE merge in a gpt2 vocabulary, and the converter reads the processor's normalisation
    alphabet = byte_alphabet()
    backend = Tokenizer(models.BPE(vocab={**{alphabet[b]: b for b in range(256)}, "Ġt": 256}, merges=[("Ġ", "t")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    backend.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["eos_token_id"] = backend.token_to_id("<|im_end|>")
    for key, token in (("image_token_id", "image_pad"), ("video_token_id", "video_pad"),
                       ("vision_start_token_id", "vision_start"), ("vision_end_token_id", "vision_end")):
        config[key] = backend.token_to_id(f"<|{token}|>")  # the specials moved up by the merge's token
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "preprocessor_config.json").write_text(json.dumps({"image_mean": MEAN, "image_std": STD,
                                                                 "patch_size": 4, "merge_size": 2}))

    def convert(out: Path, *args: str) -> Path:
        r = subprocess.run([sys.executable, "-c", LLAMA_CPP_CONVERT, str(src), str(folder), "--outfile", str(out),
                            *args], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        return out

    (base / "model").mkdir()
    model = convert(base / "model" / "tiny-vl-f32.gguf", "--outtype", "f32", "--no-mtp")
    convert(base / "model" / "mmproj-tiny-vl-f32.gguf", "--outtype", "f32", "--mmproj")
    q8 = convert(base / "mmproj-tiny-vl-q8_0.gguf", "--outtype", "q8_0", "--mmproj")
    return folder, model, q8


@pytest.mark.llama_cpp
def test_llama_cpp_converted_pair_equals_transformers(converted):
    from transformers import Qwen3_5ForConditionalGeneration

    folder, model, q8 = converted
    ref = Qwen3_5ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()
    engine = Engine(EngineConfig(model=str(model), device="cpu", dtype="float32", image_max_pixels=64 * 64))
    v = engine.vision
    assert v is not None and np.allclose(v.mean, MEAN) and engine.geometry.rope.mrope_section == (3, 3, 2)
    assert v.image_token_id == ref.config.image_token_id
    f32 = check_tower(model.parent / "mmproj-tiny-vl-f32.gguf", ref.model.visual, engine)
    q8_0 = check_tower(q8, on_file_values(ref.model.visual, q8), engine)
    print(f"tower embeddings: f32 file vs transformers {f32:.2e}; Q8_0 file vs transformers on its values {q8_0:.2e}")
    assert f32 < 1e-5 and q8_0 < 1e-5
    images = [random_image((1, 6, 4), 5)]
    prompt = template_ids(engine, images, seed=4)
    got = engine.complete(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), images)
    assert got.token_ids == hf_greedy_with_images(ref, engine, expand_pads(prompt, pads(engine), images), images, 16)
