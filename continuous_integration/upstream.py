"""Keep this project as a patch set over a pinned release of upstream distributed.

The release is pinned in setup.cfg (``[mpi4dask] upstream-version`` and
``upstream-sha256``). Upstream's files are never tracked here: the tree holds this
project's own files, and ``patches/*.patch`` hold its changes to upstream's files.

    python continuous_integration/upstream.py materialize [--force]
        Extract upstream's ``distributed/`` package into the tree, apply the patches,
        write ``distributed/_version.py`` and ``distributed/.gitignore``. Does nothing
        if the tree was already materialized from the same pin, patches and version.
    python continuous_integration/upstream.py regen
        Turn the tree's edits to upstream files back into ``patches/``.
    python continuous_integration/upstream.py check
        Check that the patches apply to the pristine release, that the tree has no
        edits to upstream files that are missing from the patches, and that git
        tracks no upstream file.

Standard library only: setup.py imports this file before anything is installed.
"""

from __future__ import annotations

import argparse
import configparser
import difflib
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "distributed"
VERSION_FILE = f"{PACKAGE}/_version.py"  # generated: never patched
STAMP = ".mpi4dask-stamp"
HUNK = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class UpstreamError(Exception):
    pass


class Config(NamedTuple):
    version: str  # this project's version
    upstream_version: str
    upstream_sha256: str


def read_config(root: Path = ROOT) -> Config:
    cfg = configparser.ConfigParser()
    if not cfg.read(root / "setup.cfg"):
        raise UpstreamError(f"no setup.cfg in {root}")
    return Config(
        cfg["metadata"]["version"],
        cfg["mpi4dask"]["upstream-version"],
        cfg["mpi4dask"]["upstream-sha256"],
    )


# ---------------------------------------------------------------------------
# Fetching and reading the pinned sdist


