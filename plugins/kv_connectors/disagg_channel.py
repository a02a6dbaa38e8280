"""The ``disagg`` connector's wire: messages between a producer (prefill) and a consumer
(decode) process, over ``torch.distributed`` point-to-point ``send``/``recv`` (gloo).

Why send/recv and not a store: the two processes are already one torchrun group, gloo
moves a tensor of bytes with no extra server, and a message is sent once and read once
(a store would need keys, polling and deletion for the same thing).

A message is::

    MAGIC (8 bytes, b"APKVMSG1")  header length (4 bytes, big-endian)  header (JSON, utf-8)
    body: the header's ``blocks`` values back to back (``block_codec.encode_block`` each,
          with its own layout header and sha256)

Header fields: ``kind`` (``"kv"``: a request's prompt KV; ``"tokens"``: its prompt and the
first sampled token; ``"end"``: the producer is done), ``req_id``, and per kind
``prompt_len`` and ``blocks`` (``[[group, index, nbytes], ...]``) or ``prompt_token_ids``
and ``first_token`` (``None``: the producer sampled nothing, e.g. the request was aborted).

On the wire each message is two sends from the producer (rank 0) to the consumer (rank 1):
an int64 tensor ``[nbytes]``, then a uint8 tensor of the message. :class:`PeerChannel`
sends from the caller's thread; the consumer receives on one background thread into a
mailbox by ``(kind, req_id)``, so the order in which the consumer asks does not matter.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

MAGIC = b"APKVMSG1"


class MessageError(Exception):
    """Bytes that are not a message of this format (cut short, bad magic or header)."""


@dataclass
class Message:
    """One decoded message (data only): ``header`` (module docstring) and ``blocks``, the
    encoded block values in header order (``bytes`` each)."""

    header: dict[str, Any]
    blocks: list[bytes] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return self.header["kind"]

    @property
    def req_id(self) -> str | None:
        return self.header.get("req_id")


def encode_message(header: dict[str, Any], blocks: list[tuple[int, int, bytes]] = ()) -> bytes:
    """A message: ``header`` plus ``blocks`` = ``(group, logical block index, value)``."""
    h = dict(header)
    h["blocks"] = [[g, i, len(v)] for g, i, v in blocks]
    raw = json.dumps(h, sort_keys=True).encode()
    return MAGIC + len(raw).to_bytes(4, "big") + raw + b"".join(v for _, _, v in blocks)


def decode_message(data: bytes) -> Message:
    """The :class:`Message` in ``data``; ``header["blocks"]`` keeps ``[group, index, nbytes]``.

    Raises:
        MessageError: wrong magic, a header that is not JSON, or a body shorter or longer
            than the header's block lengths.
    """
    if len(data) < len(MAGIC) + 4 or data[:len(MAGIC)] != MAGIC:
        raise MessageError(f"{len(data)} bytes, not a disagg message")
    hlen = int.from_bytes(data[len(MAGIC):len(MAGIC) + 4], "big")
    at = len(MAGIC) + 4
    try:
        header = json.loads(data[at:at + hlen])
    except (ValueError, UnicodeDecodeError):
        raise MessageError("header is not JSON") from None
    at += hlen
    blocks = []
    for _g, _i, n in header.get("blocks", []):
        blocks.append(data[at:at + n])
        at += n
    if at != len(data) or any(len(b) != n for b, (_, _, n) in zip(blocks, header.get("blocks", []))):
        raise MessageError(f"body of {len(data) - len(MAGIC) - 4 - hlen} bytes does not match its block lengths")
    return Message(header, blocks)


def torch_send(peer: int) -> Callable[[bytes], None]:
    """Send bytes to ``peer`` with ``torch.distributed.send`` (length, then payload)."""
    import torch.distributed as dist

    def send(data: bytes) -> None:
        dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=peer)
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=peer)
    return send


def torch_recv(peer: int) -> Callable[[], bytes]:
    """Receive one ``torch_send`` message from ``peer``."""
    import torch.distributed as dist

    def recv() -> bytes:
        n = torch.empty(1, dtype=torch.int64)
        dist.recv(n, src=peer)
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        dist.recv(buf, src=peer)
        return buf.numpy().tobytes()
    return recv


class PeerChannel:
    """One end of the producer/consumer wire.

    Args:
        role: ``"producer"`` (sends) or ``"consumer"`` (receives on a background thread).
        send / recv: the transport (:func:`torch_send` / :func:`torch_recv`, or an in-process
            pair in tests); a producer needs ``send``, a consumer ``recv``.
    """

    def __init__(self, role: str, send: Callable[[bytes], None] | None = None,
                 recv: Callable[[], bytes] | None = None):
        self.role = role
        self._send = send
        self._recv = recv
        self._box: dict[tuple[str, str], Message] = {}
        self._cond = threading.Condition()
        self._ended = False
        self.bad_messages = 0
        self._thread = None
        if role == "consumer":
            self._thread = threading.Thread(target=self._receive, name="attnplug-disagg-recv", daemon=True)
            self._thread.start()

    # --- producer ---------------------------------------------------------------------
    def send(self, header: dict[str, Any], blocks: list[tuple[int, int, bytes]] = ()) -> int:
        """Send one message; returns its size in bytes."""
        data = encode_message(header, blocks)
        self._send(data)
        return len(data)

    # --- consumer ---------------------------------------------------------------------
    def _receive(self) -> None:
        try:
            while True:
                data = self._recv()
                try:
                    msg = decode_message(data)
                except MessageError:
                    with self._cond:
                        self.bad_messages += 1
                    continue
                with self._cond:
                    if msg.kind == "end":
                        self._ended = True
                        self._cond.notify_all()
                        return
                    self._box[(msg.kind, str(msg.req_id))] = msg
                    self._cond.notify_all()
        except Exception:  # the peer went away: whoever waits sees the end
            with self._cond:
                self._ended = True
                self._cond.notify_all()

    def take(self, kind: str, req_id: str, timeout: float | None) -> Message | None:
        """The ``kind`` message of ``req_id`` (removed from the mailbox), waiting up to
        ``timeout`` seconds; ``None`` when it did not come (timeout, or the producer ended)."""
        key = (kind, req_id)
        with self._cond:
            self._cond.wait_for(lambda: key in self._box or self._ended, timeout=timeout)
            return self._box.pop(key, None)

    def close(self, timeout: float | None = None) -> None:
        """Producer: send ``end``. Consumer: wait (up to ``timeout`` seconds; default: no
        limit) for the receiver thread to see it, receiving whatever comes before it."""
        if self.role == "producer":
            self.send({"kind": "end"})
        elif self._thread is not None:
            self._thread.join(timeout)


_CURRENT: dict[str, PeerChannel] = {}


def install(channel: PeerChannel | None, role: str | None = None) -> None:
    """Make ``channel`` the process's wire for its role (both connector instances of a run
    use it); ``install(None, role)`` removes it. One per role, so a test can hold both ends."""
    if channel is None:
        _CURRENT.pop(role, None)
    else:
        _CURRENT[channel.role] = channel


def current(role: str) -> PeerChannel | None:
    """The process's wire for ``role``, or ``None`` (not launched as a disaggregated pair)."""
    return _CURRENT.get(role)
