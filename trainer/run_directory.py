"""A Hydra callback (conf/train.yaml, hydra.callbacks) that checks run_name (and a sweep's every job's config) and makes
the run's directory before Hydra does, and the handler of the run's log file there.

Hydra makes it inside its own error handling, so one it cannot make (a file named `runs`, no permission, a full disk)
ended the job with a partial traceback and exit code 1; here it is one line naming it, and exit code 2, as the
trainer's other user errors are. A run_name that is no folder of runs/ (empty, `..`, a path) is refused the same way:
the run wrote into runs/ itself or the working directory. So is a sweep one of whose jobs the trainer or Hydra would
refuse (model.depth=0,2; a misspelt key; a global batch its launcher's ranks cannot split), or two of whose jobs
would share a folder: as a refused run, it leaves nothing behind, where Hydra's sweeper wrote runs/NAME/multirun.yaml
first and the jobs before the refused one ran. A single run whose config the trainer would refuse is refused the same
way, before its folder is made (run_refusal): Hydra made it first, and each refused attempt left a folder holding only
Hydra's log. trainer.check_overrides runs these checks (check_run_name, sweep_refusal, run_refusal) before the launch
scripts' build.

Once the job runs, rank 0 holds the directory (hold_run_directory) so that no second job writes there meanwhile.
A sweep job's folder is named by its overrides (job_folder, the resolver conf/train.yaml's hydra.sweep.subdir calls).
"""
import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import socket
import stat
import sys
from pathlib import Path

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from data.files import standard_stream_writing_to
from trainer import launch_ranks
from trainer.config import RUN_NAME_SETTING, check_config, config_error_line, per_rank_batch_size
from trainer.inputs import check_inputs
from trainer.override_errors import print_refusal, refused_in_one_line
from trainer.resume import checkpoint_to_resume

log = logging.getLogger(__name__)


def check_run_name(config: DictConfig) -> None:
    """Exits 2 in one line where config.run_name names no folder of runs/, or is an interpolation that does not
    resolve (run_name=${nope}): Hydra resolved it next for the run's folder, in a traceback. It resolves as the run's
    folder does, Hydra's node readable (run_name=${hydra:runtime.choices.experiment})."""
    HydraConfig.instance().set_config(config)
    try:
        run_name = config.run_name
    except OmegaConfBaseException as error:
        print_refusal(config_error_line(error))
        sys.exit(2)
    name = "" if run_name is None or isinstance(run_name, bool) else str(run_name)  # 1.5 parses as a float: a name
    if not name.strip() or set(name) <= {"."} or "/" in name or "\\" in name:
        print_refusal(f"run_name={run_name!r} must name one folder of runs/: a name, not empty, null or true/false, "
                      "not dots alone, no / or \\")
        sys.exit(2)


def link_to_nothing(path: str | os.PathLike) -> str | None:
    """Where `path` is a symbolic link to nothing (a scratch disk not mounted), a line saying so, naming its target:
    mkdir fails on such a link saying only 'File exists'."""
    if os.path.islink(path) and not os.path.exists(path):
        return f"{path} is a symbolic link to {os.readlink(path)}, which does not exist"
    return None


def file_in_the_way(directory: str) -> Path | None:
    """`directory` itself or the folder on its way that is a file (a file named runs), of which mkdir said only 'Not a
    directory' or 'File exists', naming the run directory."""
    for path in (Path(directory), *Path(directory).parents):
        if path.exists() and not path.is_dir():
            return path
    return None


def why_not_made(error: OSError, directory: str) -> str:
    if isinstance(error, FileExistsError) and (reason := link_to_nothing(error.filename)):
        return reason
    if error.errno in (errno.ENOTDIR, errno.EEXIST) and (in_the_way := file_in_the_way(directory)):
        return f"{in_the_way} is a file, not a folder"
    return f"{error.strerror or error}" + (
        f" ({error.filename})" if error.filename and str(error.filename) != directory else "")


def make_or_exit(directory: str) -> None:
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        print_refusal(f"cannot make the run directory {directory}: {why_not_made(error, directory)}")
        sys.exit(2)
    if not os.access(directory, os.W_OK | os.X_OK):  # one that exists already (a read-only file system, no permission)
        print_refusal(f"cannot write in the run directory {directory}")
        sys.exit(2)
    if refused := run_file_refusal(directory):
        print_refusal(refused)
        sys.exit(2)


