"""GPU benchmarks: CuPy payloads over tcp://, every route of mpi:// the
machine allows, and ucx:// (where distributed-ucxx is installed), in one run,
on a machine with a GPU.

    python benchmarks/gpu.py [--quick] [--out benchmarks/results]
    python benchmarks/gpu.py --plot gpu.json

- ping-pong: a CuPy array of 1 B to 1 GiB, echoed as device frames by a server
  process (``deserialize=False``), timed through distributed's comm API;
- apps: dask arrays of CuPy chunks on a scheduler and four workers sharing the
  GPU, each a process of its own (as ``benchmarks/apps.py``): transpose-sum,
  ``(a @ a.T).sum()``, a rechunk by tasks, and 8 arrays of 256 MiB made on the
  workers and summed on one.

The routes of mpi://: "ipc" (the default between processes of one host: the
reader copies from the writer's GPU memory), "staged" (``device-ipc`` off;
through pinned host memory), "direct" (``device-ipc`` off, MPI taken as
CUDA-aware; measured only where ``python -m distributed.comm.mpi_probe`` says
it is, or with ``--direct``).  Writes ``gpu.json`` and ``gpu.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

import apps
import pingpong

HERE = os.path.abspath(__file__)


def sizes(quick: bool) -> list[int]:
    return pingpong.sizes(quick, 2**28 if quick else 2**30)


def repetitions(size: int, quick: bool) -> int:
    return pingpong.repetitions(size, quick, 2**28)


async def client(address: str, quick: bool) -> dict:
    import cupy

    from distributed.comm import connect
    from distributed.protocol import to_serialize

    comm = await connect(address)
    results = {"gpu_path": getattr(comm, "gpu_path", None)}

    async def timed(msg, n):
        times = []
        for _ in range(n):
            start = time.perf_counter()
            await comm.write(msg)
            reply = await comm.read()
            times.append((time.perf_counter() - start) / 2)
        assert isinstance(reply["x"], cupy.ndarray), type(reply["x"])
        return statistics.median(times)

    for size in sizes(quick):
        msg = {"x": to_serialize(cupy.ones(size, dtype="u1"))}
        await timed(msg, 2)
        results[size] = await timed(msg, repetitions(size, quick))
    await comm.close()
    return results


def transpose_sum(n: int, chunk: int):
    import cupy
    import dask.array as da

    rs = da.random.RandomState(RandomState=cupy.random.RandomState)
    x = rs.random((n, n), chunks=chunk)
    return (x + x.T).sum()


def dot(n: int, chunk: int):
    import cupy
    import dask.array as da

    rs = da.random.RandomState(RandomState=cupy.random.RandomState)
    a = rs.random((n, n), chunks=chunk)
    b = rs.random((n, n), chunks=chunk)
    return a.dot(b).sum()


def rechunk(n: int, pieces: int):
    import cupy
    import dask.array as da

    rs = da.random.RandomState(RandomState=cupy.random.RandomState)
    x = rs.random((n, n), chunks=(n, n // pieces))
    return x.rechunk((n // pieces, n), method="tasks").sum()


def gather(arrays: int, mib: int):
    """``arrays`` arrays of ``mib`` MiB, made on the workers, summed on one"""
    import cupy
    import dask

    @dask.delayed(pure=False)
    def make(i):
        return cupy.full(mib * 2**20 // 8, i, dtype="f8")

    @dask.delayed
    def total(parts):
        return float(sum(float(part.sum()) for part in parts))

    return total([make(i) for i in range(arrays)])


WORKERS = 4


def suite(quick: bool) -> dict:
    n = 8000 if quick else 16000
    return {
        "transpose_sum": (transpose_sum, n, n // 8),
        "dot": (dot, n // 2, n // 8),
        "rechunk": (rechunk, n, 16),
        "gather": (gather, 8, 64 if quick else 256),
    }


def cuda_aware() -> tuple[bool, str]:
    out = subprocess.run(
        [sys.executable, "-m", "distributed.comm.mpi_probe"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    rows = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    line = rows.get("CUDA-aware MPI", " no: the probe failed").strip()
    return line.startswith("yes"), line


@contextlib.contextmanager
def environment(**settings):
    """``settings`` in the environment of every process started meanwhile"""
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value


MPI_SETTING = "DASK_DISTRIBUTED__COMM__MPI__"
NO_IPC = {MPI_SETTING + "DEVICE_IPC": "False"}


def plot(results: dict, out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (lat, bw, app) = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, figures in results["pingpong"].items():
        xs = sorted(int(k) for k in figures if k.isdigit())
        ys = [figures[str(x)] for x in xs]
        lat.loglog(xs, [y * 1e6 for y in ys], marker="o", label=name)
        bw.semilogx(xs, [x / y / 1e9 for x, y in zip(xs, ys)], marker="o", label=name)
    lat.set(xlabel="CuPy array size (bytes)", ylabel="one-way latency (us, median)")
    bw.set(xlabel="CuPy array size (bytes)", ylabel="bandwidth (GB/s)")
    names = list(results["apps"])
    benches = list(results["apps"][names[0]])
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        walls = [results["apps"][name][b]["wall_time"] for b in benches]
        app.bar([j + i * width for j in range(len(benches))], walls, width, label=name)
    app.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(benches))])
    app.set_xticklabels(benches)
    app.set_ylabel("wall time (s, median)")
    for ax in (lat, bw, app):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"GPU data, {results['gpu']}, {results['machine']['mpi_library']}")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "gpu.png"), dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results"))
    parser.add_argument("--plot", metavar="JSON", help="only plot a run's results")
    parser.add_argument(
        "--direct",
        action="store_true",
        help="measure mpi:// direct even where MPI says it is not CUDA-aware "
        "(MPICH from PyPI on a UCX built with CUDA, in LD_LIBRARY_PATH)",
    )
    args = parser.parse_args()
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), os.path.dirname(os.path.abspath(args.plot)))
        return
    repeat = args.repeat or (1 if args.quick else 3)
    os.makedirs(args.out, exist_ok=True)

    import cupy

    aware, why = cuda_aware()
    if args.direct and not aware:
        why += "; mpi:// direct measured anyway (--direct)"
    results = {
        "machine": pingpong.versions(),
        "gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        "cupy": cupy.__version__,
        "cuda_aware": why,
        "quick": args.quick,
        "pingpong": {},
        "apps": {},
    }
    variants = [("tcp://", "tcp", {}), ("mpi:// ipc", "mpi", {})]
    variants.append(("mpi:// staged", "mpi", {**NO_IPC}))
    if aware or args.direct:
        variants.append(
            ("mpi:// direct", "mpi", {**NO_IPC, MPI_SETTING + "CUDA_AWARE": "true"})
        )
    if importlib.util.find_spec("distributed_ucxx"):
        # As dask-cuda does, so that UCX sees the GPU
        ucx = {"DASK_DISTRIBUTED_UCXX__CREATE_CUDA_CONTEXT": "True"}
        variants.append(("ucx://", "ucx", ucx))
    for name, protocol, settings in variants:
        print(name, file=sys.stderr)
        with environment(**settings):
            results["pingpong"][name] = pingpong.run_protocol(
                protocol, args.quick, client_script=HERE
            )
            results["apps"][name] = apps.run_protocol(
                protocol, WORKERS, args.quick, repeat, suite(args.quick)
            )
    with open(os.path.join(args.out, "gpu.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, args.out)
    summarize(results)


def summarize(results: dict) -> None:
    p = results["pingpong"]
    names = list(p)
    base = "ucx://" if "ucx://" in p else "tcp://"
    print("size".rjust(12), *(n.rjust(16) for n in names), f"ipc/{base}".rjust(11))
    for key in (k for k in p["tcp://"] if k.isdigit()):
        cells = [f"{p[n][key] * 1e6:14.1f}us" for n in names]
        ratio = p["mpi:// ipc"][key] / p[base][key]
        print(key.rjust(12), *cells, f"{ratio:11.2f}")
    for bench in results["apps"]["tcp://"]:
        walls = {n: results["apps"][n][bench]["wall_time"] for n in results["apps"]}
        ratio = walls["mpi:// ipc"] / walls[base]
        print(
            f"{bench:15s}",
            *(f"{n} {w:.3f}s" for n, w in walls.items()),
            f"ipc/{base} {ratio:.2f}",
        )
    print("CUDA-aware MPI:", results["cuda_aware"])


if __name__ == "__main__":
    if sys.argv[1:2] == ["client"]:
        pingpong.run_client(client)
    else:
        main()
