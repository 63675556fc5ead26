"""Which rank this process is and which GPU it takes, as the launcher that started it says: read from its variables
alone, without MPI or torch, so that the trainer's first checks, Hydra's refusals and the run directory's callback can
ask before any process group exists (trainer.distributed starts it).

Rank, world size, local rank and the ranks on the node come from the variables of the first launcher (OpenMPI,
MPICH/PMI, PMIx, SLURM: LAUNCHER_VARIABLES) that says it started this process as one of several. A process started
without a launcher is a world of one, unless torchrun's WORLD_SIZE says it is one of several: refused. So is a variable
that holds no whole number, a count of 0, a rank past its count, and a launcher's count or rank that MPI's, once it
starts, contradicts.

Each rank takes its node's GPU of its local rank. More ranks on a node than GPUs is refused unless share_gpus allows
it: then local rank r takes GPU r mod the GPU count.
"""
import os
import sys

from data.text import counted

# (rank, size, local rank, ranks on the node) variables of each launcher, checked in order.
LAUNCHER_VARIABLES = [
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH (hydra), Intel MPI
    ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),  # PMIx launchers
    # srun: its step's task count, not SLURM_NTASKS, which a batch script or salloc shell holds too, where a process
    # started without srun is a world of one.
    ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
]
AS_A_LAUNCHER_SETS_IT = ("as an MPI launcher sets it: start the processes with launch/single_node.sh N (mpirun) or "
                         "srun, which set it, or unset it")


def _launcher_number(name: str, default: int | None) -> int | None:
    """Launcher variable `name` as the whole number it holds, `default` where it is unset or empty (a variable cleared,
    export NAME=); ValueError naming it and its value where it holds no whole number."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if not (value.isascii() and value.isdigit()):
        raise ValueError(f"{name}={value} is no whole number, {AS_A_LAUNCHER_SETS_IT}")
    return int(value)


def _launcher_count(name: str) -> int | None:
    """Launcher variable `name`, a count of processes (a launch's or a node's), as the number it holds, None where it
    is unset or empty; ValueError naming it and its value where it holds 0, which no launcher sets: a launch's size of
    0 ran as a world of one (where WORLD_SIZE=0 was refused), and a node's was taken for none given."""
    count = _launcher_number(name, None)
    if count == 0:
        raise ValueError(f"{name}={os.environ[name].strip()} is no count of processes (a whole number above 0), "
                         f"{AS_A_LAUNCHER_SETS_IT}")
    return count


def _launcher_variables() -> tuple[str, str, str, str] | None:
    """The variable names (LAUNCHER_VARIABLES) of the launcher that started this process with size > 1."""
    for names in LAUNCHER_VARIABLES:
        if (_launcher_count(names[1]) or 1) > 1:
            return names
    return None


def launched_by_mpi() -> bool:
    return _launcher_variables() is not None


def launcher_rank() -> int:
    """This process's rank as the launcher set it (0 without one); readable before and after the process group."""
    names = _launcher_variables()
    return _rank_of_launch(*names[:2]) if names else 0


def launcher_world_size() -> int:
    """How many ranks the launcher started (1 without one), as launcher_rank reads its rank: before MPI starts, for
    what a job's every rank must be checked against before it begins (a sweep's global batch sizes)."""
    names = _launcher_variables()
    return _launcher_count(names[1]) if names else 1


def _rank_of_launch(rank_name: str, size_name: str) -> int:
    """This process's rank in variable `rank_name`, where `size_name` says a launcher started it as one of several;
    ValueError naming both where it holds none."""
    if not os.environ.get(rank_name, "").strip():
        raise ValueError(f"{rank_name} is unset or empty, where {size_name}={os.environ[size_name].strip()} says a "
                         f"launcher started this process as one of several: unset {size_name}, or start the processes "
                         "with launch/single_node.sh N (mpirun) or srun")
    return _launcher_number(rank_name, 0)


def rank_tag() -> str:
    """"[rank N] " on a rank other than 0, as its log lines are tagged (trainer.__main__.leave_the_log_to_rank_0), for
    the lines a rank prints before its log is set up: every rank refuses a bad override alike, and rank 1's line read
    as a second refusal of the job's. "" on rank 0 and without a launcher, and where a launcher's variables name no
    rank (refuse_unusable_launch's refusals): trainer.check_overrides runs in the launch script's shell, whose leftover
    variables are not the ranks' (mpirun and srun set their own), and a bad one there (PMI_SIZE=abc) ended the line it
    tags, a misspelt key's, in a traceback about that variable."""
    try:
        rank = launcher_rank()
    except ValueError:
        return ""
    return f"[rank {rank}] " if rank else ""


