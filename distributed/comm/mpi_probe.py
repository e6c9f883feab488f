"""What mpi:// will do on this node: ``python -m distributed.comm.mpi_probe``.

Prints the MPI library, the GPUs, CuPy, RMM and Numba this process sees,
whether MPI is CUDA-aware and how that was decided, and how GPU frames will
travel (see ``distributed.comm.mpi_gpu``).
"""

from __future__ import annotations

import importlib.util

from distributed.comm import mpi_gpu, mpi_startup


def _version(module: str) -> str:
    if importlib.util.find_spec(module) is None:
        return "not installed"
    try:
        return __import__(module).__version__
    except Exception as e:  # installed, but broken here (no CUDA driver...)
        return f"fails to import: {e}"


def _devices() -> str:
    if importlib.util.find_spec("cupy") is None:
        return "none seen: CuPy is not installed"
    try:
        import cupy

        runtime = cupy.cuda.runtime
        names = [
            runtime.getDeviceProperties(i)["name"].decode()
            for i in range(runtime.getDeviceCount())
        ]
        return f"{len(names)} ({', '.join(names)})" if names else "none"
    except Exception as e:
        return f"none: {e}"


def main() -> None:
    """Print what mpi:// will do with GPU data in this process"""
    MPI = mpi_startup.start_mpi().result()
    aware, why = mpi_gpu.cuda_aware(MPI)
    chunk = mpi_startup.config("chunk-size")
    if not mpi_gpu.has_gpu():
        frames = "as host frames: this process has no GPU that CuPy can use"
    elif aware:
        frames = (
            "direct (device buffers to MPI) to peers whose MPI is CUDA-aware too, "
            f"else staged through pinned host memory in {chunk} chunks"
        )
    else:
        frames = f"staged through pinned host memory, in {chunk} chunks"
    if mpi_gpu.has_gpu():
        frames += "; as host frames to peers without a GPU"
    rows = [
        ("CUDA devices", _devices()),
        ("CuPy", _version("cupy")),
        ("RMM", _version("rmm")),
        ("Numba", _version("numba")),
        ("MPI library", f"{mpi_startup.library()} ({MPI.__file__})"),
        ("CUDA-aware MPI", f"{'yes' if aware else 'no'}: {why}"),
        ("GPU frames", frames),
    ]
    for name, value in rows:
        print(f"{name + ':':16} {value}")


if __name__ == "__main__":
    main()
