"""`python -m trainer [overrides]`: the Hydra entry point (configs in conf/; see conf/train.yaml).

A user error (an input missing or unreadable, a bad config value, a full disk) prints one line and exits 2. Any other
exception on any rank prints that rank's traceback and ends the whole MPI job, so no rank is left waiting on a
collective; a rank whose collective failed as another rank ended the job on an error, or stopped answering (over gloo,
whose error names no rank), says so in one line instead. A run stopped by a signal (trainer.stop) writes its checkpoint
and exits 128 + the signal's number on every rank, as a process the signal ended would (130 Ctrl-C, 138 SIGUSR1, 143
SIGTERM), so that a script or scheduler sees it unfinished; a sweep stops there too, naming the jobs that failed before.
A signal before training began, with nothing to save, ends the run so at once.

A sweep (`python -m trainer -m key=a,b ...`) runs each job in runs/<run_name>/<its overrides>, so the same sweep run
again with train.resume=auto continues each job in its own folder. A job whose config is refused, or whose folder
another job's name gives too, refuses the whole sweep before any job runs (trainer.run_directory). A job that fails
as it runs logs its error as a run does, and the jobs after it still run; the sweep then names each failed job's folder
and error, and exits 2 where every failure was a user error, 1 otherwise. Under MPI a failing job still ends the whole
MPI job (its other ranks would wait on it).
"""
if __name__ == "__main__":  # first: the imports below take seconds (torch), in which a stop signal killed each rank
    from data.cli import end_at_once_on_a_signal

    end_at_once_on_a_signal()  # until keep_early_stop_signal: trainer.stop's imports (tqdm) take a tenth of a second
    from trainer.stop import keep_early_stop_signal

    keep_early_stop_signal()

import errno
import logging
import math
import signal
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from data.cli import stdout_failures_end_the_tool
from data.dataset import SharedMemoryFull
from data.files import FULL_DISK, came_of_writing, file_size_limit, space_left, write_error_line
from data.manifest import print_paths_printable
from trainer import distributed, launch_ranks
from trainer.cli import log_above_progress_bars, write_console_line
from trainer.config import RUN_NAME_SETTING, config_error_line
from trainer.override_errors import (let_info_stdout_failures_through, refuse_a_pickled_config,
                                     report_command_line_errors_in_one_line)
from trainer.stop import DataWorkerDied, DataWorkersTimedOut, StoppedBeforeTraining
from trainer.train import CONTINUE_RUN, train

log = logging.getLogger("trainer")

_failed_sweep_jobs: list[tuple[str, int]] = []  # (what failed where, the exit code a run would have had)


