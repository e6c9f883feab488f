"""Ways a mid-size host frame could go between two processes of one host.

    python benchmarks/local_ways.py [--quick] [--out benchmarks/results]

No Dask, no MPI: the floor of each way, to choose a route for frames of 64
KiB to 8 MiB before building one. Two processes (a fork) ping-pong a frame,
each way in turn, on a Unix socket pair with 4 MiB buffers:

- ``socket``: the frame on the socket, as comms on one host send frames
  below ``inline-size``;
- ``arena``: the writer copies the frame into shared memory (a memfd that
  both map), the reader copies it out, after a 16-byte note on the socket;
- ``arena, reader keeps it``: the same, with a reader that keeps a view of
  the shared memory instead of copying (what Dask would need to keep a
  frame in place);
- ``vm_readv``: the reader copies the frame from the writer's memory with
  ``process_vm_readv`` after a 16-byte note, then acknowledges it (the
  local-copy route, less its MPI message and lease).

The reader's memory is reused, as received frames' memory is (see
``distributed.comm.mpi_buffers``). One-way time = median round trip / 2.
Writes ``local_ways.json`` and ``local_ways.png``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import socket
import statistics
import struct
import time

import numpy as np

SIZES = [2**k for k in range(16, 24)]  # 64 KiB to 8 MiB
WAYS = ["socket", "arena", "arena, reader keeps it", "vm_readv"]
NOTE = struct.Struct("QQ")  # an address or offset, and a size


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        got += sock.recv_into(view[got:])


def _vm_read(pid: int, into: np.ndarray, address: int, size: int) -> None:
    local, remote = _IOVec(into.ctypes.data, size), _IOVec(address, size)
    done = _libc.process_vm_readv(
        pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0
    )
    if done != size:
        raise OSError(ctypes.get_errno(), "process_vm_readv")


def _send(way, sock, frame, arena) -> None:
    if way == "socket":
        sock.sendall(frame)
    elif way.startswith("arena"):
        np.copyto(arena[: frame.nbytes], frame)
        sock.sendall(NOTE.pack(0, frame.nbytes))
    else:
        sock.sendall(NOTE.pack(frame.ctypes.data, frame.nbytes))
        _recv_exactly(sock, memoryview(bytearray(NOTE.size)))  # copied


def _receive(way, sock, into, arena, peer: int):
    if way == "socket":
        _recv_exactly(sock, memoryview(into))
        return into
    note = bytearray(NOTE.size)
    _recv_exactly(sock, memoryview(note))
    where, size = NOTE.unpack(note)
    if way == "arena":
        np.copyto(into[:size], arena[where : where + size])
        return into
    if way == "arena, reader keeps it":
        return arena[where : where + size]
    _vm_read(peer, into, where, size)
    sock.sendall(NOTE.pack(0, 0))
    return into


def _ping_pong(sock, first: bool, peer: int, mine, theirs, repeat: int) -> dict:
    """``{way: {size: one-way seconds}}``; ``mine``/``theirs``: the arenas
    this process writes and reads"""
    results: dict = {way: {} for way in WAYS}
    for size in SIZES:
        frame = np.random.randint(0, 255, size, dtype="u1")
        into = np.empty(size, "u1")
        for way in WAYS:
            times = []
            for i in range(repeat + 10):  # 10 to warm up
                start = time.perf_counter()
                for sending in (first, not first):
                    if sending:
                        _send(way, sock, frame, mine)
                    else:
                        _receive(way, sock, into, theirs, peer)
                if i >= 10:
                    times.append((time.perf_counter() - start) / 2)
            results[way][size] = statistics.median(times)
    return results


def measure(repeat: int) -> dict:
    ours, theirs = socket.socketpair()
    for sock in (ours, theirs):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * 2**20)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 2**20)
    arenas = []
    for _ in range(2):
        fd = os.memfd_create("local-ways")
        os.ftruncate(fd, max(SIZES))
        arenas.append(np.frombuffer(mmap.mmap(fd, max(SIZES)), "u1"))
        os.close(fd)
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        ours.close()
        try:
            _ping_pong(theirs, False, parent, arenas[1], arenas[0], repeat)
        finally:
            os._exit(0)
    theirs.close()
    try:
        return _ping_pong(ours, True, child, arenas[0], arenas[1], repeat)
    finally:
        os.waitpid(child, 0)


def plot(results: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for way, times in results["one_way"].items():
        sizes = [int(s) for s in times]
        ax.plot(sizes, [t * 1e6 for t in times.values()], marker="o", label=way)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("frame size (bytes)")
    ax.set_ylabel("one-way time (us), median")
    ax.set_title("A host frame between two processes of one host")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "local_ways.png"), dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = {
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "one_way": measure(50 if args.quick else 300),
    }
    with open(os.path.join(args.out, "local_ways.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"{'size':>8}" + "".join(f"{way:>24}" for way in WAYS))
    for size in SIZES:
        times = [results["one_way"][way][size] for way in WAYS]
        print(f"{size >> 10:>5} KiB" + "".join(f"{t * 1e6:22.0f}us" for t in times))
    try:
        plot(results, args.out)
    except ImportError:
        print("matplotlib is not installed: no plot")


if __name__ == "__main__":
    main()
