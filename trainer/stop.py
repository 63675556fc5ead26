"""Stopping a run cleanly on a signal: SIGUSR1, SIGTERM and a first Ctrl-C (SIGINT) ask training to stop after the step
in progress and write checkpoints/last.pt, so that train.resume=auto continues it exactly. Schedulers send SIGTERM
before they preempt a job (SLURM also SIGUSR1 ahead of its time limit with --signal); MPICH's mpiexec passes all three
on to every rank; under OpenMPI's mpirun, which kills the ranks a second after it passes a signal on, the launch
scripts pass them on themselves (launch/mpi_job.sh; README, Multi-GPU training). Ranks agree on the step
they stop after (trainer.step.train_step). A second Ctrl-C interrupts at once, as a stop signal before training began
does: there is nothing to save yet."""
import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from tqdm import tqdm

from data.cli import ctrl_c_ignored

if TYPE_CHECKING:  # torch takes seconds to import, and keep_early_stop_signal must come first
    from torch.utils.data import DataLoader

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_early_signal: list[signal.Signals] = []  # the stop signal keep_early_stop_signal kept, until StopSignals takes it


def stop_signals_taken() -> tuple[signal.Signals, ...]:
    """The stop signals the trainer takes over: not a Ctrl-C it was started ignoring (data.cli.ctrl_c_ignored), as a
    script's `python -m trainer ... &` is, where one meant for the foreground job (`tail -f` on the log) stopped the
    training in the background. SIGTERM and SIGUSR1, a scheduler's, which no shell ignores for a background job, are
    always taken: a preempted run writes its checkpoint."""
    return tuple(number for number in STOP_SIGNALS if not (number == signal.SIGINT and ctrl_c_ignored()))


def keep_early_stop_signal() -> None:
    """`python -m trainer` calls this before its imports: until StopSignals takes the stop signals (after the imports
    and Hydra's config, seconds on an idle machine and 10-20 on a busy one), the first one is kept, and StopSignals
    ends the run on it as on any that came before training began. Left to their defaults, SIGTERM and SIGUSR1 killed
    each rank without a word (MPICH's mpiexec exited 15 or 10, not 143 or 138), and Ctrl-C printed a traceback from
    inside torch's import on each rank, one of which crashed (SIGSEGV). A second signal meanwhile does what it did
    before (the handlers from before this one put back)."""
    previous = {number: signal.getsignal(number) for number in stop_signals_taken()}

    def keep(number: int, frame) -> None:
        _early_signal.append(signal.Signals(number))
        for other, handler in previous.items():
            signal.signal(other, handler)

    for number in previous:
        signal.signal(number, keep)


def received_counts(received: signal.Signals | None) -> list[int]:
    """This rank's part of a sum over ranks that counts, per stop signal, the ranks that received it."""
    return [int(number == received) for number in STOP_SIGNALS]


def stop_requests(summed_counts) -> dict:
    """{signal: how many ranks received it} from the sum of every rank's received_counts, the signals none received
    left out."""
    return {number: int(ranks) for number, ranks in zip(STOP_SIGNALS, summed_counts) if ranks}


def _on_main_thread() -> bool:
    """Whether this is the main thread, the only one on which Python runs signal handlers and lets them be set."""
    return threading.current_thread() is threading.main_thread()


class StoppedBeforeTraining(KeyboardInterrupt):
    """SIGTERM or SIGUSR1 came before training began (Ctrl-C: KeyboardInterrupt itself), when there is nothing to
    save. A KeyboardInterrupt, which handlers of errors let through: one that took it for an error would skip an audio
    file as unreadable while AN4's manifests are written (data.prepare), or print it and go on (tqdm's log handler)."""

    def __init__(self, number: signal.Signals):
        super().__init__(f"{number.name} received before training began")
        self.signal = number