def ranks_from_launcher() -> tuple[int, int, int, int]:
    """(rank, world size, local rank, ranks on this node); where the launcher does not say how many ranks share the
    node, at least this one and those of lower local rank do."""
    rank_name, size_name, local_name, local_size_name = _launcher_variables()
    rank, size = _rank_of_launch(rank_name, size_name), _launcher_count(size_name)
    local_rank, local_size = _launcher_number(local_name, 0), _launcher_count(local_size_name)
    _check_rank_within(rank_name, rank, size_name, size)
    if local_size is None:
        return rank, size, local_rank, local_rank + 1
    _check_rank_within(local_name, local_rank, local_size_name, local_size)
    return rank, size, local_rank, local_size


def _check_rank_within(rank_name: str, rank: int, size_name: str, size: int) -> None:
    """ValueError naming both variables where rank `rank` is none of the `size` a launcher numbers 0 to size - 1: no
    launcher sets that, and without mpi4py the rank waited out the rendezvous's timeout for a world it is not in."""
    if rank >= size:
        raise ValueError(f"{rank_name}={rank} is no rank of {size_name}={size} processes, which a launcher numbers 0 "
                         f"to {size - 1}: they are left over from a launcher that did not start this process, or set "
                         "by hand; unset them, or start the processes with launch/single_node.sh N (mpirun) or srun")


def check_not_one_of_torchruns_ranks() -> None:
    """ValueError where torchrun's WORLD_SIZE (or a hand-made one) says this process is one of several but no MPI
    launcher's variables do: the ranks come from MPI alone, and each such process trained as a world of one, every
    one of them the whole run on its own. A WORLD_SIZE that is no count (0, abc) is refused as that."""
    size = os.environ.get("WORLD_SIZE", "").strip()
    if not size or launched_by_mpi():
        return
    if not size.isdecimal() or int(size) < 1:
        raise ValueError(f"WORLD_SIZE={size} is no count of processes (a whole number above 0), and the ranks come "
                         "from MPI: unset WORLD_SIZE")
    if int(size) > 1:
        raise ValueError(f"WORLD_SIZE={size} says this process is one of several, as torchrun starts them, but "
                         "the ranks come from MPI, and each process would train alone: start them with "
                         "launch/single_node.sh N (mpirun) or srun, or unset WORLD_SIZE")


def refuse_unusable_launch() -> None:
    """A program's first step (the trainer's, the benchmarks'): check_not_one_of_torchruns_ranks's refusal, or that of
    a launcher's variable holding no whole number, a count of 0 or a rank past its count, as "error: ..." and exit
    code 2, before the program names a rank or writes anything (the trainer's Hydra, a run directory). Every one of
    torchrun's processes prints it, and none is a rank of ours: launcher_rank, which finds no MPI launcher, would call
    each rank 0; nor can a rank be named from a variable that holds none, or one that no launcher would set."""
    try:
        check_not_one_of_torchruns_ranks()
        if launched_by_mpi():
            ranks_from_launcher()
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


def check_mpi_sees_the_launchers_ranks(rank: int, world_size: int) -> None:
    """ValueError where MPI's `rank` or `world_size` is not the launcher's variables': with another size each process
    would train alone, all into one run directory; with another rank (a launcher's variables left over whose count
    matches) the rank the log and the error lines go by (launcher_rank) is not the process group's, and two ranks
    wrote the log as rank 0."""
    rank_name, size_name = _launcher_variables()[:2]
    launched_rank, launched_size = ranks_from_launcher()[:2]
    if world_size != launched_size:
        raise ValueError(
            f"MPI sees {world_size} process(es) where the launcher started {launched_size} "
            f"({size_name}={launched_size}): the MPI library mpi4py loaded is not the launcher's (under srun, "
            f"match --mpi / SRUN_MPI to it), or {size_name} is left over from a launcher that did not start "
            "this process (unset it)"
        )
    if rank != launched_rank:
        raise ValueError(f"MPI calls this process rank {rank} where {rank_name}={launched_rank}: {rank_name} and "
                         f"{size_name} are left over from a launcher that did not start this process, or set by hand "
                         "(unset them)")


def rank_gpu(local_rank: int, ranks_on_node: int, num_gpus: int, share_gpus: bool) -> int:
    """The index of the GPU that local rank `local_rank` of `ranks_on_node` takes among the node's `num_gpus`."""
    if ranks_on_node <= num_gpus:
        return local_rank
    if not share_gpus:
        raise ValueError(
            f"{counted(ranks_on_node, 'rank')} on this node but {counted(num_gpus, 'GPU')} visible, and NCCL needs a "
            f"GPU per rank: start at most {counted(num_gpus, 'rank')} per node (sbatch and srun: "
            f"--ntasks-per-node={num_gpus}, which launch/slurm.sbatch sets to 8), or set distributed.share_gpus=true "
            "to put several ranks on each GPU (they take turns on it and all-reduce through gloo: slow, but the "
            "arithmetic of one GPU per rank)"
        )
    return local_rank % num_gpus


def ranks_sharing_gpu(gpu: int, ranks_on_node: int, num_gpus: int) -> int:
    """How many of the node's `ranks_on_node` ranks rank_gpu puts on GPU `gpu`."""
    if ranks_on_node <= num_gpus:
        return 1
    return len(range(gpu, ranks_on_node, num_gpus))
