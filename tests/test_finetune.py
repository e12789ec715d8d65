"""Fine-tuning end to end on CPU: a tiny random BERT learns small generated tasks of every kind.

Each generated task is learnable from token identity within a few dozen steps,
so the dev metric must clearly beat chance: a sentiment word (classification),
a count of marked words (regression), the word after a marker (span), the
ending that carries the right word (multiple choice), tags fixed per word
(tagging).
"""

import json
import pathlib

import flax.linen as nn
import jax
import numpy as np
import pytest

from bert_jax.convert import save_pretrained
from bert_jax.models import Encoder, ModelConfig, PretrainingModel
from bert_jax.tasks import finetune as finetune_lib
from bert_jax.tasks import evaluate as evaluate_lib
from bert_jax.tasks import finetune_config
from bert_jax.tasks.registry import get_task
from bert_jax.tasks.finetune_model import load_initial_model, merge_initial_params, task_tokenizer
from bert_jax.train import checkpoint as checkpoint_lib
from bert_jax.train import config_lib
from bert_jax.train import workdir as workdir_lib

REPO = pathlib.Path(__file__).resolve().parents[1]
WORDS = [f"w{i}" for i in range(30)]
MARKERS = ["good", "bad", "key", "where", "is", "pera", "perb", "loca", "locb"]
TINY = ModelConfig(vocab_size=5 + len(WORDS) + len(MARKERS), hidden_size=32, num_layers=2, num_heads=2,
                   intermediate_size=64, max_position_embeddings=64)
# Small, quick runs: 8 fake devices take 16 rows a step.
FAST = ["--config.train.batch_size=16", "--config.train.eval_batch_size=32", "--config.max_len=32",
        "--config.optim.lr=3e-3", "--config.optim.warmup_proportion=0.1", "--config.seeds=(1,)",
        "--config.train.log_every=5", "--config.train.save_checkpoint=False"]


def _write_tokenizer(directory: pathlib.Path) -> pathlib.Path:
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *MARKERS])
                                       + "\n")
  return directory


def save_tiny_model(root: pathlib.Path) -> pathlib.Path:
  """Saves a randomly initialised 2-layer, width-32 BERT in our converted format, with its WordPiece vocab, as
  root/model (the `tiny_model` fixture of conftest.py)."""
  params = nn.unbox(jax.jit(Encoder(TINY).init)(jax.random.key(0), np.zeros((1, 8), np.int32))["params"])
  return save_pretrained(root / "model", "bert", TINY, jax.tree.map(np.asarray, params),
                         tokenizer_dir=_write_tokenizer(root / "vocab"))


def _sentence(rng, length: int) -> list[str]:
  return [str(w) for w in rng.choice(WORDS, length)]


def _glue_sst2(root: pathlib.Path, rng) -> pathlib.Path:
  """Label 1 when the sentence holds 'good', 0 when it holds 'bad' (SST-2 layout, plus a test file)."""
  directory = root / "SST-2"
  directory.mkdir(parents=True)
  for split, count in (("train", 192), ("dev", 64), ("test", 10)):
    rows = ["sentence\tlabel" if split != "test" else "index\tsentence"]
    for index in range(count):
      label = int(rng.integers(2))
      words = _sentence(rng, 5)
      words.insert(int(rng.integers(6)), "good" if label else "bad")
      rows.append(f"{' '.join(words)}\t{label}" if split != "test" else f"{index}\t{' '.join(words)}")
    (directory / f"{split}.tsv").write_text("\n".join(rows) + "\n")
  return root


