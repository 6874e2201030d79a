"""`ninfer convert`: the converted folder loads to exactly the model the quantize-at-load path makes (logits equal
bit for bit), and refuses what it must not read: another format version, a changed or cut shard, formats or a
dtype other than its own. A shard verified once is hashed again only when its file or the manifest changed; the
staged copies to a GPU put every byte in place."""
import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine import Engine, EngineConfig, ModelFormatError, SamplingParams, UserError
from engine.config import WeightFormats
from engine.convert import convert
from engine.loaders import load_model, model_kind
from engine.loaders.converted import load_converted
from engine.loaders.manifest import MANIFEST, read_manifest
from engine.quant.gguf_blocks import GGUFWeight
from engine.quant.qweight import load_transform
from ninfer_tui.cli import main

from .conftest import run_cli, write_tiny

pytest.importorskip("transformers")  # the tiny folder is written through it

MIX = WeightFormats(attn="q5", gdn="q4", mlp="q4", embed="q8", lm_head="q8")
IDS = list(range(30, 70))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.fixture(scope="module")
def mixed(tiny, tmp_path_factory):
    """The tiny folder converted with q5/q4/q8 for fp32 compute, in shards of ~64 KB (several, as a real model's)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("engine.convert.SHARD_BYTES", 64_000)
        return convert(str(tiny), tmp_path_factory.mktemp("conv") / "mix", MIX, torch.float32).folder


def unhashed(fn, *args):
    """fn(*args) with the loader's SHA-256 checks patched out (as bench_load.py times the load without them)."""
    import engine.loaders.converted as converted

    check = converted._verify
    converted._verify = lambda *a: None
    try:
        return fn(*args)
    finally:
        converted._verify = check


def logits(engine: Engine) -> torch.Tensor:
    cache = engine.model.new_cache(len(IDS))
    with torch.inference_mode():
        return engine.model.forward(torch.tensor(IDS), cache, all_logits=True)


@pytest.mark.parametrize("formats", [WeightFormats.uniform("q8"), MIX], ids=["q8", "q5-q4-q8"])
def test_converted_logits_equal_quantize_at_load(tiny, tmp_path, formats):
    out = convert(str(tiny), tmp_path / "out", formats, torch.float32).folder
    assert model_kind(str(out)) == "converted"
    ours = Engine(EngineConfig(model=str(out), device="cpu", dtype="float32"))
    at_load = Engine(EngineConfig(model=str(tiny), device="cpu", dtype="float32", weights=formats))
    assert ours.config.weights == formats  # the folder's formats, taken by a profile that leaves them "auto"
    assert ours.plan.weights == at_load.plan.weights
    assert torch.equal(logits(ours), logits(at_load))


def test_profiles_fit_plans_a_converted_folders_own_formats(mixed):
    """`profiles fit` counts the bytes the engine loads: the folder's formats, not the profile's "auto" (bf16)."""
    from ninfer_tui import profiles
    from ninfer_tui.profiles_cmd import fit_report

    profile = profiles.Profile("converted", model=str(mixed), device="cpu", dtype="float32")
    engine = Engine(EngineConfig(model=str(mixed), device="cpu", dtype="float32"))
    assert fit_report(profile, 64)["plan"]["weights"] == engine.plan.weights


def test_manifest_records_the_source_and_every_shard(tiny, mixed):
    from engine.convert import sha256_file

    m = json.loads((mixed / MANIFEST).read_text())
    assert (m["format"], m["version"], m["dtype"], m["weights"]) == ("ninfer-model", 1, "float32", MIX.as_dict())
    assert {f["name"]: f["sha256"] for f in m["source"]["files"]}["model.safetensors"] == \
        sha256_file(tiny / "model.safetensors")
    assert [s["sha256"] for s in m["shards"]] == [sha256_file(mixed / s["name"]) for s in m["shards"]]
    kinds = {t["format"] for t in m["tensors"].values()}
    assert kinds == {"plain", "q8", "q5", "q4"} and len(m["shards"]) > 2
    assert (mixed / "tokenizer.json").is_file() and (mixed / "config.json").is_file()


