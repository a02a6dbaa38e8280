"""The Redis connector's per-step metadata, scheduler side to worker side (data only)."""

from __future__ import annotations

from dataclasses import dataclass, field

from attnplug.core.kv_connector import KVConnectorMetadata


@dataclass
class LoadSpec:
    """One request's load: ``num_tokens`` tokens as ``blocks`` = ``(group, block_id, key)``."""

    req_id: str
    num_tokens: int
    blocks: list[tuple[int, int, str]]


@dataclass
class SaveSpec:
    """One block to save: ``group``'s block ``block_id`` under ``key``."""

    group: int
    block_id: int
    key: str


@dataclass
class RedisConnectorMetadata(KVConnectorMetadata):
    """A step's loads (requests admitted to load this step) and saves."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
