"""What a process keeps of each MPI job that connected to it and left.

    python benchmarks/connect_growth.py [--cycles 40] [--size 16MiB]
                                        [--out benchmarks/results]

No Dask: one steady process opens an MPI port; in each cycle a new process
(a job of its own, as a worker started alone is) connects, sends ``--size``
bytes (0: none), disconnects and exits. The steady process's RSS growth per
cycle, a linear fit over the second half, for each UCX setting in
``SETTINGS`` (MPICH with UCX, its default netmod; and its libfabric netmod),
each in a steady process of its own (one that does not finish in 10 s a
cycle is killed, and said to hang). It tells what of ``soak.py``'s growth of
the steady worker is MPI's, and which transport keeps it. MPI starts through
``distributed.comm.mpi_startup``, which gives a process started without
``mpiexec`` a job of its own (see ``distributed.comm.mpi_pmi``). Writes
``connect_growth.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile

from dask.utils import parse_bytes

HERE = os.path.abspath(__file__)
SETTINGS = {
    "UCX, default transports": {},
    "UCX, no shared-memory transports": {"UCX_TLS": "^posix,sysv"},
    "libfabric (tcp)": {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"},
}


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def steady(cycles: int, size: int) -> dict:
    from distributed.comm.mpi_startup import start_mpi

    MPI = start_mpi().result()
    port = MPI.Open_port()
    buffer = bytearray(max(size, 1))
    samples = []
    with tempfile.NamedTemporaryFile("w", suffix=".port") as f:
        f.write(port)
        f.flush()
        for _ in range(cycles):
            args = [sys.executable, HERE, "--connect", f.name, "--size", str(size)]
            child = subprocess.Popen(args, stderr=subprocess.DEVNULL)
            comm = MPI.COMM_SELF.Accept(port)
            if size:
                comm.Recv([buffer, MPI.BYTE], 0, 0)
            comm.Disconnect()
            child.wait(timeout=60)
            samples.append(_rss())
    MPI.Close_port(port)
    half = samples[len(samples) // 2 :]
    fit = statistics.linear_regression(range(len(half)), half)
    return {"kib_per_cycle": fit.slope / 1024, "rss_mib": [s / 2**20 for s in samples]}


def connect(path: str, size: int) -> None:
    from distributed.comm.mpi_startup import start_mpi

    MPI = start_mpi().result()
    with open(path) as f:
        comm = MPI.COMM_SELF.Connect(f.read())
    if size:
        comm.Send([bytearray(size), MPI.BYTE], 0, 0)
    comm.Disconnect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=40)
    parser.add_argument("--size", default="16MiB")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--connect", help=argparse.SUPPRESS)
    parser.add_argument("--steady", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = parse_bytes(args.size)
    if args.connect:
        return connect(args.connect, size)
    if args.steady:
        print(json.dumps(steady(args.cycles, size)))
        return
    results = {"cycles": args.cycles, "size": size, "settings": {}}
    for name, env in SETTINGS.items():
        cmd = [sys.executable, HERE, "--steady", "--cycles", str(args.cycles)]
        cmd += ["--size", str(size)]
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, **env, "UCX_WARN_UNUSED_ENV_VARS": "n"},
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            errors="replace",  # UCX's warnings, on stdout, hold garbage
            start_new_session=True,  # its connecting children with it
        )
        try:
            stdout, _ = proc.communicate(timeout=10 * args.cycles)
            result = json.loads(stdout.strip().splitlines()[-1])
            print(f"{name}: {result['kib_per_cycle']:+.1f} KiB per cycle")
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            result = {"hung": f"not done in {10 * args.cycles} s"}
            print(f"{name}: hung")
        results["settings"][name] = {"env": env, **result}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "connect_growth.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
