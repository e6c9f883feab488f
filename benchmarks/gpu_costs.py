"""What each step of a device frame's trip costs on this machine's GPU: the
figures that say where mpi:// spends its time on device frames.

    python benchmarks/gpu_costs.py [--out benchmarks/results]

- steps, median microseconds: allocating a receive buffer (RMM without a
  pool, as distributed-ucxx and mpi:// do when RMM is installed, and CuPy's
  pool), finding a frame's allocation and exporting its IPC handle, an event,
  a synchronize, a device-to-device copy;
- opening a handle in another process, and its first copy, for fresh
  allocations (what a reader pays when the writer's buffer is new);
- whether a mapping in another process keeps memory that its owner freed;
- the ping-pong of ``mpi:// ipc`` with RMM importable and without it (the
  receive buffers then come from CuPy's pool, whose allocations are reused,
  so the reader's mappings are too).

Writes ``gpu_costs.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import gpu
import pingpong
from processes import kill_orphans, take_orphans

MiB = 2**20


def median_us(step, n: int = 50) -> float:
    step()  # warm up
    times = []
    for _ in range(n):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def steps() -> dict:
    import cupy

    from distributed.comm import mpi_gpu

    runtime = cupy.cuda.runtime
    device = mpi_gpu.CuPyDevice()
    frame = cupy.empty(MiB, "u1")
    big, big_copy = cupy.empty(64 * MiB, "u1"), cupy.empty(64 * MiB, "u1")
    copy = cupy.empty(MiB, "u1")
    stream = cupy.cuda.Stream(non_blocking=True)

    def copy_d2d(dst, src, size):
        runtime.memcpyAsync(dst.data.ptr, src.data.ptr, size, 3, stream.ptr)
        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        event.synchronize()

    def rmm_buffer():
        import rmm

        rmm.DeviceBuffer(size=MiB)

    steps = {
        "cupy pool alloc 1 MiB": lambda: cupy.empty(MiB, "u1"),
        "cudaMalloc+free 1 MiB": lambda: runtime.free(runtime.malloc(MiB)),
        "export (address range + handle)": lambda: device.export(frame),
        "event create+record+query": lambda: device.copy(
            copy.data.ptr, frame.data.ptr, 0, True, stream
        ).done,
        "streamSynchronize(0)": lambda: runtime.streamSynchronize(0),
        "copy d2d 1 MiB": lambda: copy_d2d(copy, frame, MiB),
        "copy d2d 64 MiB": lambda: copy_d2d(big_copy, big, 64 * MiB),
    }
    if importlib.util.find_spec("rmm"):
        steps["rmm.DeviceBuffer 1 MiB"] = rmm_buffer
    figures = {}
    for name, step in steps.items():  # one that fails leaves the others
        try:
            figures[name] = median_us(step)
        except Exception as e:
            figures[name] = {"error": repr(e)}
    return figures


def opens(n: int = 20) -> dict:
    """Handles of ``n`` fresh allocations, opened and copied by a child"""
    import cupy

    runtime = cupy.cuda.runtime
    buffers = [runtime.malloc(MiB) for _ in range(n)]
    handles = [bytes(runtime.ipcGetMemHandle(b)).hex() for b in buffers]
    child = subprocess.run(
        [sys.executable, __file__, "open"],
        input="\n".join(handles),
        capture_output=True,
        text=True,
        timeout=120,
    )
    for b in buffers:
        runtime.free(b)
    if child.returncode:
        return {"error": child.stderr[-2000:]}
    return json.loads(child.stdout)


def open_here() -> None:
    import cupy

    runtime = cupy.cuda.runtime
    target = cupy.empty(MiB, "u1")
    flags = runtime.cudaIpcMemLazyEnablePeerAccess
    opened, copied, closed = [], [], []
    for line in sys.stdin.read().split():
        start = time.perf_counter()
        base = runtime.ipcOpenMemHandle(bytes.fromhex(line), flags)
        opened.append(time.perf_counter() - start)
        start = time.perf_counter()
        runtime.memcpy(target.data.ptr, base, MiB, runtime.memcpyDeviceToDevice)
        copied.append(time.perf_counter() - start)
        start = time.perf_counter()
        runtime.ipcCloseMemHandle(base)
        closed.append(time.perf_counter() - start)
    print(
        json.dumps(
            {
                "ipcOpenMemHandle": statistics.median(opened) * 1e6,
                "first copy 1 MiB": statistics.median(copied) * 1e6,
                "ipcCloseMemHandle": statistics.median(closed) * 1e6,
            }
        )
    )


def freed_while_mapped() -> dict:
    """GiB in use on the GPU as this process allocates 1 GiB, another maps
    it, this one frees it, and the other unmaps it: whether a mapping keeps
    freed memory (what ``mpi_ipc.Mappings`` bounds)"""
    import cupy

    runtime = cupy.cuda.runtime

    def used() -> float:
        free, total = runtime.memGetInfo()
        return (total - free) / 2**30

    child = subprocess.Popen(
        [sys.executable, __file__, "map"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        child.stdin.write("\n")  # its context first
        child.stdin.flush()
        child.stdout.readline()
        figures = {"before": used()}
        buffer = runtime.malloc(2**30)
        child.stdin.write(bytes(runtime.ipcGetMemHandle(buffer)).hex() + "\n")
        child.stdin.flush()
        child.stdout.readline()
        figures["allocated here, mapped there"] = used()
        runtime.free(buffer)
        figures["freed here, still mapped there"] = used()
        child.stdin.write("\n")
        child.stdin.flush()
        child.stdout.readline()
        figures["unmapped there"] = used()
    finally:
        child.kill()
        child.wait(60)
    return figures


def map_here() -> None:
    """The child of :func:`freed_while_mapped`"""
    import cupy

    runtime = cupy.cuda.runtime
    runtime.free(runtime.malloc(1))  # a context
    sys.stdin.readline()
    print("ready", flush=True)
    handle = bytes.fromhex(sys.stdin.readline().strip())
    base = runtime.ipcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess)
    print("mapped", flush=True)
    sys.stdin.readline()
    runtime.ipcCloseMemHandle(base)
    print("closed", flush=True)
    sys.stdin.read()


def without_rmm() -> dict:
    """``mpi:// ipc``'s ping-pong (quick sizes) as it is, and with RMM hidden"""
    results = {}
    path = os.environ.get("PYTHONPATH", "")
    hidden = os.pathsep.join(p for p in path.split(os.pathsep) if "ucxx" not in p)
    for name, value in [("rmm importable", path), ("rmm hidden", hidden)]:
        with gpu.environment(PYTHONPATH=value):
            results[name] = pingpong.run_protocol("mpi", True, client_script=gpu.HERE)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(gpu.HERE), "results")
    )
    args = parser.parse_args()
    # SIGTERM (a timeout) unwinds, so that the processes started are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    take_orphans()
    os.makedirs(args.out, exist_ok=True)
    results = {"machine": pingpong.versions()}
    parts = [
        ("steps", steps),
        ("opens", opens),
        ("freed while mapped", freed_while_mapped),
        ("pingpong", without_rmm),
    ]
    for name, part in parts:
        try:
            results[name] = part()
        except Exception as e:  # one GPU run: the other parts still count
            results[name] = {"error": repr(e)}
        finally:
            kill_orphans()
        gpu.write_json(results, os.path.join(args.out, "gpu_costs.json"))
        gpu.say(name, json.dumps(results[name], indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["open"]:
        open_here()
    elif sys.argv[1:2] == ["map"]:
        map_here()
    else:
        main()
