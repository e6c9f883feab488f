"""Starting and finishing MPI, and what a process knows of itself.

MPI starts on first use of an ``mpi://`` address (:func:`start_mpi`), never on
``import distributed``: in a helper thread and through ctypes, so that this
process goes on while ``MPI_Init`` waits (under ``mpiexec`` it returns only once
every rank of the job has called it). It ends at exit, after Dask's own exit
hooks and those given to :func:`before_finalize`, unless MPI_Finalize would
crash (see :func:`skip_finalize`).
A process whose next call into MPI would abort it calls MPI no more (see
:func:`stop_mpi`).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import ctypes
import functools
import glob
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import dask
import psutil
from dask.utils import parse_bytes

from distributed.comm import mpi_library, mpi_pmi

logger = logging.getLogger(__name__)


class _ThisProcess:
    """What this process knows of its MPI, from its start to its exit; its
    name is redone in a forked child"""

    def __init__(self):
        self.lock = threading.Lock()  # guards init
        self.init: concurrent.futures.Future | None = None  # MPI_Init, once started
        self.name: str | None = None  # process_id()
        self.before_finalize: list[Callable] = []  # called with mpi4py.MPI at exit
        self.skip_finalize: str | None = None  # why MPI_Finalize must not run
        self.stopped: str | None = None  # why it calls MPI no more: see stop_mpi
        self.finalize: Any = None  # mpi4py.MPI, to finalize at exit: this started it
        # Open MPI's, left behind: see _open_mpi_session_dirs
        self.session_dirs: set[str] = set()


_this = _ThisProcess()

# Warn when MPI_Init waits this long for the other ranks of an mpiexec job
INIT_WARNING_DELAY = 10


def config(key: str):
    """The ``distributed.comm.mpi`` setting ``key``"""
    return dask.config.get(f"distributed.comm.mpi.{key}")


def start_mpi() -> concurrent.futures.Future:
    """Initialise MPI in a helper thread, once; a future for ``mpi4py.MPI``.

    Under ``mpiexec``, MPI_Init returns only once every rank of the job has
    called it.  Ranks use mpi:// at different times (workers wait for the
    scheduler file that the scheduler writes once it listens), so nobody may
    block on it: listeners listen while MPI starts.
    """
    with _this.lock:
        if _this.init is None:
            try:
                import mpi4py
            except ImportError as e:
                raise ImportError(
                    "The mpi:// transport needs mpi4py and an MPI library: "
                    "pip install mpi4py mpich (or, in this package's checkout, "
                    "`pip install .[mpi]`)"
                ) from e
            if "mpi4py.MPI" not in sys.modules:
                mpi4py.rc.initialize = False  # _initialize does it
            from mpi4py import MPI

            # Now, not in the helper thread: a nanny may start its worker
            # process next, and that inherits the environment
            launched = mpi_pmi.prepare_environment(MPI)
            if not MPI.Is_initialized():
                _configure_ucx()
            _this.init = concurrent.futures.Future()
            # Running: not cancelled with a coroutine that waits for it
            _this.init.set_running_or_notify_cancel()
            # A daemon: a rank whose job-mates never start MPI can still exit
            threading.Thread(
                target=_run_init,
                args=(_this.init, launched),
                name="MPI-init",
                daemon=True,
            ).start()
    return _this.init


def _configure_ucx() -> None:
    """UCX copies a message from a peer on this host in segments, one per
    call into MPI; a chunk in one segment is copied within one call, after
    we checked that its sender lives (see ``distributed.comm.mpi_liveness``)"""
    os.environ.setdefault("UCX_CMA_SEG_SIZE", str(parse_bytes(config("chunk-size"))))


def _run_init(fut: concurrent.futures.Future, launched: bool) -> None:
    try:
        fut.set_result(_initialize(launched))
    except BaseException as e:
        fut.set_exception(e)


def _initialize(launched: bool):
    from mpi4py import MPI

    # Here, not on the event loop: it may ask a child process (Intel MPI)
    mpi_library.prepare(MPI, launched)
    if not MPI.Is_initialized():
        before = _open_mpi_session_dirs(MPI)
        # mpi4py would hold the GIL in MPI_Init and MPI_Finalize; ctypes lets
        # go of it, so this process goes on while MPI_Init waits for the
        # other ranks, and a process manager thread (mpi_pmi) can answer.
        provided = ctypes.c_int()
        init_thread = ctypes.CDLL(MPI.__file__).MPI_Init_thread
        failed = init_thread(None, None, MPI.THREAD_MULTIPLE, ctypes.byref(provided))
        mpi_pmi.initialized()
        mpi_library.initialized()
        if failed:
            raise RuntimeError("MPI_Init_thread failed")
        _this.session_dirs.update(_open_mpi_session_dirs(MPI) - before)
        for comm in (MPI.COMM_SELF, MPI.COMM_WORLD):
            comm.Set_errhandler(MPI.ERRORS_RETURN)
        _this.finalize = MPI
    _unlink_shared_memory()
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError(
            "The mpi:// transport needs MPI_THREAD_MULTIPLE, but MPI was "
            f"initialised with thread level {MPI.Query_thread()}. Do not "
            "initialise MPI with a lower thread level before using mpi://."
        )
    return MPI


def _unlink_shared_memory() -> None:
    """MPICH makes ``/dev/shm/mpich_shm_<job>_<node>`` at the start of MPI_Init
    and removes it in MPI_Finalize only: a process that is killed leaves 1 MiB
    of memory behind for good.  Every local rank of the job has mapped it
    before MPI_Init returns in any of them, and nobody opens it by name later,
    so its name can go now; the memory stays until the last process unmaps it.

    Open MPI 5 (to 5.0.11 at least) never removes the
    ``/dev/shm/sm_segment.*`` of a process it did not launch, finalized or
    not (open-mpi/ompi#13261); no other process attaches to it, since such a
    process is alone in its job, and Open MPI connects no jobs here.
    """
    if sys.platform != "linux":
        return
    names = ["/dev/shm/mpich_shm_"]
    if "PMIX_RANK" not in os.environ:  # no PMIx launcher: an Open MPI singleton
        names.append("/dev/shm/sm_segment.")
    try:
        with open("/proc/self/maps") as f:
            paths = {
                line.split(None, 5)[5].strip()
                for line in f
                if any(name in line for name in names)
                and not line.endswith("(deleted)\n")
            }
    except OSError:
        return
    for path in paths:
        # Other ranks of the job may remove it first
        with contextlib.suppress(FileNotFoundError, PermissionError):
            os.unlink(path)


def _open_mpi_session_dirs(MPI) -> set[str]:
    """The session directories of the Open MPI singletons of this user and
    host (a process that Open MPI did not launch).  Open MPI 5 (to 5.0.11 at
    least) removes a singleton's own in MPI_Finalize, but not its job's, one
    level up: an empty directory per process, in ``/tmp`` for good.  The one
    that appears during this process's MPI_Init is its own, unless another
    singleton started at the same time: that one still holds its own
    directory, or it is gone too."""
    if "PMIX_RANK" in os.environ or not MPI.Get_library_version().startswith(
        "Open MPI"
    ):
        return set()
    tmp = next(filter(None, map(os.environ.get, ["TMPDIR", "TEMP", "TMP"])), "/tmp")
    return set(glob.glob(os.path.join(tmp, f"ompi.*.{os.getuid()}", "jf.*", "*")))


@atexit.register  # at import: after Dask's exit hooks, which close comms
def _finalize() -> None:
    MPI = _this.finalize
    if MPI is None or MPI.Is_finalized():
        return
    for hook in _this.before_finalize:
        if _this.stopped is None:  # a hook may stop it
            hook(MPI)
    # Event loops still running in other threads (a user's) post and poll
    # no more: a call into MPI after MPI_Finalize ends the process badly
    _this.stopped = _this.stopped or "MPI is finalized"
    if _this.skip_finalize is not None:
        logger.debug("Not calling MPI_Finalize: %s", _this.skip_finalize)
        return
    mpi_pmi.finalizing()
    ctypes.CDLL(MPI.__file__).MPI_Finalize()
    mpi_pmi.finalized()
    for path in _this.session_dirs:
        with contextlib.suppress(OSError):
            os.rmdir(path)  # only if empty: not another singleton's, alive


def skip_finalize(reason: str) -> None:
    """Leave MPI_Finalize out at exit, after the hooks, where it would crash
    this process (see ``mpi_opener.Opener.open``).  Only a process alone
    in its MPICH job may: MPICH's MPI_Finalize starts with a barrier over the
    process manager with the other ranks of the job.  Hydra and MPICH
    singletons take a process that exits with status 0 without it for one
    that ended well; Open MPI's launcher would not."""
    MPI = get_mpi()
    if MPI.COMM_WORLD.Get_size() == 1 and MPI.Get_library_version().startswith("MPICH"):
        _this.skip_finalize = reason


def stop_mpi(reason: str) -> None:
    """Call MPI no more in this process, whose next call into MPI would abort
    it: MPI matched a receive from a peer on this host that died, which
    cannot be cancelled, and the next call would copy from the dead peer's
    memory.  Comms move their data over TCP from then on; MPI_Finalize and
    the hooks before it are left out (MPI_Finalize stays, and may abort this
    process at exit, in a rank of a bigger job: see :func:`skip_finalize`)."""
    if _this.stopped is None:
        _this.stopped = reason
        logger.warning(
            "%s: this process calls MPI no more (its next call would copy from "
            "the dead process, and abort it), and its comms move their data "
            "over TCP",
            reason,
        )
        skip_finalize(reason)


def mpi_stopped() -> str | None:
    """Why this process calls MPI no more (see :func:`stop_mpi`), if it does not"""
    return _this.stopped


def before_finalize(hook: Callable) -> None:
    """Call ``hook(mpi4py.MPI)`` at exit, before MPI_Finalize"""
    _this.before_finalize.append(hook)


async def mpi_ready():
    """``mpi4py.MPI``, once MPI is initialised"""
    fut = asyncio.wrap_future(start_mpi())
    done, _ = await asyncio.wait([fut], timeout=INIT_WARNING_DELAY)
    if not done:
        logger.warning(
            "MPI_Init has been waiting for %ds: under mpiexec it returns once "
            "every rank of the job called it, so every rank must use mpi:// "
            "(or initialise MPI itself)",
            INIT_WARNING_DELAY,
        )
    return await fut


def get_mpi():
    """``mpi4py.MPI``; MPI must have been started with :func:`start_mpi`"""
    return start_mpi().result()


def process_id() -> str:
    """A name for this process, unique across hosts, jobs and forks:
    ``host/pid/nonce``, the nonce starting with when it was named"""
    if _this.name is None:
        nonce = f"{time.time_ns():016x}{uuid.uuid4().hex}"
        _this.name = f"{socket.gethostname()}/{os.getpid()}/{nonce}"
    return _this.name


def sorts_first(process: str, other: str) -> bool:
    """Whether, of two processes (their ``process_id()``), ``process`` comes
    first: by host, then by when each was named, so that on one host the
    older one does whatever pids wrapped around to"""
    host, _, nonce = process.split("/")
    other_host, _, other_nonce = other.split("/")
    return (host, nonce) < (other_host, other_nonce)


def _forget_process_id() -> None:
    _this.name = None


os.register_at_fork(after_in_child=_forget_process_id)


@functools.cache
def world() -> tuple[str, int] | None:
    """The mpiexec job of this process and its rank there; None when it is
    alone in its MPI_COMM_WORLD (a plain ``python``, or ``mpiexec -n 1``).

    Ranks of one job, on any host, must name it alike, and tell it apart
    from every other job, without asking each other: not every rank need
    start MPI.  Every handshake asks, and finding Hydra's proxy walks the
    process tree: it is worked out once."""
    comm = get_mpi().COMM_WORLD
    if comm.size == 1:
        return None
    return f"{_job()}/{comm.size}", comm.rank


def _job() -> str:
    env = os.environ
    # Hydra's proxy first: an mpiexec in a Slurm job inherits its variables
    if job := _hydra_job():
        return job
    if "PMIX_NAMESPACE" in env:  # Open MPI, and launchers speaking PMIx
        return env["PMIX_NAMESPACE"]
    if "SLURM_STEP_ID" in env:  # srun --mpi=pmi2
        return f"slurm/{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}"
    return f"{socket.gethostname()}/{os.getppid()}"  # the launcher, our parent


def _hydra_job() -> str | None:
    """The job of Hydra's proxy that started this process, perhaps through a
    wrapper script (``mpiexec -n 4 ./run.sh``): the address of its mpiexec
    (``--control-port HOST:PORT``), which every proxy of the job is given,
    on every host, and the process group (``--pgid``, new for each
    MPI_Comm_spawn)"""
    for parent in psutil.Process().parents():
        with contextlib.suppress(psutil.Error):
            if parent.name().startswith("hydra_pmi_prox"):
                args = parent.cmdline()
                if "--control-port" in args[:-1]:
                    port = args[args.index("--control-port") + 1]
                    pgid = (
                        args[args.index("--pgid") + 1] if "--pgid" in args[:-1] else 0
                    )
                    return f"hydra/{port}/{pgid}"
                # Intel MPI's Hydra names its job in every rank's environment
                if uuid := os.environ.get("I_MPI_HYDRA_UUID"):
                    return f"hydra/{uuid}"
                # Another Hydra: its proxy on this host, at least
                return f"hydra/{socket.gethostname()}/{parent.pid}"
    return None


def library() -> str:
    """The MPI library and version; peers must agree on it"""
    name, version = get_mpi().get_vendor()
    return f"{name} {'.'.join(map(str, version))}"
