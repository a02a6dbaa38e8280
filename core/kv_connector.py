"""The KV connector contract: KV cache blocks that leave the process and come back.

A *connector* moves a request's KV blocks between attnplug's paged caches and somewhere
else — a store shared by processes (offload: a prefix computed once is reused by later
requests, other processes, or after eviction) or another engine (prefill/decode
disaggregation). The names and the split follow vLLM V1's ``KVConnectorBase_V1`` (facts
only): one instance per *role*, which talk to each other only through the per-step
metadata the scheduler side builds and the worker side receives in
``SchedulerOutput.kv_connector_metadata`` (``runner/step/scheduler_output.py``).

Scheduler side (``runner/serve/scheduler.py``, per waiting request at admission):

1. ``get_num_new_matched_tokens(request, num_computed_tokens)`` -> ``(n, load_async)``: how
   many tokens *beyond* the local prefix hit (``num_computed_tokens``) the connector can
   provide; ``n`` keeps the hit block-aligned in every cache group and below
   ``request.num_tokens`` (one token is always computed, to sample from).
2. ``update_state_after_alloc(request, block_ids, num_external_tokens)``: the request's
   blocks (per group, all of them) are allocated; the connector notes which of them to fill.
3. ``build_connector_meta(scheduler_output)`` once per step: the loads and saves the worker
   side performs in that step (a :class:`KVConnectorMetadata`).
4. ``request_finished(request)``: the request left (finished, aborted).

With ``load_async=True`` the request's blocks are allocated but it is *not scheduled for
compute* while it loads; the worker reports in :class:`KVConnectorOutput` which loads
finished and which failed. A finished load admits the request with
``num_computed_tokens = local + n``; a failed one admits it from the local hit, so it
recomputes: a connector fault never produces different tokens, only more compute.

Worker side (``runner/execute/kv_transfer.py``, inside ``ModelRunner``):

* ``register_kv_caches(kv_caches)`` once: ``{layer_name: cache}``, as allocated
  (``runner/execute/kv_caches.py``).
* per step: ``bind_connector_metadata(meta)``, ``start_load_kv()`` before the forward,
  ``wait_for_layer_load(layer_name)`` before a layer's attention, ``save_kv_layer(layer_name,
  kv_layer)`` after it, ``wait_for_save()`` at the step's end (the step's blocks may be
  reused from the next step on, so what a save reads must be read by then),
  ``get_finished(block)`` -> :class:`KVConnectorOutput`, ``clear_connector_metadata()``.

Every connector also keeps a :class:`KVConnectorStats` (``stats``) and counts faults by kind.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

__all__ = ["KVConnectorBase", "KVConnectorGroup", "KVConnectorContext", "KVConnectorMetadata",
           "KVConnectorOutput", "KVConnectorRole", "KVConnectorStats"]


class KVConnectorRole(enum.Enum):
    """Which half of a connector an instance is (vLLM's names)."""

    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass(frozen=True)
class KVConnectorGroup:
    """One cache group as a connector sees it (data only).

    Attributes:
        layer_names: the group's layers, in group order (every one travels).
        kind: ``"full_attention"``, ``"sliding_window"`` or ``"mamba"`` (``GroupKind`` values).
        block_size: tokens per manager block (what ``block_ids`` name).
        kernel_block_size: tokens per kernel block; manager block ``b`` is kernel blocks
            ``b*k .. b*k+k-1`` of the cache tensor, ``k = block_size // kernel_block_size``.
        sliding_window: ``W`` tokens for a sliding-window group, else ``None``.
        layout_dims: the cache tensor's dimensions (``core/kv_layout.py``'s ``DIMS``
            permuted, e.g. ``("block", "kv", "token", "head", "dim")``), or ``None`` when the
            backend declares no layout (a connector may refuse such a group).
        dtype: the cache dtype's name (``"float32"``, ``"bfloat16"``, ...).
        backend: the group's backend name.
    """

    layer_names: tuple[str, ...]
    kind: str
    block_size: int
    kernel_block_size: int
    sliding_window: int | None
    layout_dims: tuple[str, ...] | None
    dtype: str
    backend: str


@dataclass(frozen=True)
class KVConnectorContext:
    """What a connector is built with (data only).

    Attributes:
        groups: the cache groups, in group order.
        model_id: names the model's weights and shapes (a preset name and seed, a file's
            digest): a store shared by runs keeps runs of different models apart with it.
        config: the connector's own settings (``--kv-connector-config``), str keys.
        reported_faults: fault kinds already reported by an instance built with this context
            (both roles of one run share it, so each kind is reported once per run).
    """

    groups: tuple[KVConnectorGroup, ...]
    model_id: str
    config: Mapping[str, Any] = field(default_factory=dict)
    reported_faults: set[str] = field(default_factory=set, compare=False)


@dataclass
class KVConnectorMetadata:
    """One step's connector work, scheduler side to worker side (a connector subclasses it).

    Attributes:
        step: the scheduler's step counter when it was built.
    """

    step: int = 0


@dataclass
class KVConnectorOutput:
    """What the worker side reports after a step (``ModelRunnerOutput.kv_connector_output``).

    Attributes:
        finished_recving: request ids whose asynchronous load completed (their blocks hold
            the loaded KV).
        failed_recving: request ids whose load failed (unreachable store, corrupt, truncated
            or wrong-layout value, missing key): they recompute from their local hit.
    """

    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.finished_recving or self.failed_recving)


