"""mpi:// across hosts, simulated on this machine (see ``simulated_hosts``):
real processes on different hosts, each test checking that data between
workers on different hosts moved over MPI.  The test process is on none of
the hosts' networks: a client runs on a host (``mpi_hosts_client``)."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytest.importorskip("mpi4py")
pytest.importorskip("numpy")

from distributed.comm.tests.mpi_processes import (
    OPENMPI_ENV,
    _env,
    known_mpi_crash,
    leaked_hwloc_files,
    library_python_or_skip,
    mpiexec,
    mpiexec_command,
    wait_for_file,
)
from distributed.comm.tests.simulated_hosts import (
    ACROSS_HOSTS,
    STATE,
    SimulatedHosts,
    skip_reason,
)

pytestmark = pytest.mark.timeout(180)

WORKER = ["-m", "distributed.cli.dask_worker", "--nthreads", "1", "--no-dashboard"]
SCHEDULER = ["-m", "distributed.cli.dask_scheduler", "--no-dashboard"]
SIZE = 2**24  # bytes of each array the client moves


@pytest.fixture
def simulated_hosts():
    """``simulated_hosts(n, **kwargs)``: :class:`SimulatedHosts`, closed at the
    end of the test; the test skips where hosts cannot be simulated"""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    start = time.time()
    with contextlib.ExitStack() as stack:
        yield lambda *args, **kwargs: stack.enter_context(
            SimulatedHosts(*args, **kwargs)
        )
    # Killed Hydra proxies leave these; mpiexec() and SimulatedHosts remove them
    assert not leaked_hwloc_files(since=start)
    # ip netns mounts /run/netns on itself; the last instance unmounts it
    with open("/proc/self/mountinfo") as f:
        mounted = {line.split()[4] for line in f}
    assert os.listdir("/run/netns") or "/run/netns" not in mounted


def on(hosts: SimulatedHosts, name: str, **env) -> list[str]:
    """A prefix that runs mpiexec (:func:`mpiexec`) on host ``name``"""
    return hosts.command(name, [], env=env)


def hydra(hosts: SimulatedHosts, spread: dict[str, int]) -> list[str]:
    """mpiexec's options for one job over several hosts"""
    spec = ",".join(f"{name}:{n}" for name, n in spread.items())
    return ["-launcher", "ssh", "-launcher-exec", hosts.fake_ssh, "-hosts", spec]


@contextlib.contextmanager
def client_process(
    hosts: SimulatedHosts,
    name: str,
    scheduler: str,
    n: int,
    *args,
    python: str = sys.executable,
):
    """``mpi_hosts_client`` running on host ``name``"""
    command = [python, "-m", "distributed.comm.tests.mpi_hosts_client"]
    output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    argv = [*command, scheduler, str(n), *args]
    with hosts.popen(name, argv, env=_env(python), **output) as proc:
        try:
            yield proc
        finally:
            proc.kill()


def client_report(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=150)
    for line in out.splitlines():
        if line.startswith("REPORT "):
            return json.loads(line[len("REPORT ") :])
    raise AssertionError(f"no report ({proc.returncode}):\n{out}")


def client(hosts: SimulatedHosts, name: str, scheduler: str, n: int, **kwargs) -> dict:
    """Run ``mpi_hosts_client`` on host ``name``; its report"""
    with client_process(hosts, name, scheduler, n, **kwargs) as proc:
        return client_report(proc)


def check_across_hosts(hosts: SimulatedHosts, report: dict, nhosts: int) -> None:
    """Workers on ``nhosts`` hosts, each advertising its own host's address,
    computed right, and moved the data between them over MPI"""
    assert report["right"], report
    workers = report["workers"].values()
    assert len({w["hostname"] for w in workers}) == nhosts, report
    for address, worker in report["workers"].items():
        assert worker["host"] == hosts.address(worker["hostname"]), report
        assert f"//{worker['host']}:" in address
        # At least the arrays it sent and received, over channels to
        # workers on other hosts
        assert worker["moved"] >= SIZE, report


