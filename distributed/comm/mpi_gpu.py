"""GPU memory on mpi:// comms.

distributed's ``"cuda"`` serializers keep CuPy, Numba, RMM and cuDF data on
the GPU: their frames are device buffers (objects with
``__cuda_array_interface__``).  An mpi:// comm between two processes that both
have a GPU serializes with them first, as distributed-ucxx does, and sends each
device frame one of two ways:

- direct, when the MPI libraries of both ends are CUDA-aware: the device
  buffers go to ``Isend``/``Irecv`` as they are (mpi4py passes their pointers
  on), in ``chunk-size`` pieces like host frames;
- staged, otherwise (no MPI from PyPI is CUDA-aware): each ``chunk-size``
  piece is copied between the GPU and one of a few pinned host slots, on a
  CUDA stream of its own, so that the copy of one piece overlaps the transfer
  of the piece before.  Slots are allocated once per process and reused.

Between two processes of one host, a device frame that the writer can export
(CUDA IPC) takes neither: the reader maps the writer's allocation and copies
device to device (``mpi_ipc``: lent on the comm's socket, or named over the
MPI channel by ``mpi_routes.DeviceIPC``); see :class:`Mapping`.

A process without a GPU (or without CuPy) says so in the handshake and is sent
host frames: what ``tcp://`` would send it.

The few GPU operations all this needs (allocate, pin, copy on a stream, poll
an event, synchronize) are a :class:`Device`: CUDA through CuPy
(:class:`CuPyDevice`), or, with ``distributed.comm.mpi.device-backend: host``,
host memory that passes for GPU memory (:class:`HostDevice`), so that tests
drive the whole GPU path, staged and direct, on machines without a GPU.

Run ``python -m distributed.comm.mpi_probe`` on a GPU node to see which way
mpi:// will go there.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import functools
import importlib.util
import itertools
import logging
import math
import os
import struct
import threading
from collections.abc import Awaitable, Callable
from typing import Protocol

from distributed.comm.mpi_startup import config

logger = logging.getLogger(__name__)

# Serializers of an mpi:// comm between two processes with a GPU
SERIALIZERS = ("cuda", "dask", "pickle", "error")

DEPTH = 4  # pinned slots per staged message: chunks in flight at once


def is_device(frame) -> bool:
    return not isinstance(frame, (bytes, bytearray, memoryview)) and hasattr(
        frame, "__cuda_array_interface__"
    )


def nbytes(frame) -> int:
    """A frame's size; ValueError for a device frame with gaps, which no
    route moves (those of Dask's serializers have none)"""
    if not is_device(frame):
        return memoryview(frame).nbytes
    cai = frame.__cuda_array_interface__
    shape = cai["shape"]
    itemsize = step = int(cai["typestr"][2:].split("[")[0])  # "<M8[ns]": 8
    for n, stride in zip(reversed(shape), reversed(cai.get("strides") or [])):
        if n > 1 and stride != step:
            raise ValueError(f"mpi:// cannot send a strided device frame: {cai}")
        step *= n
    return math.prod(shape) * itemsize


def pointer(frame) -> int:
    return frame.__cuda_array_interface__["data"][0]


class DeviceSlice:
    """Bytes ``[offset, offset + size)`` of a contiguous device buffer, as an
    object that mpi4py passes to MPI as a device pointer"""

    def __init__(self, frame, offset: int, size: int):
        self.owner = frame  # kept alive while MPI uses the slice
        self.__cuda_array_interface__ = {
            "data": (pointer(frame) + offset, False),
            "shape": (size,),
            "typestr": "|u1",
            "strides": None,
            "version": 3,
            "stream": None,  # synchronized before MPI sees it
        }


class Device(Protocol):
    """The GPU operations of this module; ``device-backend`` picks one"""

    def buffer(self, size: int):
        """An uninitialized device frame of ``size`` bytes"""

    def pinned(self, size: int):
        """``size`` bytes of page-locked host memory, as a NumPy array"""

    def stream(self):
        """A new stream, which does not wait for the default stream"""

    def copy(self, dst: int, src: int, size: int, to_device: bool, stream):
        """Start copying ``size`` bytes at ``src`` to ``dst``, from the host to
        the device or back, on ``stream``: an event, ``done`` once copied, that
        ``synchronize()`` waits for"""

    def synchronize(self, frames) -> None:
        """Wait for the GPU work that writes ``frames``, or allocated them"""

    def export(self, frame) -> tuple[bytes, int, int, int] | None:
        """The IPC handle of the allocation that holds a device frame, the
        allocation's address and size, and the frame's offset in it; None if
        it cannot be exported (memory of a stream-ordered pool)"""

    def open(self, handle: bytes, writer) -> Mapping:
        """Map an allocation of the process ``writer`` (a ``LocalPeer``) by
        its IPC handle"""

    def mappable(self) -> list[str]:
        """The devices whose allocations this process may map, by PCI bus
        id: its own first, then those it sees and can access as a peer"""


class Mapping(Protocol):
    """Another process's allocation, mapped into this one's"""

    def copy_to(self, dst: int, offset: int, size: int, stream):
        """Start copying ``size`` bytes at ``offset`` of the allocation to
        device memory at ``dst``, on ``stream``: an event, ``done`` once
        copied (raising OSError if the writer died), that ``synchronize()``
        waits for"""

    def close(self) -> None:
        """Unmap it"""


def device() -> Device | None:
    """This process's GPU, as ``distributed.comm.mpi.device-backend`` says;
    None without one"""
    return _device(config("device-backend"))


@functools.cache
def _device(backend: str) -> Device | None:
    if backend == "host":
        return HostDevice()
    if backend != "cupy":
        raise ValueError(
            "distributed.comm.mpi.device-backend must be cupy or host, "
            f"not {backend!r}"
        )
    # Ask only when CuPy is installed: a CPU cluster never loads CUDA
    if importlib.util.find_spec("cupy") is None:
        return None
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return CuPyDevice()
    except Exception:  # no driver, no device
        pass
    return None


def _usable_rmm():
    """RMM where it is installed and allocates; an RMM that cannot (a missing
    CUDA binding, a library for another CUDA) must not stop every receive"""
    if importlib.util.find_spec("rmm") is None:
        return False
    try:
        import rmm

        rmm.DeviceBuffer(size=1)
    except Exception as e:
        logger.warning(
            "RMM is installed but cannot allocate (%r): mpi:// receives device "
            "frames into CuPy arrays",
            e,
        )
        return False
    return rmm


class CuPyDevice:
    """CUDA, through CuPy"""

    def __init__(self):
        import cupy

        self._cupy = cupy
        self._rmm = None  # the module, False where it cannot be used; first use

    def buffer(self, size: int):
        # distributed's RMM deserializer requires an rmm.DeviceBuffer
        if self._rmm is None:
            self._rmm = _usable_rmm()
        if self._rmm:
            return self._rmm.DeviceBuffer(size=size)
        return self._cupy.empty(size, dtype="u1")

    def pinned(self, size: int):
        import numpy

        memory = self._cupy.cuda.alloc_pinned_memory(size)
        return numpy.frombuffer(memory, "u1", size)  # holds memory

    def stream(self):
        return self._cupy.cuda.Stream(non_blocking=True)

    def copy(self, dst: int, src: int, size: int, to_device: bool, stream):
        runtime = self._cupy.cuda.runtime
        kind = runtime.memcpyHostToDevice if to_device else runtime.memcpyDeviceToHost
        runtime.memcpyAsync(dst, src, size, kind, stream.ptr)
        done = self._cupy.cuda.Event(block=False, disable_timing=True)
        done.record(stream)
        return done

    def synchronize(self, frames) -> None:
        # The legacy default stream waits for the blocking streams, as
        # distributed-ucxx relies on too
        runtime = self._cupy.cuda.runtime
        runtime.streamSynchronize(0)
        for frame in frames:
            stream = frame.__cuda_array_interface__.get("stream")
            if stream not in (None, 0, 1, 2):  # a stream of its own
                runtime.streamSynchronize(stream)

    def export(self, frame):
        # A handle is for a whole cudaMalloc allocation, of which CuPy's and
        # RMM's pools hand out pieces: the base's handle, and an offset.
        # CuPy has no call for the base: the driver's, through ctypes
        address = pointer(frame)
        base, size = ctypes.c_uint64(), ctypes.c_size_t()

        def find() -> bool:
            get = _libcuda().cuMemGetAddressRange_v2
            at = ctypes.c_uint64(address)
            return not get(ctypes.byref(base), ctypes.byref(size), at)

        # The driver's call needs a context current in this thread, which a
        # thread that made no call of CUDA's runtime yet has not: the runtime
        # makes its own current (cudaFree(0))
        if not find():
            self._cupy.cuda.runtime.free(0)
            if not find():
                return None  # not device memory (or none: zero bytes)
        try:  # fails for stream-ordered pools (cudaMallocAsync)
            handle = self._cupy.cuda.runtime.ipcGetMemHandle(base.value)
        except self._cupy.cuda.runtime.CUDARuntimeError:
            return None
        return bytes(handle), base.value, size.value, address - base.value

    def open(self, handle, writer):
        return _CuPyMapping(self._cupy, handle)

    @functools.cache
    def mappable(self):
        runtime = self._cupy.cuda.runtime
        own = runtime.getDevice()
        # An IPC handle of another GPU's memory opens only with peer access
        # (NVLink, or PCIe where the platform allows it)
        devices = [own] + [
            i
            for i in range(runtime.getDeviceCount())
            if i != own and runtime.deviceCanAccessPeer(own, i)
        ]
        try:
            return [runtime.deviceGetPCIBusId(i) for i in devices]
        except Exception:  # their numbers, then: a mapping that fails tells
            return [str(i) for i in devices]


@functools.cache
def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


class _CuPyMapping:
    def __init__(self, cupy, handle: bytes):
        self._cupy = cupy
        runtime = cupy.cuda.runtime
        flags = runtime.cudaIpcMemLazyEnablePeerAccess
        self._base = runtime.ipcOpenMemHandle(handle, flags)

    def copy_to(self, dst, offset, size, stream):
        runtime = self._cupy.cuda.runtime
        kind = runtime.memcpyDeviceToDevice
        runtime.memcpyAsync(dst, self._base + offset, size, kind, stream.ptr)
        done = self._cupy.cuda.Event(block=False, disable_timing=True)
        done.record(stream)
        return done

    def close(self):
        self._cupy.cuda.runtime.ipcCloseMemHandle(self._base)


class HostDevice:
    """Host memory that passes for GPU memory, for tests: its buffers expose
    ``__cuda_array_interface__``, which MPI reads as host memory.  A copy is
    made when its event is polled and found done, 0 to 3 polls after it was
    started: whoever uses a slot before its copy is done gets stale bytes."""

    def __init__(self):
        self.copies = 0  # started so far
        self.opened = 0  # IPC handles opened so far
        # Mappings closed while a copy from them was under way (on a GPU:
        # undefined)
        self.closed_under_copies = 0
        self.mapped: dict[tuple[int, int], int] = {}  # size, by (pid, base)

    def buffer(self, size: int):
        return HostBuffer(size)

    def pinned(self, size: int):
        import numpy

        return numpy.empty(size, "u1")

    def stream(self):
        return None

    def copy(self, dst: int, src: int, size: int, to_device: bool, stream):
        self.copies += 1
        copy = functools.partial(ctypes.memmove, dst, src, size)
        return _HostCopy(copy, polls=self.copies % 4)

    def synchronize(self, frames) -> None:
        pass  # nothing runs behind the host's back but copies, awaited each

    def export(self, frame):
        if not frame.nbytes:  # as CUDA: no allocation holds zero bytes
            return None
        allocation = frame.pool or frame
        base, size = allocation.array.ctypes.data, allocation.nbytes
        handle = _HOST_HANDLE.pack(base, size, allocation.id)
        return handle, base, size, frame.array.ctypes.data - base

    def open(self, handle, writer):
        """As CUDA does: a handle of an allocation where this process still
        maps another of the writer's is "already mapped" """
        base, nbytes, _ = _HOST_HANDLE.unpack(handle)
        for (pid, other), size in self.mapped.items():
            if pid == writer.pid and other < base + nbytes and base < other + size:
                raise RuntimeError(f"already mapped: {base:#x} of process {pid}")
        key = (writer.pid, base)
        self.opened += 1
        self.mapped[key] = nbytes
        return _HostMapping(self, writer, key, nbytes)

    def mappable(self):
        """As a process that CUDA_VISIBLE_DEVICES restricts, where it is set"""
        return os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")


class HostBuffer:
    """A device frame of :class:`HostDevice`: an allocation of its own, or
    bytes ``[offset, offset + size)`` of a ``pool``'s (as CuPy's and RMM's
    pools hand out).  Freed, it is overwritten first, so that a reader
    copying it after the writer let it go gets other bytes"""

    _ids = itertools.count(1)

    def __init__(self, size: int, pool: HostBuffer | None = None, offset: int = 0):
        import numpy

        self.pool = pool
        if pool is None:
            self.array = numpy.empty(size, "u1")
            self.id = next(self._ids)  # tells a reallocated address from the old
        else:
            self.array = pool.array[offset : offset + size]
        self.nbytes = size
        self.__cuda_array_interface__ = {
            "data": (self.array.ctypes.data, False),
            "shape": (size,),
            "typestr": "|u1",
            "strides": None,
            "version": 3,
            "stream": None,
        }

    def __reduce__(self):
        # A test must see a frame that travels other than as a device frame
        raise TypeError("a HostDevice frame travels as a device frame only")

    def __del__(self):
        self.array.fill(0xDB)


_HOST_HANDLE = struct.Struct("<QQQ")  # a HostBuffer's address, size and id


class _HostMapping:
    """A HostBuffer of another process on this host, copied from with
    ``process_vm_readv``, as late as a HostDevice copy is made; a copy made
    once the mapping is closed fails (on a GPU: undefined)"""

    def __init__(self, device: HostDevice, writer, key: tuple[int, int], nbytes: int):
        self._device, self._writer, self._key = device, writer, key
        self._nbytes = nbytes
        self._closed = False
        self._pending = 0  # copies started, not yet made

    def copy_to(self, dst, offset, size, stream):
        if offset + size > self._nbytes:
            raise ValueError("a copy beyond the allocation")
        self._device.copies += 1
        self._pending += 1
        read = functools.partial(self._read, self._key[1] + offset, dst, size)
        return _HostCopy(read, polls=self._device.copies % 4)

    def _read(self, address: int, dst: int, size: int) -> None:
        self._pending -= 1
        if self._closed:
            raise RuntimeError("a copy from a mapping closed before it was done")
        self._writer.read(address, dst, size)

    def close(self):
        self._closed = True
        self._device.closed_under_copies += bool(self._pending)
        self._device.mapped.pop(self._key, None)


class _HostCopy:
    """A copy of :class:`HostDevice`, ``copy()``, made once ``done`` was asked
    ``polls`` times more"""

    def __init__(self, copy: Callable[[], object], polls: int):
        self._copy: Callable | None = copy
        self._polls = polls

    @property
    def done(self) -> bool:
        if self._polls:
            self._polls -= 1
            return False
        self.synchronize()
        return True

    def synchronize(self) -> None:
        if self._copy:
            copy, self._copy = self._copy, None
            copy()


def has_gpu() -> bool:
    """Whether this process can hold frames on a GPU"""
    return device() is not None


def cuda_aware(MPI) -> tuple[bool, str]:
    """Whether MPI can read and write GPU memory, and how that was decided"""
    setting = config("cuda-aware")
    if isinstance(setting, str):  # from an environment variable, say
        setting = {"true": True, "false": False}.get(setting.lower(), setting)
    if setting in (True, False):
        return setting, f"distributed.comm.mpi.cuda-aware is {str(setting).lower()}"
    if setting != "auto":
        raise ValueError(
            "distributed.comm.mpi.cuda-aware must be auto, true or false, "
            f"not {setting!r}"
        )
    return _query_cuda_support(MPI)


@functools.cache
def _query_cuda_support(MPI) -> tuple[bool, str]:
    library = ctypes.CDLL(MPI.__file__)  # its symbols include the MPI library's
    vendor = MPI.get_vendor()[0]
    if hasattr(library, "MPIX_GPU_query_support"):  # MPICH 4.1 and later
        supported = ctypes.c_int(0)
        if library.MPIX_GPU_query_support(0, ctypes.byref(supported)) == 0:
            return bool(supported.value), "MPIX_GPU_query_support(CUDA)"
    # Open MPI's query; older MPICH asserts in its own
    if vendor == "Open MPI" and hasattr(library, "MPIX_Query_cuda_support"):
        return bool(library.MPIX_Query_cuda_support()), "MPIX_Query_cuda_support()"
    return False, f"{vendor} has no query for CUDA support: taken as not CUDA-aware"


def hello(MPI) -> dict | None:
    """What this process says of its GPU in the handshake: None without one"""
    if not has_gpu():
        return None
    return {
        "cuda_aware": cuda_aware(MPI)[0],
        "ipc": bool(config("device-ipc")),
        "devices": device().mappable(),
    }


async def wait(events: list) -> None:
    """Return once every event is ``done``: a copy takes tens of
    microseconds, so poll, letting the progress engine test the transfers
    in flight meanwhile"""
    polls = 0
    for event in events:
        while not event.done:
            await asyncio.sleep(0 if polls < 1000 else 1e-4)
            polls += 1


def finish(events: list) -> None:
    """Block until the copies of ``events`` are made, whatever became of
    what awaited them: the GPU makes them anyway, so neither the mappings
    they read nor the buffers they write may go before"""
    for event in events:
        try:
            event.synchronize()
        except Exception:  # a copy that failed is made too
            pass


def path(mine: dict | None, theirs: dict | None) -> str | None:
    """How device frames travel between two processes, which both ends work
    out alike: None (host frames only: one of them has no GPU), "direct" or
    "staged" """
    if not (mine and theirs):
        return None
    return "direct" if mine["cuda_aware"] and theirs["cuda_aware"] else "staged"


def device_buffer(size: int):
    """An uninitialized device frame of ``size`` bytes, to receive into"""
    return device().buffer(size)


def synchronize(frames=()) -> None:
    """Wait for the GPU work that writes ``frames``, or that allocated them:
    MPI and copies on another stream would not"""
    device().synchronize(frames)


def pieces(size: int, chunk_size: int) -> list[tuple[int, int]]:
    """The (offset, size) of each chunk of a frame of ``size`` bytes"""
    return [(i, min(chunk_size, size - i)) for i in range(0, size, chunk_size)]


class _Stager:
    """A device's pinned host slots and copy stream.  A staged message takes
    up to ``DEPTH`` slots and gives them back once its transfers are done;
    the pool grows to the most messages ever staged at once, and never makes
    one wait for a slot (so transfers cannot wait on each other through it).
    """

    def __init__(self, device: Device):
        self.device = device
        self.stream = device.stream()
        self._free: dict[int, list] = collections.defaultdict(list)  # by size
        self._lock = threading.Lock()  # comms of several event loops take

    def take(self, size: int, count: int) -> list:
        """``count`` pinned buffers (NumPy arrays) of ``size`` bytes"""
        with self._lock:
            free = self._free[size]
            slots, self._free[size] = free[:count], free[count:]
        while len(slots) < count:
            slots.append(self.device.pinned(size))
        return slots

    def give_back(self, slots: list) -> None:
        with self._lock:
            self._free[slots[0].nbytes].extend(slots)

    async def copy(self, dst: int, src: int, size: int, to_device: bool) -> None:
        """Copy on the stager's stream; return once it is done"""
        copy = self.device.copy(dst, src, size, to_device, self.stream)
        try:
            await wait([copy])
        except BaseException:
            finish([copy])  # before its slot may go, to be reused by another
            raise


@functools.cache
def _stager(device: Device) -> _Stager:
    return _Stager(device)


@functools.cache
def copy_stream(device: Device):
    """The stream of the copies from other processes' allocations"""
    return device.stream()


def _staged_chunks(frames, chunk_size: int) -> list[tuple[int, int]]:
    """The (address, size) of each chunk of the device ``frames``, in the
    order both ends move them"""
    return [
        (pointer(frame) + offset, size)
        for frame in frames
        for offset, size in pieces(nbytes(frame), chunk_size)
    ]


async def send_staged(
    frames,
    chunk_size: int,
    post: Callable[[object], asyncio.Future],
    sent: Callable[[asyncio.Future], Awaitable],
) -> None:
    """Send the device ``frames`` through pinned slots, one message's frames
    through one set of them: ``post(buffer)`` starts the transfer of one
    chunk, ``sent(future)`` waits for one to be sent.  Returns once the last
    chunk is posted; the slots are reused once the last ones are sent."""
    chunks = _staged_chunks(frames, chunk_size)
    if not chunks:
        return
    stager = _stager(device())
    slots = stager.take(chunk_size, min(DEPTH, len(chunks)))
    depth = len(slots)
    posted: list[asyncio.Future] = []
    for i, (source, size) in enumerate(chunks):
        slot = slots[i % depth]
        if i >= depth:
            await sent(posted[i - depth])  # the slot is free again
        await stager.copy(slot.ctypes.data, source, size, to_device=False)
        posted.append(post(slot[:size]))

    def reuse(last: asyncio.Future) -> None:
        if not last.cancelled() and last.exception() is None:
            stager.give_back(slots)  # else MPI may still read them: drop them

    asyncio.gather(*posted[-depth:]).add_done_callback(reuse)


async def recv_staged(
    frames,
    chunk_size: int,
    post: Callable[[object], asyncio.Future],
) -> None:
    """Receive into the device ``frames`` through pinned slots:
    ``post(buffer)`` starts the receive of one chunk"""
    chunks = _staged_chunks(frames, chunk_size)
    if not chunks:
        return
    stager = _stager(device())
    slots = stager.take(chunk_size, min(DEPTH, len(chunks)))
    depth = len(slots)
    posted = collections.deque(
        post(slot[:size]) for slot, (_, size) in zip(slots, chunks)
    )
    for i, (target, size) in enumerate(chunks):
        slot = slots[i % depth]
        await posted.popleft()
        await stager.copy(target, slot.ctypes.data, size, to_device=True)
        if i + depth < len(chunks):  # the slot is free again
            posted.append(post(slot[: chunks[i + depth][1]]))
    stager.give_back(slots)
