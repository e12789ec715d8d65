"""A local Cloud Storage emulator, so `gs://` paths are tested without the network.

Tests take the `gcs_bucket` fixture (defined in conftest.py), a `gs://` URL of
an empty bucket:

  def test_prepared_corpus_on_gcs(gcs_bucket):
    out = epath.Path(gcs_bucket) / "prepared"   # gs://<bucket>/prepared
    ...

What the fixture does:
  * starts `gcp-storage-emulator` (the PyPI package; the test extra) in its own
    process on 127.0.0.1 and a free port, in memory, with one bucket; stops it
    after the test, so every test starts from an empty bucket;
  * sets, in `os.environ` for the test's duration, the variables that route
    `etils.epath` (the path library Orbax uses) through gcsfs to the emulator:
    `STORAGE_EMULATOR_HOST` (gcsfs' endpoint), `EPATH_USE_TF=false` (epath
    would otherwise pick TensorFlow's gfile, which cannot be pointed at an
    emulator), `GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false` (no gRPC bucket-type
    probe, which the emulator does not serve) and `FSSPEC_GCS_TOKEN=anon` (no
    credential lookup); and `TENSORSTORE_GCS_HTTP_URL`, for the arrays Orbax
    writes through TensorStore's own Cloud Storage client. Subprocesses a test starts (a trainer it kills and
    resumes) inherit them, so they see the same bucket;
  * resets the caches in this process (epath's backend choice and filesystem,
    gcsfs' instances) so the settings take effect here too;
  * skips the test when gcp-storage-emulator or gcsfs is not installed.

`environment(port)` gives those variables for a process started some other way.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Iterator

BUCKET = "bert-jax-test"
_START_SECONDS = 30


def environment(port: int) -> dict[str, str]:
  """Environment variables that send `gs://` paths (epath -> fsspec -> gcsfs) to an emulator on `port`."""
  return {
      "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",
      "EPATH_USE_TF": "false",
      "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
      "FSSPEC_GCS_TOKEN": "anon",
      "FSSPEC_GS_TOKEN": "anon",
      "TENSORSTORE_GCS_HTTP_URL": f"http://127.0.0.1:{port}",  # Orbax writes arrays through TensorStore's own client.
  }


def _free_port() -> int:
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    return probe.getsockname()[1]


def _reset_caches(anonymous: bool) -> None:
  """Drops what this process cached about `gs://` before the environment changed."""
  import fsspec
  import gcsfs
  import gcsfs.core
  from etils.epath import backend as epath_backend
  from etils.epath import gpath

  gpath._is_tf_installed.cache_clear()  # pylint: disable=protected-access
  epath_backend._FileSystemSpecBackend._get_filesystem.cache_clear()  # pylint: disable=protected-access
  # gcsfs picks its class at import from GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT; it may have been imported before.
  fsspec.register_implementation("gs", gcsfs.core.GCSFileSystem, clobber=True)
  fsspec.register_implementation("gcs", gcsfs.core.GCSFileSystem, clobber=True)
  gcsfs.core.GCSFileSystem.clear_instance_cache()
  for protocol in ("gs", "gcs"):
    if anonymous:
      fsspec.config.conf.setdefault(protocol, {})["token"] = "anon"
    else:
      fsspec.config.conf.get(protocol, {}).pop("token", None)


@contextlib.contextmanager
def running_emulator(bucket: str = BUCKET) -> Iterator[int]:
  """Runs the emulator with an empty in-memory `bucket` on 127.0.0.1; yields its port."""
  port = _free_port()
  # Its log goes to a file: a pipe nobody reads fills up and blocks the (single-threaded) server mid-request.
  log = tempfile.TemporaryFile()
  process = subprocess.Popen(
      [sys.executable, __file__, "start", "--host", "127.0.0.1", "--port", str(port),
       "--in-memory", "--default-bucket", bucket, "--quiet"],
      stdout=subprocess.DEVNULL, stderr=log)
  try:
    deadline = time.monotonic() + _START_SECONDS
    while True:
      if process.poll() is not None:
        log.seek(0)
        raise RuntimeError(f"the storage emulator exited at start: {log.read().decode()[-2000:]}")
      try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        break
      except OSError:
        if time.monotonic() > deadline:
          raise RuntimeError(f"the storage emulator did not listen on 127.0.0.1:{port} in {_START_SECONDS}s")
        time.sleep(0.05)
    yield port
  finally:
    process.terminate()
    try:
      process.wait(timeout=10)
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()
    log.close()


@contextlib.contextmanager
def gcs_bucket_url() -> Iterator[str]:
  """The body of the `gcs_bucket` fixture: an emulated empty bucket, `gs://` routed to it; yields its URL."""
  import pytest

  pytest.importorskip("gcp_storage_emulator", reason="gcp-storage-emulator is not installed (test extra)")
  pytest.importorskip("gcsfs", reason="gcsfs is not installed")
  with running_emulator() as port, pytest.MonkeyPatch.context() as patch:
    for key, value in environment(port).items():
      patch.setenv(key, value)
    _reset_caches(anonymous=True)
    try:
      yield f"gs://{BUCKET}"
    finally:
      patch.undo()
      _reset_caches(anonymous=False)


def _serve(argv: list[str]) -> None:
  """Runs the emulator with two behaviours of Cloud Storage that TensorStore (Orbax's array store) relies on and
  the emulator lacks: downloads carry the object's generation (`x-goog-generation`), and uploads honour
  `ifGenerationMatch` (412 when it does not hold), which TensorStore's conditional writes need."""
  from http import HTTPStatus

  from gcp_storage_emulator.exceptions import NotFound
  from gcp_storage_emulator.handlers import objects

  download, insert = objects.download, objects.insert

  def download_with_generation(request, response, storage, *args, **kwargs):
    download(request, response, storage, *args, **kwargs)
    try:
      obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except NotFound:
      return
    response["x-goog-generation"] = str(obj.get("generation", "0"))

  def insert_if_generation_matches(request, response, storage, *args, **kwargs):
    wanted = request.query.get("ifGenerationMatch")
    if wanted:
      name = request.query.get("name", [None])[0]
      try:
        current = str(storage.get_file_obj(request.params["bucket_name"], name).get("generation", "0"))
      except NotFound:
        current = "0"
      if current != wanted[0]:
        response.status = HTTPStatus.PRECONDITION_FAILED
        return None
    return insert(request, response, storage, *args, **kwargs)

  objects.download, objects.insert = download_with_generation, insert_if_generation_matches
  from gcp_storage_emulator import __main__ as emulator  # pylint: disable=import-outside-toplevel
  emulator.main(argv)


if __name__ == "__main__":
  _serve(sys.argv[1:])
