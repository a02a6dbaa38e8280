"""``redis``: a KV connector that offloads prefix blocks to a Redis server (a real store shared
by processes), with a local CPU-memory tier.

Scheduler side: at admission, the blocks after the local prefix hit are looked up by their
chain-hash keys (``redis_plan.py``; one pipelined ``EXISTS`` round trip); the hit loads
asynchronously (the request waits, blocks allocated, while other requests compute). Each
step, every prompt block that became full and computed is saved (once per key per process).

Worker side: a load fetches the request's values on a background thread (CPU tier first,
then one ``MGET``), checks each (``block_codec.py``: length, sha256, layout) and, when every
block is good, copies them into the caches at the step's end; then the scheduler admits the
request from the hit. Any fault (server unreachable, a value missing, truncated, corrupted
or of another layout) fails the whole load: the request recomputes from its local hit. A
save copies the step's full blocks out of the caches after the forward and writes them to
the tier and the server before the step returns.

Settings (``--kv-connector-config``): ``url`` (``redis://127.0.0.1:6379/0``), ``namespace``
(default: the model's identity), ``prefix`` (``attnplug:kv``), ``cpu_bytes`` (CPU tier
capacity, 64 MiB; 0 disables it), ``timeout_s`` (1.0), ``save`` / ``load`` (both true).
Mamba (state) groups: a value is the state slot after a multiple of the Mamba block size
``Bm`` (the group's ``block_size`` in the context), saved when a step's chunk ends there (the
scheduler cuts chunks at those multiples with prefix caching on) and loaded into the
request's own slot. Not served: attention backends without a declared ``kv_cache_layout``.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from attnplug.core.constants import NULL_BLOCK_ID
from attnplug.core.errors import ConfigError
from attnplug.core.kv_connector import KVConnectorBase, KVConnectorContext, KVConnectorRole
from attnplug.plugins.kv_connectors.redis_meta import LoadSpec, RedisConnectorMetadata, SaveSpec
from attnplug.plugins.kv_connectors.redis_plan import KeyChains, longest_hit, needed_blocks
from attnplug.plugins.kv_connectors.redis_worker import RedisWorkerSide
from attnplug.plugins.kv_connectors.store import BlockStore, StoreUnavailable

logger = logging.getLogger("attnplug.kv_connectors")

_DEFAULTS = {"url": "redis://127.0.0.1:6379/0", "namespace": None, "prefix": "attnplug:kv",
             "cpu_bytes": 64 << 20, "timeout_s": 1.0, "save": True, "load": True}
_URL_SCHEMES = ("redis://", "rediss://", "unix://")  # the schemes redis-py's from_url accepts
_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


@dataclass
class _Tracked:
    """Scheduler side: a running request's prompt keys, block lists and saved prefix."""

    keys: list[list[str]]
    block_ids: list[list[int]]
    saved: list[int]
    prompt_len: int


