"""Large frames lent on a comm's own socket, between processes of one host.

Between two processes of one host that talk over a Unix socket, where the
reader may read the writer's memory, a large frame needs no MPI channel: the
writer names it in the message's head and keeps it, the reader copies it
straight from the writer's memory (host frames: ``mpi_copy``; device frames,
where both have a GPU: from the writer's GPU memory, ``mpi_ipc``) and says so
with a note on the socket.  No MPI connection opens between such processes:
MPICH keeps 50-70 KB and three memory maps of every connection, whatever is
freed (docs/mpi-design.rst, "Long-running clusters"), and an MPI message to
end a copy cost more than the note.

Right after the handshake each end says, with a note, whether it copies from
the other, and whether device frames too; until the peer said so, large
frames take the channel's routes.  Notes are heads (``mpi_head.Head``) that
the socket stream hands to the :class:`Lender` as they arrive, never to the
comm's reads.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import struct

from tornado.iostream import StreamClosedError

from distributed.comm import mpi_policy as policy
from distributed.comm.mpi_copy import Lease
from distributed.comm.mpi_head import Head
from distributed.comm.mpi_ipc import Mappings
from distributed.comm.mpi_liveness import LocalPeer
from distributed.comm.mpi_startup import config
from distributed.comm.mpi_stream import SocketStream


class Lender:
    """One comm's frames lent to its peer, and what the two ends told each
    other about copying"""

    # Bytes of the frames that this process's comms lent or copied
    moved = 0

    def __init__(self):
        self.peer_copies = False  # the peer said it copies from this process
        self.peer_ipc = False  # ... device frames too
        self.writer: LocalPeer | None = None  # the peer, which this one copies from
        self.mappings: Mappings | None = None  # of its device frames
        self._leases: dict[int, Lease] = {}  # by tag, until the reader has them
        self._tags = itertools.count(1)
        self._returned: asyncio.Future | None = None  # done when none is lent

    def start(self, stream: SocketStream, peer) -> None:
        """After the handshake, on a Unix socket: take the peer's notes, and
        say whether this end copies from the peer"""
        if stream.socket.family != socket.AF_UNIX:
            return
        stream.take_notes(self._note)  # whatever this end does with them
        # However the comm ends, even dropped unclosed: nothing is lent, or
        # mapped, over a closed socket
        stream.when_closed().add_done_callback(lambda _: self.close())
        if config("lend-on-socket") and policy.copies_from(peer):
            self.writer = LocalPeer.find(peer)
            note = Head.COPIES
            if policy.ipc_from(peer):
                self.mappings = Mappings.of(peer.process, self.writer)
                note |= Head.IPC
            try:
                stream.write_message([Head(False, 0, 0, [], note=note).pack()])
            except StreamClosedError:
                pass  # the peer is gone already: the comm's first read says so

    @property
    def lent(self) -> int:
        """Messages lent that the reader has not said it has"""
        return len(self._leases)

    def lend(self, frames: list, nbytes: int) -> tuple[int, Lease]:
        """Keep ``frames``, of ``nbytes`` in all, until the reader says it
        has them: their tag, and the lease the reader checks after copying"""
        tag, lease = next(self._tags), Lease(frames)
        self._leases[tag] = lease
        Lender.moved += nbytes
        return tag, lease

    def copied(self, stream: SocketStream, tag: int, nbytes: int) -> None:
        """Tell the writer that the frames of its message ``tag``, ``nbytes``
        in all, were copied"""
        Lender.moved += nbytes
        note = Head(False, 0, tag, [], note=Head.COPIED).pack()
        try:
            stream.write_message([note])
        except StreamClosedError:
            pass  # the writer is gone, and its lease with it

    async def returned(self, timeout: float) -> None:
        """Wait, at most ``timeout`` seconds, for the reader to have every
        frame lent so far, while the socket is open (its closing gives them
        up)"""
        if not self._leases:
            return
        if self._returned is None or self._returned.done():  # else: shared
            self._returned = asyncio.get_running_loop().create_future()
        await asyncio.wait([self._returned], timeout=timeout)

    def drop(self) -> None:
        """Give every lent frame up: a reader that copies them yet fails"""
        self._leases.clear()
        self._none_lent()

    def close(self) -> None:
        """The comm closed: give up the lent frames and the mappings"""
        self.drop()
        if self.mappings is not None:
            self.mappings.release()
            self.mappings = None

    def _none_lent(self) -> None:
        if self._returned is not None and not self._returned.done():
            self._returned.set_result(None)

    def _note(self, frame: memoryview) -> bool:
        try:
            head = Head.unpack(frame)
        except (struct.error, IndexError, TypeError):
            return False  # not a note: the comm's read says it is garbage
        if head.note & Head.COPIES:
            self.peer_copies = bool(config("lend-on-socket"))
            self.peer_ipc = self.peer_copies and bool(head.note & Head.IPC)
        elif head.note == Head.COPIED:
            self._leases.pop(head.tag, None)
            if not self._leases:
                self._none_lent()
        else:
            return False
        return True
