"""``attnplug parity --hf-config ... --tensor-parallel-size N`` under torchrun: the same
comparison as one process, with our model sharded over the ranks.

Every rank builds the HF model from the same seed (so every rank holds the same weights),
builds its own rank model (``model_loading.build_with_backends`` under the process group) and
loads its shard of the HF weights (``parity.parity_models``). Rank 0 runs the comparison
(``parity.run_parity``: the scheduler, the HF reference, the result line); the other ranks
serve its steps (``runner/parallel/launch.py``) with engines built from the same options
(``parity_compare.engine_args``). Exit status: rank 0's (0 OK, 1 a mismatch); 2 for sizes
that do not fit the launch or the model, in one line.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Callable

from attnplug.core.errors import AttnplugError

PREFIX = "attnplug parity: "


def _peer_build(cfg_dict: dict, common: dict, parity_models: Callable):
    """A rank > 0's ``build(alone) -> ModelRunner``: its rank model, now, then engines on demand."""
    from attnplug.runner.commands.assemble import build_engine
    from attnplug.runner.commands.parity_compare import DTYPES, PROMPT_LEN_RANGE, engine_args, parity_max_model_len

    _, _, model = parity_models(cfg_dict, common["seed"], DTYPES[common["dtype"]], backend=common["backend"],
                                block_size=common["block_size"], kv_cache_dtype=common["kv_cache_dtype"])
    opts = engine_args(common["num_requests"], max_model_len=parity_max_model_len(
        PROMPT_LEN_RANGE, common["max_tokens"], common["block_size"]), **{k: common[k] for k in (
            "backend", "block_size", "seed", "max_num_batched_tokens", "force_preemption", "async_scheduling",
            "prefix_caching", "speculative", "kv_cache_dtype", "kv_scales")})

    def build(alone: bool):
        return build_engine(opts, alone=alone, model=model, requests=False).engine.runner
    return build


def run(args, cfg_dict: dict, common: dict, *, run_parity: Callable, parity_models: Callable) -> int:
    """This rank's part of a distributed parity run (``args``: the parsed flags, with
    ``tensor_parallel_size``, ``pipeline_parallel_size``, ``dist_broadcast``; ``common``:
    ``run_parity``'s keyword arguments; ``run_parity`` / ``parity_models``: ``parity.py``'s,
    passed in so that this module does not import it back). Returns the exit status."""
    from attnplug.runner.parallel.channel import Channel
    from attnplug.runner.parallel.launch import run_rank
    from attnplug.runner.parallel.state import init_parallel, shutdown

    from attnplug.runner.models import resolve_model_config
    from attnplug.runner.parallel.sharding import check_shardable

    try:  # a model that does not split: one line on every rank, before any process group
        check_shardable(resolve_model_config(cfg_dict), args.tensor_parallel_size)
        state = init_parallel(args.tensor_parallel_size, args.pipeline_parallel_size, "cpu", "parity")
    except AttnplugError as e:
        print(PREFIX + str(e), file=sys.stderr)
        return 2
    try:
        state.channel = Channel(state, args.dist_broadcast)

        def main() -> int:
            res = run_parity(cfg_dict, **common)
            print(json.dumps(dataclasses.asdict(res), indent=1) if args.json else res.line(), flush=True)
            return 0 if res.ok else 1

        try:
            build = _peer_build(cfg_dict, common, parity_models) if state.rank != 0 else None
        except AttnplugError as e:  # every rank refuses alike (e.g. a model that does not split)
            print(PREFIX + str(e), file=sys.stderr)
            return 2
        return run_rank(state, main, build, prefix=PREFIX)
    finally:
        shutdown()


__all__ = ["run"]
