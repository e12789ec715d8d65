"""The sweep runner: every row's overrides reach its config, rows run in their own workdirs, table renders."""

import json

from bert_jax.experiments import sweep


def test_sweep_runs_rows_and_renders_table(tmp_path):
  config_file = tmp_path / "exp.py"
  config_file.write_text(
      "from bert_jax.train.config_lib import pretrain_defaults\n"
      "def get_config(arg):\n  return pretrain_defaults()\n"
      "def get_sweep(arg):\n  return [{'masking.granularity': g} for g in ('token', 'span')]\n")
  seen = []

  def fake_run(config, workdir):
    seen.append((config.masking.granularity, config.optim.lr, workdir.name))
    return {"mlm_accuracy": 0.5 if config.masking.granularity == "span" else 0.25, "note": "ignored"}

  rows = sweep.run_sweep(str(config_file), tmp_path / "runs", ["--config.optim.lr=0.5"], run=fake_run)
  assert seen == [("token", 0.5, "masking.granularity=token"), ("span", 0.5, "masking.granularity=span")]
  assert rows == [("masking.granularity=token", {"mlm_accuracy": 0.25}),
                  ("masking.granularity=span", {"mlm_accuracy": 0.5})]
  table = (tmp_path / "runs" / "results.md").read_text()
  assert "| masking.granularity=span | 0.5 |" in table
  assert json.loads((tmp_path / "runs" / "results.json").read_text())["masking.granularity=token"] == {
      "mlm_accuracy": 0.25}
