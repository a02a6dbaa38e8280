"""Pipeline parallel: one stage's slice of the layers, with the hidden states passed on by
``send``/``recv`` and the logits broadcast from the last stage.

Stage ``s`` of ``pp`` holds layers ``stage_layers(L, pp)[s]`` (contiguous, the first
``L % pp`` stages one more). Every stage runs the same step (its own ``ModelRunner`` on the
broadcast ``SchedulerOutput``: the same request order, positions and attention metadata),
so the token count ``n`` and the sampled rows are known everywhere and no shapes travel:

* stage 0 embeds; a later stage receives ``[n, hidden_size]`` from stage ``s - 1``
  (its tensor-parallel peer: the same ``tp_rank``);
* each stage runs its decoder blocks (attention, or Mamba2 mixers with their state slots)
  over its own caches (``kv_cache_specs`` lists its layers only, so the runner allocates
  caches for them only); rank 0's scheduler allocates for its own stage's cache groups, so
  every stage must form the same groups (:class:`ParallelConfigError` otherwise);
* a stage before the last sends its output on; the last applies the final norm;
* ``compute_logits``: the last stage computes them (all-gathered over its tensor-parallel
  group), then broadcasts them to every rank, and every rank samples the same tokens
  (docs/distributed.md, "Sampling").
"""

from __future__ import annotations

import time
from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn

from attnplug.cache_groups.grouping import group_layers_by_spec
from attnplug.runner.models.layers import lookup_layer, lookup_metadata
from attnplug.runner.parallel.state import ParallelConfigError, ParallelState


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges per stage (the first ``num_layers % pp`` stages one more)."""
    if num_layers < pp:
        raise ParallelConfigError(f"--pipeline-parallel-size {pp} needs at least {pp} layers, "
                                  f"the model has {num_layers}")
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        size = base + (s < extra)
        out.append(range(start, start + size))
        start += size
    return out


class PipelineStageModel(nn.Module):
    """Stage ``state.pp_rank`` of ``model`` (a Llama-family, Gemma3, Bamba or attnplug_hybrid
    model, possibly tensor-parallel): the same interface as the model (``forward``,
    ``compute_logits``, ``kv_cache_specs``, ``layer_names``...), restricted to the stage's
    layers. Decoder block ``i``'s layer (attention, or a Mamba2 mixer with its state cache)
    is ``model.layer_names[i]``: its cache and metadata are looked up under that name.

    The whole model stays built (its other layers unused): simple, and fine for the
    presets; a stage of a large model would build only its layers.
    """

    def __init__(self, model: nn.Module, state: ParallelState):
        super().__init__()
        self.inner, self.state = model, state
        self.layers = stage_layers(len(model.model.layers), state.pp_size)[state.pp_rank]
        self.first, self.last = state.pp_rank == 0, state.pp_rank == state.pp_size - 1
        self.config, self.dtype, self.device = model.config, model.dtype, model.device
        self.full_config = getattr(model, "full_config", model.config)
        self.layer_names = [model.layer_names[i] for i in self.layers]
        self._check_groups()

    def _check_groups(self) -> None:
        """Rank 0's scheduler allocates blocks for *its* stage's cache groups, so every stage
        must group its layers' KV caches exactly as the others do."""
        specs = self.inner.kv_cache_specs(16)
        layers = stage_layers(len(self.inner.model.layers), self.state.pp_size)
        names = self.inner.layer_names
        shapes = [[g.kv_cache_spec for g in group_layers_by_spec({names[i]: specs[names[i]] for i in r})]
                  for r in layers]
        if any(s != shapes[0] for s in shapes):
            kinds = [[spec.kind.value for spec in s] for s in shapes]
            raise ParallelConfigError(f"--pipeline-parallel-size {self.state.pp_size}: the stages' layers form "
                                      f"different cache groups ({kinds}); every stage needs the same groups")

    @property
    def attention_layers(self):
        return {k: v for k, v in self.inner.attention_layers.items() if k in self.layer_names}

    @property
    def mamba_layers(self):
        """The stage's Mamba2 mixers (empty for a model without them)."""
        return {k: v for k, v in getattr(self.inner, "mamba_layers", {}).items() if k in self.layer_names}

    def kv_cache_specs(self, block_size: int):
        """The stage's layers' specs only (so its caches hold them only)."""
        return {k: v for k, v in self.inner.kv_cache_specs(block_size).items() if k in self.layer_names}

    def layer_configs(self, block_size: int):
        return {k: v for k, v in self.inner.layer_configs(block_size).items() if k in self.layer_names}

    def load_hf_state_dict(self, state_dict) -> None:
        self.inner.load_hf_state_dict(state_dict)

    def _timed(self, fn, *args) -> None:
        t0 = time.perf_counter_ns()
        fn(*args)
        self.state.timer.ns += time.perf_counter_ns() - t0
        self.state.timer.calls += 1

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: Mapping[str, object], kv_caches: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """As the model's ``forward``; on a stage before the last the result is the stage's
        output (already sent on), not final hidden states."""
        inner, n = self.inner, input_ids.shape[0]
        if self.first:
            hidden = inner.model.embed_tokens(input_ids)
            scale = getattr(inner, "embed_scale", None)  # Gemma3 scales its embeddings
            hidden = hidden if scale is None else hidden * scale
        else:
            hidden = torch.empty((n, self.full_config.hidden_size), dtype=self.dtype, device=self.device)
            self._timed(dist.recv, hidden, self.state.stage_rank(self.state.pp_rank - 1))
        for i, name in zip(self.layers, self.layer_names):
            hidden = inner.model.layers[i](hidden, positions, lookup_layer(kv_caches, name, "kv_caches"),
                                           lookup_metadata(attn_metadata, name))
        if self.last:  # Bamba's body calls its final norm final_layernorm
            body = inner.model
            return (body.norm if hasattr(body, "norm") else body.final_layernorm)(hidden)
        self._timed(dist.send, hidden.contiguous(), self.state.stage_rank(self.state.pp_rank + 1))
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab_size]`` float32 on every rank: computed on the last
        stage, broadcast from its tensor-parallel rank 0 (global rank ``(pp - 1) * tp``)."""
        src = self.state.stage_rank(self.state.pp_size - 1) - self.state.tp_rank
        if self.last:
            logits = self.inner.compute_logits(hidden_states).contiguous()
        else:
            logits = torch.empty((hidden_states.shape[0], self.full_config.vocab_size), dtype=torch.float32,
                                 device=self.device)
        self._timed(dist.broadcast, logits, src)
        return logits
