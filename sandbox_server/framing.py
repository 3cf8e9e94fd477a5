"""Length-prefixed JSON messages between the server and a zygote over a Unix socket pair.

One frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON. The zygote side is blocking (it
serves one call at a time); the server side is asyncio.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from typing import Any

_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 256 * 1024 * 1024


def encode_frame(message: Any) -> bytes:
    """Serialise one message into a frame."""
    payload = json.dumps(message, separators=(",", ":")).encode()
    if len(payload) > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return _HEADER.pack(len(payload)) + payload


def _decode_length(header: bytes) -> int:
    (length,) = _HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"frame header announces {length} bytes, more than {MAX_FRAME_BYTES}")
    return length


def _recv_exact(sock: socket.socket, size: int) -> bytes | None:
    chunks, remaining = [], size
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def recv_message(sock: socket.socket) -> Any | None:
    """Blocking receive of one message; None when the peer closed the socket."""
    header = _recv_exact(sock, _HEADER.size)
    if header is None:
        return None
    payload = _recv_exact(sock, _decode_length(header))
    return None if payload is None else json.loads(payload)


def send_message(sock: socket.socket, message: Any) -> None:
    """Blocking send of one message."""
    sock.sendall(encode_frame(message))


async def read_message(reader: asyncio.StreamReader) -> Any:
    """Receive one message; raises asyncio.IncompleteReadError when the peer closed the socket."""
    header = await reader.readexactly(_HEADER.size)
    return json.loads(await reader.readexactly(_decode_length(header)))