class StopSignals:
    """In its `with` block, this process's stop signals end the run at once, Ctrl-C as KeyboardInterrupt and SIGTERM
    or SIGUSR1 as StoppedBeforeTraining, rather than kill it without a word (which MPICH's mpiexec reports as exit code
    15 or 10); from `listen()` on, they set `received` (the first one) instead. Python takes signals on the main thread
    only; elsewhere (a test calling train() from a thread) it leaves them alone."""

    def __init__(self):
        self.received: signal.Signals | None = None
        self._previous = {}

    def __enter__(self) -> "StopSignals":
        # Made before a signal can raise: one raising inside tqdm's first making of its write lock (the first log line
        # through tqdm makes it) left tqdm without a lock, the signal lost and "--- Logging error ---" printed.
        tqdm.get_lock()
        self._take_signals(self._stop_now)
        if _early_signal:  # it came while the trainer started (keep_early_stop_signal)
            self.__exit__()
            self._stop_now(_early_signal.pop(), None)
        return self

    def listen(self) -> None:
        self._take_signals(self._handle)

    def came(self) -> bool:
        """Whether a stop signal has come (start_data_workers' `stopping`)."""
        return self.received is not None

    def _take_signals(self, handler) -> None:
        if _on_main_thread():
            previous = {number: signal.signal(number, handler) for number in stop_signals_taken()}
            self._previous = self._previous or previous  # those from before the block, for __exit__ to put back

    def __exit__(self, exception_type=None, *exception) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}
        if self.received is not None:
            # One the run ended without stopping on, its work done (after its last evaluation) or an error raised: a
            # sweep's next job ends on it before training begins, as on one that comes between jobs, rather than run
            # as if none came. (One the run stopped on is kept too, unread: the process exits with its code right
            # after, trainer's __main__.)
            _early_signal.append(self.received)
            self.received = None

    @staticmethod
    def _stop_now(number: int, frame) -> None:
        if number == signal.SIGINT:
            raise KeyboardInterrupt
        raise StoppedBeforeTraining(signal.Signals(number))

    def _handle(self, number: int, frame) -> None:
        if self.received is not None:
            if number == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.received = signal.Signals(number)
        log.warning("%s received: stopping when the training step or evaluation in progress ends, writing "
                    "checkpoints/last.pt%s",
                    self.received.name, "; Ctrl-C again interrupts at once" if number == signal.SIGINT else "")


def ignore_in_data_workers(worker_id: int) -> None:
    """A DataLoader's worker_init_fn: its workers leave stop signals to the training process (one Ctrl-C or scheduler
    signal reaches every process of the job). torch's workers die on SIGTERM, and the training process then fails on
    the dead worker before it can write its checkpoint. A signal that came before this ran waited, blocked since the
    worker's start (start_data_workers), and is dropped here: ignoring a signal discards one pending (POSIX), though
    the block stays.

    A worker dies with its training process (die_with_training_process).

    A stop signal while the training process awaits a batch breaks off the handover of its tensors (start_data_workers
    kills the workers then): the worker's handover thread, multiprocessing's resource sharer, printed the broken
    connection's traceback through sys.excepthook before its end, a stray "Traceback" in the job's log."""
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_IGN)
    sys.excepthook = _quiet_where_a_handover_broke(sys.excepthook)
    die_with_training_process()


def die_with_training_process() -> None:
    """Has the kernel kill this data-loading worker as soon as its training process dies (Linux's PR_SET_PDEATHSIG).
    A rank killed outright (the out-of-memory killer, kill -9) left its workers to torch's check of their parent,
    every 5 s, and one stuck (reading from a file system that stopped answering) for ever. They held the rank's output
    and its connections to the other ranks open, so the job ended only once they did: MPICH's mpiexec ends it once a
    rank's output closes, and the other ranks waited on their collective meanwhile (with a worker stuck, until
    distributed.timeout_s, then blamed a rank that did not answer, and mpiexec waited on).

    The kernel signals a parent's death, not one before the request: a training process killed between the worker's
    fork and this call left it to torch's check, which a worker stuck on a read never reaches. Such a worker, its
    parent no longer the training process, kills itself here."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    training_process = multiprocessing.parent_process()  # None in a process multiprocessing did not start
    if training_process is not None and os.getppid() != training_process.pid:
        os.kill(os.getpid(), signal.SIGKILL)


def _quiet_where_a_handover_broke(print_error: Callable) -> Callable:
    def excepthook(kind, value, trace):
        if not issubclass(kind, (ConnectionError, EOFError)):
            print_error(kind, value, trace)
    return excepthook


class DataWorkersTimedOut(TimeoutError):
    """No batch came from a DataLoader's workers in time; the workers are gone (start_data_workers)."""


