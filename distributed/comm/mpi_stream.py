"""The socket of an mpi:// comm, read and written without Tornado's IOStream.

IOStream adds its socket to the event loop for a read that finds no data, and
removes it when the read is done; with the futures and callbacks around that,
it took several times the CPU this takes to read and write a small message
(docs/mpi-design.rst, "The socket").  Control messages are
most of what a scheduler's comms move, so here the socket stays in the event
loop while it is open: each readable event reads what came, completes every
message in it, and hands each to the comm's waiting read.  Large frames are
read straight into memory of their own, and written without a copy.

Messages are framed as ``tcp://`` frames them.  A :class:`SocketStream` has
the part of IOStream's interface that TCP comms, the mpi:// handshake and MPI
channels use, so that an ``MPI`` comm is still a ``TCP`` comm.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import select
import socket
import struct
import threading
from collections.abc import Callable

from tornado.iostream import IOStream, StreamClosedError

from distributed.comm.tcp import _add_frames_header
from distributed.protocol.utils import unpack_frames
from distributed.utils import ensure_memoryview

# What one read asks of the socket; frames at least this large are read into
# their own memory
READ_SIZE = 2**16
# Most buffers in one sendmsg (Linux takes 1024)
_IOV_MAX = 512
# Messages that wait for a read before the socket is read no more: the
# peer's writes then wait, as they would for an IOStream, which reads only
# when asked to
_BACKLOG = 8
_SIZE = struct.Struct("Q")
# What a note starts with (mpi_head.Head.MARK): see SocketStream.take_notes
NOTE = b"\xc1"
_scratches = threading.local()


def _scratch() -> memoryview:
    """The memory that this thread reads sockets into: one for every stream,
    since what nothing takes at once is copied out"""
    try:
        return _scratches.buffer
    except AttributeError:
        _scratches.buffer = memoryview(bytearray(READ_SIZE))
        return _scratches.buffer


class SocketStream:
    """A connected socket, read by the event loop whenever data comes"""

    def __init__(self, sock: socket.socket):
        sock.setblocking(False)
        self.socket = sock
        self.error: BaseException | None = None
        self._loop = asyncio.get_running_loop()
        self._fd = sock.fileno()
        self._held = b""  # bytes read that nothing took yet: usually none
        self._framing = _Framing()
        # Before the first read_message: a read_bytes, or read_until_close
        self._raw: asyncio.Future | None = None
        self._discard = False
        self._messages = self._framing.messages  # complete ones
        self._waiter: asyncio.Future | None = None  # waits for one
        self._outbox = _Outbox(sock, self._loop)
        self._closed = False
        self._closing: list[asyncio.Future] = []  # done when it closes
        self._close_callback = None
        self._reading = False
        self._read_on()

    @classmethod
    def adopt(cls, stream: IOStream) -> SocketStream:
        """Take over the socket of an IOStream that has read nothing"""
        sock = stream.socket.dup()
        stream.close()  # its file descriptor; the connection is the copy's
        return cls(sock)

    # -- IOStream's interface, as TCP comms and the handshake use it --------

    def closed(self) -> bool:
        return self._closed

    def unread(self) -> bool:
        """Whether the peer sent anything that nobody read yet, or closed
        the connection, as far as the kernel knows now"""
        if self._held or self._closed:
            return True
        poll = select.poll()
        poll.register(self._fd, select.POLLIN)
        return bool(poll.poll(0))

    def set_close_callback(self, callback) -> None:
        self._close_callback = callback

    def set_nodelay(self, value: bool) -> None:
        if self.socket.family in (socket.AF_INET, socket.AF_INET6):
            self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, value)

    def writing(self) -> bool:
        return bool(self._outbox)

    def write(self, data) -> asyncio.Future:
        """Send ``data`` after what was written before; the future's result
        is set once all of it is sent"""
        if data:
            self._send([ensure_memoryview(data)])
        elif self._closed:
            raise StreamClosedError(self.error)
        return self._outbox.drained()

    def read_bytes(self, n: int) -> asyncio.Future:
        """The next ``n`` bytes (before any :meth:`read_message`)"""
        if self._closed:
            raise StreamClosedError(self.error)
        fut = self._raw = self._loop.create_future()
        self._framing.fill(memoryview(bytearray(n)))
        self._take()
        return fut

    def read_until_close(self) -> asyncio.Future:
        """A future that is done when the stream closes; what comes
        meanwhile is dropped"""
        fut = self.when_closed()
        if not self._closed:
            self._discard = True
            self._take()
        return fut

    def when_closed(self) -> asyncio.Future:
        """A future that is done when the stream closes"""
        fut = self._loop.create_future()
        if self._closed:
            fut.set_result(b"")
        else:
            self._closing.append(fut)
        return fut

    def close(self, error: BaseException | None = None) -> None:
        if self._closed:
            return
        self._closed, self.error = True, error
        failed = StreamClosedError(error)
        self._outbox.close(failed)
        # Closed by a finalizer after its event loop (a comm nobody closed):
        # nothing waits any more, and its futures can no longer be resolved
        if not self._loop.is_closed():
            self._read_off()
            for fut in [self._waiter, self._raw]:
                if fut is not None and not fut.done():
                    fut.set_exception(failed)
                    fut.exception()  # nobody may wait for it any more
            for fut in self._closing:
                if not fut.done():
                    fut.set_result(b"")
        self.socket.close()
        self._waiter = self._raw = None
        self._closing = []
        if self._close_callback is not None and not self._loop.is_closed():
            self._loop.call_soon(self._close_callback)

    # -- whole messages, framed as tcp:// frames them ------------------------

    async def read_message(self, allocate) -> list:
        """The next message's frames; ``allocate(nbytes)`` gives memory to
        read frames into"""
        if self._framing.allocate is None:
            self._framing.allocate = allocate
            self._take()  # what came after the handshake
        if not self._messages:
            if self._closed:
                raise StreamClosedError(self.error)
            # Woken with no result: a future's result lives as long as the
            # callback that ran the reader, and frames should not
            self._waiter = self._loop.create_future()
            await self._waiter
        message = self._messages.popleft()
        self._read_on()
        return message

    def take_notes(self, notes: Callable[[memoryview], bool]) -> None:
        """Hand each message of one frame starting with :data:`NOTE` to
        ``notes`` as it arrives, instead of to a read, unless it says False:
        notes between the two ends of a comm that Dask's reads never see"""
        self._framing.notes = notes

    def write_message(self, frames: list) -> int:
        """Queue a message's frames for sending; its size in bytes"""
        frames, _, nbytes = _add_frames_header(frames)
        self._send([ensure_memoryview(f) for f in frames])
        return nbytes

    # -- reading ----------------------------------------------------------

    def _read_on(self) -> None:
        if self._reading or self._closed:
            return
        if len(self._messages) >= _BACKLOG or len(self._held) >= READ_SIZE:
            return  # nothing takes what came
        self._reading = True
        self._loop.add_reader(self._fd, self._readable)

    def _read_off(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)

    def _readable(self) -> None:
        try:
            if (room := self._framing.room()) is not None:
                n = self.socket.recv_into(room)  # straight into the frame
                self._framing.filled += n
                data = None
            else:
                data = _scratch()
                n = self.socket.recv_into(data)
                data = data[:n]
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.close(e)
            return
        if n == 0:
            self.close()  # the peer closed the connection
            return
        self._take(data)

    def _take(self, data: memoryview | None = None) -> None:
        """Take what was held back, then ``data`` (which is only lent), into
        the memory being filled, starting each next frame and message; hold
        back what nothing takes yet"""
        if self._held:
            data = memoryview(self._held + bytes(data or b""))
        elif data is None:
            data = memoryview(b"")
        try:
            # Nothing is taken once closed; nothing in take() closes it
            taken = 0 if self._closed else self._framing.take(data)
        except Exception as e:  # garbage for frame sizes; no memory for them
            self.close(e)
            return
        if self._discard:
            taken = data.nbytes  # read_until_close: what nothing took goes
        self._held = bytes(data[taken:]) if taken < data.nbytes else b""
        if (raw := self._framing.raw) is not None:
            fut, self._raw, self._framing.raw = self._raw, None, None
            if fut is not None and not fut.done():
                fut.set_result(bytes(raw))
        if self._messages:
            waiter, self._waiter = self._waiter, None
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        if len(self._held) >= READ_SIZE or len(self._messages) >= _BACKLOG:
            self._read_off()  # nothing takes what comes
        else:
            self._read_on()

    # -- writing ----------------------------------------------------------

    def _send(self, views: list) -> None:
        if self._closed:
            raise StreamClosedError(self.error)
        try:
            self._outbox.send(views, self.close)
        except OSError as e:
            self.close(e)
            raise StreamClosedError(e) from e


