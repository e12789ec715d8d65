"""Summarises an Nsight Compute profile's per-instruction warp-stall samples by code region.

  ncu --kernel-name regex:mosaic --launch-skip 1 --launch-count 1 --set full -o fwd \\
    python -m bench.ffn_gemm --shapes 32768x768x3072 --once forward
  ncu --import fwd.ncu-rep --page source --csv --print-source sass > fwd_source.csv
  python -m bench.ncu_regions fwd_source.csv[.gz]

A region is a run of consecutive SASS instructions executed equally often (a basic block, roughly: in the FFN
kernels the memory warpgroup's barrier loops, the compute warpgroups' main loop, the unrolled epilogue). Per
region: its share of all warp-state samples, its instruction count, most frequent opcodes and the stall reasons
of its samples; then the kernel's totals by stall reason and by opcode. Samples are taken per warp, so a
region's share is the time warps spend there, not the time the SM spends: in a warp-specialised kernel, compare
the compute warpgroups' regions with each other.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re
from typing import Any

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read(path: str) -> tuple[list[str], list[list[str]]]:
  """The header and instruction rows of `ncu --page source --csv` output (plain or gzip)."""
  with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as handle:
    rows = list(csv.reader(handle))
  start = next((i for i, row in enumerate(rows) if SAMPLES in row), None)
  if start is None:
    raise ValueError(f"{path}: no '{SAMPLES}' column; expected `ncu --page source --csv` output of a --set full "
                     "profile")
  header = rows[start]
  return header, [row for row in rows[start + 1:] if len(row) == len(header)]


def opcode(source: str) -> str:
  """'@!P1 BRA 0x...' -> 'BRA'; 'HGMMA.64x128x16.F32 ...' -> 'HGMMA'."""
  text = re.sub(r"^@!?U?P\w+\s+", "", source.strip())
  return text.split(" ")[0].split(".")[0] if text else "?"


def regions(header: list[str], rows: list[list[str]]) -> tuple[list[dict[str, Any]], collections.Counter, int]:
  column = {name: i for i, name in enumerate(header)}
  stalls = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]
  out: list[dict[str, Any]] = []
  totals: collections.Counter = collections.Counter()
  for row in rows:
    executed = int(row[column[EXECUTED]] or 0)
    if not out or out[-1]["executed"] != executed:
      out.append(dict(address=row[column["Address"]], executed=executed, instructions=0, samples=0,
                      opcodes=collections.Counter(), stalls=collections.Counter()))
    region = out[-1]
    region["instructions"] += 1
    region["samples"] += int(row[column[SAMPLES]] or 0)
    region["opcodes"][opcode(row[column["Source"]])] += 1
    for name in stalls:
      count = int(row[column[name]] or 0)
      region["stalls"][name[len("stall_"):]] += count
      totals[name[len("stall_"):]] += count
  return out, totals, sum(region["samples"] for region in out)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("csv", help="`ncu --page source --csv --print-source sass` output, optionally gzipped")
  parser.add_argument("--min-share", type=float, default=0.4, help="hide regions under this %% of the samples")
  args = parser.parse_args()
  header, rows = read(args.csv)
  found, totals, total = regions(header, rows)
  if not total:
    raise SystemExit(f"{args.csv}: no warp-state samples (profile with --set full or --section SourceCounters)")
  print(f"{len(rows)} instructions, {total} warp-state samples")
  print("region   executed  instructions  share  most frequent opcodes / stall reasons")
  for region in found:
    share = 100 * region["samples"] / total
    if share < args.min_share:
      continue
    ops = " ".join(f"{name} {n}" for name, n in region["opcodes"].most_common(5))
    why = " ".join(f"{name} {n}" for name, n in region["stalls"].most_common(4))
    print(f"{region['address'][-6:]} {region['executed']:10d} {region['instructions']:13d} {share:5.1f}%  "
          f"{ops}  /  {why}")
  reasons = ", ".join(f"{name} {100 * n / total:.1f}%" for name, n in totals.most_common(8))
  print(f"stall reasons, all samples: {reasons}")
  by_opcode: collections.Counter = collections.Counter()
  for region in found:
    for name, n in region["opcodes"].items():
      by_opcode[name] += n
  print("SASS opcodes (static count): " + ", ".join(f"{name} {n}" for name, n in by_opcode.most_common(12)))


if __name__ == "__main__":
  main()
