"""vLLM's ``CommonAttentionMetadata`` for one hand-made step, shared by the bridge's
interface tests (``test_vllm_interface.py``, ``test_vllm_mla_bridge.py``). Imported by path:
``sys.path.insert(0, <this folder>)``."""

from __future__ import annotations

import torch


def vllm_step(V, computed: list[int], scheduled: list[int], blocks: list[list[int]], pad: int, block_size: int,
              is_prefilling: list[bool]):
    """vLLM's ``CommonAttentionMetadata`` (``V``: ``attnplug.plugins.vllm._vllm``) for one step.

    Request ``i`` has ``computed[i]`` tokens in the cache and ``scheduled[i]`` new ones, its
    blocks ``blocks[i]`` (an int32 ``[num_reqs, 8]`` table, zero-padded); ``pad`` padding
    tokens at the end (position 0, slot -1); ``max_seq_len`` is one block above the longest
    request; ``is_prefilling``: one flag per request.
    """
    qsl = torch.tensor([0] + scheduled).cumsum(0).to(torch.int32)
    seq = torch.tensor([c + s for c, s in zip(computed, scheduled)], dtype=torch.int32)
    positions = torch.cat([torch.arange(c, c + s) for c, s in zip(computed, scheduled)] + [torch.zeros(pad)]).long()
    table = torch.zeros(len(blocks), 8, dtype=torch.int32)
    for i, row in enumerate(blocks):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    req = torch.repeat_interleave(torch.arange(len(scheduled)), torch.tensor(scheduled))
    real = positions[: len(req)]
    slots = torch.cat([table[req, real // block_size].long() * block_size + real % block_size, torch.full((pad,), -1)])
    return V.VllmCommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq, num_reqs=len(scheduled),
        num_actual_tokens=int(qsl[-1]) + pad, max_query_len=max(scheduled), max_seq_len=int(seq.max()) + block_size,
        block_table_tensor=table, slot_mapping=slots, causal=True, positions=positions,
        is_prefilling=torch.tensor(is_prefilling))
