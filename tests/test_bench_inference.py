"""bench/inference.py's smoke setting: both sides timed on the CPU, the table and the md/json report written."""

import json

import pytest

from conftest import bench_module


@pytest.mark.slow
def test_inference_bench_smoke(tmp_path, capsys):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  bench = bench_module("inference")
  assert bench.main(["--smoke", "--out", str(tmp_path), "--profile", str(tmp_path / "trace"), "--profile-batch",
                     "4", "--plain", "--int8"]) == 0
  report = json.loads((tmp_path / "inference_cpu.json").read_text())
  assert {"jax", "flax", "torch", "transformers"} <= set(report["versions"]) and report["device"] == "cpu"
  assert [(row["model"], row["batch"]) for row in report["rows"]] == [
      (model, batch) for model in ("tiny", "tiny-plain", "tiny-int8") for batch in (1, 4)]
  for row in report["rows"][:2]:
    assert all(row[f"{side}_seq_per_s"] > 0 for side in ("ours", "eager", "compiled"))
  assert all(row["ours_seq_per_s"] > 0 and "compiled_seq_per_s" not in row for row in report["rows"][2:])
  assert report["rows"][0]["ours_p90_ms"] >= report["rows"][0]["ours_p50_ms"] > 0
  assert "ours_profile" not in report["rows"][0] and "matmul kernels" in report["rows"][1]["ours_profile"][1]
  table = capsys.readouterr().out.rstrip().splitlines()
  assert table[-8].startswith("| model | batch | length | ours seq/s | ref eager seq/s | ref compiled seq/s")
  assert "| tiny-int8 | 4 | 32 |" in table[-1]
  assert "| tiny | 1 | 32 |" in (tmp_path / "inference_cpu.md").read_text()