def _glue_stsb(root: pathlib.Path, rng) -> pathlib.Path:
  """Score = how many times 'good' occurs in the first sentence (0-4), STS-B's ten columns."""
  directory = root / "STS-B"
  directory.mkdir(parents=True)
  header = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"
  for split, count in (("train", 192), ("dev", 64)):
    rows = [header]
    for index in range(count):
      score = int(rng.integers(5))
      words = _sentence(rng, 6 - score // 2) + ["good"] * score
      rng.shuffle(words)
      rows.append(f"{index}\tg\tf\t2020\t{index}\ts\ts\t{' '.join(words)}\t{' '.join(_sentence(rng, 3))}\t{score}.0")
    (directory / f"{split}.tsv").write_text("\n".join(rows) + "\n")
  return root


def _squad(root: pathlib.Path, rng) -> pathlib.Path:
  """The answer is the one name (pera, perb, loca, locb) somewhere in a 10-word context."""
  root.mkdir(parents=True)
  for split, count in (("train", 192), ("dev", 48)):
    articles = []
    for index in range(count):
      words = _sentence(rng, 10)
      position = int(rng.integers(10))
      words[position] = str(rng.choice(["pera", "perb", "loca", "locb"]))
      answer_start = len(" ".join(words[:position])) + (1 if position else 0)
      qa = {"id": f"{split}{index}", "question": "where is key",
            "answers": [{"text": words[position], "answer_start": answer_start}]}
      articles.append({"title": f"{split}{index}", "paragraphs": [{"context": " ".join(words), "qas": [qa]}]})
    (root / f"{split}-v1.1.json").write_text(json.dumps({"version": "1.1", "data": articles}))
  return root


def _swag(root: pathlib.Path, rng) -> pathlib.Path:
  """The right ending is the one that starts with 'good'."""
  root.mkdir(parents=True)
  header = ",video-id,fold-ind,startphrase,sent1,sent2,gold-source,ending0,ending1,ending2,ending3,label"
  for name, count in (("train.csv", 192), ("val.csv", 48)):
    rows = [header]
    for index in range(count):
      label = int(rng.integers(4))
      endings = [f"{'good' if choice == label else 'bad'} {' '.join(_sentence(rng, 2))}" for choice in range(4)]
      rows.append(f"{index},v,{index},x,{' '.join(_sentence(rng, 4))},{' '.join(_sentence(rng, 2))},gold,"
                  f"{','.join(endings)},{label}")
    (root / name).write_text("\n".join(rows) + "\n")
  return root


def _conll(root: pathlib.Path, rng) -> pathlib.Path:
  """Persons are pera/perb, locations loca/locb, every other word O (IOB1 files with -DOCSTART-)."""
  root.mkdir(parents=True)
  tags = {"pera": "I-PER", "perb": "I-PER", "loca": "I-LOC", "locb": "I-LOC"}
  for name, count in (("eng.train", 160), ("eng.testa", 48)):
    lines = ["-DOCSTART- -X- O O", ""]
    for _ in range(count):
      words = _sentence(rng, 6)
      for position in rng.choice(6, 2, replace=False):
        words[position] = str(rng.choice(list(tags)))
      lines += [f"{word} NN O {tags.get(word, 'O')}" for word in words] + [""]
    (root / name).write_text("\n".join(lines) + "\n")
  return root


def _finetune(config_spec: str, model: pathlib.Path, data_dir: pathlib.Path, workdir: pathlib.Path,
              *overrides: str) -> dict:
  config = config_lib.load_config(str(REPO / config_spec),
                                  [f"--config.init.model={model}", f"--config.data_dir={data_dir}", *FAST,
                                   *overrides])
  return finetune_lib.finetune(config, workdir)


def _selected(results: dict, metric: str, split: str = "dev") -> list[float]:
  return [seed["selected"]["metrics"][split][metric] for seed in results["seeds"]]


@pytest.fixture(scope="module")
def classification_run(tiny_model, tmp_path_factory):
  """SST-2-style run with two seeds, evaluated every 24 steps, best checkpoint kept."""
  root = tmp_path_factory.mktemp("sst2")
  data = _glue_sst2(root / "glue", np.random.default_rng(0))
  workdir = root / "run"
  results = _finetune("configs/finetune/glue.py:task=sst2", tiny_model, data, workdir, "--config.seeds=(1,2)",
                      "--config.train.epochs=6", "--config.train.eval_every=24",
                      "--config.train.save_checkpoint=True")
  return workdir, results


@pytest.mark.slow
def test_classification_beats_chance_with_a_multi_seed_summary(classification_run):
  workdir, results = classification_run
  assert min(_selected(results, "accuracy")) > 80.0
  stats = results["summary"]["dev"]["accuracy"]
  values = _selected(results, "accuracy")
  assert stats["values"] == values
  assert stats["mean"] == pytest.approx(np.mean(values)) and stats["median"] == pytest.approx(np.median(values))
  assert stats["std"] == pytest.approx(np.std(values, ddof=1))
  assert "highest accuracy on dev" in results["selection_rule"]
  on_disk = json.loads((workdir / "results.json").read_text())
  assert on_disk["summary"] == results["summary"] and on_disk["selection_rule"] == results["selection_rule"]
  table = (workdir / "results.md").read_text()
  assert "| dev | accuracy |" in table and results["selection_rule"] in table
  lines = [json.loads(line) for line in (workdir / "seed_1" / "metrics.jsonl").read_text().splitlines()]
  assert any("train/task_loss" in line for line in lines) and any("eval/accuracy" in line for line in lines)
  # The steps are compiled once, before the first seed, and that time is reported apart from training.
  compiles = [seed["compile_seconds"] for seed in results["seeds"]]
  assert compiles[0] > 0 and all(seconds == 0 for seconds in compiles[1:])
  assert results["timings"]["compile train and predict steps (once)"] == compiles[0]
  # The train and predict steps each asked the persistent cache (the suite's) whether a run compiled them before.
  assert results["compile_cache"]["requests"] == 2 and 0 <= results["compile_cache"]["hits"] <= 2
  assert "- compile train and predict steps (once) (s):" in table


def test_best_evaluation_is_selected_and_rescored_by_evaluate(classification_run, capsys):
  workdir, results = classification_run
  for seed in results["seeds"]:
    accuracies = [record["metrics"]["dev"]["accuracy"] for record in seed["history"]]
    assert len(accuracies) == 3  # every 24 of 72 steps
    first_best = accuracies.index(max(accuracies))
    assert seed["selected"]["step"] == seed["history"][first_best]["step"]
    assert checkpoint_lib.Checkpointer(workdir / f"seed_{seed['seed']}").steps() == [seed["selected"]["step"]]
  assert evaluate_lib.main(["--workdir", str(workdir)]) == 0
  rescored = json.loads((workdir / "evaluate_dev.json").read_text())
  for seed in results["seeds"]:
    assert rescored[str(seed["seed"])]["dev"] == seed["selected"]["metrics"]["dev"]
  assert "seed 1 dev: accuracy=" in capsys.readouterr().out
  evaluate_lib.main(["--workdir", str(workdir), "--split", "test", "--seed", "2"])
  submission = (workdir / "submission" / "seed_2" / "SST-2.tsv").read_text().splitlines()
  assert submission[0] == "index\tprediction" and len(submission) == 11
  assert {row.split("\t")[1] for row in submission[1:]} <= {"0", "1"}


def test_a_workdir_refuses_another_config_naming_the_key(classification_run, tiny_model):
  workdir, _ = classification_run
  before = (workdir / "results.json").read_text()
  with pytest.raises(workdir_lib.ConfigMismatchError, match=r"train.epochs: 6 in the workdir, 7 now"):
    _finetune("configs/finetune/glue.py:task=sst2", tiny_model, workdir.parent / "glue", workdir,
              "--config.seeds=(1,2)", "--config.train.epochs=7", "--config.train.eval_every=24",
              "--config.train.save_checkpoint=True")
  assert (workdir / "results.json").read_text() == before


@pytest.mark.slow
def test_regression_from_a_finetuned_run_reuses_the_pooler(classification_run, tmp_path):
  classification_dir, _ = classification_run
  data = _glue_stsb(tmp_path / "glue", np.random.default_rng(1))
  results = _finetune("configs/finetune/glue.py:task=stsb", classification_dir, data, tmp_path / "run",
                      "--config.train.epochs=8", "--config.train.eval_every=end")
  assert results["init"]["source"] == "finetune_run"
  head = results["init"]["head"]
  assert any("pooler" in name for name in head["reused"])
  assert any("classifier" in name for name in head["reinitialised"])  # 2 labels -> 1 score
  assert _selected(results, "pearson")[0] > 60.0


@pytest.mark.slow
def test_several_steps_per_call_keep_the_logs_and_evaluations_of_single_steps(tiny_model, sst2_run, tmp_path):
  """`train.steps_per_call=5` over 6 epochs of 12 steps: calls of 5 steps wherever no log (every 5) or epoch end
  falls inside them, single steps elsewhere; the logged losses, the evaluations' steps and scores are those of the
  shared run's one step a call."""
  single_dir, data = sst2_run
  grouped = _finetune("configs/finetune/glue.py:task=sst2", tiny_model, data, tmp_path / "k5",
                      "--config.train.epochs=6", "--config.train.steps_per_call=5")
  logged = {}
  for name, workdir in (("single", single_dir), ("grouped", tmp_path / "k5")):
    lines = [json.loads(line) for line in (workdir / "seed_1" / "metrics.jsonl").read_text().splitlines()]
    logged[name] = {line["step"]: line["train/loss"] for line in lines if "train/loss" in line}
  steps = sorted(logged["single"])
  assert sorted(logged["grouped"]) == steps and {5, 10, 12, 15, 72} <= set(steps)  # logs, and one at each evaluation
  np.testing.assert_allclose([logged["grouped"][s] for s in steps], [logged["single"][s] for s in steps], rtol=1e-4)
  single = json.loads((single_dir / "results.json").read_text())["seeds"][0]["history"]
  assert [record["step"] for record in grouped["seeds"][0]["history"]] == [record["step"] for record in single] == [
      12, 24, 36, 48, 60, 72]
  for ours, theirs in zip(grouped["seeds"][0]["history"], single):
    assert ours["metrics"]["dev"]["accuracy"] == pytest.approx(theirs["metrics"]["dev"]["accuracy"], abs=1.6)


@pytest.mark.slow
def test_non_finite_loss_stops_naming_the_step(tiny_model, tmp_path):
  """An exploding learning rate makes the loss non-finite within a few steps; the run stops at the next log
  step, naming the first bad step."""
  data = _glue_sst2(tmp_path / "glue", np.random.default_rng(0))
  with pytest.raises(FloatingPointError, match=r"seed 1: non-finite loss or gradients at step \d+; try a lower"):
    _finetune("configs/finetune/glue.py:task=sst2", tiny_model, data, tmp_path / "run", "--config.optim.lr=1e30",
              "--config.optim.warmup_proportion=0.0", "--config.train.epochs=1")


def test_span_extraction_beats_chance(span_run):
  results = json.loads((span_run[0] / "results.json").read_text())  # conftest.py's run
  assert _selected(results, "exact_match")[0] > 50.0  # one of 10 context words by chance


@pytest.mark.slow
def test_multiple_choice_beats_chance(tiny_model, tmp_path):
  data = _swag(tmp_path / "swag", np.random.default_rng(3))
  results = _finetune("configs/finetune/swag.py", tiny_model, data, tmp_path / "run", "--config.train.epochs=4")
  assert _selected(results, "accuracy")[0] > 60.0  # chance is 25


def test_tagging_beats_chance(tagging_run):
  results = json.loads((tagging_run[0] / "results.json").read_text())  # conftest.py's run
  assert _selected(results, "f1")[0] > 70.0


@pytest.mark.slow
def test_feature_based_tagging_trains_the_head_and_freezes_the_encoder(tiny_model, tmp_path):
  data = _conll(tmp_path / "conll", np.random.default_rng(5))
  workdir = tmp_path / "run"
  results = _finetune("configs/finetune/ner.py:features=last", tiny_model, data, workdir,
                      "--config.feature_based.layers=(0,-1)", "--config.feature_based.head_size=16",
                      "--config.feature_based.head_layers=1", "--config.optim.lr=1e-2", "--config.train.epochs=4",
                      "--config.train.save_checkpoint=True")
  assert _selected(results, "f1")[0] > 50.0
  _, tuned = checkpoint_lib.restore_params(workdir / "seed_1")
  initial = load_initial_model(tiny_model).params["encoder"]
  jax.tree.map(np.testing.assert_array_equal, tuned["encoder"], initial)


def test_pretraining_run_is_a_starting_point(tmp_path):
  """A pre-training workdir's newest checkpoint gives the encoder and the NSP pooler."""
  workdir = tmp_path / "pretrain"
  model = PretrainingModel(TINY)
  ids = np.zeros((1, 8), np.int32)
  variables = jax.jit(model.init)(jax.random.key(1), ids, np.zeros((1, 2), np.int32))
  params = jax.tree.map(np.asarray, nn.unbox(variables["params"]))
  checkpointer = checkpoint_lib.Checkpointer(workdir, async_save=False)
  checkpointer.save(7, {"params": params}, {}, {"step": 7}, force=True)
  checkpointer.close()
  (workdir / "config.json").write_text(json.dumps({"objective": "mlm+nsp", "model": {"family": "bert"}}))
  (workdir / "model_config.json").write_text(json.dumps(TINY.__dict__))
  _write_tokenizer(workdir / "tokenizer")
  initial = load_initial_model(workdir)
  assert initial.source == "pretraining_run" and initial.config == TINY
  jax.tree.map(np.testing.assert_array_equal, initial.params["encoder"], params["encoder"])
  fresh = {"encoder": jax.tree.map(np.zeros_like, params["encoder"]),
           "head": {"pooler": jax.tree.map(np.zeros_like, params["sentence"]["pooler"]),
                    "classifier": {"kernel": np.zeros((32, 3), np.float32), "bias": np.zeros((3,), np.float32)}}}
  merged, reused, reinitialised = merge_initial_params(fresh, initial.params)
  jax.tree.map(np.testing.assert_array_equal, merged["head"]["pooler"], params["sentence"]["pooler"])
  assert reused == ["['head']['pooler']['dense']['bias']", "['head']['pooler']['dense']['kernel']"]
  assert reinitialised == ["['head']['classifier']['bias']", "['head']['classifier']['kernel']"]
  wrong = {"encoder": {**fresh["encoder"], "block_0": {}}, "head": {}}
  wrong["encoder"]["extra"] = np.zeros((2,), np.float32)
  with pytest.raises(ValueError, match="extra"):
    merge_initial_params(wrong, initial.params)


def test_bad_config_keys_fail_naming_the_key(tmp_path, capsys):
  argv = ["--config", str(REPO / "configs/finetune/glue.py:task=rte"), "--workdir", str(tmp_path)]
  with pytest.raises(config_lib.ConfigError, match="optim.lrr"):  # the CLI prints it in one line (test_cli.py)
    finetune_lib.main(argv + ["--config.optim.lrr=1e-3"])
  with pytest.raises(config_lib.ConfigError, match="tsk"):
    config_lib.load_config(str(REPO / "configs/finetune/glue.py:tsk=rte"))
  with pytest.raises(config_lib.ConfigError, match="mnli2"):
    config_lib.load_config(str(REPO / "configs/finetune/glue.py:task=mnli2"))
  with pytest.raises(config_lib.ConfigError, match="doc_strid"):
    config_lib.load_config(str(REPO / "configs/finetune/squad.py"), ["--config.task_options.doc_strid=64"])
  with pytest.raises(ValueError, match="train.selection"):
    finetune_config.validate(config_lib.load_config(str(REPO / "configs/finetune/glue.py"),
                                                 ["--config.train.selection=worst"]), 1)
  with pytest.raises(ValueError, match="config.train_examples=0"):
    finetune_config.validate(config_lib.load_config(str(REPO / "configs/finetune/glue.py"),
                                                 ["--config.train_examples=0"]), 1)


@pytest.mark.parametrize("spec", ["glue.py:task=mnli", "squad.py:version=2.0", "swag.py", "ner.py:features=last"])
def test_configs_load_and_have_sweeps(spec):
  config = config_lib.load_config(str(REPO / "configs/finetune" / spec))
  module = config_lib._load_module(config_lib.resolve_config_path(str(REPO / "configs/finetune" / spec))[0])
  for overrides in module.get_sweep(spec.partition(":")[2] or None):
    sweep_config = config_lib.load_config(str(REPO / "configs/finetune" / spec),
                                          [f"--config.{key}={value}" for key, value in overrides.items()])
    assert sweep_config.task == config.task


@pytest.mark.shared_data
@pytest.mark.slow
def test_real_rte_featurises_like_transformers(shared_data, minilm_dir):
  transformers = pytest.importorskip("transformers")
  initial = load_initial_model(minilm_dir)
  task = get_task("glue/rte")
  examples = task.load(shared_data / "glue", "train")[:32]
  features = task.featurize(examples, task_tokenizer(initial.tokenizer), 128)
  reference = transformers.AutoTokenizer.from_pretrained(str(minilm_dir))(
      [e.text_a for e in examples], [e.text_b for e in examples], truncation=True, max_length=128)
  for row, ids in enumerate(reference["input_ids"]):
    assert features["lengths"][row] == len(ids)
    assert features["input_ids"][row, :len(ids)].tolist() == ids
    assert features["segment_ids"][row, :len(ids)].tolist() == reference["token_type_ids"][row]
  assert set(features["labels"].tolist()) <= {0, 1}


@pytest.mark.slow
def test_glue_from_tfds_with_mock_data(tiny_model, tmp_path):
  """config.data_dir=tfds reads TFDS glue/* (mocked records): the run trains and scores the dev split."""
  tfds = pytest.importorskip("tensorflow_datasets")
  with tfds.testing.mock_data(num_examples=32, policy=tfds.testing.MockPolicy.USE_CODE):
    results = _finetune("configs/finetune/glue.py:task=rte", tiny_model, f"tfds:{tmp_path / 'tfds'}",
                        tmp_path / "run", "--config.train.epochs=1")
  accuracy = results["summary"]["dev"]["accuracy"]["values"][0]
  assert 0.0 <= accuracy <= 100.0


def test_cli_compilation_cache(tmp_path, monkeypatch):
  from bert_jax import cli

  before = jax.config.jax_compilation_cache_dir
  monkeypatch.setenv("BERT_JAX_COMPILATION_CACHE", str(tmp_path / "xla"))
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  try:
    cli.enable_compilation_cache()
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
  finally:
    jax.config.update("jax_compilation_cache_dir", before)
  monkeypatch.setenv("BERT_JAX_COMPILATION_CACHE", "none")
  cli.enable_compilation_cache()
  assert jax.config.jax_compilation_cache_dir == before


@pytest.mark.slow
def test_runs_of_other_lengths_and_sizes_share_the_compiled_steps(tiny_model, tmp_path):
  """With pad_to_max_len, a run over another number of examples and epochs (another schedule horizon, another
  longest row) runs the steps compiled for the first: the persistent cache serves all of its compilations."""
  data = _glue_sst2(tmp_path / "glue", np.random.default_rng(0))
  before = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # the suite writes slow compilations only
  try:
    runs = [_finetune("configs/finetune/glue.py:task=sst2", tiny_model, data, tmp_path / name,
                      "--config.pad_to_max_len=True", *overrides)
            for name, overrides in (("all", ["--config.train.epochs=1"]),
                                    ("some", ["--config.train.epochs=2", "--config.train_examples=24"]))]
  finally:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)
  assert runs[1]["compile_cache"] == {"requests": 2, "hits": 2}
  rates = []
  for name in ("all", "some"):
    lines = [json.loads(line) for line in (tmp_path / name / "seed_1" / "metrics.jsonl").read_text().splitlines()]
    rates.append([line["train/learning_rate"] for line in lines if "train/learning_rate" in line])
  assert rates[0] != rates[1][:len(rates[0])]  # the schedules differ: their step counts are the state's
  run_info = [json.loads((tmp_path / name / "finetune_run.json").read_text()) for name in ("all", "some")]
  assert run_info[0]["seq_len"] == run_info[1]["seq_len"] == 32


