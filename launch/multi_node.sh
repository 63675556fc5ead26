#!/usr/bin/env bash
# Several nodes with OpenMPI, one process per GPU:
#   launch/multi_node.sh hosts.txt 16 experiment=an4_gpu
# hosts.txt lists one node a line as `name slots=GPUS`. Run from a directory every node sees at the same path.
# Settings from the environment: PYTHON, MPIRUN (may carry options), RUN_NAME, MASTER_ADDR (rank 0's address on the fast network;
# default: the first host), NCCL_SOCKET_IFNAME / NCCL_IB_HCA (which interfaces NCCL uses).
set -euo pipefail
hostfile=${1:?usage: launch/multi_node.sh HOSTFILE NUM_PROCESSES [trainer overrides...]}
num_processes=${2:?usage: launch/multi_node.sh HOSTFILE NUM_PROCESSES [trainer overrides...]}
shift 2
run_name=${RUN_NAME:-$(date +%Y%m%d-%H%M%S)}
export MASTER_ADDR=${MASTER_ADDR:-$(awk 'NF {print $1; exit}' "$hostfile")}

forwarded=(-x PATH -x LD_LIBRARY_PATH -x PYTHONPATH -x MASTER_ADDR -x PRNN_AN4)
for name in $(env | grep -o '^NCCL_[A-Z_]*'); do forwarded+=(-x "$name"); done  # every NCCL_* setting the user made

"${PYTHON:-python3}" -m prnn_kernels.build --if-gpu
# shellcheck disable=SC2086  # MPIRUN is split into the command and its options
exec ${MPIRUN:-mpirun} --hostfile "$hostfile" -np "$num_processes" --bind-to none \
    --map-by ppr:"$(awk 'NF {sub("slots=", "", $2); print $2; exit}' "$hostfile")":node \
    "${forwarded[@]}" \
    "${PYTHON:-python3}" -m trainer run_name="$run_name" "$@"
