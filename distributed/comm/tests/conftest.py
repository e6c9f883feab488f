from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def mpi():
    """MPI started before a test: in a process started without mpiexec its
    process manager thread (``mpi_pmi``) lives as long as the process, and
    gen_test would call it a leak of the first test to use mpi://"""
    pytest.importorskip("mpi4py")
    from distributed.comm.mpi_startup import start_mpi

    return start_mpi().result()
