"""attnplug.runner.commands.bench."""
