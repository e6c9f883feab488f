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

from distributed.comm.mpi_liveness import LocalPeer
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


async def copy(writer: LocalPeer, at: int, frame: memoryview, chunk_size: int):
    """Copy ``frame`` from address ``at`` in the writer's memory, a chunk at a
    time, letting the event loop run between chunks"""
    into, size = address(frame), frame.nbytes
    for offset in range(0, size, chunk_size):
        if offset:
            await asyncio.sleep(0)
        writer.read(at + offset, into + offset, min(chunk_size, size - offset))


def check_lease(writer: LocalPeer, at: int, value: int) -> None:
    """After copying: raise if the writer gave the frames up, which may have
    changed while they were copied"""
    word = ctypes.c_uint64()
    writer.read(at, ctypes.addressof(word), ctypes.sizeof(word))
    if word.value != value:
        raise OSError(errno.ECANCELED, "the writer gave the message up")


def why(e: OSError) -> str:
    """Why a copy failed, for its comm's error"""
    if e.errno == errno.ESRCH:
        return "the peer process died"
    if e.errno in (errno.EPERM, errno.ENOSYS):
        return f"the kernel does not let this process read the peer's memory ({e})"
    return str(e)