RUN_LOCK = ".lock"  # in the run directory: who holds it, for the message of a job it refuses
# The files a run or sweep opens in place in its directory, Hydra's log files (*.log) and the skip lists
# (skipped_*.jsonl, written to where a link leads, as a tool's output file is) besides: its lock, trainer.records'
# jobs.jsonl and Hydra's multirun.yaml. A symbolic link in their place is written through, and a pipe waits for a
# reader. The others it writes (config.yaml, metrics.jsonl, checkpoints) are replaced whole, link or pipe and all
# (data.files.write_whole).
WRITTEN_IN_PLACE = (RUN_LOCK, "jobs.jsonl", "multirun.yaml")
WRITTEN_IN_PLACE_PATTERNS = ("*.log", "skipped_*.jsonl")


def run_file_refusal(directory: str | os.PathLike) -> str | None:
    """A line naming what stands in `directory` in place of a file the run writes in place, or None:
    - a pipe (mkfifo, which tar and cp -a copy), or a link to one: opening it waits for a reader, which Hydra's log and
      jobs.jsonl did for ever, a first SIGTERM kept until training would begin (trainer.stop), and the lock was refused
      as 'cannot write in the run directory (None)'. One that is this process's own stdout or stderr (__main__.log ->
      /dev/stderr under `| tee`) has its reader, and is taken;
    - a symbolic link: the run wrote through it, onto the file it links to outside the run directory (.lock ->
      ~/.bashrc emptied it), where a run directory copied from elsewhere (tar, cp -a, rsync -a) held one. A link to a
      character device (/dev/null, /dev/full, a terminal's /dev/stderr) is taken: written through, it changes no file;
    - a folder: Hydra's log ended in a traceback, and the lock was refused naming neither itself nor the folder.
    """
    folder = Path(directory)
    named = (folder / name for name in WRITTEN_IN_PLACE)
    for path in [*named, *(path for pattern in WRITTEN_IN_PLACE_PATTERNS for path in sorted(folder.glob(pattern)))]:
        if path.is_fifo() and standard_stream_writing_to(path) is None:
            through = f" (a symbolic link to {os.readlink(path)})" if path.is_symlink() else ""
            return (f"{path}{through} is a pipe: the run writes {path.name} in place, and would wait for ever for a "
                    "reader of the pipe; remove it")
        if path.is_symlink() and not _is_a_stream(path):
            return (f"{path} is a symbolic link to {os.readlink(path)}: the run writes {path.name} in place, so it "
                    "would write that file instead; remove the link")
        if path.is_dir():
            return f"{path} is a folder: the run writes {path.name} in place, as a file; remove or rename the folder"
    return None


def _is_a_stream(path: Path) -> bool:
    try:
        mode = path.stat().st_mode
    except OSError:  # a link to nothing: writing creates its target
        return False
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


MAX_FOLDER_NAME = 240  # bytes: file systems take names of at most 255
LONG_VALUE = 32  # characters of an override's value past which a name too long gives it as a digest
OVERRIDE_START = re.compile(r",(?=[+~]?[A-Za-z_][\w.]*=)")  # a comma that starts the next key=value, not one in a list


def job_folder(override_dirname: str) -> str:
    """A sweep job's folder name (hydra.sweep.subdir) from its overrides, Hydra's hydra.job.override_dirname: sorted,
    so the same for the same job whatever the sweep's order, less the keys its exclude_keys names. A "/" in a value (a
    manifest's path) becomes "_", so the name is one folder. A name past MAX_FOLDER_NAME bytes first gives each value
    longer than LONG_VALUE (a path, mostly) as a digest, so that the short ones a sweep varies stay readable, then is
    cut, a digest of the whole appended. Two jobs of one sweep that these rules give one folder are refused before
    any job runs (sweep_refusal)."""
    name = override_dirname.replace("/", "_")
    if len(name.encode()) > MAX_FOLDER_NAME:
        name = ",".join(_value_as_digest(override) for override in OVERRIDE_START.split(name))
    if len(name.encode()) > MAX_FOLDER_NAME:
        digest = hashlib.sha256(name.encode()).hexdigest()[:16]
        name = name.encode()[:MAX_FOLDER_NAME - 17].decode(errors="ignore") + "-" + digest
    return name


