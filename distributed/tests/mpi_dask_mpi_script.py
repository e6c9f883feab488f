"""A dask-mpi script on protocol="mpi": ``mpiexec -n 4 python this.py``.
Rank 0 runs the scheduler, rank 1 this client code, the other ranks workers.

With ``subcomm``, ``mpiexec -n 5 python this.py subcomm``: ranks 0-3 make
the Dask cluster over a communicator of their own, rank 4 stays outside it."""

import sys

import dask.array as da
from dask_mpi import initialize
from mpi4py import MPI

from distributed import Client

comm = None
if "subcomm" in sys.argv:
    world = MPI.COMM_WORLD
    comm = world.Split(int(world.rank >= 4), world.rank)
    if world.rank >= 4:
        print("outside the cluster", flush=True)
        sys.exit(0)

initialize(protocol="mpi", nthreads=1, dashboard=False, comm=comm)

with Client() as client:
    assert client.scheduler.address.startswith("mpi://")
    client.wait_for_workers(2)
    x = da.random.RandomState(1).random((1000, 1000), chunks=250)
    expected = (x + x.T).sum().compute(scheduler="sync")
    result = client.compute((x + x.T).sum()).result()
    assert abs(result - expected) < 1e-6 * expected
    print("dask-mpi result ok", flush=True)