class _Framing:
    """What a socket gives, parsed into messages framed as ``tcp://`` frames
    them, each frame landing in memory from ``allocate``; before that is
    set, into the memory a read_bytes asks for"""

    def __init__(self):
        self.allocate = None
        self.raw: memoryview | None = None  # a read_bytes' memory, once full
        self.messages: collections.deque = collections.deque()  # complete
        # Takes a message of one frame that starts with NOTE, or says False
        self.notes: Callable[[memoryview], bool] | None = None
        # The memory being filled, and how much of it is
        self.into: memoryview | None = None
        self.filled = 0
        # The frames of the message being read, the sizes of those to come
        self._message: list | None = None
        self._sizes: collections.deque = collections.deque()

    def fill(self, into: memoryview) -> None:
        self.into, self.filled = into, 0

    def room(self) -> memoryview | None:
        """Where a read may go straight, if a frame has a read's worth left
        to fill"""
        into = self.into
        if into is not None and into.nbytes - self.filled >= READ_SIZE:
            return into[self.filled :]
        return None

    def take(self, data: memoryview) -> int:
        """How many bytes of ``data`` were taken"""
        at, end = 0, data.nbytes
        while True:
            into = self.into
            if into is not None:
                n = min(into.nbytes - self.filled, end - at)
                if n:
                    into[self.filled : self.filled + n] = data[at : at + n]
                    at += n
                    self.filled += n
                if self.filled < into.nbytes:
                    break
                self.into = None
                self._landed(into)
            elif self.allocate is not None and end - at >= 8:
                (size,) = _SIZE.unpack_from(data, at)
                at += 8
                self.into, self.filled = self.allocate(size), 0
            else:
                break
        return at

    def _landed(self, into: memoryview) -> None:
        """``into`` is full: the bytes a read_bytes asked for, the first part
        of a message (its frames' sizes, and its first frames), or its next
        frame"""
        if self.allocate is None:
            self.raw = into
            return
        if self._message is None:
            self._message, sizes = unpack_frames(into, partial=True)
            self._sizes.extend(sizes)
        else:
            self._message.append(into)
        if self._sizes:
            self.into, self.filled = self.allocate(self._sizes.popleft()), 0
            return
        message, self._message = self._message, None
        if self.notes is not None and len(message) == 1 and message[0][:1] == NOTE:
            if self.notes(message[0]):
                return
        self.messages.append(message)


