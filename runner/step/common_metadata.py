"""Stage 4 of a step: ONE ``CommonAttentionMetadata``, ``replace``d per cache group.

Group 0's object is the template; every other group's shares all its tensors but the
block table and slot mapping (``CommonAttentionMetadata.replace``). The builders of
``runner/execute/group_metadata.py`` (stage 5) lower these per group.
"""

from __future__ import annotations

import torch

from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.runner.step.prepare import StepInputs


def build_common_attn_metadata(inputs: StepInputs, num_computed_tokens_cpu: torch.Tensor,
                               num_draft_tokens_cpu: torch.Tensor | None = None) -> list[CommonAttentionMetadata]:
    """ONE :class:`CommonAttentionMetadata` for group 0, ``replace``d copies for the others.

    Args:
        inputs: the step's inputs.
        num_computed_tokens_cpu: ``[num_reqs]`` ``int32`` CPU view of the batch column.
        num_draft_tokens_cpu: ``[num_reqs]`` ``int32`` CPU drafts per row (a step with
            drafts), else ``None``.

    Returns:
        Per cache group, the step's metadata with that group's ``block_table_tensor`` and
        ``slot_mapping``; every other tensor is shared.
    """
    R = inputs.num_reqs
    cm = CommonAttentionMetadata(
        query_start_loc=inputs.query_start_loc,
        query_start_loc_cpu=inputs.query_start_loc_cpu,
        seq_lens=inputs.seq_lens,
        seq_lens_cpu=inputs.seq_lens_cpu,
        num_computed_tokens_cpu=num_computed_tokens_cpu,
        num_reqs=R,
        num_actual_tokens=inputs.num_actual_tokens,
        max_query_len=inputs.max_query_len,
        max_seq_len=inputs.max_seq_len,
        block_table_tensor=inputs.block_table_tensor[0],
        slot_mapping=inputs.slot_mapping[0],
        causal=True,
        positions=inputs.positions,
        is_prefilling=inputs.is_prefilling_cpu,
        num_draft_tokens_cpu=num_draft_tokens_cpu,
    )
    out = [cm]
    for bt, sm in zip(inputs.block_table_tensor[1:], inputs.slot_mapping[1:]):
        out.append(cm.replace(block_table_tensor=bt, slot_mapping=sm))
    inputs.common_attn_metadata = out
    return out
