"""attnplug.runner.step: the step compiler — scheduler deltas in, one step's flat inputs and
metadata out. Imports ``core`` and ``cache_groups`` only.

Modules in the order a step runs: ``scheduler_output`` (the input contract), ``groups``
(the cache groups and limits), ``request_state`` and ``input_batch`` (the two views of the
state), ``check`` (stage 1: validate, change nothing; ``check_*`` hold the named checks)
→ ``plan`` → ``apply`` (stage 2; ``apply_windows``) → ``prepare`` (stage 3) →
``common_metadata`` (stage 4) → ``append`` (stage 8). ``compiler.StepCompiler`` is the
façade; ``fast/`` the compiled paths; ``oracle`` the naive reference; ``debug`` snapshots.
"""