def _value_as_digest(override: str) -> str:
    key, _, value = override.partition("=")
    return override if len(value) <= LONG_VALUE else f"{key}=#{hashlib.sha256(value.encode()).hexdigest()[:12]}"


OmegaConf.register_new_resolver("job_folder", job_folder, replace=True)


def sweep_jobs(config: DictConfig) -> list[list[str]]:
    """Each job's overrides, as Hydra's basic sweeper lists them: hydra.sweeper.params, then the command line's. Read
    as written: an interpolation in one (seed=${hydra:job.num}) is the job's to resolve, and resolved here it failed."""
    hydra = OmegaConf.to_container(config.hydra, resolve=False)
    overrides = [f"{key}={value}" for key, value in (hydra["sweeper"].get("params") or {}).items()]
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    return BasicSweeper.split_arguments(parser.parse_overrides(overrides + hydra["overrides"]["task"]), None)[0]


def sweep_refusal(config: DictConfig, world_size: int = 1, inputs: bool = False) -> str | None:
    """The first of a sweep's jobs that the trainer would refuse, in one line naming it, or None: each job's config
    composed as the sweeper will (Hydra's refusal of a job's overrides, a misspelt key, ends here in one line and exit
    code 2, through trainer.override_errors), its folder taken by no earlier job, its values checked as the job checks
    them (check_job_config, which with `inputs` checks the files it reads and the checkpoints in its folder too)."""
    loader = GlobalHydra.instance().config_loader()
    folders: dict[Path, int] = {}
    jobs = sweep_jobs(config)
    for number, overrides in enumerate(jobs):
        job = refused_in_one_line(lambda: loader.load_sweep_config(master_config=config, sweep_overrides=overrides))
        with open_dict(job):
            job.hydra.job.num = number  # as Hydra's launcher sets it: hydra.sweep.subdir and ${hydra:job.num} name it
        try:
            folder = claim_job_folder(job, number, folders)
            check_job_config(job, folder, world_size, inputs)
        except (FileNotFoundError, ValueError) as error:
            own = " ".join(override for override in overrides if not all(override in other for other in jobs))
            return f"sweep job {number}{f' ({own})' if own else ''}: {config_error_line(error)}"
    return None


def run_refusal(config: DictConfig, world_size: int = 1, inputs: bool = False) -> str | None:
    """What the trainer would refuse in a single run's config, in one line naming it, or None (check_job_config)."""
    try:
        check_job_config(config, Path(config.hydra.run.dir), world_size, inputs)
    except (FileNotFoundError, ValueError) as error:
        return config_error_line(error)
    return None


def check_job_config(job: DictConfig, folder: Path, world_size: int = 1, inputs: bool = False) -> None:
    """check_config on the config a job's task gets: a copy without its hydra node, which stays readable through
    ${hydra:...} as in the job; `job` itself keeps it. Its global batch too, as `world_size` ranks split it: the
    launch scripts give their count (trainer.check_overrides --world-size), the callback its launcher's. With
    `inputs`, the files it reads too (trainer.inputs.check_inputs), and the checkpoint train.resume names, or a fresh
    run over the checkpoints its `folder` holds, as trainer.resume.checkpoint_to_resume refuses them: as
    trainer.check_overrides asks on the launching node. The callback, on every rank, leaves them to the run, whose
    ranks past 0 read no AN4 source of their own, and which reads the checkpoints only once every rank has started."""
    HydraConfig.instance().set_config(job)
    task = job.copy()
    with open_dict(task):
        del task["hydra"]
    check_config(task)
    per_rank_batch_size(task, world_size)
    if inputs:
        check_inputs(task)
        checkpoint_to_resume(job.train.resume, folder)


