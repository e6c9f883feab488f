"""Build distributed from the pinned upstream release and patches/ (see
MPI4DASK_CHANGES.md). Metadata that upstream already states, such as the
dependencies and entry points, is read from upstream's own pyproject.toml."""

import importlib.util
import sys
from pathlib import Path

from setuptools import find_packages, setup

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location(
    "upstream", ROOT / "continuous_integration" / "upstream.py"
)
upstream = importlib.util.module_from_spec(spec)
spec.loader.exec_module(upstream)

config = upstream.read_config(ROOT)
upstream.materialize(ROOT)
project = tomllib.loads(upstream.pristine(config)["pyproject.toml"].decode())
meta = project["project"]

# Upstream ships every file of its sdist's package (MANIFEST.in and
# include_package_data); its files here are not tracked, so name them.
package_data = {
    k: list(v) for k, v in project["tool"]["setuptools"]["package-data"].items()
}
package_data["distributed"] += [
    path.removeprefix("distributed/")
    for path in upstream.upstream_package(config)
    if not path.endswith(".py")
]

setup(
    name="distributed",
    version=config.version,
    description=meta["description"],
    python_requires=meta["requires-python"],
    install_requires=meta["dependencies"],
    extras_require={
        "mpi": ["mpi4py>=4.0", "mpich"],
        "test": ["pytest", "pytest-timeout", "numpy", "dask-mpi", "dask-jobqueue"],
        "benchmarks": ["numpy", "dask[dataframe]", "matplotlib"],
        # upstream's own test suite (continuous_integration/upstream_tests.py)
        "upstream-tests": [
            *"pytest pytest-timeout pytest-rerunfailures pytest-repeat".split(),
            *"numpy pandas pyarrow scipy sparse h5py lz4 zstandard".split(),
            *"python-snappy bokeh requests prometheus_client setproctitle".split(),
            *"ipywidgets jupyter_events cryptography".split(),
        ],
    },
    entry_points={
        group: [f"{name} = {target}" for name, target in points.items()]
        for group, points in meta["entry-points"].items()
    },
    packages=find_packages(
        include=["distributed", "distributed.*"], exclude=["*tests*"]
    ),
    package_data=package_data,
)
