"""`bert-jax predict` and `load_for_inference`: the same predictions as the fine-tuning evaluation, bucketed lengths
compiled once each, unlabelled inputs, one-line errors for bad files, the pruned model folder."""

import json

import flax.linen as nn
import jax
import numpy as np
import pytest

from bert_jax import cli
from bert_jax.analysis import heads
from bert_jax.tasks import evaluate as evaluate_lib
from bert_jax.tasks.batching import BatchMaker
from bert_jax.tasks import inference
from bert_jax.tasks.finetune_model import (FinetuneObjective, build_model, device_fields, load_initial_model,
                                           task_tokenizer)
from bert_jax.tasks.glue import SPECS, tsv_has_labels
from bert_jax.tasks.kinds import task_kind
from bert_jax.tasks.predict import predict_file
from bert_jax.tasks.registry import get_task
from bert_jax.train import checkpoint as checkpoint_lib

# The fixtures tiny_model (a random 2-layer BERT and its vocabulary) and the fine-tuned runs sst2_run, tagging_run
# and span_run (whose test files repeat their dev examples) are conftest.py's.
from test_finetune import TINY, _conll, _glue_sst2, _squad, _swag


def test_length_buckets():
  assert inference.length_buckets(128) == (16, 32, 64, 128)
  assert inference.length_buckets(100) == (16, 32, 64, 100)
  assert inference.length_buckets(16) == (16,)


@pytest.mark.slow
def test_classification_predictions_equal_the_evaluation(sst2_run, tmp_path, capsys):
  workdir, data = sst2_run
  # The evaluation's predictions of the test split (the dev sentences) as GLUE's submission file.
  submitted = evaluate_lib.evaluate_run(workdir, "test")[1]["test"]
  output = tmp_path / "SST-2.tsv"
  assert cli.main(["predict", "--workdir", str(workdir), "--input", str(data / "SST-2" / "test.tsv"),
                   "--output", str(output), "--format", "submission"]) == 0
  assert output.read_text() == open(submitted).read()
  assert "wrote 64 predictions" in capsys.readouterr().out

  # The labelled dev file gives the same labels, and their accuracy is the evaluation's.
  jsonl = tmp_path / "dev.jsonl"
  predict_file(str(workdir), str(data / "SST-2" / "dev.tsv"), str(jsonl))
  records = [json.loads(line) for line in jsonl.read_text().splitlines()]
  submission_labels = [row.split("\t")[1] for row in output.read_text().splitlines()[1:]]
  assert [record["label"] for record in records] == submission_labels
  assert all(sum(record["probabilities"].values()) == pytest.approx(1.0, abs=1e-4) for record in records)
  gold = [row.split("\t")[1] for row in (data / "SST-2" / "dev.tsv").read_text().splitlines()[1:]]
  accuracy = 100.0 * np.mean([record["label"] == label for record, label in zip(records, gold)])
  assert accuracy == pytest.approx(evaluate_lib.evaluate_run(workdir)[1]["dev"]["accuracy"])


def test_json_lines_input_reads_like_the_tsv(sst2_run, tmp_path):
  workdir, data = sst2_run
  rows = (data / "SST-2" / "test.tsv").read_text().splitlines()[1:]
  source = tmp_path / "input.jsonl"
  source.write_text("".join(json.dumps({"idx": int(row.split("\t")[0]), "sentence": row.split("\t")[1]}) + "\n"
                            for row in rows))
  predict_file(str(workdir), str(source), str(tmp_path / "from_jsonl.jsonl"), batch_size=16)
  predict_file(str(workdir), str(data / "SST-2" / "test.tsv"), str(tmp_path / "from_tsv.jsonl"))
  from_jsonl = [json.loads(line) for line in (tmp_path / "from_jsonl.jsonl").read_text().splitlines()]
  from_tsv = [json.loads(line) for line in (tmp_path / "from_tsv.jsonl").read_text().splitlines()]
  assert [r["id"] for r in from_jsonl] == [r["id"] for r in from_tsv] == [str(i) for i in range(len(rows))]
  assert [r["label"] for r in from_jsonl] == [r["label"] for r in from_tsv]


def test_no_recompilation_within_a_bucket(sst2_run, tmp_path):
  workdir, _ = sst2_run
  model = inference.load_for_inference(workdir)
  rng = np.random.default_rng(0)
  # 8 fake devices, batches of 8: four batches of rows 17 to 30 tokens long, all in the 32 bucket.
  sentences = [" ".join(rng.choice([f"w{i}" for i in range(30)], n)) for n in rng.integers(15, 29, 32)]
  features = model.featurize(model.task.read_file(_write_tsv(tmp_path / "rows.tsv", sentences)))
  lengths = inference.row_lengths(features)
  assert lengths.min() > 16 and lengths.max() <= 32 and len(set(lengths)) > 4
  batches = model.batches(features, 8)
  assert len(batches) == 4 and {length for _, length in batches} == {32}
  model.predict_outputs(features, 8)
  assert model.predict_step._cache_size() == 1
  # A batch of short rows takes the 16 bucket: one more compilation, and none for a second call.
  short = model.featurize(model.task.read_file(_write_tsv(tmp_path / "short.tsv", ["w1 w2"] * 8)))
  model.predict_outputs(short, 8)
  model.predict_outputs(features, 8)
  assert model.predict_step._cache_size() == 2


