"""The built-in KV connectors' plugin: ``redis`` (``redis_connector.py``), ``disagg`` (``disagg_connector.py``)."""

from __future__ import annotations

from attnplug.plugins.kv_connectors.hookspecs import hookimpl


@hookimpl
def attnplug_register_kv_connectors(register):
    from attnplug.plugins.kv_connectors.redis_connector import RedisConnector

    from attnplug.plugins.kv_connectors.disagg_connector import DisaggConnector

    register("redis", RedisConnector)
    register("disagg", DisaggConnector)
