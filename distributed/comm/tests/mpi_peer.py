"""A process to test mpi:// against, meant to run under ``mpiexec``.

``python -m distributed.comm.tests.mpi_peer serve FILE`` listens on mpi://,
writes its address to FILE and echoes every message back, except
``{"op": "sum", "x": array}`` which it answers with the array's sum.

``python -m distributed.comm.tests.mpi_peer ping ADDRESS`` connects to such a
server from another process and checks a few round trips.
"""

import asyncio
import os
import sys

import numpy as np

from distributed.comm import CommClosedError, connect, listen
from distributed.protocol import to_serialize


async def handle(comm):
    try:
        while True:
            msg = await comm.read()
            if isinstance(msg, dict) and msg.get("op") == "sum":
                msg = {"sum": int(msg["x"].sum()), "nbytes": msg["x"].nbytes}
            await comm.write(msg)
    except CommClosedError:
        pass


async def serve(path):
    async with listen("mpi://127.0.0.1:0", handle) as listener:
        with open(path + ".tmp", "w") as f:
            f.write(listener.contact_address)
        os.rename(path + ".tmp", path)
        await asyncio.Event().wait()  # until killed


async def ping(address):
    comm = await connect(address)
    for i in range(100):
        await comm.write({"i": i})
        assert await comm.read() == {"i": i}
    array = np.arange(3_000_000)
    await comm.write({"op": "sum", "x": to_serialize(array)})
    assert (await comm.read())["sum"] == array.sum()
    await comm.close()
    print("ping ok", flush=True)


if __name__ == "__main__":
    command, arg = sys.argv[1:3]
    asyncio.run(serve(arg) if command == "serve" else ping(arg))
