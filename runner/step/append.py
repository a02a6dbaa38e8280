"""Stage 8 of a step: the sampled tokens enter the token history (the next step's input)."""

from __future__ import annotations

import numpy as np

from attnplug.core.errors import MetadataError
from attnplug.runner.step.check.types import row_indices, rows_distinct, show
from attnplug.runner.step.input_batch import InputBatch


def append_output_tokens(batch: InputBatch, max_model_len: int, req_ids_or_rows, token_ids) -> None:
    """Append sampled tokens to rows of ``batch`` (the public entry, with the arguments and
    errors, is ``StepCompiler.append_output_tokens``). The scheduler never re-sends the
    runner's own samples: this is how they enter the token history. Validates everything
    before writing; a bad call changes nothing."""
    b = batch
    if not isinstance(req_ids_or_rows, (list, tuple, np.ndarray)) or getattr(req_ids_or_rows, "ndim", 1) != 1:
        row_indices(req_ids_or_rows, "append_output_tokens")  # raises: not a 1-D list of ids or rows
    n = len(req_ids_or_rows)
    if n == 0:
        return
    if isinstance(req_ids_or_rows[0], str):
        try:
            rows = np.fromiter(map(b.req_id_to_index.__getitem__, req_ids_or_rows), np.int64, n)
        except (KeyError, TypeError):
            bad = next(r for r in req_ids_or_rows if not isinstance(r, str) or r not in b.req_id_to_index)
            if not isinstance(bad, str):  # (a str subclass such as numpy.str_ is looked up by its value)
                raise MetadataError(f"append_output_tokens: request ids must be str (or pass batch rows, all "
                                    f"ints), got {type(bad).__name__} {bad!r}") from None
            raise MetadataError(f"append_output_tokens: request {bad!r} is not in this step's "
                                "batch; only scheduled requests can receive tokens") from None
    else:
        rows = row_indices(req_ids_or_rows, "append_output_tokens")
        if rows.min() < 0 or rows.max() >= b.num_reqs:
            raise MetadataError(f"append_output_tokens: rows must lie in [0, {b.num_reqs}), got {rows.tolist()}")
    if not isinstance(token_ids, (list, tuple, np.ndarray)):  # a tensor, a set, a scalar
        raise MetadataError(f"append_output_tokens: token ids must be ints in [0, 2**31), as a list or a 1-D "
                            f"integer array, got {show(token_ids)}")
    if len(token_ids) != n:
        raise MetadataError(f"append_output_tokens: {len(token_ids)} token entries for {n} requests")
    first = token_ids[0]  # a list (or 1-D array) per request, or one int each (a 0-d array is one int)
    ragged = isinstance(first, (list, tuple)) or isinstance(first, np.ndarray) and first.ndim != 0
    try:
        lens = (np.fromiter(map(len, token_ids), np.int64, n) if ragged else np.ones(n, np.int64))
    except TypeError:  # a list next to something without a length
        raise MetadataError(f"append_output_tokens: token ids must be ints in [0, 2**31), got {token_ids!r}") from None
    seqs = (token_ids if type(token_ids) is list else list(token_ids)) if ragged else [token_ids]
    flat = token_id_array(b.kernels, seqs, int(lens.sum()), "append_output_tokens", token_ids)
    if not ragged and b.kernels.append_tokens(b, rows, max_model_len, np.empty(n, np.int64), flat):
        return  # the compiled kernels checked and wrote in one call (else they wrote nothing)
    if not rows_distinct(rows, b.max_num_reqs):
        raise MetadataError("append_output_tokens: a request appears twice; pass each request once "
                            "with all its tokens")
    held = b.num_tokens[rows].astype(np.int64)
    seq = b.num_computed_tokens_cpu[rows].astype(np.int64) + b.num_scheduled_tokens[rows]
    if (seq != held).any():
        i = int(np.argmax(seq != held))
        raise MetadataError(
            f"append_output_tokens: request {b._req_ids[rows[i]]!r} has seq_len {int(seq[i])} < "
            f"num_tokens {int(held[i])}: its logits are discarded this step (partial prefill or "
            "recompute), or its token was already appended; append only to rows with discard False")
    if (held + lens > max_model_len).any():
        i = int(np.argmax(held + lens > max_model_len))
        raise MetadataError(f"append_output_tokens: request {b._req_ids[rows[i]]!r} would hold "
                            f"{int(held[i] + lens[i])} tokens > max_model_len {max_model_len}")
    if not ragged or (lens == 1).all():
        b.token_ids_cpu[rows, held] = flat
    else:
        off = 0
        for r, h, k in zip(rows.tolist(), held.tolist(), lens.tolist()):
            b.token_ids_cpu[r, h:h + k] = flat[off:off + k]
            off += k
    b.num_tokens[rows] = held + lens


def token_id_array(kernels, seqs: list, total: int, where: str, shown) -> np.ndarray:
    """Stage 8's typing rule for sampled token ids, on every entry point
    (``append_output_tokens``, ``append_verified_tokens``, ``fill_output_tokens``): the rule
    of every token id the step compiler takes (``IntPacker``), the same on both kernels:
    each sequence is a ``list`` or ``tuple`` of ints, or a 1-D integer numpy array (never a
    tensor, a 2-D array, ``bytes`` or a ``range``); an int is an ``int`` or a numpy integer
    scalar (an object ``operator.index`` converts exactly, such as a 0-d integer array, is
    taken as its value), never a bool of any kind (``bool``, ``numpy.bool_``, a bool array
    or tensor), a float or a string; each value in ``[0, 2**31)``.

    Args:
        kernels: the step's kernels (their ``pack_ints``: one compiled pass on the compiled
            kernels, about 2 ns an int).
        seqs: a list of sequences of token ids, packed back to back.
        total: how many ids they must hold.
        where: the entry point, and ``shown`` what it was given, for the message.

    Returns:
        ``[total]`` ``int32``.

    Raises:
        MetadataError: anything else, a sequence that is not one, or another total.
    """
    if len(seqs) == 1 and isinstance(seqs[0], np.ndarray):  # one array: the packer's rule for arrays, directly
        a = seqs[0]
        if a.ndim == 1 and a.shape[0] == total and a.dtype.kind in "iu" and (
                total == 0 or int(a.min()) >= 0 and int(a.max()) < 2**31):
            return a.astype(np.int32)
        raise MetadataError(f"{where}: token ids must be ints in [0, 2**31), got {shown!r}")
    out = np.empty(total, np.int32)
    if kernels.pack_ints(seqs, out)[0] != total:
        raise MetadataError(f"{where}: token ids must be ints in [0, 2**31), got {shown!r}")
    return out
