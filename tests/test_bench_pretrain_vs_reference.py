"""bench/pretrain_vs_reference.py's table with `--fp8`: ours in float8 (`model.fp8`) beside ours in bf16 and the
reference, each job stubbed with the JSON it prints (`bench.train_step --json`, the reference script)."""

import pytest

BF16 = {"seq_per_s": 200.0, "mfu": 0.40, "peak_bytes": 2**31, "step_s": 0.5}
FP8 = {"seq_per_s": 300.0, "mfu": 0.60, "peak_bytes": 2**30, "step_s": 0.33}
REFERENCE = {"eager_seq_per_s": 50.0, "compile_seq_per_s": 100.0}


@pytest.fixture
def bench():
  from conftest import bench_module

  return bench_module("pretrain_vs_reference")


def _cells(text: str, model: str) -> dict[str, str]:
  lines = text.splitlines()
  header = next(line for line in lines if line.startswith("| ") and "model" in line)
  row = next(line for line in lines if line.startswith("| ") and model in line)
  return dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in row.split("|")]))


def test_fp8_runs_ours_again_with_the_switch_and_the_table_puts_it_beside_bf16(bench, tmp_path, monkeypatch):
  calls = []
  monkeypatch.setattr(bench, "versions", lambda: {"card": "cpu"})
  monkeypatch.setattr(bench, "reference", lambda *args, **kwargs: dict(REFERENCE))
  monkeypatch.setattr(bench, "ours", lambda *args, **kwargs: calls.append(args) or dict(FP8 if "--config.model.fp8=True"
                                                                                   in args else BF16))
  bench.main(["--rows", "0", "--fp8", "--out-dir", str(tmp_path)])
  assert calls == [("base", 128, 256), ("base", 128, 256, "--config.model.fp8=True")]
  (table,) = tmp_path.glob("*.md")
  cells = _cells(table.read_text(), "bert-base")
  assert (cells["ours seq/s"], cells["ours / compiled"], cells["fp8 seq/s"], cells["fp8 / compiled"]) == (
      "200", "2.00x", "300", "3.00x")
  assert (cells["fp8 / ours bf16"], cells["fp8 MFU (bf16 peak)"], cells["fp8 MFU (fp8 peak)"],
          cells["fp8 peak GiB"]) == ("1.50x", "60.0%", "30.0%", "1.0")


def test_without_fp8_the_table_has_no_fp8_columns_and_a_failed_fp8_job_says_so(bench):
  plain = bench.comparison_table([(("base", 128, 256), dict(BF16), dict(REFERENCE))])
  assert "fp8" not in plain
  failed = bench.comparison_table([(("base", 128, 256), dict(BF16, fp8={"error": ["out of memory"]}),
                                    dict(REFERENCE))])
  assert _cells(failed, "bert-base")["fp8 seq/s"] == "failed"
