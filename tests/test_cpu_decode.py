"""The whole-layer C kernel of a CPU decode step (`kernels/cpu_decode.py`) against a llama layer written in plain
torch on the same weights dequantized (float64): random weights of each GGUF type and fp32, KV rows in blocks
that are not consecutive, one and several threads; and on the default model, the kernel's steps against the
model's composition of ops."""
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine.cache.kv_cache import KVCache
from engine.cache.kv_pool import BlockTable, KVPool, StoreSpec
from engine.kernels import cpu_decode, cpu_gguf
from engine.models.layers import causal_attention, rms_norm_reference
from engine.models.taps import Taps
from engine.quant.gguf_blocks import GGUFWeight, concat, dequantize, from_blocks

from .conftest import rel_error
from .test_cpu_kernels import random_blocks

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
if not cpu_gguf.available():
    pytest.skip("no C compiler: the CPU kernels are not built here", allow_module_level=True)
SPEC = SimpleNamespace(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512,
                       rms_eps=1e-5)
ROTARY = 32  # partial rotary: the rest of each head passes through


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def weight(qtype, rows: int, k: int, seed: int):
    if qtype == "f32":
        return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return from_blocks(qtype, torch.from_numpy(random_blocks(qtype, rows, k, seed)), k, torch.float32)


def layer_weights(qtype) -> dict:
    s = SPEC
    qd, kvd = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    g = torch.Generator().manual_seed(7)
    mixed = qtype == "mixed"  # a Q4_K_M file's: q/k/v parts of several types in one projection
    other = Q.Q4_K if mixed else qtype
    w = {"in_norm": torch.rand(s.hidden_size, generator=g) + 0.5,
         "post_norm": torch.rand(s.hidden_size, generator=g) + 0.5,
         "o": weight(other, s.hidden_size, qd, 2), "gate_up": weight(other, 2 * s.intermediate_size, s.hidden_size, 3),
         "down": weight(other, s.hidden_size, s.intermediate_size, 4)}
    if mixed:
        w["qkv"] = concat([weight(Q.Q4_K, qd, s.hidden_size, 1), weight(Q.Q6_K, kvd, s.hidden_size, 5),
                           weight("f32", kvd, s.hidden_size, 6)])
    else:
        w["qkv"] = weight(qtype, qd + 2 * kvd, s.hidden_size, 1)
    return w


def dense(w, dtype: torch.dtype) -> torch.Tensor:
    return dequantize(w, dtype) if isinstance(w, GGUFWeight) else w.to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot, rest = x[..., :ROTARY], x[..., ROTARY:]
    half = ROTARY // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos[:, None] + rotated * sin[:, None], rest], dim=-1)


def reference_layer(w: dict, x, h, keys, values, cos, sin, dtype: torch.dtype):
    """A llama layer in torch over rows x [T, hidden] (+ h) after the cached keys/values [start, Hkv, D]:
    (x + h + attention, the MLP's output, this step's rotated keys, its values)."""
    s, t = SPEC, x.shape[0]
    x, cos, sin = (x + h).to(dtype), cos.to(dtype), sin.to(dtype)
    a = rms_norm_reference(x, w["in_norm"].to(dtype), s.rms_eps)
    qkv = a @ dense(w["qkv"], dtype).T
    qd, kvd = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    q = rope(qkv[:, :qd].reshape(t, s.num_heads, s.head_dim), cos, sin)
    k = rope(qkv[:, qd:qd + kvd].reshape(t, s.num_kv_heads, s.head_dim), cos, sin)
    v = qkv[:, qd + kvd:].reshape(t, s.num_kv_heads, s.head_dim)
    start = keys.shape[0]
    attn = causal_attention(q, torch.cat([keys.to(dtype), k]), torch.cat([values.to(dtype), v]), start,
                            s.head_dim ** -0.5)
    x = x + attn.reshape(t, qd) @ dense(w["o"], dtype).T
    a = rms_norm_reference(x, w["post_norm"].to(dtype), s.rms_eps)
    gate, up = (a @ dense(w["gate_up"], dtype).T).chunk(2, dim=-1)
    return x, (F.silu(gate) * up) @ dense(w["down"], dtype).T, k, v


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K, "f32", "mixed"],
                         ids=lambda q: q if isinstance(q, str) else q.name)
