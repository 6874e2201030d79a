"""The host memory tier: held conversations' KV (`host_kv_mib`) and recurrent states (`host_state_slots`) kept in
host memory instead of on the device, within their budgets (the oldest go first); the memory plan takes them off
the device. On the CPU the tier's copies stay in the same memory, so these tests check the bookkeeping and the
reuse; `tests/test_runner.py` checks the pinned copies and their way back on a GPU."""

import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.cache.held import HeldSequence, HeldSequences
from engine.cache.kv_cache import KVCache
from engine.cache.kv_pool import StoreSpec
from engine.cache.sequence import SequenceCache
from engine.cache.state_slots import GDNState
from engine.loaders.synthetic import preset_spec
from engine.memory_plan import GIB, MESSAGE_CHECKPOINTS, MIB, kv_bytes_per_token, plan_memory

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _held(tokens: int, checkpoints: int = 0) -> HeldSequence:
    kv = KVCache.new(StoreSpec(1, 1, 64, "int8", torch.float32), tokens, torch.device("cpu"))  # 2 x (64 + 4) B/token
    states = GDNState.zeros(1, 4, 8, 1, 4, 4, torch.float32, torch.device("cpu"))
    cache = SequenceCache(kv=kv, states=states, length=tokens)
    return HeldSequence(list(range(tokens)), cache, {i: states.snapshot() for i in range(checkpoints)})


def test_budgets_evict_the_oldest_and_refuse_what_alone_does_not_fit():
    unit = _held(128).cache.kv.nbytes  # two blocks
    assert unit == 128 * 2 * (64 + 4)
    held = HeldSequences(4, kv_bytes=3 * unit)
    a, b, c, d = (_held(128) for _ in range(4))
    for h in (a, b, c):
        held.put(h)
    assert list(held) == [a, b, c]
    held.put(d)  # a fourth unit: the oldest goes
    assert list(held) == [b, c, d]
    held.put(_held(512))  # larger than the whole budget: everything goes, itself too
    assert len(held) == 0
    states = HeldSequences(4, state_copies=5)  # each holds its final state and two checkpoints: 3 copies
    e, f = _held(10, checkpoints=2), _held(10, checkpoints=2)
    states.put(e)
    states.put(f)
    assert list(states) == [f]
    counted = HeldSequences(2)  # no budgets: the count alone
    for h in (a, b, c):
        counted.put(h)
    assert list(counted) == [b, c]


def test_plan_takes_held_conversations_states_off_the_device():
    from dataclasses import replace

    from ninfer_tui import profiles

    spec = preset_spec("qwen3.6-27b")
    base = profiles.load("256k-long").engine_config("x")
    tier = replace(base, host_kv_mib=40960, host_state_slots=8)
    before, after = plan_memory(spec, base, "cuda"), plan_memory(spec, tier, "cuda")
    per_slot = before.state_bytes_per_slot
    assert before.kv_pool == after.kv_pool  # held conversations' KV lives in the pool, or in host memory
    assert before.state_slots == (2 + MESSAGE_CHECKPOINTS) * (1 + 2) * per_slot
    assert after.state_slots == (2 + MESSAGE_CHECKPOINTS) * 1 * per_slot  # the running sequence's alone
    assert after.host_kv == 40960 * MIB and after.host_states == 8 * per_slot
    assert before.device_total - after.device_total == before.state_slots - after.state_slots
    assert after.device_total < 26 * GIB < before.device_total  # 256K on a 32 GB card with the tier


def test_held_conversation_in_the_host_tier_serves_the_next_turn():
    eng = Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", host_kv_mib=1, host_state_slots=4))
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    first = eng.complete(prompt, GREEDY)
    (held,) = list(eng.held)
    # the cache holds what was fed: the prompt and every output token but the last
    assert held.cache.length == len(held.tokens) == len(prompt) + len(first.token_ids) - 1
    follow = prompt + first.token_ids + [5, 6, 7]
    again = eng.complete(follow, GREEDY)
    assert again.cached_tokens >= len(prompt)
    fresh = Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", held_sequences=0))
    assert again.token_ids == fresh.complete(follow, GREEDY).token_ids


def test_a_conversation_over_the_kv_budget_is_not_held():
    eng = Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", host_kv_mib=1, max_context=4096))
    per_token = kv_bytes_per_token(eng.geometry, eng.config.kv_dtype, 4)
    n = MIB // per_token + 8  # one conversation longer than 1 MiB of KV
    prompt = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(2)).tolist()
    eng.complete(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert len(eng.held) == 0
    assert eng.complete(prompt + [1], GREEDY).cached_tokens == 0


def test_a_tier_larger_than_the_ram_is_refused_at_launch():
    import pytest

    from engine.errors import UserError

    with pytest.raises(UserError, match="host memory tier may take") as err:
        Engine(EngineConfig("synthetic:tiny", device="cpu", host_kv_mib=1 << 24))  # 16 TiB
    assert "host_kv_mib" in err.value.hint


def test_every_rank_of_a_cpu_engine_counts_against_the_ram(monkeypatch):
    """tensor_parallel processes on the CPU each hold a host tier and a shard in this host's RAM: a tier that one
    process could hold is refused for two, before any process starts."""
    import pytest

    from engine import engine as engine_module
    from engine.errors import UserError
    from engine.memory_plan import GIB

    monkeypatch.setattr(engine_module, "available_bytes", lambda device: 3 * GIB)
    config = {"device": "cpu", "host_kv_mib": 2 << 10, "model": "synthetic:tiny"}
    Engine(EngineConfig(**config)).close()
    with pytest.raises(UserError, match=r"host memory tier may take 4\.00 GiB of RAM \(2 processes\)"):
        Engine(EngineConfig(tensor_parallel=2, **config))
