"""GGUF blocks on a GPU (Q8_0, Q4_K, Q5_K, Q6_K kept as the file stores them, `kernels/gguf_matmul.py`): the
dequantized rows equal the gguf package's decoding exactly, the few-row matmul is within fp32 rounding of
x @ W_ref.T (its fp32 partials; its output within the rounding to x's dtype), the prefill path within the rounding
of the weights to x's dtype. In the Triton interpreter on the CPU at small sizes (random blocks: random bytes
with valid scales), and with NINFER_TEST_DEVICE=cuda at the 27B's sizes, every launch shape a row count tries.
Then the wiring: a tiny qwen35 GGUF keeps its blocks on a GPU, the memory plan counts their stored bytes, and its
logits on the GPU equal the same file's on the CPU path."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from engine.quant.gguf_blocks import GPU_TYPES, BlockRows, GGUFWeight, kept_types, random_blocks

from .conftest import gpu_only, interpret, rel_error

TYPES = [Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]

# Per type: the dequant kernel (every row, a gather, a row range cast to fp16) equal to gguf's decoding; the
# matmul in both kernels and every x dtype the interpreter multiplies (its tl.dot has no bf16, and its casts to
# bf16 truncate: bf16 goes through `fma` here, `mma` and the bf16 casts on the GPU), each split-K launch's fp32
# partials against x @ W_ref.T in fp64, each cast output against the same within its dtype's rounding. Prints the
# worst fp32-exact error.
KERNEL_CHECK = """
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from engine.kernels.gguf_matmul import GConfig, SplitK, dequantize_rows, launch
from engine.quant.gguf_blocks import BlockRows, random_blocks
from tests.conftest import rel_error
qtype = Q.{qtype}
g = torch.Generator().manual_seed(3)
n, k = 48, 512
data = random_blocks(qtype, n, k, generator=g)
part = BlockRows(int(qtype), data)
want = torch.from_numpy(gguf_dequantize(data.numpy(), qtype))
assert torch.equal(dequantize_rows(part, k, torch.float32), want)
ids = torch.tensor([5, 0, 47, 5, 31])
assert torch.equal(dequantize_rows(part, k, torch.float32, ids=ids), want[ids])
assert torch.equal(dequantize_rows(part, k, torch.float16, 16, 48), want[16:48].half())
eps = {{torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}}
worst = 0.0
for rows, kernel, dtype, split in ((1, "fma", torch.bfloat16, 2), (1, "fma", torch.float32, 1),
                                   (3, "mma", torch.float16, 2), (16, "mma", torch.float32, 1),
                                   (16, "mma", torch.float16, 1)):
    x = torch.randn(rows, k, generator=g).to(dtype)
    exact = x.double() @ want.double().T
    out = launch(x, part, k, GConfig(kernel, 32, 4, split))
    if split > 1:
        assert isinstance(out, SplitK) and out.parts.shape == (split, rows, n)
        err = rel_error(out.parts.sum(0), exact)
        worst = max(worst, err)
        out = out.dense()
    elif dtype == torch.float32:
        worst = max(worst, rel_error(out, exact))
    assert out.dtype == dtype and rel_error(out, exact) < eps[dtype], (rows, kernel, dtype)
