#!/usr/bin/env bash
# Pretrain across GPU hosts without a scheduler: run this once per process, on
# every host, with the same coordinator and process count and its own id.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"

USAGE="Usage: launch/gpu/multinode.sh --coordinator HOST:PORT --num-processes N --process-id I
           [--local-device-ids 0,1,...] [--nvls-off] [--dry-run] CONFIG WORKDIR [--config.KEY=VALUE ...]

  --coordinator       address of process 0 and a free port on it, reachable from every host
  --num-processes     total number of processes (e.g. one per host)
  --process-id        this process's id, 0..N-1 (process 0 runs on the coordinator host)
  --local-device-ids  GPUs this process uses (default: all GPUs of the host);
                      for one process per GPU, start G processes per host with 0, 1, ...
  --nvls-off          set NCCL_NVLS_ENABLE=0 (NVLink SHARP / multicast off)
  WORKDIR             on storage every host sees (shared filesystem or gs://);
                      started again with the same WORKDIR, the run resumes.

Sets BERT_JAX_COORDINATOR, BERT_JAX_NUM_PROCESSES, BERT_JAX_PROCESS_ID (and
BERT_JAX_LOCAL_DEVICE_IDS), read by bert_jax.parallel.distributed.initialize()."
USAGE_HINT="Run 'launch/gpu/multinode.sh --help' for usage."

coordinator=""
num_processes=""
process_id=""
local_device_ids=""
nvls_off=""
parse_options "--coordinator= --num-processes= --process-id= --local-device-ids= --nvls-off" "$@"
nvls_env=()
if [[ -n "$nvls_off" ]]; then
  nvls_env=(NCCL_NVLS_ENABLE=0)
fi
require "$coordinator" "--coordinator HOST:PORT"
require "$num_processes" "--num-processes"
require "$process_id" "--process-id"
if [[ ! "$coordinator" =~ ^[^:]+:[0-9]+$ ]]; then
  die "--coordinator must be HOST:PORT; got '$coordinator'"
fi
if [[ ! "$num_processes" =~ ^[0-9]+$ ]] || (( num_processes < 1 )); then
  die "--num-processes must be a positive integer; got '$num_processes'"
fi
if [[ ! "$process_id" =~ ^[0-9]+$ ]] || (( process_id >= num_processes )); then
  die "--process-id must be an integer in 0..$((num_processes - 1)); got '$process_id'"
fi
if [[ -n "$local_device_ids" && ! "$local_device_ids" =~ ^[0-9]+(,[0-9]+)*$ ]]; then
  die "--local-device-ids must be comma-separated integers such as 0,1; got '$local_device_ids'"
fi
run_arguments "${positional[@]}"

dist_env=(BERT_JAX_COORDINATOR="$coordinator" BERT_JAX_NUM_PROCESSES="$num_processes"
          BERT_JAX_PROCESS_ID="$process_id")
if [[ -n "$local_device_ids" ]]; then
  dist_env+=(BERT_JAX_LOCAL_DEVICE_IDS="$local_device_ids")
fi
say "process $process_id of $num_processes (coordinator $coordinator${local_device_ids:+, GPUs $local_device_ids}): pretraining $config, workdir $workdir"
run env "${dist_env[@]}" "${nvls_env[@]}" \
  "$PYTHON" -m bert_jax.cli pretrain --config "$config" --workdir "$workdir" "${overrides[@]}"