@pytest.mark.slow
def test_cloud_storage_workdir_holds_the_run_and_evaluate_reads_it(tiny_model, tmp_path, gcs_bucket):
  """A gs:// fine-tuning workdir (an emulated bucket): results, per-seed metrics and checkpoint, the tokenizer;
  `evaluate` scores the run from the bucket again."""
  from etils import epath
  data = _glue_sst2(tmp_path / "glue", np.random.default_rng(0))
  workdir = f"{gcs_bucket}/runs/sst2"
  results = _finetune("configs/finetune/glue.py:task=sst2", tiny_model, data, workdir, "--config.train.epochs=1",
                      "--config.train.save_checkpoint=True")
  remote = epath.Path(workdir)
  for name in ("results.json", "results.md", "config.json", "tokenizer", "seed_1/metrics.jsonl",
               "seed_1/result.json", "seed_1/checkpoints"):
    assert (remote / name).exists(), name
  rescored = evaluate_lib.evaluate_run(workdir)
  assert rescored[1]["dev"]["accuracy"] == _selected(results, "accuracy")[0]
  assert not (tmp_path / "gs:").exists() and not (REPO / "gs:").exists()


@pytest.mark.parametrize("kind,num_labels", [("classification", 3), ("tagging", 5)])
@pytest.mark.slow
def test_top_bilstm_sits_between_the_encoder_and_the_head(kind, num_labels):
  """BERT Table 5's "+ BiLSTM": a fresh BiLSTM (hidden/2 a direction) under the head; the encoder's parameters and
  the head's shapes are those of the model without it, and the loss reaches the BiLSTM."""
  from bert_jax.tasks.finetune_model import build_model
  ids = np.ones((2, 3, 8) if kind == "multiple_choice" else (2, 8), np.int32)
  pack_ids = np.concatenate([np.ones(ids.shape[:-1] + (6,), np.int32), np.zeros(ids.shape[:-1] + (2,), np.int32)], -1)
  plain, with_bilstm = (build_model(TINY, kind, num_labels, top_bilstm=flag) for flag in (False, True))
  params = {name: nn.unbox(model.init(jax.random.key(0), ids, pack_ids=pack_ids)["params"])
            for name, model in (("plain", plain), ("bilstm", with_bilstm))}
  assert set(params["bilstm"]) == set(params["plain"]) | {"bilstm"}
  same_shapes = lambda a, b: jax.tree.map(lambda x, y: x.shape == y.shape, a, b)  # noqa: E731
  assert all(jax.tree.leaves(same_shapes(params["plain"]["encoder"], params["bilstm"]["encoder"])))
  assert all(jax.tree.leaves(same_shapes(params["plain"]["head"], params["bilstm"]["head"])))
  outputs = jax.tree.leaves(with_bilstm.apply({"params": params["bilstm"]}, ids, pack_ids=pack_ids))
  assert all(np.all(np.isfinite(out)) for out in outputs)
  grads = jax.jit(jax.grad(lambda p: sum(jax.numpy.sum(out) for out in jax.tree.leaves(
      with_bilstm.apply({"params": p}, ids, pack_ids=pack_ids)))))(params["bilstm"])
  assert any(np.abs(leaf).sum() > 0 for leaf in jax.tree.leaves(grads["bilstm"]))


def test_top_bilstm_is_refused_with_a_feature_based_head():
  from bert_jax.tasks.finetune_model import build_model
  with pytest.raises(ValueError, match="config.top_bilstm adds a BiLSTM in full fine-tuning"):
    build_model(TINY, "tagging", 5, feature_layers=(-1,), top_bilstm=True)
