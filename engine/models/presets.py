"""Model presets for synthetic (random-weight) models, as HF `qwen3_5_text` config dicts."""
from __future__ import annotations

# The Qwen3.6-27B / Qwen3.5-27B text config. Numbers as published in the model's config.json (reproduced in
# public repos, e.g. THUDM/slime scripts/models/qwen3.5-27B.sh and the Qwen3.6-27B model card's "Model Overview":
# 64 layers = 16 x (3 Gated DeltaNet + 1 gated attention), hidden 5120, FFN 17408, 24 q / 4 kv heads of 256,
# linear 16 key / 48 value heads of 128, vocab 248320, rope theta 1e7, partial rotary 0.25, 1 MTP layer).
QWEN36_27B = {
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "attn_output_gate": True,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "mtp_num_hidden_layers": 1,
    "eos_token_id": 248046,
}

# A tiny model of the same family for tests (CPU, seconds): every mechanism, a byte-level vocabulary.
TINY = {
    **QWEN36_27B,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 8192,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "mtp_num_hidden_layers": 1,
    "eos_token_id": 258,
}

# The Qwen3.6-27B / Qwen3.5-27B vision tower (its config.json's vision_config: 27 blocks of width 1152, 16 heads,
# MLP 4304, patch 16 over 2 frames, 2x2 merge, learned positions on a 48 x 48 grid, out at the text width), and a
# tiny one for tests (the tests' tiny vision-language folder's shape).
QWEN36_27B_VISION = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                     "out_hidden_size": 5120, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
                     "in_channels": 3, "num_position_embeddings": 2304, "hidden_act": "gelu_pytorch_tanh"}
TINY_VISION = {"depth": 2, "hidden_size": 64, "intermediate_size": 96, "num_heads": 4, "out_hidden_size": 64,
               "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3,
               "num_position_embeddings": 36, "hidden_act": "gelu_pytorch_tanh"}

# The vision-language models: the text models above with the tower (their text weights are the text models' own,
# `loaders/synthetic.py`); the tiny one rotates 8 frequencies, so that time, row and column each turn several.
QWEN36_27B_VL = {**QWEN36_27B, "vision_config": QWEN36_27B_VISION}
TINY_VL = {**TINY, "vision_config": TINY_VISION,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                               "mrope_section": [3, 3, 2], "mrope_interleaved": True}}

# DFlash block drafters (random weights) for the targets above: the z-lab Qwen3.6-27B drafter's geometry
# (5 layers, 4 sliding-window + 1 full, 32 q / 8 kv heads of 128, FFN 17408, taps [1, 16, 31, 46, 61],
# mask token 248070; research/architecture.md 5.1), and a tiny one for tests.
DFLASH_QWEN36_27B = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "vocab_size": 248320,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000000.0,
    "sliding_window": 2048,
    "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
    "num_target_layers": 64,
    "block_size": 16,
    "dflash_config": {"target_layer_ids": [1, 16, 31, 46, 61], "mask_token_id": 248070, "block_size": 16},
}
DFLASH_TINY = {
    **DFLASH_QWEN36_27B,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_theta": 10000.0,
    "sliding_window": 16,
    "layer_types": ["sliding_attention", "full_attention"],
    "num_target_layers": 4,
    "block_size": 8,
    "dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 300, "block_size": 8},
}
DRAFTER_PRESETS = {"dflash-tiny": DFLASH_TINY, "dflash-qwen3.6-27b": DFLASH_QWEN36_27B}

PRESETS = {"tiny": TINY, "qwen3.6-27b": QWEN36_27B, "tiny-vl": TINY_VL, "qwen3.6-27b-vl": QWEN36_27B_VL}
