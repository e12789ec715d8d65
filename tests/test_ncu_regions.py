"""bench/ncu_regions.py reads Nsight Compute's source-page CSV and groups its stall samples by code region."""

from __future__ import annotations


import pytest

from conftest import bench_module

ncu_regions = bench_module("ncu_regions")

_HEADER = ['"Address"', '"Source"', '"Warp Stall Sampling (All Samples)"', '"Instructions Executed"',
           '"stall_barrier"', '"stall_long_sb"', '"stall_barrier (Not Issued)"']


def _csv(tmp_path, rows):
  lines = ['"Kernel Name","k",', ",".join(_HEADER)]
  lines += [",".join(f'"{v}"' for v in row) for row in rows]
  path = tmp_path / "source.csv"
  path.write_text("\n".join(lines) + "\n")
  return str(path)


def test_regions_group_equally_executed_runs(tmp_path):
  path = _csv(tmp_path, [
      ("0x10", "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR8], R5", 2, 100, 0, 2, 0),
      ("0x20", "@!P1  BRA 0x90", 8, 100, 0, 8, 0),
      ("0x30", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24", 5, 400, 1, 0, 0),
      ("0x40", "FMUL R1, R2, R3", 5, 400, 4, 0, 0),
  ])
  header, rows = ncu_regions.read(path)
  found, totals, total = ncu_regions.regions(header, rows)
  assert total == 20 and [r["samples"] for r in found] == [10, 10] and [r["executed"] for r in found] == [100, 400]
  assert found[0]["opcodes"] == {"SYNCS": 1, "BRA": 1} and found[1]["opcodes"] == {"HGMMA": 1, "FMUL": 1}
  assert totals == {"long_sb": 10, "barrier": 5}  # the "(Not Issued)" columns are not counted twice


def test_a_file_without_samples_names_itself(tmp_path):
  path = tmp_path / "details.csv"
  path.write_text('"ID","Metric Name"\n"0","Duration"\n')
  with pytest.raises(ValueError, match="details.csv"):
    ncu_regions.read(str(path))
