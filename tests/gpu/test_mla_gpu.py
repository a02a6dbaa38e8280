"""The MLA backends on a CUDA GPU (marker ``gpu``; skipped without CUDA): the MLA conformance
family on ``torch_native_mla`` and the compiled ``triton_mla`` (float32/float16/bfloat16),
the decode kernel at DeepSeek's real dims (512 + 64, 128 heads) and long contexts against
the reference, and ``flashmla`` / ``flashinfer_mla`` when their packages are installed.

Run them in a process without ``TRITON_INTERPRET`` (``tests/gpu/run_all.sh`` does).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")]


@pytest.mark.parametrize("backend", ["torch_native_mla", "triton_mla", "flashmla", "flashinfer_mla"])
def test_mla_family_on_cuda(backend, capsys):
    from attnplug.plugins.discovery import get_backend
    from attnplug.runner.commands.check import main

    ok, why = get_backend(backend).is_available()
    if not ok:
        pytest.skip(why)
    rc = main([backend, "--device", "cuda", "-k", "mla"])
    out = capsys.readouterr().out
    assert rc == 0, out


@pytest.mark.parametrize("dtype, splits", [(torch.bfloat16, 1), (torch.bfloat16, 8), (torch.float16, 4)])
def test_decode_kernel_at_deepseek_dims(dtype, splits):
    from attnplug.backends.mla.torch_native.backend import TorchNativeMLABackend
    from attnplug.backends.mla.triton.decode import mla_decode
    from attnplug.core.mla import MLADecodeMetadata, MLALayerConfig

    g = torch.Generator(device="cuda").manual_seed(0)
    heads, lr, rope, bs = 128, 512, 64, 64
    seq = torch.tensor([1, 900, 4096, 8191], dtype=torch.int32, device="cuda")
    blocks = (seq + bs - 1) // bs
    table = torch.zeros(4, int(blocks.max()), dtype=torch.int32, device="cuda")
    perm = torch.randperm(int(blocks.sum()), generator=g, device="cuda").to(torch.int32) + 1
    start = 0
    for r, n in enumerate(blocks.tolist()):
        table[r, :n] = perm[start:start + n]
        start += n
    cache = torch.randn(int(blocks.sum()) + 1, bs, lr + rope, generator=g, device="cuda").to(dtype)
    cache[0] = float("nan")                                  # the null block: never read
    q = torch.randn(4, heads, lr + rope, generator=g, device="cuda").to(dtype)
    o, lse = mla_decode(q, cache, table, seq, kv_lora_rank=lr, scale=192 ** -0.5, num_kv_splits=splits)
    ref = TorchNativeMLABackend.get_impl_cls()(MLALayerConfig(heads, lr, 128, rope, 128, dtype=dtype), 192 ** -0.5)
    want_o, want_lse = ref.forward_mqa(q, cache, MLADecodeMetadata(4, table, seq, 8191))
    assert not torch.isnan(o).any()
    torch.testing.assert_close(o.float(), want_o.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=2e-2, rtol=2e-2)