@pytest.mark.parametrize("library", ["MPICH", "Intel MPI"])
def test_dask_cli_under_one_mpiexec_across_hosts(simulated_hosts, library, tmp_path):
    """One job over three hosts: the scheduler and a worker on one, a worker
    on each other.  The two workers on other hosts know they are ranks of
    one job (Intel MPI's by the job id its Hydra gives every rank): their
    channel was made by MPI_Comm_create_group (Intel MPI's over its OFI
    fabric, here libfabric's tcp provider)"""
    python = library_python_or_skip(library)
    # Intel MPI's libfabric takes the machine's own eth0 otherwise
    env = {"FI_TCP_IFACE": "eth0"} if library == "Intel MPI" else {}
    hosts = simulated_hosts(3)
    a, b, c = hosts.names
    path = str(tmp_path / "scheduler.json")
    args = [*hydra(hosts, {a: 2, b: 1, c: 1}), "-n", "1", *SCHEDULER]
    args += ["--protocol", "mpi", "--scheduler-file", path, ":", "-n", "3", *WORKER]
    args += ["--no-nanny", "--scheduler-file", path]
    with mpiexec(args, prefix=on(hosts, a, **env), python=python) as job:
        wait_for_file(path, job)
        report = client(hosts, a, path, 3, python=python)
    check_across_hosts(hosts, report, 3)
    workers = report["workers"].values()
    assert all(w["library"].startswith(library) for w in workers), report
    worlds = {w["world"][0] for w in workers}
    ranks = sorted(w["world"][1] for w in workers)
    assert len(worlds) == 1 and ranks == [1, 2, 3], report
    for worker in workers:
        assert worker["channels"], report
        assert not any(c["inter"] for c in worker["channels"]), report


def test_separate_launches_on_different_hosts(simulated_hosts, tmp_path):
    """The scheduler on one host, each worker its own ``mpiexec -n 1`` on
    another, with a nanny (the default)"""
    hosts = simulated_hosts(3)
    a, b, c = hosts.names
    path = str(tmp_path / "scheduler.json")
    scheduler = ["-n", "1", *SCHEDULER, "--protocol", "mpi", "--scheduler-file", path]
    worker = ["-n", "1", *WORKER, "--scheduler-file", path]
    with mpiexec(scheduler, prefix=on(hosts, a)) as job:
        wait_for_file(path, job)
        with mpiexec(worker, prefix=on(hosts, b)), mpiexec(worker, prefix=on(hosts, c)):
            report = client(hosts, a, path, 2)
    check_across_hosts(hosts, report, 2)
    for worker in report["workers"].values():
        assert worker["world"] is None  # a nanny's worker is a job of its own
        assert all(c["inter"] for c in worker["channels"]), report


def test_dask_mpi_across_hosts(simulated_hosts, tmp_path):
    """``dask-mpi --protocol mpi`` over three hosts: the scheduler on the
    first, workers (with nannies) on the others; a client on the first"""
    hosts = simulated_hosts(3)
    a, b, c = hosts.names
    path = str(tmp_path / "scheduler.json")
    args = [*hydra(hosts, {a: 1, b: 1, c: 1}), "-n", "3", "dask-mpi"]
    args += ["--protocol", "mpi", "--scheduler-file", path, "--nthreads", "1"]
    args += ["--no-dashboard"]
    with mpiexec(args, prefix=on(hosts, a)) as job:
        wait_for_file(path, job)
        report = client(hosts, a, path, 2)
    check_across_hosts(hosts, report, 2)
    assert {w["hostname"] for w in report["workers"].values()} == {b, c}


def test_frames_between_hosts_without_rdma_travel_over_tcp(simulated_hosts, tmp_path):
    """By default (``across-hosts: auto``), processes on hosts without an RDMA
    network move frames between them over TCP, as MPI would (more slowly):
    the result is right, and no MPI channel opens between the hosts"""
    hosts = simulated_hosts(2)
    a, b = hosts.names
    auto = {ACROSS_HOSTS: "auto"}
    path, log = str(tmp_path / "scheduler.json"), tmp_path / "worker.log"
    scheduler = ["-n", "1", *SCHEDULER, "--protocol", "mpi", "--scheduler-file", path]
    worker = ["-n", "1", *WORKER, "--no-nanny", "--scheduler-file", path]
    with mpiexec(scheduler, prefix=on(hosts, a, **auto)) as job:
        wait_for_file(path, job)
        with open(log, "w") as out, mpiexec(
            worker, prefix=on(hosts, a, **auto), stdout=out, stderr=subprocess.STDOUT
        ), mpiexec(worker, prefix=on(hosts, b, **auto)):
            report = client(hosts, a, path, 2)
    assert report["right"], report
    workers = report["workers"].values()
    assert {w["hostname"] for w in workers} == {a, b}, report
    for worker in workers:
        assert worker["channels"] == [] and worker["moved"] == 0, report
    assert "on other hosts travel over TCP" in log.read_text()


