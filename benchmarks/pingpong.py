"""Comm ping-pong between two processes: tcp:// vs mpi:// (vs ucx://), and raw mpi4py.

    python benchmarks/pingpong.py [--quick] [--out benchmarks/results]

A server process listens on every protocol and echoes every message back (it
reads with ``deserialize=False``, so it sends the same frames back); a client
process times round trips through distributed's public comm API on a comm to
each listener, alternating between them round trip by round trip, so that the
transports are compared in the same two processes: one-way latency is half the
round trip. The payload is a numpy array wrapped in ``to_serialize``
(the path of worker-to-worker transfers), plus a small dict message. The raw
mpi4py ``Send``/``Recv`` ping-pong of the same buffers is the ceiling.
Writes ``pingpong.json`` (and PNG plots when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from processes import MPIEXEC, kill, launch, stop, wait_for_file

HERE = os.path.abspath(__file__)


def sizes(quick: bool, top: int | None = None) -> list[int]:
    """Powers of 4 up to ``top`` (default: 16 MiB quick, else 1 GiB), and
    every power of 2 from 256 KiB to 16 MiB, where Dask's chunks and shards
    are and where the routes change"""
    top = top or (2**24 if quick else 2**30)
    band = {2**k for k in range(18, 25)}  # 256 KiB to 16 MiB
    return sorted({n for n in {4**k for k in range(20)} | band if n <= top} | {top})


def repetitions(size: int, quick: bool, budget: int = 2**26) -> int:
    """Round trips of a message of ``size``: moving about ``budget`` bytes"""
    n = 200 if size <= 2**16 else max(5, budget // size)
    return max(3, n // 4) if quick else n


async def serve(protocols: str, path: str, host: str = "127.0.0.1") -> None:
    """Echo every message back (not deserialized: the same frames), on a
    listener for each of the comma-separated ``protocols``; write their
    addresses, space-separated, to ``path``"""
    from distributed.comm import CommClosedError, listen

    async def echo(comm):
        try:
            while True:
                await comm.write(await comm.read())
        except CommClosedError:
            pass

    async with contextlib.AsyncExitStack() as stack:
        listeners = [
            await stack.enter_async_context(
                listen(f"{protocol}://{host}:0", echo, deserialize=False)
            )
            for protocol in protocols.split(",")
        ]
        with open(path + ".tmp", "w") as f:
            f.write(" ".join(listener.contact_address for listener in listeners))
        os.rename(path + ".tmp", path)
        await asyncio.Event().wait()


async def client(addresses: str, quick: bool) -> dict:
    """{protocol: {size: median one-way time}} over a comm to each of the
    space-separated ``addresses``, alternating between them"""
    import numpy as np

    from distributed.comm import connect
    from distributed.protocol import to_serialize

    comms = {}
    for address in addresses.split():
        comms[address.split("//")[0] + "//"] = await connect(address)
    results: dict = {name: {} for name in comms}

    async def timed(msg, n):
        times: dict = {name: [] for name in comms}
        for i in range(n):
            # Each goes first in turn: neither always follows the other
            for name, comm in list(comms.items())[:: 1 if i % 2 else -1]:
                start = time.perf_counter()
                await comm.write(msg)
                await comm.read()
                times[name].append((time.perf_counter() - start) / 2)
        return {name: statistics.median(t) for name, t in times.items()}

    def record(key, medians: dict) -> None:
        for name, median in medians.items():
            results[name][key] = median

    await timed({"op": "ping", "i": 1}, 20)  # warm up
    record("dict", await timed({"op": "ping", "i": 1, "key": "x-123"}, 200))
    for size in sizes(quick):
        msg = {"x": to_serialize(np.ones(size, dtype="u1"))}
        await timed(msg, 2)
        record(size, await timed(msg, repetitions(size, quick)))
    for comm in comms.values():
        await comm.close()
    return results


def raw(quick: bool) -> None:
    """mpiexec -n 2: blocking Send/Recv of the same buffers"""
    import numpy as np
    from mpi4py import MPI

    comm, results = MPI.COMM_WORLD, {}
    peer = 1 - comm.rank
    for size in sizes(quick):
        buf = np.ones(size, dtype="u1")
        times = []
        for i in range(repetitions(size, quick) + 2):
            comm.Barrier()
            start = time.perf_counter()
            if comm.rank == 0:
                comm.Send(buf, peer)
                comm.Recv(buf, peer)
            else:
                comm.Recv(buf, peer)
                comm.Send(buf, peer)
            if i >= 2:
                times.append((time.perf_counter() - start) / 2)
        results[size] = statistics.median(times)
    if comm.rank == 0:
        print(json.dumps(results))


def run_client(client) -> None:
    """``SCRIPT client ADDRESS [--quick]``: print ``client(address, quick)``
    as JSON, for :func:`run_protocol`.  ``@FILE``: the address is in FILE,
    where the server's rank writes it."""
    address = sys.argv[2]
    if address.startswith("@"):
        address = wait_for_file(address[1:], None)
    result = asyncio.run(client(address, "--quick" in sys.argv))
    print(json.dumps(result), flush=True)