def parse_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The connector's settings with defaults.

    Raises:
        ConfigError: an unknown key, a value of the wrong type, a negative ``cpu_bytes``, a
            ``timeout_s`` <= 0, a ``url`` not ``redis://``, ``rediss://`` or ``unix://``, or a
            ``save``/``load`` that is not a boolean (origin ``--kv-connector-config``).
    """
    unknown = sorted(set(config) - set(_DEFAULTS))
    if unknown:
        raise ConfigError("--kv-connector-config", f"unknown redis connector setting(s) {unknown}; "
                          f"known: {sorted(_DEFAULTS)}")
    out = {**_DEFAULTS, **config}
    try:
        out["cpu_bytes"] = int(out["cpu_bytes"])
        out["timeout_s"] = float(out["timeout_s"])
    except (TypeError, ValueError):
        raise ConfigError("--kv-connector-config", "cpu_bytes must be an int and timeout_s a number") from None
    if out["cpu_bytes"] < 0 or not out["timeout_s"] > 0:
        raise ConfigError("--kv-connector-config", f"cpu_bytes must be >= 0 (got {out['cpu_bytes']}) and "
                          f"timeout_s > 0 (got {out['timeout_s']})")
    if not isinstance(out["url"], str) or not out["url"].startswith(_URL_SCHEMES):
        raise ConfigError("--kv-connector-config", f"url {out['url']!r} must start with one of {list(_URL_SCHEMES)}")
    for k in ("save", "load"):
        value = out[k]
        if isinstance(value, str) and value.lower() in _BOOL_WORDS:
            out[k] = _BOOL_WORDS[value.lower()]
        elif isinstance(value, bool) or value in (0, 1):
            out[k] = bool(value)
        else:
            raise ConfigError("--kv-connector-config", f"{k} must be true or false (got {value!r})")
    return out


class RedisConnector(RedisWorkerSide, KVConnectorBase):
    """The ``redis`` offload connector (module docstring).

    Raises:
        ConfigError: a Mamba group, a group whose backend declares no KV layout, or a bad setting.
    """

    name = "redis"

    def __init__(self, context: KVConnectorContext, role: KVConnectorRole):
        super().__init__(context, role)
        self.settings = parse_settings(context.config)
        for g, grp in enumerate(context.groups):
            if grp.kind not in ("full_attention", "sliding_window", "mamba"):
                raise ConfigError("--kv-connector", f"redis: cache group {g} is a {grp.kind} group; the redis "
                                  "connector moves full-attention, sliding-window and Mamba groups only")
            if grp.layout_dims is None and grp.kind != "mamba":
                raise ConfigError("--kv-connector", f"redis: cache group {g}'s backend {grp.backend!r} declares "
                                  "no kv_cache_layout, so its blocks have no known position in the cache")
        self.groups = context.groups
        namespace = self.settings["namespace"] or context.model_id
        self.chains = KeyChains(self.settings["prefix"], namespace, self.groups)
        self.store = BlockStore(self.settings["url"], self.settings["timeout_s"],
                                self.settings["cpu_bytes"] if role is KVConnectorRole.WORKER else 0)
        # scheduler side
        self._lookups: dict[str, tuple[int, int, list[list[str]]]] = {}
        self._loads: list[LoadSpec] = []
        self._tracked: dict[str, _Tracked] = {}
        self._known: set[str] = set()
        self._step = 0
        # worker side
        self._caches: list[list[tuple[str, torch.Tensor]]] = []
        self._layouts: list[BlockLayout] = []
        self._block_dims: list[int] = []
        self._layer_index: dict[str, tuple[int, int]] = {}
        self._executor: cf.ThreadPoolExecutor | None = None
        self._inflight: dict[str, tuple[cf.Future, LoadSpec, int]] = {}
        self._pending_saves: dict[str, tuple[SaveSpec, list[torch.Tensor | None]]] = {}
        self._lock = threading.Lock()

    def _fault(self, kind: str, detail: str) -> None:
        with self._lock:
            first = self.record_fault(kind)
        if first:
            logger.warning("kv connector redis: %s (%s); the request recomputes; reported once per kind",
                           kind, detail)

    # --- scheduler side -----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens after ``num_computed_tokens`` whose blocks the server holds (always asynchronous)."""
        if not self.settings["load"] or getattr(request, "prompt_embeds", None) is not None:
            return 0, True
        tokens = request.all_token_ids
        max_tokens = len(tokens) - 1
        self.stats.lookups += 1
        self.stats.query_tokens += max(0, max_tokens - num_computed_tokens)
        keys = self.chains.keys(tokens)
        # every block from the local hit to the last full one (a hit stops one token short, and
        # a window's shorter hits need earlier blocks; the tail block is asked for so that a
        # process never saves again what the store already holds)
        wanted = [(g, i) for g, grp in enumerate(self.groups)
                  for i in range(num_computed_tokens // grp.block_size, len(tokens) // grp.block_size)]
        if not wanted:
            return 0, True
        try:
            found = self.store.exists([keys[g][i] for g, i in wanted])
        except StoreUnavailable as exc:
            self._fault("store_unavailable", str(exc))
            return 0, True
        present = dict(zip(wanted, found))
        self._known.update(keys[g][i] for (g, i), ok in present.items() if ok)  # never saved again
        h = longest_hit(self.groups, num_computed_tokens, max_tokens, present)
        if h <= num_computed_tokens:
            return 0, True
        self._lookups[request.req_id] = (num_computed_tokens, h, keys)
        return h - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[Sequence[int]],
                                 num_external_tokens: int) -> None:
        """Plan the load of the looked-up blocks into ``block_ids`` (per group, whole lists)."""
        found = self._lookups.pop(request.req_id, None)
        if not num_external_tokens or found is None:
            return
        local, h, keys = found
        if local + num_external_tokens != h:
            raise ValueError(f"{request.req_id}: allocated for {num_external_tokens} tokens, looked up {h - local}")
        blocks = [(g, block_ids[g][0] if grp.kind == "mamba" else block_ids[g][i], keys[g][i])
                  for g, grp in enumerate(self.groups) for i in needed_blocks(grp, local, h)]
        self._known.update(k for _, _, k in blocks)
        self.stats.hit_tokens += num_external_tokens  # counted once the load is planned (not per retry)
        self._loads.append(LoadSpec(request.req_id, num_external_tokens, blocks))

    def build_connector_meta(self, scheduler_output: Any) -> RedisConnectorMetadata:
        """This step's loads, and the saves of every prompt block the step completes."""
        self._step += 1
        meta = RedisConnectorMetadata(step=self._step, loads=self._loads)
        self._loads = []
        out = scheduler_output
        for rid in out.finished_req_ids:
            self._tracked.pop(rid, None)
        computed: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            if getattr(new, "prompt_embeds", None) is not None:
                continue
            keys = self.chains.keys(new.prompt_token_ids)
            c = new.num_computed_tokens
            self._tracked[new.req_id] = _Tracked(keys, [list(b) for b in new.block_ids],
                                                 [c // g.block_size for g in self.groups],
                                                 len(new.prompt_token_ids))
            computed[new.req_id] = c
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tr = self._tracked.get(rid)
            if tr is None:
                continue
            blocks = cached.new_block_ids[i]
            if cached.resumed_from_preemption[i]:
                tr.block_ids = [list(b) for b in blocks]
            elif blocks is not None:
                for lst, b in zip(tr.block_ids, blocks):
                    lst.extend(b)
            computed[rid] = cached.num_computed_tokens[i]
        if self.settings["save"]:
            for rid, n in out.num_scheduled_tokens.items():
                tr = self._tracked.get(rid)
                if tr is not None and rid in computed:
                    meta.saves.extend(self._saves_of(tr, computed[rid] + n))
        return meta

    def _saves_of(self, tr: _Tracked, chunk_end: int) -> list[SaveSpec]:
        """Saves of a step whose chunk ends at ``chunk_end``: every prompt block now full; a
        Mamba group's slot when the chunk ends at a multiple of ``Bm`` inside the prompt."""
        saves = []
        end = min(chunk_end, tr.prompt_len)
        for g, grp in enumerate(self.groups):
            if grp.kind == "mamba":
                i = chunk_end // grp.block_size - 1
                if chunk_end == end and chunk_end % grp.block_size == 0 and i >= tr.saved[g] and tr.block_ids[g]:
                    if tr.keys[g][i] not in self._known:
                        self._known.add(tr.keys[g][i])
                        saves.append(SaveSpec(g, tr.block_ids[g][0], tr.keys[g][i]))
                    tr.saved[g] = i + 1
                continue
            full = min(end // grp.block_size, len(tr.keys[g]), len(tr.block_ids[g]))
            for i in range(tr.saved[g], full):
                key, bid = tr.keys[g][i], tr.block_ids[g][i]
                if bid != NULL_BLOCK_ID and key not in self._known:
                    self._known.add(key)
                    saves.append(SaveSpec(g, bid, key))
            tr.saved[g] = max(tr.saved[g], full)
        return saves

    def request_finished(self, request: Any) -> None:
        self._tracked.pop(request.req_id, None)
        self._lookups.pop(request.req_id, None)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self.store.close()
