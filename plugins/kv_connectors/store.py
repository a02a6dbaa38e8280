"""The Redis connector's storage: a Redis server, with a local CPU-memory tier in front.

:class:`BlockStore` speaks to Redis through the ``redis`` client (``pip install
attnplug[kv-redis]``) and keeps the values it wrote or read in :class:`CpuTier`, a
least-recently-used map bounded in bytes, so a worker that saved a block loads it again
without the network. The tier holds encoded values (``block_codec.py``): every load
checks the checksum, whichever tier the value came from. The Redis server is the index:
``exists`` asks it, so a value only the tier holds (the server restarted empty) is not
offered to the scheduler.

Every failure to reach the server (refused connection, timeout, a reply that is not one)
is a :class:`StoreUnavailable`; the connector counts it and falls back to recomputation.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence


class StoreUnavailable(Exception):
    """The Redis server could not be reached or did not answer."""


class CpuTier:
    """``{key: value bytes}``, least recently used first out, at most ``capacity_bytes``;
    safe to share between the fetch thread and the step's thread (one lock)."""

    def __init__(self, capacity_bytes: int):
        self._lock = threading.Lock()
        self.capacity_bytes = int(capacity_bytes)
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self.num_bytes = 0
        self.hits = 0

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._get(key)

    def _get(self, key: str) -> bytes | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
            self.hits += 1
        return value

    def put(self, key: str, value: bytes) -> None:
        with self._lock:
            self._put(key, value)

    def _put(self, key: str, value: bytes) -> None:
        if len(value) > self.capacity_bytes:
            return
        old = self._items.pop(key, None)
        if old is not None:
            self.num_bytes -= len(old)
        self._items[key] = value
        self.num_bytes += len(value)
        while self.num_bytes > self.capacity_bytes:
            _, v = self._items.popitem(last=False)
            self.num_bytes -= len(v)

    def discard(self, key: str) -> None:
        with self._lock:
            v = self._items.pop(key, None)
        if v is not None:
            self.num_bytes -= len(v)


class BlockStore:
    """Redis plus a CPU tier.

    Args:
        url: ``redis://host:port/db``.
        timeout_s: socket connect and read timeout (a dead server costs at most this).
        cpu_bytes: the CPU tier's capacity (0: no tier).

    Raises:
        ImportError: the ``redis`` client is not installed (message says how).
    """

    def __init__(self, url: str, timeout_s: float = 1.0, cpu_bytes: int = 64 << 20):
        try:
            import redis
        except ImportError as exc:  # pragma: no cover - the test extra installs it
            raise ImportError("the redis KV connector needs the redis client: pip install 'attnplug[kv-redis]'") \
                from exc
        self._redis = redis
        self.url = url
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.tier = CpuTier(cpu_bytes) if cpu_bytes > 0 else None

    def _call(self, fn):
        try:
            return fn()
        except (self._redis.RedisError, OSError) as exc:
            raise StoreUnavailable(f"{self.url}: {type(exc).__name__}: {exc}") from exc

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether the server holds it (one round trip).

        Raises:
            StoreUnavailable: the server did not answer.
        """
        if not keys:
            return []

        def run():
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            return [bool(r) for r in pipe.execute()]
        return self._call(run)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Per key its value (the CPU tier first, then one ``MGET`` for the rest), ``None``
        when neither has it.

        Raises:
            StoreUnavailable: the server did not answer (only asked when the tier misses).
        """
        out: list[bytes | None] = [self.tier.get(k) if self.tier else None for k in keys]
        missing = [i for i, v in enumerate(out) if v is None]
        if missing:
            got = self._call(lambda: self.client.mget([keys[i] for i in missing]))
            for i, v in zip(missing, got):
                out[i] = v
                if v is not None and self.tier is not None:
                    self.tier.put(keys[i], v)
        return out

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Write values (the CPU tier, then one pipelined ``SET`` per value).

        Raises:
            StoreUnavailable: the server did not answer (the tier keeps the values).
        """
        if not items:
            return
        if self.tier is not None:
            for k, v in items:
                self.tier.put(k, v)

        def run():
            pipe = self.client.pipeline(transaction=False)
            for k, v in items:
                pipe.set(k, v)
            pipe.execute()
        self._call(run)

    def forget(self, key: str) -> None:
        """Drop ``key`` from the CPU tier (its value proved unusable)."""
        if self.tier is not None:
            self.tier.discard(key)

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # pragma: no cover - closing a dead connection
            pass
