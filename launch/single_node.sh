#!/usr/bin/env bash
# One node, N GPUs, one process per GPU:
#   launch/single_node.sh 8 experiment=an4_gpu model.backend=persistent
# Settings from the environment: PYTHON (default python3), MPIRUN (default mpirun; may carry options, e.g.
# MPIRUN="mpirun -x NCCL_DEBUG"), RUN_NAME (default: now).
# Ctrl-C, SIGTERM, SIGUSR1 or a closed terminal stops the job after a step, with its checkpoint (launch/mpi_job.sh).
set -euo pipefail
source "$(dirname "$0")/mpi_job.sh"
usage="usage: launch/single_node.sh NUM_GPUS [trainer overrides...]"
help_if_asked "$usage" "$@"
num_gpus=${1-}
# Else a forgotten count takes the first override's place: mpirun would start one rank without it.
[[ $num_gpus =~ ^[1-9][0-9]*$ ]] || { echo "NUM_GPUS must be a positive integer, not '$num_gpus'; $usage" >&2; exit 2; }
shift
run_name=${RUN_NAME:-$(date +%Y%m%d-%H%M%S)}  # fixed here once, so every rank writes to and resumes from one run dir
# The name becomes a Hydra override and a folder: '=', ',' or brackets in it would end every rank in a parse error.
# A name of dots alone would be runs/ itself or the working directory.
[[ $run_name =~ ^[A-Za-z0-9._+@\ -]+$ && ! $run_name =~ ^\.+$ ]] || {
    echo "RUN_NAME '$run_name': use letters, digits, spaces and ._+@-, not dots alone" >&2; exit 2; }
require_launcher

# A sweep's -m goes before the script's overrides: Hydra's parser takes the overrides as one run of arguments.
sweep=()
if [[ ${1-} == -m || ${1-} == --multirun ]]; then sweep=("$1"); shift; fi

# The overrides checked as the trainer checks them, every job of a sweep, before the build and the ranks' start: a
# misspelt key, a value the trainer refuses or a global batch the ranks cannot split evenly is one line and exit code 2
# in seconds (trainer/check_overrides.py).
"${PYTHON:-python3}" -m trainer.check_overrides --world-size "$num_gpus" "${sweep[@]}" run_name="'$run_name'" "$@"

# Build the CUDA extension once before the ranks start, instead of every rank waiting on the build lock.
"${PYTHON:-python3}" -m prnn_kernels.build --if-gpu

# --bind-to none: each rank's data-loading workers may use any core of the node.
# shellcheck disable=SC2086  # MPIRUN is split into the command and its options
run_mpi_job ${MPIRUN:-mpirun} -np "$num_gpus" --bind-to none \
    "${PYTHON:-python3}" -m trainer "${sweep[@]}" run_name="'$run_name'" "$@"
