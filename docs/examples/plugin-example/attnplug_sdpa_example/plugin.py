"""The plugin object named by the ``attnplug`` entry point: one hook implementation."""

from attnplug.plugins import hookimpl


@hookimpl
def attnplug_register_backends(registry):
    """Register :class:`SdpaExampleBackend` (imported here, so a broken import is reported as
    this plugin's fault instead of breaking attnplug)."""
    from attnplug_sdpa_example.backend import SdpaExampleBackend

    registry.register(SdpaExampleBackend)