print(worst)
"""


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_kernels_match_gguf_in_the_interpreter(qtype):
    assert interpret(KERNEL_CHECK.format(qtype=qtype.name)) < 1e-6


# The host side on a weight stacked from three parts (a K-quant, float rows, another K-quant), as a fused
# projection whose parts the file quantized differently: each part's launch into its columns (split-K parts summed
# there), a single part's unsummed partials with `partial`, a prefill-sized input's dequantized blocks, the
# embedding rows across parts; and a part that is a view of some of its blocks' columns.
WIRING_CHECK = """
import torch
from gguf import GGMLQuantizationType as Q
from engine.kernels import gguf_matmul
from engine.kernels.gguf_matmul import SplitK, linear, linear_reference, rows
from engine.quant.gguf_blocks import BlockRows, GGUFWeight, dequantize, float_rows, random_blocks
from tests.conftest import rel_error
g = torch.Generator().manual_seed(4)
k = 512  # two blocks: the launch shapes split K in two
a = BlockRows(int(Q.Q4_K), random_blocks(Q.Q4_K, 32, k, generator=g))
b = float_rows(torch.randn(16, k, generator=g) * 1e-2)
c = BlockRows(int(Q.Q6_K), random_blocks(Q.Q6_K, 32, k, generator=g))
w = GGUFWeight((a, b, c), k)
worst = 0.0
x = torch.randn(2, 3, k, generator=g)
out = linear(x, w, partial=True)
assert isinstance(out, torch.Tensor) and out.shape == (2, 3, 80)
worst = max(worst, rel_error(out, linear_reference(x, w)))
one = GGUFWeight((c,), k)
parts = linear(x[0], one, partial=True)
assert isinstance(parts, SplitK) and parts.shape == (3, 32)
worst = max(worst, rel_error(parts.dense(), linear_reference(x[0], one)))
assert torch.equal(linear(x[0], one), parts.dense())
many = torch.randn(gguf_matmul.MAX_ROWS + 6, k, generator=g)
worst = max(worst, rel_error(linear(many, w), linear_reference(many, w)))
ids = torch.tensor([79, 0, 40, 33, 47, 48, 5])
assert torch.equal(rows(w, ids), dequantize(w)[ids])
cut = GGUFWeight((BlockRows(a.qtype, a.data[:, 144:]),), 256)  # a tensor-parallel rank's block columns: a view
x = torch.randn(3, 256, generator=g)
worst = max(worst, rel_error(linear(x, cut), linear_reference(x, cut)))
print(worst)
"""


def test_stacked_parts_prefill_and_rows_in_the_interpreter():
    assert interpret(WIRING_CHECK) < 1e-6


def test_a_gpu_keeps_the_types_its_kernels_read():
    assert kept_types(torch.device("cuda")) == GPU_TYPES == (Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)


# ---- the 27B's sizes on a GPU --------------------------------------------------------------------------------

SHAPES_27B = ((17408, 5120), (5120, 17408))  # the MLP's up (and gate) and its down projection


@gpu_only
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_kernels_at_27b_sizes_on_the_gpu(qtype):
    from engine.kernels.gguf_matmul import MAX_ROWS, GConfig, SplitK, candidates, dequantize_rows, launch
    from engine.kernels.qmatmul import row_bucket

    g = torch.Generator().manual_seed(5)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n, k in SHAPES_27B:
        data = random_blocks(qtype, n, k, generator=g)
        part = BlockRows(int(qtype), data.cuda())
        sample = torch.cat([torch.arange(256), torch.randperm(n, generator=g)[:256], torch.arange(n - 16, n)])
        want = torch.from_numpy(gguf_dequantize(data[sample].numpy(), qtype))
        assert torch.equal(dequantize_rows(part, k, torch.float32, ids=sample.cuda()).cpu(), want)
        assert torch.equal(dequantize_rows(part, k, torch.bfloat16, ids=sample.cuda()).cpu(), want.bfloat16())
        # every row through the same code as the sample: the reference the matmuls are held to
        exact_w = dequantize_rows(part, k, torch.float32).double()
        w = GGUFWeight((part,), k, torch.bfloat16)
        for rows in (1, 8, MAX_ROWS):
            x = torch.randn(rows, k, generator=g).to(device="cuda", dtype=torch.bfloat16)
            exact = x.double() @ exact_w.T
            for cfg in candidates(n, k, sms, qtype, row_bucket(rows)[0]):
                out = launch(x, part, k, cfg)
                if isinstance(out, SplitK):
                    assert rel_error(out.parts.sum(0), exact) < 1e-5, (n, k, rows, cfg)
                    out = out.dense()
                assert rel_error(out, exact) < 1e-2, (n, k, rows, cfg)
            assert rel_error(w.matmul(x), exact) < 1e-2  # the chosen shape, through the weight
        # fp32 x: IEEE fp32 products on the tensor-core kernel too, never TF32 (one shape: each is a compilation)
        x = torch.randn(8, k, generator=g).cuda()
        assert rel_error(launch(x, part, k, GConfig("mma", 32, 4)), x.double() @ exact_w.T) < 1e-5, (n, k)
        x = torch.randn(512, k, generator=g).cuda()  # a prefill chunk
        exact = x.double() @ exact_w.T
        assert rel_error(w.matmul(x), exact) < 1e-5, (n, k)
        assert rel_error(w.matmul(x.bfloat16()), exact) < 1e-2, (n, k)
        del exact_w, exact
        torch.cuda.empty_cache()


# ---- a model ---------------------------------------------------------------------------------------------------

# A tiny qwen35 with rows of whole super-blocks (256-wide), every GPU type among its tensors: the embedding (a row
# gather), the LM head, q/k/v in three types (a three-part fused weight), gate and up alike (one part), the GDN
# projections in two, and `ssm_out`, whose columns the converter reorders (dequantized at load, not kept).
CONFIG = {"hidden_size": 256, "intermediate_size": 512, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2,
          "linear_num_value_heads": 4, "mtp_num_hidden_layers": 0}
TYPE_OF = {"token_embd.weight": Q.Q4_K, "output.weight": Q.Q6_K, "attn_q.weight": Q.Q4_K, "attn_k.weight": Q.Q5_K,
           "attn_v.weight": Q.Q6_K, "attn_output.weight": Q.Q8_0, "ffn_gate.weight": Q.Q4_K,
           "ffn_up.weight": Q.Q4_K, "ffn_down.weight": Q.Q6_K, "attn_qkv.weight": Q.Q5_K,
           "attn_gate.weight": Q.Q5_K, "ssm_beta.weight": Q.Q8_0, "ssm_alpha.weight": Q.Q8_0,
           "ssm_out.weight": Q.Q4_K}


def blocks_like(data: np.ndarray, qtype: int, seed: int) -> np.ndarray:
    """Random blocks with about the spread of `data` (the gguf package has no K-quant quantizer)."""
    g = torch.Generator().manual_seed(seed)
    unit = gguf_dequantize(random_blocks(qtype, 16, data.shape[1], 1.0, g).numpy(), qtype).std()
    return random_blocks(qtype, data.shape[0], data.shape[1], float(data.std() / unit), g).numpy()


def write_typed_gguf(base: Path, name: str, types: dict[str, int]) -> Path:
    """A tiny random qwen35 GGUF (`CONFIG`) with each tensor of `types` (its name in a block, or the embedding's
    or head's) in its type: the gguf package's quantizer where it has one, random blocks for the K-quants."""
    pytest.importorskip("transformers")
    import gguf

    from .conftest import write_tiny
    from .test_gguf_qwen35 import write_qwen35_gguf

    folder = write_tiny(base / "hf", seed=9, **CONFIG)
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    quantized = {f"blk.{i}.{t}": q for i in range(layers) for t, q in types.items()}
    quantized.update({t: q for t, q in types.items() if t in ("token_embd.weight", "output.weight")})
    real = gguf.quants.quantize
    seeds = iter(range(1000))

    def quantize(data, qtype):
        return blocks_like(data, qtype, next(seeds)) if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else real(data, qtype)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.quants, "quantize", quantize)
        return write_qwen35_gguf(folder, base / name, quantized)


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory):
    return write_typed_gguf(tmp_path_factory.mktemp("kquant"), "tiny-kquant.gguf", TYPE_OF)


def test_memory_plan_counts_the_blocks_a_gpu_keeps(kquant_file):
    from engine import EngineConfig
    from engine.config import WeightFormats
    from engine.loaders import read_spec
    from engine.loaders.gguf import load_gguf
    from engine.memory_plan import plan_memory
    from engine.models import weight_shapes

    spec = read_spec(str(kquant_file))
    config = EngineConfig(model=str(kquant_file), device="cuda")
    # the tensors a GPU load keeps, as a CPU load keeping the same types holds them (bf16: a GPU's compute dtype)
    loaded = load_gguf(kquant_file, torch.bfloat16, torch.device("cpu"), blocks=True).weights
    shapes = weight_shapes(spec)
    kept = [name for name in shapes if isinstance(loaded[name], GGUFWeight)]
    assert "embed_tokens.weight" in kept and "layers.0.linear_attn.out_proj.weight" not in kept
    assert plan_memory(spec, config, "cuda").weights == sum(loaded[name].nbytes for name in shapes)
    # formats in the profile: the load re-quantizes every tensor, the plan counts those formats
    q8 = EngineConfig(model=str(kquant_file), device="cuda", weights=WeightFormats.uniform("q8"))
    assert plan_memory(spec, q8, "cuda").weights > plan_memory(spec, config, "cuda").weights


@gpu_only
def test_model_on_the_gpu_matches_the_cpu_path(kquant_file):
    from engine import Engine, EngineConfig

    prompt = torch.randint(0, 256, (96,), generator=torch.Generator().manual_seed(0))

    def logits(device: str) -> tuple[torch.Tensor, object]:
        """A prefill-sized chunk (past the few-row kernel's 64 rows), a verify-sized one, then one-token steps."""
        model = Engine(EngineConfig(model=str(kquant_file), device=device, dtype="float32",
                                    cuda_graphs=False)).model
        cache = model.new_cache(len(prompt))
        with torch.inference_mode():
            out = [model.forward(prompt[:80].to(model.device), cache, all_logits=True),
                   model.forward(prompt[80:88].to(model.device), cache, all_logits=True)]
            out += [model.forward(prompt[i:i + 1].to(model.device), cache) for i in range(88, len(prompt))]
        return torch.cat([o.float().cpu() for o in out]), model

    on_gpu, model = logits("cuda")
    assert isinstance(model.embed, GGUFWeight) and model.embed.device.type == "cuda"
    assert isinstance(model.lm_head, GGUFWeight)
    on_cpu, _ = logits("cpu")
    assert rel_error(on_gpu, on_cpu) < 1e-3


def test_a_gguf_tile_that_computes_wrongly_is_never_chosen(monkeypatch):
    """The choice compares each tile's product, at both ends of the weight's rows, with x times the dequantize
    kernel's rows before timing it: a tile off in one output column, or one that cannot run, is passed over."""
    from types import SimpleNamespace

    from engine.kernels import gguf_matmul

    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 64, generator=g), torch.randn(700, 64, generator=g)
    part = SimpleNamespace(rows=700)
    monkeypatch.setattr(gguf_matmul, "dequantize_rows", lambda part, k, dtype, start, stop: w[start:stop])
    monkeypatch.setattr(gguf_matmul, "launch", lambda x, part, k, cfg: x @ w.T)
    assert gguf_matmul._agrees(x, part, 64, None)
    wrong = x @ w.T
    wrong[:, 650] *= -1  # a last, partial tile's column: past the first CHECK_ROWS
    monkeypatch.setattr(gguf_matmul, "launch", lambda x, part, k, cfg: wrong)
    assert not gguf_matmul._agrees(x, part, 64, None)

    def fails(x, part, k, cfg):
        raise RuntimeError("out of shared memory")

    monkeypatch.setattr(gguf_matmul, "launch", fails)
    assert not gguf_matmul._agrees(x, part, 64, None)