def test_client_outside_the_job_over_tcp(simulated_hosts, tmp_path):
    """The scheduler listens on mpi:// for workers and tcp:// for clients: a
    client on a host that is not in the job drives it over TCP, and the
    workers still move data between them over MPI"""
    hosts = simulated_hosts(3)
    a, b, c = hosts.names
    path = str(tmp_path / "scheduler.json")
    args = [*hydra(hosts, {a: 1, b: 1}), "-n", "1", *SCHEDULER]
    args += ["--protocol", "mpi,tcp", "--port", "8786,8788", "--scheduler-file", path]
    args += [":", "-n", "2", *WORKER, "--no-nanny", f"mpi://{a}:8786"]
    with mpiexec(args, prefix=on(hosts, a)) as job:
        wait_for_file(path, job)
        report = client(hosts, c, f"tcp://{hosts.address(a)}:8788", 2)
    check_across_hosts(hosts, report, 2)
    assert report["scheduler"].startswith("tcp://")


def test_worker_killed_on_another_host_while_data_moves(
    simulated_hosts, tmp_path, capfd
):
    """A worker SIGKILLed on its host while arrays move between hosts: the
    computation finishes on the workers left, right, and the cluster goes
    on, without a hang"""
    hosts = simulated_hosts(2)
    a, b = hosts.names
    path, killfile = str(tmp_path / "scheduler.json"), str(tmp_path / "kill")
    scheduler = ["-n", "1", *SCHEDULER, "--protocol", "mpi", "--scheduler-file", path]
    worker = ["-n", "1", *WORKER, "--scheduler-file", path, "--no-nanny"]
    with mpiexec(scheduler, prefix=on(hosts, a)) as job:
        wait_for_file(path, job)
        with mpiexec(worker, prefix=on(hosts, b)), mpiexec(worker, prefix=on(hosts, a)):
            python = os.path.realpath(sys.executable)
            with client_process(hosts, a, path, 2, "kill", killfile) as proc:
                wait_for_file(killfile, proc, timeout=90)
                victims = [p for p in hosts.processes(b) if p.exe() == python]
                if not victims:  # it died before it was killed
                    output = "".join(capfd.readouterr())
                    if crash := known_mpi_crash(output):
                        pytest.xfail(crash)
                    sys.stderr.write(output)
                [victim] = victims
                victim.kill()
                report = client_report(proc)
            assert job.poll() is None  # the scheduler lives
    assert report["wrong"] == 0, report
    # Recomputed on the worker left; none lost for good
    assert report["right"] + len(report["errors"]) == 40, report
    assert report["right"] >= 20, report
    assert report["after"], report
    [survivor] = report["workers"].values()
    assert survivor["hostname"] == a


def test_workers_advertise_their_own_hosts_address(simulated_hosts, tmp_path):
    """Two workers per host, one job with nannies: the scheduler knows each
    by its host's address"""
    hosts = simulated_hosts(2)
    a, b = hosts.names
    path = str(tmp_path / "scheduler.json")
    args = [*hydra(hosts, {a: 2, b: 1}), "-n", "1", *SCHEDULER]
    args += ["--protocol", "mpi", "--scheduler-file", path, ":", "-n", "2", *WORKER]
    args += ["--scheduler-file", path]
    with mpiexec(args, prefix=on(hosts, a)) as job:
        wait_for_file(path, job)
        report = client(hosts, b, path, 2)
    check_across_hosts(hosts, report, 2)
    hostnames = {w["hostname"]: w["host"] for w in report["workers"].values()}
    assert hostnames == {name: hosts.address(name) for name in hosts.names}
    assert report["scheduler"].startswith(f"mpi://{hosts.address(a)}:")


