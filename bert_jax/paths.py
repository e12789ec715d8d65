"""Local and Cloud Storage paths through one type: `etils.epath.Path`, the path library Orbax uses.

A workdir or a prepared corpus may be a local folder or a `gs://` URL. Code
that only reads and writes whole files uses `as_path(...)` and epath's
methods, which work on both. What needs a local file (a library that opens
files by name, an append-only log) stages it:

  with paths.local_copy(remote_dir) as local: ...     # read a remote folder from a local copy
  paths.upload(local_dir, remote_dir)                  # copy a local folder's files up
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile
from typing import Iterator

from etils import epath


def is_remote(path: str | os.PathLike) -> bool:
  return "://" in os.fspath(path)


def as_path(path: str | os.PathLike) -> epath.Path:
  """`path` as an epath.Path: a URL kept whole, a local path made absolute.

  Raises:
    ValueError: a URL that `pathlib.Path` collapsed into a local name (gs:/bucket).
  """
  text = os.fspath(path)
  if text.startswith(("gs:/", "s3:/")) and "://" not in text:
    raise ValueError(f"{text} looks like a Cloud Storage URL that lost a slash (pathlib.Path does that); pass the "
                     f"URL as a string, {text.replace(':/', '://', 1)}")
  return epath.Path(text if is_remote(text) else os.path.abspath(text))


def files(path: epath.Path) -> list[epath.Path]:
  """The files under a folder, sub-folders included (epath's rglob refuses Cloud Storage and its walk drops the
  scheme from the folders it yields)."""
  found = []
  for child in path.iterdir():
    found.extend(files(child) if child.is_dir() else [child])
  return sorted(found)


def _files_under(source: epath.Path) -> list[tuple[epath.Path, str]]:
  """(file, its path relative to `source`) of a folder's files; a file alone gives itself and ""."""
  if source.is_file():
    return [(source, "")]
  return [(path, os.fspath(path)[len(os.fspath(source)):].lstrip("/")) for path in files(source)]


def upload(source: pathlib.Path, target: epath.Path) -> None:
  """Copies a local file, or a folder's files (sub-folders included), to `target` (local or remote)."""
  for path in [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file()):
    destination = target if path == source else target / path.relative_to(source).as_posix()
    destination.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "rb") as reader, destination.open("wb") as writer:
      shutil.copyfileobj(reader, writer, 1 << 24)


def move(source: epath.Path, target: epath.Path) -> None:
  """Moves a file or folder; on an object store (no rename of folders) file by file, copying before deleting."""
  if not is_remote(source) and not is_remote(target):
    shutil.move(os.fspath(source), os.fspath(target))
    return
  for path, relative in _files_under(source):
    destination = target / relative if relative else target
    destination.parent.mkdir(parents=True, exist_ok=True)
    path.copy(destination, overwrite=True)
  if source.is_dir():
    source.rmtree()
  else:
    source.unlink()


def write_text(path: epath.Path, text: str) -> None:
  """Replaces a file's contents at once: an object store's write already is; a local file goes through a rename,
  so a kill never leaves half a file."""
  path.parent.mkdir(parents=True, exist_ok=True)
  if is_remote(path):
    path.write_text(text)
    return
  temporary = path.parent / f".{path.name}.{os.getpid()}.tmp"
  temporary.write_text(text)
  temporary.replace(path)


def write_bytes_with(path: epath.Path, write) -> None:
  """Calls `write(file)` with a binary file that lands at `path` (local or remote; csv and savefig take one)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  with path.open("wb") as handle:
    write(handle)


@contextlib.contextmanager
def local_copy(path: str | os.PathLike) -> Iterator[pathlib.Path]:
  """A local path holding `path`'s contents: `path` itself when local, else a temporary copy (a file or a folder)."""
  if not is_remote(path):
    yield pathlib.Path(os.fspath(path))
    return
  source = epath.Path(path)
  with tempfile.TemporaryDirectory(prefix="bert_jax-") as temporary:
    local = pathlib.Path(temporary) / source.name
    for file, relative in _files_under(source):
      destination = local / relative if relative else local
      destination.parent.mkdir(parents=True, exist_ok=True)
      destination.write_bytes(file.read_bytes())
    yield local
