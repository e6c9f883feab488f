"""GPU data on mpi:// comms (distributed.comm.mpi_gpu).

Tests marked ``gpu`` need CuPy and a CUDA device, and skip without them; the
others run everywhere, and check what can be checked without a GPU: the
CUDA-aware query against a real MPI, its setting, the probe, and a process
without a GPU refusing device frames clearly."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys

import pytest

pytest.importorskip("mpi4py")
np = pytest.importorskip("numpy")

import dask

from distributed import Client, LocalCluster
from distributed.comm import CommClosedError, connect, mpi_gpu, mpi_ipc, mpi_startup
from distributed.comm.mpi import Head
from distributed.comm.mpi_routes import Staged
from distributed.comm.mpi_channel import channels
from distributed.comm.tests.mpi_processes import mpiexec, wait_for_file
from distributed.comm.tests.test_mpi import comm_pair
from distributed.protocol import to_serialize
from distributed.utils_test import gen_test, popen

gpu = pytest.mark.skipif(not mpi_gpu.has_gpu(), reason="needs CuPy and a GPU")


@gen_test()
async def test_cuda_aware_is_asked_of_mpi():
    MPI = await mpi_startup.mpi_ready()
    aware, why = mpi_gpu.cuda_aware(MPI)
    if MPI.get_vendor()[0] == "MPICH" and "mpich" in MPI.__file__:
        # MPICH from PyPI, as in CI: built without CUDA, and says so
        assert (aware, why) == (False, "MPIX_GPU_query_support(CUDA)")
    assert isinstance(aware, bool)


@gen_test()
async def test_cuda_aware_setting_overrides_the_query():
    MPI = await mpi_startup.mpi_ready()
    with dask.config.set({"distributed.comm.mpi.cuda-aware": True}):
        assert mpi_gpu.cuda_aware(MPI) == (
            True,
            "distributed.comm.mpi.cuda-aware is true",
        )
    with dask.config.set({"distributed.comm.mpi.cuda-aware": False}):
        assert mpi_gpu.cuda_aware(MPI)[0] is False
    # DASK_DISTRIBUTED__COMM__MPI__CUDA_AWARE=true
    with dask.config.set({"distributed.comm.mpi.cuda-aware": "true"}):
        assert mpi_gpu.cuda_aware(MPI)[0] is True
    with dask.config.set({"distributed.comm.mpi.cuda-aware": "maybe"}):
        with pytest.raises(ValueError, match="auto, true or false, not 'maybe'"):
            mpi_gpu.cuda_aware(MPI)


@pytest.mark.parametrize(
    "mine,theirs,path",
    [
        (None, None, None),
        ({"cuda_aware": True}, None, None),
        (None, {"cuda_aware": False}, None),
        ({"cuda_aware": False}, {"cuda_aware": True}, "staged"),
        ({"cuda_aware": True}, {"cuda_aware": True}, "direct"),
    ],
)
def test_both_ends_work_out_one_path(mine, theirs, path):
    assert mpi_gpu.path(mine, theirs) == mpi_gpu.path(theirs, mine) == path


def probe(**env) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-m", "distributed.comm.mpi_probe"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, **env},
    ).stdout
    return dict(line.split(":", 1) for line in out.splitlines())


def test_probe_says_what_mpi_will_do():
    rows = probe()
    assert set(rows) == {
        "CUDA devices",
        "CuPy",
        "RMM",
        "Numba",
        "MPI library",
        "CUDA-aware MPI",
        "GPU frames",
        "Copies on this host",
        "Frames across hosts",
        "Frames to other jobs",
    }
    assert rows["MPI library"].strip().startswith(mpi_startup.library())
    assert rows["Frames to other jobs"].strip() == "over MPI"  # MPICH
    assert rows["Copies on this host"].strip().startswith(("yes", "no"))
    rows = probe(DASK_DISTRIBUTED__COMM__MPI__LOCAL_COPY="False")
    assert rows["Copies on this host"].strip().startswith("no (local-copy: false)")
    if not mpi_gpu.has_gpu():
        assert "as host frames" in rows["GPU frames"]
    rows = probe(DASK_DISTRIBUTED__COMM__MPI__ACROSS_HOSTS="tcp")
    assert rows["Frames across hosts"].strip().startswith("over TCP")
    rows = probe(DASK_DISTRIBUTED__COMM__MPI__ACROSS_HOSTS="mpi")
    assert rows["Frames across hosts"].strip().startswith("over MPI")


@gpu
def test_a_process_may_map_its_own_gpu_and_its_peers():
    """What a hello says this process may map: its GPU first, by PCI bus id,
    then the others that it can access as a peer (an IPC handle of another
    GPU's memory opens only then)"""
    import cupy

    runtime = cupy.cuda.runtime
    own = runtime.getDevice()
    devices = mpi_gpu.CuPyDevice().mappable()
    assert devices[0] == runtime.deviceGetPCIBusId(own)
    peers = [
        runtime.deviceGetPCIBusId(i)
        for i in range(runtime.getDeviceCount())
        if i != own and runtime.deviceCanAccessPeer(own, i)
    ]
    assert devices[1:] == peers


@gpu
def test_an_rmm_that_cannot_allocate_leaves_cupy_buffers(tmp_path):
    """An RMM that imports but cannot allocate (built for another CUDA, a
    binding missing) is given up once, with a warning, for CuPy's buffers"""
    (tmp_path / "rmm").mkdir()
    (tmp_path / "rmm" / "__init__.py").write_text(
        "class DeviceBuffer:\n"
        "    def __init__(self, size):\n"
        "        raise RuntimeError('no CUDA 99 driver')\n"
    )
    script = (
        "from distributed.comm import mpi_gpu\n"
        "device = mpi_gpu.CuPyDevice()\n"
        "print(type(device.buffer(16)).__name__, type(device.buffer(8)).__name__)\n"
    )
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.split() == ["ndarray", "ndarray"], out.stderr
    assert out.stderr.count("RMM is installed but cannot allocate") == 1
    assert "no CUDA 99 driver" in out.stderr


@gen_test()
async def test_device_slices_reach_mpi_as_pointers():
    """A chunk of a device frame goes to MPI as a pointer and size; here the
    'device' memory is host memory, which MPI, not CUDA-aware, reads as is"""
    MPI = await mpi_startup.mpi_ready()

    class Buffer:  # host memory, exposed as CuPy exposes device memory
        def __init__(self, array):
            self.array = array
            self.__cuda_array_interface__ = {
                "data": (array.ctypes.data, False),
                "shape": (array.nbytes,),
                "typestr": "|u1",
                "version": 3,
            }

    source = Buffer(np.arange(100, dtype="u1"))
    target = Buffer(np.zeros(100, dtype="u1"))
    assert mpi_gpu.is_device(source) and mpi_gpu.nbytes(source) == 100
    comm = MPI.COMM_SELF
    for offset, size in mpi_gpu.pieces(100, 30):
        request = comm.Irecv([mpi_gpu.DeviceSlice(target, offset, size), MPI.BYTE])
        comm.Send([mpi_gpu.DeviceSlice(source, offset, size), MPI.BYTE], 0)
        request.Wait()
    assert (target.array == source.array).all()


@pytest.mark.skipif(mpi_gpu.has_gpu(), reason="needs a process without a GPU")
@gen_test()
async def test_device_frames_to_a_process_without_gpu_fail_clearly():
    async with comm_pair() as (a, b):
        assert a.gpu_path is b.gpu_path is None  # neither end has a GPU
        # What a peer with a GPU would send, were it to ignore the handshake:
        # the head of one device frame of 8 bytes
        channel = channels.get(mpi_startup.process_id())
        head = Head(False, channel.id, channel.tag(), [(0, 8, Staged.code, 0)])
        a.write_frames([head.pack()])
        with pytest.raises(CommClosedError, match="GPU frames, which this process"):
            await b.read()
        assert b.closed()
        await a.close()


# With a GPU


def sizes() -> list[int]:
    """0 B to 2.5 GB, with chunk and slot boundaries, unless the GPU is small"""
    sizes = [0, 1, 1000, 2**20 - 1, 2**20, 2**20 + 1, 5 * 2**20 + 3, 2**28]
    if os.environ.get("MPI4DASK_GPU_LARGE", "1") == "1":
        sizes.append(2_500_000_000)
    return sizes


@contextlib.asynccontextmanager
async def comm_to_a_peer(tmp_path):
    """A comm to an echoing peer process (mpi_peer), under mpiexec"""
    path = str(tmp_path / "address")
    with mpiexec(
        ["-n", "1", "-m", "distributed.comm.tests.mpi_peer", "serve", path]
    ) as job:
        comm = await connect(wait_for_file(path, job))
        yield comm
        await comm.close()


async def echoed(comm, x) -> dict:
    """``x`` back from the peer, with the type the peer got"""
    await comm.write({"op": "echo", "x": to_serialize(x)})
    return await comm.read()


@gpu
@gen_test(timeout=600)
async def test_cupy_arrays_between_two_processes(tmp_path):
    import cupy

    MPI = await mpi_startup.mpi_ready()
    async with comm_to_a_peer(tmp_path) as comm:
        # Both ends are alike, and so is their MPI
        assert comm.gpu_path == ("direct" if mpi_gpu.cuda_aware(MPI)[0] else "staged")
        for size in sizes():
            x = cupy.random.randint(0, 255, size=size, dtype="u1")
            reply = await echoed(comm, x)
            assert reply["type"] == "cupy.ndarray"  # on the device over there
            y = reply["x"]
            assert isinstance(y, cupy.ndarray) and y.shape == x.shape
            assert bool((y == x).all())
            del x, y, reply
        # Not contiguous, and in a message with host frames
        x = cupy.arange(10**6, dtype="f8").reshape(1000, 1000)[::2, ::3]
        y, host, raw = (await echoed(comm, [x, np.arange(10**6), b"bytes"]))["x"]
        assert isinstance(y, cupy.ndarray) and bool((y == x).all())
        assert isinstance(host, np.ndarray) and (host == np.arange(10**6)).all()
        assert raw == b"bytes"


@pytest.fixture
def staged_copies(monkeypatch):
    """The copies between the GPU and pinned host memory, as they are made"""
    staged = mpi_gpu._Stager.copy
    calls = []

    async def copy(self, *args, **kwargs):
        calls.append(args)
        return await staged(self, *args, **kwargs)

    monkeypatch.setattr(mpi_gpu._Stager, "copy", copy)
    return calls


@gpu
@pytest.mark.parametrize("ipc", [True, False])
@gen_test(timeout=120)
async def test_cupy_arrays_by_ipc_or_through_mpi(
    tmp_path, monkeypatch, staged_copies, ipc
):
    """Between processes of one host device frames are copied from the
    writer's GPU memory (``device-ipc``), not staged or sent through MPI;
    with it off, they are.  Frames of one pool allocation, of several, and
    of none (zero bytes)"""
    import cupy

    monkeypatch.setenv("DASK_DISTRIBUTED__COMM__MPI__DEVICE_IPC", str(ipc))
    empty = cupy.empty(0, "u1")  # at address 0, in no allocation
    with dask.config.set({"distributed.comm.mpi.device-ipc": ipc}):
        async with comm_to_a_peer(tmp_path) as comm:
            for _ in range(100 if not ipc else 0):
                # Without IPC, as host frames until the channel is open
                await echoed(comm, cupy.ones(2**23, "u1"))
                if comm.channel is not None:
                    break
                await asyncio.sleep(0.05)
            pool = cupy.arange(2**24, dtype="u1")  # pieces of one allocation
            for x in [pool[: 2**20], pool[2**20 : 2**22], cupy.ones(2**22, "f8")]:
                y = (await echoed(comm, [x, x + 1, empty]))["x"]
                assert bool((y[0] == x).all()) and bool((y[1] == x + 1).all())
                assert isinstance(y[2], cupy.ndarray) and y[2].shape == (0,)
    if ipc or mpi_gpu.cuda_aware(await mpi_startup.mpi_ready())[0]:
        assert not staged_copies  # received by IPC (or direct): nothing staged
    else:
        assert staged_copies


@gpu
@gen_test(timeout=120)
async def test_frames_freed_by_their_writer_are_not_kept_by_its_reader(tmp_path):
    """A reader's mapping keeps the writer's allocation even once the writer
    frees it (openucx/ucx#4410): arrays of allocations of their own
    (cudaMalloc, no pool), each sent, copied and freed, leave no more than
    ``Mappings.MAPPED_BYTES`` of the GPU's memory in use"""
    import cupy

    size = 2**28

    def used() -> int:
        free, total = cupy.cuda.runtime.memGetInfo()
        return total - free

    async with comm_to_a_peer(tmp_path) as comm:

        async def send_fresh(i: int) -> None:
            memory = cupy.cuda.Memory(size)  # cudaMalloc: freed with x
            x = cupy.ndarray(size, "u1", cupy.cuda.MemoryPointer(memory, 0))
            x.fill(i)
            await comm.write({"op": "sum", "x": to_serialize(x)})
            assert (await comm.read())["sum"] == i * size

        for i in range(2):
            await send_fresh(i)
        before = used()
        for i in range(16):
            await send_fresh(i)
        assert used() - before <= mpi_ipc.Mappings.MAPPED_BYTES + 2 * size


@gpu
@gen_test(timeout=120)
async def test_memory_of_a_stream_ordered_pool_goes_staged(tmp_path, staged_copies):
    """cudaMallocAsync's memory has no legacy IPC handle: such frames cannot
    be lent on the socket, and travel as host frames until the MPI channel is
    open, then take the route MPI allows (staged from PyPI's MPICH); they
    arrive right every time"""
    import cupy

    with cupy.cuda.using_allocator(cupy.cuda.MemoryAsyncPool().malloc):
        x = cupy.arange(2**22, dtype="u1")
    assert mpi_gpu.device().export(x) is None
    async with comm_to_a_peer(tmp_path) as comm:
        for _ in range(50):
            y = (await echoed(comm, [x, cupy.ones(2**22, "f8")]))["x"]
            assert bool((y[0] == x).all()) and bool((y[1] == 1).all())
            if comm.channel is not None:  # this message took it
                break
            await asyncio.sleep(0.05)
        assert comm.channel is not None
    if not mpi_gpu.cuda_aware(await mpi_startup.mpi_ready())[0]:
        assert staged_copies


@gpu
@gen_test(timeout=120)
async def test_numba_device_array_between_two_processes(tmp_path):
    numba_cuda = pytest.importorskip("numba.cuda")
    async with comm_to_a_peer(tmp_path) as comm:
        x = numba_cuda.to_device(np.arange(3 * 2**20, dtype="i4"))
        y = (await echoed(comm, x))["x"]
        assert numba_cuda.is_cuda_array(y)
        assert (y.copy_to_host() == np.arange(3 * 2**20)).all()


@gpu
@gen_test(timeout=120)
async def test_rmm_buffer_between_two_processes(tmp_path):
    rmm = pytest.importorskip("rmm")
    async with comm_to_a_peer(tmp_path) as comm:
        data = np.arange(2**20, dtype="u1")
        y = (await echoed(comm, rmm.DeviceBuffer.to_device(data.tobytes())))["x"]
        assert isinstance(y, rmm.DeviceBuffer)
        assert bytes(y.tobytes()) == data.tobytes()


@gpu
def test_cupy_dask_array_on_a_cluster():
    """Workers in processes of their own, data moving between them on mpi://,
    against the same computation on one GPU"""
    import cupy
    import dask.array as da

    # Made in chunks where they are used, not shipped in the graph
    x = da.random.random((4000, 4000), chunks=1000).map_blocks(cupy.asarray)
    expected_sum = float((x + x.T).sum().compute(scheduler="sync"))
    expected_dot = (x @ x.T).compute(scheduler="sync")
    with LocalCluster(
        protocol="mpi", n_workers=2, threads_per_worker=1, dashboard_address=":0"
    ) as cluster, Client(cluster) as client:
        x = x.persist()
        total = client.compute((x + x.T).sum()).result()
        dot = client.compute(x @ x.T).result()
        assert isinstance(total, cupy.ndarray) and isinstance(dot, cupy.ndarray)
        assert np.isclose(float(total), expected_sum)
        assert bool(cupy.allclose(dot, expected_dot))
        # Data moved between the workers, on the device
        moved = client.run(
            lambda dask_worker: dask_worker.state.transfer_incoming_count_total
        )
        assert sum(moved.values()) > 0
        assert gpu_paths(client) & {"staged", "direct"}


def gpu_paths(client) -> set:
    """How the comms that the workers keep for each other move GPU frames"""
    paths = client.run(
        lambda dask_worker: {
            comm.gpu_path
            for comms in dask_worker.rpc.available.values()
            for comm in comms
        }
    )
    return set().union(*paths.values())


@gpu
@pytest.mark.timeout(180)
def test_cupy_work_with_a_scheduler_without_gpu(tmp_path):
    """A scheduler on a node without a GPU and workers with one, each in a
    process of its own: the workers move device data between them"""
    import cupy
    import dask.array as da

    file = str(tmp_path / "scheduler.json")
    no_gpu = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    scheduler = ["dask", "scheduler", "--protocol", "mpi", "--scheduler-file", file]
    worker = ["dask", "worker", "--scheduler-file", file, "--nthreads", "1"]
    with popen([*scheduler, "--dashboard-address", ":0"], env=no_gpu):
        with popen(worker), popen(worker), Client(scheduler_file=file) as client:
            client.wait_for_workers(2, timeout=60)
            assert not client.run_on_scheduler(mpi_gpu.has_gpu)
            x = da.random.random((4000, 4000), chunks=1000).map_blocks(cupy.asarray)
            expected = float((x + x.T).sum().compute(scheduler="sync"))
            total = client.compute((x + x.T).sum()).result()
            assert isinstance(total, cupy.ndarray)
            assert np.isclose(float(total), expected)
            assert gpu_paths(client) & {"staged", "direct"}


@gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rmm_pool", [None, "1GB"])
def test_dask_cuda_local_cuda_cluster_and_cli_worker(tmp_path, rmm_pool):
    """dask-cuda as GPU users run it: ``LocalCUDACluster(protocol="mpi")``,
    with and without an RMM pool (its devices' memory hands out pieces of one
    allocation), and ``dask cuda worker`` with an mpi:// scheduler"""
    dask_cuda = pytest.importorskip("dask_cuda")
    import cupy
    import dask.array as da

    x = da.random.random((4000, 4000), chunks=1000).map_blocks(cupy.asarray)
    expected = float((x + x.T).sum().compute(scheduler="sync"))
    with dask_cuda.LocalCUDACluster(
        protocol="mpi", rmm_pool_size=rmm_pool, dashboard_address=":0"
    ) as cluster, Client(cluster) as client:
        assert cluster.scheduler_address.startswith("mpi://")
        assert np.isclose(float(client.compute((x + x.T).sum()).result()), expected)
    file = str(tmp_path / "scheduler.json")
    scheduler = ["dask", "scheduler", "--protocol", "mpi", "--scheduler-file", file]
    worker = ["dask", "cuda", "worker", "--scheduler-file", file]
    if rmm_pool:
        worker += ["--rmm-pool-size", rmm_pool]
    with popen([*scheduler, "--dashboard-address", ":0"]), popen(worker):
        with Client(scheduler_file=file) as client:
            client.wait_for_workers(1, timeout=60)
            total = client.compute((x + x.T).sum()).result()
            assert np.isclose(float(total), expected)


BENCHMARKS = os.path.join(os.path.dirname(__file__), *[os.pardir] * 3, "benchmarks")


@pytest.mark.timeout(420)
@pytest.mark.skipif(
    not os.path.exists(os.path.join(BENCHMARKS, "gpu.py")),
    reason="the benchmarks are in the checkout, not in an installed package",
)
def test_the_gpu_benchmark_rehearses_on_host_arrays(tmp_path):
    """benchmarks/gpu.py, as on a GPU machine, with numpy in CuPy's place:
    every transport measured but ucx://, each part whole, the figures
    publishable (a GPU run is rare, and must not be spent on the script)"""
    import json

    sys.path.insert(0, BENCHMARKS)
    try:
        import publish
    finally:
        sys.path.remove(BENCHMARKS)

    cmd = [sys.executable, "gpu.py", "--quick", "--host-arrays", "--out", tmp_path]
    proc = subprocess.Popen(cmd + ["--limit", "120", "--budget", "360"], cwd=BENCHMARKS)
    try:
        assert proc.wait(390) == 0
    finally:
        if proc.poll() is None:
            proc.terminate()  # it stops what it started
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(60)
            proc.kill()
            proc.wait()
    with open(tmp_path / "gpu.json") as f:
        results = json.load(f)
    variants = ["mpi:// ipc", "tcp://", "mpi:// staged", "mpi:// ipc, channel"]
    assert [v for v in results["variants"] if v != "ucx://"] == variants
    assert results["failed"] == {}
    top = str(2**28)
    workloads = {"transpose_sum", "dot", "rechunk", "gather"}
    for name in variants:
        assert top in results["pingpong"][name]
        assert workloads <= set(results["apps"][name]), results["apps"][name]
        assert all("wall_time" in f for f in results["apps"][name].values())
    lines = publish.gpu_lines(results)
    assert "failed" not in "\n".join(lines)
