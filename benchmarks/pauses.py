"""Round trips with pauses between them: tcp:// vs mpi://.

    python benchmarks/pauses.py [--quick] [--out benchmarks/results]

Ping-pong sends the next message as soon as the last one is back; Dask's
scheduler and workers mostly talk now and then. Here a client process sleeps
``gap`` between round trips of a small message to ``pingpong.py``'s echoing
server and times each round trip (median). Writes ``pauses.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import pingpong

HERE = os.path.abspath(__file__)
GAPS = [0, 0.0005, 0.002, 0.005, 0.03]  # seconds


async def client(address: str, quick: bool) -> dict:
    from distributed.comm import connect

    comm = await connect(address)
    results = {}
    for gap in GAPS:
        times = []
        for _ in range(50 if quick else 200):
            await asyncio.sleep(gap)
            start = time.perf_counter()
            await comm.write({"op": "ping"})
            await comm.read()
            times.append(time.perf_counter() - start)
        results[str(gap)] = statistics.median(times)
    await comm.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = {"machine": pingpong.versions(), "quick": args.quick}
    results["round_trip"] = {
        f"{protocol}://": pingpong.run_protocol(protocol, args.quick, HERE)
        for protocol in ["tcp", "mpi"]
    }
    with open(os.path.join(args.out, "pauses.json"), "w") as f:
        json.dump(results, f, indent=1)
    tcp, mpi = results["round_trip"]["tcp://"], results["round_trip"]["mpi://"]
    print("gap (ms)   tcp (us)   mpi (us)   mpi/tcp")
    for gap in tcp:
        print(
            f"{float(gap) * 1e3:8g} {tcp[gap] * 1e6:10.0f} {mpi[gap] * 1e6:10.0f}"
            f" {mpi[gap] / tcp[gap]:9.2f}"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["client"]:
        pingpong.run_client(client)
    else:
        main()
