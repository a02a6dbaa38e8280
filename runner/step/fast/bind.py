"""Binding the compiled fast paths to an ``InputBatch``'s columns.

Each compiled object (``runner/step/fast/_native.pyx``) holds typed views of the numpy
columns it reads and writes; this module is the one place that knows which column goes
where. It takes the batch and layout by duck typing (their attribute names), so the
fast paths stay a leaf of the import graph: nothing here imports the step compiler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from attnplug.runner.step.fast import NATIVE


@dataclass(frozen=True)
class Scans:
    """The compiled planning scans of one step compiler.

    Attributes:
        cached: ``CachedScan``: checks and plans the regular cached-request deltas in one
            pass (``runner/step/fast/_native_cached.pxi``).
        new: ``NewScan``: checks and stages fresh requests (``_native_admit.pxi``).
    """

    cached: Any
    new: Any


def _tables(batch) -> list:
    return list(batch.block_table)


def bind_block_rows(batch) -> Any:
    """The compiled ``BlockRows`` (row clears and moves of every group's block table) over
    ``batch.block_table``, or ``None`` when the extension is not built."""
    if NATIVE is None:
        return None
    tables = batch.block_table.block_tables
    return NATIVE.BlockRows(batch.block_table.num_blocks_per_row, [bt.block_table_np for bt in tables],
                            [bt.kernel_block_table.np for bt in tables], [bt.kernel_blocks_per_block for bt in tables])


def bind_scans(batch, layout, sampling_params_cls: type) -> Scans:
    """``CachedScan`` and ``NewScan`` over ``batch``'s columns for ``layout``'s groups.

    Args:
        batch: the ``InputBatch`` (its columns are bound, not copied).
        layout: the ``StepLayout`` (pool sizes, null-block rules, tokens per block).
        sampling_params_cls: the ``SamplingParams`` class a new request must carry.

    Raises:
        RuntimeError: the extension is not built (check ``NATIVE`` first).
    """
    if NATIVE is None:
        raise RuntimeError("the compiled fast paths are not built")
    b = batch
    tables = _tables(b)
    ids = [bt.block_table_np for bt in tables]
    kernel = [bt.kernel_block_table.np for bt in tables]
    per_block = [bt.kernel_blocks_per_block for bt in tables]
    nblocks = b.block_table.num_blocks_per_row
    cached = NATIVE.CachedScan(
        b.num_tokens, b.num_computed_tokens_nulled, b.num_computed_tokens_cpu, b.num_scheduled_tokens, nblocks,
        ids, kernel, per_block, layout.capacity_col[:, 0], layout.num_blocks_per_group, layout.null_block_allowed)
    new = NATIVE.NewScan(
        b.token_ids_cpu, b.num_tokens, b.num_prompt_tokens, b.num_computed_tokens_cpu, b.num_scheduled_tokens,
        b.num_computed_tokens_nulled, b.temperature, b.top_k, b.top_p, nblocks, ids, kernel, per_block,
        layout.capacity_col[:, 0],  # a Mamba group: max_model_len, so it needs one state slot
        layout.num_blocks_per_group, sampling_params_cls)
    return Scans(cached, new)


def bind_prepare(batch, preparer, writes_slots: tuple[bool, ...]) -> Any:
    """The compiled ``Prepare`` over ``batch``'s columns and ``preparer``'s output buffers
    (an ``InputPreparer``); groups that write no slots (Mamba) get no slot mapping."""
    tables = _tables(batch)
    p = preparer
    return NATIVE.Prepare(
        batch.num_scheduled_tokens, batch.num_computed_tokens_cpu, batch.num_tokens, batch.num_prompt_tokens,
        batch.token_ids_cpu, p.query_start_loc.np, p.positions.np, p.input_ids.np, p.seq_lens.np,
        p.logits_indices.np, p._req_indices, p._discard, p._is_prefilling,
        [bt.block_table_np if w else None for bt, w in zip(tables, writes_slots)],
        [bt.slot_mapping.np for bt in tables], [bt.block_size for bt in tables])
