# Sourced by single_node.sh and multi_node.sh: `run_mpi_job MPIRUN_COMMAND...` runs the job and ends the script with
# its exit code, so that Ctrl-C, SIGTERM and SIGUSR1 reach the trainer's ranks as signals they stop on cleanly.
# MPICH's mpiexec passes all three on as they are, so it runs in this script's place. OpenMPI's mpirun passes Ctrl-C
# and SIGTERM on as SIGTERM and kills the ranks one second later, before a rank has finished its step and written
# last.pt (2-8 s on the recipes), and passes no SIGUSR1 on (README, Multi-GPU training). So under OpenMPI, mpirun runs
# in a session of its own, which a terminal's Ctrl-C does not reach, and this script passes each signal to the ranks
# mpirun started on this node itself (a closed terminal's SIGHUP as SIGTERM). One rank's signal stops every rank after
# the same step (trainer/stop.py), those on other nodes too. Only the trainer's processes: mpirun's other children are
# its ssh or srun connections to the other nodes. Where this node runs no rank, mpirun gets the signal, as before.
# Should this script be killed outright (SIGKILL), mpirun gets SIGTERM (setpriv --pdeathsig, where util-linux has it)
# rather than run on alone.
run_mpi_job() {
    if ! "$1" --version 2>/dev/null | grep -q "Open MPI"; then
        exec "$@"
    fi
    if setpriv --pdeathsig TERM true 2> /dev/null; then  # an older setpriv lacks the option
        setsid setpriv --pdeathsig TERM "$@" &
    else
        setsid "$@" &
    fi
    local launcher=$! status=0 name interrupted
    for name in INT TERM USR1 HUP; do
        # shellcheck disable=SC2064  # the launcher's pid and the signal's name, fixed now
        trap "interrupted=1; pkill -${name/HUP/TERM} -P $launcher -f ' -m trainer ' ||
              kill -${name/HUP/TERM} $launcher || true" "$name"
    done
    while true; do  # a trapped signal ends a wait early; the next one gets mpirun's exit code
        interrupted=""
        wait "$launcher" || status=$?
        [[ -n $interrupted ]] || break
        status=0
    done
    exit "$status"
}
