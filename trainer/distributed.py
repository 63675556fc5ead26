"""The process group of `mpirun -np N python -m trainer`: its start, its collectives and its end, and how a rank that
fails ends the job and tells the others.

Rank, world size and local rank come from MPI through mpi4py; the launcher's variables (trainer.launch_ranks) are the
fallback where mpi4py is unavailable. Rank 0's address and a free port are broadcast over MPI (without mpi4py, read
from MASTER_ADDR and MASTER_PORT), then torch.distributed starts: NCCL on GPUs, gloo on CPUs. A process started
without a launcher is a world of one and never imports MPI.

Each rank takes its node's GPU of its local rank (trainer.launch_ranks.rank_gpu). Where distributed.share_gpus puts
several ranks on one GPU, the group runs on gloo, because NCCL cannot put two ranks of one communicator on one GPU.
The ranks take turns on a shared GPU and all-reduce through host memory, so it is slow; what it is for is an N-GPU
job's arithmetic (per-GPU batch, batch-norm statistics, reduction) on fewer GPUs.
"""
import array
import contextlib
import datetime
import gc
import ipaddress
import json
import logging
import os
import re
import select
import signal
import socket
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainer.launch_ranks import (check_mpi_sees_the_launchers_ranks, check_not_one_of_torchruns_ranks, launched_by_mpi,
                                 launcher_rank, rank_gpu, ranks_from_launcher, ranks_sharing_gpu)

log = logging.getLogger(__name__)

ABORT_GRACE_S = 2.0
# gloo's words for a collective that waited its timeout, and for one that failed as another of this rank's timed
# out: gloo then closes every connection of this rank, and a collective waiting beside it (sync batch norm's in the
# backward, beside DDP's asynchronous bucket all-reduce, which timed out first) fails on the closure.
GLOO_TIMEOUT = re.compile(r"Timed out waiting \d+ms|Application timeout caused pair closure")
GLOO_PEER_GONE = re.compile(r"Connection (?:closed|reset) by peer")  # gloo's words for a peer whose process ended
ANSWER_TAG = 0x5052  # the MPI tag of other_ranks_answers' messages, which no other message of the trainer's has
TIMED_OUT_TOO, ENDED_ON_ITS_OWN_ERROR = 0, 1  # what a rank says to the others under ANSWER_TAG
LONGEST_ANSWER_WAIT_S = 60.0  # a live rank times out a step or so after another; a job that hangs ends soon after


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    device: torch.device
    ranks_on_device: int = 1  # this rank's and those that share its device's memory (a CPU's, or a shared GPU's)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


TRAINER_TIMEOUT_SETTING = "distributed.timeout_s"


def _within(timeout_s: float, timeout_setting: str) -> str:
    """How the lines of a wait that ran out say its limit: naming `timeout_setting`, what raises it for the caller's
    user (the trainer's Hydra key, a benchmark's flag), which a key of another program's would not tell them."""
    return f"within {timeout_setting} ({timeout_s:g} s)"


@contextlib.contextmanager
def ended_past(timeout_s: float, rank: int, timeout_setting: str = TRAINER_TIMEOUT_SETTING):
    """Its block, MPI's start and its exchanges before the process group, ends this process after `timeout_s`, saying
    so in one line naming `timeout_setting`: those wait for every rank with no timeout of their own, where a rank
    stopped or hung before it started MPI (stuck importing from a file system that stopped answering) left the others
    in MPI_Init for ever. MPI_Init holds the GIL, so neither a thread nor a signal handler of this process would run:
    a process forked here waits on a pipe that the block's end closes, and kills this one (the launcher then ends the
    job) where it was not closed in time. Not once MPI has started (a sweep's later job): a fork then makes OpenMPI
    warn, and InfiniBand's registered memory may not survive it."""
    if "mpi4py.MPI" in sys.modules:
        yield
        return
    refusal = (f"error on rank {rank}: MPI did not start {_within(timeout_s, timeout_setting)}: another rank stopped "
               "answering before it started MPI (stopped, or hung importing from a file system that stopped "
               "answering); this rank ends the job\n")
    read_end, write_end = os.pipe()
    watchdog = os.fork()
    if watchdog == 0:
        try:  # whatever happens here (a Ctrl-C's KeyboardInterrupt), this copy never runs on into the trainer's code
            # MPICH's mpiexec passes a stop signal on to the rank's process group, this copy among it: the rank's
            # handlers (StopSignals' raise) would end it, leaving the rank in MPI_Init for ever. They are the rank's
            # to run, once MPI_Init returns.
            for number in signal.valid_signals():
                if callable(signal.getsignal(number)):
                    signal.signal(number, signal.SIG_IGN)
            os.close(write_end)
            if not select.select([read_end], [], [], timeout_s)[0]:
                os.write(2, refusal.encode())
                os.kill(os.getppid(), signal.SIGKILL)
        finally:
            os._exit(0)
    os.close(read_end)
    try:
        yield
    finally:
        os.close(write_end)
        os.waitpid(watchdog, 0)


