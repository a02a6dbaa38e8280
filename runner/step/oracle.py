"""A deliberately naive step compiler: per-request dicts, per-token Python loops.

It knows prompt embeddings and images too (``is_embed`` / ``embed_rows`` / ``image_rows``:
which row each token takes, recomputed per token).

Two uses: the test oracle (it recomputes every step's inputs from scratch out of plain
Python lists, sharing no code with ``StepCompiler`` beyond the data classes) and the
baseline of ``attnplug bench step``. It follows the same row placement policy as
``InputBatch`` (fill the lowest free row; condense moves the last row into the lowest
hole; optional decodes-first swaps) so that row orders can be compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attnplug.cache_groups.kinds import GroupKind
from attnplug.core.constants import NULL_BLOCK_ID, PAD_SLOT_ID
from attnplug.core.devices import resolve_device
from attnplug.core.errors import InvalidSchedulerOutput
from attnplug.core.metadata import CommonAttentionMetadata
from attnplug.runner.step.packed_deltas import as_vllm_form
from attnplug.runner.step.scheduler_output import SchedulerOutput


@dataclass
class NaiveStepInputs:
    """Plain-list twin of ``StepInputs`` (same names; ``block_table``: per group, per row,
    the row's kernel block ids)."""

    req_ids: list[str]
    num_scheduled_tokens: list[int]
    num_computed_tokens: list[int]
    num_tokens: list[int]
    query_start_loc: list[int]
    req_indices: list[int]
    positions: list[int]
    input_ids: list[int]
    seq_lens: list[int]
    logits_indices: list[int]
    discard: list[bool]
    is_prefilling: list[bool]
    slot_mapping: list[list[int]]
    block_table: list[list[list[int]]]
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    common_prefix_len: list[int] | None = None
    """Per group: leading manager blocks that are the same real block in every row (prefix
    caching), in tokens, clamped to the smallest ``num_computed_tokens``, rounded down to
    the kernel block; 0 for a sliding-window or Mamba group or fewer than two rows
    (``runner/execute/cascade.py``'s definition, recomputed naively)."""
    num_draft_tokens: list[int] | None = None
    """Speculative decoding, over the kept rows: drafts per row (``None``: no drafts this step)."""
    spec_logits_indices: list[int] | None = None
    """The last ``1 + d`` token indices of every kept row."""
    draft_token_ids: list[int] | None = None
    row_draft_tokens: list[int] | None = None
    """Drafts of every row (``CommonAttentionMetadata.num_draft_tokens_cpu``; ``None``: no drafts)."""
    is_embed: list[bool] | None = None
    """Per token: its row comes from the request's prompt embeddings (a prompt position of a
    request given them); ``None`` when no token of the step does."""
    embed_rows: list | None = None
    """The prompt-embedding rows of the tokens ``is_embed``, in token order (1-D tensors)."""
    image_rows: list[tuple[str, int] | None] | None = None
    """Per token: ``(mm_hash, row of the image's encoder output)`` for a placeholder token of
    an image, else ``None``; ``None`` when no token of the step is one."""


class NaiveStepCompiler:
    """Same constructor arguments and step methods as ``StepCompiler`` (lists in, lists out)."""

    def __init__(self, block_sizes, max_num_reqs, max_model_len, max_num_batched_tokens,
                 device="cpu", kernel_block_sizes=None, reorder_batch_threshold=None, *,
                 num_blocks=None, group_kinds=None):
        self.block_sizes = list(block_sizes)
        self.kernel_block_sizes = list(kernel_block_sizes or self.block_sizes)
        self.group_kinds = [GroupKind(k) for k in group_kinds or [GroupKind.FULL_ATTENTION] * len(self.block_sizes)]
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.reorder_batch_threshold = reorder_batch_threshold
        self.num_blocks = num_blocks if num_blocks is not None else 2**30
        self.device = resolve_device(device)
        self.reqs: dict[str, dict] = {}
        self.rows: list[str | None] = []
        self.sched: dict[str, int] = {}

    def _fail(self, rid, field, msg):
        raise InvalidSchedulerOutput(rid, field, msg)

    def update_states(self, so: SchedulerOutput) -> None:
        """Check the output request by request, then apply it (a packed output,
        ``PackedCachedDeltas``, in vLLM's form: ``packed_deltas.as_vllm_form``)."""
        so = as_vllm_form(so)
        self._check(so)
        self._apply(so)

    def _check(self, so: SchedulerOutput) -> None:
        cached = so.scheduled_cached_reqs
        total = 0
        for rid in so.finished_req_ids:
            if rid not in self.reqs:
                self._fail(rid, "finished_req_ids", "unknown request")
        seen = set()
        for nr in so.scheduled_new_reqs:
            if (nr.req_id in self.reqs and nr.req_id not in so.finished_req_ids) or nr.req_id in seen:
                self._fail(nr.req_id, "scheduled_new_reqs", "already resident")
            seen.add(nr.req_id)
            n = so.num_scheduled_tokens.get(nr.req_id, 0)
            held = len(nr.prompt_token_ids) + len(nr.output_token_ids)
            if n < 1 or nr.num_computed_tokens + n > held or held > self.max_model_len:
                self._fail(nr.req_id, "num_scheduled_tokens", "bad count")
            for g, ids in enumerate(nr.block_ids):
                if any(b < 0 or b >= self.num_blocks for b in ids):
                    self._fail(nr.req_id, "block_ids", "outside the pool")
            total += n
        for i, rid in enumerate(cached.req_ids):
            if rid not in self.reqs or rid in seen or rid in so.finished_req_ids:
                self._fail(rid, "scheduled_cached_reqs", "unknown or repeated request")
            seen.add(rid)
            n = so.num_scheduled_tokens.get(rid, 0)
            held = len(self.reqs[rid]["tokens"]) + len(cached.new_token_ids[i])
            if n < 1 or cached.num_computed_tokens[i] + n > held or held > self.max_model_len:
                if not (so.scheduled_spec_decode_tokens.get(rid) and cached.num_computed_tokens[i] + n
                        == held + len(so.scheduled_spec_decode_tokens[rid])):
                    self._fail(rid, "num_scheduled_tokens", "bad count")
            for g, ids in enumerate(cached.new_block_ids[i] or ()):
                lo = NULL_BLOCK_ID if (cached.resumed_from_preemption[i]
                                       and self.group_kinds[g] is GroupKind.SLIDING_WINDOW) else NULL_BLOCK_ID + 1
                if any(b < lo or b >= self.num_blocks for b in ids):
                    self._fail(rid, "new_block_ids", "outside the pool")
            total += n
        if total > self.max_num_batched_tokens or len(seen) != len(so.num_scheduled_tokens):
            self._fail(None, "num_scheduled_tokens", "bad total")
        self._check_drafts(so)

    def _check_drafts(self, so: SchedulerOutput) -> None:
        """Drafts only for a cached, not resumed request with one real token left,
        scheduled ``1 + d`` tokens, the ``1 + d`` tokens it may emit fitting ``max_model_len``."""
        cached = so.scheduled_cached_reqs
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            if not drafts:
                continue
            if rid not in cached.req_ids:
                self._fail(rid, "scheduled_spec_decode_tokens", "not a scheduled cached request")
            i = cached.req_ids.index(rid)
            held = len(self.reqs[rid]["tokens"]) + len(cached.new_token_ids[i])
            ncc, n = cached.num_computed_tokens[i], so.num_scheduled_tokens[rid]
            if (cached.resumed_from_preemption[i] or held - ncc != 1 or n != 1 + len(drafts)
                    or held + len(drafts) + 1 > self.max_model_len
                    or any(type(t) is not int or not 0 <= t < 2**31 for t in drafts)):
                self._fail(rid, "scheduled_spec_decode_tokens", "bad drafts")

    def _apply(self, so: SchedulerOutput) -> None:
        cached = so.scheduled_cached_reqs
        for rid in so.finished_req_ids:
            self.reqs.pop(rid)
            if rid in self.rows:
                self.rows[self.rows.index(rid)] = None
        for i, rid in enumerate(self.rows):
            if rid is not None and rid not in so.num_scheduled_tokens:
                self.rows[i] = None
        to_add = []
        in_rows = set(self.rows)
        for nr in so.scheduled_new_reqs:
            self.reqs[nr.req_id] = {
                "prompt": list(nr.prompt_token_ids),
                "tokens": list(nr.prompt_token_ids) + list(nr.output_token_ids),
                "ncc": nr.num_computed_tokens,
                "blocks": [list(b) for b in nr.block_ids],
                "sampling_params": nr.sampling_params,
                "spec": [],
                "embeds": None if nr.prompt_embeds is None else nr.prompt_embeds.detach().clone(),
                "images": [(f.mm_position.offset, f.mm_position.length, f.mm_hash) for f in nr.mm_features or ()],
            }
            to_add.append(nr.req_id)
        for i, rid in enumerate(cached.req_ids):
            st = self.reqs[rid]
            st["ncc"] = cached.num_computed_tokens[i]
            st["tokens"].extend(cached.new_token_ids[i])
            nb = cached.new_block_ids[i]
            if cached.resumed_from_preemption[i]:
                st["blocks"] = [list(b) for b in nb] if nb is not None else [[] for _ in self.block_sizes]
            elif nb is not None:
                for g, ids in enumerate(nb):
                    st["blocks"][g].extend(ids)
            if rid not in in_rows:
                to_add.append(rid)
        for rid in to_add:
            if None in self.rows:
                self.rows[self.rows.index(None)] = rid
            else:
                self.rows.append(rid)
        self.sched = dict(so.num_scheduled_tokens)
        for rid, st in self.reqs.items():
            st["spec"] = list(so.scheduled_spec_decode_tokens.get(rid, ()))
        # condense: the last occupied row moves into the lowest hole
        while None in self.rows:
            hole = self.rows.index(None)
            last = max(i for i, r in enumerate(self.rows) if r is not None) if any(
                r is not None for r in self.rows) else -1
            if last < hole:
                break
            self.rows[hole], self.rows[last] = self.rows[last], None
        while self.rows and self.rows[-1] is None:
            self.rows.pop()
        if self.reorder_batch_threshold is not None:
            dec = [self.sched[r] <= self.reorder_batch_threshold for r in self.rows]
            d = sum(dec)
            front = [i for i in range(d) if not dec[i]]
            back = [j for j in range(len(self.rows) - 1, d - 1, -1) if dec[j]]
            for a, b in zip(front, back):
                self.rows[a], self.rows[b] = self.rows[b], self.rows[a]

    def _embedding_sources(self, out: NaiveStepInputs) -> None:
        """``is_embed`` / ``embed_rows`` / ``image_rows`` of the step, token by token."""
        is_embed, rows, images = [], [], []
        for rid in out.req_ids:
            st = self.reqs[rid]
            c, e = st["ncc"], st.get("embeds")
            for p in range(c, c + self.sched[rid]):
                inside = e is not None and p < e.shape[0]
                is_embed.append(inside)
                if inside:
                    rows.append(e[p])
                images.append(next(((h, p - off) for off, length, h in st.get("images", ())
                                    if off <= p < off + length), None))
        if any(is_embed):
            out.is_embed, out.embed_rows = is_embed, rows
        if any(x is not None for x in images):
            out.image_rows = images

    def prepare_inputs(self, scheduler_output=None) -> NaiveStepInputs:
        """Recompute every input of the step from the per-request lists."""
        out = NaiveStepInputs([], [], [], [], [0], [], [], [], [], [], [], [],
                              [[] for _ in self.block_sizes], [[] for _ in self.block_sizes], 0, 0, 0)
        for i, rid in enumerate(self.rows):
            st = self.reqs[rid]
            n, c = self.sched[rid], st["ncc"]
            tokens = st["tokens"] + st["spec"]
            out.req_ids.append(rid)
            out.num_scheduled_tokens.append(n)
            out.num_computed_tokens.append(c)
            out.num_tokens.append(len(st["tokens"]))
            out.query_start_loc.append(out.query_start_loc[-1] + n)
            for j in range(n):
                pos = c + j
                out.req_indices.append(i)
                out.positions.append(pos)
                out.input_ids.append(tokens[pos])
                for g, B in enumerate(self.block_sizes):
                    if self.group_kinds[g] is GroupKind.MAMBA:
                        out.slot_mapping[g].append(PAD_SLOT_ID)
                    else:
                        out.slot_mapping[g].append(st["blocks"][g][pos // B] * B + pos % B)
            out.seq_lens.append(c + n)
            out.logits_indices.append(out.query_start_loc[-1] - 1)
            out.discard.append(c + n < len(st["tokens"]))
            out.is_prefilling.append(c < len(st["prompt"]))
            for g, (B, kb) in enumerate(zip(self.block_sizes, self.kernel_block_sizes)):
                k = B // kb
                if k == 1:
                    row = list(st["blocks"][g])
                else:
                    row = []
                    for b in st["blocks"][g]:
                        row.extend([NULL_BLOCK_ID] * k if b == NULL_BLOCK_ID else range(b * k, b * k + k))
                out.block_table[g].append(row)
        out.num_actual_tokens = out.query_start_loc[-1]
        out.max_query_len = max(out.num_scheduled_tokens, default=0)
        out.max_seq_len = max(out.seq_lens, default=0)
        out.common_prefix_len = [self._common_prefix_len(g, out) for g in range(len(self.block_sizes))]
        self._embedding_sources(out)
        if any(self.reqs[rid]["spec"] for rid in self.rows):
            out.row_draft_tokens = [len(self.reqs[rid]["spec"]) for rid in self.rows]
            out.num_draft_tokens, out.spec_logits_indices, out.draft_token_ids = [], [], []
            for i, rid in enumerate(self.rows):
                if out.discard[i]:
                    continue
                d = self.reqs[rid]["spec"]
                out.num_draft_tokens.append(len(d))
                end = out.query_start_loc[i + 1]
                out.spec_logits_indices.extend(range(end - 1 - len(d), end))
                out.draft_token_ids.extend(d)
        return out

    def _common_prefix_len(self, g: int, out: NaiveStepInputs) -> int:
        if self.group_kinds[g] is not GroupKind.FULL_ATTENTION or len(out.req_ids) < 2:
            return 0
        lists = [self.reqs[rid]["blocks"][g] for rid in out.req_ids]
        k = 0
        while all(len(ids) > k for ids in lists) and lists[0][k] != NULL_BLOCK_ID \
                and all(ids[k] == lists[0][k] for ids in lists):
            k += 1
        tokens = min(k * self.block_sizes[g], min(out.num_computed_tokens))
        return tokens - tokens % self.kernel_block_sizes[g]

    def build_common_attn_metadata(self, inp: NaiveStepInputs) -> list[CommonAttentionMetadata]:
        """Tensors from the lists, one fresh ``CommonAttentionMetadata`` per group."""
        dev = self.device
        out = []
        for g, B in enumerate(self.block_sizes):
            k = B // self.kernel_block_sizes[g]
            width = -(-self.max_model_len // B) * k
            table = np.full((len(inp.req_ids), width), NULL_BLOCK_ID, dtype=np.int32)
            for i, row in enumerate(inp.block_table[g]):
                table[i, :len(row)] = row
            out.append(CommonAttentionMetadata(
                query_start_loc=torch.tensor(inp.query_start_loc, dtype=torch.int32, device=dev),
                query_start_loc_cpu=torch.tensor(inp.query_start_loc, dtype=torch.int32),
                seq_lens=torch.tensor(inp.seq_lens, dtype=torch.int32, device=dev),
                seq_lens_cpu=torch.tensor(inp.seq_lens, dtype=torch.int32),
                num_computed_tokens_cpu=torch.tensor(inp.num_computed_tokens, dtype=torch.int32),
                num_reqs=len(inp.req_ids), num_actual_tokens=inp.num_actual_tokens,
                max_query_len=inp.max_query_len, max_seq_len=inp.max_seq_len,
                block_table_tensor=torch.from_numpy(table).to(dev),
                slot_mapping=torch.tensor(inp.slot_mapping[g], dtype=torch.int64, device=dev),
                causal=True,
                positions=torch.tensor(inp.positions, dtype=torch.int64, device=dev),
                is_prefilling=torch.tensor(inp.is_prefilling, dtype=torch.bool),
                num_draft_tokens_cpu=None if inp.row_draft_tokens is None else torch.tensor(
                    inp.row_draft_tokens, dtype=torch.int32)))
        return out

    def append_output_tokens(self, req_ids, token_ids) -> None:
        """Append one token (or a list of tokens: accepted drafts then the bonus) per request;
        the request's drafts are gone."""
        for rid, t in zip(req_ids, token_ids):
            self.reqs[rid]["tokens"].extend(t if isinstance(t, (list, tuple)) else [t])
            self.reqs[rid]["spec"] = []
