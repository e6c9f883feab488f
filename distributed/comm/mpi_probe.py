"""What mpi:// will do on this node: ``python -m distributed.comm.mpi_probe``.

Prints the MPI library, the GPUs, CuPy, RMM and Numba this process sees,
whether MPI is CUDA-aware and how that was decided, how GPU frames will
travel (see ``distributed.comm.mpi_gpu``), whether processes of this
host may copy large frames from each other's memory (``mpi_copy``), and
whether frames to other hosts and to processes of other jobs take MPI
(``mpi_policy``, ``mpi_library``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from distributed.comm import mpi_gpu, mpi_library, mpi_policy, mpi_startup
from distributed.comm.mpi_liveness import LocalPeer, beacon

YAMA = "/proc/sys/kernel/yama/ptrace_scope"


def _version(module: str) -> str:
    if importlib.util.find_spec(module) is None:
        return "not installed"
    try:
        return __import__(module).__version__
    except Exception as e:  # installed, but broken here (no CUDA driver...)
        return f"fails to import: {e}"


def _devices() -> str:
    if importlib.util.find_spec("cupy") is None:
        return "none seen: CuPy is not installed"
    try:
        import cupy

        runtime = cupy.cuda.runtime
        names = [
            runtime.getDeviceProperties(i)["name"].decode()
            for i in range(runtime.getDeviceCount())
        ]
        return f"{len(names)} ({', '.join(names)})" if names else "none"
    except Exception as e:
        return f"none: {e}"


# Run by a child of the probe: Yama's ptrace_scope 1 treats it as a sibling
# worker, which may not read this process unless this process lets it
_READ_PARENT = (
    "import sys; from distributed.comm.mpi_liveness import LocalPeer; "
    "sys.exit(not LocalPeer(int(sys.argv[1]), int(sys.argv[2])).readable())"
)


def _copies() -> str:
    """Whether another process may read this one's memory, as
    ``mpi_policy.copies_from`` finds out of a peer"""
    through_mpi = "large host frames between processes of this host go through MPI"
    if not mpi_startup.config("local-copy"):
        return f"no (local-copy: false): {through_mpi}"
    if not LocalPeer(os.getpid(), beacon()).readable():
        return f"no, process_vm_readv fails here (seccomp?): {through_mpi}"
    child = [sys.executable, "-c", _READ_PARENT, str(os.getpid()), str(beacon())]
    if subprocess.run(child, timeout=120).returncode:
        try:
            with open(YAMA) as f:
                scope = f"Yama's ptrace_scope is {f.read().strip()}"
        except OSError:
            scope = "no Yama"
        return (
            f"no, a process may not read another's memory here ({scope}): "
            f"{through_mpi}, and GPU frames copied by CUDA IPC are acknowledged "
            "over MPI"
        )
    return (
        "yes, where both run as one user: a reader copies large frames from "
        "the writer's memory (GPU frames by CUDA IPC) and says so on the "
        "comm's socket"
    )


def _across_hosts() -> str:
    """Whether frames to processes on other hosts will travel over MPI"""
    setting = mpi_policy.across_hosts()
    if setting == "mpi":
        return "over MPI (across-hosts: mpi)"
    if setting == "auto" and mpi_policy.rdma():
        return (
            f"over MPI to hosts with an RDMA network up too (this one has "
            f"{mpi_policy.rdma()}), else over TCP"
        )
    why = "across-hosts: tcp" if setting == "tcp" else "no RDMA network up here"
    return (
        f"over TCP, GPU frames as host frames ({why}; on a fabric with no "
        "device in /sys/class/infiniband nor /sys/class/cxi, set "
        "across-hosts: mpi)"
    )


def _other_jobs() -> str:
    """Whether frames to processes of other jobs may travel over MPI"""
    if mpi_startup.library().startswith("Open MPI"):
        return "over TCP: Open MPI cannot connect processes of different jobs"
    if why := mpi_library.no_ports():
        return f"over TCP: {why}"
    network = mpi_library.network()
    return "over MPI" + (f" (libfabric provider {network})" if network else "")


def main() -> None:
    """Print what mpi:// will do with GPU data in this process"""
    MPI = mpi_startup.start_mpi().result()
    aware, why = mpi_gpu.cuda_aware(MPI)
    chunk = mpi_startup.config("chunk-size")
    if not mpi_gpu.has_gpu():
        frames = "as host frames: this process has no GPU that CuPy can use"
    elif aware:
        frames = (
            "direct (device buffers to MPI) to peers whose MPI is CUDA-aware too, "
            f"else staged through pinned host memory in {chunk} chunks"
        )
    else:
        frames = f"staged through pinned host memory, in {chunk} chunks"
    if mpi_gpu.has_gpu():
        if mpi_startup.config("device-ipc"):
            frames = (
                "on this host, copied by CUDA IPC between processes that may "
                f"map each other's GPU; else, {frames}"
            )
        frames += "; as host frames to peers without a GPU"
    rows = [
        ("CUDA devices", _devices()),
        ("CuPy", _version("cupy")),
        ("RMM", _version("rmm")),
        ("Numba", _version("numba")),
        ("MPI library", f"{mpi_startup.library()} ({MPI.__file__})"),
        ("CUDA-aware MPI", f"{'yes' if aware else 'no'}: {why}"),
        ("GPU frames", frames),
        ("Copies on this host", _copies()),
        ("Frames across hosts", _across_hosts()),
        ("Frames to other jobs", _other_jobs()),
    ]
    for name, value in rows:
        print(f"{name + ':':22} {value}")


if __name__ == "__main__":
    main()
