"""The command-line tools' shared behaviour: Ctrl-C, output files written whole and never over an input, paths that
are not UTF-8, inputs they cannot open, progress bars."""
import argparse
import errno
import fcntl
import importlib
import io
import logging
import os
import re
import shlex
import signal
import struct
import subprocess
import sys
import termios
import time
import wave

import pytest
import torch

from conftest import REPO_ROOT, small_checkpoint
from data.cli import end_at_once_on_a_signal, raise_terminated, shows_a_progress_bar, signals_raise
from data.manifest import Utterance, write_manifest
from trainer import checkpoint, cli
from trainer.records import open_metrics


def test_a_progress_bar_shows_on_a_terminal_that_has_a_width_only(tmp_path):
    """tqdm draws nothing on a terminal of 0 columns (one no one gave a size), as it draws nothing worth reading in a
    file: both get log lines instead."""
    controller, terminal = os.openpty()
    try:
        with open(terminal, "w", closefd=False) as stream, open(tmp_path / "log", "w") as file:
            assert not shows_a_progress_bar(stream) and not shows_a_progress_bar(file)
            fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
            assert shows_a_progress_bar(stream)
    finally:
        os.close(terminal)
        os.close(controller)



def test_a_stream_the_tool_started_without_shows_no_progress_bar():
    # `python -m data.prepare ... 2>&-` (a cron job): Python gives a closed stderr as None, and data.prepare,
    # trainer.evaluate and the trainer ended in an AttributeError's traceback where they asked whether to draw a bar.
    assert not shows_a_progress_bar(None)

class WritesSeen(io.StringIO):
    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def test_a_log_line_above_the_progress_bar_is_one_write_with_its_newline(monkeypatch):
    """mpiexec merges the ranks' output as their writes come: a line written apart from its newline (tqdm's write)
    had another rank's line glued to it."""
    stdout = WritesSeen()
    monkeypatch.setattr(sys, "stdout", stdout)  # tqdm's redirect takes over the console's handlers alone
    handler = logging.StreamHandler(sys.stdout)
    logger = logging.getLogger("test_tools.one_write")
    monkeypatch.setattr(logging.getLogger(), "handlers", [handler])
    logger.setLevel(logging.INFO)
    with cli.log_above_progress_bars():
        logger.info("epoch 1: loss 161.139")
    assert [text for text in stdout.writes if text] == ["epoch 1: loss 161.139\n"]