def _write_tsv(path, sentences):
  path.write_text("index\tsentence\n" + "".join(f"{i}\t{s}\n" for i, s in enumerate(sentences)))
  return path


def test_bad_inputs_fail_in_one_line(sst2_run, tmp_path, capsys):
  workdir, _ = sst2_run
  bad = tmp_path / "bad.tsv"
  bad.write_text("sentence\tlabel\nw1 w2\t1\nw3\n")
  assert cli.main(["predict", "--workdir", str(workdir), "--input", str(bad), "--output", str(tmp_path / "o")]) == 1
  assert f"{bad}:3: expected 2 tab-separated columns, found 1" in capsys.readouterr().err
  missing = tmp_path / "missing.tsv"
  assert cli.main(["predict", "--workdir", str(workdir), "--input", str(missing), "--output", "o"]) == 1
  assert f"--input {missing}: no such file" in capsys.readouterr().err
  lines = tmp_path / "bad.jsonl"
  lines.write_text('{"sentence": "w1"}\n{"text": "w2"}\n')
  assert cli.main(["predict", "--workdir", str(workdir), "--input", str(lines), "--output", "o"]) == 1
  assert f"{lines}:2: no ['sentence'] field" in capsys.readouterr().err
  assert cli.main(["predict", "--workdir", str(tmp_path), "--input", str(lines), "--output", "o"]) == 1
  assert "finetune_run.json not found" in capsys.readouterr().err


def test_pruned_model_folder_loads_and_predicts(sst2_run, tmp_path):
  workdir, data = sst2_run
  model = inference.load_for_inference(workdir)
  _, params = checkpoint_lib.restore_params(workdir / f"seed_{model.seed}")
  keep = np.array([[True, False], [True, True]])
  config, encoder = heads.prune_heads(model.model_config, params["encoder"], keep)
  heads.save_pruned_run(workdir, tmp_path / "pruned", config, {**params, "encoder": encoder})
  pruned = inference.load_for_inference(tmp_path / "pruned")
  assert pruned.model_config.heads_per_layer == (1, 2)
  predict_file(str(tmp_path / "pruned"), str(data / "SST-2" / "test.tsv"), str(tmp_path / "pruned.jsonl"))
  assert len((tmp_path / "pruned.jsonl").read_text().splitlines()) == 64


@pytest.mark.slow
def test_tagging_predictions_equal_the_evaluation_and_read_unlabelled_files(tagging_run, tmp_path):
  workdir, data = tagging_run
  evaluated = json.loads(open(evaluate_lib.evaluate_run(workdir, "test")[1]["test"]).read())
  output = tmp_path / "tags.jsonl"
  predict_file(str(workdir), str(data / "eng.testb"), str(output), batch_size=16)
  records = [json.loads(line) for line in output.read_text().splitlines()]
  assert [record["tags"] for record in records] == evaluated
  # Words only, one a line, as the submission format writes them: the same tags back.
  words_only = tmp_path / "words.txt"
  words_only.write_text("".join("-DOCSTART-\n\n" if line.startswith("-DOCSTART-") else
                                (line.split()[0] + "\n" if line.strip() else "\n")
                                for line in (data / "eng.testb").read_text().splitlines(keepends=True)))
  predict_file(str(workdir), str(words_only), str(tmp_path / "tags.conll"), output_format="submission")
  conll = (tmp_path / "tags.conll").read_text().split("\n\n")
  sentences = [[line.split() for line in block.splitlines()] for block in conll
               if block.strip() and not block.startswith("-DOCSTART-")]
  assert [[tag for _, tag in sentence] for sentence in sentences] == evaluated
  # JSON lines of tokens: one sentence a line, each its own document.
  tokens = tmp_path / "tokens.jsonl"
  tokens.write_text("".join(json.dumps({"tokens": record["words"]}) + "\n" for record in records[:5]))
  predict_file(str(workdir), str(tokens), str(tmp_path / "few.jsonl"))
  assert [json.loads(line)["words"] for line in (tmp_path / "few.jsonl").read_text().splitlines()] == [
      record["words"] for record in records[:5]]


