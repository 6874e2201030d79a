"""The disk tier of held conversations (`engine/cache/disk_tier.py`): conversations that leave memory, and those
held when the engine closes, are written to files and serve a later engine on the same model and formats; a file
of another identity, truncated or corrupted is never loaded; the folder keeps within its cap."""
import logging
import threading
import time
from concurrent.futures import Future

import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.cache import disk_tier
from engine.cache.disk_tier import DiskTier
from engine.cache.kv_cache import HostKV
from engine.runtime.scheduler import Scheduler
from engine.runtime.sequence import Sequence

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _engine(folder, **settings) -> Engine:
    return Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", held_dir=str(folder),
                               **{"held_disk_mib": 64, **settings}))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _files(folder) -> list:
    return sorted(folder.glob("*.safetensors"))


def _cold(follow: list[int], **settings) -> list[int]:
    cold = Engine(EngineConfig("synthetic:tiny", device="cpu", dtype="float32", held_sequences=0, **settings))
    return cold.complete(follow, GREEDY).token_ids


def test_a_restarted_engine_continues_a_conversation_from_disk(tmp_path):
    first = _engine(tmp_path)
    prompt = _prompt(120, 1)
    out = first.complete(prompt, GREEDY).token_ids
    assert not _files(tmp_path)  # still held in memory
    first.close()  # the engine's end writes what it holds
    (path,) = _files(tmp_path)
    follow = prompt + out + [7, 8, 9]
    again = _engine(tmp_path).complete(follow, GREEDY)
    assert again.cached_tokens == len(prompt) + len(out) - 1  # the cache holds every output token but the last
    assert again.token_ids == _cold(follow)
    # a profile with other settings but the same model and formats finds it too
    other = _engine(tmp_path, max_context=4096, prefill_chunk=64, held_sequences=3)
    assert other.complete(follow, GREEDY).cached_tokens == len(prompt) + len(out) - 1


def test_an_evicted_conversation_is_written_and_served_from_disk(tmp_path):
    eng = _engine(tmp_path, held_sequences=1)
    a, b = _prompt(120, 2), _prompt(80, 3)
    out = eng.complete(a, GREEDY).token_ids
    eng.complete(b, GREEDY)  # a leaves the held set (one place): it goes to disk
    eng.held.disk.flush()
    (file_a,) = _files(tmp_path)
    follow = a + out + [1, 2]
    again = eng.complete(follow, GREEDY)
    assert again.cached_tokens == len(a) + len(out) - 1
    assert again.token_ids == _cold(follow)
    # b, loaded back from its file, evicts the continued conversation, whose file supersedes a's shorter one
    assert eng.complete(b + [5], GREEDY).cached_tokens == len(b)
    eng.held.disk.flush()
    assert len(_files(tmp_path)) == 2 and not file_a.exists()
    assert eng.held.disk.best(follow + again.token_ids + [3])[1] == len(follow) + len(again.token_ids) - 1


def test_a_file_of_another_format_is_left_alone_and_not_loaded(tmp_path):
    writer = _engine(tmp_path, kv_dtype="int8")
    prompt = _prompt(100, 4)
    out = writer.complete(prompt, GREEDY).token_ids
    writer.close()
    (path,) = _files(tmp_path)
    follow = prompt + out + [4]
    reader = _engine(tmp_path)  # fp32 KV: another format
    again = reader.complete(follow, GREEDY)
    assert again.cached_tokens == 0 and again.token_ids == _cold(follow)
    assert path.exists()  # the int8 engine's file stays for it
    assert _engine(tmp_path, kv_dtype="int8").complete(follow, GREEDY).cached_tokens == len(prompt) + len(out) - 1


def _written(folder) -> tuple[list[int], object]:
    eng = _engine(folder)
    prompt = _prompt(100, 5)
    out = eng.complete(prompt, GREEDY).token_ids
    eng.close()
    (path,) = _files(folder)
    return prompt + out + [6], path


