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
import ctypes
import errno
import itertools
import secrets

from distributed.comm.core import CommClosedError
from distributed.comm.mpi_buffers import host_buffer
from distributed.comm.mpi_startup import get_mpi

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


async def receive(channel, copies: list, lease: tuple[int, int], chunk_size: int):
    """The frames of a message to copy from its writer (``copies`` and
    ``lease`` of its head), copied a chunk at a time, letting the event loop
    run between chunks; CommClosedError if they cannot be"""
    writer, frames = channel.sender, [host_buffer(size) for _, size, _ in copies]
    try:
        for frame, (_, size, at) in zip(frames, copies):
            into = address(frame)
            for offset in range(0, size, chunk_size):
                if offset:
                    await asyncio.sleep(0)
                n = min(chunk_size, size - offset)
                writer.read(at + offset, into + offset, n)
        # After copying: the writer may have given the frames up, and they
        # may have changed while they were copied
        word = ctypes.c_uint64()
        writer.read(lease[0], ctypes.addressof(word), ctypes.sizeof(word))
        if word.value != lease[1]:
            raise OSError(errno.ECANCELED, "the writer gave the message up")
    except OSError as e:
        raise CommClosedError(
            f"cannot copy a message's frames from the writer's memory: {_why(e)}"
        ) from e
    return frames


def acknowledge(engine, channel, tag: int) -> None:
    """Tell the writer that the frames of its message were copied"""
    if channel.sender.died():
        return  # a send to it could never complete
    engine.drop_dead_senders()  # before any call into MPI
    request = channel.comm.Isend([NOTHING, 0, engine.MPI.BYTE], channel.rank, tag)
    if not request.Test():
        engine.orphan([request])


def _why(e: OSError) -> str:
    if e.errno == errno.ESRCH:
        return "the peer process died"
    if e.errno in (errno.EPERM, errno.ENOSYS):
        return f"the kernel does not let this process read the peer's memory ({e})"
    return str(e)
