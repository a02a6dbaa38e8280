"""attnplug.cache_groups."""