def _ranks_from_mpi() -> tuple[int, int, int, int, bool, "object"]:
    """(rank, world size, local rank, ranks on this node, whether rank 0 is on this node, the world communicator)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    on_rank_0s_node = array.array("i", [world.Get_rank() == 0])
    node.Allreduce(MPI.IN_PLACE, [on_rank_0s_node, MPI.INT], op=MPI.LOR)  # a buffer: lowercase allreduce pickles
    return world.Get_rank(), world.Get_size(), node.Get_rank(), node.Get_size(), bool(on_rank_0s_node[0]), world


def _broadcast_json(world, value):
    """Rank 0's `value` (JSON data) on every rank of MPI communicator `world`: as bytes, not mpi4py's pickles, which
    would run what they hold."""
    from mpi4py import MPI

    encoded = json.dumps(value).encode() if world.Get_rank() == 0 else b""
    length = array.array("q", [len(encoded)])
    world.Bcast([length, MPI.INT64_T], root=0)
    received = bytearray(encoded) if world.Get_rank() == 0 else bytearray(length[0])
    world.Bcast([received, MPI.BYTE], root=0)
    return json.loads(received)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _main_address() -> str:
    """MASTER_ADDR wins (multi-node jobs name the interface there); otherwise this host's resolved address, or
    ValueError naming MASTER_ADDR where its name does not resolve (a container's, in no /etc/hosts nor DNS), which
    ended the job on socket.gaierror's traceback."""
    if address := os.environ.get("MASTER_ADDR"):
        return address
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except socket.gaierror as error:
        raise ValueError(f"rank 0's host name {name} does not resolve to an address ({error.strerror}), which the "
                         "other ranks need to reach it: set MASTER_ADDR to its address") from None


def check_reachable_from_other_nodes(address: str, on_rank_0s_node: bool) -> None:
    """ValueError on a rank of another node than rank 0's where rank 0's address is a loopback one there (rank 0's
    host name resolved to 127.0.1.1 on its node, as many do, where MASTER_ADDR is unset): this rank would connect to
    itself and wait out the timeout. On rank 0's node any address of its own reaches rank 0, whose rendezvous listens
    on every interface, so a MASTER_ADDR naming that node, which its /etc/hosts maps to 127.0.1.1, is taken there."""
    if on_rank_0s_node:
        return
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(address)).is_loopback
    except (OSError, ValueError):
        return  # a name this node cannot resolve: the rendezvous says so
    if loopback:
        raise ValueError(f"rank 0's address {address} is a loopback address, which the ranks on other nodes cannot "
                         "reach: set MASTER_ADDR to its node's address on the network the nodes share "
                         "(launch/multi_node.sh sets it to the hostfile's first host)")


def _ranks_and_rendezvous(timeout_s: float, timeout_setting: str) -> tuple[int, int, int, int, str, int]:
    """(rank, world size, local rank, ranks on this node, rank 0's address, its port) in a job a launcher started: from
    MPI, rank 0's address and a free port broadcast, the job ended past `timeout_s` where MPI does not start
    (ended_past); without mpi4py, from the launcher's variables, MASTER_ADDR and MASTER_PORT."""
    try:
        with ended_past(timeout_s, launcher_rank(), timeout_setting):
            rank, world_size, local_rank, ranks_on_node, on_rank_0s_node, world = _ranks_from_mpi()
            check_mpi_sees_the_launchers_ranks(rank, world_size)
            address, port = _broadcast_json(world, [_main_address(), _free_port()] if rank == 0 else None)
        check_reachable_from_other_nodes(address, on_rank_0s_node)  # MPI knows which ranks share rank 0's node
    except ImportError:
        rank, world_size, local_rank, ranks_on_node = ranks_from_launcher()
        address, port = rendezvous_from_environment()
    return rank, world_size, local_rank, ranks_on_node, address, port


