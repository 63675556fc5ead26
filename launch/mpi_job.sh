# Sourced by single_node.sh and multi_node.sh: `run_mpi_job MPIRUN_COMMAND...` runs the job and ends the script with
# its exit code, so that Ctrl-C, SIGTERM, SIGUSR1 and a closed terminal's SIGHUP reach the trainer's ranks as signals
# they stop on cleanly (SIGHUP as SIGTERM). The launcher runs in a session of its own, which a terminal's signals do
# not reach, and this script passes each signal on once. MPICH's mpiexec passes all three on to the ranks as they
# are, so it gets them. OpenMPI's mpirun passes Ctrl-C and SIGTERM on as SIGTERM and kills the ranks one second later,
# before a rank has finished its step and written last.pt (2-8 s on the recipes), and passes no SIGUSR1 on (README,
# Multi-GPU training), so under OpenMPI this script passes each signal to the ranks mpirun started on this node
# itself: only the trainer's processes, as mpirun's other children are its ssh or srun connections to other nodes.
# One rank's signal stops every rank after the same step (trainer/stop.py), those on other nodes too. Where this node
# runs no rank, mpirun gets the signal. Should this script be killed outright (SIGKILL), the launcher gets SIGTERM
# (setpriv --pdeathsig, where util-linux has it) rather than run on alone.
run_mpi_job() {
    local open_mpi=""
    # OpenMPI's mpirun says "Open MPI", its mpiexec "OpenRTE".
    if [[ $(launcher_version "$1") =~ Open\ MPI|OpenRTE ]]; then
        open_mpi=1
    fi
    if setpriv --pdeathsig TERM true 2> /dev/null; then  # an older setpriv lacks the option
        setsid setpriv --pdeathsig TERM "$@" &
    else
        setsid "$@" &
    fi
    local launcher=$! status=0 name signal interrupted
    for name in INT TERM USR1 HUP; do
        signal=${name/HUP/TERM}
        # shellcheck disable=SC2064  # the launcher's pid and the signal's name, fixed now
        if [[ -n $open_mpi ]]; then
            trap "interrupted=1; pkill -$signal -P $launcher -f ' -m trainer ' || kill -$signal $launcher || true" \
                "$name"
        elif [[ $name == INT ]]; then
            trap "interrupted=1; pass_ctrl_c_on_under_mpich $launcher" INT
        else
            trap "interrupted=1; kill -$signal $launcher || true" "$name"
        fi
    done
    while true; do  # a trapped signal ends a wait early; the next one gets the launcher's exit code
        interrupted=""
        wait "$launcher" || status=$?
        [[ -n $interrupted ]] || break
        status=0
    done
    exit "$status"
}

# MPICH's mpiexec passes a first Ctrl-C on to the ranks, but takes a second as an order to kill the job at once, before
# a rank can say what it holds: from the second on, this node's ranks (the children of mpiexec's proxies) get it
# themselves, and the first to get it ends the job (trainer/__main__.py: one line naming the last checkpoint, exit 130).
# Where no rank runs (not started yet, or all ended), there is nothing to say, and mpiexec gets it. No early `return`
# here: in a trap it returns the status of the command the trap cut short (the wait's 130), which set -e exits on.
mpich_ctrl_c_passed=""
pass_ctrl_c_on_under_mpich() {
    local launcher=$1 proxies
    if [[ -z $mpich_ctrl_c_passed ]]; then
        mpich_ctrl_c_passed=1
        kill -INT "$launcher" || true
    else
        proxies=$(pgrep -d, -P "$launcher") || true
        if [[ -z $proxies ]] || ! pkill -INT -P "$proxies" -f ' -m trainer '; then
            kill -INT "$launcher" || true
        fi
    fi
}

# `require_launcher`: the launcher MPIRUN names (its first word; default mpirun) is on PATH, or one line naming it and
# exit code 127, before the script builds the extension (a minute on a GPU node) only to find no MPI; and rather than
# setpriv's "failed to execute", which names neither MPI nor MPIRUN.
require_launcher() {
    local launcher
    read -r launcher _ <<< "${MPIRUN:-mpirun}"
    if ! command -v "$launcher" > /dev/null; then
        echo "no MPI launcher '$launcher' on PATH: install MPI (OpenMPI, or MPICH: pip install mpich) or set MPIRUN" >&2
        exit 127
    fi
}

# What `LAUNCHER --version` prints, read to the end: piped into `grep -q` under pipefail, a launcher still writing
# when grep had its match died of SIGPIPE, and at random went unrecognised.
launcher_version() {
    "$1" --version 2> /dev/null || true
}

# `help_if_asked "$usage" "$@"`: where any of the script's arguments is -h or --help, its usage and its header comment
# (an example, the settings it reads from the environment) on stdout, and exit 0, before a count's check takes the
# flag for a count. Among the overrides too: the check of the overrides answered it with its own help, exit code 0, and
# every rank of the job then printed the trainer's.
help_if_asked() {
    local usage=$1 argument
    shift
    for argument in "$@"; do
        if [[ $argument == -h || $argument == --help ]]; then
            echo "$usage"
            sed -n '2,/^set /s/^# \{0,1\}//p' "$0"
            exit 0
        fi
    done
}

# `counted COUNT NOUN`: '1 host line', '2 host lines', a count and its noun as the Python side words one
# (data.text.counted).
counted() {
    if (( $1 == 1 )); then echo "$1 $2"; else echo "$1 $2s"; fi
}
