"""Expected decode speed per GPU and profile, for the speed check's verdict.

Rows marked "other engine" are the figures of the native engine we compete with (its forum post, RTX 4090 48 GB,
8K context, INT8 KV, the fixed code task, 4096 output tokens); replace them with ninfer's own as they are measured.
Each row says how many tokens its figure was generated over: the speed check's default length, since a figure
from a run of another length compares less well (and 4096 tokens take over an hour on a 2-core CPU).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reference:
    gpu: str  # a substring of the GPU name, or "cpu"
    profile: str
    spec: str
    decode_tok_s: float
    source: str
    setup: dict  # the settings the figure was measured with
    new_tokens: int  # tokens generated in the measured run


REFERENCES = (
    Reference("RTX 4090", "8k-speed", "dflash", 213.17, "other engine (NInfer-4090 V3, DFlash2 K=7, 59.6% acceptance)",
              {"kv_dtype": "int8", "spec": "dflash", "draft_tokens": 7, "cuda_graphs": True, "max_context": 8192},
              new_tokens=4096),
    Reference("RTX 4090", "8k-speed", "mtp", 147.56, "other engine (NInfer-4090 V3, MTP3, 79.1% acceptance)",
              {"kv_dtype": "int8", "spec": "mtp", "draft_tokens": 3, "cuda_graphs": True, "max_context": 8192},
              new_tokens=4096),
    Reference("cpu", "cpu-default", "none", 29.6,
              "ninfer `speedcheck --max-new-tokens 256`, 2-core CI-kind machine, fp32 reference path, int8 KV",
              {"kv_dtype": "int8", "spec": "none", "max_context": 8192}, new_tokens=256),
)


def find(gpu_name: str | None, profile: str, spec: str) -> Reference | None:
    key = (gpu_name or "cpu").lower()
    for ref in REFERENCES:
        hit = ref.gpu == "cpu" if gpu_name is None else ref.gpu.lower() in key
        if hit and ref.profile == profile and ref.spec == spec:
            return ref
    return None


def task_tokens(gpu_name: str | None, profile: str, spec: str) -> int:
    """The speed check's default length: that of the matching row's run, else that of the rows for this kind of
    device (a GPU or the CPU)."""
    ref = find(gpu_name, profile, spec)
    if ref is not None:
        return ref.new_tokens
    return next(r.new_tokens for r in REFERENCES if (r.gpu == "cpu") == (gpu_name is None))
