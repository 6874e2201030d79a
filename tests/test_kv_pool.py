"""The paged KV pool: blocks handed out and given back, block tables (the slots they map positions to, the
slice fast path), KV written and read through a table whose blocks are scattered, and the engine keeping held
conversations in the pool."""

import os

import pytest
import torch

from engine.cache.kv_cache import KVCache, dequantize_per_head, quantize_per_head
from engine.cache.kv_pool import PAGE, SCRATCH, BlockTable, KVPool, StoreSpec


def scattered_cache(layers: int, tokens: int, heads: int, dim: int, kv_dtype: str, dtype: torch.dtype,
                    device: str, seed: int = 0) -> KVCache:
    """A cache of `tokens` tokens whose blocks are scattered over a pool twice its size (no two consecutive), so
    every read and write goes through the block table."""
    pool = KVPool.for_tokens(2 * tokens + PAGE, torch.device(device))
    spec = StoreSpec(layers, heads, dim, kv_dtype, dtype)
    kv = KVCache(pool.store("target", spec), BlockTable(pool, tokens))
    ids = pool.allocate(pool.free_blocks)
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed)).tolist()
    want = -(-tokens // PAGE)
    chosen = [ids[i] for i in perm if ids[i] % 2 == 0][:want]  # even ids: never consecutive
    kv.table.add(chosen)
    pool.release([i for i in ids if i not in chosen])
    assert kv.table.run(PAGE + 1) is None
    return kv


def test_pool_hands_out_blocks_and_never_the_scratch_block():
    pool = KVPool(4, torch.device("cpu"))
    a = pool.allocate(3)
    assert sorted(a) == [1, 2, 3] and SCRATCH not in a
    assert pool.allocate(2) is None and pool.free_blocks == 1  # all or nothing
    pool.release(a[:2])
    assert pool.free_blocks == 3 and sorted(pool.allocate(3)) == sorted([4, *a[:2]])


def test_table_maps_positions_through_its_blocks():
    pool = KVPool(8, torch.device("cpu"))
    t = BlockTable(pool, 3 * PAGE)
    assert t.reserve(2 * PAGE + 1) and t.capacity == 3 * PAGE and t.run(3 * PAGE) == t.ids[0] * PAGE
    pos = torch.tensor([0, PAGE - 1, PAGE, 2 * PAGE + 5, 3 * PAGE + 2])  # the last: past the blocks, in the span
    want = [t.ids[0] * PAGE, t.ids[0] * PAGE + PAGE - 1, t.ids[1] * PAGE, t.ids[2] * PAGE + 5, SCRATCH * PAGE + 2]
    assert t.slots(pos).tolist() == want
    assert not t.reserve(20 * PAGE) and t.capacity == 3 * PAGE  # the pool lacks them: nothing taken
    held = BlockTable(pool, 3 * PAGE)
    held.add(pool.allocate(1))
    first = held.ids[0]
    t.truncate(PAGE + 1)  # keeps two blocks
    assert len(t.ids) == 2 and t.tensor[2:].eq(SCRATCH).all()
    rest = list(t.ids)
    t.move_from(held)  # the held blocks go first
    assert t.ids == [first, *rest] and held.ids == [] and held.tensor.eq(SCRATCH).all()
    assert t.tensor[:3].tolist() == t.ids and t.run(PAGE) == first * PAGE and t.run(2 * PAGE) is None
    t.release()
    assert pool.free_blocks == 8


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
def test_scattered_blocks_read_back_what_was_written(kv_dtype):
    g = torch.Generator().manual_seed(1)
    n = 3 * PAGE + 17
    kv = scattered_cache(2, n, 3, 16, kv_dtype, torch.float32, "cpu")
    k, v = torch.randn(n, 3, 16, generator=g), torch.randn(n, 3, 16, generator=g)
    order = torch.randperm(n, generator=g)  # written in pieces, out of order
    for piece in order.split(37):
        kv.write(1, piece, k[piece], v[piece])
    got_k, got_v = kv.read(1, n)
    for got, src in ((got_k, k), (got_v, v)):
        want = src if kv_dtype == "auto" else dequantize_per_head(*quantize_per_head(src, kv_dtype), torch.float32)
        assert torch.equal(got, want)


GREEDY = dict(temperature=0, ignore_eos=True)


def _engine(**kw):
    """On the CPU; on a GPU (NINFER_TEST_DEVICE=cuda) the requests run in lanes of CUDA graphs."""
    from engine import Engine, EngineConfig

    device = os.environ.get("NINFER_TEST_DEVICE", "cpu")
    return Engine(EngineConfig("synthetic:tiny", device=device, dtype="float32", **kw))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_held_conversations_keep_their_blocks_and_the_next_turn_takes_them_over():
    from engine import SamplingParams

    eng = _engine(max_context=512, kv_capacity=1024)
    total = eng.stats()["kv_tokens_free"]
    assert total == 1024 and eng.stats()["kv_tokens_in_use"] == 0
    params = SamplingParams(max_tokens=12, **GREEDY)
    a, b = _prompt(70, 1), _prompt(150, 2)
    first_a = eng.complete(a, params)
    first_b = eng.complete(b, params)
    held = {len(h.tokens): h for h in eng.held}
    assert sorted(held) == [70 + 11, 150 + 11]  # prompt and every output token but the last
    assert eng.stats()["kv_tokens_in_use"] == 2 * PAGE + 3 * PAGE  # only the blocks they fill
    # A's next turn continues in A's two blocks and new ones after B's: its KV is scattered over the pool
    follow = a + first_a.token_ids + _prompt(40, 3)
    again = eng.complete(follow, params)
    assert again.cached_tokens == 70 + 11
    (a_held,) = [h for h in eng.held if len(h.tokens) > 150 + 11 or h.tokens[:5] == a[:5]]
    assert a_held.cache.kv.table.run(len(a_held.tokens)) is None  # not one run of blocks
    fresh = _engine(max_context=512, held_sequences=0)
    assert again.token_ids == fresh.complete(follow, params).token_ids
    assert first_b.token_ids == fresh.complete(b, params).token_ids


def _full_pool_with_two_held(seed: int):
    """An engine whose pool of 4 blocks holds two finished conversations (60 + 8 tokens: two blocks each)."""
    from engine import SamplingParams

    eng = _engine(max_context=256, kv_capacity=256)
    a, b = _prompt(60, seed), _prompt(60, seed + 1)
    for p in (a, b):
        eng.complete(p, SamplingParams(max_tokens=8, **GREEDY))
    assert len(eng.held) == 2 and eng.stats()["kv_tokens_free"] == 0
    return eng, a, b


def test_a_request_that_needs_the_room_drops_the_oldest_held_conversations():
    from engine import SamplingParams

    eng, a, b = _full_pool_with_two_held(4)
    params = SamplingParams(max_tokens=8, **GREEDY)
    c = _prompt(100, 6)
    out = eng.complete(c, params)  # needs two blocks: the oldest (a) goes, b stays
    assert out.cached_tokens == 0
    assert [h.tokens[:60] for h in eng.held] == [b, c[:60]]
    assert eng.complete(b + [7], params).cached_tokens == 60  # the recurrent state's checkpoint: b's end
    fresh = _engine(max_context=256, held_sequences=0)
    assert out.token_ids == fresh.complete(c, params).token_ids


def test_shared_blocks_are_free_again_when_the_last_table_gives_them_back():
    pool = KVPool(6, torch.device("cpu"))
    a = BlockTable(pool, 4 * PAGE)
    assert a.reserve(3 * PAGE)
    b = BlockTable(pool, 4 * PAGE)
    b.add(pool.allocate(1))
    b.share_from(a, 2)  # a's first two blocks, as b's first ones
    assert b.ids[:2] == a.ids[:2] and pool.free_blocks == 2
    assert pool.freeable([a.ids]) == 1 and pool.freeable([a.ids, b.ids]) == 4
    a.release()
    assert pool.free_blocks == 3  # the shared two stay with b
    b.release()
    assert pool.free_blocks == 6


def test_a_prompt_that_leaves_a_held_conversation_shares_its_blocks_and_keeps_it_held():
    from engine import SamplingParams

    eng = _engine(max_context=512, kv_capacity=2048)
    params = SamplingParams(max_tokens=12, **GREEDY)
    a = _prompt(130, 7)  # two full blocks and two tokens
    first = eng.complete(a, params)
    assert eng.stats()["kv_tokens_in_use"] == 3 * PAGE  # 141 tokens
    other = (first.token_ids[0] + 1) % 256
    b = a + [other, 5, 6]  # the same start, then another way
    branch = eng.complete(b, params)
    assert branch.cached_tokens == 130 and len(eng.held) == 2
    # the branch lists the two full blocks of a's prompt and copied the rest: 3 + 1 blocks in use
    assert eng.stats()["kv_tokens_in_use"] == 4 * PAGE
    again = eng.complete(a + first.token_ids + [9], params)  # the first conversation goes on: taken over
    assert again.cached_tokens == 130 + 11
    fresh = _engine(max_context=512)
    assert branch.token_ids == fresh.complete(b, params).token_ids
    # the branch's KV, shared and copied rows alike, is a fresh run's
    (mine,) = [h for h in eng.held if h.tokens[:len(b)] == b]
    (theirs,) = list(fresh.held)
    assert mine.tokens == theirs.tokens
    # a GPU's fp32 dots round through tf32, and the two runs split the prompt differently: rows agree to ~1e-3
    tol = dict(rtol=1e-4, atol=1e-5) if eng.config.device == "cpu" else dict(rtol=2e-2, atol=2e-2)
    for layer in range(mine.cache.kv.store.spec.layers):
        for got, want in zip(mine.cache.kv.read(layer, len(b)), theirs.cache.kv.read(layer, len(b)), strict=True):
            assert torch.allclose(got, want, **tol)
    fresh.drop_held()
    assert again.token_ids == fresh.complete(a + first.token_ids + [9], params).token_ids
    eng.drop_held()
    assert eng.stats()["kv_tokens_in_use"] == 0


def test_a_request_takes_blocks_as_it_decodes_and_only_then_drops_held_conversations():
    from engine import SamplingParams

    eng, a, b = _full_pool_with_two_held(8)
    # reserves all 4 blocks (10 + 200 tokens) but starts with one: a (the oldest) goes now, b when it grows
    c = _prompt(10, 10)
    stops_at_once = SamplingParams(max_tokens=200, temperature=0, stop_token_ids=list(range(256)))
    assert eng.complete(c, stops_at_once).completion_tokens == 0
    assert [h.tokens[:60] for h in eng.held][0] == b  # b was not needed
    long = SamplingParams(max_tokens=200, **GREEDY)
    d = _prompt(10, 11)
    out = eng.complete(d, long)  # grows to 4 blocks: b and c go on the way
    assert out.completion_tokens == 200 and [h.tokens[:10] for h in eng.held] == [d]
    fresh = _engine(max_context=256, held_sequences=0)
    assert out.token_ids == fresh.complete(d, long).token_ids
    assert eng.stats()["kv_tokens_in_use"] == 4 * PAGE  # the held one: 10 + 199 tokens
