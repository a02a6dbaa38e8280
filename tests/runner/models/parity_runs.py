"""What the HF-parity tests share: the engine options a parity run is tried under, the checks
every such run must pass, and the tiny random Qwen2-VL config (also refused by the torchrun
parity test). Imported by path, like ``gguf_files``: ``sys.path.insert(0, <this folder>)``."""

from __future__ import annotations

# run_parity's keyword arguments per named engine option
PARITY_OPTIONS = {
    "chunked": {},
    "preempt": {"force_preemption": True},
    "prefix": {"prefix_caching": True, "system_prompt_len": 12},
    "ngram": {"speculative": "ngram:k=3"},
    "async": {"async_scheduling": True},
}

QWEN2_VL = {
    "model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"],
    "text_config": {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "initializer_range": 0.1,
                    "bos_token_id": 0, "eos_token_id": 1,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}},
    "vision_config": {"depth": 2, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "spatial_merge_size": 2,
                      "patch_size": 2, "temporal_patch_size": 2, "in_channels": 3, "mlp_ratio": 2,
                      "initializer_range": 0.1},
    "image_token_id": 90, "video_token_id": 91, "vision_start_token_id": 92, "vision_end_token_id": 93,
}


def options(*names: str) -> dict[str, dict]:
    """The entries of :data:`PARITY_OPTIONS` named, in that order."""
    return {name: PARITY_OPTIONS[name] for name in names}


def assert_parity(res, option: str, num_requests: int, *, max_abs_dlogit: float | None = None,
                  check_dlogit: bool = True) -> None:
    """``res`` (a ParityResult) is a pass: every one of ``num_requests`` requests gave HF's
    greedy tokens, the largest logit difference is within ``max_abs_dlogit`` (the result's own
    tolerance when None; not checked when ``check_dlogit`` is False), and the named option did
    what it exists for (a preemption, a prefix-cache hit, a proposed draft)."""
    assert res.ok, res.line()
    assert res.num_identical == res.num_requests == num_requests, res.line()
    if check_dlogit:
        bound = res.tolerance if max_abs_dlogit is None else max_abs_dlogit
        assert res.max_abs_dlogit <= bound, res.line()
    if option == "preempt":
        assert res.preemptions > 0, "forced preemption did not preempt anything"
    if option == "prefix":
        assert res.prefix_cache_hits > 0, f"no prefix-cache hit: the shared prefixes were not reused; {res.line()}"
    if option == "ngram":
        assert res.spec["proposed"] > 0, "no draft was proposed"
