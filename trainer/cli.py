"""What the trainer's command-line tools share: argument types (argparse refuses a bad value, naming its argument,
before any work starts), writing their output files, and how they end when interrupted."""
import argparse
import atexit
import contextlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from data.cli import (Terminated, discard, input_path, raise_terminated, signals_raise,
                      stdout_failures_end_the_tool, stopped_line)
from data.files import FULL_DISK, is_stream, standard_stream_writing_to, write_out, write_whole


class _LineInOneWrite(tqdm):
    """tqdm whose write() passes a log line and its newline on together. tqdm's own writes them apart, and each
    reached the stream's file on its own: under mpiexec, which merges the ranks' output, another rank's line came
    between them, two lines glued into one and an empty one after."""

    @classmethod
    def write(cls, s, file=None, end="\n", nolock=False):
        try:
            super().write(s + end, file=file, end="", nolock=nolock)
        except BrokenPipeError:
            # The console's reader ended (`| head`): logging printed a traceback for each later line, and the run's
            # last line failed a finished run. The stream goes on into /dev/null; the run's log file keeps every line.
            discard(file or sys.stdout)
        except OSError as error:
            if error.errno not in FULL_DISK:
                raise
            # The console on a full disk (`> train.out`): logging printed a traceback for each later line, and the
            # run's last line failed a finished run, exit code 2. Said once: the stream goes on into /dev/null first.
            discard(file or sys.stdout)
            print(f"warning: cannot write the console ({error.strerror}): the run's log file has its lines",
                  file=sys.stderr)


def log_above_progress_bars():
    """A context in which log lines go above a tqdm progress bar, not glued to its end, each line in one write."""
    return logging_redirect_tqdm(tqdm_class=_LineInOneWrite)


def write_console_line(line: str) -> None:
    """A line of the trainer's own on the console, stdout (stderr where stdout is closed), written as the log's lines
    are (log_above_progress_bars): dropped where the console's reader has ended (`| head`) or its disk is full, which
    failed a finished run on its last line."""
    _LineInOneWrite.write(line, file=lines_stream())


def int_at_least(minimum: int, at_most: int | None = None) -> Callable[[str], int]:
    """An argument type: an integer of at least `minimum` (and at most `at_most`, where given), another refused naming
    it."""
    def integer(text: str) -> int:  # argparse names the function in "invalid integer value: 'x'"
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {value}")
        if at_most is not None and value > at_most:
            raise argparse.ArgumentTypeError(f"must be at most {at_most}, not {value}")
        return value
    return integer


positive_int = int_at_least(1)


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text}")
    return value


def seconds_up_to(maximum: float) -> Callable[[str], float]:
    """An argument type: a positive number of seconds up to `maximum`, another refused naming it."""
    def seconds(text: str) -> float:
        value = finite_float(text)
        if not 0 < value <= maximum:
            raise argparse.ArgumentTypeError(f"must be a positive number of seconds up to {maximum:g}, not {text}")
        return value
    return seconds


def output_file(text: str) -> str:
    """A file to write, in a folder that exists and takes it: found out before the work whose result it would hold.
    A symbolic link is judged by its target, which is what gets written. An empty one (an unset shell variable) is
    refused as such, where it read as the current folder ("is a folder; name a file in it"). "-", which other
    programs take for stdout, is refused rather than taken for a file of that name (`--out - | gzip` gzipped
    nothing)."""
    if text == "-":
        raise argparse.ArgumentTypeError("'-' is no file name here: /dev/stdout writes to stdout")
    check_names_no_folder(input_path(text))
    path = Path(text).resolve()
    try:
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{path} is a folder; name a file in it")
        if not path.parent.is_dir():
            raise argparse.ArgumentTypeError(f"no folder {path.parent}")
        if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise argparse.ArgumentTypeError(f"{path} cannot be written (permissions)")
    except OSError as error:  # a name past the file system's limit: argparse would let it out as a traceback
        raise argparse.ArgumentTypeError(f"{path} cannot be written: {error.strerror or error}") from None
    return text