@dataclass
class KVConnectorStats:
    """Counters of one connector instance since it was built (or ``reset``).

    Attributes:
        lookups: admissions that asked the connector (``get_num_new_matched_tokens``).
        query_tokens: tokens those admissions could have got (``num_tokens - 1 - local hit``).
        hit_tokens: tokens the connector provides to admitted loads (a connector counts them
            when the load is planned, ``update_state_after_alloc``).
        tokens_loaded / bytes_loaded: tokens and value bytes written into the caches.
        tokens_saved / bytes_saved: tokens and value bytes sent to the store.
        load_time_ns: per step that loaded, nanoseconds its loads took (fetch, check, copy).
        save_time_ns: per step that saved, nanoseconds its saves took.
        faults: ``{kind: count}`` (``store_unavailable``, ``checksum``, ``truncated``,
            ``layout``, ``missing``, ...).
    """

    lookups: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    tokens_loaded: int = 0
    bytes_loaded: int = 0
    tokens_saved: int = 0
    bytes_saved: int = 0
    load_time_ns: list[int] = field(default_factory=list)
    save_time_ns: list[int] = field(default_factory=list)
    faults: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / query_tokens`` (0 with no queries)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class KVConnectorBase:
    """The connector contract (see the module docstring); every method has a do-nothing default.

    Args:
        context: the cache groups, model identity and settings.
        role: the half this instance is.

    Raises:
        ConfigError (subclasses): a setting or cache group the connector cannot serve.
    """

    name: str = "base"

    def __init__(self, context: KVConnectorContext, role: KVConnectorRole):
        self.context = context
        self.role = role
        self.stats = KVConnectorStats()
        self._meta: KVConnectorMetadata | None = None

    # --- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` the connector can provide, and whether they
        load asynchronously. ``request`` has ``req_id``, ``all_token_ids``, ``num_tokens``."""
        return 0, False

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[Sequence[int]],
                                 num_external_tokens: int) -> None:
        """The request's blocks, per group (the whole list), after allocation."""

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's loads and saves (called once per ``schedule()``)."""
        return KVConnectorMetadata()

    def request_finished(self, request: Any) -> None:
        """``request`` finished or was aborted; forget it."""

    def take_remote_output_tokens(self, request: Any) -> list[int]:
        """Tokens another instance already sampled for ``request`` (a disaggregated prefill's
        first token), asked once right after ``get_num_new_matched_tokens``; the scheduler
        appends them to the request's outputs, so its first computed token is a decode step.
        Default: none (attnplug's own extension; vLLM's decode instance recomputes instead)."""
        return []

    # --- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        """The caches, once, ``{layer_name: cache}``."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        self._meta = metadata

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def start_load_kv(self) -> None:
        """Start the bound step's loads (before the forward)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s loads of this step are in its cache."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any) -> None:
        """``layer_name``'s cache after its attention ran: take what this step saves."""

    def wait_for_save(self) -> None:
        """Block until every save of this step has read the caches."""

    def get_finished(self, block: bool = False) -> KVConnectorOutput:
        """Loads completed or failed since the last call; with ``block`` (a step that computed
        nothing) wait until at least one of the loads in progress ends."""
        return KVConnectorOutput()

    def close(self) -> None:
        """Release connections and threads."""

    # --- faults ---------------------------------------------------------------------------
    def record_fault(self, kind: str) -> bool:
        """Count a fault of ``kind``; ``True`` the first time in the run (both roles built from
        one context together): the caller then reports it, once."""
        self.stats.faults[kind] = self.stats.faults.get(kind, 0) + 1
        first = kind not in self.context.reported_faults
        self.context.reported_faults.add(kind)
        return first