# An echo server (serve PATH HOST) and its client (client PATH), over mpi://:
# the client writes PATH.moved once large frames went both ways over an MPI
# channel, then exits once PATH.go exists
EXCHANGE = """
import asyncio, faulthandler, os, sys
import numpy as np
faulthandler.dump_traceback_later(30)
from distributed.comm import connect, listen
from distributed.protocol import to_serialize

async def serve(path, host):
    closed = asyncio.Event()
    async def echo(comm):
        try:
            while True:
                await comm.write(await comm.read())
        except Exception:
            closed.set()
    async with listen(f"mpi://{host}:0", echo, deserialize=False) as listener:
        with open(path + ".tmp", "w") as f:
            f.write(listener.contact_address)
        os.rename(path + ".tmp", path)
        await closed.wait()

async def client(path):
    while not os.path.exists(path):
        await asyncio.sleep(0.05)
    with open(path) as f:
        comm = await connect(f.read())
    for _ in range(100):  # the channel opens in the background
        await comm.write({"x": to_serialize(np.ones(2**22, "u1"))})
        assert (await comm.read())["x"].sum() == 2**22
        if comm.channel is not None and comm.channel.nbytes >= 2**24:
            break
    else:
        raise AssertionError("no MPI channel")
    await comm.close()
    open(path + ".moved", "w").close()
    while not os.path.exists(path + ".go"):
        await asyncio.sleep(0.05)

if sys.argv[1] == "serve":
    asyncio.run(serve(*sys.argv[2:]))
else:
    asyncio.run(client(*sys.argv[2:]))
"""


def ucx_complaints(output: str) -> list[str]:
    return [
        line
        for line in output.splitlines()
        if "UCX" in line
        and ("WARN" in line or "ERROR" in line)
        or "BAD TERMINATION" in line
    ]


def wait_or_explain(path: str, proc: subprocess.Popen) -> None:
    """Wait for ``proc`` to write ``path``; else kill it, and xfail on a
    known crash of MPICH's, or fail with its output"""
    try:
        wait_for_file(path, proc, timeout=60)
    except (RuntimeError, TimeoutError):
        proc.kill()
        out = proc.communicate()[0].decode(errors="replace")
        if crash := known_mpi_crash(out):
            pytest.xfail(crash)
        raise AssertionError(out)


@pytest.mark.parametrize("peer", ["exits", "killed"])
def test_processes_exit_cleanly_after_moving_data_across_hosts(
    simulated_hosts, tmp_path, peer
):
    """Two processes on different hosts, each its own ``mpiexec -n 1``, that
    moved large frames over MPI exit with status 0 and no complaint from UCX,
    whether the other exited first or was killed.  MPI_Finalize crashed in
    the process that had called MPI_Comm_connect (MPICH 5.0, UCX over TCP:
    it reported a request as leaked, reading freed memory), see
    ``mpi_startup.skip_finalize``"""
    hosts = simulated_hosts(2)
    # The process whose process_id() sorts first accepts: the client, on the
    # other host, connects
    a, b = sorted(hosts.names)
    path = str(tmp_path / "address")
    python = os.path.realpath(sys.executable)
    output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    run = [mpiexec_command(), "-n", "1", sys.executable, "-c", EXCHANGE]
    serve = [*run, "serve", path, hosts.address(a)]
    with hosts.popen(a, serve, env=_env(), **output) as server:
        with hosts.popen(b, [*run, "client", path], env=_env(), **output) as client:
            try:
                wait_or_explain(path + ".moved", client)
                if peer == "killed":
                    [victim] = [p for p in hosts.processes(a) if p.exe() == python]
                    victim.kill()
                out, _ = server.communicate(timeout=30)
                out = out.decode(errors="replace")
                if peer == "exits":
                    assert server.returncode == 0, out
                    assert not ucx_complaints(out), out
                open(path + ".go", "w").close()
                out, _ = client.communicate(timeout=30)
                out = out.decode(errors="replace")
                assert client.returncode == 0, out
                assert not ucx_complaints(out), out
            finally:
                client.kill()
                server.kill()


