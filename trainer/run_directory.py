"""A Hydra callback (conf/train.yaml, hydra.callbacks) that checks run_name and makes the run's directory before Hydra
does, and the handler of the run's log file there.

Hydra makes it inside its own error handling, so one it cannot make (a file named `runs`, no permission, a full disk)
ended the job with a partial traceback and exit code 1; here it is one line naming it, and exit code 2, as the
trainer's other user errors are. A run_name that is no folder of runs/ (empty, `..`, a path) is refused the same way:
the run wrote into runs/ itself or the working directory.
"""
import logging
import os
import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def check_run_name(run_name) -> None:
    name = "" if run_name is None or isinstance(run_name, bool) else str(run_name)  # 1.5 parses as a float: a name
    if not name.strip() or set(name) <= {"."} or "/" in name or "\\" in name:
        print(f"error: run_name={run_name!r} must name one folder of runs/: a name, not empty, null or true/false, "
              "not dots alone, no / or \\", file=sys.stderr)
        sys.exit(2)


def link_to_nothing(path: str | os.PathLike) -> str | None:
    """Where `path` is a symbolic link to nothing (a scratch disk not mounted), a line saying so, naming its target:
    mkdir fails on such a link saying only 'File exists'."""
    if os.path.islink(path) and not os.path.exists(path):
        return f"{path} is a symbolic link to {os.readlink(path)}, which does not exist"
    return None


def make_or_exit(directory: str) -> None:
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        reason = link_to_nothing(error.filename) if isinstance(error, FileExistsError) else None
        if reason is None:
            reason = f"{error.strerror or error}" + (
                f" ({error.filename})" if error.filename and str(error.filename) != directory else "")
        print(f"error: cannot make the run directory {directory}: {reason}", file=sys.stderr)
        sys.exit(2)
    if not os.access(directory, os.W_OK | os.X_OK):  # one that exists already (a read-only file system, no permission)
        print(f"error: cannot write in the run directory {directory}", file=sys.stderr)
        sys.exit(2)


class MakeRunDirectory(Callback):
    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        check_run_name(config.run_name)
        make_or_exit(config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        check_run_name(config.run_name)
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