def fetch(config: Config) -> Path:
    """Path of the pinned upstream sdist, downloaded into a cache if needed.

    ``$MPI4DASK_UPSTREAM_SDIST`` names a local copy. Whatever the source, its sha256
    must match the pin.
    """
    if path := os.environ.get("MPI4DASK_UPSTREAM_SDIST"):
        path = Path(path)
    else:
        cache = Path.home() / ".cache" / "mpi4dask"
        path = cache / f"{PACKAGE}-{config.upstream_version}.tar.gz"
        if not path.exists():
            _download(config, path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != config.upstream_sha256:
        raise UpstreamError(
            f"{path} has sha256 {digest}, but setup.cfg pins "
            f"{PACKAGE} {config.upstream_version} to {config.upstream_sha256}"
        )
    return path


def _download(config: Config, path: Path) -> None:
    """Download the sdist to ``path``: with pip (which follows the site's pip
    configuration), else from PyPI's JSON API. Written atomically, so that an
    interrupted download is never mistaken for the sdist."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        # pip's isolated build environments hide the site-packages that pip itself
        # lives in through PYTHONPATH: drop it so that `-m pip` works from setup.py.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps"]
        cmd += ["--no-binary", ":all:", f"{PACKAGE}=={config.upstream_version}"]
        subprocess.run([*cmd, "-d", tmp], env=env, stdout=sys.stderr, check=False)
        got = Path(tmp, path.name)
        if not got.exists():
            # The project-wide page: some PyPI mirrors lack /pypi/<name>/<version>/json
            url = f"https://pypi.org/pypi/{PACKAGE}/json"
            print(f"pip download failed; trying {url}", file=sys.stderr)
            try:
                with urllib.request.urlopen(url) as response:
                    files = json.load(response)["releases"][config.upstream_version]
                (sdist,) = (r["url"] for r in files if r["packagetype"] == "sdist")
                with urllib.request.urlopen(sdist) as response, open(got, "wb") as f:
                    shutil.copyfileobj(response, f)
            except (OSError, KeyError, ValueError) as e:
                raise UpstreamError(
                    f"cannot download {PACKAGE} {config.upstream_version}: {e!r}; "
                    "set $MPI4DASK_UPSTREAM_SDIST to a copy of its sdist"
                )
        os.replace(got, path)


@functools.cache
def pristine(config: Config) -> dict[str, bytes]:
    """All regular files of the pinned sdist, by path inside its top directory."""
    top = f"{PACKAGE}-{config.upstream_version}/"
    with tarfile.open(fetch(config)) as tar:
        return {
            m.name.removeprefix(top): tar.extractfile(m).read()
            for m in tar
            if m.isfile() and m.name.startswith(top)
        }


def upstream_package(config: Config) -> dict[str, bytes]:
    """The files of upstream's ``distributed/`` package: what the tree receives."""
    return {k: v for k, v in pristine(config).items() if k.startswith(f"{PACKAGE}/")}


# ---------------------------------------------------------------------------
# Unified diffs


def _lines(data: bytes) -> list[str]:
    # Split after "\n" only: str.splitlines also splits at "\r", "\f", "\x1c", ...
    return re.findall(r"[^\n]*\n|[^\n]+", data.decode())


def _path(header: str) -> str | None:
    """The file a ``---``/``+++`` line names, without its a/ or b/; None for
    /dev/null."""
    name = header[4:].rstrip("\r\n").split("\t")[0]
    if name == "/dev/null":
        return None
    if name[:2] not in ("a/", "b/"):
        raise UpstreamError(f"expected a/ or b/ before the file name: {header!r}")
    return name[2:]


def apply_patch(patch: Path, files: dict[str, bytes]) -> None:
    """Apply a unified diff to ``files`` in place.

    Strict: every context and removed line must match exactly (no fuzz, no
    whitespace leniency). A hunk applies where its lines match nearest to the line
    number in its header (which upstream's own changes may have moved), after the
    hunk before it.
    A patch may delete an upstream file (``+++ /dev/null``), not create one: new
    files are this project's own and are tracked as they are.
    """
    lines = _lines(patch.read_bytes())
    i = 0
    while i < len(lines):
        if not lines[i].startswith("--- "):
            i += 1  # "diff --git ...", "index ...", comments
            continue
        old_path, new_path = _path(lines[i]), _path(lines[i + 1])
        if old_path is None:
            raise UpstreamError(f"{patch}: creates {new_path}: track new files as such")
        if old_path not in files:
            raise UpstreamError(f"{patch}: {old_path} is not an upstream file")
        text, out, pos, i = _lines(files[old_path]), [], 0, i + 2
        n = 0
        while i < len(lines) and (m := HUNK.match(lines[i])):
            n += 1
            try:
                old, new, i = _hunk(lines, i + 1, int(m[2] or 1), int(m[4] or 1))
            except UpstreamError as e:
                raise UpstreamError(f"{patch}: hunk #{n} ({m[0]}): {e}")
            start = int(m[1]) - (1 if old else 0)
            # Nearest exact match to the header's line, after the previous hunk
            candidates = range(pos, len(text) - len(old) + 1)
            at = min(
                (p for p in candidates if text[p : p + len(old)] == old),
                key=lambda p: abs(p - start),
                default=None,
            )
            if at is None:
                raise UpstreamError(
                    f"{patch}: hunk #{n} ({m[0]}) does not apply to {old_path}"
                )
            out += text[pos:at] + new
            pos = at + len(old)
        result = "".join(out + text[pos:])
        if new_path is None:
            if result:
                raise UpstreamError(f"{patch}: does not delete all of {old_path}")
            del files[old_path]
        else:
            files[old_path] = result.encode()


def _hunk(lines: list[str], i: int, n_old: int, n_new: int):
    """The old and new lines of the hunk body starting at ``lines[i]``."""
    old: list[str] = []
    new: list[str] = []
    sides = {" ": (old, new), "-": (old,), "+": (new,)}
    tag = None
    while i < len(lines) and (
        len(old) < n_old or len(new) < n_new or lines[i].startswith("\\")
    ):
        line = lines[i]
        i += 1
        if line.startswith("\\"):  # "\ No newline at end of file"
            for side in sides[tag]:
                side[-1] = side[-1].removesuffix("\n")
        elif line[0] in sides:
            tag = line[0]
            for side in sides[tag]:
                side.append(line[1:])
        else:
            raise UpstreamError(f"malformed hunk line {line!r}")
    if (len(old), len(new)) != (n_old, n_new):
        raise UpstreamError("truncated hunk")
    return old, new, i


def make_patch(path: str, old: bytes, new: bytes | None) -> str:
    """Unified diff (3 lines of context) from ``old`` to ``new``; None deletes."""
    try:
        a, b = _lines(old), _lines(new or b"")
    except UnicodeDecodeError:
        raise UpstreamError(f"{path} is binary: cannot patch it; restore it")
    diff = difflib.unified_diff(
        a, b, f"a/{path}", "/dev/null" if new is None else f"b/{path}"
    )
    # difflib leaves a line without "\n" as it is: mark it as patch(1) does
    return "".join(
        d if d.endswith("\n") else d + "\n\\ No newline at end of file\n" for d in diff
    )


# ---------------------------------------------------------------------------
# The tree


def patches(root: Path) -> list[Path]:
    return sorted((root / "patches").glob("*.patch"))


def expected(root: Path, config: Config) -> dict[str, bytes]:
    """Upstream's package with the patches applied and our _version.py."""
    files = upstream_package(config)
    for patch in patches(root):
        apply_patch(patch, files)
    files[VERSION_FILE] = version_file(config.version, files[VERSION_FILE]).encode()
    return files


def version_file(version: str, upstream: bytes) -> str:
    # The same names as the _version.py that setuptools-scm writes for upstream,
    # and upstream's commit id: the commit this fork is built on
    commit = re.search(rb"^__commit_id__ = commit_id = (.*)$", upstream, re.M)
    commit = commit.group(1).decode() if commit else "None"
    release, _, local = version.partition("+")
    parts = tuple(int(p) if p.isdigit() else p for p in release.split("."))
    parts += (local,) if local else ()
    return (
        "# file generated by continuous_integration/upstream.py from setup.cfg\n"
        "# don't change, don't track in version control\n"
        f"__version__ = version = {version!r}\n"
        f"__version_tuple__ = version_tuple = {parts!r}\n"
        f"__commit_id__ = commit_id = {commit}\n"
    )


def stamp(root: Path, config: Config) -> str:
    """Hash of everything that materialize's result depends on."""
    h = hashlib.sha256(f"{config.upstream_sha256}\n{config.version}\n".encode())
    for patch in patches(root):
        h.update(f"{patch.name}\n".encode() + patch.read_bytes())
    return h.hexdigest()


def is_current(root: Path, config: Config) -> bool:
    """Whether the tree was materialized from the current pin, patches and version."""
    stamp_file = root / PACKAGE / STAMP
    return stamp_file.exists() and stamp_file.read_text().strip() == stamp(root, config)


def tracked(root: Path) -> set[str]:
    """Files that git tracks under distributed/ (empty without git)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--", PACKAGE],
            cwd=root,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return set()
    return set(out.decode().split("\0")) - {""}


def materialize(root: Path = ROOT, force: bool = False) -> bool:
    """Write upstream's patched package into the tree; return whether it did."""
    config = read_config(root)
    if is_current(root, config) and not force:
        return False
    files = expected(root, config)
    upstream = set(upstream_package(config))
    ours = tracked(root)
    if collisions := sorted(upstream & ours):
        raise UpstreamError(
            "these files are tracked here but are upstream files too: make your "
            "changes to them patches (regen) and `git rm --cached` them:\n  "
            + "\n  ".join(collisions)
        )
    package = root / PACKAGE
    ignore = package / ".gitignore"
    n = len(PACKAGE)
    ignored = [*sorted(p[n:] for p in upstream), "/.gitignore", f"/{STAMP}"]
    if ignore.exists():  # remove files of the release materialized before, if gone
        before = {line for line in ignore.read_text().splitlines() if line[:1] == "/"}
        for gone in before - set(ignored) - {p[n:] for p in ours}:
            (package / gone[1:]).unlink(missing_ok=True)
    for path in upstream:
        target = root / path
        if path in files:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(files[path])
        else:  # deleted by a patch
            target.unlink(missing_ok=True)
    ignore.write_text(
        "# Written by continuous_integration/upstream.py: upstream's files, which "
        "this project\n# does not track (its changes to them are in patches/).\n"
        + "".join(f"{p}\n" for p in ignored)
    )
    (package / STAMP).write_text(stamp(root, config) + "\n")
    print(
        f"materialized {PACKAGE} {config.upstream_version} "
        f"with {len(patches(root))} patches as {config.version}"
    )
    return True


def patch_name(path: str) -> str:
    """patches/distributed-comm-__init__.py.patch for distributed/comm/__init__.py"""
    return path.replace("/", "-") + ".patch"


def regen(root: Path = ROOT) -> None:
    """Rewrite patches/ from the tree's edits to upstream files, one per file."""
    config = read_config(root)
    if not is_current(root, config):
        raise UpstreamError(
            "the tree was not materialized from the current pin and patches: "
            "its edits cannot be told from upstream's changes. Run materialize "
            "(which overwrites upstream files: save any edits first)"
        )
    wanted = {}
    for path, old in sorted(upstream_package(config).items()):
        target = root / path
        new = target.read_bytes() if target.exists() else None
        if path != VERSION_FILE and new != old:
            wanted[patch_name(path)] = make_patch(path, old, new)
    (root / "patches").mkdir(exist_ok=True)
    for patch in patches(root):
        if patch.name not in wanted:
            patch.unlink()
            print(f"removed patches/{patch.name}")
    added = removed = 0
    for name, text in wanted.items():
        patch = root / "patches" / name
        if not patch.exists() or patch.read_bytes() != text.encode():
            patch.write_bytes(text.encode())
        body = [line for line in text.splitlines() if line[:3] not in ("---", "+++")]
        plus = sum(line.startswith("+") for line in body)
        minus = sum(line.startswith("-") for line in body)
        print(f"patches/{name}: +{plus} -{minus}")
        added, removed = added + plus, removed + minus
    print(
        f"{len(wanted)} upstream files changed, {added + removed} changed lines "
        f"(+{added} -{removed})"
    )
    (root / PACKAGE / STAMP).write_text(stamp(root, config) + "\n")


def check(root: Path = ROOT) -> list[str]:
    """Problems found: patches that do not apply raise; the rest are returned."""
    config = read_config(root)
    files = expected(root, config)
    upstream = set(upstream_package(config))
    problems = [
        f"{path} is an upstream file but git tracks it: `git rm --cached {path}`"
        for path in sorted(upstream & tracked(root))
    ]
    if config.version.partition("+")[0] != config.upstream_version:
        problems.append(
            f"setup.cfg: version {config.version} is not a local version of "
            f"upstream-version {config.upstream_version} (like "
            f"{config.upstream_version}+mpi.1)"
        )
    if is_current(root, config):
        for path in sorted(upstream):
            target = root / path
            if (target.read_bytes() if target.exists() else None) != files.get(path):
                problems.append(f"{path} differs from upstream + patches: run regen")
    else:
        print(
            f"note: {root / PACKAGE} is not materialized from the current pin and "
            "patches, so only the patches were checked"
        )
    print(
        f"{len(patches(root))} patches apply to {PACKAGE} {config.upstream_version}"
        f" (sha256 {config.upstream_sha256[:12]}...)"
    )
    return problems


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=ROOT, help="project root")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("materialize").add_argument(
        "--force", action="store_true", help="even if the stamp says it is done"
    )
    commands.add_parser("regen")
    commands.add_parser("check")
    args = parser.parse_args(argv)
    try:
        if args.command == "materialize":
            if not materialize(args.root, args.force):
                print("up to date (--force to materialize again)")
        elif args.command == "regen":
            regen(args.root)
        elif problems := check(args.root):
            sys.exit("check failed:\n  " + "\n  ".join(problems))
        else:
            print("check passed")
    except UpstreamError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