DIES_WRITING = """
import asyncio, os, sys, time
import numpy as np
from distributed.comm import CommClosedError, connect, listen
from distributed.protocol import to_serialize

async def serve(path, host):
    async def write(comm):
        while True:
            msg = await comm.read()
            await comm.write({"x": to_serialize(np.ones(msg["size"], "u1"))})
            if msg.get("last"):
                # Its sends posted, and never pushed on: the test kills it here
                open(path + ".writing", "w").close()
                time.sleep(120)
    async with listen(f"mpi://{host}:0", write) as listener:
        with open(path + ".tmp", "w") as f:
            f.write(listener.contact_address)
        os.rename(path + ".tmp", path)
        await asyncio.sleep(120)

async def client(path):
    while not os.path.exists(path):
        await asyncio.sleep(0.05)
    with open(path) as f:
        comm = await connect(f.read())
    for _ in range(100):  # the channel opens in the background
        await comm.write({"size": 2**22})
        await comm.read()
        if comm.channel is not None and comm.channel.nbytes >= 2**24:
            break
    else:
        raise AssertionError("no MPI channel")
    await comm.write({"size": 2**28, "last": True})
    start = time.monotonic()
    try:
        await comm.read()
    except CommClosedError as e:
        print(f"FAILED after {time.monotonic() - start:.1f} s: {e}", flush=True)

asyncio.run(serve(*sys.argv[2:]) if sys.argv[1] == "serve" else client(sys.argv[2]))
"""


def test_a_read_from_a_writer_killed_on_another_host_fails_soon(
    simulated_hosts, tmp_path
):
    """A writer on another host killed while the reader waits for its frames
    over MPI: nothing else says it died, its socket tells, and the read fails
    a second after nothing more came, not after ``stall-timeout``"""
    hosts = simulated_hosts(2)
    a, b = hosts.names
    path = str(tmp_path / "address")
    python = os.path.realpath(sys.executable)
    env = {**_env(), "DASK_DISTRIBUTED__COMM__MPI__STALL_TIMEOUT": "90s"}
    output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "env": env}
    run = [mpiexec_command(), "-n", "1", sys.executable, "-c", DIES_WRITING]
    with hosts.popen(a, [*run, "serve", path, hosts.address(a)], **output) as writer:
        with hosts.popen(b, [*run, "client", path], **output) as reader:
            try:
                wait_or_explain(path + ".writing", reader)
                [victim] = [p for p in hosts.processes(a) if p.exe() == python]
                victim.kill()
                out = reader.communicate(timeout=60)[0].decode(errors="replace")
            finally:
                reader.kill()
                writer.kill()
    assert "FAILED after" in out, out
    seconds = float(out.split("FAILED after ")[1].split()[0])
    assert seconds < 30, out


def test_job_and_worker_alone_on_other_hosts_shut_down_cleanly(
    simulated_hosts, tmp_path
):
    """A job of two ranks (the scheduler and a worker) on one host and a
    worker alone in its job on another move data over MPI; after
    ``client.shutdown()`` every process exits with 0, without a complaint
    from UCX.  MPICH's MPI_Finalize crashes in a process that connected to
    another host, and a rank of a bigger job cannot leave it out: the
    process alone in its job connects"""
    hosts = simulated_hosts(2)
    # The job on the host whose name sorts last: its rank would connect if
    # process ids alone decided
    alone_on, job_on = sorted(hosts.names)
    path = str(tmp_path / "scheduler.json")
    worker = [*WORKER, "--no-nanny", "--scheduler-file", path]
    args = ["-n", "1", *SCHEDULER, "--protocol", "mpi", "--scheduler-file", path]
    args += [":", "-n", "1", *worker]
    logs = {name: tmp_path / f"{name}.log" for name in ["job", "alone"]}
    with open(logs["job"], "w") as out, open(logs["alone"], "w") as out_alone:
        output = {"stderr": subprocess.STDOUT}
        with mpiexec(args, prefix=on(hosts, job_on), stdout=out, **output) as job:
            wait_for_file(path, job)
            with mpiexec(
                ["-n", "1", *worker],
                prefix=on(hosts, alone_on),
                stdout=out_alone,
                **output,
            ) as alone:
                with client_process(hosts, job_on, path, 2, "shutdown") as proc:
                    report = client_report(proc)
                alone.wait(60)
            job.wait(60)
    try:
        check_across_hosts(hosts, report, 2)
    except AssertionError as e:  # why the data went over TCP, if it did
        output = {name: log.read_text()[-20000:] for name, log in logs.items()}
        raise AssertionError(f"{e}\n{output['job']}\n{output['alone']}") from e
    for name, proc in [("job", job), ("alone", alone)]:
        out = logs[name].read_text()
        assert proc.returncode == 0, out
        assert not ucx_complaints(out), out