def check_names_no_folder(text: str) -> None:
    """Refuses an output path that ends in "/", a folder yet to be made (`--json results/`): Path drops the "/", and a
    file of the folder's name was written."""
    if text.endswith(os.sep):
        raise argparse.ArgumentTypeError(f"{text} names a folder; name a file in it")


def json_output(text: str) -> str:
    """The benchmarks' --json: an output_file whose missing folders are made now, so that neither a folder named in its
    place nor one that cannot be made is found out only after the measurements the file would hold. "-", which other
    programs take for stdout, is refused as output_file refuses it."""
    check_names_no_folder(text)  # before its folders are made
    try:
        Path(text).resolve().parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot make the folder of {text}: {error.strerror or error}") from None
    return output_file(text)


# Where a benchmark writes the JSON no --json names, in place of results/ beside the script: tests point it at a folder
# of their own, and it moves the results of a checkout that cannot be written in.
RESULTS_FOLDER_VARIABLE = "PRNN_BENCHMARK_RESULTS"
# The end of each benchmark's --json help.
DEFAULT_JSON_HELP = (f"; without it, a new file in benchmarks/results/ (or ${RESULTS_FOLDER_VARIABLE}) named after "
                     "the script and the UTC time")
# The end of json_file's refusals: where the results folder cannot be written in (a read-only checkout), how to
# run the benchmark all the same.
JSON_ELSEWHERE = f"; --json PATH or {RESULTS_FOLDER_VARIABLE}=DIR puts the JSON elsewhere"
MAX_RUNS_A_SECOND = 1000  # of one script: past it, a refusal where a loop over taken names would seem to hang


def json_file(given: str | None, script_file: str) -> str:
    """Where a benchmark writes its JSON: the --json file `given`, else a new file in the results/ folder beside the
    script (made where missing; $PRNN_BENCHMARK_RESULTS where set), named after the script and the UTC time,
    `rnn_kernels-20261206-031500.json`, so that a measurement is not lost to a terminal's scrolled-away table. It is
    created now, empty, to take the name: a second run in the same second takes `...-031500-2.json`, where it would
    have found the name free and written over the first run's file. A run that ends before it writes anything removes
    it, at exit: one that a signal kills, or MPI aborts, leaves it empty. CannotWrite naming the folder or the file
    where either cannot be made."""
    if given is not None:
        return given
    script = Path(script_file)
    folder = Path(os.environ.get(RESULTS_FOLDER_VARIABLE) or script.resolve().parent / "results")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CannotWrite(f"cannot make the folder {folder}: {error.strerror or error}{JSON_ELSEWHERE}") from None
    stem = f"{script.stem}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    for count in range(1, MAX_RUNS_A_SECOND + 1):
        path = folder / (f"{stem}.json" if count == 1 else f"{stem}-{count}.json")
        try:
            path.open("x").close()
        except FileExistsError:
            continue  # another run's, started in the same second
        except OSError as error:
            raise CannotWrite(f"cannot write {path}: {error.strerror or error}{JSON_ELSEWHERE}") from None
        atexit.register(_remove_if_empty, path)
        return str(path)
    raise CannotWrite(f"cannot write {folder / stem}.json: it and {MAX_RUNS_A_SECOND - 1} more of that second exist"
                      f"{JSON_ELSEWHERE}")


def _remove_if_empty(path: Path) -> None:
    """A results file that json_file took and its run left empty (it ended before any result): nothing to keep."""
    with contextlib.suppress(OSError):
        if path.stat().st_size == 0:
            path.unlink()


class GivenOnce(argparse.Action):
    """The action of a flag given once: argparse keeps a repeated flag's last values, so that `--manifest a.jsonl
    --manifest b.jsonl` counted b's transcripts alone, without a word. A repeat is refused (refuse_repeat)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, self.default) is not self.default:  # set by an earlier use of the flag
            self.refuse_repeat(parser, values, option_string)
        setattr(namespace, self.dest, values)

    def refuse_repeat(self, parser, values, option_string):
        raise argparse.ArgumentError(self, f"is given more than once: name all its values after one {option_string}")


class EachOnce(GivenOnce):
    """The action of a list flag (nargs="+") given once, whose values are each given once: a repeat, `--batches 4 4`,
    would be measured or run twice. It is refused naming the value."""

    def __call__(self, parser, namespace, values, option_string=None):
        repeated = [value for index, value in enumerate(values) if value in values[:index]]
        if repeated:
            raise argparse.ArgumentError(self, f"{repeated[0]} is given more than once")
        super().__call__(parser, namespace, values, option_string)


def check_not_an_input(path: str | None, inputs: list[str]) -> None:
    """ValueError where the output file `path` is one of the tool's `inputs`: asked before the work, whose result would
    destroy it."""
    if path is not None and any(Path(path).resolve() == Path(given).resolve() for given in inputs):
        raise ValueError(f"{path} is also an input of this command: writing it would destroy it")


class CannotWrite(ValueError):
    """An output file a tool cannot write, in one line naming it, which run_tool prints as the tool's error."""


