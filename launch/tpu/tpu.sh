#!/usr/bin/env bash
# Cloud TPU VM (single host or pod slice): create, set up, run, follow, stop, delete.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"

USAGE="Usage: launch/tpu/tpu.sh COMMAND [options] [--dry-run]

Commands:
  create  --name N --zone Z --project P --accelerator-type T [--version RUNTIME]
          [--spot | --preemptible]
          Create the TPU VM (a pod slice when T has several hosts, e.g. v4-32).
          RUNTIME defaults from T: v2/v3/v4/v5p -> tpu-ubuntu2204-base,
          v5litepod -> v2-alpha-tpuv5-lite, v6e -> v2-alpha-tpuv6e.
  setup   --name N --zone Z --project P [--repo URL [--ref REF]] [--python VERSION]
          Install the project on every worker into ~/bert_jax (venv
          ~/bert_jax_venv, pip install -e '.[tpu]' through uv). Without --repo,
          copies this checkout's HEAD (git archive; uncommitted changes are
          not included); with --repo, git clones URL at REF on every worker.
  run     --name N --zone Z --project P CONFIG gs://BUCKET/WORKDIR [--config.KEY=VALUE ...]
          Start 'bert-jax pretrain' on all workers at once, in the background
          (nohup), appending to ~/bert_jax_pretrain.log on each worker. CONFIG
          is relative to the repository root. The workdir must be on GCS: all
          workers share it and it outlives the VM. Re-running with the same
          workdir resumes from its latest checkpoint (also after preemption).
  logs    --name N --zone Z --project P [--worker W] [--lines L]
          Follow worker W's log (default worker 0, last 100 lines).
  stop    --name N --zone Z --project P
          Stop the run on every worker (SIGTERM to the recorded pid).
  delete  --name N --zone Z --project P
          Delete the TPU VM.

--name, --zone and --project default to \$BERT_JAX_TPU_NAME, \$BERT_JAX_TPU_ZONE
and \$BERT_JAX_TPU_PROJECT. --dry-run prints the exact commands without running them."
USAGE_HINT="Run 'launch/tpu/tpu.sh --help' for usage."

REMOTE_DIR='~/bert_jax'
REMOTE_VENV='~/bert_jax_venv'
REMOTE_LOG='~/bert_jax_pretrain.log'
REMOTE_PID='~/bert_jax_pretrain.pid'

if (( $# == 0 )); then
  echo "$USAGE" >&2
  exit 2
fi
command="$1"
shift
case "$command" in
  -h|--help) echo "$USAGE"; exit 0 ;;
  create|setup|run|logs|stop|delete) ;;
  *) die "unknown command '$command' (expected create, setup, run, logs, stop or delete)" ;;
esac

name="${BERT_JAX_TPU_NAME:-}"
zone="${BERT_JAX_TPU_ZONE:-}"
project="${BERT_JAX_TPU_PROJECT:-}"
accelerator_type=""
version=""
provisioning=""
repo=""
ref=""
python_version="3.11"
worker="0"
lines="100"
parse_options "--name= --zone= --project= --accelerator-type= --version= --repo= --ref= --python=python_version=
               --worker= --lines= --spot=provisioning --preemptible=provisioning" "$@"

require "$name" "--name (or \$BERT_JAX_TPU_NAME)"
require "$zone" "--zone (or \$BERT_JAX_TPU_ZONE)"
require "$project" "--project (or \$BERT_JAX_TPU_PROJECT)"
if [[ "$command" != run ]] && (( ${#positional[@]} )); then
  die "unexpected argument '${positional[0]}' for '$command'"
fi
require_command gcloud
location=(--zone="$zone" --project="$project")

# ssh_workers WORKERS REMOTE_COMMAND: run a shell command on TPU workers.
ssh_workers() {
  run gcloud compute tpus tpu-vm ssh "$name" "${location[@]}" --worker="$1" --command="$2"
}

default_runtime() {
  case "$1" in
    v2-*|v3-*|v4-*|v5p-*) echo tpu-ubuntu2204-base ;;
    v5litepod-*|v5e-*) echo v2-alpha-tpuv5-lite ;;
    v6e-*) echo v2-alpha-tpuv6e ;;
  esac
}