def claim_job_folder(job: DictConfig, number: int, folders: dict[Path, int]) -> Path:
    """Refuses a sweep job whose folder an earlier job of the same sweep took (folders: each folder, and the job that
    took it): one would resume or overwrite the other's run. It happens where the sweep varies a key that job folder
    names leave out (train.max_steps...). Refuses one whose folder holds a link, a pipe or a folder in place of a
    file the job writes in place (run_file_refusal) too. Returns the job's folder."""
    folder = Path(job.hydra.sweep.dir) / job.hydra.sweep.subdir
    if refused := run_file_refusal(folder):
        raise ValueError(refused)
    earlier = folders.setdefault(folder, number)
    if earlier != number:
        excluded = ", ".join(job.hydra.job.config.override_dirname.exclude_keys)
        raise ValueError(f"{folder} is job {earlier}'s folder too: sweep job folders are named by the overrides less "
                         f"{excluded}, so a sweep over one of those puts its jobs in one folder (sweep over it in "
                         "separate runs, or set hydra.sweep.subdir, e.g. to ${hydra.job.num})")
    return folder


class MakeRunDirectory(Callback):
    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        check_run_name(config)
        # Every rank checks the same config against the same count of ranks, so all of them refuse it alike.
        if refused := run_refusal(config, launch_ranks.launcher_world_size()):
            print_refusal(refused)
            sys.exit(2)
        make_or_exit(config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        check_run_name(config)
        # Hydra's callbacks take an exception for a warning and go on: the sweep would start, so it ends here.
        if refused := sweep_refusal(config, launch_ranks.launcher_world_size()):
            print_refusal(f"{refused}; no job of the sweep ran")
            sys.exit(2)
        make_or_exit(config.hydra.sweep.dir)


class LogFile(logging.FileHandler):
    """The run's log file (conf/train.yaml, hydra.job_logging). A line it cannot write (a full disk, a quota) is said
    once on stderr and left out, where logging printed a traceback of some 30 lines for every one, the trainer's own
    error line among them: the console keeps the whole log, and the next checkpoint ends the run in one line if the
    disk has no space for it either."""

    warned = False

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)
        elif not self.warned:
            self.warned = True
            print(f"warning: cannot write the log file {self.baseFilename} ({error.strerror or error}): the lines it "
                  "cannot take are on the console only", file=sys.stderr)


@contextlib.contextmanager
def hold_run_directory(run_dir: Path, is_main: bool):
    """Rank 0 holds the run directory for the whole job: a second job there (launched twice, or requeued while the
    first still runs) is refused with ValueError before it changes anything, rather than both writing checkpoints and
    metrics.jsonl over each other. A POSIX record lock (lockf), which the kernel releases when the job's process ends
    however it ends (killed, out of memory): no stale lock outlives it. Not an flock, which forked data-loading
    workers share: killed alone, the trainer left its lock to them for the seconds they took to notice. A
    checkpoints/ or tensorboard/ that cannot be written is refused here too, before training (check_run_folder)."""
    if not is_main:
        yield
        return
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = open(run_dir / RUN_LOCK, "a+")
    except OSError as error:  # the directory, or its lock: a folder named .lock was refused naming neither
        raise ValueError(f"cannot write in the run directory {run_dir} ({error.strerror}: {error.filename})") from None
    with lock:
        try:
            fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):  # held: EAGAIN or EACCES, as the system reports it
            lock.seek(0)
            raise ValueError(f"{run_dir} is in use by another job ({lock.read().strip() or 'its process unknown'}): "
                             "two jobs there would overwrite each other's checkpoints and metrics; wait for it to end, "
                             f"or give this run another {RUN_NAME_SETTING}") from None
        except OSError as error:  # a file system without locks: run as before, unguarded
            log.warning("cannot lock %s (%s): nothing stops a second job in this run directory", lock.name,
                        error.strerror)
        lock.truncate(0)
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}")
        lock.flush()
        for folder, written in (("checkpoints", "its checkpoints"), ("tensorboard", "its TensorBoard events")):
            check_run_folder(run_dir / folder, written)
        yield


def check_run_folder(folder: Path, written: str) -> None:
    """ValueError where the run could not write `written` in `folder`, a folder of the run directory: a symbolic link
    to nothing, a file (or a pipe), a folder it may not write in. The run makes the folder only when it first writes
    there: the first checkpoint failed an epoch's work in, and TensorBoard's writer in a traceback."""
    if reason := link_to_nothing(folder):
        raise ValueError(f"{reason}: the run writes {written} there")
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is not a folder: the run writes {written} there")
    writable = folder if folder.exists() else folder.parent
    if not os.access(writable, os.W_OK | os.X_OK):
        raise ValueError(f"{writable} cannot be written by this job (its permissions, or a read-only file system): "
                         f"the run writes {written} in {folder}")