@pytest.mark.parametrize("version", [0, 2])
def test_another_format_version_is_refused_with_the_command_that_converts_again(mixed, tmp_path, version, capsys):
    folder = shutil.copytree(mixed, tmp_path / "old")
    m = json.loads((folder / MANIFEST).read_text())
    m["version"] = version
    (folder / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ModelFormatError, match=f"format version {version}; this ninfer reads version 1") as err:
        load_model(str(folder), torch.float32, torch.device("cpu"))
    assert f"ninfer convert {m['source']['path']} {folder} --force" in err.value.hint
    assert main(["generate", "--model", str(folder), "--prompt-ids", "1,2", "-n", "1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-2].startswith("error:") and lines[-1].startswith("hint: convert the model again")


def test_a_changed_shard_is_refused_and_a_cut_one_by_its_size(mixed, tmp_path):
    folder = shutil.copytree(mixed, tmp_path / "tampered")
    shard = next(folder.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # the same size: only the hash tells
    shard.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match="does not match its SHA-256"):
        load_model(str(folder), torch.float32, torch.device("cpu"))
    shard.write_bytes(bytes(data[:-8]))
    with pytest.raises(ModelFormatError, match=f"shard {shard.name} has {len(data) - 8} bytes"):
        unhashed(load_converted, folder, torch.float32, torch.device("cpu"))  # checked without hashing too


@pytest.fixture
def hashed(monkeypatch) -> list[str]:
    """The SHA-256 of each shard the loads that follow hash, in the order hashed."""
    import engine.loaders.converted as converted

    seen, real = [], converted._sha256

    def counted(buf) -> str:
        digest = real(buf)  # workers hash at once: each returns its own
        seen.append(digest)
        return digest

    monkeypatch.setattr(converted, "_sha256", counted)
    return seen


@pytest.fixture
def settled(monkeypatch):
    """Shards written a moment ago count as settled (they are, here, until a test changes one)."""
    monkeypatch.setattr("engine.loaders.verified_shards.SETTLED_NS", 0)


def test_a_shard_verified_once_is_hashed_again_only_when_its_file_changed(mixed, tmp_path, hashed, settled):
    folder = shutil.copytree(mixed, tmp_path / "m")
    record = tmp_path / "state" / "verified-shards.json"
    shards = read_manifest(folder).shards
    every = sorted(s.sha256 for s in shards)
    Engine(EngineConfig(model=str(folder), device="cpu", dtype="float32", verified_shards=str(record)))
    assert sorted(hashed) == every  # the first load hashes every shard, and records them

    def load():
        return load_converted(folder, torch.float32, torch.device("cpu"), verified_shards=record)

    hashed.clear()
    load()
    unhashed(load_converted, folder, torch.float32, torch.device("cpu"))
    assert hashed == []
    load_converted(folder, torch.float32, torch.device("cpu"))  # no record: every shard
    assert sorted(hashed) == every
    hashed.clear()

    shard = folder / shards[0].name
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # touched: hashed once more, then known again
    load()
    load()
    assert hashed == [shards[0].sha256]
    hashed.clear()

    time.sleep(0.02)  # a ctime ticks coarsely (a clock tick): the change lands in a later tick than the one recorded
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))  # the same size and inode, the mtime set back: only the ctime tells
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (shard.stat().st_size, shard.stat().st_mtime_ns, shard.stat().st_ino) == \
        (st.st_size, st.st_mtime_ns, st.st_ino)
    for _ in range(2):  # refused, and not recorded as verified
        with pytest.raises(ModelFormatError, match=f"shard {shards[0].name} does not match its SHA-256"):
            load()
    assert len(hashed) == 2 and shards[0].sha256 not in hashed


def test_a_record_of_another_manifest_folder_or_file_is_not_trusted(mixed, tmp_path, hashed, settled):
    folder = shutil.copytree(mixed, tmp_path / "m")
    record = tmp_path / "verified-shards.json"
    every = sorted(s.sha256 for s in read_manifest(folder).shards)

    def hashes_all() -> bool:
        hashed.clear()
        load_converted(folder, torch.float32, torch.device("cpu"), verified_shards=record)
        return sorted(hashed) == every

    assert hashes_all() and not hashes_all()
    m = json.loads((folder / MANIFEST).read_text())
    m["written_by"] += " (edited)"  # the same shards and hashes under another manifest
    (folder / MANIFEST).write_text(json.dumps(m))
    assert hashes_all() and not hashes_all()
    folder = shutil.copytree(folder, tmp_path / "copy")  # the same files, times kept, in another folder
    assert hashes_all() and not hashes_all()
    assert {Path(k).parent.name for k in json.loads(record.read_text())["shards"]} == {"m", "copy"}  # both kept
    record.write_text("not json")  # a damaged record is an empty one, written again
    assert hashes_all() and not hashes_all()