case "$command" in
  create)
    require "$accelerator_type" "--accelerator-type (e.g. v4-32, v5litepod-16, v6e-8)"
    if [[ ! "$accelerator_type" =~ ^v[0-9][a-z0-9]*-[0-9]+$ ]]; then
      die "--accelerator-type '$accelerator_type' is not of the form v4-32, v5litepod-16, v6e-8"
    fi
    version="${version:-$(default_runtime "$accelerator_type")}"
    require "$version" "--version (no default runtime known for $accelerator_type)"
    say "creating TPU VM $name ($accelerator_type, runtime $version${provisioning:+, ${provisioning#--}}) in $zone, project $project"
    run gcloud compute tpus tpu-vm create "$name" "${location[@]}" \
      --accelerator-type="$accelerator_type" --version="$version" ${provisioning:+"$provisioning"}
    ;;
  setup)
    if [[ -n "$ref" && -z "$repo" ]]; then
      die "--ref needs --repo"
    fi
    install="curl -LsSf https://astral.sh/uv/install.sh | sh"
    install+=" && rm -rf $REMOTE_VENV && ~/.local/bin/uv venv --python $python_version $REMOTE_VENV"
    install+=" && cd $REMOTE_DIR && ~/.local/bin/uv pip install --python $REMOTE_VENV/bin/python -e \".[tpu]\""
    if [[ -n "$repo" ]]; then
      say "installing $repo${ref:+ at $ref} on every worker of $name"
      fetch="rm -rf $REMOTE_DIR && git clone $(quote "$repo") $REMOTE_DIR"
      if [[ -n "$ref" ]]; then
        fetch+=" && git -C $REMOTE_DIR checkout $(quote "$ref")"
      fi
    else
      archive="${TMPDIR:-/tmp}/bert_jax-$name.tar.gz"
      say "copying this checkout's HEAD ($REPO_ROOT) to every worker of $name and installing it"
      if [[ -n "$(git -C "$REPO_ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ]]; then
        echo "warning: uncommitted changes in $REPO_ROOT are not copied (git archive HEAD)" >&2
      fi
      run git -C "$REPO_ROOT" archive --format=tar.gz --output="$archive" HEAD
      run gcloud compute tpus tpu-vm scp "$archive" "$name:bert_jax.tar.gz" "${location[@]}" --worker=all
      fetch="rm -rf $REMOTE_DIR && mkdir -p $REMOTE_DIR && tar -xzf ~/bert_jax.tar.gz -C $REMOTE_DIR"
    fi
    ssh_workers all "set -e; $fetch && $install"
    ;;
  run)
    config="${positional[0]:-}"
    workdir="${positional[1]:-}"
    (cd "$REPO_ROOT" && check_config "$config" warn)  # CONFIG is relative to the repository
    require "$workdir" "WORKDIR (gs://BUCKET/PATH)"
    require_gcs_workdir "$workdir" "for a TPU VM: all workers share it and it survives preemption"
    overrides=("${positional[@]:2}")
    check_overrides "${overrides[@]}"
    say "starting $config on all workers of $name, workdir $workdir, log $REMOTE_LOG on each worker"
    trainer="$REMOTE_VENV/bin/python -m bert_jax.cli pretrain $(quote_all --config "$config" --workdir "$workdir" "${overrides[@]}")"
    # \$! must be the trainer's pid (nohup execs it), so the background job is
    # the nohup command alone, not an && list.
    ssh_workers all "if [ -f $REMOTE_PID ] && kill -0 \$(cat $REMOTE_PID) 2>/dev/null; then echo \"a run is already going on this worker; stop it first\" >&2; exit 1; fi; cd $REMOTE_DIR || exit 1; nohup $trainer >> $REMOTE_LOG 2>&1 < /dev/null & echo \$! > $REMOTE_PID"
    ;;
  logs)
    if [[ ! "$worker" =~ ^[0-9]+$ ]]; then
      die "--worker must be a worker number; got '$worker'"
    fi
    if [[ ! "$lines" =~ ^[0-9]+$ ]]; then
      die "--lines must be a number; got '$lines'"
    fi
    say "following the log of worker $worker of $name (Ctrl-C stops following, not the run)"
    ssh_workers "$worker" "tail -n $lines -F $REMOTE_LOG"
    ;;
  stop)
    say "stopping the run on every worker of $name"
    ssh_workers all "if [ -f $REMOTE_PID ]; then kill \$(cat $REMOTE_PID) 2>/dev/null || true; rm -f $REMOTE_PID; fi"
    ;;
  delete)
    say "deleting TPU VM $name in $zone, project $project"
    run gcloud compute tpus tpu-vm delete "$name" "${location[@]}" --quiet
    ;;
esac