def test_jobs_of_several_ranks_on_different_hosts_shut_down_cleanly(
    simulated_hosts, tmp_path
):
    """A job of two ranks (the scheduler and a worker) on one host, and a job
    of two workers on another.  Ranks of two MPICH jobs on different hosts
    move their data over TCP: the one that called MPI_Comm_connect would
    crash or warn in MPI_Finalize, which it cannot leave out (see
    ``mpi_handshake.jobs_apart_across_hosts``).  After ``client.shutdown()``
    every process exits with 0, without a complaint from UCX"""
    hosts = simulated_hosts(2)
    a, b = hosts.names
    path = str(tmp_path / "scheduler.json")
    worker = [*WORKER, "--no-nanny", "--scheduler-file", path]
    first = ["-n", "1", *SCHEDULER, "--protocol", "mpi", "--scheduler-file", path]
    first += [":", "-n", "1", *worker]
    logs = {name: tmp_path / f"{name}.log" for name in [a, b]}
    with open(logs[a], "w") as out_a, open(logs[b], "w") as out_b:
        output = {"stderr": subprocess.STDOUT}
        with mpiexec(first, prefix=on(hosts, a), stdout=out_a, **output) as job_a:
            wait_for_file(path, job_a)
            second = ["-n", "2", *worker]
            with mpiexec(second, prefix=on(hosts, b), stdout=out_b, **output) as job_b:
                with client_process(hosts, a, path, 3, "shutdown") as proc:
                    report = client_report(proc)
                job_b.wait(60)
            job_a.wait(60)
    assert report["right"], report
    on_b = [w for w in report["workers"].values() if w["hostname"] == b]
    [on_a] = [w for w in report["workers"].values() if w["hostname"] == a]
    assert len(on_b) == 2 and on_a["world"][0] != on_b[0]["world"][0], report
    for worker in [on_a, *on_b]:
        assert worker["channels"] == [] and worker["moved"] == 0, report
    for name, proc in [(a, job_a), (b, job_b)]:
        out = logs[name].read_text()
        assert proc.returncode == 0, out
        assert not ucx_complaints(out), out
    assert "move their data over TCP" in logs[a].read_text()


@pytest.mark.parametrize(
    "netmod,interface", [("ucx", "eth0"), ("ucx", "eth1"), ("ofi", "eth1")]
)
def test_mpi_traffic_goes_over_the_interface_named(
    simulated_hosts, netmod, interface, tmp_path
):
    """Hosts with two networks: MPICH moves data between hosts over the
    interface named by ``UCX_NET_DEVICES`` (its default netmod, UCX) or
    ``FI_TCP_IFACE`` (libfabric's tcp provider), whichever network host
    names resolve to; the comms' TCP connections use eth0, where they do"""
    hosts = simulated_hosts(2, interfaces=2)
    a, b = hosts.names
    other = "eth1" if interface == "eth0" else "eth0"
    # The setting of the netmod not used names the other interface
    if netmod == "ofi":
        env = {"FI_TCP_IFACE": interface, "UCX_NET_DEVICES": other}
        env.update(MPIR_CVAR_CH4_NETMOD="ofi", FI_PROVIDER="tcp")
    else:
        env = {"UCX_NET_DEVICES": interface, "FI_TCP_IFACE": other}
    path, pause = str(tmp_path / "scheduler.json"), str(tmp_path / "pause")
    args = [*hydra(hosts, {a: 2, b: 1}), "-n", "1", *SCHEDULER]
    args += ["--protocol", "mpi", "--scheduler-file", path, ":", "-n", "2"]
    args += [*WORKER, "--no-nanny", "--scheduler-file", path]
    with mpiexec(args, prefix=on(hosts, a, **env)) as job:
        wait_for_file(path, job)
        with client_process(hosts, a, path, 2, "pause", pause) as proc:
            # Between the rounds: the second moves over the channels
            wait_for_file(pause, proc, timeout=120)
            before = {i: hosts.interface_bytes(b, i) for i in ["eth0", "eth1"]}
            open(pause + ".go", "w").close()
            report = client_report(proc)
            after = {i: hosts.interface_bytes(b, i) for i in ["eth0", "eth1"]}
    check_across_hosts(hosts, report, 2)
    moved = {i: after[i] - before[i] for i in before}
    # An array each way in the second round, and hardly anything else
    assert moved[interface] >= 2 * SIZE, moved
    assert moved[other] < SIZE // 4, moved


