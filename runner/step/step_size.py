"""The token count ``StepCompiler.prepare_inputs`` holds a step to.

``prepare_inputs`` takes the scheduler output it prepares for only to check that it is the
one ``update_states`` just applied: its ``total_num_scheduled_tokens`` must be the count of
tokens the batch schedules. The total is read once and typed by stage 1's rule
(``check/cached.py``) before the kernels run, so that a refused step consumes nothing (the
asynchronous patch's columns, ``runner/step/placeholders.py``); the count itself is known
only once the kernels have counted the tokens, and is checked then.
"""

from __future__ import annotations

from attnplug.core.errors import InvalidSchedulerOutput, MetadataError
from attnplug.runner.step.check.types import is_int, show
from attnplug.runner.step.scheduler_output import SchedulerOutput


def expected_tokens(scheduler_output: SchedulerOutput | None) -> int:
    """The token count the step must hold: ``-1`` (no output: no check), else the output's
    ``total_num_scheduled_tokens`` read once, as an ``int`` (an ``int`` or numpy integer,
    never a ``bool``: stage 1's rule).

    Raises:
        InvalidSchedulerOutput: ``scheduler_output`` is not a ``SchedulerOutput``, or its total
            is not such an int in ``[0, 2**62)`` (stage 1 refuses both).
    """
    if scheduler_output is None:
        return -1
    if not isinstance(scheduler_output, SchedulerOutput):
        raise InvalidSchedulerOutput(None, "scheduler_output", f"expected the SchedulerOutput update_states just "
                                     f"applied, got {type(scheduler_output).__name__}")
    t = scheduler_output.total_num_scheduled_tokens
    if type(t) is int and 0 <= t < 2**62:
        return t
    if is_int(t) and 0 <= t < 2**62:
        return int(t)
    raise InvalidSchedulerOutput(None, "total_num_scheduled_tokens",
                                 f"must be an int in [0, 2**62), got {show(t)}: not an output update_states took")


def check_step_size(expected: int, Q: int, num_tokens_padded: int | None, max_num_batched_tokens: int) -> None:
    """Refuse a step of ``Q`` tokens when ``expected`` (:func:`expected_tokens`; -1: no
    check) is another count, or when ``num_tokens_padded`` is not in
    ``[Q, max_num_batched_tokens]``.

    Raises:
        InvalidSchedulerOutput: ``expected != Q`` (the output is not the one just applied).
        MetadataError: the padding.
    """
    if expected >= 0 and expected != Q:
        raise InvalidSchedulerOutput(None, "total_num_scheduled_tokens", (
            f"is {expected} but the batch holds {Q} scheduled tokens: call update_states with this output first"))
    if num_tokens_padded is not None and not Q <= num_tokens_padded <= max_num_batched_tokens:
        raise MetadataError(f"num_tokens_padded={num_tokens_padded} must lie in [{Q}, "
                            f"{max_num_batched_tokens}] (num_actual_tokens .. max_num_batched_tokens)")
