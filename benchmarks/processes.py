"""Start the benchmarks' processes: under ``mpiexec -n 1`` for mpi://, in their
own session so that a whole job can be killed, and always cleaned up."""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
# A folder for the output of clusters' processes, else dropped
LOGS = "BENCHMARK_LOGS"


def launch(argv: list[str], mpi: bool, **kwargs) -> subprocess.Popen:
    """``python <argv>``, as its own one-rank MPI job when ``mpi``"""
    cmd = [sys.executable, *argv]
    if mpi:
        cmd = [MPIEXEC, "-n", "1", *cmd]
    proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
    proc.started = time.time()
    return proc


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the process, its session and its descendants (which may have
    sessions of their own: a benchmark's child that launched processes); for
    an mpiexec, remove the hwloc file in /tmp that its killed proxy leaves"""
    with contextlib.suppress(psutil.Error):
        _kill_descendants(psutil.Process(proc.pid))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if proc.args[0] == MPIEXEC:
        remove_leaked_hwloc_files(since=getattr(proc, "started", 0))


def take_orphans() -> None:
    """Make this process the parent of the orphans of its descendants (Linux:
    a subreaper), so that :func:`kill_orphans` finds those a child that died
    hard left behind, in sessions of their own"""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


_PR_SET_CHILD_SUBREAPER = 36


def kill_orphans() -> None:
    """SIGKILL every descendant of this process, and reap them"""
    psutil.wait_procs(_kill_descendants(psutil.Process()), timeout=10)


def _kill_descendants(process: psutil.Process) -> list[psutil.Process]:
    """SIGKILL the descendants of ``process``, and the sessions they lead"""
    descendants = process.children(recursive=True)
    for child in descendants:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
        with contextlib.suppress(psutil.Error):
            child.kill()
    return descendants


def remove_leaked_hwloc_files(since: float) -> None:
    """Remove the /tmp/hydra_hwloc_xmlfile_* files made since ``since`` that no
    process holds: a Hydra proxy removes its own when it exits cleanly, and
    leaves it when it is killed.  (The tests have their own copy: the
    benchmarks run from an installed distributed, without its tests.)"""
    leaked = {
        path
        for path in glob.glob("/tmp/hydra_hwloc_xmlfile_*")
        if os.path.exists(path) and os.stat(path).st_mtime >= since
    }
    for process in psutil.process_iter() if leaked else ():
        with contextlib.suppress(psutil.Error):
            leaked -= {f.path for f in process.open_files()}
    for path in leaked:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def stop(proc: subprocess.Popen) -> None:
    """:func:`kill`, but an mpiexec is asked first (SIGTERM: it ends its ranks;
    it prints a "BAD TERMINATION" banner on its stdout)"""
    if proc.poll() is None and proc.args[0] == MPIEXEC:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
    kill(proc)


def wait_for_file(path: str, proc: subprocess.Popen | None, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline or (proc and proc.poll() is not None):
            raise RuntimeError(
                f"{proc.args if proc else 'nobody'} did not write {path}"
            )
        time.sleep(0.05)
    with open(path) as f:
        return f.read()


@contextlib.contextmanager
def cluster(protocol: str, workers: int, *worker_args: str):
    """A scheduler and ``workers`` single-threaded workers, each a process of
    its own; yields the scheduler file and the processes.  Their output is
    dropped, or kept in files in the folder that $BENCHMARK_LOGS names"""
    mpi = protocol == "mpi"
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as logs:

        def quiet(name: str) -> dict:
            if not os.environ.get(LOGS):
                return {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
            path = os.path.join(os.environ[LOGS], f"{protocol}-{name}.log")
            log = logs.enter_context(open(path, "a"))
            return {"stdout": log, "stderr": subprocess.STDOUT}

        sched_file = os.path.join(tmp, "scheduler.json")
        scheduler = [
            "-m",
            "distributed.cli.dask_scheduler",
            "--protocol",
            protocol,
            "--port",
            "0",
            "--scheduler-file",
            sched_file,
            "--no-dashboard",
        ]
        worker = [
            "-m",
            "distributed.cli.dask_worker",
            "--scheduler-file",
            sched_file,
            "--no-nanny",
            "--nthreads",
            "1",
            "--no-dashboard",
            *worker_args,
        ]
        jobs = [launch(scheduler, mpi, **quiet("scheduler"))]
        try:
            jobs += [launch(worker, mpi, **quiet(f"worker{i}")) for i in range(workers)]
            wait_for_file(sched_file, jobs[0])
            yield sched_file, jobs
        finally:
            for job in jobs:
                kill(job)
