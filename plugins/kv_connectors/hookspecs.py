"""The KV-connector plugin hook (pluggy project ``attnplug_kv_connectors``).

A plugin module (an entry point of the group ``attnplug.kv_connectors``) implements::

    from attnplug.plugins.kv_connectors.hookspecs import hookimpl

    @hookimpl
    def attnplug_register_kv_connectors(register):
        register("mystore", MyStoreConnector)   # a KVConnectorBase subclass (core/kv_connector.py)
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "attnplug_kv_connectors"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def attnplug_register_kv_connectors(register):
    """Call ``register(name, connector_class)`` for each connector the plugin provides."""
