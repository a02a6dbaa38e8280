"""One cache block of one group as a store value: a header, the block's bytes, a checksum.

A value holds manager block ``b`` of every layer of one cache group, in the group's
declared layout (``core/kv_layout.py``): for each layer in group order, the slice of its
cache tensor at kernel blocks ``b*k .. b*k+k-1`` along the layout's ``block`` dimension
(``k = block_size // kernel_block_size``), as raw bytes of the cache dtype. Encoding::

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
        layout_dims: the cache tensor's dimension order.
        dtype: the cache dtype's name.
        slice_shape: one layer's slice of one manager block (the cache's shape with the
            ``block`` dimension set to ``k``).
        num_layers: layers in the group.
    """

    kind: str
    block_size: int
    kernel_block_size: int
    sliding_window: int | None
    layout_dims: tuple[str, ...]
    dtype: str
    slice_shape: tuple[int, ...]
    num_layers: int

    def header(self) -> bytes:
        return json.dumps({"v": 1, "kind": self.kind, "block_size": self.block_size,
                           "kernel_block_size": self.kernel_block_size, "sliding_window": self.sliding_window,
                           "layout_dims": list(self.layout_dims), "dtype": self.dtype,
                           "slice_shape": list(self.slice_shape), "num_layers": self.num_layers},
                          sort_keys=True).encode()

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def slice_bytes(self) -> int:
        n = self.torch_dtype.itemsize
        for s in self.slice_shape:
            n *= s
        return n

    @property
    def payload_bytes(self) -> int:
        return self.slice_bytes * self.num_layers


def encode_block(layout: BlockLayout, slices: Sequence[torch.Tensor]) -> bytes:
    """The value of one block: ``slices`` = per layer, its ``layout.slice_shape`` CPU tensor.

    Raises:
        ValueError: not one slice per layer, or a slice of another shape or dtype.
    """
    if len(slices) != layout.num_layers:
        raise ValueError(f"{len(slices)} layer slices for a group of {layout.num_layers} layers")
    parts = []
    for t in slices:
        if tuple(t.shape) != layout.slice_shape or t.dtype != layout.torch_dtype:
            raise ValueError(f"slice {tuple(t.shape)} {t.dtype}, expected {layout.slice_shape} {layout.dtype}")
        parts.append(t.contiguous().view(torch.uint8).numpy().tobytes())
    header = layout.header()
    body = header + b"".join(parts)
    return MAGIC + len(header).to_bytes(4, "big") + body + hashlib.sha256(body).digest()


def decode_block(layout: BlockLayout, value: bytes) -> list[torch.Tensor]:
    """The per-layer slices of a value written by :func:`encode_block` for ``layout``.

    Returns:
        ``num_layers`` CPU tensors of ``layout.slice_shape`` and dtype.

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
    n = layout.slice_bytes
    return [raw[i * n:(i + 1) * n].view(layout.torch_dtype).reshape(layout.slice_shape)
            for i in range(layout.num_layers)]
