"""``python -m attnplug`` → the ``attnplug`` command line."""

from attnplug.runner.commands.cli import main

raise SystemExit(main())
