"""``python -m attnplug.runner.commands.bench.builders_vllm``: attnplug's triton and flash_attn
builders and vLLM's own (``TritonAttentionMetadataBuilder``, ``FlashAttentionMetadataBuilder``:
both import and build on a CPU-only vLLM 0.33) lower the same steps in one process, every
contender timed; ``--before`` loads a commit's builder module beside the current one."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # ~12 s: two vLLM configs and workloads


def test_both_backends_are_timed_beside_vllms_builders(vllm_installed, tmp_path, monkeypatch):
    if not vllm_installed.startswith("0.33."):
        pytest.skip(f"the side-by-side is written against vLLM 0.33's builders (installed: {vllm_installed})")
    import tempfile

    from attnplug.runner.commands.bench.builders_vllm import run

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where vLLM's config directory goes

    tri = run("triton", 4, 2, before="HEAD")
    assert {"ours build", "ours update_block_table", "before build", "vllm build"} <= tri.keys()
    assert "vllm update_block_table" not in tri, "vLLM's triton builder builds every group"
    fa = run("flash_attn", 4, 2)
    assert {"ours build", "ours update_block_table", "vllm build", "vllm update_block_table"} <= fa.keys()
    for r in (tri, fa):
        assert all(v > 0 for v in r.values())
        assert r["ours / vllm build"] == pytest.approx(r["ours build"] / r["vllm build"])
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith("attnplug-builders-vllm-")]
    assert left == [], "the model config directory written for vLLM is left behind"