def test_a_truncated_file_is_ignored_with_a_log_line(tmp_path, caplog):
    follow, path = _written(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with caplog.at_level(logging.WARNING, logger="ninfer.engine"):
        again = _engine(tmp_path).complete(follow, GREEDY)
    assert again.cached_tokens == 0 and again.token_ids == _cold(follow)
    assert "ignoring held conversation file" in caplog.text and not path.exists()


def test_a_corrupted_file_is_ignored_with_a_log_line(tmp_path, caplog):
    follow, path = _written(tmp_path)
    data = bytearray(path.read_bytes())
    data[-1000] ^= 0x40  # one bit of the tensors' bytes, the header intact: only the checksums see it
    path.write_bytes(bytes(data))
    eng = _engine(tmp_path)
    assert eng.held.disk.best(follow)[1] > 0  # indexed from its header
    with caplog.at_level(logging.WARNING, logger="ninfer.engine"):
        again = eng.complete(follow, GREEDY)
    assert again.cached_tokens == 0 and again.token_ids == _cold(follow)
    assert "fails its checksum" in caplog.text and not path.exists()


def test_the_folder_keeps_within_its_cap_dropping_the_least_recently_used(tmp_path):
    eng = _engine(tmp_path, held_sequences=1, held_disk_mib=1)
    prompts = [_prompt(600, 10 + i) for i in range(4)]  # each file ~0.35 MiB: two fit in 1 MiB, not three
    for p in prompts:
        eng.complete(p, GREEDY)  # the one before leaves the held set: it goes to disk
    eng.held.disk.flush()
    files = _files(tmp_path)
    assert sum(f.stat().st_size for f in files) <= 1 << 20
    served = [eng.held.disk.best(p + [1])[1] > 0 for p in prompts[:3]]
    assert served == [False, True, True]  # the oldest file went
    # a conversation that alone exceeds the cap is not written
    eng.complete(_prompt(3000, 20), GREEDY)
    eng.close()
    assert eng.held.disk.best(_prompt(3000, 20) + [1])[1] == 0
    # ...nor did it push out the files that fit (a written one over the cap would empty the folder to make room)
    assert eng.held.disk.best(prompts[3] + [1])[1] > 0


def test_a_file_is_read_off_the_step_loop_while_running_requests_go_on(tmp_path, monkeypatch):
    writer = _engine(tmp_path)
    prompt = _prompt(120, 30)
    out = writer.complete(prompt, GREEDY).token_ids
    writer.close()
    eng = _engine(tmp_path, max_concurrency=2)
    seen, reading, release = {}, threading.Event(), threading.Event()
    load = DiskTier.load

    def slow_load(tier, entry):
        free = eng._held_lock.acquire(timeout=5)  # times out where the loading thread holds it (not re-entrant)
        if free:
            eng._held_lock.release()
        seen.update(thread=threading.current_thread().name, locked=not free)
        reading.set()
        release.wait(10)
        return load(tier, entry)

    monkeypatch.setattr(DiskTier, "load", slow_load)
    busy = eng.submit(_prompt(40, 31), SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True))
    next(iter(busy))  # it runs
    follow = prompt + out + [3]
    waiting = eng.submit(follow, GREEDY)
    assert reading.wait(10)
    steps = eng.core.steps
    for _ in range(500):  # the running request goes on while the file is read
        if eng.core.steps >= steps + 5:
            break
        time.sleep(0.01)
    assert eng.core.steps >= steps + 5 and not release.is_set()
    assert seen["thread"].startswith("ninfer-disk-read") and not seen["locked"]
    release.set()
    again = list(waiting)[-1]
    assert again.cached_tokens == len(prompt) + len(out) - 1 and again.token_ids == _cold(follow)
    busy.cancel()
    eng.close()


class _Copies(HostKV):
    """HostKV counting the conversations copied to host memory."""

    made = 0

    def __init__(self, *args) -> None:
        type(self).made += 1
        super().__init__(*args)