def rendezvous_from_environment() -> tuple[str, int]:
    """Rank 0's address and port from MASTER_ADDR and MASTER_PORT, where no mpi4py broadcasts them; ValueError naming
    the variable where one is unset or MASTER_PORT is no port, before any rendezvous. Without MASTER_ADDR each rank
    would take its own host's address, and those of other nodes wait out the timeout connecting to themselves; a port
    torch cannot use fails in its traceback, and port 0 (any free port, on rank 0 alone) waits out the timeout too."""
    address, port = (os.environ.get(name, "").strip() for name in ("MASTER_ADDR", "MASTER_PORT"))
    if unset := [name for name, value in (("MASTER_ADDR", address), ("MASTER_PORT", port)) if not value]:
        raise ValueError(f"{' and '.join(unset)} unset: without mpi4py, every rank needs rank 0's address and a free "
                         "port there in MASTER_ADDR and MASTER_PORT (mpirun -x MASTER_ADDR=host -x MASTER_PORT=29511), "
                         "or mpi4py to share them")
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"MASTER_PORT must be a port number from 1 to 65535, not {port!r}")
    return address, int(port)


# Seconds (31 years). Longer ones broke the rendezvous over gloo, 1e10 s failing it at once, 9e9 s and 1e11 s hanging
# it (int64 nanoseconds end at 9.2e9 s), and 1e300 s overflowed timedelta in a traceback.
MAX_TIMEOUT_S = 1e9
DEFAULT_TIMEOUT_S = 300.0  # of init and shutdown, where the caller names none (the benchmarks' --timeout-s default)
LEAST_RENDEZVOUS_WAIT_S = 1.0  # of a rendezvous whose rank 0 opened its port just in time (rendezvous_wait_s)


def end_nccl_timeouts_promptly(timeout_s: float) -> None:
    """Environment defaults, read when NCCL's process group starts, under which a collective past timeout_s ends the
    process. NCCL's watchdog sees the timeout but then stalls (2 x H100, torch 2.11: a rank whose peer had stopped
    lived on past a minute), and the monitor that ends a stalled watchdog waits 480 s by default: it gets timeout_s,
    and the debug dump on timeout is skipped. A user's own settings win."""
    os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "1")
    os.environ.setdefault("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", str(max(1, round(timeout_s))))
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")


def _device_and_backend(use_cuda: bool, local_rank: int, ranks_on_node: int, share_gpus: bool
                        ) -> tuple[torch.device, int, str]:
    """This rank's device (its GPU made the current one), how many ranks share its memory (DistEnv.ranks_on_device),
    and the process group's backend: NCCL where each of the node's ranks has a GPU of its own, else gloo (CPUs, and
    GPUs shared under share_gpus, which NCCL refuses)."""
    if not use_cuda:
        # Share the node's cores: more compute threads than cores make OpenMP's spin-waits crawl.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_on_node))
        return torch.device("cpu"), ranks_on_node, "gloo"
    num_gpus = torch.cuda.device_count()
    rank_device = torch.device("cuda", rank_gpu(local_rank, ranks_on_node, num_gpus, share_gpus))
    torch.cuda.set_device(rank_device)
    backend = "nccl" if ranks_on_node <= num_gpus else "gloo"
    return rank_device, ranks_sharing_gpu(rank_device.index, ranks_on_node, num_gpus), backend


DEVICES = ("auto", "cpu", "cuda")  # init's, as the config's `device` names them (auto: this rank's GPU, if any)