def test_what_a_killed_test_process_left_is_swept(simulated_hosts):
    """Hosts of a process killed with SIGKILL: their processes die with it,
    and the next instance removes their namespaces, mounts and files"""
    code = (
        "import time; from distributed.comm.tests.simulated_hosts import *; "
        "h = SimulatedHosts(2); h.popen(h.names[1], ['sleep', '599.5']); "
        "print(h.tag, flush=True); time.sleep(600)"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=_env()
    ) as proc:
        tag = proc.stdout.readline().strip()
        proc.kill()
    prefix = f"simhost-{tag}-"

    def left() -> list[str]:
        found = [ns for ns in os.listdir("/run/netns") if ns.startswith(prefix)]
        found += [ns for ns in os.listdir("/etc/netns") if ns.startswith(prefix)]
        with open("/proc/self/mountinfo") as f:
            found += [line for line in f if f"/{tag}/" in line]
        found += [p for p in os.listdir(STATE) if p.startswith(tag)]
        return found

    assert tag and left()
    simulated_hosts(2)
    assert not left()
    deadline = time.monotonic() + 10
    while any(
        p.info["cmdline"] and p.info["cmdline"][-1] == "599.5"
        for p in psutil.process_iter(["cmdline"])
    ):
        assert time.monotonic() < deadline
        time.sleep(0.1)


@pytest.fixture
def openmpi() -> str:
    """The Python of an Open MPI environment; the test skips without one"""
    return library_python_or_skip("Open MPI")


def prte(hosts: SimulatedHosts, spread: dict[str, int]) -> list[str]:
    """Open MPI's mpirun options for one job over several hosts (without
    ``--bind-to none`` each host's ranks share its first core)"""
    spec = ",".join(f"{name}:{n}" for name, n in spread.items())
    options = ["--prtemca", "plm_ssh_agent", hosts.fake_ssh, "--host", spec]
    return [*options, "--bind-to", "none", "--oversubscribe"]


def test_open_mpi_job_across_hosts(simulated_hosts, openmpi, tmp_path):
    """One Open MPI job over three hosts, the dask CLI with workers without
    nannies (Open MPI connects no processes of different jobs): its ranks
    know they are one job on every host, by their PMIx namespace, and the
    channels between workers on different hosts were made by
    MPI_Comm_create_group.  The client, not in the job, comes over tcp://"""
    hosts = simulated_hosts(3)
    a, b, c = hosts.names
    path = str(tmp_path / "scheduler.json")
    args = [*prte(hosts, {a: 2, b: 1, c: 1}), "-n", "1", *SCHEDULER]
    args += ["--protocol", "mpi,tcp", "--port", "8786,8788", "--scheduler-file", path]
    args += [":", "-n", "3", *WORKER, "--no-nanny", f"mpi://{a}:8786"]
    with mpiexec(args, prefix=on(hosts, a, **OPENMPI_ENV), python=openmpi) as job:
        wait_for_file(path, job)
        scheduler = f"tcp://{hosts.address(a)}:8788"
        report = client(hosts, a, scheduler, 3, python=openmpi)
    check_across_hosts(hosts, report, 3)
    workers = report["workers"].values()
    assert all(w["library"].startswith("Open MPI") for w in workers), report
    assert len({w["world"][0] for w in workers}) == 1, report
    assert sorted(w["world"][1] for w in workers) == [1, 2, 3], report
    for worker in workers:
        assert worker["channels"], report
        assert not any(c["inter"] for c in worker["channels"]), report


