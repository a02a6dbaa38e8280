"""Each adapter records the vLLM interface it was written against (``v0_XX/interface.py``);
the installed vLLM must match the record of the adapter it selects, so a patch release
that changes a signature the bridge relies on fails here, naming the change."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def vllm_modules(vllm_installed):
    from attnplug.plugins.vllm import _vllm as V
    from attnplug.plugins.vllm import fingerprint

    return V, fingerprint


def test_installed_vllm_matches_the_interface_its_adapter_records(vllm_modules):
    V, fp = vllm_modules
    diff = fp.differences(V.ADAPTER.INTERFACE, fp.fingerprint())
    assert not diff, f"vLLM {V.VLLM_VERSION} differs from {V.ADAPTER.__name__}/interface.py: {diff}"


def test_differences_name_what_was_added_and_removed(vllm_modules):
    _, fp = vllm_modules
    old = {"AttentionImpl.forward": ("self", "layer", "query"), "gone": ("x",)}
    new = {"AttentionImpl.forward": ("self", "layer", "query", "skip_scale")}
    assert fp.differences(old, new) == ["AttentionImpl.forward: +['skip_scale'] -[]", "gone: +[] -['x']"]
    assert fp.differences(new, new) == []
