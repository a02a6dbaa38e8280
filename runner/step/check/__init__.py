"""Stage 1 of a step: check a ``SchedulerOutput`` in full against the state; change nothing.

``checker.py`` holds :class:`~attnplug.runner.step.check.checker.UpdateChecker` (the
order the checks run in); each other module is one family of named checks:
``snapshot.py`` (every field read once), ``fast.py`` (the kernels' scans of a regular
output), ``cached.py``, ``blocks.py``, ``windows.py``, ``new.py``, ``lists.py``,
``spec.py`` (drafts), ``types.py`` (the typing rule and the error helpers).

This package imports nothing itself, so a leaf check module (``types.py``) can be
imported without the checker.
"""