def test_a_conversation_over_the_cap_is_not_copied_to_host_memory(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(disk_tier, "HostKV", _Copies)
    monkeypatch.setattr(_Copies, "made", 0)
    eng = _engine(tmp_path, held_sequences=1, held_disk_mib=1)
    eng.complete(_prompt(3000, 40), GREEDY)
    with caplog.at_level(logging.INFO, logger="ninfer.engine"):
        eng.complete(_prompt(50, 41), GREEDY)  # the long one leaves the held set: over the cap, not written
    assert "exceeds the disk tier's cap" in caplog.text and _Copies.made == 0
    eng.close()
    assert len(_files(tmp_path)) == _Copies.made == 1  # the short one, held at the close, is copied and written


def test_evictions_past_the_pending_writes_are_dropped_with_a_log_line(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(disk_tier, "HostKV", _Copies)
    monkeypatch.setattr(_Copies, "made", 0)
    writing, release = threading.Event(), threading.Event()
    write = DiskTier._write

    def slow_write(tier, item):
        writing.set()
        release.wait(10)
        write(tier, item)

    monkeypatch.setattr(DiskTier, "_write", slow_write)
    eng = _engine(tmp_path, held_sequences=1)
    queued = disk_tier.PENDING_WRITES
    prompts = [_prompt(60, 50 + i) for i in range(queued + 4)]  # evictions: 1 written, `queued` wait, 2 dropped
    eng.complete(prompts[0], GREEDY)
    eng.complete(prompts[1], GREEDY)  # the first is evicted: the writer takes it and waits
    assert writing.wait(10)
    with caplog.at_level(logging.INFO, logger="ninfer.engine"):
        for p in prompts[2:]:  # each evicts the one before: PENDING_WRITES queue, the rest are dropped
            eng.complete(p, GREEDY)
    assert caplog.text.count("wait for the disk already") == 2
    assert _Copies.made == 1 + queued  # a dropped one was never copied
    assert eng.complete(prompts[-1] + [1], GREEDY).cached_tokens == len(prompts[-1])  # memory serves as ever
    release.set()
    eng.held.disk.flush()
    assert len(_files(tmp_path)) == 1 + queued
    eng.close()


def test_close_writes_what_is_queued_and_stops_the_disk_tiers_threads(tmp_path):
    eng = _engine(tmp_path, held_sequences=1)
    a, b = _prompt(60, 60), _prompt(60, 61)
    eng.complete(a, GREEDY)
    eng.complete(b, GREEDY)  # a leaves the held set: the writer starts
    disk = eng.held.disk
    disk.flush()
    assert eng.complete(a + [7], GREEDY).cached_tokens > 0  # a's file read back: the reader starts
    writer, readers = disk._writer, list(disk._reader._threads)
    assert writer.is_alive() and readers
    eng.close()
    assert not writer.is_alive() and not any(t.is_alive() for t in readers)
    assert len(_files(tmp_path)) >= 2  # a's, written before, and the conversations held at the close
    assert disk.best(a + [1])[1] > 0 and disk.best(b + [1])[1] > 0


def test_a_prompt_no_file_serves_is_not_queued_behind_the_reader(tmp_path):
    eng = _engine(tmp_path, held_sequences=1)
    a = _prompt(60, 60)
    eng.complete(a, GREEDY)
    eng.complete(_prompt(60, 61), GREEDY)  # a is written
    eng.held.disk.flush()
    assert eng.held.disk.read(a + [7], lambda: 0) is not None
    assert eng.held.disk.read(_prompt(60, 62), lambda: 0) is None  # answered at once, no read queued
    eng.close()


def test_a_read_scans_the_index_once(tmp_path, monkeypatch):
    eng = _engine(tmp_path, held_sequences=1)
    a = _prompt(60, 63)
    eng.complete(a, GREEDY)
    eng.complete(_prompt(60, 64), GREEDY)  # a is written
    eng.held.disk.flush()
    compared = []
    reusable = disk_tier.reusable
    monkeypatch.setattr(disk_tier, "reusable", lambda *args: compared.append(args[0]) or reusable(*args))
    assert eng.held.disk.read(a + [7], lambda: 0).result() is not None
    assert len(compared) == len(eng.held.disk._snapshot()) == 1  # the submit's scan found the file the read loads
    eng.close()


def test_a_request_whose_file_is_still_read_keeps_its_place_and_lets_those_behind_start():
    sched = Scheduler(max_running=3, max_pending=8, step_tokens=64)
    reading, a, b, c = (Sequence([1, 2, 3], GREEDY) for _ in range(4))
    reading.loading = Future()
    for seq in (reading, a, b, c):
        sched.add(seq)
    room = {reading: True, a: True, b: False, c: True}

    def start(seq: Sequence) -> bool:  # as the engine's: not while its file is read, then where there is room
        return (seq.loading is None or seq.loading.done()) and room[seq]

    assert sched.admit(start) == [a]  # b finds no room: c, behind it, waits as ever
    assert list(sched.waiting) == [reading, b, c]
    reading.loading.set_result(None)
    room[b] = True
    assert sched.admit(start) == [reading, b]  # read: it starts in its place, first; then the places are full
    assert list(sched.waiting) == [c] and sched.running == [a, reading, b]
