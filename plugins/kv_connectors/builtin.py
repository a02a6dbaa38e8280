"""The built-in KV connectors' plugin: ``redis`` (``redis_connector.py``)."""

from __future__ import annotations

from attnplug.plugins.kv_connectors.hookspecs import hookimpl


@hookimpl
def attnplug_register_kv_connectors(register):
    from attnplug.plugins.kv_connectors.redis_connector import RedisConnector

    register("redis", RedisConnector)