# First lines of the GLUE files (train/dev, test) as download_glue_data.py leaves them.
_GLUE_FIRST_LINES = {
    "cola": ("gj04\t1\t\tThe sailors rode the breeze clear of the rocks.", "index\tsentence"),
    "sst2": ("sentence\tlabel", "index\tsentence"),
    "mrpc": ("\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String", "index\t#1 ID\t#2 ID\t#1 String\t#2 String"),
    "stsb": ("index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore",
             "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"),
    "qqp": ("id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate", "id\tquestion1\tquestion2"),
    "mnli": ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
             "sentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label",
             "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
             "sentence2_parse\tsentence1\tsentence2"),
    "qnli": ("index\tquestion\tsentence\tlabel", "index\tquestion\tsentence"),
    "rte": ("index\tsentence1\tsentence2\tlabel", "index\tsentence1\tsentence2"),
    "wnli": ("index\tsentence1\tsentence2\tlabel", "index\tsentence1\tsentence2"),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_glue_tsv_layout_is_told_by_the_first_line(name, tmp_path):
  labelled, unlabelled = _GLUE_FIRST_LINES[name]
  for first_line, expected in ((labelled, True), (unlabelled, False)):
    path = tmp_path / "file.tsv"
    path.write_text(first_line + "\n")
    assert tsv_has_labels(SPECS[name], path) is expected


@pytest.mark.slow
def test_span_predictions_equal_the_evaluation_on_questions_without_answers(span_run, tmp_path):
  workdir, data = span_run
  dev = json.loads((data / "test-v1.1.json").read_text())
  evaluated = json.loads(open(evaluate_lib.evaluate_run(workdir, "test")[1]["test"]).read())
  for article in dev["data"]:
    for paragraph in article["paragraphs"]:
      for question in paragraph["qas"]:
        del question["answers"]
  unanswered = tmp_path / "questions-v1.1.json"
  unanswered.write_text(json.dumps(dev))
  with pytest.raises(ValueError, match="has no .answers. field"):  # training data must have answers
    get_task("squad/v1.1").load(tmp_path, "questions")
  predict_file(str(workdir), str(unanswered), str(tmp_path / "answers.json"), output_format="submission")
  assert json.loads((tmp_path / "answers.json").read_text()) == evaluated


@pytest.mark.parametrize("task_name, make_data, data_file", [
    ("glue/sst2", _glue_sst2, "SST-2/dev.tsv"), ("swag", _swag, "val.csv"), ("conll2003", _conll, "eng.testa"),
    ("squad/v1.1", _squad, "dev-v1.1.json")])
@pytest.mark.slow
def test_bucketed_outputs_equal_full_length_outputs(task_name, make_data, data_file,
                                                    tiny_model, tmp_path):
  """Every kind's outputs from rows cut to their buckets equal those of rows at max_len, on the real tokens."""
  task = get_task(task_name)
  objective = FinetuneObjective(build_model(TINY, task.kind, task.num_labels), task.kind, num_choices=task.num_choices)
  params = nn.unbox(objective.init_variables(jax.random.key(0), objective.example_batch(1, 16))["params"])
  tokenizer = task_tokenizer(load_initial_model(tiny_model).tokenizer)
  model = inference.inference_model(task, TINY, params, tokenizer, 64, batch_size=8)
  examples = task.read_file(make_data(tmp_path / "data", np.random.default_rng(0)) / data_file)
  features = model.featurize(examples)
  assert max(length for _, length in model.batches(features)) < 64  # rows are cut
  bucketed = model.predict_outputs(features)
  full = evaluate_lib.predict_outputs(model.predict_step, model.params, features,
                                      BatchMaker(device_fields(task.kind), 8, model.partitioning.mesh))
  if task_kind(task.kind).token_output_fill is not None:  # per-token outputs: compared on the real tokens
    real = np.arange(64) < features["lengths"][:, None]
    bucketed, full = bucketed[real], full[real]
  np.testing.assert_allclose(bucketed, full, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_inference_bench_times_a_fine_tuned_variant(sst2_run, tmp_path, capsys):
  workdir, _ = sst2_run
  from conftest import bench_module

  bench = bench_module("inference")
  assert bench.main(["--models", "", "--variant", f"sst2={workdir}", "--no-reference", "--batches", "1,8",
                     "--lengths", "16,128", "--seconds", "0.01", "--latency-calls", "3", "--out", str(tmp_path)]) == 0
  rows = json.loads((tmp_path / "inference_cpu.json").read_text())["rows"]
  assert [(row["model"], row["batch"], row["length"]) for row in rows] == [("sst2", 1, 16), ("sst2", 8, 16)]
  assert all(row["ours_seq_per_s"] > 0 and "compiled_seq_per_s" not in row for row in rows)
  assert "length 128 is longer than its 64 positions" in capsys.readouterr().out
