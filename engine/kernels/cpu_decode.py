"""A llama-family model's decoder layers on the CPU in one C call (`cpu_decode.c`) for the few rows of a decode or
verify step, of one sequence or several (their projections read the weights once for all of them): a layer's ~20
separate ops cost more in dispatch than in arithmetic on a small model, and its projections are too small to thread
one by one. Weights in GGUF blocks (`quant/gguf_blocks.py`) or fp32; fp32 activations and KV. The reference is the
model's composition of torch ops (`models/llama.py`), which runs wherever this does not: no C compiler, a GPU,
other dtypes, an 8-bit KV store, sequences in different stores or a prefill chunk."""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType as Q

from ..cache.kv_cache import KVCache
from ..cache.kv_pool import PAGE
from ..quant.gguf_blocks import BLOCK_TYPES, GGUFWeight, float_rows
from . import cpu_build
from .cpu_gguf import MAX_ROWS  # a decode or verify step's rows

MAX_PARTS = 4  # cpu_decode.c's MAX_PARTS
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


class _Weight(ctypes.Structure):
    _fields_ = [("parts", _I64), ("qtype", _I64 * MAX_PARTS), ("data", _PTR * MAX_PARTS), ("rows", _I64 * MAX_PARTS)]


class _Layer(ctypes.Structure):
    _fields_ = [("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64), ("rotary_dim", _I64),
                ("ffn", _I64), ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("in_norm", _PTR),
                ("post_norm", _PTR), ("qkv", _Weight), ("o", _Weight), ("gate_up", _Weight), ("down", _Weight)]


class _Step(ctypes.Structure):
    _fields_ = [("x", _PTR), ("h", _PTR), ("has_h", _I64), ("t", _I64), ("pos", _PTR), ("table", _PTR),
                ("cos", _PTR), ("sin", _PTR), ("k", _PTR), ("v", _PTR), ("layer_floats", _I64), ("page", _I64),
                ("len", _I64)]


_SIGNATURES = {
    "ninfer_llama_layers": ([ctypes.POINTER(_Layer), _I64, _I64, ctypes.POINTER(_Step), _INT], _INT),
}


def _library() -> ctypes.CDLL | None:
    try:
        return cpu_build.library(_SIGNATURES)
    except OSError:
        return None


def _weight(w, keep: list) -> _Weight | None:
    """A projection's row ranges as the kernel reads them (None: a format it does not read). Plain tensors become
    F32 rows; `keep` holds whatever memory the structure points into."""
    if isinstance(w, torch.Tensor):
        if w.dtype != torch.float32 or w.is_cuda:
            return None
        parts = (float_rows(w),)
    elif isinstance(w, GGUFWeight) and w.compute_dtype == torch.float32 and w.device.type == "cpu":
        parts = w.parts
    else:
        return None
    if len(parts) > MAX_PARTS or any(p.qtype not in (*map(int, BLOCK_TYPES), int(Q.F32)) for p in parts):
        return None
    out = _Weight(len(parts))
    for i, p in enumerate(parts):
        data = p.data.contiguous()
        keep.append(data)
        out.qtype[i], out.data[i], out.rows[i] = p.qtype, data.data_ptr(), p.rows
    return out


class LlamaLayers:
    """The C form of a llama model's layers: the weights' addresses and the geometry, made once."""

    def __init__(self, lib: ctypes.CDLL, layers: list[_Layer], keep: list) -> None:
        self.lib, self.count, self._keep = lib, len(layers), keep
        self.layers = (_Layer * len(layers))(*layers)

    @classmethod
    def build(cls, spec, layers: list[dict], rotary_dim: int, scale: float) -> LlamaLayers | None:
        """None where the kernel cannot run these layers (no compiler, a GPU, another dtype or weight format)."""
        if spec.num_heads % spec.num_kv_heads:
            return None
        keep: list = []
        built = []
        for w in layers:
            if any(isinstance(v, torch.Tensor) and (v.dtype != torch.float32 or v.is_cuda) for v in w.values()):
                return None
            weights = {name: _weight(w[name], keep) for name in ("qkv", "o", "gate_up", "down")}
            if any(v is None for v in weights.values()):
                return None
            norms = [w["in_norm"].contiguous(), w["post_norm"].contiguous()]
            keep.extend(norms)
            built.append(_Layer(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, rotary_dim,
                                spec.intermediate_size, spec.rms_eps, scale, norms[0].data_ptr(),
                                norms[1].data_ptr(), **weights))
        lib = _library()
        return None if lib is None else cls(lib, built, keep)

    def step(self, x: torch.Tensor, seqs: list[tuple[KVCache, int, int]], cos: torch.Tensor, sin: torch.Tensor
             ) -> Callable | None:
        """The layers' run for a step over rows x of the sequences `seqs` ((kv, start, rows) in row order: each
        one's rows at positions start..), or None where the torch ops must run it. The run takes a Taps (or None)
        and returns (x, h): the residual stream after the last layer and that layer's output, still to be added
        to it."""
        t = x.shape[0]
        store = seqs[0][0].store
        if t > MAX_ROWS or x.dtype != torch.float32 or x.is_cuda or store.quantized \
                or store.k.dtype != torch.float32 or sum(n for _, _, n in seqs) != t \
                or any(kv.store is not store or start + n > kv.table.span for kv, start, n in seqs):
            return None
        pos = torch.cat([torch.arange(start, start + n) for _, start, n in seqs])

        def run(taps) -> tuple[torch.Tensor, torch.Tensor]:
            tables = (_PTR * t)(*(kv.table.tensor.data_ptr() for kv, _, n in seqs for _ in range(n)))
            rows, h = x.contiguous().clone(), torch.empty_like(x)  # updated in place, layer after layer
            c, s = cos.contiguous(), sin.contiguous()
            args = _Step(rows.data_ptr(), h.data_ptr(), 0, t, pos.data_ptr(), ctypes.addressof(tables), c.data_ptr(),
                         s.data_ptr(), store.k.data_ptr(), store.v.data_ptr(), store.k[0].numel(), PAGE, 0)
            first = 0
            for last in [*sorted(taps.layer_ids if taps is not None else ()), self.count - 1]:
                if last >= first:  # layers first..last in one call, then the tap after `last`
                    if self.lib.ninfer_llama_layers(self.layers, first, last + 1, ctypes.byref(args),
                                                    torch.get_num_threads()):
                        raise MemoryError("out of memory for a CPU decode step's activations")
                    if taps is not None and last in taps.layer_ids:
                        taps.keep(last, rows + h)
                    first = last + 1
            return rows, h

        return run
