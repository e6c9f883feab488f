"""Whether a peer process on this host still has its memory, and copies
from it.

Between processes of one host that can read each other's memory, a large
frame does not go through MPI: its reader copies it straight from the
writer's memory (:meth:`LocalPeer.read`), and gets an error, not an abort,
if the writer died.  For the frames that do go through MPI (GPU frames, or
where ``local-copy`` is off):

UCX, MPICH's default netmod, copies a message straight out of the memory of a
sender on the same host (CMA, ``process_vm_readv``), and aborts the process
that copies when that memory is gone: MPICH gives UCX no error handler.  A
killed sender's messages are still queued in MPI, and any call into MPI may
start to copy one.  So before each call into MPI, the progress engine cancels
the receives from senders that died, found out with the very copy UCX would
make: one byte, from an address each process names in its mpi:// handshake.
The kernel takes a killed process's memory away before it closes its sockets,
so its TCP connection tells too late.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import select
import socket
import sys
from typing import TYPE_CHECKING

from distributed.comm.mpi_startup import process_id

if TYPE_CHECKING:
    from distributed.comm.mpi_hello import Peer


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


# The byte of this process that peers on its host read
_BEACON = ctypes.c_char(b"\x01")


def beacon() -> int:
    """The address to name in the handshake"""
    _let_peers_read()
    return ctypes.addressof(_BEACON)


@functools.cache
def _let_peers_read() -> None:
    """Let processes of this user read this process's memory (its beacon, the
    frames it lends) where Yama's ``ptrace_scope`` 1 (Ubuntu's default) lets
    only its ancestors: what UCX and Open MPI do for their own copies from a
    peer's memory.  Without Yama, or with a stricter scope, nothing changes."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)


_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1)


def pid_namespace() -> int | None:
    """This process's PID namespace, to name in the handshake: UCX copies
    from a peer's memory only in the same one (it compares them), and
    process_vm_readv could not find the peer's pid outside it"""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


class LocalPeer:
    """A peer process on this host, whose memory UCX reads"""

    def __init__(self, pid: int, address: int):
        self.pid = pid
        self._byte = ctypes.c_char()
        self._local = _IOVec(ctypes.addressof(self._byte), 1)
        self._remote = _IOVec(address, 1)

    @classmethod
    def find(cls, peer: Peer) -> LocalPeer | None:
        """The peer of a handshake if it runs on this host (and this is
        Linux, where UCX copies from local peers) and named its beacon"""
        if sys.platform != "linux" or peer.beacon is None:
            return None
        if peer.host != socket.gethostname() or peer.process == process_id():
            return None
        if peer.pid_namespace != pid_namespace():
            return None  # a container on this host: UCX does not read it
        return cls(peer.pid, peer.beacon)

    def died(self) -> bool:
        """Whether its memory is gone: it died, or is dying"""
        return self._read_beacon() == errno.ESRCH

    def readable(self) -> bool:
        """Whether this process may read the peer's memory (the kernel's
        ptrace rules: same user, Yama's ``ptrace_scope``, seccomp)"""
        return self._read_beacon() == 0

    def _read_beacon(self) -> int:
        """0 if the peer's beacon could be read, else why not (an errno)"""
        read = _process_vm_readv(
            self.pid, ctypes.byref(self._local), 1, ctypes.byref(self._remote), 1, 0
        )
        if read == 1:
            return 0
        return ctypes.get_errno() if read < 0 else errno.EFAULT

    def read(self, address: int, into: int, nbytes: int) -> None:
        """Copy ``nbytes`` at ``address`` in the peer's memory to ``into`` in
        this process's; OSError if they cannot all be read: ``ESRCH`` if the
        peer died, ``EFAULT`` if it no longer has them"""
        while nbytes:
            local, remote = _IOVec(into, nbytes), _IOVec(address, nbytes)
            n = _process_vm_readv(
                self.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0
            )
            if n <= 0:  # 0: a partial read that read nothing
                code = ctypes.get_errno() if n < 0 else errno.EFAULT
                raise OSError(code, os.strerror(code))
            address, into, nbytes = address + n, into + n, nbytes - n


def hung_up(sock: socket.socket) -> bool:
    """Whether the process at the other end of a TCP connection closed it,
    or died, as the kernel knows before anyone reads: about a process on
    another host, the only sign there is here"""
    # Asked before every send over MPI: one poll, which says so even with
    # bytes from the peer not read yet (POLLRDHUP; POLLHUP and POLLERR come
    # unasked)
    poll = select.poll()
    try:
        poll.register(sock, select.POLLRDHUP)
    except ValueError:  # closed at this end already
        return True
    return bool(poll.poll(0))


def death_watch():
    """``died(peer)``: whether a peer on this host (a :class:`LocalPeer`)
    died, asked once per process; a peer not on this host (None) never is"""
    dead: dict[int, bool] = {}

    def died(peer: LocalPeer | None) -> bool:
        if peer is None:
            return False
        if peer.pid not in dead:
            dead[peer.pid] = peer.died()
        return dead[peer.pid]

    return died


def _load():
    libc = ctypes.CDLL(None, use_errno=True)
    function = libc.process_vm_readv
    function.restype = ctypes.c_ssize_t
    function.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong]
    function.argtypes += [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    return function


_process_vm_readv = _load() if sys.platform == "linux" else None
