"""Round trips with pauses between them, receiver idle or busy: tcp:// vs mpi://.

    python benchmarks/pauses.py [--quick] [--rounds 2] [--out benchmarks/results]

Ping-pong sends the next message as soon as the last one is back; Dask's
scheduler and workers mostly talk now and then, while their task threads
compute. Here a client process sleeps ``gap`` (0 to 100 ms) between round
trips of a small message to ``pingpong.py``'s echoing server and times each
round trip (median per gap), in two series:

- ``idle``: the server does nothing else;
- ``busy``: the server runs a task thread all along, as a worker computing
  does: a loop of pure-Python work (about 1 ms; it holds the GIL, so the event
  loop's thread waits for it up to the switch interval, 5 ms) and a NumPy
  ufunc over 1 MiB (which releases the GIL while it runs).

tcp:// and mpi:// alternate: in each round, each series runs both protocols,
tcp first in one round and mpi first in the next (the two series in opposite
orders); the figure per gap is the median of all round trips of all rounds
(``per_round`` holds each round's median). Each protocol's server and client
are processes of their own (``mpiexec -n 1`` each for mpi://). Writes ``pauses.json`` (``round_trip``: receiver idle,
``round_trip_busy``: receiver busy; seconds, by gap in seconds) and
``pauses.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time

import pingpong

HERE = os.path.abspath(__file__)
GAPS = [0, 0.0005, 0.002, 0.005, 0.03, 0.1]  # seconds
SERIES = {"idle": "round_trip", "busy": "round_trip_busy"}


def repetitions(gap: float, quick: bool) -> int:
    """Round trips per gap: 200 (50 quick), fewer where the gaps add up to
    more than 10 s (2 s quick)"""
    most, seconds = (50, 2) if quick else (200, 10)
    return most if gap == 0 else max(20, min(most, int(seconds / gap)))


async def client(address: str, quick: bool) -> dict:
    from distributed.comm import connect

    comm = await connect(address)
    for _ in range(20):  # warm up
        await comm.write({"op": "ping"})
        await comm.read()
    results = {}
    for gap in GAPS:
        times = []
        for _ in range(repetitions(gap, quick)):
            await asyncio.sleep(gap)
            start = time.perf_counter()
            await comm.write({"op": "ping"})
            await comm.read()
            times.append(time.perf_counter() - start)
        results[str(gap)] = times
    await comm.close()
    return results


def busy_task() -> None:
    """A task thread that never ends: pure Python, then NumPy, again and again"""
    import numpy as np

    a = np.random.random(2**17)  # 1 MiB
    while True:
        total = 0
        for i in range(10_000):  # about 1 ms of pure Python
            total += i * i
        np.sqrt(a, out=a)  # releases the GIL
        a += 1.0


def serve(protocol: str, path: str, busy: bool) -> None:
    if busy:
        threading.Thread(target=busy_task, daemon=True, name="task").start()
    asyncio.run(pingpong.serve(protocol, path))


def plot(results: dict, out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (rt, ratio) = plt.subplots(1, 2, figsize=(12, 4.5))
    gaps = list(results["round_trip"]["tcp://"])  # evenly spaced, labelled
    xs = range(len(gaps))
    for series, key in SERIES.items():
        style = "-" if series == "idle" else "--"
        figures = results[key]
        for protocol, by_gap in figures.items():
            rt.plot(
                xs,
                [by_gap[g] * 1e3 for g in gaps],
                style,
                marker="o",
                label=f"{protocol} receiver {series}",
            )
        tcp, mpi = figures["tcp://"], figures["mpi://"]
        ratio.plot(
            xs,
            [mpi[g] / tcp[g] for g in gaps],
            style,
            marker="o",
            label=f"receiver {series}",
        )
    ratio.axhline(1.0, color="black", linewidth=1)
    rt.set(ylabel="round trip (ms, median)", ylim=(0, None))
    ratio.set(ylabel="round trip mpi:// / tcp://", ylim=(0, None))
    for ax in (rt, ratio):
        ax.set(xlabel="pause before each round trip (ms)")
        ax.set_xticks(xs, [f"{float(g) * 1e3:g}" for g in gaps])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(
        "round trips of a small message after a pause"
        + (" (quick)" if results["quick"] else "")
    )
    fig.tight_layout()
    fig.savefig(os.path.join(out, "pauses.png"), dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = {
        "machine": pingpong.versions(),
        "quick": args.quick,
        "gaps_ms": [g * 1e3 for g in GAPS],
        "repetitions": {str(g): repetitions(g, args.quick) for g in GAPS},
        "rounds": args.rounds,
        "busy_task": busy_task.__doc__,
    }
    per_round = {s: {"tcp://": [], "mpi://": []} for s in SERIES}
    for rnd in range(args.rounds):
        # each series: tcp first in one round, mpi first in the next
        for i, series in enumerate(SERIES):
            order = ["tcp", "mpi"] if (rnd + i) % 2 == 0 else ["mpi", "tcp"]
            for protocol in order:
                print(
                    f"round {rnd + 1}: receiver {series}, {protocol}://",
                    file=sys.stderr,
                )
                server_args = ("--busy",) if series == "busy" else ()
                times = pingpong.run_protocol(
                    protocol, args.quick, HERE, HERE, server_args
                )
                per_round[series][f"{protocol}://"].append(times)
    for series, key in SERIES.items():
        results[key] = {
            protocol: {
                str(g): statistics.median(t for r in rounds for t in r[str(g)])
                for g in GAPS
            }
            for protocol, rounds in per_round[series].items()
        }
    results["per_round"] = {
        series: {
            protocol: [{g: statistics.median(t) for g, t in r.items()} for r in rounds]
            for protocol, rounds in by_protocol.items()
        }
        for series, by_protocol in per_round.items()
    }
    with open(os.path.join(args.out, "pauses.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, args.out)
    summarize(results)


def summarize(results: dict) -> None:
    print("receiver  gap (ms)   tcp (us)   mpi (us)   mpi/tcp")
    for series, key in SERIES.items():
        tcp, mpi = results[key]["tcp://"], results[key]["mpi://"]
        for gap in tcp:
            print(
                f"{series:8s} {float(gap) * 1e3:9g} {tcp[gap] * 1e6:10.0f}"
                f" {mpi[gap] * 1e6:10.0f} {mpi[gap] / tcp[gap]:9.2f}"
            )


if __name__ == "__main__":
    if sys.argv[1:2] == ["client"]:
        pingpong.run_client(client)
    elif sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2], sys.argv[3], "--busy" in sys.argv[4:])
    else:
        main()