@pytest.mark.parametrize("t,start", [(1, 0), (1, 150), (5, 61), (16, 100)])  # decode, verify steps; across blocks
def test_layers_match_torch(qtype, t, start, threads):
    """Two layers (the second adds the first's output), the first one's output kept for a tap."""
    s = SPEC
    weights = [layer_weights(qtype), layer_weights(Q.Q8_0 if qtype == Q.Q4_1 else Q.Q4_1)]
    layers = cpu_decode.LlamaLayers.build(s, weights, ROTARY, s.head_dim ** -0.5)
    assert layers is not None
    pool = KVPool(8, torch.device("cpu"))
    table = BlockTable(pool, 256)
    table.add([6, 2, 7, 3])  # not consecutive: rows found through the table
    kv = KVCache(pool.store("target", StoreSpec(2, s.num_kv_heads, s.head_dim, "auto", torch.float32)), table)
    g = torch.Generator().manual_seed(t + start)
    keys = torch.randn(2, start, s.num_kv_heads, s.head_dim, generator=g)
    values = torch.randn(2, start, s.num_kv_heads, s.head_dim, generator=g)
    if start:
        for i in range(2):
            kv.write(i, torch.arange(start), keys[i], values[i])
    x = torch.randn(t, s.hidden_size, generator=g) * 2
    angles = torch.arange(start, start + t, dtype=torch.float64)[:, None] * torch.rand(ROTARY // 2, generator=g,
                                                                                         dtype=torch.float64)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    taps = Taps(layer_ids=(0,))
    got_x, got_h = layers.step(x, [(kv, start, t)], cos.float(), sin.float())(taps)
    cached = [kv.read(i, start + t) for i in range(2)]
    got = [taps.layers[0], *(c[start:] for c in cached[0]), got_x, got_h, *(c[start:] for c in cached[1])]
    want, fp32 = (reference_layers(weights, x, keys, values, cos, sin, dtype) for dtype in (torch.float64,
                                                                                            torch.float32))
    for result, ref, near in zip(got, want, fp32, strict=True):
        # within fp32 rounding: what the same layers in fp32 torch stand from float64 (random K-quant weights make
        # large activations and peaked attention, where that reaches 2e-5), or 1e-6
        assert rel_error(result, ref) < max(1e-6, 2 * rel_error(near, ref))
    for i in range(2):
        assert torch.equal(cached[i][0][:start], keys[i]) and torch.equal(cached[i][1][:start], values[i])


def reference_layers(weights: list[dict], x, keys, values, cos, sin, dtype) -> list[torch.Tensor]:
    """Two layers: the first's x + h, keys, values; the second's x, h, keys, values."""
    x0, h0, k0, v0 = reference_layer(weights[0], x, torch.zeros_like(x), keys[0], values[0], cos, sin, dtype)
    x1, h1, k1, v1 = reference_layer(weights[1], x0, h0, keys[1], values[1], cos, sin, dtype)
    return [x0 + h0, k0, v0, x1, h1, k1, v1]