def write_output(path: str, text: str, so_far: bool = False) -> None:
    """Writes `text` to `path` whole or not at all (beside it, then renamed: a full disk leaves an earlier file as it
    was), or straight into a stream (a pipe or terminal: /dev/stdout); CannotWrite naming the file where it cannot be
    written, BrokenPipeError where a stream's reader stopped early. A file name in `text` that is not UTF-8
    (b"\\xff.wav", which Python holds as "\\udcff.wav") is written as its own bytes. `so_far`: the results up to now
    of a long run, which writes them all again when it ends; a file keeps them should the run be cut short, while a
    stream, which cannot take them back, is left for the last."""
    if so_far and is_stream(path):
        return
    with cannot_write(path):
        write_out(path, text.encode("utf-8", errors="surrogateescape"))


def write_results(path: str, value, so_far: bool = False) -> None:
    """A benchmark's results as JSON, written as write_output writes text, in the one layout every script's file has."""
    write_output(path, json.dumps(value, indent=1) + "\n", so_far)


def write_binary_output(path: str, write_into: Callable[[BinaryIO], object]) -> None:
    """A file of bytes (a plot) that `write_into(file)` writes, whole or not at all as write_output writes text: a full
    disk or a Ctrl-C mid-write leaves an earlier file as it was. CannotWrite naming it where it cannot be written."""
    with cannot_write(path):
        write_whole(Path(path).resolve(), write_into)


@contextlib.contextmanager
def cannot_write(path: str | None):
    """An OSError inside as CannotWrite, in one line naming `path`; a BrokenPipeError let through."""
    try:
        yield
    except BrokenPipeError:
        raise  # the reader stopped early (`| head`), which run_tool ends quietly: not a file that cannot be written
    except OSError as error:
        raise CannotWrite(f"cannot write {path}: {error.strerror or error}") from None


def lines_stream(*outputs: str | None):
    """Where a tool prints its own lines (what it does, what it wrote, trainer.evaluate's WER): stdout, or stderr where
    one of its output files `outputs` (None: not given) is stdout (--out /dev/stdout | gzip), whose reader would find
    them in the middle of the file, or where stdout is closed (>&-: Python's None, into which print() dropped the
    WER)."""
    if sys.stdout is None:
        return sys.stderr
    written_to_stdout = any(out is not None and standard_stream_writing_to(out) is sys.stdout for out in outputs)
    return sys.stderr if written_to_stdout else sys.stdout


def say_written(path: str) -> None:
    """A tool's last line, "wrote PATH", once its output file is written: on its lines_stream, so that a JSON written
    to stdout ends it."""
    print(f"wrote {path}", file=lines_stream(path))


def run_tool(main: Callable[[], int]) -> int:
    """A tool's exit code from its `main`, which a Ctrl-C ends in one line (exit 130, not a traceback), a SIGTERM too
    (exit 143: Python's default ended it without a word), a reader that stops early (`| head`) quietly (exit 1), and
    an output file or a stdout on a full disk in one line (exit 2)."""
    previous = signal.getsignal(signal.SIGTERM)  # end_at_once_on_a_signal's, where the tool took it over at its start
    signals_raise()
    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        with stdout_failures_end_the_tool():
            return main()
    except CannotWrite as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated) as stopped:
        line, code = stopped_line(stopped)
        print(line, file=sys.stderr)
        return code
    finally:
        signal.signal(signal.SIGTERM, previous)
