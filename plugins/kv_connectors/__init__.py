"""KV connectors as plugins: discovery and the built-in ones (``docs/kv-connectors.md``).

``get_kv_connector(name)`` returns a connector class; ``available_kv_connectors()`` lists
them. Discovery mirrors the backends' (``plugins/discovery.py``): one pluggy hook,
``attnplug_register_kv_connectors(register)``, implemented by the built-in plugin
(``builtin.py``: ``redis``) and by every entry point of the group
``attnplug.kv_connectors`` of the installed distributions, loaded in (distribution,
name) order; a plugin that fails to import or register is logged and skipped.
"""

from attnplug.plugins.kv_connectors.discovery import (ENTRY_POINT_GROUP, available_kv_connectors,
                                                      discover_kv_connectors, get_kv_connector)

__all__ = ["ENTRY_POINT_GROUP", "available_kv_connectors", "discover_kv_connectors", "get_kv_connector"]