def init(device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S, share_gpus: bool = False,
         timeout_setting: str = TRAINER_TIMEOUT_SETTING) -> DistEnv:
    """Starts the process group when launched by MPI; picks this rank's device.

    device: "auto" (this rank's local GPU when CUDA is available, else CPU), "cpu" or "cuda".
    share_gpus: let more ranks than GPUs run on a node, several to a GPU (module docstring).
    timeout_setting: what sets `timeout_s` for the caller's user, which the lines of a wait that ran out name.
    """
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, not {device!r}")  # as the config's rule says
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda (experiment=an4_gpu and deep100 set it) was asked for, but no CUDA GPU is "
                         "visible: on a CPU, train experiment=cpu_demo, or set device=cpu")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())

    check_not_one_of_torchruns_ranks()
    if not launched_by_mpi():
        return DistEnv(0, 1, torch.device("cuda", 0) if use_cuda else torch.device("cpu"))

    rank, world_size, local_rank, ranks_on_node, address, port = _ranks_and_rendezvous(timeout_s, timeout_setting)
    rank_device, ranks_on_device, backend = _device_and_backend(use_cuda, local_rank, ranks_on_node, share_gpus)
    if backend == "nccl":
        end_nccl_timeouts_promptly(timeout_s)
    try:
        deadline = time.monotonic() + timeout_s
        if rank != 0:
            wait_for_rank_0s_rendezvous(address, port, deadline)
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{address}:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=rendezvous_wait_s(deadline, timeout_s)),
            device_id=rank_device if backend == "nccl" else None,
        )
    except (dist.DistStoreError, dist.DistNetworkError) as error:
        if not rendezvous_timed_out(error):
            raise
        log.error("error on rank %d: the process group's rendezvous did not complete %s: %s; this rank ends the job "
                  "(%s)", rank, _within(timeout_s, timeout_setting), rendezvous_missed_by(address, port),
                  " ".join(str(error).split()))
        abort_job(1)
    # init_process_group's timeout, the rendezvous's, is the collectives' too, which each get the whole of it.
    dist.group.WORLD.set_timeout(datetime.timedelta(seconds=timeout_s))
    # The process and host too: where a rank dies, MPICH's mpiexec names its PID and host, not its rank.
    log.info("rank %d of %d (local rank %d) on %s over %s, rendezvous %s:%d, process %d on %s", rank, world_size,
             local_rank, rank_device, dist.get_backend(), address, port, os.getpid(), socket.gethostname())
    return DistEnv(rank, world_size, rank_device, ranks_on_device)


def rendezvous_wait_s(deadline: float, timeout_s: float) -> float:
    """What the process group's rendezvous may wait: what is left until `deadline` (time.monotonic()), `timeout_s`
    after a rank began its wait for rank 0's port, so that the two waits end within `timeout_s`, where each took the
    whole of it and a rank whose rank 0 opened its port late waited up to twice it. At least LEAST_RENDEZVOUS_WAIT_S
    (or `timeout_s`, where that is shorter): a rendezvous of ranks that are all there takes a moment, which a port
    that answered just in time would leave it none of."""
    return max(deadline - time.monotonic(), min(LEAST_RENDEZVOUS_WAIT_S, timeout_s))


def wait_for_rank_0s_rendezvous(address: str, port: int, deadline: float) -> None:
    """Returns once rank 0's rendezvous at `address` and `port` accepts a connection, which its store closes without
    a word; DistNetworkError saying it timed out where it did not by `deadline` (time.monotonic(); init's one line
    then says so).
    Torch's own wait for it logged each of its tries that timed out with some 20 lines of C++ stack frames before that
    line, and TORCH_CPP_LOG_LEVEL, which hides them, is read as torch is imported and would hide every other C++
    warning and error too (NCCL's watchdog's). Any other error (a name that does not resolve) is left to the
    rendezvous, which says it."""
    while True:
        try:
            with socket.create_connection((address, port), timeout=max(deadline - time.monotonic(), 0.01)):
                return
        except (ConnectionRefusedError, TimeoutError) as error:
            if time.monotonic() >= deadline:
                raise dist.DistNetworkError(f"timed out connecting to {address}:{port} ({error})") from None
            time.sleep(0.05)
        except OSError:
            return


def rendezvous_missed_by(address: str, port: int) -> str:
    """Who kept the process group's rendezvous at rank 0's `address` and `port` from completing, as far as this rank
    can tell. Every rank started MPI before it, where mpi4py broadcast them; without mpi4py none is known to have
    started MPI, and a rank given another MASTER_ADDR or MASTER_PORT than rank 0 misses it too."""
    if "mpi4py.MPI" in sys.modules:
        return "another rank stopped answering after MPI started (stopped, or hung)"
    return (f"a rank did not reach rank 0 at MASTER_ADDR and MASTER_PORT ({address}:{port}): it stopped or hung, or "
            "another MASTER_ADDR or MASTER_PORT than this rank's was set for it")


def rendezvous_timed_out(error: Exception) -> bool:
    """Whether init_process_group's `error` is its rendezvous's timeout, whose traceback through torch's store said no
    more: rank 0's store waited for the others (DistStoreError), or another rank's connection to it, where rank 0 is
    the one stopped (DistNetworkError). Not the network errors that say what went wrong (a port taken)."""
    return isinstance(error, dist.DistStoreError) or "timed out" in str(error)


