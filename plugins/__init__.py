"""attnplug.plugins."""