def test_a_step_of_several_sequences_equals_each_alone(threads):
    """Three sequences' decode and verify rows in one call (each projection reads the weights once for all) give
    each sequence's rows and cached keys exactly what a call of its own gives: a row attends to its own sequence."""
    s = SPEC
    weights = [layer_weights(Q.Q4_K), layer_weights(Q.Q8_0)]
    layers = cpu_decode.LlamaLayers.build(s, weights, ROTARY, s.head_dim ** -0.5)
    shapes = [(40, 1, [5]), (100, 5, [1, 6]), (0, 3, [3])]  # cached keys, this step's rows, blocks
    g = torch.Generator().manual_seed(11)
    cached = [(torch.randn(2, start, s.num_kv_heads, s.head_dim, generator=g),
               torch.randn(2, start, s.num_kv_heads, s.head_dim, generator=g)) for start, _, _ in shapes]
    x = torch.randn(sum(n for _, n, _ in shapes), s.hidden_size, generator=g)
    angles = torch.rand(x.shape[0], ROTARY, generator=g) * 50
    cos, sin = angles.cos(), angles.sin()

    def sequences() -> list[KVCache]:
        pool = KVPool(8, torch.device("cpu"))
        store = pool.store("target", StoreSpec(2, s.num_kv_heads, s.head_dim, "auto", torch.float32))
        kvs = []
        for (start, _, blocks), (keys, values) in zip(shapes, cached, strict=True):
            table = BlockTable(pool, 256)
            table.add(blocks)
            kvs.append(KVCache(store, table))
            for i in range(2 if start else 0):
                kvs[-1].write(i, torch.arange(start), keys[i], values[i])
        return kvs

    together = sequences()
    got_x, got_h = layers.step(x, [(kv, start, n) for kv, (start, n, _) in zip(together, shapes, strict=True)],
                               cos, sin)(None)
    alone, first = sequences(), 0
    for kv, (start, n, _) in zip(alone, shapes, strict=True):
        r = slice(first, first + n)
        want_x, want_h = layers.step(x[r], [(kv, start, n)], cos[r], sin[r])(None)
        assert torch.equal(got_x[r], want_x) and torch.equal(got_h[r], want_h)
        first += n
    for a, b, (start, n, _) in zip(together, alone, shapes, strict=True):
        for i in range(2):
            assert all(torch.equal(p, q) for p, q in zip(a.read(i, start + n), b.read(i, start + n), strict=True))
    other = sequences()[0]  # a sequence in another pool's store: the torch ops run the step
    assert layers.step(x[:2], [(together[0], 40, 1), (other, 40, 1)], cos[:2], sin[:2]) is None


def test_steps_it_does_not_take():
    """Prefill chunks and 8-bit KV stay on the torch ops."""
    s = SPEC
    layers = cpu_decode.LlamaLayers.build(s, [layer_weights(Q.Q4_1)], ROTARY, 0.125)
    cos = sin = torch.zeros(1, ROTARY)
    plain = KVCache.new(StoreSpec(1, s.num_kv_heads, s.head_dim, "auto", torch.float32), 64, torch.device("cpu"))
    int8 = KVCache.new(StoreSpec(1, s.num_kv_heads, s.head_dim, "int8", torch.float32), 64, torch.device("cpu"))
    x = torch.randn(1, s.hidden_size)
    assert layers.step(x, [(plain, 0, 1)], cos, sin) is not None
    rows = cpu_decode.MAX_ROWS + 1
    assert layers.step(torch.randn(rows, s.hidden_size), [(plain, 0, rows)], cos.expand(rows, -1),
                       sin.expand(rows, -1)) is None
    assert layers.step(x, [(int8, 0, 1)], cos, sin) is None
    assert layers.step(x.double(), [(plain, 0, 1)], cos, sin) is None
    assert cpu_decode.LlamaLayers.build(s, [{**layer_weights(Q.Q4_1), "o": torch.randn(256, 256).half()}],
                                        ROTARY, 0.125) is None


def test_default_model_steps_equal_its_ops(default_engine, threads):
    """SmolLM2's decode and verify steps through the layer kernel equal the model's composition of per-op kernels
    (the same dot products and sums in the same order)."""
    model = default_engine.model
    fused = model.cpu_layers
    assert fused is not None
    ids = torch.tensor(default_engine.tokenizer.encode("The printing press begins in the fifteenth century."))
    caches = model.new_cache(128), model.new_cache(128)
    with torch.inference_mode():
        for tokens, all_logits in ((ids, False), (torch.tensor([1000]), False), (torch.tensor([1037]), False),
                                   (torch.tensor([5, 6, 7, 8]), True)):
            got = model.forward(tokens, caches[0], all_logits=all_logits)
            model.cpu_layers = None
            try:
                want = model.forward(tokens, caches[1], all_logits=all_logits)
            finally:
                model.cpu_layers = fused
            assert torch.equal(got, want)


def counting(step, calls: list[int]):
    """`LlamaLayers.step` noting the rows of each call it takes (not those it leaves to the torch ops)."""
    def counted(*args):
        run = step(*args)
        if run is not None:
            calls.append(args[0].shape[0])
        return run
    return counted


