"""State specs declare their tensors; allocation, slot copies, block policy and prefix-hit rule
work from the declaration, so Mamba2, GDN and a third-party state kind share one mechanism."""

from __future__ import annotations

import pytest
import torch

from attnplug.cache_groups.block_pool import BlockPool, MambaStateManager, make_block_manager
from attnplug.cache_groups.grouping import KVCacheConfig, group_layers_by_spec
from attnplug.cache_groups.kinds import GroupKind
from attnplug.cache_groups.specs import MambaSpec, StateSpec, StateTensorSpec
from attnplug.core.errors import KVCacheSpecError
from attnplug.core.gdn import GDNLayerConfig
from attnplug.core.mamba import MambaLayerConfig, MambaStateCache
from attnplug.core.state import StateBackend
from attnplug.runner.execute.kv_caches import allocate_kv_caches
from attnplug.runner.execute.state_copies import copy_state_slots

# a third-party kind with three tensors (e.g. a token-shift state, a wkv state and a counter)
RWKV = StateSpec(block_size=64, state_kind="rwkv_like", tensors=(
    StateTensorSpec("shift", (8,), torch.float16), StateTensorSpec("wkv", (2, 4, 4), torch.float32),
    StateTensorSpec("count", (1,), torch.int64)))


class RwkvLikeBackend(StateBackend):
    state_kind = "rwkv_like"

    @classmethod
    def get_name(cls):
        return "rwkv_like"


def test_mamba_spec_declares_conv_then_ssm_state_and_keeps_its_page_size():
    spec = MambaSpec(block_size=64, conv_state_shape=(10, 3), ssm_state_shape=(2, 3, 4), dtype=torch.float16,
                     ssm_dtype=torch.float32, chunk_size=8)
    assert [(t.name, t.shape, t.dtype) for t in spec.tensors] == [
        ("conv_state", (10, 3), torch.float16), ("ssm_state", (2, 3, 4), torch.float32)]
    assert spec.state_kind == "mamba2" and spec.kind is GroupKind.MAMBA
    assert spec.page_size_bytes == 10 * 3 * 2 + 2 * 3 * 4 * 4
    assert MambaSpec(block_size=64) == MambaSpec(block_size=64) and len({MambaSpec(block_size=64), spec}) == 2


def test_a_third_party_state_kind_is_allocated_copied_and_managed_from_its_declaration():
    assert RWKV.page_size_bytes == 8 * 2 + 32 * 4 + 8
    groups = group_layers_by_spec({"l0": RWKV, "l1": RWKV})
    cfg = KVCacheConfig(num_blocks=4, groups=groups, num_state_slots=5)
    caches = allocate_kv_caches(cfg, [RwkvLikeBackend], [64])
    cache = caches["l0"]
    assert [(tuple(t.shape), t.dtype) for t in cache] == [((5, 8), torch.float16), ((5, 2, 4, 4), torch.float32),
                                                          ((5, 1), torch.int64)]
    for t in caches["l1"]:
        t[2] = 3
    assert copy_state_slots(caches, [g.layer_names for g in groups], [(0, 2, 4)]) == 1
    assert all((t[4] == 3).all() and (t[1] == 0).all() for t in caches["l1"]), "every declared tensor moves"
    assert isinstance(make_block_manager(RWKV, BlockPool(4)), MambaStateManager)


def test_state_backends_allocate_only_their_kind_and_reject_other_kinds_of_layers():
    from attnplug.backends.mamba2 import Mamba2Backend
    from attnplug.backends.state.gdn import GDNTorchBackend

    with pytest.raises(KVCacheSpecError, match="serves .gdn. state, the spec declares .mamba2."):
        GDNTorchBackend.allocate_state_cache(MambaSpec(block_size=4), 2, "cpu")
    assert isinstance(Mamba2Backend.allocate_state_cache(MambaSpec(block_size=4), 2, "cpu"), MambaStateCache)
    gdn = GDNLayerConfig(num_k_heads=1, num_v_heads=2, head_k_dim=4, head_v_dim=4, conv_kernel_size=4)
    mamba = MambaLayerConfig(num_heads=2, head_size=4, state_size=4, n_groups=1, conv_kernel_size=4, chunk_size=4)
    assert Mamba2Backend.validate_configuration(gdn) == ["serves 'mamba2' state layers, not 'gdn'"]
    assert GDNTorchBackend.validate_configuration(mamba) == ["serves 'gdn' state layers, not 'mamba2'"]
    assert GDNTorchBackend.validate_configuration(gdn) == []


@pytest.mark.parametrize("kwargs,message", [
    (dict(tensors=()), "declares at least one StateTensorSpec"),
    (dict(tensors=(StateTensorSpec("a", (1,)), StateTensorSpec("a", (2,)))), r"repeated: \['a'\]"),
    (dict(tensors=(StateTensorSpec("a", (1,)),), state_kind=""), "state_kind must be a non-empty str"),
    (dict(tensors=(StateTensorSpec("a", (1,)),), chunk_size=-1), "chunk_size must be an int >= 0"),
])
def test_bad_declarations_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(KVCacheSpecError, match=message):
        StateSpec(block_size=16, **kwargs)


def test_bad_tensor_declarations_are_refused():
    with pytest.raises(KVCacheSpecError, match="shape must be a tuple of ints >= 0"):
        StateTensorSpec("x", (2, -1))
    with pytest.raises(KVCacheSpecError, match="name must be an identifier"):
        StateTensorSpec("not a name", (2,))
    with pytest.raises(KVCacheSpecError, match="has no tensor 'ssm' .declared: shift, wkv, count."):
        RWKV.tensor("ssm")


def test_a_state_page_that_does_not_fit_the_padded_page_is_refused_in_one_line():
    """vLLM pads a state page to an attention block's page (``page_size_padded``); the
    declared tensors must fit in it, or the spec is refused naming the field."""
    import dataclasses

    from attnplug.backends.state.gdn import GDNTorchBackend
    from attnplug.cache_groups.specs import FullAttentionSpec
    from attnplug.runner.models.qwen3_next import gdn_state_spec

    gdn = gdn_state_spec(GDNLayerConfig(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8,
                                        conv_kernel_size=4), 16)
    need = gdn.page_size_bytes
    assert need == (2 * 16 + 32) * 3 * 4 + 4 * 8 * 8 * 4
    small = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32).page_size_bytes
    big = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32).page_size_bytes
    assert small < need <= big
    padded = dataclasses.replace(gdn, page_size_padded=big)
    assert padded.page_size_bytes == big and padded.tensors == gdn.tensors
    assert [tuple(t.shape) for t in GDNTorchBackend.allocate_state_cache(padded, 3, "cpu")] == [
        (3, 64, 3), (3, 4, 8, 8)], "allocation follows the declared tensors"
    with pytest.raises(KVCacheSpecError) as e:
        dataclasses.replace(gdn, block_size=4, page_size_padded=small)
    msg = str(e.value)
    assert msg.startswith(f"page_size_padded: {small} bytes (the page of a block of 4 tokens) does not fit the gdn "
                          f"state's {need} bytes (conv_state 768, recurrent_state 1024)") and "\n" not in msg
    assert gdn.page_size_padded is None and gdn.page_size_bytes == need, "the spec it was derived from is unchanged"
    with pytest.raises(KVCacheSpecError, match="page_size_padded: 'x' bytes"):
        StateSpec(block_size=16, tensors=(StateTensorSpec("a", (1,)),), page_size_padded="x")