def data_parallel(module: torch.nn.Module, device: torch.device, graphed: bool, **options) -> DistributedDataParallel:
    """DistributedDataParallel around `module` on `device` (DDP's keyword `options` passed on). A `graphed` module
    (models.cuda_graphs) gets it made on a side stream: DDP makes each parameter's gradient accumulator here, on the
    current stream, and accumulators of the legacy default stream make every later capture of a backward through
    them fail (cudaErrorStreamCaptureImplicit). An eager one keeps the default stream its passes run on."""
    device_ids = [device] if device.type == "cuda" else None
    if not graphed:  # graphs run on GPUs only
        return DistributedDataParallel(module, device_ids=device_ids, **options)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        wrapped = DistributedDataParallel(module, device_ids=device_ids, **options)
    torch.cuda.current_stream(device).wait_stream(side)  # its broadcast of rank 0's parameters
    return wrapped


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sums a tensor over ranks in place (a no-op in a world of one)."""
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """The elementwise maximum over ranks, in place (a no-op in a world of one)."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def check_same_on_every_rank(settings: dict[str, str], refusal: str = "the ranks were started with other settings",
                             remedy: str = "every rank must run the same command, with the same conf/ folder") -> None:
    """ValueError on every rank where a rank holds other `settings` than rank 0 ({name: its value as text}), saying
    `refusal`, the differences, then `remedy`: ranks started with another seed, model or step limit do not fail by
    themselves, they shard batches that overlap, or wait for each other's collectives until the timeout (a no-op in a
    world of one)."""
    if not dist.is_initialized():
        return
    every = all_gather_json(settings)
    differ = [f"rank {rank} has {key}={theirs.get(key)} where rank 0 has {every[0].get(key)}"
              for rank, theirs in enumerate(every[1:], start=1)
              for key in sorted(set(theirs) | set(every[0])) if theirs.get(key) != every[0].get(key)]
    if differ:
        named = "; ".join(differ[:4]) + (f"; {len(differ) - 4} more" if len(differ) > 4 else "")
        raise ValueError(f"{refusal} ({named}): {remedy}")


def all_gather_json(value) -> list:
    """Every rank's `value` (JSON data), in rank order (a list of one in a world of one): as bytes, not pickles, which
    would run what they hold."""
    if not dist.is_initialized():
        return [value]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    encoded = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([len(encoded)], device=device))
    longest = max(int(size) for size in sizes)
    gathered = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in sizes]
    dist.all_gather(gathered, torch.nn.functional.pad(encoded, (0, longest - len(encoded))))
    return [json.loads(bytes(data[:int(size)].tolist())) for data, size in zip(gathered, sizes)]


def backend() -> str | None:
    """The process group's backend ("nccl" or "gloo"), None in a world of one."""
    return dist.get_backend() if dist.is_initialized() else None


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shutdown(timeout_s: float = DEFAULT_TIMEOUT_S, timeout_setting: str = TRAINER_TIMEOUT_SETTING) -> None:
    """Ends the process group after a successful run, in step on every rank: all ranks reach it before any closes its
    connections, and none exits before all have. Two-rank benchmarks.scaling runs, which ended the group rank by
    rank, aborted at exit once in CI and about once in 50 runs on a loaded 2-core machine ("terminate called without
    an active exception"); a rank closing its sockets under a peer's live group is the suspected cause. Where another
    rank does not reach the last barrier, MPI's, within `timeout_s` (stopped, or hung closing its group), this rank
    ends the job in one line naming `timeout_setting`: MPI's barrier has no timeout, and the job waited there for
    ever. The process group's barrier before it times out as any collective does."""
    if not dist.is_initialized():
        return
    gc.collect()  # DDP's reducer sits in reference cycles that hold the group's work handles: free them first
    dist.barrier()
    dist.destroy_process_group()
    mpi = sys.modules.get("mpi4py.MPI")  # imported by init() when MPI started the job
    if mpi is not None and _unfinished([mpi.COMM_WORLD.Ibarrier()], timeout_s):
        log.error("error on rank %d: another rank did not reach the job's end %s (stopped, or hung closing its "
                  "process group); training is done and its checkpoints are written, and this rank ends the job",
                  mpi.COMM_WORLD.Get_rank(), _within(timeout_s, timeout_setting))
        abort_job(1)


