"""``python -m attnplug`` → the ``attnplug`` command line."""

from attnplug.runner.cli import main

raise SystemExit(main())
