"""Connection set-up time per protocol.

    python benchmarks/connect.py [--quick] [--processes 16] [--out benchmarks/results]

A listener runs in its own process. Measured, for tcp:// and mpi://:

- ``init``: MPI_Init in the connecting process (mpi:// only);
- ``first``: the first connection from a new process (for mpi:// this opens
  the MPI channel between the two processes);
- ``next``: median of later connections from the same process (they reuse it);
- ``many_comms``: 200 connections opened concurrently from one process;
- ``many_processes``: N processes started together, each connecting once
  (a cluster's workers joining), from start of connect to the last one done.
Writes ``connect.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from processes import kill, launch, wait_for_file

HERE = os.path.abspath(__file__)


async def serve(protocol: str, path: str) -> None:
    from distributed.comm import listen

    comms = []

    async def keep(comm):
        comms.append(comm)

    async with listen(f"{protocol}://127.0.0.1:0", keep) as listener:
        with open(path + ".tmp", "w") as f:
            f.write(listener.contact_address)
        os.rename(path + ".tmp", path)
        await asyncio.Event().wait()


async def client(address: str, mode: str) -> dict:
    from distributed.comm import connect

    if mode == "once":  # one connection; wall clock start for many_processes
        comm = await connect(address)
        done = time.time()
        await comm.close()
        return {"done": done}
    init = 0.0
    if address.startswith("mpi://"):  # time MPI_Init apart from the connection
        from distributed.comm.mpi_startup import mpi_ready, start_mpi

        start = time.perf_counter()
        start_mpi()
        await mpi_ready()
        init = time.perf_counter() - start
    start = time.perf_counter()
    comms = [await connect(address)]
    first = time.perf_counter() - start
    times = []
    for _ in range(50):
        start = time.perf_counter()
        comms.append(await connect(address))
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    comms += await asyncio.gather(*(connect(address) for _ in range(200)))
    many = time.perf_counter() - start
    await asyncio.gather(*(c.close() for c in comms))
    return {
        "init": init,
        "first": first,
        "next": statistics.median(times),
        "many_comms": many,
    }


def last_json(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"a client printed no result: {stdout!r}")
    return json.loads(lines[-1])


def measure(protocol: str, processes: int) -> dict:
    mpi = protocol == "mpi"
    pipe = {"stdout": subprocess.PIPE, "text": True}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "address")
        server = launch([HERE, "serve", protocol, path], mpi)
        try:
            address = wait_for_file(path, server)
            out = launch([HERE, "client", address, "all"], mpi, **pipe)
            result = last_json(out.communicate(timeout=600)[0])
            # Processes start together; time from the earliest start to the last connection
            start = time.time()
            clients = [
                launch([HERE, "client", address, "once"], mpi, **pipe)
                for _ in range(processes)
            ]
            done = [last_json(c.communicate(timeout=600)[0])["done"] for c in clients]
            result["many_processes"] = max(done) - start
            result["processes"] = processes
            return result
        finally:
            kill(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--processes", type=int, default=None)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results"))
    args = parser.parse_args()
    processes = args.processes or (4 if args.quick else 16)
    os.makedirs(args.out, exist_ok=True)
    results = {p: measure(p, processes) for p in ["tcp", "mpi"]}
    with open(os.path.join(args.out, "connect.json"), "w") as f:
        json.dump(results, f, indent=1)
    for p, r in results.items():
        print(
            f"{p}://: init {r['init'] * 1e3:.1f} ms, first {r['first'] * 1e3:.1f} ms, next {r['next'] * 1e3:.2f} ms, "
            f"200 comms {r['many_comms']:.2f} s, {processes} processes {r['many_processes']:.2f} s"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        asyncio.run(serve(sys.argv[2], sys.argv[3]))
    elif sys.argv[1:2] == ["client"]:
        print(json.dumps(asyncio.run(client(sys.argv[2], sys.argv[3]))))
    else:
        main()
