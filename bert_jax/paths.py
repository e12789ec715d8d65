"""Local and Cloud Storage paths through one type: `etils.epath.Path`, the path library Orbax uses.

A workdir or a prepared corpus may be a local folder or a `gs://` URL. Code
that only reads and writes whole files uses `as_path(...)` and epath's
methods, which work on both. What needs a local file (a library that opens
files by name, an append-only log) stages it:

  with paths.local_copy(remote_dir) as local: ...     # read a remote folder from a local copy
  paths.upload(local_dir, remote_dir)                  # copy a local folder's files up

Files the project derives (a corpus, a tokenizer, shards, a manifest) go through `write_text`, `write_bytes_with`
and `write_array`: a local file is written beside its destination and renamed into place once complete, so a
kill or a full disk never leaves part of one where a rerun would trust it. A failed write raises `StorageError`,
one line naming the file and the cause (disk full, quota, permission), with the partial file removed.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pathlib
import shutil
import tempfile
from typing import Iterator

from etils import epath
import numpy as np

# The causes a user can act on, by errno; any other OS error is named by its own text.
_STORAGE_CAUSES = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "the file system is read-only",
    errno.EFBIG: "the file is over the size limit",
}
_REMEDIES = {errno.ENOSPC: "free space there", errno.EDQUOT: "free space or raise the quota",
             errno.EACCES: "make it writable", errno.EPERM: "make it writable", errno.EROFS: "make it writable",
             errno.EFBIG: "raise the limit (ulimit -f) or write elsewhere"}


class StorageError(OSError):
  """A file could not be written because of its storage; the message names the file and the cause in one line."""

  def __str__(self) -> str:
    return self.args[0]  # OSError's own form would put "[Errno N]" before it and the file name after.


def storage_error(error: OSError, path: str | os.PathLike) -> OSError:
  """`error` (raised writing `path`) as a `StorageError` whose one-line message names `path` and the cause.

  A `StorageError` already names its file and is returned as it is.
  """
  if isinstance(error, StorageError):
    return error
  cause = _STORAGE_CAUSES.get(error.errno) or error.strerror or str(error).splitlines()[0] or type(error).__name__
  if error.strerror and error.strerror.lower() != cause.lower():
    cause += f" ({error.strerror})"
  remedy = _REMEDIES.get(error.errno, "fix the storage")
  wrapped = StorageError(f"cannot write {os.fspath(path)}: {cause}; {remedy} and run the same command again")
  wrapped.errno, wrapped.strerror, wrapped.filename = error.errno, error.strerror, os.fspath(path)
  return wrapped


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
    with open(path, "rb") as reader:
      if is_remote(destination):  # Streamed: a shard may not fit in memory; an object appears whole when closed.
        destination.parent.mkdir(parents=True, exist_ok=True)
        with destination.open("wb") as writer:
          shutil.copyfileobj(reader, writer, 1 << 24)
      else:
        write_bytes_with(destination, lambda writer: shutil.copyfileobj(reader, writer, 1 << 24))


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


def write_text(path: str | os.PathLike, text: str) -> None:
  """Replaces a file's contents at once (see `write_bytes_with`)."""
  data = text.encode("utf-8")
  write_bytes_with(path, lambda handle: handle.write(data))


def write_json(path: str | os.PathLike, value) -> None:
  """`value` as indented JSON (what JSON lacks written as its str), replacing the file at once."""
  write_text(path, json.dumps(value, indent=2, default=str) + "\n")


def write_bytes_with(path: str | os.PathLike, write) -> None:
  """Calls `write(file)` with a binary file that lands at `path` whole or not at all (csv and savefig take one).

  A local file is written beside `path`, synced and renamed over it, so a kill leaves `path` as it was; an
  object store's write already is whole, and is made from the bytes in memory.

  Raises:
    StorageError: writing failed for the storage (disk full, quota, permission); nothing of it is left behind.
  """
  path = as_path(path)
  if is_remote(path):
    buffer = io.BytesIO()
    write(buffer)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buffer.getvalue())
    return
  # The process id keeps two writers of one file (two hosts on shared storage) off each other's temporary file.
  temporary = os.path.join(os.path.dirname(path), f".{path.name}.{os.getpid()}.tmp")
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(temporary, "wb") as handle:
      write(handle)
      handle.flush()
      os.fsync(handle.fileno())  # A network file system may report a full disk or quota only here.
    os.replace(temporary, path)
  except BaseException as error:
    with contextlib.suppress(OSError):
      os.unlink(temporary)  # A partial file would keep a full disk full.
    if isinstance(error, OSError):
      raise storage_error(error, path) from error
    raise


class _Writes:
  """Only `write` of a file: numpy writes through it and so keeps the OS error (its own writes of a real file
  say only "N requested and M written")."""

  def __init__(self, handle):
    self.write = handle.write


def write_array(path: str | os.PathLike, array: np.ndarray) -> None:
  """Saves `array` as a .npy file at `path` whole or not at all (see `write_bytes_with`)."""
  write_bytes_with(path, lambda handle: np.save(_Writes(handle), np.asarray(array), allow_pickle=False))


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
