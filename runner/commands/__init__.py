"""attnplug.runner.commands."""