def test_a_tools_output_may_be_a_stream(tmp_path):
    # /dev/stdout into a pipe: written beside and renamed, it ended in "cannot write /dev/stdout" after the work.
    (tmp_path / "m.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": "yes no"}\n')
    result = subprocess.run([sys.executable, "-m", "trainer.lm", "--manifest", str(tmp_path / "m.jsonl"), "--out",
                             "/dev/stdout"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "\\data\\\nngram 1=5\n" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("mode", ["w", "a"])
def test_a_tools_output_to_dev_stdout_under_a_redirection_keeps_the_files_lines(tmp_path, mode):
    # `--out /dev/stdout >> log.txt`: written beside the file and renamed over it, the lines >> had appended to were
    # lost, and so were the tool's own lines, before and after (now on stderr: lines_stream).
    (tmp_path / "m.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": "yes no"}\n')
    log = tmp_path / "log.txt"
    log.write_text("an earlier line\n")
    with open(log, mode) as stdout:
        result = subprocess.run([sys.executable, "-m", "trainer.lm", "--manifest", str(tmp_path / "m.jsonl"),
                                 "--out", "/dev/stdout"], cwd=REPO_ROOT, stdout=stdout, stderr=subprocess.PIPE,
                                text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    earlier = "an earlier line\n" if mode == "a" else ""
    written = log.read_text()
    assert written.startswith(f"{earlier}\\data\\\nngram 1=5\n") and written.endswith("\\end\\\n"), written
    assert result.stderr == "counting the 3-grams of 1 transcript\nwrote /dev/stdout: a 3-gram model of 1 transcript\n"


def test_an_output_file_that_could_not_be_written_is_refused_before_the_work(tmp_path, monkeypatch):
    assert cli.output_file(str(tmp_path / "x.arpa")) == str(tmp_path / "x.arpa")
    with pytest.raises(argparse.ArgumentTypeError, match=f"{tmp_path} is a folder; name a file in it"):
        cli.output_file(str(tmp_path))
    # A folder yet to be made (`--json results/`) was written as a file named results.
    with pytest.raises(argparse.ArgumentTypeError, match=f"^{tmp_path}/results/ names a folder; name a file in it$"):
        cli.output_file(f"{tmp_path}/results/")
    assert not (tmp_path / "results").exists()
    with pytest.raises(argparse.ArgumentTypeError, match=f"^{tmp_path}/new/results/ names a folder; name a file in"):
        cli.json_output(f"{tmp_path}/new/results/")
    assert not (tmp_path / "new").exists()  # a refused --json makes none of its folders
    too_long = tmp_path / ("x" * 300)  # a traceback out of argparse, which takes only its own errors from a type
    with pytest.raises(argparse.ArgumentTypeError, match=f"{too_long} cannot be written: File name too long$"):
        cli.output_file(str(too_long))
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # what a folder not the user's answers
    with pytest.raises(argparse.ArgumentTypeError, match="x.arpa cannot be written"):
        cli.output_file(str(tmp_path / "x.arpa"))


def test_an_output_file_that_is_read_only_is_refused_though_its_folder_takes_files(tmp_path, monkeypatch):
    """A file is written beside its target and renamed over it, which its folder allows over a read-only file: without
    the check of the file itself a file kept read-only was replaced (a mutant that checked the folder alone passed
    every test). As root os.access grants everything: a file not the user's is played."""
    target = tmp_path / "kept.tsv"
    monkeypatch.setattr(os, "access", lambda path, mode: str(path) != str(target))
    assert cli.output_file(str(target)) == str(target)  # not there yet: its folder's answer alone counts
    target.write_text("kept\n")
    with pytest.raises(argparse.ArgumentTypeError, match=f"^{target} cannot be written \\(permissions\\)$"):
        cli.output_file(str(target))


def test_a_number_of_seconds_is_taken_up_to_its_limit_and_not_past_it():
    """benchmarks.scaling's --timeout-s takes what distributed.timeout_s takes: its limit too (a mutant that refused
    it passed every test), not 0 or more."""
    seconds = cli.seconds_up_to(1e9)
    assert seconds("1e9") == 1e9 and seconds("0.5") == 0.5
    for refused in ("0", "1.000001e9", "inf"):
        with pytest.raises(argparse.ArgumentTypeError, match=f", not {refused}$"):
            seconds(refused)


def test_a_tool_interrupted_by_ctrl_c_says_so_in_one_line(capsys):
    def interrupted():
        raise KeyboardInterrupt

    assert cli.run_tool(interrupted) == 130
    assert capsys.readouterr().err == "interrupted by Ctrl-C\n"
    assert cli.run_tool(lambda: 3) == 3


def test_a_tool_sent_sigterm_says_so_in_one_line():
    """SIGTERM (kill, a scheduler ending the job) ended trainer.evaluate and the other tools without a word, where the
    trainer names the signal and exits 128 + its number."""
    terminated = ("import os, signal, sys, time\n"
                  "from trainer import cli\n"
                  "def main():\n"
                  "    os.kill(os.getpid(), signal.SIGTERM)\n"
                  "    time.sleep(60)\n"
                  "sys.exit(cli.run_tool(main))\n")
    result = subprocess.run([sys.executable, "-c", terminated], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert (result.returncode, result.stdout, result.stderr) == (143, "", "terminated by SIGTERM\n"), result.stderr


def test_a_tool_gives_sigterm_back_to_the_handler_it_found_however_it_ends():
    """run_tool raises Terminated on a SIGTERM only while its tool runs: a caller's own handler (a test's, a script
    that runs a tool in-process) was left replaced by it (a mutant that kept it passed every test)."""
    def caller_handler(number, frame):
        pass

    def cannot_write():
        raise cli.CannotWrite("cannot write x: No space left on device")

    previous = signal.signal(signal.SIGTERM, caller_handler)
    try:
        for main, code in ((lambda: 0, 0), (cannot_write, 2)):
            assert cli.run_tool(main) == code
            assert signal.getsignal(signal.SIGTERM) is caller_handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_tool_sent_sigterm_as_it_reads_a_file_ends_on_the_signal_not_on_a_refusal_of_the_file(tmp_path, monkeypatch,
                                                                                                  capsys):
    """Terminated is a BaseException, as KeyboardInterrupt is: raised inside a read that the tools guard with `except
    Exception` (torch.load of a checkpoint, an audio file's decoding), it would read as the file's fault, refused in
    one line, exit code 2, or skipped for the next file. The other tests send SIGTERM outside any such read, and a
    Terminated made an Exception passed them all."""
    from trainer import transcribe

    model = small_checkpoint(tmp_path / "small.pt")

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # run_tool's handler raises Terminated here
        time.sleep(60)

    monkeypatch.setattr(torch, "load", terminated)
    assert cli.run_tool(lambda: transcribe.main(["--checkpoint", str(model), "--device", "cpu", "a.wav"])) == 143
    assert capsys.readouterr().err == "terminated by SIGTERM\n"


# Runs a tool as `python -m` does, sending it a real signal (argv[3], Ctrl-C where none is named) as its first import
# of the module named in argv[2] begins.
SIGNAL_WHILE_IMPORTING = """
import builtins, os, runpy, signal, sys
tool, interrupted_at = sys.argv[1:3]
number = getattr(signal, sys.argv[3]) if len(sys.argv) > 3 else signal.SIGINT
real_import = builtins.__import__
def importing(name, *args, **kwargs):
    if name == interrupted_at:
        builtins.__import__ = real_import
        os.kill(os.getpid(), number)
    return real_import(name, *args, **kwargs)
builtins.__import__ = importing
sys.argv = [tool, "--help"]
runpy.run_module(tool, run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("signal_name, line, code", [("SIGINT", "interrupted by Ctrl-C", 130),
                                                     ("SIGTERM", "terminated by SIGTERM", 143)])
@pytest.mark.parametrize("tool, interrupted_at", [
    ("trainer.evaluate", "torch"), ("trainer.transcribe", "torch"), ("trainer.lm", "data.manifest"),
    ("benchmarks.rnn_kernels", "torch"), ("benchmarks.rnn_stack", "torch"), ("benchmarks.train_step", "torch"),
    ("benchmarks.scaling", "torch"), ("benchmarks.wer_parity", "yaml"), ("data.prepare", "tqdm"),
    ("trainer.check_overrides", "hydra"), ("trainer", "tqdm"), ("benchmarks.support_table", "torch"),
    ("benchmarks.scaling_model", "torch"),
])
def test_a_tool_stopped_by_a_signal_while_it_imports_says_so_in_one_line(tool, interrupted_at, signal_name, line,
                                                                          code):
    """A Ctrl-C in the seconds a tool imports torch, before run_tool takes it, printed a traceback from inside them
    (benchmarks.scaling, benchmarks.wer_parity and data.prepare still did, until they shared data.cli), and a SIGTERM
    ended it without a word; the trainer's first tenth of a second, as trainer.stop imports tqdm before it takes the
    signals, did either."""
    result = subprocess.run([sys.executable, "-c", SIGNAL_WHILE_IMPORTING, tool, interrupted_at, signal_name],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert (result.returncode, result.stdout, result.stderr) == (code, "", f"{line}\n"), result.stderr


@pytest.mark.parametrize("tool, interrupted_at", [
    ("trainer.evaluate", "torch"), ("trainer.lm", "data.manifest"), ("benchmarks.scaling", "torch"),
    ("benchmarks.wer_parity", "yaml"), ("data.prepare", "tqdm"),
])
def test_a_tool_started_with_ctrl_c_ignored_runs_on_through_one(tool, interrupted_at):
    """A non-interactive shell starts `tool &` with SIGINT ignored, so that a Ctrl-C for the foreground job (the
    terminal's, to the whole process group) leaves it running: the tools took SIGINT over and ended on it."""
    result = subprocess.run([sys.executable, "-c", SIGNAL_WHILE_IMPORTING, tool, interrupted_at], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    assert result.stdout.startswith("usage:"), result.stdout


def test_signals_raise_after_the_imports_only_where_the_tool_took_it_over():
    """A tool started with Ctrl-C ignored (`tool &` in a script) keeps ignoring it once its imports are done too: the
    test above sends its Ctrl-C during the imports, and passed with SIGINT's handler set after them whatever it was."""
    previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        end_at_once_on_a_signal()
        signals_raise()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is raise_terminated
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        end_at_once_on_a_signal()
        signals_raise()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a tool's main() called from Python: nothing taken over
        signals_raise()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def test_an_output_file_is_written_whole_and_never_over_an_input(tmp_path, monkeypatch):
    target, manifest = tmp_path / "out.tsv", tmp_path / "m.jsonl"
    manifest.write_text("kept\n")
    monkeypatch.chdir(tmp_path)  # the input named from here, the output by its whole path: one file still
    with pytest.raises(ValueError, match="is also an input of this command"):
        cli.check_not_an_input(str(manifest), ["./m.jsonl"])
    cli.check_not_an_input(None, [str(manifest)])
    (tmp_path / "link.tsv").symlink_to(tmp_path / "nowhere" / "x.tsv")  # a dangling link: its folder does not exist
    with pytest.raises(argparse.ArgumentTypeError, match=f"no folder {tmp_path / 'nowhere'}"):
        cli.output_file(str(tmp_path / "link.tsv"))
    cli.write_output(str(target), "table\n")
    assert target.read_text() == "table\n" and sorted(path.name for path in tmp_path.iterdir()) == [
        "link.tsv", "m.jsonl", "out.tsv"]


def test_the_tools_print_a_path_that_is_not_utf8_with_its_bytes_escaped_as_data_prepare_does(tmp_path):
    # trainer.lm and trainer.transcribe printed b"\xff" as stderr's "\udcff", which names no byte, where data.prepare
    # prints "\xff"; and trainer.lm's last line, under strict UTF-8 (PYTHONIOENCODING), was a UnicodeEncodeError.
    corpus = bytes(tmp_path) + b"/corpus\xff"
    os.mkdir(corpus)
    with open(corpus + b"/m.jsonl", "w", encoding="utf-8") as manifest:
        manifest.write('{"audio_filepath": "a.wav", "duration": 1.0, "text": "A"}\n' * 2)
    shown = f"{tmp_path}/corpus\\xff".encode()
    strict = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    result = subprocess.run([sys.executable, "-m", "trainer.lm", "--manifest", corpus + b"/m.jsonl", "--out",
                             corpus + b"/lm.arpa"], cwd=REPO_ROOT, capture_output=True, timeout=120, env=strict)
    assert result.returncode == 0, result.stderr
    assert f"(the first: {shown.decode()}/a.wav)".encode() in result.stderr, result.stderr
    assert result.stdout.endswith(b"wrote " + shown + b"/lm.arpa: a 3-gram model of 1 transcript; 1 whose audio "
                                  b"file is listed before left out\n"), result.stdout
    result = subprocess.run([sys.executable, "-m", "trainer.transcribe", "--checkpoint",
                             str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu", corpus + b"/absent.wav"],
                            cwd=REPO_ROOT, capture_output=True, timeout=300, env=strict)
    assert result.returncode == 1 and result.stderr.endswith(shown + b"/absent.wav\terror: no such audio file\n"), \
        result.stderr


@pytest.mark.parametrize("name", ["absent", "x" * 300], ids=["missing", "name_too_long"])
@pytest.mark.parametrize("tool, argument", [("lm", "--manifest"), ("evaluate", "--manifest"), ("evaluate", "--lm"),
                                            ("evaluate", "--checkpoint"), ("transcribe", "--checkpoint")])
def test_the_tools_refuse_an_input_they_cannot_open_in_one_line(tool, argument, name, tmp_path, capsys):
    # An OSError other than a missing file (no permission, which root is never refused; a name past the file system's
    # 255 bytes) ended in a traceback; so did trainer.lm's missing manifest, whose error names no `filename`, which
    # the tool took for a print into a full stdout.
    main = importlib.import_module(f"trainer.{tool}").main
    manifest, model = str(tmp_path / "m.jsonl"), str(small_checkpoint(tmp_path / "small.pt"))
    write_manifest(manifest, [Utterance(str(tmp_path / "a.wav"), 1.0, "YES", "a")])
    arguments = {"lm": ["--manifest", manifest, "--out", str(tmp_path / "words.arpa")],
                 "evaluate": ["--checkpoint", model, "--device", "cpu", "--manifest", manifest],
                 "transcribe": ["--checkpoint", model, "--device", "cpu", str(tmp_path / "a.wav")]}[tool]
    unopenable = str(tmp_path / name)
    if argument in arguments:
        arguments[arguments.index(argument) + 1] = unopenable
    else:
        arguments += [argument, unopenable]
    assert main(arguments) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and unopenable in error and error.count("\n") == 1, error


WHOLE_FILE_WRITERS = {
    "manifest": lambda path: write_manifest(path, [Utterance("/a.flac", 1.0, "NEW", "spk1")]),
    "tool output": lambda path: cli.write_output(str(path), "new\n"),
    "metrics.jsonl": lambda path: open_metrics(path, {"epoch": 0, "step": 0}).close(),
    "checkpoint": lambda path: checkpoint.save(path, {"model": {}, "config": {}}),
}


@pytest.mark.parametrize("writer", WHOLE_FILE_WRITERS)
def test_each_writer_puts_its_file_on_disk_before_the_rename_and_leaves_nothing_when_interrupted(tmp_path, monkeypatch,
                                                                                                 writer):
    """A Ctrl-C at the flush to disk (data.files.write_whole) leaves the earlier file and nothing beside it; a writer
    that renamed without flushing left, after a power loss, an empty file where the earlier one was."""
    path = tmp_path / "file"
    path.write_text("earlier\n")

    def ctrl_c(fd):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "fsync", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        WHOLE_FILE_WRITERS[writer](path)
    assert path.read_text() == "earlier\n" and [file.name for file in tmp_path.iterdir()] == ["file"]


@pytest.mark.parametrize("command, unbuffered", [
    ("trainer --help", ""), ("trainer --help", "1"), ("trainer --cfg job", ""), ("trainer --cfg job", "1"),
    ("trainer --info", ""), ("trainer --info searchpath", "1"),
    ("trainer.check_overrides --help", ""), ("trainer.evaluate --help", ""), ("data.prepare --help", ""),
    ("benchmarks.scaling --help", ""),
])
def test_a_help_into_a_reader_that_stopped_early_ends_quietly(command, unbuffered):
    """`| head -1`: what a tool left in stdout's buffer was written at Python's exit, which printed "Exception ignored
    ... BrokenPipeError" with exit code 120; under PYTHONUNBUFFERED=1 the trainer's --help (Hydra's, which prints it
    and its newline apart) and --cfg ended in a BrokenPipeError's traceback. (argparse's --help, unbuffered, ignores a
    failed write and exits 0.) data.prepare and benchmarks.scaling, which end without run_tool, still exited 120; the
    trainer's --info, which Hydra prints through logging, printed "--- Logging error ---" and a traceback a line."""
    tool = f"{shlex.quote(sys.executable)} -m {command}"
    piped = subprocess.run(["bash", "-c", f"{tool} | true; exit ${{PIPESTATUS[0]}}"], cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONUNBUFFERED": unbuffered})
    assert (piped.returncode, piped.stderr) == (1, ""), piped.stderr


@pytest.mark.parametrize("command, unbuffered", [
    ("trainer.check_overrides --help", ""), ("trainer --help", ""), ("trainer --help", "1"), ("trainer --cfg job", ""),
    ("trainer --info", ""), ("trainer --info searchpath", "1"), ("data.prepare --help", ""),
    ("benchmarks.scaling --help", ""),
])
def test_a_help_on_a_full_disk_says_so_in_one_line(command, unbuffered):
    """What a tool left in stdout's buffer, written at Python's exit past run_tool: "Exception ignored ... OSError:
    [Errno 28]", exit code 120. The trainer's --help, --cfg and --info, data.prepare's and benchmarks.scaling's --help,
    which end without run_tool, still did (or a traceback, or "--- Logging error ---" a line)."""
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", *command.split()], cwd=REPO_ROOT, stdout=full,
                                stderr=subprocess.PIPE, text=True, timeout=300,
                                env={**os.environ, "PYTHONUNBUFFERED": unbuffered})
    assert (result.returncode, result.stderr) == (2, "error: cannot write stdout: No space left on device\n")


def test_a_tools_output_into_a_reader_that_stopped_early_ends_it_quietly(tmp_path):
    # `trainer.lm --out /dev/stdout | head -1`: write_output took the closed pipe for an unwritable file, exit 2 and
    # "error: cannot write /dev/stdout: Broken pipe", where run_tool ends a tool whose reader stopped early quietly.
    (tmp_path / "m.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": "yes no"}\n')
    lm = shlex.join([sys.executable, "-m", "trainer.lm", "--manifest", str(tmp_path / "m.jsonl"), "--out",
                     "/dev/stdout"])
    piped = subprocess.run(["bash", "-c", f"{lm} | true; exit ${{PIPESTATUS[0]}}"], cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=120)
    assert piped.returncode == 1 and "error" not in piped.stderr, piped.stderr


def test_a_tools_output_to_stdout_is_its_output_alone_its_own_lines_on_stderr(tmp_path):
    # `trainer.lm ... --out /dev/stdout | gzip`, `trainer.evaluate ... --out /dev/stdout | sort`: "counting the 3-grams
    # ...", "wrote /dev/stdout ..." and the WER line went to stdout too, into the ARPA file and the table.
    audio = tmp_path / "a.wav"
    with wave.open(str(audio), "wb") as file:
        file.setnchannels(1), file.setsampwidth(2), file.setframerate(16000)
        file.writeframes(struct.pack("<16000h", *(((n * 7919) % 2001) - 1000 for n in range(16000))))
    write_manifest(tmp_path / "m.jsonl", [Utterance(str(audio), 1.0, "YES NO", "s")])
    tools = {"trainer.lm": ("\\data\\\n", "\\end\\\n"),
             "trainer.evaluate": ("audio_filepath\tword_errors\t", "\tYES NO\t")}
    for tool, (first, last) in tools.items():
        model = ["--checkpoint", str(small_checkpoint(tmp_path / "model.pt"))] if tool == "trainer.evaluate" else []
        result = subprocess.run([sys.executable, "-m", tool, *model, "--manifest", str(tmp_path / "m.jsonl"), "--out",
                                 "/dev/stdout"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(first) and last in result.stdout.splitlines(keepends=True)[-1], result.stdout
        assert "wrote /dev/stdout" in result.stderr or "WER " in result.stderr, result.stderr


def test_a_tools_lines_go_to_stderr_where_stdout_is_closed_though_it_names_no_output_file(monkeypatch, tmp_path):
    """The test below names an --out file, which is no standard stream, and so finds stderr without the check of a
    closed stdout (a mutant without it passed every test); trainer.evaluate without --out printed its WER into
    None, where print() drops it."""
    monkeypatch.setattr(sys, "stdout", None)
    # trainer.evaluate without --out or --skipped asks as lines_stream(None, None).
    assert cli.lines_stream(None, None) is cli.lines_stream(str(tmp_path / "out.tsv")) is sys.stderr


def test_a_tool_started_with_stdout_closed_writes_its_out_file_and_its_lines_to_stderr(tmp_path):
    # `python -m trainer.lm ... --out model.arpa >&-` (a daemon, a cron job): print_paths_printable reconfigured the
    # None that Python gives for a closed stdout, an AttributeError's traceback before any work. Then print() dropped
    # the tool's own lines into that None: trainer.evaluate's WER, its result, was lost with exit code 0.
    (tmp_path / "m.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": "yes no"}\n')
    (tmp_path / "lm.arpa").write_text("an earlier model\n")  # compared with the (closed) stdout before it is replaced
    lm = shlex.join([sys.executable, "-m", "trainer.lm", "--manifest", str(tmp_path / "m.jsonl"), "--out",
                     str(tmp_path / "lm.arpa")])
    result = subprocess.run(["bash", "-c", f"{lm} >&-"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (0, "counting the 3-grams of 1 transcript\n"
                                                     f"wrote {tmp_path / 'lm.arpa'}: a 3-gram model of 1 transcript\n")
    assert (tmp_path / "lm.arpa").read_text().startswith("\\data\\\n")


def test_a_tool_whose_stdout_is_on_a_full_disk_says_so_in_one_line(tmp_path):
    # `trainer.evaluate ... > /dev/full` ended in an OSError's traceback, `trainer.lm ... > /dev/full` in "error: [Errno
    # 28] No space left on device", which named no file: a print's write() names none.
    (tmp_path / "m.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": "yes no"}\n')
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "trainer.lm", "--manifest", str(tmp_path / "m.jsonl"), "--out",
                                 str(tmp_path / "lm.arpa")], cwd=REPO_ROOT, stdout=full, stderr=subprocess.PIPE,
                                text=True, timeout=120)
    assert (result.returncode, result.stderr) == (2, "error: cannot write stdout: No space left on device\n")

    def printing_into_a_full_disk():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(SystemExit) as ended:
        cli.run_tool(printing_into_a_full_disk)
    assert ended.value.code == 2

    def writing_a_file_into_a_full_disk():  # its error names the file, which "cannot write stdout" would hide
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "out.json"))

    with pytest.raises(OSError, match="out.json"):
        cli.run_tool(writing_a_file_into_a_full_disk)


def test_an_output_file_a_tool_cannot_write_ends_it_in_one_line_naming_the_file(tmp_path, capsys):
    # benchmarks.rnn_kernels, rnn_stack, train_step and wer_parity let write_output's error out as a traceback: each
    # tool caught it on its own, and those four did not.
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "results.json"
    assert cli.run_tool(lambda: cli.write_output(str(out), "{}\n")) == 2
    assert capsys.readouterr().err == f"error: cannot write {out}: Not a directory\n"


def test_transcribe_started_with_stdout_closed_says_its_transcripts_have_nowhere_to_go(tmp_path):
    # `python -m trainer.transcribe ... >&-` ended in an AttributeError's traceback: Python gives a closed stdout as
    # None.
    transcribe = shlex.join([sys.executable, "-m", "trainer.transcribe", "--checkpoint", str(tmp_path / "model.pt"),
                             str(tmp_path / "a.wav")])
    result = subprocess.run(["bash", "-c", f"{transcribe} >&-"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert (result.returncode, result.stderr) == (2, "error: stdout is closed (>&-): the transcripts would be lost\n")


@pytest.mark.parametrize("tool", ["trainer", "trainer.evaluate", "trainer.lm", "data.prepare",
                                  "trainer.check_overrides", "benchmarks.scaling_model", "benchmarks.wer_parity"])
def test_the_readme_names_the_package_a_python_without_the_virtualenv_lacks(tool):
    """Python without its site-packages (-S) stands for one without the virtualenv: the README named 'hydra' or
    'torch', where python -m trainer, trainer.lm and data.prepare end in No module named 'tqdm', and later listed
    benchmarks.scaling_model with them, which ends in 'torch' since it reads its measurement through
    benchmarks.scaling, and benchmarks.wer_parity ends in 'yaml'. Each tool the bullet names for a package ends in
    it; any other in 'torch' or 'hydra'."""
    result = subprocess.run([sys.executable, "-S", "-m", tool, "--help"], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60)
    (missing,) = re.findall(r"No module named '(\w+)'", result.stderr.splitlines()[-1])
    readme = (REPO_ROOT / "README.md").read_text()
    bullet = readme.split("- A Python without the virtualenv ")[1].split("\n- ")[0]
    # "`'tqdm'` for `python -m trainer`, `trainer.lm` and `data.prepare`, `'yaml'` for ..., `'torch'` or ...": each
    # package's tools, up to the next package.
    named = {package: re.findall(r"`(?:python -m )?([\w.]+)`", tools)
             for package, tools in re.findall(r"`'(\w+)'` for\s(.*?)(?=`'|$)", bullet, flags=re.DOTALL)}
    expected = [package for package, tools in named.items() if tool in tools] or ["torch", "hydra"]
    assert missing in expected, (missing, named)


@pytest.mark.parametrize("argument", ["--out", "--skipped"])
def test_an_output_of_a_dash_is_refused_not_written_as_a_file_so_named(argument, tmp_path, monkeypatch, capsys):
    # `trainer.lm --out - | gzip` wrote a file named "-" and gzip an empty archive, as the benchmarks' --json - did.
    from trainer import evaluate, lm
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": "yes no"}\n')
    tool = lm if argument == "--out" else evaluate
    with pytest.raises(SystemExit) as refused:
        tool.main(["--manifest", "m.jsonl", argument, "-", *(["--checkpoint", "c.pt"] if tool is evaluate else [])])
    assert refused.value.code == 2 and not (tmp_path / "-").exists()
    assert capsys.readouterr().err.endswith(f"argument {argument}: '-' is no file name here: /dev/stdout writes to "
                                            "stdout\n")
