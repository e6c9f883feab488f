"""A process manager of one, for processes started without ``mpiexec``.

MPICH 5.0 gives every process started without a process manager (a
"singleton": plain ``python``, a nanny's worker, a ``LocalCluster`` worker)
the same job name, "singinit", and then refuses to connect two of them,
taking them for one process (pmodels/mpich#7805).  Before MPI_Init such a
process serves the PMI-1 wire protocol to itself from a thread, as the
process manager of a job of one with a name of its own; MPICH then connects
it to other processes as it would a job started with ``mpiexec -n 1``.

MPICH asks its process manager only in MPI_Init and MPI_Finalize, so the
thread serves only while MPI_Init runs: a thread that lived as long as the
process would count as leaked in the first test to use ``mpi://``.  What
MPI_Finalize asks (a barrier, then finalize from a C exit handler) is
answered in advance: Python 3.12 starts no thread at exit.

A process inherits its parent's process manager variables, which name a
connection that is not its own, when a rank of an ``mpiexec`` job starts it
(a nanny starting its worker); those are dropped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import sys
import threading
import uuid

logger = logging.getLogger(__name__)

# The process whose process manager the PMI variables name, for children
_USER = "DASK_MPI_PMI_USER"

_manager: _SelfManager | None = None  # when this process serves itself


def prepare_environment(MPI) -> bool:
    """Call before MPI_Init: make the process manager variables this
    process's own, serving them from a thread when nobody else does;
    whether a launcher started this process (or MPI is running already)"""
    global _manager
    env = os.environ
    launched = MPI.Is_initialized() or _has_process_manager()
    if not launched:
        for key in [k for k in env if k.startswith(("PMI_", "PMIX_"))]:
            del env[key]
        if MPI.Get_library_version().startswith("MPICH"):
            _manager = _SelfManager()
    env[_USER] = str(os.getpid())
    return launched


def _has_process_manager() -> bool:
    env = os.environ
    if env.get(_USER) == str(os.getppid()):
        return False  # the variables are the parent's
    if "PMIX_NAMESPACE" in env:
        # Open MPI's launcher, which sets no PMI_FD: one here is stale, from
        # an ancestor that started MPI alone (as a client may)
        return True
    if "PMI_FD" in env:  # Hydra's ranks, and srun --mpi=pmi2: a socketpair
        return _process_manager_at(env["PMI_FD"])
    return "PMI_PORT" in env


def _process_manager_at(fd: str) -> bool:
    """Whether file descriptor ``fd`` connects to a process manager: a Unix
    stream socket to another process.  One from an ancestor's variables
    (under a forkserver, say) may be any file of this process, or one of
    its own socket pairs (asyncio's self-pipe)"""
    try:
        dup = os.dup(int(fd))
    except (OSError, ValueError):  # closed, or not a number
        return False
    try:
        sock = socket.socket(fileno=dup)
    except OSError:  # not a socket
        os.close(dup)
        return False
    with sock:
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            return False
        if not hasattr(socket, "SO_PEERCRED"):  # not Linux
            return True
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        return int.from_bytes(creds[:4], sys.byteorder) != os.getpid()


def initialized() -> None:
    """Call once MPI_Init returned: stop serving, and take back the variables
    that named this process's own process manager: a child (a job submitted
    from here, or its children) would take them for its own"""
    if _manager is not None and _manager.serving():
        _manager.stop()
        for key in ["PMI_FD", "PMI_RANK", "PMI_SIZE"]:
            os.environ.pop(key, None)


def finalizing() -> None:
    """Call before MPI_Finalize, which waits in a barrier: answer it"""
    if _manager is not None:
        _manager.say("cmd=barrier_out rc=0")


def finalized() -> None:
    """Call after MPI_Finalize.  MPICH sends its last request, finalize,
    from a C exit handler, once Python has stopped every thread: answer it
    in advance."""
    if _manager is not None:
        _manager.say("cmd=finalize_ack rc=0")
        _manager.socket.detach()  # left open for that request: never closed


class _SelfManager:
    """The process manager of a job of one, this process: serves PMI-1 on
    a socket pair, from a thread, until stopped"""

    def __init__(self):
        self.socket, theirs = socket.socketpair()
        self.job = f"dask-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._kvs = {"PMI_process_mapping": "(vector,(0,1,1))"}
        self._stop = threading.Event()
        os.environ.update(PMI_FD=str(theirs.detach()), PMI_RANK="0", PMI_SIZE="1")
        self._thread: threading.Thread | None = threading.Thread(
            target=self._serve, name="MPI-process-manager", daemon=True
        )
        self._thread.start()

    def serving(self) -> bool:
        return self._thread is not None

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def say(self, reply: str) -> None:
        with contextlib.suppress(OSError):
            self.socket.sendall(reply.encode() + b"\n")

    def _serve(self) -> None:
        """Answer the PMI-1 requests of MPI_Init until stopped"""
        replies = {
            "init": "cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=1",
            "get_maxes": "cmd=maxes rc=0 kvsname_max=256 keylen_max=64 vallen_max=1024",
            "get_appnum": "cmd=appnum rc=0 appnum=0",
            "get_my_kvsname": f"cmd=my_kvsname rc=0 kvsname={self.job}",
            "get_universe_size": "cmd=universe_size rc=0 size=1",
            "barrier_in": "cmd=barrier_out rc=0",
            "finalize": "cmd=finalize_ack rc=0",
        }
        pending = b""
        readable = select.poll()  # select() takes no fd from 1024 on
        readable.register(self.socket, select.POLLIN)
        while not self._stop.is_set():
            if not readable.poll(50):
                continue
            data = self.socket.recv(4096)
            if not data:
                return
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                request = dict(
                    field.split("=", 1)
                    for field in line.decode().split()
                    if "=" in field
                )
                cmd = request.get("cmd", "")
                if cmd == "put":
                    self._kvs[request["key"]] = request.get("value", "")
                    reply = "cmd=put_result rc=0"
                elif cmd == "get":
                    value = self._kvs.get(request.get("key", ""))
                    reply = (
                        f"cmd=get_result rc=0 value={value}"
                        if value is not None
                        else "cmd=get_result rc=-1 msg=key_not_found"
                    )
                elif cmd in replies:
                    reply = replies[cmd]
                else:  # spawn, publish_name, ...: a job of one cannot
                    logger.warning("MPI asked its process manager for %r", line)
                    reply = f"cmd={cmd} rc=-1 msg=unsupported"
                self.socket.sendall(reply.encode() + b"\n")
