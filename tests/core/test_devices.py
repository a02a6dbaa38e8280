"""``"cuda"`` and ``"cuda:0"``: torch compares them unequal, attnplug treats them as one device.

No GPU is needed: CUDA's presence is monkeypatched, and the buffer checks see a stand-in
whose ``.device`` is what a real CUDA tensor reports (always indexed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from attnplug.backends.common.buffer_checks import check_block_table, check_slot_mapping
from attnplug.core.devices import resolve_device, same_device
from attnplug.core.errors import MetadataError


@pytest.fixture
def fake_cuda(monkeypatch):
    """A process that sees CUDA with device 3 current (no CUDA call reaches the driver)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)


def test_the_premise_torch_compares_unindexed_unequal():
    assert torch.device("cuda") != torch.device("cuda:0")


def test_resolve_fills_the_current_index(fake_cuda):
    assert resolve_device("cuda") == torch.device("cuda:3")
    assert resolve_device(torch.device("cuda")) == torch.device("cuda:3")
    assert resolve_device("cuda:1") == torch.device("cuda:1"), "an explicit index is kept"
    assert same_device("cuda", "cuda:3") and same_device(torch.device("cuda:3"), "cuda")
    assert not same_device("cuda", "cuda:0") and not same_device("cuda", "cpu")


def test_resolve_leaves_cpu_meta_and_absent_accelerators_alone(monkeypatch):
    def boom():
        raise AssertionError("current_device must not be called without CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", boom)
    assert resolve_device("cpu") == torch.device("cpu") and resolve_device("meta") == torch.device("meta")
    assert resolve_device("cuda") == torch.device("cuda"), "nothing to resolve against: returned as given"
    with pytest.raises(RuntimeError):
        resolve_device("not-a-device")


def _fake_tensor(dtype, shape, device):
    return SimpleNamespace(dtype=dtype, shape=shape, device=torch.device(device), dim=lambda: len(shape))


def test_buffer_checks_accept_an_indexed_tensor_for_an_unindexed_device(fake_cuda):
    slots = _fake_tensor(torch.int64, (5,), "cuda:3")
    check_slot_mapping(slots, 5, 8, torch.device("cuda"))
    table = _fake_tensor(torch.int32, (2, 4), "cuda:3")
    check_block_table(table, 2, 30, block_size=16, max_num_blocks_per_req=4, max_model_len=64,
                      device=torch.device("cuda"), backend="triton")
    with pytest.raises(MetadataError, match="on cuda:0"):
        check_slot_mapping(_fake_tensor(torch.int64, (5,), "cuda:0"), 5, 8, torch.device("cuda"))


def test_builders_keep_the_resolved_device(fake_cuda):
    from attnplug.core.contracts import AttentionMetadataBuilder, BuilderConfig

    class Minimal(AttentionMetadataBuilder):
        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            return None

    builder = Minimal(None, ["layer"], BuilderConfig(max_num_reqs=1, max_num_batched_tokens=1, max_model_len=1), "cuda")
    assert builder.device == torch.device("cuda:3")
