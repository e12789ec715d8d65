#!/usr/bin/env bash
# Pretrain on this host with all of its local devices (one process).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

USAGE="Usage: launch/local.sh [--dry-run] CONFIG WORKDIR [--config.KEY=VALUE ...]

  CONFIG   config file with optional args, e.g. configs/bert.py:size=tiny
  WORKDIR  where checkpoints and metrics go; started again with the same
           WORKDIR, the run resumes from its latest checkpoint.

Runs: \$PYTHON -m bert_jax.cli pretrain --config CONFIG --workdir WORKDIR [overrides]
(PYTHON defaults to python3)."
USAGE_HINT="Run 'launch/local.sh --help' for usage."

parse_options "" "$@"
run_arguments "${positional[@]}"

say "pretraining $config on this host (all local devices), workdir $workdir"
unset BERT_JAX_COORDINATOR BERT_JAX_NUM_PROCESSES BERT_JAX_PROCESS_ID BERT_JAX_LOCAL_DEVICE_IDS
run "$PYTHON" -m bert_jax.cli pretrain --config "$config" --workdir "$workdir" "${overrides[@]}"
