"""Random step sequences: StepCompiler vs a naive from-scratch oracle, every step.

Each hypothesis example builds a random cache-group layout (1-3 groups, different block
sizes, a kernel block smaller than the manager block, sometimes a sliding-window group
with null blocks in its skipped prefix, sometimes decodes-first reordering) and drives
both implementations through STEPS_PER_EXAMPLE random steps that add requests (with
prefix hits), append tokens and blocks, finish, leave requests unscheduled, and preempt
and resume them, and new requests that share a resident request's leading blocks (prefix
hits on shared block ids, refcounted in the random pool). Every step compares all inputs,
the row order, both views of every request, ``common_prefix_len`` per group (the runner's
cascade computation against the oracle's naive one), and runs ``validate`` on every group.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.runner.step.oracle import NaiveStepCompiler
from attnplug.runner.step.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from attnplug.runner.execute.cascade import step_prefix_lens
from attnplug.runner.step.fast import NATIVE
from attnplug.runner.step.compiler import StepCompiler
from attnplug.runner.step.multimodal import MultiModalConfig, image_feature
from attnplug.runner.step.prompt_embeds import PromptEmbedsConfig

STEPS_PER_EXAMPLE = 25
MAX_EXAMPLES = 15 if os.environ.get("ATTNPLUG_MUTATE") else 90  # fewer per mutant (tests/mutate.py)
STEP_COUNT = {"steps": 0, "native": 0, "numpy": 0, "in_flight": 0, "shared": 0, "common_prefix": 0, "embeds": 0,
              "images": 0}
HIDDEN, PATCH_DIM = 4, 3  # prompt embeddings' width; an image patch's values (merge size 1)

LAYOUTS = [
    # (block_sizes, kernel_block_sizes, group_kinds)
    ([4], [4], ["full_attention"]),
    ([4, 8], [4, 4], ["full_attention", "full_attention"]),
    ([8, 2], [2, 2], ["full_attention", "sliding_window"]),
    ([2, 16, 4], [2, 8, 4], ["full_attention", "full_attention", "sliding_window"]),
    ([16, 4], [16, 2], ["full_attention", "full_attention"]),
]
MAX_NUM_REQS, MAX_MODEL_LEN, MAX_TOKENS, NUM_BLOCKS = 6, 48, 40, 400


class RandomScheduler:
    """Emits valid, varied SchedulerOutputs by reading the oracle's state."""

    def __init__(self, rng: random.Random, layout, oracle: NaiveStepCompiler, regular: bool = False,
                 media: bool = True):
        self.rng = rng
        self.media = media  # prompt embeddings / images on some new requests (the compiler must take them)
        self.regular = regular
        """Mostly regular outputs (no token deltas, rare resumes): the compiled fast path."""
        self.block_sizes, _, self.kinds = layout
        self.oracle = oracle
        self.free = [list(range(1, NUM_BLOCKS)) for _ in self.block_sizes]
        for f in self.free:
            rng.shuffle(f)
        self.next_id = 0
        self.kv: dict[str, int] = {}  # tokens whose K/V the runner computed
        self.refs: list[dict[int, int]] = [{} for _ in self.block_sizes]  # holders of shared blocks

    def _alloc(self, g: int, n: int) -> list[int]:
        assert len(self.free[g]) >= n, "test pool exhausted"
        out, self.free[g] = self.free[g][:n], self.free[g][n:]
        for b in out:
            self.refs[g][b] = 1
        return out

    def _release(self, blocks) -> None:
        for g, ids in enumerate(blocks):
            for b in ids:
                if b == NULL_BLOCK_ID:
                    continue
                self.refs[g][b] -= 1
                if self.refs[g][b] == 0:
                    del self.refs[g][b]
                    self.free[g].append(b)

    def _share(self, donors: list[str], plen: int):
        """A prefix hit on a resident donor's leading blocks: ``(tokens, h, per group the
        shared ids)`` with ``h`` a multiple of every block size, at most the donor's
        computed tokens and ``plen - 1``; ``None`` when no donor can give a block."""
        if not donors:
            return None
        donor = self.rng.choice(donors)
        unit = int(np.lcm.reduce(self.block_sizes))
        h = min(self.kv.get(donor, 0), plen - 1, len(self.oracle.reqs[donor]["tokens"])) // unit * unit
        lists = self.oracle.reqs[donor]["blocks"]
        shared = [list(ids[:h // B]) for ids, B in zip(lists, self.block_sizes)]
        if h == 0 or any(len(s) < h // B or NULL_BLOCK_ID in s for s, B in zip(shared, self.block_sizes)):
            return None
        return self.oracle.reqs[donor]["tokens"][:h], h, shared

    def _fresh_blocks(self, start: int, end: int, skip_ok: bool) -> tuple[list[int], ...]:
        """Blocks covering tokens [0, end); in sliding-window groups the blocks wholly
        before ``start`` may be the null block."""
        out = []
        for g, B in enumerate(self.block_sizes):
            n = -(-end // B) + self.rng.choice([0, 0, 0, 1])
            n = min(n, -(-MAX_MODEL_LEN // B))
            ids = self._alloc(g, n)
            if skip_ok and self.kinds[g] == "sliding_window":
                for i in range(min(start // B, n)):
                    if self.rng.random() < 0.5:
                        self.free[g].append(ids[i])
                        ids[i] = NULL_BLOCK_ID
            out.append(ids)
        return tuple(out)

    def step(self) -> SchedulerOutput:
        rng, oracle = self.rng, self.oracle
        budget = MAX_TOKENS
        finished = set()
        for rid in list(oracle.reqs):
            if rng.random() < 0.12:
                finished.add(rid)
                self._release(oracle.reqs[rid]["blocks"])
                self.kv.pop(rid, None)
        cached = CachedRequestData()
        sched: dict[str, int] = {}
        residents = [r for r in oracle.reqs if r not in finished]
        rng.shuffle(residents)
        resumed_now: set[str] = set()
        for rid in residents:
            st_ = oracle.reqs[rid]
            if len(sched) >= MAX_NUM_REQS or budget == 0 or rng.random() < 0.15:
                continue  # unscheduled this step (state kept)
            held = len(st_["tokens"])
            new_tokens = [] if self.regular else [rng.randrange(1000) for _ in range(rng.choice([0, 0, 0, 1, 2]))]
            if held + len(new_tokens) > MAX_MODEL_LEN:
                new_tokens = []
            held += len(new_tokens)
            resumed = rng.random() < (0.02 if self.regular else 0.1)
            if resumed:
                ncc = rng.randrange(0, held)
            else:
                ncc = min(self.kv[rid], held)
                if ncc >= held:
                    continue
            n = rng.randint(1, min(held - ncc, budget))
            if resumed:
                self._release(st_["blocks"])
                blocks = self._fresh_blocks(ncc, ncc + n, skip_ok=True)
            else:
                blocks = []
                for g, B in enumerate(self.block_sizes):
                    need = max(0, -(-(ncc + n) // B) - len(st_["blocks"][g]))
                    room = -(-MAX_MODEL_LEN // B) - len(st_["blocks"][g]) - need
                    blocks.append(self._alloc(g, need + (1 if room > 0 and rng.random() < 0.1 else 0)))
                blocks = tuple(blocks) if any(blocks) else None
            if resumed:
                resumed_now.add(rid)
            cached.req_ids.append(rid)
            cached.resumed_from_preemption.append(resumed)
            cached.new_token_ids.append(new_tokens)
            cached.new_block_ids.append(blocks)
            cached.num_computed_tokens.append(ncc)
            sched[rid] = n
            self.kv[rid] = ncc + n
            budget -= n
        new = []
        while len(sched) < MAX_NUM_REQS and budget > 0 and rng.random() < 0.45:
            rid = f"r{self.next_id}"
            self.next_id += 1
            plen = rng.randint(1, MAX_MODEL_LEN - 4)
            outs = [rng.randrange(1000) for _ in range(rng.choice([0, 0, 0, 2]))]
            held = plen + len(outs)
            ncc = rng.choice([0, 0, rng.randrange(0, held)])
            prompt = [rng.randrange(1000) for _ in range(plen)]
            hit = self._share([r for r in residents if r not in resumed_now], plen) \
                if rng.random() < 0.4 else None
            if hit is not None:  # a prefix hit: start on the donor's blocks
                toks, ncc, shared = hit
                prompt[:ncc] = toks
            n = rng.randint(1, min(held - ncc, budget))
            sp = SamplingParams(temperature=rng.choice([0.0, 0.7]), top_k=rng.choice([0, 5]),
                                top_p=rng.choice([1.0, 0.9]), seed=rng.choice([None, 7]))
            blocks = self._fresh_blocks(ncc, ncc + n, skip_ok=hit is None)
            if hit is not None:
                for g, ids in enumerate(shared):
                    self._release([[] if j != g else blocks[g][:len(ids)] for j in range(len(shared))])
                    blocks[g][:len(ids)] = ids
                    for b in ids:
                        self.refs[g][b] += 1
                STEP_COUNT["shared"] += 1
            embeds, images = None, None  # prompt embeddings / an image on some new requests
            if not self.media:
                pass
            elif rng.random() < 0.12:
                embeds = torch.randn(plen, HIDDEN, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
            elif plen >= 2 and rng.random() < 0.15:
                k = rng.randint(1, min(plen, 6))
                images = [image_feature(torch.full((k, PATCH_DIM), float(rng.randrange(99))), (1, 1, k),
                                        rng.randrange(0, plen - k + 1), 1)]
            new.append(NewRequestData(rid, prompt, blocks, ncc, sp, outs, prompt_embeds=embeds, mm_features=images))
            sched[rid] = n
            self.kv[rid] = ncc + n
            budget -= n
        return SchedulerOutput(new, cached, sched, finished_req_ids=finished)


def compare_embedding_rows(inp, ref) -> None:
    """Prompt-embedding rows and image slices, token by token, against the oracle's."""
    Q = inp.num_actual_tokens
    if ref.is_embed is None:
        assert inp.inputs_embeds is None and inp.is_embed is None
    else:
        assert inp.is_embed[:Q].tolist() == ref.is_embed
        assert torch.equal(inp.inputs_embeds[:Q][inp.is_embed[:Q]], torch.stack(ref.embed_rows))
        STEP_COUNT["embeds"] += 1
    got: list = [None] * Q
    for s in inp.mm_slices or ():
        for j in range(s.length):
            assert got[s.dest + j] is None
            got[s.dest + j] = (s.feature.mm_hash, s.start + j)
    assert got == (ref.image_rows or [None] * Q)
    STEP_COUNT["images"] += ref.image_rows is not None


def compare(sc: StepCompiler, oracle: NaiveStepCompiler, inp, ref) -> None:
    R, Q = inp.num_reqs, inp.num_actual_tokens
    assert inp.req_ids == ref.req_ids
    assert inp.num_scheduled_tokens.tolist() == ref.num_scheduled_tokens
    assert inp.num_computed_tokens.tolist() == ref.num_computed_tokens
    assert inp.query_start_loc_cpu.tolist() == ref.query_start_loc
    assert inp.req_indices.tolist() == ref.req_indices
    assert inp.positions.tolist() == ref.positions
    assert inp.input_ids.tolist() == ref.input_ids
    assert inp.seq_lens.tolist() == ref.seq_lens
    assert inp.logits_indices.tolist() == ref.logits_indices
    assert inp.discard.tolist() == ref.discard
    assert inp.is_prefilling.tolist() == ref.is_prefilling
    assert (Q, inp.max_query_len, inp.max_seq_len) == (ref.num_actual_tokens, ref.max_query_len, ref.max_seq_len)
    cms = inp.common_attn_metadata
    assert len(cms) == len(sc.block_sizes)
    drafts = cms[0].num_draft_tokens_cpu   # state builders read it (docs/speculative-decoding.md)
    assert (None if drafts is None else drafts.tolist()) == ref.row_draft_tokens
    for g in range(len(sc.block_sizes)):
        assert inp.slot_mapping[g].tolist() == ref.slot_mapping[g], f"group {g} slot mapping"
        table = inp.block_table_tensor[g]
        assert table.shape[0] == R
        for i in range(R):
            row = ref.block_table[g][i]
            assert table[i, :len(row)].tolist() == row, f"group {g} row {i}"
            assert (table[i, len(row):] == NULL_BLOCK_ID).all()
        assert cms[g].slot_mapping is inp.slot_mapping[g]
        assert cms[g].block_table_tensor is inp.block_table_tensor[g]
        assert cms[g].query_start_loc is cms[0].query_start_loc  # one template, replaced copies
    compare_embedding_rows(inp, ref)
    for bt in sc.input_batch.block_table:  # the compiled scan trusts it to skip rows
        held = np.where(np.arange(bt.block_table_np.shape[1]) < bt.num_blocks_per_row[:, None], bt.block_table_np, 0)
        assert (bt.block_id_bound >= held.max(axis=1, initial=0)).all(), "block_id_bound below a held id"
    skip = [k != "full_attention" for k in sc.layout.group_kinds]
    assert step_prefix_lens(sc, cms, skip) == ref.common_prefix_len
    STEP_COUNT["common_prefix"] += any(ref.common_prefix_len)
    # both views of every request
    assert set(sc.requests) == set(oracle.reqs)
    for rid, st_ in sc.requests.items():
        o = oracle.reqs[rid]
        assert st_.all_token_ids == o["tokens"]
        assert list(st_.output_token_ids) == o["tokens"][len(o["prompt"]):]
        assert st_.num_computed_tokens == o["ncc"]
        assert [list(b) for b in st_.block_ids] == o["blocks"]
        assert (st_.row is not None) == (rid in ref.req_ids)


@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(rng=st.randoms(use_true_random=False), layout=st.sampled_from(LAYOUTS),
       threshold=st.sampled_from([None, None, 1, 2]), regular=st.booleans(),
       native=st.sampled_from([None, None, False]))
def test_random_steps_match_naive_oracle(rng, layout, threshold, regular, native):
    """``native=None``: the compiled fast paths when built; ``False``: numpy paths only."""
    block_sizes, kernel_sizes, kinds = layout
    kw = dict(kernel_block_sizes=kernel_sizes, reorder_batch_threshold=threshold,
              num_blocks=NUM_BLOCKS, group_kinds=kinds)
    sc = StepCompiler(block_sizes, MAX_NUM_REQS, MAX_MODEL_LEN, MAX_TOKENS, validate=True, native=native,
                      prompt_embeds=PromptEmbedsConfig(HIDDEN, torch.float32), multimodal=MultiModalConfig(1, PATCH_DIM),
                      **kw)
    oracle = NaiveStepCompiler(block_sizes, MAX_NUM_REQS, MAX_MODEL_LEN, MAX_TOKENS, **kw)
    sched = RandomScheduler(rng, layout, oracle, regular)
    for _ in range(STEPS_PER_EXAMPLE):
        so = sched.step()
        plan = sc.checker.plan(so)
        sc.apply(plan)
        STEP_COUNT["native" if sc.checker.last_scanned else "numpy"] += 1
        oracle.update_states(so)
        inp = sc.prepare_inputs(so)
        ref = oracle.prepare_inputs(so)
        compare(sc, oracle, inp, ref)
        # the runner appends its own samples to rows whose logits are kept
        keep = [i for i, d in enumerate(ref.discard) if not d and ref.num_tokens[i] < MAX_MODEL_LEN]
        rng.shuffle(keep)
        ids = [ref.req_ids[i] for i in keep]
        toks = [[rng.randrange(1000)] for _ in keep]
        if rng.random() < 0.5:
            sc.append_output_tokens(ids, toks)
        else:
            sc.append_output_tokens(np.array(keep), [t[0] for t in toks])
        oracle.append_output_tokens(ids, toks)
        STEP_COUNT["steps"] += 1


@settings(max_examples=MAX_EXAMPLES * 4 // 9, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(rng=st.randoms(use_true_random=False), layout=st.sampled_from(LAYOUTS),
       threshold=st.sampled_from([None, 1, 2]), native=st.sampled_from([None, False]))
def test_random_steps_with_a_step_in_flight_match_the_oracle(rng, layout, threshold, native):
    """Asynchronous scheduling: each step's samples stay "on the device" (a tensor) and the
    history gets placeholders; the next step's input_ids must equal the oracle's (which got
    the real tokens at once) after rows were condensed, reordered, unscheduled, resumed or
    finished in between; then the real tokens are filled in and both views must agree."""
    block_sizes, kernel_sizes, kinds = layout
    kw = dict(kernel_block_sizes=kernel_sizes, reorder_batch_threshold=threshold,
              num_blocks=NUM_BLOCKS, group_kinds=kinds)
    sc = StepCompiler(block_sizes, MAX_NUM_REQS, MAX_MODEL_LEN, MAX_TOKENS, validate=True, native=native,
                      prompt_embeds=PromptEmbedsConfig(HIDDEN, torch.float32), multimodal=MultiModalConfig(1, PATCH_DIM),
                      **kw)
    oracle = NaiveStepCompiler(block_sizes, MAX_NUM_REQS, MAX_MODEL_LEN, MAX_TOKENS, **kw)
    sched = RandomScheduler(rng, layout, oracle)
    prev = None  # (placeholders, device tokens) of the step before
    for _ in range(STEPS_PER_EXAMPLE):
        so = sched.step()
        sc.update_states(so)
        oracle.update_states(so)
        inp = sc.prepare_inputs(so, prev_token_ids=None if prev is None else prev[1])
        ref = oracle.prepare_inputs(so)
        if prev is not None:  # the previous step's outputs arrive after this step launched
            sc.fill_output_tokens(prev[0], prev[1].tolist())
        compare(sc, oracle, inp, ref)
        keep = [i for i, d in enumerate(ref.discard) if not d and ref.num_tokens[i] < MAX_MODEL_LEN]
        rng.shuffle(keep)
        toks = [rng.randrange(1000) for _ in keep]
        prev = (sc.append_placeholders(np.array(keep, dtype=np.int64)), torch.tensor(toks, dtype=torch.int64))
        oracle.append_output_tokens([ref.req_ids[i] for i in keep], [[t] for t in toks])
        STEP_COUNT["in_flight"] += 1


def test_zz_enough_random_steps_ran():
    """The issue asks for at least 2,000 random steps per test run."""
    if STEP_COUNT["steps"] == 0:
        import pytest
        pytest.skip("run together with test_random_steps_match_naive_oracle")
    if os.environ.get("ATTNPLUG_MUTATE"):
        import pytest
        pytest.skip("tests/mutate.py runs fewer examples")
    assert STEP_COUNT["steps"] >= 2000, STEP_COUNT
    assert STEP_COUNT["embeds"] >= 500 and STEP_COUNT["images"] >= 500, STEP_COUNT  # the embedding rows ran
    # both planning paths ran often (the compiled one only where it is built)
    assert STEP_COUNT["numpy"] >= 500, STEP_COUNT
    if NATIVE is not None:
        assert STEP_COUNT["native"] >= 300, STEP_COUNT
    assert STEP_COUNT["in_flight"] >= 900, STEP_COUNT
    assert STEP_COUNT["shared"] >= 200 and STEP_COUNT["common_prefix"] >= 20, STEP_COUNT
