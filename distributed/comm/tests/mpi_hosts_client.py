"""The client of tests across simulated hosts, run on one of them (the test
process is on none of their networks)::

    python -m distributed.comm.tests.mpi_hosts_client SCHEDULER NWORKERS [pause|kill FILE|shutdown]

SCHEDULER is an address or a scheduler file.  It moves 16 MiB arrays between
every two workers on different hosts, twice, and prints ``REPORT <json>``:
the results, and what each worker says of itself.  With ``pause FILE``, it
writes FILE between the two rounds and waits for FILE.go.  With ``kill
FILE``, it moves many arrays from each worker to the others, writes FILE
once data moves (the test then kills a worker), and reports what became of
them.  With ``shutdown``, it shuts the cluster down after its report.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import sys
import time

import numpy as np

from distributed import Client, wait

SIZE = 2**21  # float64s: 16 MiB, over MPI


def about() -> dict:
    """What a worker says of itself (run on workers)"""
    from distributed.comm import mpi_startup
    from distributed.comm.mpi_channel import channels
    from distributed.comm.tests.mpi_processes import moved_off_the_socket

    return {
        "hostname": socket.gethostname(),
        "library": mpi_startup.library(),
        "world": mpi_startup.world(),
        "moved": moved_off_the_socket(),
        # An intercommunicator: the two met with accept/connect, as separate
        # jobs do; an intracommunicator: made by Create_group, as one job
        "channels": [
            {"peer": c.peer, "inter": c.comm.Is_inter(), "nbytes": c.nbytes}
            for c in channels.to_others()
        ],
    }


def opening() -> int:
    """How many MPI channels this worker is opening (run on workers)"""
    from distributed.comm.mpi_opener import opener

    return opener.sizes()["opening"]


def wait_for_channels(client: Client, timeout: float = 60) -> None:
    """Until no worker is opening an MPI channel: those the last transfers
    asked for are open (or failed), and the next transfers use them"""
    deadline = time.monotonic() + timeout
    while any(client.run(opening).values()) and time.monotonic() < deadline:
        time.sleep(0.05)


def across_hosts(client: Client) -> list[tuple[str, str]]:
    """Every ordered pair of workers on different hosts"""
    workers = client.scheduler_info(n_workers=-1)["workers"]
    return [
        (a, b)
        for a, b in itertools.permutations(sorted(workers), 2)
        if workers[a]["host"] != workers[b]["host"]
    ]


def move(client: Client, a: str, b: str, value: float):
    """A future of the sum, on ``b``, of an array made on ``a``"""
    x = client.submit(np.full, SIZE, value, workers=[a], pure=False)
    return client.submit(np.sum, x, workers=[b], allow_other_workers=False)


def check(client: Client, pause: str | None = None) -> dict:
    """Two rounds: the first opens channels (its arrays go over TCP while
    they open), the second moves over them.  With ``pause``, write that
    file between them, and wait for the test to write ``pause.go``"""
    pairs = across_hosts(client)
    right = True
    for round in range(2):
        futures = [move(client, a, b, i) for i, (a, b) in enumerate(pairs)]
        right &= client.gather(futures) == [i * SIZE for i in range(len(pairs))]
        wait_for_channels(client)
        if pause and round == 0:
            with open(pause, "w"):
                pass
            while not os.path.exists(pause + ".go"):
                time.sleep(0.05)
    return {"pairs": len(pairs), "right": bool(right)}


def kill(client: Client, path: str) -> dict:
    """Move data between hosts until a worker is killed; what happened"""
    pairs = across_hosts(client) * 20
    futures = [
        client.submit(np.sum, x, workers=[b], allow_other_workers=True)
        for i, (a, b) in enumerate(pairs)
        for x in [
            client.submit(
                np.full, SIZE, i, workers=[a], allow_other_workers=True, pure=False
            )
        ]
    ]
    wait(futures[:2])
    with open(path, "w"):
        pass  # the test kills a worker now
    wait(futures, timeout=120)
    outcome = {"right": 0, "wrong": 0, "errors": []}
    for i, future in enumerate(futures):
        if future.status == "finished":
            outcome["right" if future.result() == i * SIZE else "wrong"] += 1
        else:
            outcome["errors"].append(repr(future.exception()))
    # The cluster goes on
    x = client.submit(np.full, SIZE, 1.0, pure=False)
    outcome["after"] = bool(client.submit(np.sum, x).result(timeout=60) == SIZE)
    return outcome


def main(scheduler: str, nworkers: int, what: str = "check", path=None) -> None:
    if os.path.exists(scheduler):
        client = Client(scheduler_file=scheduler, timeout=60)
    else:
        client = Client(scheduler, timeout=60)
    with client:
        client.wait_for_workers(nworkers, timeout=120)
        report = kill(client, path) if what == "kill" else check(client, path)
        report["workers"] = {
            address: {
                **info,
                "host": client.scheduler_info(n_workers=-1)["workers"][address]["host"],
            }
            for address, info in client.run(about).items()
        }
        report["scheduler"] = client.scheduler.address
        print("REPORT " + json.dumps(report), flush=True)
        if what == "shutdown":
            client.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:5])
