"""The memory plan of a GGUF model whose blocks a GPU keeps, against the bytes a load holds once the model has fused
its projections: a fused weight that joins kept blocks with dequantized parts stores those as F32 rows, and a folder
converted from the file keeps the same blocks. The loads run on the CPU with a GPU's keep rule (`GPU_TYPES`)."""
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine import EngineConfig
from engine.config import WeightFormats
from engine.loaders import LoadedModel, read_spec
from engine.memory_plan import plan_memory
from engine.quant.gguf_blocks import GPU_TYPES, GGUFWeight

from .test_gguf_gpu_kernels import TYPE_OF, write_typed_gguf

# attn_k in Q4_0 (kept by the CPU's kernels, not a GPU's) between the kept q and v, ssm_alpha left F32: both join
# their fused projection's kept parts as F32 rows on a GPU
MIXED = {**{name: q for name, q in TYPE_OF.items() if name != "ssm_alpha.weight"}, "attn_k.weight": Q.Q4_0}


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    return write_typed_gguf(tmp_path_factory.mktemp("mixed"), "tiny-mixed.gguf", MIXED)


def held_bytes(loaded: LoadedModel, monkeypatch) -> int:
    """The weight bytes a model built from `loaded` holds: the loaded tensors, each fused projection as the one
    weight its parts make. Asserts that some fused weight stores F32 rows beside kept blocks."""
    from engine.models import build_model, layers

    total = sum(w.nbytes for w in loaded.weights.values())
    real = layers.concat_rows
    fused = []

    def recorded(parts):
        fused.append((parts, real(parts)))
        return fused[-1][1]

    monkeypatch.setattr(layers, "concat_rows", recorded)
    build_model(loaded, "auto")
    assert any(isinstance(w, GGUFWeight) and {p.qtype for p in w.parts} > {Q.F32} for _, w in fused)
    return total + sum(w.nbytes - sum(p.nbytes for p in parts) for parts, w in fused)


def test_parts_fused_with_kept_blocks_are_planned_as_f32_rows(mixed_file, monkeypatch):
    from engine.loaders import gguf

    plan = plan_memory(read_spec(str(mixed_file)), EngineConfig(model=str(mixed_file), device="cuda"), "cuda")
    monkeypatch.setattr(gguf, "kept_types", lambda device: GPU_TYPES)
    loaded = gguf.load_gguf(mixed_file, torch.bfloat16, torch.device("cpu"))  # bf16: a GPU's compute dtype
    assert plan.weights == held_bytes(loaded, monkeypatch)


def test_a_folder_converted_from_the_gguf_is_planned_with_its_kept_blocks(mixed_file, tmp_path, monkeypatch):
    from engine.convert import convert
    from engine.loaders import converted

    folder = convert(str(mixed_file), tmp_path / "out", WeightFormats(), torch.bfloat16).folder
    config = converted.settled_config(EngineConfig(model=str(folder), device="cuda"))
    plan = plan_memory(read_spec(str(folder)), config, "cuda")
    gguf_plan = plan_memory(read_spec(str(mixed_file)), EngineConfig(model=str(mixed_file), device="cuda"), "cuda")
    assert plan.weights == gguf_plan.weights
    monkeypatch.setattr(converted, "kept_types", lambda device: GPU_TYPES)
    loaded = converted.load_converted(folder, torch.bfloat16, torch.device("cpu"))
    assert plan.weights == held_bytes(loaded, monkeypatch)
