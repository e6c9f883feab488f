"""Upstream's comm checks (``distributed/comm/tests/test_comms.py``) on
``mpi://``, as upstream runs them on ``tcp://``: ``upstream_tests.py --scheme
mpi`` puts this file beside them, as ``test_comms_mpi.py``."""

from distributed.comm.tests.test_comms import (
    check_comm_closed_explicit,
    check_comm_closed_implicit,
    check_connect_timeout,
    check_deserialize,
    check_deserialize_eoferror,
    check_deserialize_roundtrip,
    check_many_listeners,
)
from distributed.utils_test import gen_test


@gen_test()
async def test_mpi_comm_closed_implicit():
    await check_comm_closed_implicit("mpi://127.0.0.1")


@gen_test()
async def test_mpi_comm_closed_explicit():
    await check_comm_closed_explicit("mpi://127.0.0.1")


@gen_test()
async def test_mpi_connect_timeout():
    await check_connect_timeout("mpi://127.0.0.1:44444")


@gen_test()
async def test_mpi_many_listeners():
    await check_many_listeners("mpi://127.0.0.1")


@gen_test()
async def test_mpi_deserialize():
    await check_deserialize("mpi://")


@gen_test()
async def test_mpi_deserialize_roundtrip():
    await check_deserialize_roundtrip("mpi://")


@gen_test()
async def test_mpi_deserialize_eoferror():
    await check_deserialize_eoferror("mpi://")