def test_open_mpi_dask_mpi_across_hosts(simulated_hosts, openmpi, tmp_path):
    """``dask-mpi --protocol mpi`` in one Open MPI job over three hosts, with
    workers without nannies (a nanny's worker would be a process of no job,
    which Open MPI does not connect): the workers on different hosts move
    their data over channels of the job, and a client outside the job drives
    them over the same mpi:// address, its comms on TCP"""
    hosts = simulated_hosts(3)
    a, b, c = hosts.names
    path = str(tmp_path / "scheduler.json")
    args = [*prte(hosts, {a: 1, b: 1, c: 1}), "-n", "3", "-m", "dask_mpi.cli"]
    args += ["--protocol", "mpi", "--scheduler-file", path, "--nthreads", "1"]
    args += ["--no-dashboard", "--worker-class", "distributed.Worker"]
    with mpiexec(args, prefix=on(hosts, a, **OPENMPI_ENV), python=openmpi) as job:
        wait_for_file(path, job)
        report = client(hosts, a, path, 2, python=openmpi)
    check_across_hosts(hosts, report, 2)
    workers = report["workers"].values()
    assert {w["hostname"] for w in workers} == {b, c}, report
    assert all(w["library"].startswith("Open MPI") for w in workers), report
    for worker in workers:
        assert worker["channels"], report
        assert not any(c["inter"] for c in worker["channels"]), report


def test_open_mpi_jobs_apart_move_their_data_over_tcp(
    simulated_hosts, openmpi, tmp_path
):
    """Workers of two Open MPI jobs, on two hosts: Open MPI cannot connect
    processes of different jobs (it would hang in MPI_Comm_accept/connect),
    so their comms move all their data over TCP, and they say why"""
    hosts = simulated_hosts(2)
    a, b = hosts.names
    path, log = str(tmp_path / "scheduler.json"), tmp_path / "worker.log"
    common = ["--bind-to", "none", "--oversubscribe", "-n", "1"]
    worker = [*WORKER, "--no-nanny", f"mpi://{a}:8786"]
    first = [*common, *SCHEDULER, "--protocol", "mpi,tcp", "--port", "8786,8788"]
    first += ["--scheduler-file", path, ":", "-n", "1", *worker]
    on_a, on_b = (on(hosts, name, **OPENMPI_ENV) for name in [a, b])
    with mpiexec(first, prefix=on_a, python=openmpi) as job:
        wait_for_file(path, job)
        with open(log, "w") as out:
            output = {"stdout": out, "stderr": subprocess.STDOUT}
            with mpiexec([*common, *worker], prefix=on_b, python=openmpi, **output):
                scheduler = f"tcp://{hosts.address(a)}:8788"
                report = client(hosts, a, scheduler, 2, python=openmpi)
    assert report["right"], report
    workers = report["workers"].values()
    assert {w["hostname"] for w in workers} == {a, b}, report
    # One worker shares its job with the scheduler, the other is alone in its
    assert len({w["world"] and w["world"][0] for w in workers}) == 2, report
    for worker in workers:
        assert worker["moved"] == 0 and not worker["channels"], report
    assert "Open MPI cannot connect processes of different" in log.read_text()


LOCAL_CLUSTER = """
import numpy as np
from distributed import Client, LocalCluster

if __name__ == "__main__":
    with LocalCluster(
        protocol="mpi", n_workers=2, threads_per_worker=1, dashboard_address=":0"
    ) as cluster, Client(cluster) as client:
        a, b = client.scheduler_info()["workers"]
        x = client.submit(np.ones, 2**21, workers=[a])
        print(client.submit(np.sum, x, workers=[b]).result())
"""


def open_mpi_leftovers() -> set[str]:
    """Open MPI's shared memory files, and the session directories of its jobs"""
    tmp = os.environ.get("TMPDIR", "/tmp")
    jobs = os.path.join(tmp, f"ompi.*.{os.getuid()}", "jf.*", "*")
    return set(glob.glob("/dev/shm/sm_segment.*") + glob.glob(jobs))


def test_open_mpi_processes_it_did_not_launch_leave_nothing_behind(openmpi, tmp_path):
    """Open MPI never removes the /dev/shm/sm_segment.* of a process it did
    not launch, such as those of a LocalCluster, finalized or not, nor the
    directory of its job in /tmp: mpi:// removes both"""
    before = open_mpi_leftovers()
    script = tmp_path / "cluster.py"
    script.write_text(LOCAL_CLUSTER)
    proc = subprocess.Popen(
        [openmpi, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**_env(openmpi), **OPENMPI_ENV},
        cwd=tmp_path,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, out
    assert out.split()[-1] == str(float(2**21)), out
    assert open_mpi_leftovers() <= before
