"""Synthetic vision-language models (`synthetic:tiny-vl`, `synthetic:qwen3.6-27b-vl`: a preset's text model with a
vision tower of random weights), and scripts/bench_vision.py's time to first token of a chat turn with a
screenshot, run on the tiny one on the CPU."""
from __future__ import annotations

import importlib.util
import json
import sys

import torch

from engine.loaders import VISION_PREFIX, load_model, read_spec
from engine.loaders.synthetic import random_tower
from engine.models.presets import QWEN36_27B_VISION, TINY_VISION
from engine.models.spec import vision_parameters
from engine.models.vision import VisionTower, tower_shapes, vision_spec

from .conftest import ROOT

CPU = torch.device("cpu")


def test_a_vl_preset_is_its_text_model_with_a_tower():
    text = load_model("synthetic:tiny", torch.float32, CPU)
    vl = load_model("synthetic:tiny-vl", torch.float32, CPU)
    tower = {k: v for k, v in vl.weights.items() if k.startswith(VISION_PREFIX)}
    # the text weights are the text model's, value for value (benchmarks compare the two)
    assert vl.weights.keys() - tower.keys() == text.weights.keys()
    assert all(torch.equal(vl.weights[k], w) for k, w in text.weights.items())
    assert text.vision is None and vl.vision.spec == vision_spec(TINY_VISION)
    special = vl.tokenizer.special
    assert (vl.vision.image_token_id, vl.vision.video_token_id, vl.vision.vision_start_id, vl.vision.vision_end_id) \
        == tuple(special[t] for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"))
    # the memory plan counts the tower it loads; without vision none is loaded
    assert sum(t.numel() for t in tower.values()) == read_spec("synthetic:tiny-vl").vision_params \
        == vision_parameters(TINY_VISION)
    assert read_spec("synthetic:tiny").vision_params == 0
    alone = load_model("synthetic:tiny-vl", torch.float32, CPU, vision=False)
    assert alone.vision is None and not any(k.startswith(VISION_PREFIX) for k in alone.weights)
    # the 27B's tower: every parameter of its config (shapes only: 0.46 B parameters)
    assert sum(torch.Size(s).numel() for s in tower_shapes(vision_spec(QWEN36_27B_VISION)).values()) \
        == vision_parameters(QWEN36_27B_VISION)


def test_the_random_tower_keeps_its_activations_order_one():
    """Through as many blocks as the 27B's: the embeddings stay O(1), neither vanishing nor growing with depth."""
    spec = vision_spec({**TINY_VISION, "depth": QWEN36_27B_VISION["depth"]})
    weights = random_tower(spec, torch.float32, CPU)
    assert all(w.std() > 0 for w in weights.values())  # never zeros (a missing term would hide)
    pixels = torch.rand(8 * 12, spec.patch_dim, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        out = VisionTower(spec, weights)(pixels, [(1, 8, 12)])
    assert out.shape == (24, spec.out_hidden_size) and out.isfinite().all()
    assert 0.1 < out.std() < 3 and out.abs().max() < 20


def test_bench_vision_times_a_chat_turn_with_a_screenshot(tmp_path, monkeypatch):
    """--ttft alone on the tiny model: each scenario's row, the tower and the held conversation serving where they
    should; the results file keeps the earlier run's tower rows and replaces its row of a scenario run again."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("bench_vision", ROOT / "scripts" / "bench_vision.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_vision", bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    results = tmp_path / "scripts" / "results"
    results.mkdir(parents=True)
    tower_row = {"image": "1024x1024", "tokens": 1024, "encode_ms": 20.0}
    (results / "bench_vision_cpu.json").write_text(json.dumps(
        {"device": "cpu", "dtype": "float32", "tower_weight_mib": 1.0,
         "rows": [tower_row, {"scenario": "cold", "image": "64x48", "ttft_s": 99.0}]}))
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setattr(sys, "argv", [
        "bench_vision.py", "--device", "cpu", "--dtype", "float32", "--sizes", "", "--videos", "", "--ttft",
        "--model", "synthetic:tiny-vl", "--weights", "auto", "--kv", "auto", "--chunk", "512", "--max-context",
        "1024", "--ttft-image", "64x48", "--ttft-max-pixels", "4096", "--ttft-runs", "2"])
    bench.main()
    data = json.loads((tmp_path / "out" / "bench_vision_cpu.json").read_text())
    assert data["tower_weight_mib"] == 1.0 and data["rows"][0] == tower_row
    decoding = {r["scenario"]: r for r in data["rows"][4:]}
    assert list(decoding) == ["decode-image", "decode-text"]
    assert all(r["decode_tok_s"] > 0 and r["reply_tokens"] == bench.DECODE for r in decoding.values())
    rows = {r["scenario"]: r for r in data["rows"][1:4]}
    assert list(rows) == ["cold", "resent", "second-turn"] and len(data["rows"]) == 6
    for r in rows.values():
        assert (r["image"], r["gpu"], r["model"]) == ("64x48", "cpu", "synthetic:tiny-vl")
        assert len(r["ttft_runs_s"]) == 2 and 0 < r["ttft_s"] < 99 and r["image_tokens"] == rows["cold"]["image_tokens"]
        assert r["prompt_tokens"] > r["image_tokens"] > 0
    cold, resent, second = rows["cold"], rows["resent"], rows["second-turn"]
    assert (cold["tower_runs"], cold["cached_tokens"]) == (1, 0)
    assert (resent["tower_runs"], resent["cached_tokens"]) == (0, 0)  # the tower's cache, a whole prefill
    # the held first turn: its prompt and reply but the last token, whose KV the reply's end never wrote
    assert second["tower_runs"] == 0 and second["cached_tokens"] == cold["prompt_tokens"] + bench.REPLY - 1
    assert second["prompt_tokens"] > second["cached_tokens"]