def _unfinished(requests: list, timeout_s: float) -> list:
    """Those of MPI `requests` not completed within `timeout_s`: polled, since MPI's waits have no timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        requests = [request for request in requests if not request.Test()]
        if not requests or time.monotonic() >= deadline:
            return requests
        time.sleep(0.05)


def _mpi_of_a_gloo_job():
    """mpi4py's MPI module where init() imported it (MPI started the job) and the process group runs on gloo, else
    None: the ranks' other way to reach each other (other_ranks_answers, tell_others_this_rank_failed)."""
    return sys.modules.get("mpi4py.MPI") if backend() == "gloo" else None


def other_ranks_answers(error: Exception, timeout_s: float) -> dict[int, int | None] | None:
    """Where `error` is a gloo collective's failure in a job MPI started, {rank: what each other rank said}:
    TIMED_OUT_TOO from each rank whose collective timed out too (said here), ENDED_ON_ITS_OWN_ERROR from one that
    ends the job on an error of its own (tell_others_this_rank_failed), None from one that said nothing. A timeout
    waits for them for the collectives' `timeout_s` (at most LONGEST_ANSWER_WAIT_S): those that stay silent are the
    ones the collectives waited for (stopped, hung, or busy elsewhere), which gloo's error does not name. A connection
    a peer closed waits ABORT_GRACE_S, the time a failing rank gives its line before it ends the job, having said so
    first. None for any other error. Over MPI, not the process group, whose collectives wait for every rank."""
    timed_out = GLOO_TIMEOUT.search(str(error))
    mpi = _mpi_of_a_gloo_job()
    if mpi is None or (timed_out is None and not GLOO_PEER_GONE.search(str(error))):
        return None
    world = mpi.COMM_WORLD
    others = [rank for rank in range(world.Get_size()) if rank != world.Get_rank()]
    unsaid = [world.Isend([bytearray([TIMED_OUT_TOO]), mpi.BYTE], dest=rank, tag=ANSWER_TAG) for rank in others]
    answers = {rank: bytearray(1) for rank in others}
    unheard = {rank: world.Irecv([answers[rank], mpi.BYTE], source=rank, tag=ANSWER_TAG) for rank in others}
    wait_s = min(timeout_s, LONGEST_ANSWER_WAIT_S) if timed_out else ABORT_GRACE_S
    unfinished = _unfinished([*unsaid, *unheard.values()], wait_s)
    return {rank: None if any(unheard[rank] is request for request in unfinished) else answer[0]
            for rank, answer in answers.items()}


def silent_ranks_waited_for(error: Exception, answers: dict[int, int | None]) -> list[int]:
    """The ranks of other_ranks_answers' `answers` that a failed gloo collective waited for: the silent ones, where
    this rank's collective timed out or another rank's did (TIMED_OUT_TOO): gloo closes a rank's connections as its
    collective times out, so a rank still waiting reads that as a peer gone, and ended the job on it, before the rank
    that timed out could name the silent ones (3 ranks, one stopped). Where a connection closed otherwise, the silent
    ranks may be alive and well: none."""
    if not GLOO_TIMEOUT.search(str(error)) and TIMED_OUT_TOO not in answers.values():
        return []
    return [rank for rank, said in answers.items() if said is None]


_said_failed: list = []  # tell_others_this_rank_failed's sends and their buffers, kept until the job ends


def tell_others_this_rank_failed() -> None:
    """Says to every other rank, over MPI, that this one ends the job on an error of its own, which its line gives:
    a rank whose collective then fails for want of this one (timed out, or its connection closed as this one ended)
    names it (other_ranks_answers) rather than print that collective's traceback. Over gloo, as other_ranks_answers."""
    mpi = _mpi_of_a_gloo_job()
    if mpi is None:
        return
    world = mpi.COMM_WORLD
    for rank in range(world.Get_size()):
        if rank != world.Get_rank():
            said = bytearray([ENDED_ON_ITS_OWN_ERROR])
            _said_failed.append((said, world.Isend([said, mpi.BYTE], dest=rank, tag=ANSWER_TAG)))


def abort_job(exit_code: int = 1) -> None:
    """Ends every rank now. A rank that raised calls this so the others exit instead of waiting on a collective."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # None: closed as the process started (>&-)
            stream.flush()
    if launched_by_mpi():
        # The launcher forwards each rank's output through its own pipes and drops whatever is still in them when
        # Abort ends the job (MPICH under load lost the error line 3 runs in 10); a moment lets the message through.
        time.sleep(ABORT_GRACE_S)
        try:
            from mpi4py import MPI
        except ImportError:
            os._exit(exit_code)  # the launcher ends the other ranks when one exits non-zero
        MPI.COMM_WORLD.Abort(exit_code)
    sys.exit(exit_code)
