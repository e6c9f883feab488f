"""The head of an mpi:// message whose frames do not all travel on its
socket (:class:`Head`): its wire format, packed and unpacked here alone."""

from __future__ import annotations

import struct
from typing import NamedTuple


class Head(NamedTuple):
    """The first frame of a message some of whose frames take a route of
    their own (see ``distributed.comm.mpi_routes``; or are lent on the
    socket, ``distributed.comm.mpi_lending``), or whose writer wants a
    channel opened: which frames, which route each takes, on which channel
    and tag; alone in a message, a note between two ends that lend.  The
    message's other frames follow it on the socket, in order.
    Other messages go as ``tcp://`` writes them: their first frame is
    msgpack, which never starts with the byte that a head starts with."""

    want_channel: bool
    channel: int  # Channel.id; 0 if no frame takes a route
    tag: int
    # index, size, route code, and what the route says of it (an address)
    frames: list[tuple[int, int, int, int]]
    lease: tuple[int, int] = (0, 0)  # of the copied frames: mpi_copy.Lease.head
    extra: bytes = b""  # what routes say beyond a word (IPC handles)
    # A note between two ends that lend frames on their socket (mpi_lending),
    # alone in its message: COPIES (with IPC: device frames too), or COPIED
    # with the message's tag
    note: int = 0

    MARK = 0xC1  # "never used" in msgpack
    COPIES, COPIED, IPC = 2, 4, 8  # notes, as flags beside want_channel's 1
    LENT = 2**64 - 1  # the channel of frames lent on the socket: none
    # MARK, flags, len(frames), channel, tag, lease, len(extra)
    _FIXED = struct.Struct("<BBxxIQIQQI")
    _FRAME = struct.Struct("<IQBQ")

    def pack(self) -> bytes:
        fixed = self._FIXED.pack(
            self.MARK,
            self.want_channel | self.note,
            len(self.frames),
            self.channel,
            self.tag,
            *self.lease,
            len(self.extra),
        )
        frames = [self._FRAME.pack(*frame) for frame in self.frames]
        return b"".join([fixed, *frames, self.extra])

    @classmethod
    def unpack(cls, data) -> Head:
        _, flags, n, channel, tag, *lease, extra = cls._FIXED.unpack_from(data)
        frames = [
            cls._FRAME.unpack_from(data, cls._FIXED.size + i * cls._FRAME.size)
            for i in range(n)
        ]
        start = cls._FIXED.size + n * cls._FRAME.size
        if len(data) != start + extra:
            raise struct.error("a head of another length than it says")
        extra = bytes(data[start:])
        note = flags & (cls.COPIES | cls.COPIED | cls.IPC)
        return cls(bool(flags & 1), channel, tag, frames, tuple(lease), extra, note)
