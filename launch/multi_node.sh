#!/usr/bin/env bash
# Several nodes with OpenMPI, one process per GPU:
#   launch/multi_node.sh hosts.txt 16 experiment=an4_gpu
# hosts.txt lists one node a line as `name slots=GPUS`, one GPUS for all. Run from a directory every node sees at
# the same path.
# Settings from the environment: PYTHON, MPIRUN (may carry options), RUN_NAME, MASTER_ADDR (rank 0's address on the
# fast network; default: the first host), MASTER_PORT (a free port there, needed without mpi4py, which otherwise
# picks one), NCCL_SOCKET_IFNAME / NCCL_IB_HCA (which interfaces NCCL uses), GLOO_SOCKET_IFNAME (gloo's: device=cpu,
# distributed.share_gpus).
# Ctrl-C, SIGTERM, SIGUSR1 or a closed terminal stops the job after a step, with its checkpoint (launch/mpi_job.sh).
set -euo pipefail
source "$(dirname "$0")/mpi_job.sh"
usage="usage: launch/multi_node.sh HOSTFILE NUM_PROCESSES [trainer overrides...]"
help_if_asked "$usage" "$@"
hostfile=${1-}
num_processes=${2-}
[[ -r $hostfile && ! -d $hostfile ]] || { echo "no readable hostfile '$hostfile'; $usage" >&2; exit 2; }
[[ $num_processes =~ ^[1-9][0-9]*$ ]] || {
    echo "NUM_PROCESSES must be a positive integer, not '$num_processes'; $usage" >&2; exit 2; }
shift 2
run_name=${RUN_NAME:-$(date +%Y%m%d-%H%M%S)}
# A name of dots alone would be runs/ itself or the working directory.
[[ $run_name =~ ^[A-Za-z0-9._+@\ -]+$ && ! $run_name =~ ^\.+$ ]] || {
    echo "RUN_NAME '$run_name': use letters, digits, spaces and ._+@-, not dots alone" >&2; exit 2; }
# The hostfile as OpenMPI's parser reads it: a Windows line end taken off, and each line's comment, from its # on (a
# slots= there was taken for a second count, or for the line's own).
hosts=$(tr -d '\r' < "$hostfile" | sed 's/[[:space:]]*#.*//')
# The first host line, past blank lines and comments: its name and its slots, the processes each node runs, wherever
# the slots= field stands.
first_line=$(awk '!/^[[:space:]]*$/ {print; exit}' <<< "$hosts")
read -r first_host _ <<< "$first_line" || true
first_slots=$(grep -o -E '(^|[[:space:]])slots=[1-9][0-9]*([[:space:]]|$)' <<< "$first_line" |
              tr -d '[:space:]' || true)
[[ -n $first_slots ]] || {
    echo "$hostfile: its first host line must read 'NAME slots=GPUS', got '$first_line'" >&2; exit 2; }
# Every node runs the first line's count of ranks (--map-by below): a later line without a name or that count was
# found out by mpirun after the build, or put more ranks on a node than it has GPUs.
bad_line=$(awk -v slots="$first_slots" '!/^[[:space:]]*$/ &&
    !($1 !~ /=/ && (" " $0 " ") ~ ("[[:space:]]" slots "[[:space:]]")) {print NR ": \047" $0 "\047"; exit}' \
    <<< "$hosts")
[[ -z $bad_line ]] || {
    echo "$hostfile: every host line must read 'NAME $first_slots', the first line's count, line $bad_line" >&2
    exit 2; }
# OpenMPI takes a host listed twice for one node (its slots added up), where --map-by places the first line's count:
# its second line's ranks were counted below, and mpirun found them out after the build.
repeated=$(awk '!/^[[:space:]]*$/ {
    if ($1 in line) {print $1 " is listed twice, lines " line[$1] " and " NR; exit} line[$1] = NR}' <<< "$hosts")
[[ -z $repeated ]] || {
    echo "$hostfile: host $repeated, which OpenMPI takes for one node of ${first_slots#slots=} ranks:" \
         "list each node once" >&2
    exit 2; }
# More ranks than the hosts' slots in all were found out by mpirun, after the check and the build.
host_lines=$(grep -c -v -E '^[[:space:]]*$' <<< "$hosts")
slots_in_all=$(( host_lines * ${first_slots#slots=} ))
(( num_processes <= slots_in_all )) || {
    echo "NUM_PROCESSES $num_processes is more than the $(counted "$slots_in_all" slot) of $hostfile" \
         "($(counted "$host_lines" "host line") of $first_slots)" >&2; exit 2; }
export MASTER_ADDR=${MASTER_ADDR:-$first_host}
require_launcher
# The options below are OpenMPI's: MPICH's mpiexec (which pip's mpich installs as mpirun too) stops on them with a
# parse error of its own.
read -r launcher _ <<< "${MPIRUN:-mpirun}"
if [[ $(launcher_version "$launcher") == *HYDRA* ]]; then
    echo "MPIRUN '${MPIRUN:-mpirun}' is MPICH's launcher: launch/multi_node.sh runs OpenMPI's mpirun (its hostfile," \
         "-x and --map-by); set MPIRUN to OpenMPI's" >&2
    exit 2
fi

# A sweep's -m goes before the script's overrides: Hydra's parser takes the overrides as one run of arguments.
sweep=()
if [[ ${1-} == -m || ${1-} == --multirun ]]; then sweep=("$1"); shift; fi

# What the ranks need on every node, every NCCL_*, GLOO_* and TORCH_NCCL_* setting the user made (the trainer leaves a
# user's TORCH_NCCL_* timeouts as set), and the extension's build folder, which the build below fills on this node:
# each where it is set, as OpenMPI warns of every -x name it does not find ("could not find environment variable").
forwarded=()
for name in PATH LD_LIBRARY_PATH PYTHONPATH MASTER_ADDR MASTER_PORT PRNN_AN4 \
            $(compgen -e | grep -E '^(NCCL_|GLOO_|TORCH_NCCL_|TORCH_EXTENSIONS_DIR$)'); do
    if printenv "$name" > /dev/null; then forwarded+=(-x "$name"); fi
done

# The overrides checked as the trainer checks them, every job of a sweep, before the build and the ranks' start: a
# misspelt key, a value the trainer refuses or a global batch the ranks cannot split evenly is one line and exit code 2
# in seconds (trainer/check_overrides.py).
"${PYTHON:-python3}" -m trainer.check_overrides --world-size "$num_processes" "${sweep[@]}" \
    run_name="'$run_name'" "$@"

"${PYTHON:-python3}" -m prnn_kernels.build --if-gpu
# OpenMPI's hostfile parser takes a Windows line end's \r for a parse error in the hostfile: mpirun, which alone reads
# it, reads a copy without them, removed when this script ends.
if grep -q $'\r' "$hostfile"; then
    lf_hostfile=$(mktemp "${TMPDIR:-/tmp}/hostfile.XXXXXX")
    trap 'rm -f "$lf_hostfile"' EXIT
    tr -d '\r' < "$hostfile" > "$lf_hostfile"
    hostfile=$lf_hostfile
fi
# shellcheck disable=SC2086  # MPIRUN is split into the command and its options
run_mpi_job ${MPIRUN:-mpirun} --hostfile "$hostfile" -np "$num_processes" --bind-to none \
    --map-by ppr:"${first_slots#slots=}":node \
    "${forwarded[@]}" \
    "${PYTHON:-python3}" -m trainer "${sweep[@]}" run_name="'$run_name'" "$@"
