"""``merge_attn_states``: the cascade's combination of two partial results by their LSE."""

from __future__ import annotations

import torch

from attnplug.backends.common.merge import merge_attn_states


def test_merge_equals_attention_over_the_union():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 2, 8, generator=g), torch.randn(10, 2, 8, generator=g), torch.randn(10, 2, 8, generator=g)

    def attend(keys):
        logits = torch.einsum("thd,khd->htk", q, k[keys])
        return torch.einsum("htk,khd->thd", logits.softmax(-1), v[keys]), logits.logsumexp(-1)

    (oa, la), (ob, lb), (ref, _) = attend(slice(0, 4)), attend(slice(4, 10)), attend(slice(0, 10))
    torch.testing.assert_close(merge_attn_states(oa, la, ob, lb), ref)


def test_an_empty_side_is_ignored_whether_its_lse_is_minus_or_plus_inf():
    """FlashAttention's non-split kernels write +inf for a row that saw no key, split ones -inf."""
    out_b, lse_b = torch.randn(2, 1, 4), torch.zeros(1, 2)
    garbage = torch.full((2, 1, 4), float("nan"))
    for empty in (float("-inf"), float("inf")):
        merged = merge_attn_states(garbage, torch.full((1, 2), empty), out_b, lse_b)
        assert torch.equal(merged, out_b), empty
    both_empty = merge_attn_states(garbage, torch.full((1, 2), float("inf")), garbage, torch.full((1, 2), float("-inf")))
    assert torch.equal(both_empty, torch.zeros(2, 1, 4)), "no key at all: zeros"
