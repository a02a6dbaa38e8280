"""``disagg``: prefill/decode disaggregation between two attnplug processes.

The *producer* (``--kv-role producer``, torchrun rank 0) runs each request's prefill only
(``attnplug run`` caps its outputs at one token): in the step whose chunk completes the
prompt, the worker side copies every block holding prompt tokens (the last one may be
partial) out of the caches and sends them as one ``"kv"`` message; when the request
finishes, the scheduler side sends a ``"tokens"`` message with its prompt and the first
sampled token (``disagg_channel.py``: the wire).

The *consumer* (``--kv-role consumer``, rank 1) computes no prompt token: at a request's
admission the scheduler side waits for its ``"tokens"`` message, hands the first token to
the scheduler (:meth:`take_remote_output_tokens`, appended to the request's outputs) and
offers the whole prompt, ``n = prompt_len - local hit``, as an asynchronous load; the
worker side takes the ``"kv"`` message, checks every block (``block_codec.decode_block``:
length, sha256, layout; the block count) and copies them into the request's blocks. Then
the request's first computed token is the producer's first sampled token, a decode step.

Faults (each counted, logged once per kind; the request recomputes its prompt, outputs
unchanged): ``timeout`` (no message within ``timeout_s``), ``mismatch`` (the producer's
prompt differs), ``missing`` (a block absent from the message), ``truncated`` /
``checksum`` / ``layout`` (a block value, ``block_codec.py``).

Settings (``--kv-connector-config``): ``role`` (``producer`` / ``consumer``; default from
the torch.distributed rank: 0 producer, 1 consumer; ``--kv-role`` sets it), ``timeout_s``
(120: how long a consumer waits for a request's prefill). Served: full-attention groups
only (sliding-window and Mamba groups are refused).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from attnplug.core.errors import ConfigError
from attnplug.core.kv_connector import (KVConnectorBase, KVConnectorContext, KVConnectorMetadata,
                                        KVConnectorOutput, KVConnectorRole)
from attnplug.plugins.kv_connectors import disagg_channel
from attnplug.plugins.kv_connectors.block_codec import BlockFault, decode_block, encode_block
from attnplug.plugins.kv_connectors.redis_worker import RedisWorkerSide

logger = logging.getLogger("attnplug.kv_connectors")

_KEYS = {"role", "timeout_s"}


@dataclass
class PrefillSend:
    """Producer: send request ``req_id``'s ``prompt_len`` tokens, in ``block_ids`` (per group,
    the blocks holding prompt tokens, logical order)."""

    req_id: str
    prompt_len: int
    block_ids: list[list[int]]


@dataclass
class PrefillLoad:
    """Consumer: load ``num_tokens`` tokens of ``req_id`` from logical block ``first_block``
    on (the local prefix hit holds the earlier ones) into ``block_ids`` (per group)."""

    req_id: str
    num_tokens: int
    first_block: int
    block_ids: list[list[int]]


@dataclass
class DisaggMetadata(KVConnectorMetadata):
    """A step's sends (producer) or loads (consumer)."""

    sends: list[PrefillSend] = field(default_factory=list)
    loads: list[PrefillLoad] = field(default_factory=list)


def _role(config) -> str:
    role = config.get("role")
    if role is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("--kv-connector", "disagg: give --kv-role producer|consumer, or launch two "
                              "ranks with torchrun (rank 0 prefills, rank 1 decodes)")
        role = "producer" if dist.get_rank() == 0 else "consumer"
    if role not in ("producer", "consumer"):
        raise ConfigError("--kv-role", f"disagg: role {role!r} is not producer or consumer")
    return role


