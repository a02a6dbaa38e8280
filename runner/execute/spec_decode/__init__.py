"""Speculative decoding: drafters, the verification layout, and the rejection sampler.

What is here (usable on its own, tested in ``tests/runner/test_spec_decode.py``):

* ``drafter.py``: the ``Drafter`` interface (``propose(token_histories, k)``), the n-gram /
  prompt-lookup drafter ``NgramDrafter``, and ``parse_speculative`` for ``ngram:k=3[,n=,min_n=]``.
* ``metadata.py``: ``SpecDecodeMetadata`` (``num_draft_tokens``, ``cu_num_draft_tokens``,
  ``target_logits_indices``, ``bonus_logits_indices``, ``logits_indices``,
  ``draft_token_ids``, as vLLM names them) and ``build_spec_decode_metadata``.
* ``rejection_sampler.py``: ``RejectionSampler`` (greedy, and the accept/reject rule of
  Leviathan et al. 2023 / Chen et al. 2023 with per-request generators).

How the rest of a step will plug in (not done yet; those modules have other owners):

1. **Scheduler** (``runner/serve/scheduler.py``): asks the drafter for up to ``k`` drafts per
   decoding request (capped by the token budget and ``max_model_len``), schedules
   ``1 + len(drafts)`` tokens for it, allocates blocks for that optimistic length, and sends
   the drafts in ``SchedulerOutput.scheduled_spec_decode_tokens`` (``{req_id: [ids]}``).
2. **Step compiler** (``runner/step/``): ``InputBatch`` writes each row's drafts after its
   last real token (``spec_token_ids``), so the row's query is ``1 + d`` tokens long with
   positions, slot mapping and ``seq_lens`` for every draft. ``runner/step`` may not import
   ``runner/execute`` (docs/architecture.md, Layers), so either the model runner calls
   ``build_spec_decode_metadata(query_start_loc, num_draft_tokens, input_ids=...)`` right
   after ``prepare_inputs``, or ``metadata.py`` (it imports only numpy and torch) moves into
   ``runner/step`` for ``prepare_inputs`` to call; either way its ``logits_indices`` replace
   the one-per-row ones.
3. **Model runner** (``runner/execute/model_runner.py``): computes logits at
   ``metadata.logits_indices`` and hands them to ``RejectionSampler`` instead of ``Sampler``
   (rows with ``d = 0`` sample exactly as ``Sampler`` would); rows whose logits are discarded
   (partial prefill) must carry no drafts.
4. **Rollback**: request ``i`` emitted ``num_accepted[i] + 1`` tokens; its
   ``num_computed_tokens`` advances by ``num_accepted[i] + 1`` (not ``1 + d_i``), the token
   history keeps only those, ``seq_lens`` / block tables shrink to the accepted length, and the
   K/V written at rejected draft positions is dead: the next step's slots overwrite it, and no
   query may read past the accepted length.
"""

from attnplug.runner.execute.spec_decode.drafter import (
    Drafter, NgramDrafter, SpeculativeConfig, parse_speculative)
from attnplug.runner.execute.spec_decode.metadata import SpecDecodeMetadata, build_spec_decode_metadata
from attnplug.runner.execute.spec_decode.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID, RejectionOutput, RejectionSampler, target_probs)

__all__ = [
    "Drafter", "NgramDrafter", "SpeculativeConfig", "parse_speculative",
    "SpecDecodeMetadata", "build_spec_decode_metadata",
    "PLACEHOLDER_TOKEN_ID", "RejectionOutput", "RejectionSampler", "target_probs",
]