class DataWorkerDied(Exception):
    """A DataLoader's worker died: killed by a signal (the kernel's out-of-memory killer sends SIGKILL), or exited with
    an error of its own. The other workers are gone too (start_data_workers)."""

    def __init__(self, pid: int, exit_code: int):
        self.pid = pid
        self.signal = signal.Signals(-exit_code) if exit_code < 0 else None
        how = f"was killed by {self.signal.name}" if self.signal else f"exited with code {exit_code}"
        super().__init__(f"data-loading worker (pid {pid}) {how}")


# How long a worker whose batch could not be read may take to be seen dead: its connections close as it exits, just
# before the kernel lets it be reaped.
DYING_S = 5.0


def _time_out(number: int, frame) -> None:
    raise DataWorkersTimedOut


@contextlib.contextmanager
def _deadline(seconds: float | None):
    """Its block raises DataWorkersTimedOut after `seconds`, where given (SIGALRM, on the main thread only: Python's
    rule for signals). The DataLoader's own timeout bounds only the wait for a batch's message: unpickling a prefetched
    batch then waits, for ever, on the worker that made it to hand over its tensors' file descriptors."""
    if seconds is None or not _on_main_thread():
        yield
        return
    previous = signal.signal(signal.SIGALRM, _time_out)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class _StopWaiting(Exception):
    """A stop signal came while a batch was awaited (_stop_waiting_on)."""


@contextlib.contextmanager
def _stop_waiting_on(stopping: Callable[[], bool] | None):
    """Its block raises _StopWaiting on a stop signal after which `stopping()` is true, the handler in place
    (StopSignals') run first; on the main thread only, where Python runs signal handlers."""
    previous = {number: signal.getsignal(number) for number in stop_signals_taken()}
    if stopping is None or not _on_main_thread() or not all(map(callable, previous.values())):
        yield
        return

    def stop_waiting(number: int, frame) -> None:
        previous[number](number, frame)
        if stopping():
            raise _StopWaiting

    for number in previous:
        signal.signal(number, stop_waiting)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _death(workers: set, wait_s: float = 0.0) -> DataWorkerDied | None:
    """The first of `workers` found dead within `wait_s` (each one that has ended is reaped), or None."""
    deadline = time.monotonic() + wait_s
    while True:
        for worker in workers:
            if worker.exitcode:  # 0: torch's shutdown at the loader's end
                return DataWorkerDied(worker.pid, worker.exitcode)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)


def _kill_and_reap(workers: set) -> None:
    """Kills and reaps the workers, torch's SIGCHLD handler and start_data_workers' set aside meanwhile, as their
    deaths would call them."""
    on_main_thread = _on_main_thread()
    watching = signal.signal(signal.SIGCHLD, signal.SIG_DFL) if on_main_thread else None
    try:
        for worker in workers:
            worker.kill()
        for worker in workers:
            worker.join()
    finally:
        if on_main_thread:
            signal.signal(signal.SIGCHLD, watching)


