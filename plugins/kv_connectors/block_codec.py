"""One cache block of one group as a store value: a header, the block's bytes, a checksum.

A value holds manager block ``b`` of every layer of one cache group, in the group's
declared layout (``core/kv_layout.py``): for each layer in group order, the slice of its
cache tensor at kernel blocks ``b*k .. b*k+k-1`` along the layout's ``block`` dimension
(``k = block_size // kernel_block_size``), as raw bytes of the cache dtype. For a Mamba
(state) group the "block" is one state slot: per layer, row ``slot`` of each declared
state tensor (``conv_state``, ``ssm_state``), one *part* each. Encoding::

    MAGIC (8 bytes, b"APKVBLK1")
    header length (4 bytes, big-endian)   header (JSON, utf-8: the layout fingerprint)
    payload (layers x slice bytes)
    sha256 (32 bytes) of header + payload

:func:`decode_block` checks, in this order, and raises :class:`BlockFault` with ``kind``:
``truncated`` (shorter or longer than its own lengths say, or not this format at all),
``checksum`` (the digest does not match: a flipped byte anywhere), ``layout`` (a value
written by a run whose group layout, dtype, block shape or layer count differ). The
checksum covers the header, so a header that was damaged, not merely different, is a
``checksum`` fault.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Sequence

import torch

MAGIC = b"APKVBLK1"
_DIGEST = 32


class BlockFault(Exception):
    """A store value that cannot be loaded; ``kind`` names why (module docstring)."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


@dataclass(frozen=True)
class BlockLayout:
    """What one group's block value must look like (the fingerprint in the header).

    Attributes:
        kind, block_size, kernel_block_size, sliding_window: the group's (``KVConnectorGroup``).
        layout_dims: the cache tensor's dimension order (``()`` for a state group).
        parts: per layer, ``(dtype name, shape)`` of each part: one for an attention group
            (the cache's shape with the ``block`` dimension set to ``k``), one per state
            tensor (a slot's row) for a state group.
        num_layers: layers in the group.
    """

    kind: str
    block_size: int
    kernel_block_size: int
    sliding_window: int | None
    layout_dims: tuple[str, ...]
    parts: tuple[tuple[str, tuple[int, ...]], ...]
    num_layers: int

    def header(self) -> bytes:
        return json.dumps({"v": 1, "kind": self.kind, "block_size": self.block_size,
                           "kernel_block_size": self.kernel_block_size, "sliding_window": self.sliding_window,
                           "layout_dims": list(self.layout_dims),
                           "parts": [[d, list(shape)] for d, shape in self.parts], "num_layers": self.num_layers},
                          sort_keys=True).encode()

    def part_bytes(self, i: int) -> int:
        dtype, shape = self.parts[i]
        n = getattr(torch, dtype).itemsize
        for s in shape:
            n *= s
        return n

    @property
    def payload_bytes(self) -> int:
        return sum(self.part_bytes(i) for i in range(len(self.parts))) * self.num_layers


def encode_block(layout: BlockLayout, slices: Sequence[Sequence[torch.Tensor]]) -> bytes:
    """The value of one block: ``slices`` = per layer, its parts (CPU tensors of ``layout.parts``).

    Raises:
        ValueError: not one entry per layer and part, or a part of another shape or dtype.
    """
    if len(slices) != layout.num_layers:
        raise ValueError(f"{len(slices)} layer slices for a group of {layout.num_layers} layers")
    parts = []
    for layer in slices:
        if len(layer) != len(layout.parts):
            raise ValueError(f"{len(layer)} parts per layer, expected {len(layout.parts)}")
        for t, (dtype, shape) in zip(layer, layout.parts):
            if tuple(t.shape) != shape or t.dtype != getattr(torch, dtype):
                raise ValueError(f"part {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}")
            parts.append(t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())
    header = layout.header()
    body = header + b"".join(parts)
    return MAGIC + len(header).to_bytes(4, "big") + body + hashlib.sha256(body).digest()


def decode_block(layout: BlockLayout, value: bytes) -> list[list[torch.Tensor]]:
    """The per-layer parts of a value written by :func:`encode_block` for ``layout``.

    Returns:
        per layer, one CPU tensor per ``layout.parts`` entry (its dtype and shape).

    Raises:
        BlockFault: ``truncated``, ``checksum`` or ``layout`` (module docstring).
    """
    if len(value) < len(MAGIC) + 4 + _DIGEST or value[:len(MAGIC)] != MAGIC:
        raise BlockFault("truncated", f"{len(value)} bytes, not a block value")
    hlen = int.from_bytes(value[len(MAGIC):len(MAGIC) + 4], "big")
    start = len(MAGIC) + 4
    body = value[start:-_DIGEST]
    if hlen > len(body):
        raise BlockFault("truncated", f"header of {hlen} bytes in a body of {len(body)}")
    if hashlib.sha256(body).digest() != value[-_DIGEST:]:
        # a cut value's last 32 bytes are payload, not its digest: name a short one by its length
        expected = start + hlen + layout.payload_bytes + _DIGEST
        kind = "truncated" if len(value) < expected else "checksum"
        raise BlockFault(kind, f"{len(value)} bytes (expected {expected}), sha256 mismatch")
    header, payload = body[:hlen], body[hlen:]
    if header != layout.header():
        raise BlockFault("layout", f"written as {header.decode(errors='replace')}, expected "
                                   f"{layout.header().decode()}")
    if len(payload) != layout.payload_bytes:  # same header, so only a writer bug gets here
        raise BlockFault("truncated", f"payload of {len(payload)} bytes, expected {layout.payload_bytes}")
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    out, at = [], 0
    for _ in range(layout.num_layers):
        layer = []
        for i, (dtype, shape) in enumerate(layout.parts):
            n = layout.part_bytes(i)
            layer.append(raw[at:at + n].view(getattr(torch, dtype)).reshape(shape))
            at += n
        out.append(layer)
    return out