class DisaggConnector(RedisWorkerSide, KVConnectorBase):
    """The ``disagg`` connector (module docstring).

    Raises:
        ConfigError: an unknown setting, a group that is not full attention, no role, or no
            wire (not launched as a pair: ``disagg_channel.install`` was not called).
    """

    name = "disagg"

    def __init__(self, context: KVConnectorContext, role: KVConnectorRole):
        super().__init__(context, role)
        unknown = sorted(set(context.config) - _KEYS)
        if unknown:
            raise ConfigError("--kv-connector-config", f"unknown disagg setting(s) {unknown}; known: {sorted(_KEYS)}")
        for g, grp in enumerate(context.groups):
            if grp.kind != "full_attention" or grp.layout_dims is None:
                raise ConfigError("--kv-connector", f"disagg: cache group {g} ({grp.kind}, backend {grp.backend!r}) "
                                  "is not a full-attention group with a declared kv_cache_layout")
        self.kv_role = _role(context.config)
        self.timeout_s = float(context.config.get("timeout_s", 120.0))
        self.channel = disagg_channel.current(self.kv_role)
        if self.channel is None:
            raise ConfigError("--kv-connector", f"disagg: no {self.kv_role} wire in this process (launch with "
                              "torchrun --nproc-per-node 2 ... attnplug run --kv-connector disagg)")
        self.groups = context.groups
        self.prompt_tokens_computed = 0
        # scheduler side
        self._step = 0
        self._tracked: dict[str, tuple[int, list[list[int]]]] = {}  # producer: prompt_len, blocks
        self._sent: set[str] = set()
        self._first_tokens: dict[str, int] = {}  # consumer: each request's first token, once received
        self._remote_tokens: dict[str, list[int]] = {}
        self._loads: list[PrefillLoad] = []
        self._offered: dict[str, int] = {}
        self._prompt_lens: dict[str, int] = {}
        # worker side (RedisWorkerSide.register_kv_caches fills these)
        self._caches, self._layouts, self._block_dims, self._layer_index = [], [], [], {}
        self._executor = None
        self._pending: dict[str, tuple[PrefillSend, list[list[list[torch.Tensor]]]]] = {}
        self._done = KVConnectorOutput()

    def _fault(self, kind: str, detail: str) -> None:
        if self.record_fault(kind):
            logger.warning("kv connector disagg: %s (%s); the request recomputes; reported once per kind",
                           kind, detail)

    # --- scheduler side -----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Producer: 0. Consumer: wait for the request's prefill; its whole prompt beyond the hit."""
        if self.kv_role == "producer":
            return 0, False
        prompt = list(request.prompt_token_ids)
        self.stats.lookups += 1
        self.stats.query_tokens += max(0, len(prompt) - num_computed_tokens)
        rid = request.req_id
        first = self._first_tokens.get(rid)
        if first is None:  # asked again when its blocks did not fit at the last admission
            msg = self.channel.take("tokens", rid, self.timeout_s)
            if msg is None:
                self._fault("timeout", f"{rid}: no prefill within {self.timeout_s}s")
                return 0, True
            if msg.header.get("prompt_token_ids") != prompt or msg.header.get("first_token") is None:
                self._fault("mismatch", f"{rid}: the producer's prompt or first token differs")
                return 0, True
            first = self._first_tokens[rid] = int(msg.header["first_token"])
        if request.sampling_params.max_tokens <= 1:
            return 0, True
        if not request.output_token_ids:
            self._remote_tokens[rid] = [first]
        elif request.output_token_ids[:1] != [first]:
            return 0, True
        self._offered[rid] = len(prompt)
        return max(0, len(prompt) - num_computed_tokens), True

    def take_remote_output_tokens(self, request: Any) -> list[int]:
        return self._remote_tokens.pop(request.req_id, [])

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[Sequence[int]],
                                 num_external_tokens: int) -> None:
        """Consumer: plan the load into ``block_ids``."""
        prompt_len = self._offered.pop(request.req_id, None)
        if not num_external_tokens or prompt_len is None:
            return
        local = prompt_len - num_external_tokens
        first = local // self.groups[0].block_size
        self.stats.hit_tokens += num_external_tokens
        self._loads.append(PrefillLoad(request.req_id, num_external_tokens, first, [list(b) for b in block_ids]))

    def build_connector_meta(self, scheduler_output: Any) -> DisaggMetadata:
        """This step's loads (consumer) or the sends of prompts the step completes (producer);
        both count the prompt tokens the step computes (``prompt_tokens_computed``)."""
        self._step += 1
        meta = DisaggMetadata(step=self._step, loads=self._loads)
        self._loads = []
        out = scheduler_output
        computed: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            self._tracked[new.req_id] = (len(new.prompt_token_ids), [list(b) for b in new.block_ids])
            computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tr = self._tracked.get(rid)
            if tr is None:
                continue
            blocks = cached.new_block_ids[i]
            if cached.resumed_from_preemption[i]:
                self._tracked[rid] = (tr[0], [list(b) for b in blocks])
            elif blocks is not None:
                for lst, b in zip(tr[1], blocks):
                    lst.extend(b)
            computed[rid] = cached.num_computed_tokens[i]
        for rid, n in out.num_scheduled_tokens.items():
            if rid not in computed or rid not in self._tracked:
                continue
            prompt_len, block_ids = self._tracked[rid]
            c = computed[rid]
            self.prompt_tokens_computed += max(0, min(c + n, prompt_len) - c)
            if self.kv_role == "producer" and c + n >= prompt_len and rid not in self._sent:
                self._sent.add(rid)
                nb = -(-prompt_len // self.groups[0].block_size)
                meta.sends.append(PrefillSend(rid, prompt_len, [b[:nb] for b in block_ids]))
        return meta

    def request_finished(self, request: Any) -> None:
        """Producer: send the request's prompt and first sampled token."""
        rid = request.req_id
        self._tracked.pop(rid, None)
        self._remote_tokens.pop(rid, None)
        self._first_tokens.pop(rid, None)
        self._offered.pop(rid, None)
        if self.kv_role == "producer":
            first = request.output_token_ids[0] if request.output_token_ids else None
            self.channel.send({"kind": "tokens", "req_id": rid, "prompt_token_ids": list(request.prompt_token_ids),
                               "first_token": None if first is None else int(first)})

    # --- worker side --------------------------------------------------------------------
    def start_load_kv(self) -> None:
        """Consumer: take each load's ``"kv"`` message, check it, copy it into the caches."""
        meta = self._meta
        if not isinstance(meta, DisaggMetadata):
            return
        for spec in meta.loads:
            t0 = time.perf_counter_ns()
            msg = self.channel.take("kv", spec.req_id, self.timeout_s)
            try:
                if msg is None:
                    raise BlockFault("timeout", f"{spec.req_id}: no KV within {self.timeout_s}s")
                blocks = self._checked_blocks(spec, msg)
            except BlockFault as exc:
                self._fault(exc.kind, str(exc))
                self._done.failed_recving.add(spec.req_id)
                continue
            self._install_blocks(blocks, spec.num_tokens, t0)
            self._done.finished_recving.add(spec.req_id)

    def _checked_blocks(self, spec: PrefillLoad, msg) -> list[tuple[int, int, list]]:
        """``(group, block id, per-layer parts)`` of every block the load needs; all checked
        before any is copied. Raises BlockFault."""
        got = {(g, i): v for (g, i, _), v in zip(msg.header["blocks"], msg.blocks)}
        prompt_len = int(msg.header["prompt_len"])
        out = []
        for g, grp in enumerate(self.groups):
            for i in range(spec.first_block, -(-prompt_len // grp.block_size)):
                value = got.get((g, i))
                if value is None:
                    raise BlockFault("missing", f"{spec.req_id}: block {i} of group {g} not in the transfer")
                out.append((g, spec.block_ids[g][i], decode_block(self._layouts[g], value)))
        return out

    def save_kv_layer(self, layer_name: str, kv_layer: Any) -> None:
        """Producer: copy this step's prompts' blocks of ``layer_name`` to the CPU."""
        meta = self._meta
        if not isinstance(meta, DisaggMetadata) or not meta.sends or layer_name not in self._layer_index:
            return
        g, j = self._layer_index[layer_name]
        n = len(self._caches[g])
        for spec in meta.sends:
            _, per_block = self._pending.setdefault(spec.req_id, (spec, [[None] * n for _ in self.groups]))
            per_block[g][j] = [[v.to("cpu", copy=True) for v in self._block_view(g, j, b)]
                               for b in spec.block_ids[g]]

    def wait_for_save(self) -> None:
        """Producer: one ``"kv"`` message per request whose prompt the step completed."""
        if not self._pending:
            return
        t0 = time.perf_counter_ns()
        for rid, (spec, per_group) in self._pending.items():
            blocks = []
            for g, layers in enumerate(per_group):
                for i in range(len(spec.block_ids[g])):
                    blocks.append((g, i, encode_block(self._layouts[g], [layer[i] for layer in layers])))
            sent = self.channel.send({"kind": "kv", "req_id": rid, "prompt_len": spec.prompt_len}, blocks)
            self.stats.tokens_saved += spec.prompt_len
            self.stats.bytes_saved += sent
        self._pending = {}
        self.stats.save_time_ns.append(time.perf_counter_ns() - t0)

    def get_finished(self, block: bool = False) -> KVConnectorOutput:
        done, self._done = self._done, KVConnectorOutput()
        return done

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
