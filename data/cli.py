"""What every command-line tool shares that data.prepare needs too, here in data, which imports no other part of the
project (trainer.cli holds the rest): how a Ctrl-C or a SIGTERM ends a tool, in one line, exit code 130 (128 + SIGINT)
or 143 (128 + SIGTERM), not a traceback or nothing at all; how stdout's failures end it, quietly where its reader stops
early (`| head`) and in one line where it is on a full disk; the paths it is given, and whether its progress shows as
a bar or as lines."""
import argparse
import contextlib
import os
import signal
import sys

from data.files import FULL_DISK

INTERRUPTED = "interrupted by Ctrl-C"
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT
TERMINATED = "terminated by SIGTERM"
TERMINATED_EXIT_CODE = 128 + signal.SIGTERM
# Without a bar (a pipe, a SLURM or nohup log), a tool logs a line on its progress this often: as training's
# evaluations do every train.progress_line_s (60 by default too).
PROGRESS_LINE_S = 60


def input_path(text: str) -> str:
    """A path, not the empty string that an unset shell variable gives (--lm "$LM"): the tools took it as no file
    given and went on without one, and data.prepare as the current folder, writing its manifests there."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path (an unset shell variable?)")
    return text


def shows_a_progress_bar(stream) -> bool:
    """Whether a tqdm bar drawn on `stream` is seen: a terminal that has a width. One of 0 columns, a terminal no one
    gave a size (`docker run -t` or a Kubernetes pod's tty with none attached, `script -c`), is where tqdm draws
    nothing at all: there, as in a pipe, a tool logs a line on its progress every while instead. A stream the tool
    started without (`2>&-`), which Python gives as None, shows none."""
    return stream is not None and stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0


def end_at_once_on_a_signal() -> None:
    """A tool calls this before its imports (torch's take seconds), in which a Ctrl-C printed a traceback from inside
    them and a SIGTERM ended the tool without a word: either ends it there in the tools' line and exit code, until
    signals_raise. A tool started with Ctrl-C ignored keeps ignoring it (ctrl_c_ignored)."""
    if not ctrl_c_ignored():
        signal.signal(signal.SIGINT, _ended_while_importing)
    signal.signal(signal.SIGTERM, _ended_while_importing)


def ctrl_c_ignored() -> bool:
    """Whether Ctrl-C (SIGINT) is ignored: only as this process started (nothing here ignores it in a process that
    takes it), as a non-interactive shell starts `tool &` (a script's background job), or as some schedulers do. A
    Ctrl-C that the terminal sends to the whole process group, meant for the foreground job, must leave such a process
    running, as it leaves any program that does not take SIGINT over; Python itself keeps the ignore."""
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def _ended_while_importing(number: int, frame) -> None:
    print(INTERRUPTED if number == signal.SIGINT else TERMINATED, file=sys.stderr, flush=True)
    os._exit(128 + number)  # not SystemExit: code in the middle of an import could catch it and go on


class Terminated(BaseException):
    """SIGTERM to a tool (kill, a scheduler's end of a job), raised where the tool is as KeyboardInterrupt is for a
    Ctrl-C: a BaseException, which a tool's `except Exception` lets through."""


def raise_terminated(number: int, frame) -> None:
    raise Terminated


def signals_raise() -> None:
    """Once the imports are done, where the tool took the signals over (end_at_once_on_a_signal): a Ctrl-C raises
    KeyboardInterrupt again, and a SIGTERM Terminated, for the tool to end in its own way (the manifest or the results
    so far kept as they were), in the line stopped_line gives."""
    if signal.getsignal(signal.SIGINT) is _ended_while_importing:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) is _ended_while_importing:
        signal.signal(signal.SIGTERM, raise_terminated)


def stopped_line(stopped: KeyboardInterrupt | Terminated) -> tuple[str, int]:
    """The line a tool ends on, and its exit code, where a Ctrl-C or a SIGTERM stopped it (signals_raise)."""
    if isinstance(stopped, Terminated):
        return TERMINATED, TERMINATED_EXIT_CODE
    return INTERRUPTED, INTERRUPTED_EXIT_CODE


@contextlib.contextmanager
def stdout_failures_end_the_tool():
    """Ends the process where stdout fails as the block prints: in silence, exit code 1, where its reader stops early
    (`| head`), and in one line, exit code 2, where it is a file on a full disk (`> file`). What the block leaves in
    stdout's buffer is written as it ends, a SystemExit's included (argparse's and Hydra's --help): at Python's exit,
    either was "Exception ignored ... OSError", exit code 120."""
    try:
        try:
            yield
        finally:
            if sys.stdout is not None:  # None: closed as the process started (>&-)
                sys.stdout.flush()
    except BrokenPipeError:
        discard(sys.stdout)
        sys.exit(1)
    except OSError as error:
        if not is_stdouts_full_disk(error):
            raise
        print(f"error: cannot write stdout: {error.strerror}", file=sys.stderr)
        discard(sys.stdout)
        sys.exit(2)


def is_stdouts_full_disk(error: OSError) -> bool:
    """Whether `error` is stdout's on a full disk: a file the tool opens is named in its error, a print's write() names
    none."""
    return error.filename is None and error.errno in FULL_DISK


def discard(stream) -> None:
    """Sends what `stream` (stdout, stderr) writes from now on to /dev/null: its reader stopped early or its disk is
    full, and each later write, Python's flush of it as it exits included, would fail again."""
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), stream.fileno())
