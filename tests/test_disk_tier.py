"""The disk tier of held conversations (`engine/cache/disk_tier.py`): conversations that leave memory, and those
held when the engine closes, are written to files and serve a later engine on the same model and formats; a file
of another identity, truncated or corrupted is never loaded; the folder keeps within its cap."""
import logging

import torch

from engine import Engine, EngineConfig, SamplingParams

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
