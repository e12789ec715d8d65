"""What the experiment drivers carry to a GPU machine that keeps nothing between calls, and what they bring back.

Carried: the downstream data (GLUE with SST-2's dev carved from its train file, SQuAD v1.1's dev file split by
article, CoNLL-2003), the MiniLM as float16, wheels the machine lacks. Brought back: a call's record (card, versions)
and its small files in one archive. `bert-jax reproduce`, `compression-runs` and `analysis-runs` and
bench/finetune_vs_reference.py share these.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import shutil
import signal
import subprocess
import tarfile
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
# The shared data folder beside the checkout, or beside the folder of worktrees that holds it.
SHARED = next((folder / "shared" for folder in REPO.parents if (folder / "shared" / "data").is_dir()),
              REPO.parent / "shared")
CORPUS = SHARED / "data" / "corpus" / "wikipedia_en_sample" / "wiki_en_sample.sentences.txt.gz"
GLUE_DIRS = {"rte": "RTE", "mrpc": "MRPC", "stsb": "STS-B", "cola": "CoLA", "sst2": "SST-2"}
SST2_DEV_ROWS = 872
SQUAD_TRAIN_FRACTION = 0.8  # of the articles of dev-v1.1.json, in file order
SQUAD_FILES = ("train-v1.1.json", "dev-v1.1.json")  # what squad/v1.1's `load` reads
CONLL_FILES = ("eng.train", "eng.testa")  # conll2003's train and dev splits
MODEL_FILES = ("config.json", "vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MAX_COPIED_BYTES = 4 << 20  # Results, state, metrics and figures are far smaller; checkpoints are not copied at all.


def split_squad(source: pathlib.Path, out: pathlib.Path, train_fraction: float = SQUAD_TRAIN_FRACTION) -> dict:
  """Writes the first `train_fraction` of source's articles as train-v1.1.json and the rest as dev-v1.1.json."""
  data = json.loads(source.read_text(encoding="utf-8"))
  articles = data["data"]
  cut = int(train_fraction * len(articles))
  out.mkdir(parents=True, exist_ok=True)
  counts = {}
  for name, chosen in zip(SQUAD_FILES, (articles[:cut], articles[cut:])):
    (out / name).write_text(json.dumps({"version": data["version"], "data": chosen}, separators=(",", ":")),
                            encoding="utf-8")
    counts[name] = (len(chosen), sum(len(p["qas"]) for a in chosen for p in a["paragraphs"]))
  return counts


def write_task_data(out: pathlib.Path, glue_tasks=tuple(GLUE_DIRS), squad: bool = True, conll: bool = True) -> None:
  """Writes the downstream data the drivers' runs (and both sides of bench/finetune_vs_reference.py) read: GLUE with
  SST-2's dev carved from its train file as whole sentences (and glue/SST-2/carve.json), SQuAD v1.1's dev file split
  by article into train and dev, CoNLL-2003's train and dev (each of them as the arguments ask)."""
  from bert_jax.tasks import glue as glue_lib  # pylint: disable=import-outside-toplevel  (a call's run never needs it)

  glue = SHARED / "data" / "glue"
  for task in glue_tasks:
    directory = GLUE_DIRS[task]
    (out / "glue" / directory).mkdir(parents=True, exist_ok=True)
    if task == "sst2":
      # Its rows are the phrases of ~7k sentences: a random carve would put parts of one sentence on both sides.
      marker = glue_lib.write_sentence_carve(glue / directory / "train.tsv", out / "glue" / directory, SST2_DEV_ROWS,
                                             seed=0)
      print(f"sst2: {marker['dev_rows']} dev sentences, {marker['train_rows']} train rows ({marker['method']})")
    else:
      for split in ("train", "dev"):
        shutil.copy(glue / directory / f"{split}.tsv", out / "glue" / directory / f"{split}.tsv")
  if squad:
    counts = split_squad(SHARED / "data" / "squad" / "dev-v1.1.json", out / "squad")
    print("squad: " + ", ".join(f"{name} {articles} articles / {questions} questions"
                                for name, (articles, questions) in counts.items()))
  if conll:
    (out / "conll2003").mkdir(parents=True, exist_ok=True)
    for name in CONLL_FILES:
      shutil.copy(SHARED / "data" / "conll2003" / name, out / "conll2003" / name)


def copy_wheels(wheels: pathlib.Path | None, out: pathlib.Path) -> None:
  if wheels is not None and wheels.resolve() != (out / "wheels").resolve():
    shutil.copytree(wheels, out / "wheels", dirs_exist_ok=True)


