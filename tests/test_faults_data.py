"""Faults while the trainer derives its data end in one line naming the file and the cause, never in a silent wrong
result: a kill -9 or a full disk while the built-in corpus, its tokenizer, the shards or the eval split are written
leaves nothing partial where a rerun would reuse it, and the rerun builds what an uninterrupted run builds; a
changed eval split is refused before the prepared folder is touched."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import subprocess
import sys
import threading

import numpy as np
import pytest

from bert_jax import cli
from bert_jax import paths
from bert_jax.data import prepare
from bert_jax.train import config_lib
from bert_jax.train import pretrain_data

REPO = pathlib.Path(__file__).resolve().parents[1]
DEMO = str(REPO / "configs" / "demo.py")
CAUSES = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
          errno.EACCES: "permission denied"}


def _demo_config():
  return config_lib.load_config(DEMO, [])


def _snapshot(root: pathlib.Path) -> dict[str, object]:
  """Every file under `root` by relative path: its bytes, or for a manifest what does not depend on when and where
  the corpus was built (the seconds taken, the input's path and time). Asserts that no write was left half done."""
  found = {}
  for path in sorted(p for p in root.rglob("*") if p.is_file()):
    relative = path.relative_to(root).as_posix()
    assert not path.name.endswith(".tmp") and ".preparing" not in relative, f"{relative} was left behind"
    if path.name == prepare.MANIFEST:
      manifest = json.loads(path.read_text().replace(str(root), "ROOT"))  # The input report names the input.
      manifest.pop("seconds")
      manifest["inputs"] = [{k: v for k, v in i.items() if k in ("size", "head_sha256")} for i in manifest["inputs"]]
      found[relative] = manifest
    else:
      found[relative] = path.read_bytes()
  return found


@pytest.fixture(autouse=True, scope="module")
def _one_process():
  """The trainer prepares the built-in corpus with a process per core; tokenising in this process gives the same
  bytes (test_prepare) without the pool's start-up, most of the time of a corpus this small."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(prepare.os, "cpu_count", lambda: 1)
    yield


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, object]:
  """What an uninterrupted demo run derives in its workdir's builtin_corpus/."""
  workdir = tmp_path_factory.mktemp("uninterrupted")
  pretrain_data.prepare_data(_demo_config(), paths.as_path(workdir))
  return _snapshot(workdir / "builtin_corpus")


def _rebuilt(workdir: pathlib.Path) -> dict[str, object]:
  pretrain_data.prepare_data(_demo_config(), paths.as_path(workdir))
  return _snapshot(workdir / "builtin_corpus")


class _FillingFile:
  """A file on a disk that fails after `room` more bytes: the write that crosses it lands in part, then raises."""

  def __init__(self, handle, code: int, room: int):
    self._handle, self._code, self._room = handle, code, room

  def write(self, data) -> int:
    data = memoryview(data).cast("B")
    if len(data) > self._room:
      self._handle.write(data[:self._room])
      raise OSError(self._code, os.strerror(self._code))
    self._room -= len(data)
    return self._handle.write(data)

  def __getattr__(self, name):
    return getattr(self._handle, name)

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self._handle.close()


def _fail_writes_of(monkeypatch, name: str, code: int, room: int = 100) -> None:
  """Writes of the file `name` through `bert_jax.paths` fail with `code` after `room` bytes."""
  def fake_open(file, mode="r", *args, **kwargs):
    handle = open(file, mode, *args, **kwargs)  # pylint: disable=unspecified-encoding
    if "w" in mode and os.path.basename(file).startswith(f".{name}."):
      return _FillingFile(handle, code, room)
    return handle
  monkeypatch.setattr(paths, "open", fake_open, raising=False)


@pytest.fixture
def cli_state(monkeypatch):
  """Restores what the CLI changes for the whole process when a command fails on storage."""
  import logging
  monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
  monkeypatch.setattr(threading, "excepthook", threading.excepthook)
  loggers = [logging.getLogger(name) for name in ("jax", "orbax", "absl", "fsspec", "asyncio")]
  levels = [logger.level for logger in loggers]
  yield
  for logger, level in zip(loggers, levels):
    logger.setLevel(level)


def _error_line(capsys, command: str) -> str:
  err = capsys.readouterr().err
  assert "Traceback" not in err
  lines = [line for line in err.splitlines() if line.startswith(f"bert-jax {command}: error:")]
  assert len(lines) == 1, err
  return lines[0]


# Item 1: kill -9 while the built-in corpus (or its tokenizer) is written.

_KILLED_WHILE_WRITING = """
import os, signal, sys
from bert_jax import paths
from bert_jax.data import builtin_corpus, tokenizers

name, root, vocab_size = sys.argv[1], sys.argv[2], int(sys.argv[3])

class Killed:
  def __init__(self, handle):
    self.handle = handle
  def write(self, data):
    self.handle.write(memoryview(data).cast("B")[:len(data) // 2])
    self.handle.flush()
    os.kill(os.getpid(), signal.SIGKILL)
  def __getattr__(self, attribute):
    return getattr(self.handle, attribute)
  def __enter__(self):
    return self
  def __exit__(self, *exc_info):
    self.handle.close()

def killing_open(file, mode="r", *args, **kwargs):
  handle = open(file, mode, *args, **kwargs)
  return Killed(handle) if "w" in mode and os.path.basename(file).startswith(f".{name}.") else handle

paths.open = killing_open
corpus = os.path.join(root, "corpus.txt")
builtin_corpus.build_builtin_corpus(corpus)
tokenizers.train_tokenizer("wordpiece", [corpus], vocab_size, os.path.join(root, "tokenizer"))
"""


@pytest.mark.parametrize("name", ["corpus.txt", "tokenizer.json"])
def test_kill_9_while_the_builtin_corpus_is_written_leaves_nothing_reused(reference, tmp_path, name):
  root = tmp_path / "builtin_corpus"
  killed = subprocess.run([sys.executable, "-c", _KILLED_WHILE_WRITING, name, str(root),
                           str(_demo_config().data.builtin_vocab_size)], capture_output=True, text=True, timeout=120)
  assert killed.returncode == -9, killed.stderr
  partial = list(root.rglob(f".{name}.*.tmp"))
  assert len(partial) == 1 and partial[0].stat().st_size > 0  # The kill came part-way through the write...
  assert not list(root.rglob(name))  # ...and nothing stands where a rerun looks.
  partial[0].unlink()  # A hidden leftover of the killed process, never read.
  assert _rebuilt(tmp_path) == reference


# Items 2 and 4: a full disk (or quota, or permission) while the built-in corpus, tokenizer, shards or eval split are
# written.

@pytest.mark.parametrize("name, code", [
    ("corpus.txt", errno.ENOSPC),
    ("tokenizer.json", errno.EDQUOT),
    ("shard-00000.tokens.npy", errno.ENOSPC),
    ("eval_documents.npy", errno.EACCES),
])
@pytest.mark.slow
def test_storage_error_while_deriving_data_is_one_line_and_the_rerun_rebuilds(reference, tmp_path, monkeypatch,
                                                                               capsys, cli_state, name, code):
  _fail_writes_of(monkeypatch, name, code)
  assert cli.main(["pretrain", "--config", DEMO, "--workdir", str(tmp_path)]) == 1
  line = _error_line(capsys, "pretrain")
  written = [p for p in (tmp_path / "builtin_corpus").rglob("*") if p.name == name]
  assert not written
  # The file named is the one being written (the shards' and the split's in prepare's staging folder beside the
  # prepared one), and the cause is the storage's.
  folder = {"corpus.txt": "builtin_corpus", "tokenizer.json": "builtin_corpus/tokenizer"}.get(
      name, "builtin_corpus/.prepared.preparing")
  assert f"cannot write {tmp_path / folder / name}: {CAUSES[code]}" in line, line
  assert not (tmp_path / "builtin_corpus" / "prepared" / prepare.MANIFEST).exists()
  monkeypatch.undo()  # Space is freed.
  assert _rebuilt(tmp_path) == reference


@pytest.mark.slow
def test_full_disk_is_one_line_from_a_real_process(tmp_path):
  """A file-size limit makes the kernel refuse the corpus part-way (EFBIG), as a full disk would."""
  # The shell sets the limit (64 KiB): a preexec_fn would fork this multithreaded process.
  process = subprocess.run(["bash", "-c", 'ulimit -f 64 && exec "$@"', "bash", sys.executable, "-m", "bert_jax.cli",
                            "pretrain", "--config", DEMO, "--workdir", str(tmp_path)],
                           capture_output=True, text=True, timeout=300)
  assert process.returncode == 1, process.stderr
  assert "Traceback" not in process.stderr
  errors = [line for line in process.stderr.splitlines() if "error" in line.lower()]
  corpus = tmp_path / "builtin_corpus" / "corpus.txt"
  assert errors == [f"bert-jax pretrain: error: cannot write {corpus}: the file is over the size limit (File too "
                    f"large); raise the limit (ulimit -f) or write elsewhere and run the same command again"]
  assert not corpus.exists() and not list(corpus.parent.iterdir())


def test_full_disk_while_preparing_again_keeps_the_earlier_corpus(reference, tmp_path, monkeypatch, capsys,
                                                                  cli_state):
  source = tmp_path / "source"
  for relative in ("corpus.txt", "tokenizer/tokenizer.json", "tokenizer/bert_jax_tokenizer.json"):
    (source / relative).parent.mkdir(parents=True, exist_ok=True)
    (source / relative).write_bytes(reference[relative])

  def prepared(out, eval_fraction):
    return cli.main(["prepare", "--input", str(source / "corpus.txt"), "--tokenizer", str(source / "tokenizer"),
                     "--out", str(out), "--num-workers", "0", "--eval-fraction", str(eval_fraction)])

  out = tmp_path / "out"
  assert prepared(out, 0.05) == 0
  before = _snapshot(out)
  _fail_writes_of(monkeypatch, "shard-00000.tokens.npy", errno.ENOSPC)
  assert prepared(out, 0.1) == 1
  line = _error_line(capsys, "prepare")
  assert f"cannot write {tmp_path / '.out.preparing' / 'shard-00000.tokens.npy'}: the disk is full" in line, line
  assert _snapshot(out) == before and not (tmp_path / ".out.preparing").exists()
  monkeypatch.undo()
  assert prepared(out, 0.1) == 0 and prepared(tmp_path / "fresh", 0.1) == 0
  assert _snapshot(out) == _snapshot(tmp_path / "fresh")


# Item 6: a changed eval split is refused before anything is written.

def test_a_refused_change_leaves_the_prepared_corpus_untouched(reference, tmp_path):
  corpus = tmp_path / "corpus.txt"
  corpus.write_bytes(reference["corpus.txt"])
  tokenizer = tmp_path / "tokenizer"
  tokenizer.mkdir()
  for name in ("tokenizer.json", "bert_jax_tokenizer.json"):
    (tokenizer / name).write_bytes(reference[f"tokenizer/{name}"])
  out = tmp_path / "prepared"
  kwargs = dict(num_workers=0, log=lambda *_: None)
  prepare.prepare_corpus([str(corpus)], tokenizer, out, eval_fraction=0.05, **kwargs)
  before = {path.name: path.read_bytes() for path in out.rglob("*") if path.is_file()}
  calls = []

  def refuse():
    calls.append(True)
    raise ValueError("holds checkpoints of another config")

  # The same inputs and options: nothing to write, nothing to check.
  prepare.prepare_corpus([str(corpus)], tokenizer, out, eval_fraction=0.05, before_write=refuse, **kwargs)
  assert not calls
  for changed in (dict(eval_fraction=0.1), dict(eval_fraction=0.05, seed=1)):
    with pytest.raises(ValueError, match="another config"):
      prepare.prepare_corpus([str(corpus)], tokenizer, out, before_write=refuse, **changed, **kwargs)
    assert {path.name: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "prepared", "tokenizer"]
  assert len(calls) == 2
  # Accepted, the change is made in full: the split a fresh preparation draws.
  prepare.prepare_corpus([str(corpus)], tokenizer, out, eval_fraction=0.1, seed=1, before_write=lambda: None,
                         **kwargs)
  fresh = prepare.prepare_corpus([str(corpus)], tokenizer, tmp_path / "fresh", eval_fraction=0.1, seed=1, **kwargs)
  np.testing.assert_array_equal(np.load(out / prepare.EVAL_DOCUMENTS), np.load(tmp_path / "fresh" /
                                                                                 prepare.EVAL_DOCUMENTS))
  assert fresh["splits"] == json.loads((out / prepare.MANIFEST).read_text())["splits"]


def test_the_trainer_refuses_a_changed_split_before_rewriting_the_builtin_corpus(tmp_path, monkeypatch):
  # A workdir with checkpoints and a demo config whose eval split then changes: refused, the prepared corpus as it
  # was (the trainer's config check runs inside prepare, before its first write).
  from bert_jax.train import checkpoint as checkpoint_lib
  from bert_jax.train import workdir as workdir_lib

  config = _demo_config()
  pretrain_data.prepare_data(config, tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
  before = _snapshot(tmp_path / "builtin_corpus")
  monkeypatch.setattr(checkpoint_lib, "complete_steps", lambda workdir: [2])
  changed = config_lib.load_config(DEMO, ["data.eval_fraction=0.1"])
  with pytest.raises(workdir_lib.ConfigMismatchError, match="data.eval_fraction"):
    pretrain_data.prepare_data(changed, tmp_path)
  assert _snapshot(tmp_path / "builtin_corpus") == before
