"""Build the draft model of ``--speculative draft:k=N,model=...`` and inject its drafter.

The drafter itself (``runner/execute/spec_decode/draft_model.py``) runs a built model; loading
one (preset or HF ``config.json``, backends chosen as for the target) is the commands'
job, so it happens here, once per engine, and the result rides on the
``SpeculativeConfig`` (``drafter=``) into the scheduler's ``SpecScheduler``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from attnplug.core.errors import AttnplugError, ConfigError
from attnplug.runner.execute.spec_decode.drafter import SpeculativeConfig


def attach_draft_model(spec: SpeculativeConfig | None, args, target: torch.nn.Module, device: str,
                       resolve: Callable) -> SpeculativeConfig | None:
    """``spec`` with a ``DraftModelDrafter`` attached when its method is ``draft`` (else as is).

    The draft model gets the run's ``--backend``, ``--block-size``, ``--seed`` (so
    ``model=`` the target's own config gives the target's weights) and ``device``; its
    pool holds ``--max-num-seqs`` requests of ``--max-model-len`` tokens.

    Raises:
        ConfigError: one line naming ``--speculative model=...``: the model cannot be read
            or built, its ``vocab_size`` differs from the target's, or it has Mamba layers.
    """
    if spec is None or spec.method != "draft" or spec.drafter is not None:
        return spec
    from attnplug.runner.commands.model_loading import load_model_for_run
    from attnplug.runner.execute.spec_decode.draft_model import DraftModelDrafter

    origin = f"--speculative model={spec.model}"
    try:
        draft = load_model_for_run(spec.model, backend=args.backend, block_size=args.block_size, seed=args.seed,
                                   resolve=resolve, device=device)
    except AttnplugError as e:  # unreadable config, unknown model type, backend selection
        raise ConfigError(origin, str(e)) from None
    want, got = getattr(target.config, "vocab_size", None), getattr(draft.config, "vocab_size", None)
    if want != got:
        raise ConfigError(origin, f"the draft model's vocab_size is {got}, the target's {want}: "
                                  "a draft model must share the target's vocabulary")
    try:
        drafter = DraftModelDrafter(draft, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                                    max_model_len=args.max_model_len, device=device, seed=args.seed)
    except ConfigError as e:
        raise ConfigError(origin, str(e).removeprefix(f"{e.origin}: ")) from None
    return dataclasses.replace(spec, drafter=drafter)