def start_data_workers(loader: "DataLoader", timeout_s: float | None = None,
                       stopping: Callable[[], bool] | None = None) -> Iterator:
    """The loader's batches, its workers started with the stop signals blocked: they inherit the block, so a signal
    that reaches one before its ignore_in_data_workers has run cannot kill it there (torch's own SIGTERM handler, set
    first, ends a worker). This process takes a signal that came meanwhile as the block ends.

    A batch the workers do not give within `timeout_s`, where given (a worker stuck on a file system that stopped
    answering, or stopped by SIGSTOP: torch's DataLoader waits for ever on one), raises DataWorkersTimedOut once they
    are gone. A worker that dies (the out-of-memory killer's SIGKILL) raises DataWorkerDied once they are gone, here,
    as the next batch is asked for: torch's SIGCHLD handler, which raised wherever this process was when one died (in
    a training step, a checkpoint's write, the handling of the error the death had raised here first), is set aside
    meanwhile for one that only notes the death. The death may surface first here as torch's error (it checks its
    workers every 5 s while it waits) or as a batch whose tensors cannot be fetched from the dead worker
    (ConnectionResetError, EOFError). However the batches end early (a second Ctrl-C, a consumer that stops at
    train.max_steps), the workers are killed and reaped too, so that a stuck one cannot hold up Python's exit.

    Where `stopping()` (a training run's stop signal, given) is true, or turns true while a batch is awaited, the
    workers are killed and None comes instead of the batch, which its step would not train (trainer.step.train_step)
    nor its evaluation decode (trainer.evaluate.evaluate): a worker stuck meanwhile held the run, and every rank
    waiting on this one, for `timeout_s`."""
    if loader.num_workers > 0:
        # Only a forked worker inherits the block; forkserver (Python 3.14's default on Linux) and spawn start
        # workers from another process.
        loader.multiprocessing_context = "fork"
    others = set(multiprocessing.active_children())
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        batches = iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    if loader.num_workers == 0:
        yield from batches
        return
    workers = set(multiprocessing.active_children()) - others
    died = None

    def note_death(number: int, frame) -> None:
        nonlocal died
        died = died or _death(workers)

    # torch's pin-memory thread (on a GPU) fetches each batch's tensors from the worker that made it, and dies with a
    # traceback of its own where that worker died or was killed: this generator says what happened instead.
    pin_memory_thread = getattr(batches, "_pin_memory_thread", None)
    print_thread_error = threading.excepthook

    def quiet_where_a_worker_is_gone(args) -> None:
        if not (args.thread is pin_memory_thread and isinstance(args.exc_value, (ConnectionError, EOFError))
                and _death(workers, DYING_S)):
            print_thread_error(args)

    on_main_thread = _on_main_thread()
    watching = signal.signal(signal.SIGCHLD, note_death) if on_main_thread else None
    threading.excepthook = quiet_where_a_worker_is_gone
    failure = None
    stopped = False
    try:
        while failure is None:
            try:
                if stopping is not None and stopping():
                    raise _StopWaiting
                with _deadline(timeout_s), _stop_waiting_on(stopping):
                    batch = next(batches)
            except StopIteration:
                return
            except _StopWaiting:
                stopped = True
                break
            except KeyboardInterrupt as interrupt:  # a second Ctrl-C, as likely as not while a worker is stuck
                failure = interrupt.with_traceback(None)  # which held the iterator
            except DataWorkersTimedOut:
                failure = DataWorkersTimedOut(f"no batch came from the data-loading workers within {timeout_s:g} s")
            except Exception:
                failure = died or _death(workers, DYING_S)
                if failure is None:  # a worker's own error, which torch raises here
                    # The workers ignore the SIGTERM of torch's shutdown, and Python's exit then waited for them for
                    # ever, after the error's traceback.
                    _kill_and_reap(workers)
                    raise
            else:
                yield batch
                failure = died
        # The rest outside the except block, whose traceback holds the iterator. Killed and reaped first: torch's
        # shutdown of its workers (as the iterator goes) sends SIGTERM, which they ignore, and Python's exit then
        # waited for a stopped one for ever.
        _kill_and_reap(workers)
        batches = None
        if died or not stopped:
            raise died or failure
    except GeneratorExit:  # the consumer wanted no more (train.max_steps, a stop signal); a worker may be stuck
        _kill_and_reap(workers)
        batches = None
        raise
    finally:
        threading.excepthook = print_thread_error
        if on_main_thread:
            signal.signal(signal.SIGCHLD, watching)
    yield None  # stopped: after the workers are gone, so that the consumer's stop does not wait on them
