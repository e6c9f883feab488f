"""Device frames that a reader copies from a writer's GPU memory (CUDA IPC),
between processes of one host.

The writer exports the IPC handle of the allocation that holds each frame
(CuPy's and RMM's pools hand out pieces of larger allocations: the handle is
the allocation's, with the frame's offset in it), and keeps the frame until
the reader says it has it; the reader maps the allocation and copies device
to device.  The frames come over an MPI channel (``mpi_routes.DeviceIPC``)
or lent on the comm's socket (``mpi_lending``), and both read through one
:class:`Mappings` per writer: opening a mapping costs far more than a copy,
and a process may map an allocation of another only once (CUDA: "already
mapped").
"""

from __future__ import annotations

import collections
import struct
import threading

from distributed.comm import mpi_gpu
from distributed.comm.core import CommClosedError
from distributed.comm.mpi_copy import why

# Before each handle in a head's extra bytes: its length, the address and
# size of the writer's allocation, and the frame's offset in it
_RECORD = struct.Struct("<HQQQ")
# cudaMalloc's granularity: an allocation less than this larger than a frame
# holds that frame alone
_GRANULARITY = 2 * 2**20


def export(frame) -> bytes | None:
    """What a head's extra bytes say of a device frame for its reader to
    copy it; None if its memory cannot be exported (a stream-ordered pool's)"""
    if not mpi_gpu.nbytes(frame):  # nothing to copy, nor any allocation
        return _RECORD.pack(0, 0, 0, 0)
    exported = mpi_gpu.device().export(frame)
    if exported is None:
        return None
    handle, base, nbytes, offset = exported
    return _RECORD.pack(len(handle), base, nbytes, offset) + handle


# The writers whose memory this process failed to map
unmappable: set[str] = set()


class Mappings:
    """This process's mappings of one writer's allocations, kept while
    anything reads from that writer, the least recently used closed past
    :data:`MAPPINGS`, or past :data:`MAPPED_BYTES` of allocations that each
    held one frame.  A mapping keeps its allocation even once the writer
    frees it (UCX's unbounded cache ran GPUs out of memory, openucx/ucx#4410),
    which such allocations soon are (``cudaMalloc`` for one array), unlike
    the larger ones of a pool (RMM's) that frames are pieces of.  One whose
    address the writer freed and reallocated is mapped afresh."""

    MAPPINGS = 64
    MAPPED_BYTES = 2**30
    _of: dict[str, Mappings] = {}  # by the writer's process id
    # Comms of several event loops (threads) may share them: their
    # bookkeeping, and the mappings, change under this lock
    _lock = threading.RLock()

    def __init__(self, process: str, writer):
        self._process = process
        self._writer = writer  # a LocalPeer
        self._users = 0
        self._copying = 0
        # By the writer's address, least recently used first: its
        # allocation's handle and size, what of it counts against
        # MAPPED_BYTES, and the mapping
        self._mapped: collections.OrderedDict = collections.OrderedDict()
        self._nbytes = 0  # that count, in all
        self._in_use: collections.Counter = collections.Counter()  # copied from

    @classmethod
    def of(cls, process: str, writer) -> Mappings:
        """The mappings of the process ``process`` (``writer``: its
        ``LocalPeer``), for a user that calls :meth:`release` once done"""
        with cls._lock:
            mappings = cls._of.get(process)
            if mappings is None:
                mappings = cls._of[process] = cls(process, writer)
            mappings._users += 1
        return mappings

    def release(self) -> None:
        """A user is done: the mappings close once no user is left, nor any
        copy from them under way"""
        with self._lock:
            self._users -= 1
            self._close_if_unused()

    def _close_if_unused(self) -> None:
        # Kept for new users until then: a second object would map the same
        # allocations again (CUDA: "already mapped")
        if self._users or self._copying:
            return
        if self._of.get(self._process) is self:
            del self._of[self._process]
        self.forget()

    async def copy(self, frames: list[tuple[int, int]], extra) -> list:
        """The device frames of these (size, word) entries of a head, copied
        into buffers of this process's device; CommClosedError if the
        writer's memory is gone"""
        device = mpi_gpu.device()
        received = [device.buffer(size) for size, _ in frames]
        mpi_gpu.synchronize()  # the allocations, before anything writes
        stream = mpi_gpu.copy_stream(device)
        copies, used, writer_died = [], [], False
        with self._lock:
            self._copying += 1
        try:
            with self._lock:
                for frame, (size, word) in zip(received, frames):
                    if not size:
                        continue
                    n, base, nbytes, offset = _RECORD.unpack_from(extra, word)
                    start = word + _RECORD.size
                    held = nbytes if nbytes - size < _GRANULARITY else 0
                    handle = bytes(extra[start : start + n])
                    mapping = self._map(handle, base, nbytes, held)
                    self._in_use[base] += 1
                    used.append(base)
                    dst = mpi_gpu.pointer(frame)
                    copies.append(mapping.copy_to(dst, offset, size, stream))
            await mpi_gpu.wait(copies)
        except BaseException as e:
            # Cancelled, say: the GPU copies all the same, so no mapping may
            # close, nor buffer go, before it is done
            mpi_gpu.finish(copies)
            if isinstance(e, OSError):
                writer_died = True
                raise CommClosedError(
                    f"cannot copy device frames from the writer: {why(e)}"
                ) from e
            raise
        finally:
            with self._lock:
                self._in_use -= collections.Counter(used)
                self._copying -= 1
                if writer_died:  # its allocations are gone
                    self.forget()
                else:
                    self._evict()
                self._close_if_unused()  # released meanwhile
        return received

    def _map(self, handle: bytes, base: int, size: int, held: int):
        cached = self._mapped.get(base)
        if cached is not None and cached[0] == handle:
            self._mapped.move_to_end(base)
            return cached[3]
        # Allocations that the writer freed where this one is now: CUDA would
        # not map it ("already mapped") while they are
        for other, (_, other_size, _, _) in list(self._mapped.items()):
            if other < base + size and base < other + other_size:
                self._close(other)
        try:
            mapping = mpi_gpu.device().open(handle, self._writer)
        except Exception as e:  # a GPU that this process may not map
            unmappable.add(self._process)
            raise CommClosedError(
                f"cannot map the writer's GPU memory ({e}): its next comms "
                "move device frames through MPI"
            ) from e
        self._mapped[base] = handle, size, held, mapping
        self._nbytes += held
        return mapping

    def _evict(self) -> None:
        """Close the least recently used mappings past the limits, but the
        latest and those copied from now"""
        for base in list(self._mapped)[:-1]:
            too_many = len(self._mapped) > self.MAPPINGS
            if not too_many and self._nbytes <= self.MAPPED_BYTES:
                return
            if not self._in_use[base] and (too_many or self._mapped[base][2]):
                self._close(base)

    def _close(self, base: int) -> None:
        _, _, held, mapping = self._mapped.pop(base)
        self._nbytes -= held
        mapping.close()

    def forget(self) -> None:
        """Close every mapping but those copied from now"""
        for base in list(self._mapped):
            if not self._in_use[base]:
                self._close(base)
