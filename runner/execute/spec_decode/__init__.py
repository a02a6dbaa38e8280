"""Speculative decoding: drafters, the verification layout, and the rejection sampler.

What is here (usable on its own, tested in ``tests/runner/step/test_spec_decode.py``):

* ``drafter.py``: the ``Drafter`` interface (``propose(token_histories, k)``), the n-gram /
  prompt-lookup drafter ``NgramDrafter``, and ``parse_speculative`` for ``ngram:k=3[,n=,min_n=]``
  and ``draft:k=3,model=...``.
* ``draft_model.py``: ``DraftModelDrafter``, greedy drafts from a second model run through its
  own ``ModelRunner`` (not imported here: it imports the model runner).
* ``metadata.py`` (re-exports ``runner/step/spec_metadata.py``): ``SpecDecodeMetadata``
  (``num_draft_tokens``, ``cu_num_draft_tokens``,
  ``target_logits_indices``, ``bonus_logits_indices``, ``logits_indices``,
  ``draft_token_ids``, as vLLM names them) and ``build_spec_decode_metadata``.
* ``rejection_sampler.py``: ``RejectionSampler`` (greedy, and the accept/reject rule of
  Leviathan et al. 2023 / Chen et al. 2023 with per-request generators).

How a step uses them (docs/speculative-decoding.md):

1. **Scheduler** (``runner/serve/spec_schedule.py``, hooks in ``scheduler.py``): drafts per
   decoding request, ``1 + d`` scheduled tokens, ``scheduled_spec_decode_tokens``; rollback
   of ``num_computed_tokens`` by the rejected count after the step.
2. **Step compiler** (``runner/step/check/spec.py``, ``spec_apply.py``, ``spec_metadata.py``):
   drafts after each row's tokens, ``StepInputs.spec_decode_metadata``,
   ``StepCompiler.append_verified_tokens``.
3. **Model runner** (``verify.py``): logits at ``metadata.logits_indices`` and the
   ``RejectionSampler`` instead of ``Sampler``.
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
