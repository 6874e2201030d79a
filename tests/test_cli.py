"""The CLI as a user runs it: JSON schema, determinism, and one-line errors with exit code 2."""
import json

import pytest

from .conftest import run_cli


def test_help_lists_implemented_commands():
    r = run_cli("--help")
    assert r.returncode == 0
    for cmd in ("generate", "chat", "serve", "ps", "stop", "profiles", "pull", "models"):
        assert cmd in r.stdout


def test_version():
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("ninfer ")


def test_generate_json_schema_and_greedy_determinism():
    args = ("generate", "--prompt-ids", "1,504,3458,282,1104", "--temperature", "0", "-n", "12", "--json")
    first, second = run_cli(*args), run_cli(*args)
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert set(out) == {"model", "prompt_tokens", "completion_tokens", "token_ids", "text", "finish_reason",
                        "timings"}
    assert set(out["timings"]) == {"prefill_s", "decode_s", "prefill_tok_s", "decode_tok_s"}
    assert out["model"] == "smollm2-135m"  # the name the user gave, not the cache path
    assert out["prompt_tokens"] == 5 and out["completion_tokens"] == len(out["token_ids"]) > 0
    assert out["finish_reason"] in ("stop", "length")
    assert json.loads(second.stdout)["token_ids"] == out["token_ids"]


def test_generate_chat_uses_template():
    r = run_cli("generate", "--chat", "Say hello.", "--temperature", "0", "-n", "8", "--json")
    out = json.loads(r.stdout)
    assert out["prompt_tokens"] > 10  # the template adds the system and role markers


def test_pipe_chat_prints_only_the_reply():
    r = run_cli("chat", "-n", "16", "--temperature", "0", stdin="What is 2 plus 2?")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "<|im_start|>" not in r.stdout


@pytest.mark.parametrize("args,needle", [
    (("generate", "--prompt", "hi", "-m", "/no/such/model.gguf"), "neither a known model name"),
    (("generate", "--prompt", "hi", "-m", "pyproject.toml"), "neither a GGUF file"),
    (("generate", "--prompt", ""), "prompt is empty"),
    (("generate", "--prompt", "hi", "-n", "0"), "max_tokens must be >= 1"),
    (("generate", "--prompt", "hi", "-n", "-5"), "max_tokens must be >= 1"),
    (("generate", "--prompt-ids", "1,x"), "comma-separated integers"),
    (("generate", "--prompt-ids", "99999999"), "outside the vocabulary"),
    (("generate", "--prompt", "hi", "-n", "9000", "--max-context", "8192"), "exceeds the context window"),
    (("pull", "no-such-model"), "unknown model"),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_unsupported_gguf_architecture(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    import numpy as np

    w.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = run_cli("generate", "--prompt-ids", "1", "-m", str(path))
    assert r.returncode == 2 and "unsupported GGUF architecture 'mamba'" in r.stderr


def test_unsupported_quant_type(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from engine.errors import ModelFormatError
    from engine.loaders.gguf import load_gguf

    path = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, val in (("block_count", 1), ("embedding_length", 32), ("feed_forward_length", 64),
                     ("attention.head_count", 2)):
        w.add_uint32(f"llama.{key}", val)
    w.add_tensor("token_embd.weight", np.zeros((4, 32 * 4), dtype=np.uint8), raw_shape=(4, 32 * 4),
                 raw_dtype=gguf.GGMLQuantizationType.I8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    import torch

    with pytest.raises(ModelFormatError, match="quant type I8"):
        load_gguf(path, torch.float32, torch.device("cpu"))