def test_a_step_of_several_sequences_runs_them_in_one_layer_kernel_call(default_engine):
    """Rows of several sequences (a decode row, a verify step's rows) run in one kernel call, and equal the torch
    ops' batched step."""
    from engine.models.decoder import Row

    model = default_engine.model
    fused = model.cpu_layers
    ids = torch.tensor(default_engine.tokenizer.encode("The printing press begins in the fifteenth century."))
    calls = []
    step = fused.step
    counted = counting(step, calls)
    logits = []
    with torch.inference_mode():
        for c in (False, True):
            caches = [model.new_cache(128, default_engine.pool), model.new_cache(128, default_engine.pool)]
            for cache in caches:
                assert cache.kv.table.reserve(128)  # blocks of their own, as the scheduler gives them
            model.forward(ids, caches[0])
            model.forward(ids[:7], caches[1])
            model.cpu_layers = fused if c else None
            fused.step = counted
            try:
                rows = [Row(caches[0], 1), Row(caches[1], 3, all_logits=True)]
                logits.append(model.forward_rows(torch.tensor([1000, 5, 6, 7]), rows))
            finally:
                model.cpu_layers = fused
                del fused.step
    assert calls == [4]  # one call for both sequences' rows
    assert torch.equal(logits[0], logits[1])


def test_sequences_over_one_calls_rows_run_in_groups(default_engine):
    """Four verify steps of 5 rows (20, more than one call takes) run as calls of 15 and 5 rows, equal to each
    sequence's step alone; a step whose hidden states a drafter taps keeps to the torch ops (a tap takes the rows at
    once), within fp32 rounding of them (20 rows multiply dequantized weights there)."""
    from engine.models.decoder import Row

    model = default_engine.model
    fused = model.cpu_layers
    ids = torch.tensor(default_engine.tokenizer.encode("The printing press begins in the fifteenth century."))
    calls = []
    step = fused.step
    counted = counting(step, calls)
    fused.step = counted
    logits, made = {}, {}
    try:
        with torch.inference_mode():
            for way in ("together", "alone", "tapped"):
                caches = [model.new_cache(128, default_engine.pool) for _ in range(4)]
                for i, cache in enumerate(caches):
                    assert cache.kv.table.reserve(128)
                    model.forward(ids[:5 + i], cache)
                tokens = torch.arange(100, 120)
                calls.clear()
                if way == "alone":
                    logits[way] = torch.cat([model.forward_rows(tokens[5 * i:5 * i + 5], [Row(c, 5, all_logits=True)])
                                             for i, c in enumerate(caches)])
                else:
                    logits[way] = model.forward_rows(tokens, [Row(c, 5, all_logits=True) for c in caches],
                                                     taps=Taps(layer_ids=(3,)) if way == "tapped" else None)
                made[way] = list(calls)
    finally:
        del fused.step
    assert made == {"together": [15, 5], "alone": [5, 5, 5, 5], "tapped": []}
    assert torch.equal(logits["together"], logits["alone"])
    assert rel_error(logits["tapped"], logits["together"]) < 1e-5


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_child_forked_while_a_kernel_runs_can_call_the_kernels(threads):
    """The kernels' callers' lock is held through a fork (the fork waits for the job under way) and given back in
    the child: a child forked while another thread ran a kernel, on one thread or a team, must not hang."""
    w = weight(Q.Q8_0, 1024, 256, 1)
    x = torch.randn(16, 256)
    stop = threading.Event()

    def busy():
        torch.set_num_threads(threads)
        while not stop.is_set():
            cpu_gguf.linear(x, w)

    runner = threading.Thread(target=busy)
    runner.start()
    try:
        hung = 0
        for _ in range(5):
            time.sleep(0.01)
            pid = os.fork()
            if pid == 0:  # the child: killed by SIGALRM if the call hangs
                signal.alarm(5)
                cpu_gguf.linear(x, w)
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            hung += os.WIFSIGNALED(status)
    finally:
        stop.set()
        runner.join()
    assert hung == 0