def write_float16_model(model_dir: pathlib.Path, out: pathlib.Path, layers: int | None = None) -> None:
  """The MiniLM's files with its weights as float16 (half the bytes to carry), in out/minilm; with `layers`, its
  first `layers` layers alone (a smaller model to carry where the call's files are tight)."""
  import safetensors.numpy  # pylint: disable=import-outside-toplevel

  model_out = out / "minilm"
  model_out.mkdir(parents=True, exist_ok=True)
  for name in MODEL_FILES:
    shutil.copy(model_dir / name, model_out / name)
  tensors = safetensors.numpy.load_file(model_dir / "model.safetensors")
  if layers is not None:
    config = json.loads((model_dir / "config.json").read_text())
    if not 0 < layers <= config["num_hidden_layers"]:
      raise ValueError(f"layers={layers}: the model has {config['num_hidden_layers']}")
    tensors = {k: v for k, v in tensors.items()
               if not k.startswith("encoder.layer.") or int(k.split(".")[2]) < layers}
    (model_out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2) + "\n")
  safetensors.numpy.save_file({k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in tensors.items()},
                              model_out / "model.safetensors")


def limit_data(carry: pathlib.Path, tasks: list[str], limit: int, destination: pathlib.Path) -> pathlib.Path:
  """Copies of the SQuAD / CoNLL splits cut to their first `limit` questions or sentences (smoke tests)."""
  for task in tasks:
    if task == "squad":
      (destination / "squad").mkdir(parents=True, exist_ok=True)
      for name in SQUAD_FILES:
        data = json.loads((carry / "squad" / name).read_text(encoding="utf-8"))
        kept, left = [], limit
        for article in data["data"]:
          paragraphs = []
          for paragraph in article["paragraphs"]:
            if left > 0:
              paragraphs.append({**paragraph, "qas": paragraph["qas"][:left]})
              left -= len(paragraphs[-1]["qas"])
          if paragraphs:
            kept.append({**article, "paragraphs": paragraphs})
        (destination / "squad" / name).write_text(json.dumps({**data, "data": kept}), encoding="utf-8")
    elif task == "conll":
      (destination / "conll2003").mkdir(parents=True, exist_ok=True)
      for name in CONLL_FILES:
        lines, sentences, in_sentence = [], 0, False
        for line in (carry / "conll2003" / name).read_text(encoding="utf-8").splitlines():
          is_word = bool(line.split()) and not line.startswith("-DOCSTART-")
          if in_sentence and not is_word:
            sentences += 1
            if sentences == limit:
              break
          in_sentence = is_word
          lines.append(line)
        (destination / "conll2003" / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    else:
      raise ValueError(f"--limit serves squad and conll, not {task}")
  return destination


def float32_model(carry: pathlib.Path, destination: pathlib.Path) -> pathlib.Path:
  """The carried float16 MiniLM written back as float32 (what both sides load)."""
  import safetensors.numpy  # pylint: disable=import-outside-toplevel

  destination.mkdir(parents=True, exist_ok=True)
  for name in MODEL_FILES:
    shutil.copy(carry / "minilm" / name, destination / name)
  tensors = safetensors.numpy.load_file(carry / "minilm" / "model.safetensors")
  safetensors.numpy.save_file({k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in tensors.items()},
                              destination / "model.safetensors")
  return destination


def card() -> str:
  """The accelerators, as "N x NAME" (read with nvidia-smi, no framework started), else the host's processor."""
  try:
    names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, check=True).stdout.split("\n")
    names = [name for name in names if name]
    return f"{len(names)} x {names[0]}" if names else "no GPU"
  except (OSError, subprocess.CalledProcessError):
    return platform.processor() or "cpu"


def versions() -> dict[str, str]:
  from importlib import metadata  # pylint: disable=import-outside-toplevel

  out = {"python": platform.python_version()}
  for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain"):
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      pass
  return out


def stop(process: subprocess.Popen, grace: float = 5.0) -> None:
  """Stops a process started in a session of its own and its children (one process group): a term signal, then a
  kill after `grace` to whatever of the group is left. A child started as the term signal went out (a sweep
  starting its next fine-tuning) never saw it and would outlive its parent, holding its workdir's lock and the
  accelerator's memory: the stop ends when the whole group has, not its first process."""
  for sig in (signal.SIGTERM, signal.SIGKILL):
    try:
      os.killpg(process.pid, sig)
    except ProcessLookupError:
      return
    if _group_ended(process, grace):
      return


def _group_ended(process: subprocess.Popen, timeout: float) -> bool:
  """Whether `process` and every other member of its process group end within `timeout` seconds."""
  deadline = time.monotonic() + timeout
  try:
    process.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    return False
  while time.monotonic() < deadline:
    try:
      os.killpg(process.pid, 0)
    except ProcessLookupError:
      return True
    time.sleep(0.05)
  return False


def pack_results(root: pathlib.Path, archive: pathlib.Path, skip=lambda relative: False) -> int:
  """Writes `root`'s small files (no checkpoints, tokenizers or hidden files) into one .tar.gz; returns how many.

  One archive because a device call brings back a few files only, two folders deep at most.
  """
  files = 0
  archive.parent.mkdir(parents=True, exist_ok=True)
  with tarfile.open(archive, "w:gz") as tar:
    for path in sorted(root.rglob("*")):
      relative = path.relative_to(root)
      if not path.is_file() or "checkpoints" in relative.parts or path.stat().st_size > MAX_COPIED_BYTES:
        continue
      if relative.parts[-1].startswith(".") or "tokenizer" in relative.parts or skip(relative):
        continue
      tar.add(path, arcname=str(relative))
      files += 1
  return files
