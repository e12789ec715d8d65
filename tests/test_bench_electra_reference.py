"""bench/electra_vs_reference.py writes its reference from numbers of its own: they must stay ours' at each scale."""

import pathlib

import pytest

from bert_jax.models import electra_generator_config
from bert_jax.models.config import ModelConfig
from bert_jax.train import config_lib
from test_trainer import prepared  # noqa: F401 - the session fixture (prepared built-in corpus)

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
  from conftest import bench_module

  return bench_module("electra_vs_reference")


# Table 5's rows (the bench's --rtd-positions masked is its ELECTRA 15%) share Table 1's sizes and recipe.
@pytest.mark.parametrize("table", ["electra_compute", "electra_variants"])
@pytest.mark.parametrize("scale", ["tiny", "gpu"])
def test_reference_sizes_and_recipe_are_the_configs(bench, scale, table):
  size = bench.SCALES[scale]
  config = config_lib.load_config(f"{REPO}/configs/ablations/{table}.py:scale={scale}")
  model = config.model
  assert (size["layers"], size["hidden"], size["heads"], size["ffn"], size["embed"], size["positions"]) == (
      model.num_layers, model.hidden_size, model.num_heads, model.intermediate_size, model.embedding_size,
      model.max_position_embeddings)
  assert config.loss.rtd_weight == 50.0 and config.loss.generator_weight == 1.0
  if scale == "gpu":  # at scale tiny the bench sets these itself (`ours_command`)
    assert (size["lr"], size["warmup"], size["batch"], size["seq"], size["max_predictions"], size["steps"]) == (
        config.optim.lr, config.optim.warmup_steps, config.train.batch_size, config.data.seq_len,
        config.masking.max_predictions, config.train.steps)


@pytest.mark.parametrize("scale", ["tiny", "gpu"])
@pytest.mark.parametrize("fraction", [0.125, 0.25, 1 / 3, 0.5, 1.0])
def test_reference_generator_follows_the_generator_rule(bench, scale, fraction):
  size = bench.SCALES[scale]
  discriminator = ModelConfig(vocab_size=100, hidden_size=size["hidden"], num_layers=size["layers"],
                              num_heads=size["heads"], intermediate_size=size["ffn"], embedding_size=size["embed"])
  generator = electra_generator_config(discriminator, fraction)
  assert bench.generator_sizes(size, fraction) == (generator.hidden_size, generator.num_heads,
                                                   generator.intermediate_size)


def test_the_table_shows_each_sides_columns_with_the_masked_positions_accuracy(bench):
  ours = {100: {"mlm_accuracy": 0.036, "replaced": 0.16, "rtd_loss": 0.473, "rtd_accuracy": 0.84, "grad_norm": 3.2}}
  theirs = {100: {"mlm_accuracy": 0.031, "replaced": 0.143, "rtd_loss": 0.4659, "rtd_accuracy": 0.857,
                  "grad_norm": 2.914},
            200: {"mlm_accuracy": 0.05, "replaced": 0.1, "rtd_loss": 0.3, "rtd_accuracy": 0.9, "grad_norm": 1.0}}
  every = bench.table(ours, theirs, "T").splitlines()
  assert every[2].startswith("| step | ours MLM acc | ours replaced | ours RTD loss | ours grad norm | constant's | "
                             "reference MLM acc")
  assert every[4] == "| 100 | 0.036 | 0.160 | 0.4730 | 3.20 | 0.4397 | 0.031 | 0.143 | 0.4659 | 2.91 | 0.4104 |"
  assert len(every) == 5  # the steps both sides reached
  masked = bench.table(ours, theirs, "T", "masked").splitlines()
  assert masked[2] == ("| step | ours MLM acc | ours RTD acc | ours RTD loss | ours grad norm | reference MLM acc | "
                       "reference replaced | reference RTD acc | reference RTD loss | reference grad norm | constant's |")
  assert masked[4] == "| 100 | 0.036 | 0.840 | 0.4730 | 3.20 | 0.031 | 0.143 | 0.857 | 0.4659 | 2.91 | 0.4104 |"


@pytest.mark.slow
def test_the_reference_stopped_at_a_deadline_goes_on_exactly_from_its_saved_state(bench, prepared, tmp_path):
  """A reference cut short (its deadline already past: it stops after the first interval) and run again with the
  same state file reaches the uninterrupted run's every number; run once more, it trains nothing."""
  pytest.importorskip("torch", reason="the reference trains on PyTorch: the torch tier, pip install -e '.[test,hf]'")
  from tokenizers import Tokenizer

  tokenizer = prepared.parent / "tokenizer" / "tokenizer.json"
  vocab = Tokenizer.from_file(str(tokenizer)).get_vocab_size()
  run = lambda **kwargs: bench.reference(prepared, tokenizer, vocab, "tiny", 40, 10, 0.25, **kwargs)  # noqa: E731
  whole, reached = run()
  assert reached == 40 and sorted(whole) == [10, 20, 30, 40]
  state = tmp_path / "reference_state.pt"
  first, reached = run(stop_at=0.0, state_file=state)
  assert reached == 10 and first == {10: whole[10]}
  rest, reached = run(state_file=state, save=tmp_path / "saved")
  assert reached == 40 and rest == whole and (tmp_path / "saved" / "config.json").exists()
  assert run(state_file=state) == (whole, 40)


def test_ours_config_overrides_reach_ours_pretraining_alone(bench, tmp_path):
  command = bench.ours_command(tmp_path / "ours", "gpu", 3000, 100, 0.25, tmp_path / "wiki", "masked",
                               ["model.dtype=float32"])
  assert command[-1] == "--config.model.dtype=float32"  # after the bench's own settings, so it wins
  spec = command[command.index("--config") + 1]
  overrides = [flag.removeprefix("--config.") for flag in command if flag.startswith("--config.")]
  config = config_lib.load_config(spec, overrides)
  assert config.model.dtype == "float32" and config.loss.rtd_positions == "masked"


@pytest.mark.slow
def test_an_unknown_ours_config_key_is_one_line_before_any_training():
  import subprocess
  import sys

  result = subprocess.run([sys.executable, "-m", "bench.electra_vs_reference", "--ours-config", "model.dtyp=float32"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
  assert result.returncode == 2 and "Traceback" not in result.stderr
  assert "--ours-config model.dtyp=float32: unknown config key 'model.dtyp'" in result.stderr.splitlines()[-1]