def test_a_shard_changed_just_before_its_hash_is_not_recorded(mixed, tmp_path, hashed):
    """A file's timestamps tick coarsely, so a write right after a shard's state was taken could leave it unchanged:
    a shard written less than a second before the load is hashed again next time."""
    folder = shutil.copytree(mixed, tmp_path / "fresh")
    record = tmp_path / "verified-shards.json"
    for _ in range(2):
        load_converted(folder, torch.float32, torch.device("cpu"), verified_shards=record)
    assert len(hashed) == 2 * len(read_manifest(folder).shards) and not record.exists()


def test_staged_copies_put_every_byte_in_place_and_reuse_a_buffer_after_its_copies_ran():
    """Tensors smaller and larger than a buffer, empty, 0-d, not contiguous, of several dtypes, through two 1 KiB
    buffers to a queue that runs its copies only when waited on (as a stream runs them while the host goes on): a
    piece dropped, put in the wrong place, or staged in a buffer whose earlier copies have not run changes the
    result."""
    from engine.loaders.staging import StagedCopies

    class Deferred:
        def __init__(self) -> None:
            self.queued, self.ran, self.behind = [], 0, []

        def copy(self, dst, src):
            self.queued.append((dst, src))
            n = len(self.queued)
            return SimpleNamespace(synchronize=lambda: self.run(n))

        def run(self, n: int) -> None:
            for dst, src in self.queued[self.ran:n]:
                dst.copy_(src)
            self.ran = max(self.ran, n)
            self.behind.append(len(self.queued) - self.ran)

    g = torch.Generator().manual_seed(0)
    shapes = [(0,), (1,), (7, 3), (250,), (16, 64), (1025,), (4567,), (), (32, 33), (513,), (3, 700)]
    dtypes = [torch.uint8, torch.float32, torch.bfloat16, torch.int8, torch.float16, torch.float64]
    tensors = []
    for i, shape in enumerate(shapes):
        dtype = dtypes[i % len(dtypes)]
        n = torch.Size(shape).numel() * dtype.itemsize
        tensors.append(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape))
    tensors.append(tensors[8].t())  # not contiguous
    queue = Deferred()
    copies = StagedCopies(torch.device("cpu"), 1 << 20, queue, size=1024)
    out = [copies.to_device(t) for t in tensors]
    queue.run(len(queue.queued))
    for t, o in zip(tensors, out, strict=True):
        assert (o.shape, o.dtype) == (t.shape, t.dtype)
        assert torch.equal(o.reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8))
    # buffers were reused, and each time the other buffer's copies were still queued: the host filled one while
    # the copies from the other had not run
    assert len(queue.behind) > 10 and all(n > 0 for n in queue.behind[:-1])


def test_several_shards_load_to_the_one_shard_model(tiny, mixed, tmp_path):
    one = convert(str(tiny), tmp_path / "one", MIX, torch.float32).folder
    assert len(read_manifest(one).shards) == 1
    assert torch.equal(logits(Engine(EngineConfig(model=str(mixed), device="cpu", dtype="float32"))),
                       logits(Engine(EngineConfig(model=str(one), device="cpu", dtype="float32"))))


def test_other_formats_or_dtype_are_refused_not_requantized(mixed):
    with pytest.raises(UserError, match="holds weights converted to attn q5") as err:
        Engine(EngineConfig(model=str(mixed), device="cpu", dtype="float32", weights=WeightFormats.uniform("q8")))
    assert "--weights auto" in err.value.hint and "--weights q8 --force" in err.value.hint
    with pytest.raises(UserError, match="converted for float32 compute, and this engine computes in bfloat16") as err:
        load_model(str(mixed), torch.bfloat16, torch.device("cpu"))
    assert "--set dtype=float32" in err.value.hint


def test_out_is_never_a_folder_it_must_not_replace(tiny, mixed, tmp_path):
    with pytest.raises(UserError, match="is a converted model folder already"):
        convert(str(tiny), mixed, MIX, torch.float32)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="is not a converted model folder"):
        convert(str(tiny), other, MIX, torch.float32, force=True)
    with pytest.raises(UserError, match="holds the source"):
        convert(str(tiny), tiny.parent, MIX, torch.float32, force=True)
    broken = shutil.copytree(tiny, tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelFormatError):
        convert(str(broken), tmp_path / "never", MIX, torch.float32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "other"]  # no partial folder left
    again = convert(str(tiny), mixed, MIX, torch.float32, force=True).folder
    assert sorted(p.name for p in again.parent.iterdir()) == ["mix"]


