"""A dask-mpi script on protocol="mpi": ``mpiexec -n 4 python this.py``.
Rank 0 runs the scheduler, rank 1 this client code, the other ranks workers."""

import dask.array as da
from dask_mpi import initialize

from distributed import Client

initialize(protocol="mpi", nthreads=1, dashboard=False)

with Client() as client:
    assert client.scheduler.address.startswith("mpi://")
    client.wait_for_workers(2)
    x = da.random.RandomState(1).random((1000, 1000), chunks=250)
    expected = (x + x.T).sum().compute(scheduler="sync")
    result = client.compute((x + x.T).sum()).result()
    assert abs(result - expected) < 1e-6 * expected
    print("dask-mpi result ok", flush=True)