class _Outbox:
    """What was written to a non-blocking socket: sent at once as far as the
    socket takes it, the rest when the event loop finds it writable"""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop):
        self._socket = sock
        self._loop = loop
        self._fd = sock.fileno()
        self._unsent: collections.deque = collections.deque()  # memoryviews
        self._drained: list[asyncio.Future] = []  # wait for _unsent to empty
        self._fail = None  # (error): the stream closes

    def __bool__(self) -> bool:
        return bool(self._unsent)

    def drained(self) -> asyncio.Future:
        """A future that is done once everything written so far is sent"""
        fut = self._loop.create_future()
        if self._unsent:
            self._drained.append(fut)
        else:
            fut.set_result(None)
        return fut

    def send(self, views: list, fail) -> None:
        """Send ``views`` after what waits; raises OSError if the socket
        fails now, and calls ``fail(error)`` if it fails later"""
        if self._unsent:  # after what waits
            self._unsent.extend(views)
            return
        try:
            if len(views) == 1:
                n = self._socket.send(views[0])
            else:
                n = self._socket.sendmsg(views[:_IOV_MAX])
        except (BlockingIOError, InterruptedError):
            n = 0
        self._unsent.extend(views)
        if self._sent(n):
            self._fail = fail
            self._loop.add_writer(self._fd, self._writable)

    def close(self, failed: BaseException) -> None:
        """The socket closes: drop what was not sent; fail those waiting"""
        if self._unsent and not self._loop.is_closed():
            self._loop.remove_writer(self._fd)
        self._unsent.clear()
        self._fail = None
        drained, self._drained = self._drained, []
        for fut in drained if not self._loop.is_closed() else []:
            if not fut.done():
                fut.set_exception(failed)
                fut.exception()  # nobody may wait for it any more

    def _sent(self, n: int) -> bool:
        """Drop ``n`` bytes sent; whether some are left to send"""
        unsent = self._unsent
        while unsent and n >= unsent[0].nbytes:
            n -= unsent.popleft().nbytes
        if n:
            unsent[0] = unsent[0][n:]
        return bool(unsent)

    def _writable(self) -> None:
        try:
            n = self._socket.sendmsg(list(itertools.islice(self._unsent, _IOV_MAX)))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._fail(e)
            return
        if self._sent(n):
            return
        self._loop.remove_writer(self._fd)
        self._fail = None
        drained, self._drained = self._drained, []
        for fut in drained:
            if not fut.done():
                fut.set_result(None)