def test_cli_convert_then_generate(tiny, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["convert", str(tiny), str(out), "--weights", "q8"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    r = run_cli("generate", "--model", str(out), "--prompt-ids", ",".join(map(str, IDS[:8])), "--temperature", "0",
                "--repeat-penalty", "1", "-n", "6", "--json")
    assert r.returncode == 0, r.stderr
    at_load = Engine(EngineConfig(model=str(tiny), device="cpu", dtype="float32",
                                  weights=WeightFormats.uniform("q8")))
    want = at_load.complete(IDS[:8], SamplingParams(max_tokens=6, temperature=0)).token_ids
    assert json.loads(r.stdout)["token_ids"] == want


def test_gguf_converts_to_the_model_its_loader_makes(default_model_path, tmp_path):
    """The GGUF's blocks are kept (the CPU kernels read them; elsewhere they are dequantized at load, as the file's
    are), its vocabulary and template come from its metadata."""
    out = convert(default_model_path, tmp_path / "smollm", WeightFormats(), torch.float32).folder
    ours = Engine(EngineConfig(model=str(out), device="cpu", dtype="float32"))
    at_load = Engine(EngineConfig(model=default_model_path, device="cpu", dtype="float32"))
    embed = "embed_tokens.weight"
    assert isinstance(load_model(str(out), torch.float32, torch.device("cpu")).weights[embed], GGUFWeight) == \
        isinstance(load_model(default_model_path, torch.float32, torch.device("cpu")).weights[embed], GGUFWeight)
    assert torch.equal(logits(ours), logits(at_load))
    chat = [{"role": "user", "content": "Hello"}]
    assert ours.encode_chat(chat) == at_load.encode_chat(chat)


@pytest.mark.parametrize("formats", [WeightFormats(), MIX], ids=["gguf-blocks", "q5-q4-q8"])
def test_a_qwen35_gguf_converts_to_the_model_its_loader_makes(tiny, tmp_path, formats):
    from .test_gguf_qwen35 import write_qwen35_gguf

    path = write_qwen35_gguf(tiny, tmp_path / "tiny.gguf")  # Q8_0, Q4_K, ... beside F32, value heads reordered
    out = convert(str(path), tmp_path / "out", formats, torch.float32).folder
    ours = Engine(EngineConfig(model=str(out), device="cpu", dtype="float32"))
    at_load = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", weights=formats))
    chat = [{"role": "user", "content": "Hello"}]
    assert ours.geometry == at_load.geometry and ours.encode_chat(chat) == at_load.encode_chat(chat)
    assert torch.equal(logits(ours), logits(at_load))


def test_the_vision_tower_is_converted_with_the_model(vl_folder, tmp_path):
    q8 = WeightFormats.uniform("q8")
    out = convert(str(vl_folder), tmp_path / "vl", q8, torch.float32).folder
    ours = load_model(str(out), torch.float32, torch.device("cpu"))
    at_load = load_model(str(vl_folder), torch.float32, torch.device("cpu"), load_transform(q8))
    assert ours.vision == at_load.vision and ours.geometry == at_load.geometry
    tower = [k for k in at_load.weights if k.startswith("visual.")]
    assert tower and all(torch.equal(ours.weights[k], at_load.weights[k]) for k in tower)
    assert not any(k.startswith("visual.") for k in load_model(str(out), torch.float32, torch.device("cpu"),
                                                               vision=False).weights)


def test_a_conversion_that_cannot_write_is_one_line_and_an_abandoned_one_is_removed(tiny, tmp_path, monkeypatch):
    """A disk error while writing is a UserError naming OUT and the file; a folder a killed conversion left (its
    process gone) goes at the next conversion to that OUT."""
    import engine.convert as conv

    left = tmp_path / ".out.converting-999999999"
    left.mkdir()
    (left / "model-00001-of-00001.safetensors").write_bytes(b"partial")

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "x.safetensors"))

    monkeypatch.setattr(conv, "save_file", full)
    with pytest.raises(UserError, match=r"to .*out failed: No space left on device \(.*x\.safetensors\)") as err:
        convert(str(tiny), tmp_path / "out", WeightFormats.uniform("q8"), torch.float32)
    assert "free disk space" in err.value.hint
    assert not left.exists() and sorted(p.name for p in tmp_path.iterdir()) == []