def end_job(exit_code: int, summary: str) -> None:
    """After a job's error is logged: a sweep that MPI did not launch goes on with its next job, and
    sweep_exit_code reports this one at the end; a single run, or any job under MPI, ends the process (every rank)
    with exit_code."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN and not launch_ranks.launched_by_mpi():
        log.error("sweep job %d failed; the jobs after it still run, and the sweep ends non-zero", hydra_cfg.job.num)
        _failed_sweep_jobs.append((f"sweep job {hydra_cfg.job.num} ({hydra_cfg.runtime.output_dir}): {summary}",
                                   exit_code))
        return
    distributed.tell_others_this_rank_failed()
    distributed.abort_job(exit_code)


def name_failed_sweep_jobs() -> None:
    for failure, _ in _failed_sweep_jobs:
        print(f"failed: {failure}", file=sys.stderr)


def sweep_exit_code() -> int:
    """After the sweep: names each failed job on stderr; 2 where every failure was a user error, 1 else, 0 if none."""
    name_failed_sweep_jobs()
    if not _failed_sweep_jobs:
        return 0
    return 2 if all(exit_code == 2 for _, exit_code in _failed_sweep_jobs) else 1


# What keeps a file named in the config from being opened, besides its absence: no permission (to it or a folder on its
# way), a name past the file system's limit, a folder where a file should be or the reverse, a read-only file system.
UNUSABLE_PATH = (errno.EACCES, errno.EPERM, errno.ENAMETOOLONG, errno.EISDIR, errno.ENOTDIR, errno.ELOOP, errno.EROFS)


def user_error_message(error: Exception, run_dir: Path, continues: str = CONTINUE_RUN) -> str | None:
    """One line for what the user fixes (a missing file, one that cannot be opened or written, a value refused, a full
    disk), or None for anything else, which gets its traceback. continues: what continues the run once a write that
    failed can be made (continue_with's)."""
    if isinstance(error, OSError) and (error.errno in FULL_DISK or refused_write(error)):
        return write_error_message(error, run_dir, continues)
    if isinstance(error, FileNotFoundError | ValueError):
        return config_error_line(error)
    if isinstance(error, OSError) and error.errno in UNUSABLE_PATH and error.filename:
        return f"cannot open {error.filename}: {error.strerror}"
    return None


def refused_write(error: OSError) -> bool:
    """A run record or manifest (data.files.errors_naming) that its folder no longer takes: made read-only, on a file
    system mounted read-only, or removed (ENOENT) as the run went on."""
    return came_of_writing(error) and error.errno in (*UNUSABLE_PATH, errno.ENOENT)


def write_error_message(error: OSError, run_dir: Path, continues: str) -> str:
    full_disk = error.errno in FULL_DISK
    free = space_left(run_dir, f"in {run_dir}") if full_disk else ""
    if error.errno == errno.EFBIG:
        free += file_size_limit()
    return (f"{write_error_line(error)}{free}; checkpoints are written whole or not at all, so once "
            f"{'there is space' if full_disk else 'it can be written'} {continues} continues from the last one")


def continue_with(cfg: DictConfig) -> str:
    """What continues a run that train.max_steps or a stop signal stopped, for the trainer's log line."""
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        return CONTINUE_RUN
    # Its run_name by value: the launch scripts' default RUN_NAME is the time they started.
    return (f"the same sweep (its -m and overrides; train.max_steps and train.epochs may change) with "
            f"train.resume=auto under the same {RUN_NAME_SETTING}, {cfg.run_name},")


def data_workers_failure(error: DataWorkersTimedOut | DataWorkerDied | SharedMemoryFull, cfg: DictConfig) -> str:
    """What befell the data-loading workers, and what may keep it from happening again."""
    if isinstance(error, SharedMemoryFull):
        return (f"a data-loading worker could not hand its batch over in shared memory ({error.reason}): /dev/shm is "
                f"full, or a file size limit (ulimit -f) too low; train.num_workers=0 ({cfg.train.num_workers} here: "
                "batches made in the training process itself) or a larger /dev/shm (docker run --shm-size) may keep "
                "it from happening")
    if isinstance(error, DataWorkersTimedOut):
        return (f"{error} (distributed.timeout_s): one is stuck (on a file system that stopped answering, or stopped) "
                "or far too slow, and they were killed")
    if error.signal == signal.SIGKILL:
        return (f"{error}, which the kernel's out-of-memory killer sends: fewer train.num_workers "
                f"({cfg.train.num_workers} here), a smaller train.global_batch_size or train.eval_batch_size, or more "
                "memory may keep it alive")
    return str(error)


def other_ranks_failure(error: Exception, timeout_s: float) -> str | None:
    """One line for a gloo collective that failed for want of other ranks, which its error and traceback do not name:
    those that ended the job on an error of their own, or those that did not answer (stopped, hung) within the
    collectives' `timeout_s`. None for any other error, which gets its traceback."""
    answers = distributed.other_ranks_answers(error, timeout_s) or {}
    if failed := [rank for rank, said in answers.items() if said == distributed.ENDED_ON_ITS_OWN_ERROR]:
        return (f"{', '.join(f'rank {rank}' for rank in failed)} ended the job on an error of its own, which its line "
                "gives; this rank's collective failed with it")
    if silent := distributed.silent_ranks_waited_for(error, answers):
        return (f"no answer from {', '.join(f'rank {rank}' for rank in silent)}: this rank's collective waited "
                "distributed.timeout_s for them, and they did not say since that one of theirs had timed out too "
                "(stopped, hung, or busy elsewhere)")
    return None


def summary_line(result: dict) -> str:
    """The job's last line on stdout: the run's final test WER, or where train.max_steps stopped it before its end,
    the step it stopped at and the last evaluation's figures (inside an epoch, not the saved model's)."""
    figures = f"test WER {result['wer']:.2f}%  CER {result['cer']:.2f}%" if "wer" in result else ""
    if "wer" in result and math.isnan(result["wer"]):  # a rate over no utterances
        figures = "test WER and CER none: no test utterance could be decoded"
    if "stopped_at_step" not in result:
        return f"final {figures}  (epoch {result['epoch']})"
    if not figures:
        return f"stopped at step {result['stopped_at_step']} (train.max_steps), before this job's first evaluation"
    return (f"stopped at step {result['stopped_at_step']} (train.max_steps); the last evaluation, after epoch "
            f"{result['epoch']} (step {result['step']}): {figures}")


def leave_the_log_to_rank_0(rank: int) -> None:
    """Hydra gives every rank the console and the run's log file, where rank 0 speaks for the job (its lines count
    every rank's work). Other ranks add only their start line (trainer.distributed: their device and rendezvous) and
    their warnings and errors, tagged with their rank, rather than each line again untagged; Hydra's own lines of a
    sweep ("Launching 2 jobs locally", each job's "#0 : ...") are rank 0's too. Called before Hydra starts, for those
    lines, which come before the first job's, and again in each job."""
    if rank == 0:
        return
    # Hydra's logging config names no "hydra" logger and leaves loggers it does not name as they are: this level holds.
    logging.getLogger("hydra").setLevel(logging.WARNING)
    # Again for each job of a sweep: Hydra sets the root's level up anew for every job.
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger(distributed.__name__).setLevel(logging.INFO)
    if getattr(logging.getLogRecordFactory(), "tags_rank", False):  # tagged by an earlier call (before Hydra)
        return
    make_record = logging.getLogRecordFactory()

    def tagged_record(*args, **kwargs):
        record = make_record(*args, **kwargs)
        record.msg = f"[rank {rank}] {record.msg}"
        return record

    tagged_record.tags_rank = True
    logging.setLogRecordFactory(tagged_record)


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    # Hydra's console log goes to stdout, which a pipe or a batch job's log buffers: a line would land after the
    # progress shown on stderr since, or be lost with the job. A stdout closed (>&-, Python's None) leaves logging's
    # console handler on stderr, where the last line goes too (write_console_line).
    if sys.stdout is not None:
        sys.stdout.reconfigure(line_buffering=True)
    print_paths_printable(sys.stdout, sys.stderr)  # a path that is not UTF-8 as the tools and the log file name it
    leave_the_log_to_rank_0(launch_ranks.launcher_rank())
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        with log_above_progress_bars():
            result = train(cfg, run_dir, continue_with(cfg))
    except StoppedBeforeTraining as stopped:
        stop_now(str(stopped), stopped.signal, run_dir)
    except KeyboardInterrupt:  # a second Ctrl-C, or one before training began
        stop_now("interrupted by Ctrl-C", signal.SIGINT, run_dir)
    except (DataWorkersTimedOut, DataWorkerDied, SharedMemoryFull) as error:
        # No user error (exit 1), as a rank killed is none.
        message = f"{data_workers_failure(error, cfg)}; {continue_with(cfg)} continues the run from its last checkpoint"
        log.error("error on rank %d: %s", launch_ranks.launcher_rank(), message)
        end_job(1, message)
    except Exception as error:
        message = user_error_message(error, run_dir, continue_with(cfg))
        if message is not None:
            log.error("error on rank %d: %s", launch_ranks.launcher_rank(), message)
            end_job(2, message)
        elif summary := other_ranks_failure(error, cfg.distributed.timeout_s):
            log.error("error on rank %d: %s", launch_ranks.launcher_rank(), summary)
            end_job(1, summary)
        else:
            log.error("training failed on rank %d:\n%s", launch_ranks.launcher_rank(), traceback.format_exc())
            end_job(1, f"{type(error).__name__}: {error} (its traceback is above)")
    else:
        if "stop_signal" in result:
            name_failed_sweep_jobs()  # a sweep stopped here still names the jobs that failed before
            sys.exit(128 + result["stop_signal"])
        if result and launch_ranks.launcher_rank() == 0:  # every rank holds the same figures; one line says them
            write_console_line(summary_line(result))


def stop_now(what: str, number: signal.Signals, run_dir: Path) -> None:
    """Ends the run, a sweep included, on a signal that left it nothing to save, saying what the run directory holds,
    with 128 + the signal's number on every rank."""
    last = run_dir / "checkpoints" / "last.pt"
    log.error("%s; %s", what, f"{last} holds the run as of its last checkpoint"
              if last.exists() else "no checkpoint of this run was written")
    name_failed_sweep_jobs()
    distributed.abort_job(128 + number)


def end_job_before_mpi(leaving: SystemExit, overrides: list[str]) -> None:
    """A rank that leaves before it started MPI (Hydra refused an override, its run directory could not be made, a
    node whose conf/ differs) while the others wait for it in MPI_Init, where MPICH's mpiexec leaves them for ever:
    it starts MPI too and ends the job with its exit code. MPI_Init waits for every rank, so a job with another rank
    hung before MPI (stuck importing) ends past the timeout `overrides` give, as a rank's start does (ended_past)."""
    code = leaving.code if isinstance(leaving.code, int) or leaving.code is None else 1  # sys.exit("message"): 1
    if code and launch_ranks.launched_by_mpi() and "mpi4py.MPI" not in sys.modules:
        with distributed.ended_past(timeout_on_the_command_line(overrides), launch_ranks.launcher_rank()):
            distributed.abort_job(code)


def timeout_on_the_command_line(overrides: list[str]) -> float:
    """distributed.timeout_s as the last of `overrides` to set it gives it, where that is a number the config takes;
    its default otherwise. Read from the command line itself: a rank leaving before MPI may have no config."""
    for override in reversed(overrides):
        key, given, value = override.lstrip("+").partition("=")
        if key.strip() == "distributed.timeout_s" and given:
            try:
                seconds = float(value)
            except ValueError:
                break
            if 0 < seconds <= distributed.MAX_TIMEOUT_S:
                return seconds
            break
    return distributed.DEFAULT_TIMEOUT_S


if __name__ == "__main__":
    launch_ranks.refuse_unusable_launch()
    report_command_line_errors_in_one_line()
    let_info_stdout_failures_through()
    leave_the_log_to_rank_0(launch_ranks.launcher_rank())
    # Hydra's --help and --info print outside run_and_report (report_command_line_errors_in_one_line).
    with stdout_failures_end_the_tool():
        try:
            refuse_a_pickled_config(sys.argv[1:])
            main()
        except SystemExit as leaving:
            end_job_before_mpi(leaving, sys.argv[1:])
            raise
    sys.exit(sweep_exit_code())