def run_protocol(
    protocol: str,
    quick: bool,
    client_script: str = HERE,
    server_script: str = HERE,
    server_args: tuple[str, ...] = (),
) -> dict:
    """The client's figures, with an echoing server (``server_script serve
    PROTOCOL PATH *server_args``: this script's, by default); the client is
    ``client_script client ADDRESS``.  ``protocol`` may be several,
    comma-separated: the server listens on each, and ADDRESS names them all"""
    mpi = "mpi" in protocol.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "address")
        server = launch(  # stdout: mpiexec's banner when it is stopped
            [server_script, "serve", protocol, path, *server_args],
            mpi,
            stdout=subprocess.DEVNULL,
        )
        try:
            address = wait_for_file(path, server)
            args = [client_script, "client", address] + (["--quick"] if quick else [])
            client_proc = launch(args, mpi, stdout=subprocess.PIPE, text=True)
            try:
                stdout, _ = client_proc.communicate(timeout=1800)
            finally:
                stop(client_proc)
            return json.loads(stdout.strip().splitlines()[-1])
        finally:
            stop(server)


def run_one_job(quick: bool) -> dict:
    """mpi:// between the two ranks of one ``mpiexec`` job, as raw mpi4py is"""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "address")
        client_args = ["client", "@" + path] + (["--quick"] if quick else [])
        cmd = [MPIEXEC, "-n", "1", sys.executable, HERE, "serve", "mpi", path]
        cmd += [":", "-n", "1", sys.executable, HERE, *client_args]
        job = subprocess.Popen(
            cmd, start_new_session=True, stdout=subprocess.PIPE, text=True
        )
        try:
            for line in job.stdout:  # the client's result; the server serves on
                if line.startswith("{"):
                    return json.loads(line)["mpi://"]
            raise RuntimeError(f"{cmd} printed no result")
        finally:
            kill(job)


def versions() -> dict:
    import dask
    import mpi4py

    import distributed

    info = {"python": platform.python_version(), "machine": platform.machine()}
    info["cpus"] = os.cpu_count()
    info["dask"] = dask.__version__
    info["distributed"] = distributed.__version__
    info["mpi4py"] = mpi4py.__version__
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])",
        ],
        capture_output=True,
        text=True,
    )
    info["mpi_library"] = out.stdout.strip()
    return info


def plot(results: dict, out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (lat, bw) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, figures in results["transports"].items():
        xs = sorted(int(k) for k in figures if k != "dict")
        ys = [figures[str(x)] for x in xs]
        lat.loglog(xs, [y * 1e6 for y in ys], marker="o", label=name)
        bw.semilogx(xs, [x / y / 1e9 for x, y in zip(xs, ys)], marker="o", label=name)
    lat.set(xlabel="message size (bytes)", ylabel="one-way latency (us, median)")
    bw.set(xlabel="message size (bytes)", ylabel="bandwidth (GB/s)")
    for ax in (lat, bw):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"ping-pong, {results['machine']['mpi_library']}")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "pingpong.png"), dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    protocols = ["tcp", "mpi"]
    try:
        import distributed_ucxx  # noqa: F401

        protocols.append("ucx")
    except ImportError:
        pass
    results = {"machine": versions(), "quick": args.quick, "transports": {}}
    print(", ".join(f"{protocol}://" for protocol in protocols), file=sys.stderr)
    results["transports"] = run_protocol(",".join(protocols), args.quick)
    print("mpi:// in one job", file=sys.stderr)
    results["transports"]["mpi:// one job"] = run_one_job(args.quick)
    cmd = [MPIEXEC, "-n", "2", sys.executable, HERE, "raw"] + (
        ["--quick"] if args.quick else []
    )
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True)
    results["transports"]["raw mpi4py"] = json.loads(
        out.stdout.strip().splitlines()[-1]
    )

    with open(os.path.join(args.out, "pingpong.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, args.out)
    summarize(results)


def summarize(results: dict) -> None:
    t = results["transports"]
    names = list(t)
    print("size".rjust(10), *(n.rjust(14) for n in names), "mpi/tcp".rjust(9), sep="")
    for key in t["tcp://"]:
        row = [t[n].get(key) for n in names]
        cells = [f"{v * 1e6:12.1f}us" if v else " " * 14 for v in row]
        ratio = t["mpi://"][key] / t["tcp://"][key]
        print(str(key).rjust(10), *cells, f"{ratio:9.2f}", sep="")


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        asyncio.run(serve(*sys.argv[2:5]))  # PROTOCOLS PATH [HOST]
    elif sys.argv[1:2] == ["client"]:
        run_client(client)
    elif sys.argv[1:2] == ["raw"]:
        raw("--quick" in sys.argv)
    else:
        main()
