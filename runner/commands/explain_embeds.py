"""``attnplug explain``: the prompt-embeddings and M-RoPE fields of its JSON Lines.

Input (``runner/commands/explain.py`` has the rest of the format): the config line may
set ``"prompt_embeds_hidden_size": H`` (then new requests may carry ``"prompt_embeds"``,
one list of ``H`` numbers per prompt token, float32) and ``"uses_mrope": true`` (then new
requests may carry ``"mm_placeholders"``: ``[{"offset": int, "grid_thw": [t, h, w]}]``,
``runner/step/mrope.py``). Output: a step with embedding rows adds ``"is_embed"`` (per
token, whether it takes its prompt embedding instead of ``input_ids``); a compiler with
``uses_mrope`` adds ``"mrope_positions"`` (three lists: temporal, height, width).
"""

from __future__ import annotations

from typing import Any

import torch

from attnplug.runner.commands.explain_input import StepFormatError, get, int_list
from attnplug.runner.commands.limits import clip
from attnplug.runner.step.mrope import PlaceholderRange


def prompt_embeds_of(r: dict, rid: str) -> torch.Tensor | None:
    """``r["prompt_embeds"]`` as a float32 ``[n, H]`` tensor (``None`` when absent);
    shapes are the compiler's to check."""
    rows = get(r, "prompt_embeds", (list, type(None)), None, "new.", rid)
    if rows is None:
        return None
    for i, row in enumerate(rows):
        if not isinstance(row, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                for x in row):
            raise StepFormatError("new.prompt_embeds", f"row {i}: expected a list of numbers, got {clip(row)}", rid)
    if len({len(row) for row in rows}) > 1:
        raise StepFormatError("new.prompt_embeds", "rows of different lengths", rid)
    return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), len(rows[0]) if rows else 0)


def placeholders_of(r: dict, rid: str) -> list[PlaceholderRange] | None:
    """``r["mm_placeholders"]`` as :class:`PlaceholderRange` objects (``None`` when absent)."""
    items = get(r, "mm_placeholders", (list, type(None)), None, "new.", rid)
    if items is None:
        return None
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or set(item) != {"offset", "grid_thw"}:
            raise StepFormatError("new.mm_placeholders", f"item {i}: expected {{\"offset\", \"grid_thw\"}}, got "
                                  f"{clip(item)}", rid)
        grid = int_list(item, "grid_thw", "new.mm_placeholders.", rid)
        if len(grid) != 3:
            raise StepFormatError("new.mm_placeholders.grid_thw", f"item {i}: expected [t, h, w]", rid)
        out.append(PlaceholderRange(get(item, "offset", int, where="new.mm_placeholders.", req_id=rid), tuple(grid)))
    return out


def embeds_json(inputs: Any) -> dict:
    """The optional output keys of one step (``is_embed``, ``mrope_positions``)."""
    Q, out = inputs.num_actual_tokens, {}
    if inputs.is_embed is not None:
        out["is_embed"] = inputs.is_embed.cpu()[:Q].tolist()
    if inputs.mrope_positions is not None:
        out["mrope_positions"] = inputs.mrope_positions.cpu()[:, :Q].tolist()
    return out
