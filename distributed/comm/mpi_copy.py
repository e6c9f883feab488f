"""Frames that a reader copies straight from the memory of a writer on its host.

Between two processes of one host, where the kernel lets the reader read the
writer's memory (``process_vm_readv``: same user and PID namespace, Yama's
``ptrace_scope``, seccomp), a large host frame does not go through MPI: the
writer names its address in the message's head, and keeps it until the reader
has copied it and says so with an empty message on the MPI channel.  It is the
copy that UCX's CMA would make, without MPI around it: a writer that dies
while its frame is copied fails the read (``ESRCH``) instead of aborting the
reader inside MPI (see docs/mpi-design.rst, "Failure modes").
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import itertools
import secrets
import threading
from collections import deque

from distributed.comm.core import CommClosedError
from distributed.comm.mpi_buffers import host_buffer
from distributed.comm.mpi_startup import get_mpi
from distributed.utils import _offload_executor

# The frames are copied in pieces of this size
PIECE = 2**20
# Copies from this size on are shared with the offload thread; below it,
# waking the thread cost what it saved (docs/mpi-design.rst, "Frames between
# processes of one host")
SHARED_FROM = 8 * 2**20

# The buffer of the empty messages that say a message's frames were copied
NOTHING = bytearray(1)


class Lease:
    """Frames that a reader copies from this process's memory, kept until it
    says that it has them.  It then reads the lease's word: a writer that gave
    the frames up first (its comm aborted, or closed long before the reader
    came to them) zeroes it, and the reader fails instead of returning what
    it copied from memory that may have been reused."""

    __slots__ = ("frames", "word")
    # Unique: a word freed and reused for another lease holds another value
    _values = itertools.count(secrets.randbits(62) + 1)

    def __init__(self, frames: list):
        self.frames = frames
        self.word = ctypes.c_uint64(next(self._values))

    @property
    def head(self) -> tuple[int, int]:
        """The word's address and value, for the message's head"""
        return ctypes.addressof(self.word), self.word.value

    def __del__(self):
        self.word.value = 0  # before the frames are freed


def address(frame: memoryview) -> int:
    """Where a host frame's bytes are, in this process's memory"""
    return get_mpi().buffer(frame).address


def lend(engine, channel, tag: int, lease: Lease) -> asyncio.Future:
    """Keep the frames of a message that its reader copies until it says,
    with an empty message on the channel and the message's tag, that it has
    them; the engine's future of that"""
    request = channel.comm.Irecv([NOTHING, 0, engine.MPI.BYTE], channel.rank, tag)
    return engine.transfer([request], lease, local=True, sender=channel.sender)


async def receive(writer, copies: list[tuple[int, int]], lease: tuple[int, int]):
    """The frames of a message to copy from its ``writer`` (a ``LocalPeer``):
    the size and address of each, and the ``lease`` of its head;
    CommClosedError if they cannot be.  The event
    loop copies them a piece at a time, running its other work in between,
    and Dask's offload thread, when free, takes pieces too: one thread copies
    at a third to a half of memcpy's speed on these machines, since the
    kernel pins the writer's pages one by one."""
    copy = _Copy(writer, copies)
    if sum(size for size, _ in copies) >= SHARED_FROM:
        # Not at exit, once the executor is shut down: the loop copies alone
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().run_in_executor(_offload_executor, copy.run)
    try:
        while copy.next():
            await asyncio.sleep(0)
        copy.join()
        # After copying: the writer may have given the frames up, and they
        # may have changed while they were copied
        word = ctypes.c_uint64()
        copy.writer.read(lease[0], ctypes.addressof(word), ctypes.sizeof(word))
        if word.value != lease[1]:
            raise OSError(errno.ECANCELED, "the writer gave the message up")
    except OSError as e:
        raise CommClosedError(
            f"cannot copy a message's frames from the writer's memory: {why(e)}"
        ) from e
    finally:
        copy.pieces.clear()  # cancelled: the helper stops
    return copy.frames


class _Copy:
    """The pieces of a message's frames left to copy, which the event loop
    and a helper thread take in turn"""

    def __init__(self, writer, copies: list):
        self.writer = writer
        # Kept until both are done: the helper writes into them
        self.frames = [host_buffer(size) for size, _ in copies]
        self.pieces: deque[tuple[int, int, int]] = deque(
            (address(frame) + offset, at + offset, min(PIECE, size - offset))
            for frame, (size, at) in zip(self.frames, copies)
            for offset in range(0, size, PIECE)
        )
        self._helping = threading.Lock()  # held while the helper copies
        self._error: OSError | None = None

    def next(self) -> bool:
        """Copy a piece; whether there was one"""
        try:
            into, at, n = self.pieces.popleft()
        except IndexError:
            return False
        self.writer.read(at, into, n)
        return True

    def run(self) -> None:
        """The helper's: copy pieces until none is left"""
        while True:
            with self._helping:
                try:
                    if not self.next():
                        return
                except OSError as e:
                    self._error = e
                    self.pieces.clear()
                    return

    def join(self) -> None:
        """Wait for the piece the helper is copying (no longer than a piece
        takes); raise what it failed with"""
        with self._helping:
            pass
        if self._error is not None:
            raise self._error


def acknowledge(engine, channel, tag: int) -> None:
    """Tell the writer that the frames of its message were copied"""
    if channel.sender.died():
        return  # a send to it could never complete
    engine.drop_dead_senders()  # before any call into MPI
    request = channel.comm.Isend([NOTHING, 0, engine.MPI.BYTE], channel.rank, tag)
    if not request.Test():
        engine.orphan([request])


def why(e: OSError) -> str:
    """What a failed copy from a peer's memory means"""
    if e.errno == errno.ESRCH:
        return "the peer process died"
    if e.errno in (errno.EPERM, errno.ENOSYS):
        return f"the kernel does not let this process read the peer's memory ({e})"
    return str(e)
