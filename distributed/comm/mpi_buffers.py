"""Host memory for the frames an ``mpi://`` comm receives, over MPI or its socket.

A fresh buffer costs its receive a page fault per page, a large part of the
time of a copy from a process of this host.  Frames from the socket pay the
same where glibc maps each buffer afresh: from its mmap threshold, which
adapts up to 32 MiB, or stays at 128 KiB under a nanny (its
``MALLOC_TRIM_THRESHOLD_`` fixes it).  Smaller frames from the socket come
from glibc's heap, as on ``tcp://``, which serves them faster than this
module.  Two things help (figures in docs/mpi-design.rst, "Receive buffers"):

- 2 MiB pages.  The kernel's transparent huge pages back only whole aligned
  2 MiB stretches of a mapping that asks for them; numpy's buffers ask, but
  start anywhere, so the last one or two MiB of each took 4 KiB pages.  Ours
  start on a 2 MiB boundary.
- The memory of frames already freed.  When the last reference to a received
  frame goes, its memory waits ``KEEP_FOR`` (at most twice that) for the
  next frame of its size, since a message often follows one like it, up to
  ``distributed.comm.mpi.keep-freed`` bytes in all.  Then a timer on the
  event loop of the frame's reader gives it back to the system, as memory
  that Dask frees is (``MALLOC_TRIM_THRESHOLD_``), so that a worker's memory
  comes down; a frame freed once that loop stopped is given back at once.
  (Should the loop stop in between, the next receive in the process gives
  back what waited.)
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import mmap
import os
import threading
import time
import weakref
from collections import deque

from dask.utils import parse_bytes

from distributed.comm.mpi_startup import config
from distributed.protocol.utils import host_array

HUGE_PAGE = 2 * 2**20
KEEP_FOR = 1.0  # seconds
SMALLEST = 128 * 2**10  # smaller buffers come from glibc's heap

try:
    import numpy
except ImportError:  # distributed does not need it
    numpy = None


def _glibc_mmap_threshold() -> int:
    """The size from which glibc's malloc gives a buffer a mapping of its
    own (faulted in page by page): it adapts to the buffers freed, up to 32
    MiB, unless a setting fixes it (at 128 KiB unless it is the one set)"""
    env = os.environ
    with contextlib.suppress(KeyError, ValueError):
        return int(env["MALLOC_MMAP_THRESHOLD_"])
    fixing = ["MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_"]
    return 128 * 2**10 if any(key in env for key in fixing) else 32 * 2**20


# Read once: glibc reads its settings when the process starts
GLIBC_MMAP_THRESHOLD = _glibc_mmap_threshold()


def socket_buffer(size: int) -> memoryview:
    """Memory to read a frame that comes on a comm's socket into: glibc's,
    unless glibc would map it afresh"""
    if size < GLIBC_MMAP_THRESHOLD:
        return host_array(size)
    return host_buffer(size)


def host_buffer(size: int) -> memoryview:
    """Memory to receive a frame of ``size`` bytes into, in 2 MiB pages
    where the kernel has them, and in memory of a freed frame when one of
    the same capacity waits"""
    if size < SMALLEST or numpy is None or not hasattr(mmap, "MADV_HUGEPAGE"):
        return host_array(size)
    capacity = -(-size // HUGE_PAGE) * HUGE_PAGE
    mapping = freed.take(capacity)
    if mapping is None:
        try:
            # 2 MiB more, to start on a boundary
            mapping = mmap.mmap(-1, capacity + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
        except OSError:
            # Out of address space, or of mappings (``vm.max_map_count``;
            # each frame kept holds one): glibc's heap may still have room
            return host_array(size)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(mapping)) % HUGE_PAGE
    if whole := size - size % HUGE_PAGE:
        # The rest of the last stretch keeps 4 KiB pages: memory not used is
        # not taken.  A kernel without transparent huge pages refuses.
        with contextlib.suppress(OSError):
            mapping.madvise(mmap.MADV_HUGEPAGE, start, whole)
    # The array owns the frame: every view of the frame refers to it
    array = numpy.frombuffer(mapping, "u1", size, start)
    loop = weakref.ref(asyncio.get_running_loop())
    keep_at_most = parse_bytes(config("keep-freed"))  # read here, not in any thread
    weakref.finalize(
        array, freed.free, capacity, mapping, loop, keep_at_most
    ).atexit = False
    return array.data


class FreedBuffers:
    """The memory of received frames that were freed, kept a while for the
    next frames of the same capacity (appended by any thread, taken by the
    event loops of any)"""

    def __init__(self):
        # (capacity, mapping, when freed), oldest first
        self._entries: deque[tuple[int, mmap.mmap, float]] = deque()
        self._taking = threading.Lock()
        self._trimming: weakref.WeakSet = weakref.WeakSet()  # loops, trims due

    def nbytes(self) -> int:
        """How much memory is kept"""
        return sum(entry[0] for entry in list(self._entries))

    def clear(self) -> None:
        self._entries.clear()

    def take(self, capacity: int) -> mmap.mmap | None:
        """The freed mapping of ``capacity`` that waited least, if one waits"""
        with self._taking:  # from several loops; finalizers only append
            self._drop_expired()
            for entry in reversed(list(self._entries)):
                if entry[0] == capacity:
                    self._entries.remove(entry)
                    return entry[1]
        return None

    def free(
        self, capacity: int, mapping: mmap.mmap, loop: weakref.ref, keep_at_most: int
    ) -> None:
        """The last reference to a received frame went (in any thread): keep
        its memory a while, if the event loop of its reader runs to give it
        back then, and unless ``keep_at_most`` waits already"""
        loop = loop()
        if loop is None or not loop.is_running():
            return  # the mapping goes with its last reference
        if self.nbytes() + capacity > keep_at_most:
            return
        if loop not in self._trimming:
            try:
                loop.call_soon_threadsafe(self._trim_later, loop)
            except RuntimeError:  # closed meanwhile
                return
        self._entries.append((capacity, mapping, time.monotonic()))

    def _drop_expired(self) -> None:
        """Give back what waited ``KEEP_FOR`` (with ``_taking`` held)"""
        expired = time.monotonic() - KEEP_FOR
        while self._entries and self._entries[0][2] < expired:
            self._entries.popleft()  # the mapping goes with its last reference

    def _trim_later(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop not in self._trimming:
            self._trimming.add(loop)
            loop.call_later(KEEP_FOR, self._trim, loop)

    def _trim(self, loop: asyncio.AbstractEventLoop) -> None:
        """Give back the memory that waited ``KEEP_FOR``; look again later
        while some waits"""
        self._trimming.discard(loop)
        with self._taking:
            self._drop_expired()
        if self._entries:
            self._trim_later(loop)


freed = FreedBuffers()
