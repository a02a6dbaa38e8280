"""Embed attnplug's step compiler in your own engine (the example of docs/embedding.md).

Your scheduler — here a toy one: first come first served, chunked prefill under a token
budget, greedy — writes each step's ``SchedulerOutput`` by hand; the step compiler turns
it into one flat token stream and per-group attention metadata; a tiny model runs its
attention through the selected backend (``torch_native``); the sampled tokens go back to
the step compiler. Run it: ``python docs/examples/embed_loop.py``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from attnplug import AttentionLayerConfig, BuilderConfig
from attnplug.plugins import select_backend
from attnplug.runner import (CachedRequestData, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                             NewRequestData, SamplingParams, SchedulerOutput, StepCompiler, allocate_kv_caches,
                             kernel_kv_cache_spec, negotiate_kernel_block_sizes)

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_SIZE = 97, 32, 4, 2, 8
LAYERS = ("layers.0.attn", "layers.1.attn")
BLOCK_SIZE, NUM_BLOCKS, MAX_REQS, MAX_LEN = 4, 48, 4, 64   # block size in tokens; block 0 is the null block
SPEC = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
KV_CONFIG = KVCacheConfig(NUM_BLOCKS, (KVCacheGroupSpec(LAYERS, SPEC),))   # one cache group: both layers


def select_attention_backend():
    """The backend class of the (only) cache group, chosen through attnplug's selection."""
    layer = AttentionLayerConfig(num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, block_size=BLOCK_SIZE)
    return select_backend(layer, SPEC.kind, cli_choice="torch_native").backend_cls


class TinyModel(nn.Module):
    """Token + learned position embeddings, attention layers whose attention is the backend's
    impl, an LM head. ``forward`` / ``compute_logits`` are what ``ModelRunner`` calls too."""

    def __init__(self, backend, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.pos = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(MAX_LEN, HIDDEN)
        self.qkv = nn.ModuleList(nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_SIZE) for _ in LAYERS)
        self.proj = nn.ModuleList(nn.Linear(HEADS * HEAD_SIZE, HIDDEN) for _ in LAYERS)
        self.lm_head = nn.Linear(HIDDEN, VOCAB)
        self.impls = [backend.get_impl_cls()(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, KV_HEADS) for _ in LAYERS]

    def forward(self, input_ids, positions, attn_metadata, kv_caches):
        h, n = self.embed(input_ids) + self.pos(positions), input_ids.shape[0]
        for name, qkv, proj, impl in zip(LAYERS, self.qkv, self.proj, self.impls):
            q, k, v = qkv(h).split([HEADS * HEAD_SIZE, KV_HEADS * HEAD_SIZE, KV_HEADS * HEAD_SIZE], dim=-1)
            out = torch.zeros(n, HEADS, HEAD_SIZE)
            impl.forward(None, q.reshape(n, HEADS, HEAD_SIZE), k.reshape(n, KV_HEADS, HEAD_SIZE),
                         v.reshape(n, KV_HEADS, HEAD_SIZE), kv_caches[name], attn_metadata[name], out)
            h = h + proj(out.reshape(n, HEADS * HEAD_SIZE))
        return h

    def compute_logits(self, hidden):
        return self.lm_head(hidden).float()


def generate(prompts: dict[str, list[int]], max_tokens: int, budget: int = 8, seed: int = 0) -> dict[str, list[int]]:
    """Greedy ``max_tokens`` tokens per prompt; ``budget``: most tokens one step computes."""
    # --- once, at start -------------------------------------------------------------------
    backends = [select_attention_backend()]                       # one backend per cache group
    model = TinyModel(backends[0], seed)
    kernel_block_sizes = negotiate_kernel_block_sizes(KV_CONFIG, backends)
    kv_caches = allocate_kv_caches(KV_CONFIG, backends, kernel_block_sizes, "cpu")
    limits = BuilderConfig(max_num_reqs=MAX_REQS, max_num_batched_tokens=budget, max_model_len=MAX_LEN)
    builders = [b.get_builder_cls()(kernel_kv_cache_spec(g.kv_cache_spec, k), list(g.layer_names), limits, "cpu")
                for g, b, k in zip(KV_CONFIG.groups, backends, kernel_block_sizes)]
    compiler = StepCompiler(KV_CONFIG, MAX_REQS, MAX_LEN, budget, kernel_block_sizes=kernel_block_sizes)
    # --- your scheduler's state -------------------------------------------------------------
    tokens = {rid: list(p) for rid, p in prompts.items()}          # prompt + outputs so far
    computed = dict.fromkeys(prompts, 0)                            # tokens whose K/V is cached
    blocks: dict[str, list[int]] = {}                              # block ids of resident requests
    free = list(range(NUM_BLOCKS - 1, 0, -1))
    outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
    done: set[str] = set()
    finished: set[str] = set()                                      # tell the compiler next step
    while True:
        new, cached, num_scheduled, left = [], CachedRequestData(), {}, budget
        for rid, prompt in prompts.items():
            if rid in done or left == 0 or len(num_scheduled) == MAX_REQS:
                continue
            n = min(len(tokens[rid]) - computed[rid], left)
            left -= n
            fresh = [free.pop() for _ in range(-(-(computed[rid] + n) // BLOCK_SIZE) - len(blocks.get(rid, ())))]
            if rid not in blocks:                                    # first schedule: the full start state
                blocks[rid] = fresh
                new.append(NewRequestData(rid, list(prompt), (fresh,), 0, SamplingParams(max_tokens=max_tokens)))
            else:                                                    # resident: only what changed
                blocks[rid] += fresh
                cached.req_ids.append(rid)
                cached.resumed_from_preemption.append(False)
                cached.new_token_ids.append([])                      # the compiler holds our samples
                cached.new_block_ids.append((fresh,) if fresh else None)
                cached.num_computed_tokens.append(computed[rid])
            num_scheduled[rid] = n
        out = SchedulerOutput(new, cached, num_scheduled, sum(num_scheduled.values()), finished)
        compiler.update_states(out)                                  # check, then apply
        finished = set()
        if not num_scheduled:
            return outputs                                           # all done and forgotten
        inputs = compiler.prepare_inputs(out)                        # views, valid until the next step
        attn_metadata = {}
        for group, builder, common in zip(KV_CONFIG.groups, builders, inputs.common_attn_metadata):
            attn_metadata.update(dict.fromkeys(group.layer_names, builder.build(0, common)))
        with torch.inference_mode():
            hidden = model(inputs.input_ids, inputs.positions, attn_metadata, kv_caches)
            keep = np.flatnonzero(~inputs.discard)                   # partial prefills sample nothing
            sampled = model.compute_logits(hidden[inputs.logits_indices[keep]]).argmax(dim=-1).tolist()
        rids = [inputs.req_ids[i] for i in keep]
        compiler.append_output_tokens(rids, sampled)
        for rid, n in num_scheduled.items():
            computed[rid] += n
        for rid, tok in zip(rids, sampled):
            tokens[rid].append(tok)
            outputs[rid].append(tok)
            if len(outputs[rid]) == max_tokens:                      # finished: free its blocks
                done.add(rid)
                finished.add(rid)
                free += blocks.pop(rid)


if __name__ == "__main__":
    print(generate({"a": [5, 17, 3, 9, 40, 2, 11, 8, 1, 60, 33], "b": [7, 7, 7, 1, 2], "c": [90, 4, 4]}, 6))
