"""What a process says of itself in an mpi:// handshake (its hello), parsed
once into a :class:`Peer`, which every rule about the pair asks.  It names
nothing above it: the handshake (``mpi_handshake``) sends and reads hellos.
"""

from __future__ import annotations

import dataclasses

PROTOCOL = 12  # both ends must speak the same


@dataclasses.dataclass(frozen=True)
class Peer:
    """The process at the other end of a handshake, as its hello says"""

    process: str  # "host/pid/nonce": mpi_startup.process_id()
    library: str  # its MPI library
    world: tuple[str, int] | None  # its mpiexec job and rank; None: alone
    beacon: int | None  # where peers on its host read its liveness
    pid_namespace: int | None
    rdma: str | None  # the RDMA network up on its host (mpi_policy.rdma)
    stopped: bool  # it calls MPI no more
    ports: bool  # it may open MPI ports (mpi_library.no_ports)
    gpu: dict | None  # mpi_gpu.hello: None without a GPU
    unreachable: frozenset[str] = frozenset()  # the processes it gave up on
    chunk_size: int | None = None  # of its MPI pieces
    open: bool | None = None  # whether it asks for (or opens) a channel

    @property
    def host(self) -> str:
        return self.process.split("/", 1)[0]

    @property
    def pid(self) -> int:
        return int(self.process.split("/")[1])

    @property
    def job(self) -> str:
        """Its mpiexec job: the process itself when alone in one"""
        return self.world[0] if self.world else self.process

    @classmethod
    def parse(cls, hello: dict, library: str) -> Peer:
        """The peer of a hello to a process on MPI ``library``; ValueError,
        saying why, if it is not one"""
        problem = _incompatibility(hello, library)
        if problem:
            raise ValueError(problem)
        process, world = hello["process"], hello.get("world")
        if len(process.split("/")) != 3 or not process.split("/")[1].isdigit():
            raise ValueError(f"peer named itself {process!r}, not host/pid/nonce")
        if world is not None:
            if not (isinstance(world, list) and len(world) == 2):
                raise ValueError(f"peer's mpiexec job is {world!r}")
            world = (str(world[0]), int(world[1]))
        chunk_size = hello.get("chunk_size")
        return cls(
            process=process,
            library=hello["library"],
            world=world,
            beacon=_int_or_none(hello.get("beacon")),
            pid_namespace=_int_or_none(hello.get("pid_namespace")),
            rdma=hello["rdma"] if isinstance(hello.get("rdma"), str) else None,
            stopped=bool(hello.get("stopped")),
            ports=hello.get("ports") is True,
            gpu=hello.get("gpu") if isinstance(hello.get("gpu"), dict) else None,
            unreachable=frozenset(map(str, hello.get("unreachable", ()))),
            chunk_size=_int_or_none(chunk_size) if chunk_size else None,
            open=bool(hello["open"]) if "open" in hello else None,
        )


def _int_or_none(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _incompatibility(hello: dict, library: str) -> str | None:
    """Why a peer with this hello cannot talk to us over MPI, if it cannot"""
    if hello.get("protocol") != PROTOCOL:
        return (
            f"peer speaks mpi:// protocol {hello.get('protocol')!r}, this process "
            f"{PROTOCOL}: use the same version of distributed everywhere"
        )
    if hello.get("library") != library:
        return (
            f"peer uses MPI library {hello.get('library')!r}, this process "
            f"{library!r}: all processes of a cluster on mpi:// "
            "must use the same MPI library"
        )
    if not isinstance(hello.get("process"), str):
        return "peer did not say which process it is"
    return None
