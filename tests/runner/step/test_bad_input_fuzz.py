"""Malformed scheduler outputs between valid steps, on both paths (issue 21's categories).

A small world (full attention, a sliding window of known width, a Mamba state group)
runs random valid steps; before each valid step every applicable corruption of it is
sent first. Each must raise ``InvalidSchedulerOutput`` naming the expected request and
field, leave the state byte-identical (``snapshot_diff``), and the valid step must then
apply and pass ``validate``. ``MALFORMED`` counts what was sent: at least 5,000 per path.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.core.errors import InvalidSchedulerOutput
from attnplug.runner.step.compiler import StepCompiler, snapshot_diff
from attnplug.runner.step.fast import NATIVE
from attnplug.runner.step.mrope import PlaceholderRange
from attnplug.runner.step.multimodal import MultiModalConfig, image_feature
from attnplug.runner.step.prompt_embeds import PromptEmbedsConfig
from attnplug.runner.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

B, W, MAX_LEN, MAX_REQS, BUDGET = 4, 6, 64, 4, 24
HIDDEN = 8  # prompt embeddings: some new requests carry [len(prompt), HIDDEN] float32
PATCH_DIM = 24  # images: some new requests carry one (runner/step/multimodal.py)
SIZES = [B, B, MAX_LEN]
KINDS = ["full_attention", "sliding_window", "mamba"]
STEPS, EXAMPLES = 12, 10 if os.environ.get("ATTNPLUG_MUTATE") else 50  # fewer per mutant (tests/mutate.py)
MALFORMED = {True: 0, False: 0}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class World:
    """Valid steps for the compiler, from a model of what it holds."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.next_block = [1, 1, 1]
        self.reqs: dict[str, dict] = {}  # rid -> held, ncc, blocks (per group)
        self.next_id = 0

    def alloc(self, g: int, n: int) -> list[int]:
        out = list(range(self.next_block[g], self.next_block[g] + n))
        self.next_block[g] += n
        return out

    def step(self) -> SchedulerOutput:
        rng = self.rng
        finished = set()
        if self.reqs and rng.random() < 0.2:
            rid = rng.choice(sorted(self.reqs))
            finished.add(rid)
            del self.reqs[rid]
        budget, sched, cached = BUDGET, {}, CachedRequestData()
        for rid, r in self.reqs.items():
            n = min(r["held"] - r["ncc"], budget)
            if n < 1:
                continue
            seq = r["ncc"] + n
            need = [max(0, cdiv(seq, B) - len(r["blocks"][0])), max(0, cdiv(seq, B) - len(r["blocks"][1])), 0]
            new = None
            if any(need):
                new = tuple(self.alloc(g, k) for g, k in enumerate(need))
                for g in range(3):
                    r["blocks"][g] += new[g]
            cached.req_ids.append(rid)
            cached.resumed_from_preemption.append(False)
            cached.new_token_ids.append([])
            cached.new_block_ids.append(new)
            cached.num_computed_tokens.append(r["ncc"])
            sched[rid] = n
            r["sched"] = n
            budget -= n
        new_reqs = []
        if len(self.reqs) < MAX_REQS and budget >= 3 and rng.random() < 0.6:
            rid = f"r{self.next_id}"
            self.next_id += 1
            prompt = [rng.randrange(2, 1000) for _ in range(rng.randint(3, 14))]
            ncc = rng.choice([0, 0, len(prompt) // 2 // B * B])
            n = min(len(prompt) - ncc, budget)
            seq = ncc + n
            full = self.alloc(0, cdiv(seq, B))
            window = self.alloc(1, cdiv(seq, B))
            for i in range(max(0, ncc - W + 1) // B):  # the skipped prefix may be null
                if rng.random() < 0.5:
                    window[i] = NULL_BLOCK_ID
            blocks = (full, window, self.alloc(2, 1))
            embeds = torch.randn(len(prompt), HIDDEN) if rng.random() < 0.3 else None
            images = None  # an image of 2 placeholder tokens at position 1 (patch grid 2 x 4, merge 2)
            if embeds is None and len(prompt) >= 4 and rng.random() < 0.4:
                images = [image_feature(torch.randn(8, PATCH_DIM), (1, 2, 4), 1, 2)]
            new_reqs.append(NewRequestData(rid, prompt, blocks, ncc, prompt_embeds=embeds, mm_features=images))
            sched[rid] = n
            self.reqs[rid] = dict(held=len(prompt), ncc=ncc, blocks=[list(b) for b in blocks], sched=n)
        return SchedulerOutput(new_reqs, cached, sched, finished_req_ids=finished)

    def after(self, sc: StepCompiler, inputs) -> None:
        """The step ran: append a token to every row whose logits are kept."""
        keep = [i for i, d in enumerate(inputs.discard) if not d]
        rows = [i for i in keep if self.reqs[inputs.req_ids[i]]["held"] < MAX_LEN - 2]
        for rid in inputs.req_ids:
            self.reqs[rid]["ncc"] += self.reqs[rid]["sched"]
        if rows:
            sc.append_output_tokens(rows, [7] * len(rows))
            for i in rows:
                self.reqs[inputs.req_ids[i]]["held"] += 1
        for rid in [r for r, v in self.reqs.items() if v["held"] >= MAX_LEN - 2 and v["ncc"] >= v["held"]]:
            self.reqs[rid]["held"] = self.reqs[rid]["ncc"]  # done: stays unscheduled until finished


def corruptions(so: SchedulerOutput):
    """``(name, expected (req_id, field), corrupt(copy))`` for every category that applies."""
    c = so.scheduled_cached_reqs
    out = [
        ("finished None", (None, "finished_req_ids"), lambda s: setattr(s, "finished_req_ids", None)),
        ("new None", (None, "scheduled_new_reqs"), lambda s: setattr(s, "scheduled_new_reqs", None)),
        ("cached None", (None, "scheduled_cached_reqs"), lambda s: setattr(s, "scheduled_cached_reqs", None)),
        ("cached ids None", (None, "scheduled_cached_reqs.req_ids"),
         lambda s: setattr(s.scheduled_cached_reqs, "req_ids", None)),
        ("dict request", (None, "scheduled_new_reqs"),
         lambda s: s.scheduled_new_reqs.append({"req_id": "x", "prompt_token_ids": [1]})),
        ("unhashable finished id", (None, "finished_req_ids"), lambda s: setattr(s, "finished_req_ids", [["a"]])),
        ("nst not a dict", (None, "num_scheduled_tokens"),
         lambda s: setattr(s, "num_scheduled_tokens", list(s.num_scheduled_tokens.items()))),
    ]
    if c.req_ids:
        cr = c.req_ids[0]
        out += [
            ("resume flag 'False'", (cr, "resumed_from_preemption"),
             lambda s: s.scheduled_cached_reqs.resumed_from_preemption.__setitem__(0, "False")),
            ("resume flag [True]", (cr, "resumed_from_preemption"),
             lambda s: s.scheduled_cached_reqs.resumed_from_preemption.__setitem__(0, [True])),
            ("resume flag 2", (cr, "resumed_from_preemption"),
             lambda s: s.scheduled_cached_reqs.resumed_from_preemption.__setitem__(0, 2)),
            ("resume flag array", (cr, "resumed_from_preemption"),
             lambda s: s.scheduled_cached_reqs.resumed_from_preemption.__setitem__(0, np.array([True]))),
            ("computed True", (cr, "num_computed_tokens"),
             lambda s: s.scheduled_cached_reqs.num_computed_tokens.__setitem__(0, True)),
            ("computed 1.0", (cr, "num_computed_tokens"),
             lambda s: s.scheduled_cached_reqs.num_computed_tokens.__setitem__(0, 1.0)),
            ("token 0-d", (cr, "new_token_ids"),
             lambda s: s.scheduled_cached_reqs.new_token_ids.__setitem__(0, np.array(5))),
            ("token bool", (cr, "new_token_ids"),
             lambda s: s.scheduled_cached_reqs.new_token_ids.__setitem__(0, [True])),
        ]
        for bad in ("3", b"3", 3.7, True, None, 1 + 2j):
            out.append((f"block id {bad!r}", (cr, "new_block_ids"),
                        lambda s, bad=bad: s.scheduled_cached_reqs.new_block_ids.__setitem__(0, ([bad], [], []))))
        for arr in (np.array([3.0]), np.array(["3"]), np.array([1 + 0j]), np.array([True]), np.array(3)):
            out.append((f"block array {arr.dtype}", (cr, "new_block_ids"),
                        lambda s, arr=arr: s.scheduled_cached_reqs.new_block_ids.__setitem__(0, (arr, [], []))))
        if so.num_scheduled_tokens[cr] == 1:
            out.append(("count True", (cr, "num_scheduled_tokens"),
                        lambda s: s.num_scheduled_tokens.__setitem__(cr, True)))
        out.append(("count 1.0", (cr, "num_scheduled_tokens"),
                    lambda s: s.num_scheduled_tokens.__setitem__(cr, float(s.num_scheduled_tokens[cr]))))
    if so.scheduled_new_reqs:
        nr = so.scheduled_new_reqs[0]
        rid = nr.req_id
        out += [
            ("prompt 0-d", (rid, "prompt_token_ids"),
             lambda s: setattr(s.scheduled_new_reqs[0], "prompt_token_ids", np.array(5))),
            ("prompt bool", (rid, "prompt_token_ids"),
             lambda s: s.scheduled_new_reqs[0].prompt_token_ids.__setitem__(0, True)),
            ("prompt str", (rid, "prompt_token_ids"),
             lambda s: s.scheduled_new_reqs[0].prompt_token_ids.__setitem__(0, "5")),
            ("blocks 0-d", (rid, "block_ids"),
             lambda s: setattr(s.scheduled_new_reqs[0], "block_ids", (np.array(5), [], []))),
            ("block id 3.7", (rid, "block_ids"),
             lambda s: s.scheduled_new_reqs[0].block_ids[0].__setitem__(0, 3.7)),
            ("block id True", (rid, "block_ids"),
             lambda s: s.scheduled_new_reqs[0].block_ids[0].__setitem__(0, True)),
            ("no state slot", (rid, "block_ids"),
             lambda s: s.scheduled_new_reqs[0].block_ids[2].clear()),
            ("id not str", (None, "scheduled_new_reqs"), lambda s: setattr(s.scheduled_new_reqs[0], "req_id", 5)),
            ("computed True", (rid, "num_computed_tokens"),
             lambda s: setattr(s.scheduled_new_reqs[0], "num_computed_tokens", True)),
            ("embeds width", (rid, "prompt_embeds"),
             lambda s: setattr(s.scheduled_new_reqs[0], "prompt_embeds", torch.zeros(len(nr.prompt_token_ids), 7))),
            ("embeds length", (rid, "prompt_embeds"),
             lambda s: setattr(s.scheduled_new_reqs[0], "prompt_embeds", torch.zeros(1 + len(nr.prompt_token_ids), 8))),
            ("embeds dtype", (rid, "prompt_embeds"), lambda s: setattr(
                s.scheduled_new_reqs[0], "prompt_embeds", torch.zeros(len(nr.prompt_token_ids), 8, dtype=torch.float16))),
            ("embeds list", (rid, "prompt_embeds"),
             lambda s: setattr(s.scheduled_new_reqs[0], "prompt_embeds", [[0.0] * 8] * len(nr.prompt_token_ids))),
            ("embeds nan", (rid, "prompt_embeds"), lambda s: setattr(
                s.scheduled_new_reqs[0], "prompt_embeds", torch.full((len(nr.prompt_token_ids), 8), float("nan")))),
        ]
        if nr.mm_features:
            out += image_corruptions(nr)
        seq = nr.num_computed_tokens + so.num_scheduled_tokens[rid]
        visible = max(0, nr.num_computed_tokens - W + 1) // B  # first block a query sees
        if visible < cdiv(seq, B):
            out.append(("null block in the window", (rid, "block_ids"),
                        lambda s: s.scheduled_new_reqs[0].block_ids[1].__setitem__(visible, NULL_BLOCK_ID)))
    return out


def image_corruptions(nr: NewRequestData):
    """Bad images of a new request that carries one: each names the request and ``mm_features``."""
    rid, L, (f,) = nr.req_id, len(nr.prompt_token_ids), nr.mm_features
    where = (rid, "mm_features")

    def feature(**kw):
        return lambda s: setattr(s.scheduled_new_reqs[0], "mm_features", [dataclasses.replace(f, **kw)])
    return [
        ("image grid vs placeholders", where, feature(image_grid_thw=(1, 4, 4), pixel_values=torch.zeros(16, PATCH_DIM))),
        ("image span outside the prompt", where, feature(mm_position=PlaceholderRange(L - 1, (1, 1, 2)))),
        ("image span at a negative offset", where, feature(mm_position=PlaceholderRange(-1, (1, 1, 2)))),
        ("image pixels shape", where, feature(pixel_values=torch.zeros(8, PATCH_DIM + 1))),
        ("image grid not mergeable", where, feature(image_grid_thw=(1, 3, 4))),
        ("image pixels nan", where, feature(pixel_values=torch.full((8, PATCH_DIM), float("nan")))),
        ("image hash empty", where, feature(mm_hash="")),
        ("image not a feature", where, lambda s: setattr(s.scheduled_new_reqs[0], "mm_features", [{"offset": 1}])),
        ("image and placeholders", where,
         lambda s: setattr(s.scheduled_new_reqs[0], "mm_placeholders", [f.mm_position])),
    ]


@pytest.mark.parametrize("native", [True, False])
def test_malformed_outputs_between_valid_steps(native):
    if native and NATIVE is None:
        pytest.skip("the compiled fast paths are not built")
    MALFORMED[native] = 0

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(seed=st.integers(0, 2**32 - 1))
    def run(seed):
        rng = random.Random(seed)
        sc = StepCompiler(SIZES, MAX_REQS, MAX_LEN, BUDGET, num_blocks=2000, group_kinds=KINDS,
                          sliding_windows=[None, W, None], validate=True, native=native,
                          prompt_embeds=PromptEmbedsConfig(HIDDEN, torch.float32), uses_mrope=True,
                          multimodal=MultiModalConfig(2, PATCH_DIM))
        world = World(rng)
        for _ in range(STEPS):
            so = world.step()
            before = sc.snapshot()
            for name, expected, corrupt in corruptions(so):
                bad = copy.deepcopy(so)
                corrupt(bad)
                with pytest.raises(InvalidSchedulerOutput) as info:
                    sc.update_states(bad)
                assert (info.value.req_id, info.value.field) == expected, (name, str(info.value))
                assert not snapshot_diff(sc.snapshot(), before), name
                MALFORMED[native] += 1
            sc.update_states(so)  # the valid step still applies ...
            world.after(sc, sc.prepare_inputs(so))  # ... and passes validate (validate=True)

    run()
    assert MALFORMED[native] >= (600 if os.environ.get("ATTNPLUG_MUTATE") else 5000), MALFORMED


@pytest.mark.parametrize("native", [True, False])
def test_a_request_whose_id_changes_between_reads_is_read_once(native):
    """Category 5: the id is read once, so the request is validated and admitted under one id."""
    if native and NATIVE is None:
        pytest.skip("the compiled fast paths are not built")

    class Shifty(NewRequestData):
        reads = 0

        @property
        def req_id(self):
            Shifty.reads += 1
            return f"s{Shifty.reads}"

        @req_id.setter
        def req_id(self, value):
            pass

    sc = StepCompiler(SIZES, MAX_REQS, MAX_LEN, BUDGET, num_blocks=50, group_kinds=KINDS,
                      sliding_windows=[None, W, None], validate=True, native=native)
    Shifty.reads = 0
    req = Shifty("ignored", [5, 6, 7], ([1], [1], [1]))
    sc.update_states(SchedulerOutput([req], CachedRequestData(), {"s1": 3}))
    sc.prepare_inputs()
    assert list(sc.requests) == ["s1"] and sc.input_batch.req_ids == ["s1"]


@pytest.mark.parametrize("native", [True, False])
def test_the_callers_prompt_list_is_not_kept(native):
    """Category 8: mutating the prompt list after update_states changes nothing."""
    if native and NATIVE is None:
        pytest.skip("the compiled fast paths are not built")
    sc = StepCompiler(SIZES, MAX_REQS, MAX_LEN, BUDGET, num_blocks=50, group_kinds=KINDS,
                      sliding_windows=[None, W, None], validate=True, native=native)
    prompt = [5, 6, 7]
    sc.update_states(SchedulerOutput([NewRequestData("a", prompt, ([1], [1], [1]))], CachedRequestData(),
                                     {"a": 3}))
    prompt[:] = [9, 9, 9, 9]
    assert sc.requests["a"].prompt_token_ids == [5, 6, 7]
    sc.prepare_inputs()  # validate: invariant 2 sees the runner's own copy
    assert sc.requests["a"].all_token_ids == [5, 6, 7]
