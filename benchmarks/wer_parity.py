"""Test WER of the trainer on each backend over several seeds, the runs side by side: does the persistent backend
train to the same word error rate as cuDNN?

    python -m benchmarks.wer_parity [--backends cudnn persistent] [--seeds 1234 7] [--parallel 4] [--graphs]
        [--ranks 1] [--name wer] [--runs-dir DIR] [--at-epoch E] [--report] [--json PATH]
        [--backend-overrides BACKEND OVERRIDE ...] [-- TRAINER_OVERRIDES ...]

e.g. `python -m benchmarks.wer_parity --seeds 1234 7 11 --graphs --json wer.json -- experiment=an4_gpu
train.num_workers=2`. Each (backend, seed) is one `python -m trainer` run in RUNS_DIR/NAME-BACKEND-sSEED, with the
overrides, then that backend's --backend-overrides (e.g. `--backend-overrides persistent model.batch_slice=4 --`: cuDNN
at the whole batch against the persistent kernels at a per-GPU batch of 4, in one command; the -- is required), then
model.backend, seed, its run directory, train.resume=auto and train.progress_bar=false, which the overrides may not set;
its output goes to RUNS_DIR/NAME-BACKEND-sSEED.out. Up to --parallel runs go at once, spread round-robin over the
visible GPUs (CUDA_VISIBLE_DEVICES, or every GPU), one GPU per run: runs that share a GPU share its time, which at a
small per-GPU batch leaves most of it idle anyway. --graphs adds train.cuda_graphs=true to every backend but cuDNN
(whose packed sequences a graph cannot hold). --ranks N makes each run a data-parallel job of N ranks
(launch/single_node.sh under MPIRUN) on its one GPU, with distributed.share_gpus=true: the arithmetic of N GPUs at a
per-GPU batch of the global batch / N, e.g. the recipe's global batch 32 at the per-GPU batch 4 the persistent kernels
are built for, on a machine with fewer GPUs. Running the same command again continues each unfinished run from its
last.pt (one that finished all its epochs ends at once), so a long comparison can span several jobs. --report trains
nothing: it summarises the runs as they stand in RUNS_DIR (finished, stopped part way, or copied there from another
machine). Every run's row of the JSON lists the devices its jobs trained on, from its jobs.jsonl.

Prints each run's last and best test WER and its time (training and evaluation, over all its jobs), then per backend the
mean and sample standard deviation of the last WER over the runs that finished, and each backend's difference from the
first backend: the mean over the seeds both finished of the per-seed difference, with its standard error. The difference
is paired because a seed gives every backend the same initial weights and data order, so what makes a seed hard or easy
cancels. --at-epoch E compares every run as it stood at epoch E (its WER then, the best up to then): runs of a budget
that ran out can be compared where all of them got to. Writes the same, with the command and versions, as JSON (to
--json, else to a new file in benchmarks/results/). A failed run is reported with its exit status and the last line of
its output, and left out of the means (the command then exits 1), as is one that stopped short of the epochs its
config.yaml sets (a run copied without it counts as it stands); the others still count. So is a run with a file that is
not as the trainer writes it (a config.yaml that is no YAML, an evaluation or job line missing a field or holding
another type, a file that cannot be read, a pipe or a device in a file's place, which is not read), in one line naming
the file and what is wrong; a --report whose every run is left out so reports nothing and exits 2, as does one that
finds none of its runs in RUNS_DIR (a misspelt --name).
"""
if __name__ == "__main__":  # first: during the imports below a Ctrl-C printed a traceback, and a
    # SIGTERM ended the tool without a word
    from data.cli import end_at_once_on_a_signal

    end_at_once_on_a_signal()

import argparse
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NoReturn

import yaml

from benchmarks.fields import COUNT, DamagedFile, field
from data.cli import Terminated, input_path, stopped_line
from data.text import counted
from data.values import is_number, json_objects
from trainer import check_overrides
from trainer.cli import (DEFAULT_JSON_HELP, EachOnce, cannot_write, int_at_least, json_file, json_output,
                         positive_int, run_tool, say_written, write_results)
from trainer.config import MAX_SEED

REPO_ROOT = Path(__file__).resolve().parent.parent


def read_text(path: Path) -> str:
    """A run file's text; "" where the run has not written it yet. DamagedFile where it is a pipe or a device (a link
    to one), which the trainer never writes: a runs folder copied from elsewhere may hold one, and read, a link to
    /dev/zero took all the memory and a pipe waited for a writer for ever."""
    if path.exists() and not (path.is_file() or path.is_dir()):  # a folder: read_text names it below
        raise DamagedFile(f"{path}: not a file (a pipe, a device), which the trainer never writes there")
    try:
        return path.read_text() if path.exists() else ""
    except (OSError, UnicodeDecodeError) as error:  # a folder of that name, no permission, bytes that are no UTF-8
        raise DamagedFile(f"{path}: cannot read it ({getattr(error, 'strerror', None) or error})") from None


def read_jsonl(path: Path) -> list[dict]:
    """The records of one of a run's JSON-lines files; none where the run has not written it yet. A line a killed job
    left half written, or one that is no JSON object, is skipped, as the trainer skips it when it resumes."""
    return [record for _, record in json_objects(read_text(path))]


# What the report reads of each evaluation line of metrics.jsonl (those with an eval_wer: a WER that is no number is
# left out, as partial) and of each line of jobs.jsonl: key, kind (benchmarks.fields.KINDS), whether null may stand.
EVALUATION_FIELDS = (("epoch", "a count", False), ("eval_cer", "a number", True),
                     ("elapsed_s", "a finite number", False))
JOB_FIELDS = (("device", "a string", False), ("world_size", COUNT, True))
# A run's row where it has no evaluation to give, or a damaged file keeps the report from reading one.
NO_EVALUATION = {"last_wer": None, "last_cer": None, "best_wer": None, "elapsed_s": None}


def checked(path: Path, record: dict, fields: tuple, within: str) -> dict:
    """`record`, a line of the run file at `path`, if each of `fields` holds what the trainer writes there; else
    DamagedFile naming it after `within`. An epoch of "3" or a CER of true ended the report in a traceback."""
    for key, kind, or_null in fields:
        field(path, record, key, kind=kind, or_null=or_null, within=within)
    return record


def run_jobs(run_dir: Path) -> list[dict]:
    """The run's jobs, from its jobs.jsonl."""
    path = run_dir / "jobs.jsonl"
    return [checked(path, job, JOB_FIELDS, "a job's ") for job in read_jsonl(path)]


def planned_epochs(run_dir: Path) -> int | None:
    """The epochs the run was set to train (train.epochs in the config.yaml the trainer writes into its directory), or
    None where that cannot tell when it ends: no config.yaml (a run copied without it) or a train.max_steps. Read as
    plain YAML: the two counts are all it needs, and no interpolation a hand-edited file holds is resolved."""
    config_path = run_dir / "config.yaml"
    try:
        config = yaml.safe_load(read_text(config_path)) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise DamagedFile(f"{config_path}: not YAML ({getattr(error, 'problem', None) or error}{where})") from None
    except RecursionError:  # YAML's reader nests as deep as the file: a traceback of a thousand lines
        raise DamagedFile(f"{config_path}: YAML nested too deeply to read") from None
    if not isinstance(config, dict):
        raise DamagedFile(f"{config_path}: not the mapping of settings, train among them, that the trainer writes")
    epochs = field(config_path, config, "train", "epochs", kind="a count", or_null=True)
    return epochs if field(config_path, config, "train", "max_steps", kind="a count", or_null=True) is None else None


def evaluations(run_dir: Path, at_epoch: int | None = None) -> dict:
    """The run's test evaluations so far, from its metrics.jsonl: epochs, last and best WER, last CER, and the
    seconds the run has spent training and evaluating, over all the jobs it took. With at_epoch, the run as it stood
    after that epoch; a run that has not evaluated it yet has its epochs so far and no WER. An evaluation that could
    not read the whole test set (eval_unreadable) is left out: its WER is over another set of utterances; so is one
    whose WER is no number (null, NaN)."""
    metrics = run_dir / "metrics.jsonl"
    evaluated = [checked(metrics, line, EVALUATION_FIELDS, "an evaluation's ") for line in read_jsonl(metrics)
                 if "eval_wer" in line]
    epochs = evaluated[-1]["epoch"] if evaluated else 0
    planned = planned_epochs(run_dir)
    # Stopped short of its epochs (crashed, killed, out of time): not a finished run's WER. None: cannot tell.
    unfinished = {"unfinished": planned is not None and epochs < planned} if at_epoch is None else {}
    if at_epoch is not None:
        evaluated = [line for line in evaluated if line["epoch"] <= at_epoch] if epochs >= at_epoch else []
    partial = [line["epoch"] for line in evaluated if not over_the_whole_test_set(line)]
    evaluated = [line for line in evaluated if over_the_whole_test_set(line)]
    if not evaluated:
        return {"epochs": epochs, **NO_EVALUATION, "partial_epochs": partial, **unfinished}
    last = evaluated[-1]
    # EVALUATION_FIELDS lets eval_cer be null or missing: last["eval_cer"] ended the report in a KeyError.
    return {"epochs": last["epoch"], "last_wer": last["eval_wer"], "last_cer": last.get("eval_cer"),
            "best_wer": min(line["eval_wer"] for line in evaluated), "elapsed_s": last["elapsed_s"],
            "partial_epochs": partial, **unfinished}


def over_the_whole_test_set(evaluation: dict) -> bool:
    """Whether a metrics.jsonl evaluation has a WER over the whole test set: it read every utterance, and its WER is a
    finite number (the trainer writes null where it read none; a NaN would make every mean and difference NaN)."""
    return not evaluation.get("eval_unreadable") and is_number(evaluation["eval_wer"])


def devices(jobs: list[dict]) -> list[str]:
    """The devices a run's jobs (run_jobs) trained on (rank 0's), each once, in order."""
    return list(dict.fromkeys(job["device"] for job in jobs))


def visible_gpus() -> list[str]:
    """The GPUs the runs are spread over: CUDA_VISIBLE_DEVICES's entries where it is set, else every GPU torch sees."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [gpu.strip() for gpu in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if gpu.strip()]
    import torch  # here, so that --help and argument errors answer without loading torch

    return [str(index) for index in range(torch.cuda.device_count())]


def report(runs_dir: Path, name: str, backend: str, seed: int, ranks: int, at_epoch: int | None) -> dict:
    """A run as it stands in runs_dir, trained by an earlier job or elsewhere: no exit status or GPU of this call.
    Its ranks are those its last job ran with (jobs.jsonl), `ranks` where it records none. A run with a file the report
    cannot read (DamagedFile) has no evaluations: its row's "damaged" says which file and what is wrong."""
    row = {"run": name, "backend": backend, "seed": seed, "ranks": ranks, "gpu": None, "returncode": None,
           "wall_s": None, "output": str(runs_dir / f"{name}.out")}
    try:
        jobs = run_jobs(runs_dir / name)
        return {**row, "ranks": jobs[-1].get("world_size") or ranks if jobs else ranks,
                "devices": devices(jobs), **evaluations(runs_dir / name, at_epoch)}
    except DamagedFile as error:
        return {**row, "devices": [], "epochs": None, **NO_EVALUATION, "partial_epochs": [], "damaged": str(error)}


class Runs:
    """Starts the trainer's runs and keeps those in progress, to pass on a SIGTERM sent to this script alone (a
    terminal's Ctrl-C reaches them itself): each stops at its checkpoint, and no run starts after it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.in_progress: set[subprocess.Popen] = set()
        self.terminated = False

    def run_to_end(self, command: list[str], env: dict, log) -> int | None:
        """The run's exit status, its output into `log`; None where a SIGTERM came before it could start."""
        with self.lock:
            if self.terminated:
                return None
            process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            self.in_progress.add(process)
        try:
            return process.wait()
        finally:
            with self.lock:
                self.in_progress.discard(process)

    def terminate(self) -> None:
        with self.lock:
            self.terminated = True
            for process in self.in_progress:
                process.send_signal(signal.SIGTERM)


def train(runs: Runs, runs_dir: Path, name: str, backend: str, seed: int, overrides: list[str], graphs: bool,
          ranks: int, gpu: str | None, at_epoch: int | None) -> dict | None:
    """One trainer run of `ranks` ranks to the end (or its continuation) on the given GPU (None: as inherited);
    returns how it ended and what it evaluated (up to at_epoch, if given), or None where it was not started."""
    run_dir = runs_dir / name
    settings = run_settings(run_dir, backend, seed, overrides, graphs)
    env = dict(os.environ) if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
    if ranks == 1:
        command = [sys.executable, "-m", "trainer", f"run_name={name}", *settings]
    else:
        # The launch script names the run from RUN_NAME, once for all ranks.
        command = ["bash", str(REPO_ROOT / "launch" / "single_node.sh"), str(ranks), "distributed.share_gpus=true",
                   *settings]
        env.update(RUN_NAME=name, PYTHON=sys.executable)
    output = runs_dir / f"{name}.out"
    started = time.perf_counter()
    with open(output, "a") as log:
        returncode = runs.run_to_end(command, env, log)
    if returncode is None:
        return None
    wall_s = round(time.perf_counter() - started, 1)
    return {**report(runs_dir, name, backend, seed, ranks, at_epoch), "gpu": gpu, "returncode": returncode,
            "wall_s": wall_s}


def run_settings(run_dir: Path, backend: str, seed: int, overrides: list[str], graphs: bool) -> list[str]:
    """The trainer's overrides for one run: the user's, then what this script sets (RUN_KEYS, but for run_name, which
    its callers add: the launch script of --ranks sets it from RUN_NAME), and train.cuda_graphs=true under --graphs
    for every backend but cuDNN."""
    settings = [*overrides, f"model.backend={backend}", f"seed={seed}", f"hydra.run.dir={hydra_quoted(run_dir)}",
                "train.resume=auto", "train.progress_bar=false"]
    return settings + ["train.cuda_graphs=true"] if graphs and backend != "cudnn" else settings


def hydra_quoted(path: Path) -> str:
    """`path` as a quoted string of Hydra's override grammar: unquoted, a comma in it made the override a list Hydra
    refused, and a bracket or colon another value. Hydra takes the backslashes before a quote as escapes, so they are
    doubled, and the quote escaped after them."""
    return "'" + re.sub(r"(\\*)'", lambda match: match[1] * 2 + "\\'", str(path)) + "'"


def summarize(rows: list[dict], backends: list[str]) -> list[dict]:
    """Per backend: runs that finished, mean and sample standard deviation of their last WER; then for every backend
    after the first, over the seeds both finished, the mean per-seed difference of the last WER from the first
    backend's and its standard error (None where too few runs give one). A run that failed, has no evaluation or
    stopped short of its epochs is left out."""
    finished = {(row["backend"], row["seed"]): row["last_wer"] for row in rows
                if row["returncode"] in (0, None) and row["last_wer"] is not None and not row.get("unfinished")}
    summary = []
    for backend in backends:
        wers = [wer for (run_backend, _), wer in finished.items() if run_backend == backend]
        summary.append({"backend": backend, "runs": len(wers),
                        "mean_wer": statistics.fmean(wers) if wers else None,
                        "std_wer": statistics.stdev(wers) if len(wers) > 1 else None})
    first = backends[0]
    for entry in summary[1:]:
        differences = [wer - finished[first, seed] for (backend, seed), wer in finished.items()
                       if backend == entry["backend"] and (first, seed) in finished]
        entry["paired_seeds"] = len(differences)
        entry["difference"] = statistics.fmean(differences) if differences else None
        entry["difference_stderr"] = (statistics.stdev(differences) / math.sqrt(len(differences))
                                      if len(differences) > 1 else None)
    return summary


def gpu_named(gpu: str | None) -> str:
    """A run's GPU as its line names it; None where none is visible, and the trainer's device=auto takes the CPU."""
    return "no GPU" if gpu is None else f"GPU {gpu}"


def train_all(jobs: list[tuple[str, str, int]], runs_dir: Path, gpus: list[str], args) -> list[dict]:
    """Trains (or continues) every job, --parallel at once, and returns their rows in the order of `jobs`. A stop signal
    (a Ctrl-C reaches the runs as well as this script; a SIGTERM to this script alone it passes on) lets the runs in
    progress stop at their checkpoints, starts no more and exits with the signal's code."""
    print(f"{counted(len(jobs), 'run')} of {counted(args.ranks, 'rank')}, {min(args.parallel, len(jobs))} at once on "
          f"{counted(len(gpus), 'GPU') if gpus else 'no GPU'}; "
          f"output in {runs_dir}/{args.name}-*.out", flush=True)
    stopped_by = []  # the exit codes of runs a stop signal ended: the jobs queued after them are not started
    runs = Runs()

    def train_unless_stopped(*job):
        if stopped_by:  # else, the signal having reached this script too late, a Ctrl-C for every queued run
            return None
        row = train(runs, *job)
        if row is not None and row["returncode"] in STOPPED_BY_SIGNAL:
            stopped_by.append(STOPPED_BY_SIGNAL[row["returncode"]])
        return row

    with ThreadPoolExecutor(args.parallel) as pool:
        # Job i on GPU i mod n: with backends outermost and as many seeds as GPUs (or a multiple), each GPU trains
        # every backend equally often, so no backend gets the less crowded GPUs.
        futures = [pool.submit(train_unless_stopped, runs_dir, name, backend, seed,
                               overrides_of(args, backend), args.graphs, args.ranks,
                               gpus[index % len(gpus)] if gpus else None, args.at_epoch)
                   for index, (name, backend, seed) in enumerate(jobs)]
        rows = []
        try:
            for future in futures:
                rows.append(future.result())
                row = rows[-1]
                if row is not None:
                    outcome = row.get("damaged") or f"{row['epochs']} epochs, last WER {percent(row['last_wer'])} %"
                    print(f"{row['run']} ({gpu_named(row['gpu'])}): exit {row['returncode']}, {outcome}, "
                          f"{row['wall_s']:.0f} s", flush=True)
        except (KeyboardInterrupt, Terminated) as stopped:
            stopped_by.append(stopped_line(stopped)[1])
            if isinstance(stopped, Terminated):
                runs.terminate()
            pool.shutdown(cancel_futures=True)  # waits for the runs in progress, which the signal stops too
    if stopped_by:
        not_started = sum(future.cancelled() or future.result() is None for future in futures)
        print(f"stopped by a signal: the runs in progress stopped at their checkpoints and "
              f"{counted(not_started, 'run')} did not start; the same command continues them all", file=sys.stderr)
        sys.exit(stopped_by[0])
    return rows


# The exit status of a run that a stop signal ended -> 128 + the signal's number: the trainer's, after its checkpoint,
# or the negative one of a launch script the signal ended before it could pass it on.
STOPPED_BY_SIGNAL = {status: 128 + number for number in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
                     for status in (128 + number, -number)}


# What train() sets for each run, after the overrides: the same key among them would be silently replaced.
RUN_KEYS = ("model.backend", "seed", "run_name", "hydra.run.dir", "train.resume", "train.progress_bar")


def run_name_prefix(text: str) -> str:
    """--name, in the characters the launch scripts take for RUN_NAME (--ranks) and Hydra reads unquoted in run_name=:
    a / ended this script in a traceback (no folder for the run's .out), a comma each run in Hydra's refusal."""
    if not re.fullmatch(r"[A-Za-z0-9._+@ -]+", text):
        raise argparse.ArgumentTypeError(f"{text!r}: use letters, digits, spaces and ._+@-")
    return text


def backend_overrides(args) -> dict[str, list[str]]:
    """--backend-overrides as {backend: its overrides}, each given after the common ones (so it wins over them)."""
    return {backend: overrides for backend, *overrides in args.backend_overrides or []}


def overrides_of(args, backend: str) -> list[str]:
    """The user's overrides of one backend's runs: the common ones, then its own, which win over them."""
    return [*args.overrides, *backend_overrides(args).get(backend, [])]


def nothing_to_report(why: str) -> NoReturn:
    """Ends a --report that has no run to summarise with exit code 2, a usage error's: 1 says that a run failed."""
    print(f"--report: {why}", file=sys.stderr)
    sys.exit(2)


def environment() -> dict:
    """Where the runs trained: the GPU (the trainer's device=auto takes one when there is one) and the versions."""
    import torch  # here, so that --help and argument errors answer without loading torch

    from trainer.environment import device_name, versions

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return {"device": device_name(device), **versions(device)}


def percent(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.wer_parity", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--backends", nargs="+", action=EachOnce, choices=("cudnn", "persistent", "reference", "auto"),
                        default=["cudnn", "persistent"], help="the first is the one the others are compared with")
    # Each backend's first seed alone is checked with its overrides: another out of range failed its run after hours.
    parser.add_argument("--seeds", nargs="+", action=EachOnce, type=int_at_least(0, MAX_SEED), default=[1234, 7])
    parser.add_argument("--parallel", type=positive_int, default=4, help="runs at once")
    parser.add_argument("--graphs", action="store_true", help="train.cuda_graphs=true for every backend but cuDNN")
    parser.add_argument("--ranks", type=positive_int, default=1, help="ranks per run, sharing the run's GPU")
    parser.add_argument("--name", type=run_name_prefix, default="wer", help="prefix of the run names")
    parser.add_argument("--runs-dir", type=input_path, default=REPO_ROOT / "runs",
                        help="where the runs' directories go (default: runs/ of this checkout)")
    parser.add_argument("--at-epoch", type=positive_int, help="compare the runs as they stood after this epoch")
    parser.add_argument("--report", action="store_true", help="train nothing: summarise the runs in --runs-dir")
    parser.add_argument("--json", metavar="PATH", type=json_output,
                        help="write the runs, the summary and the configuration here" + DEFAULT_JSON_HELP)
    parser.add_argument("--backend-overrides", nargs="+", action="append", metavar=("BACKEND", "OVERRIDE"),
                        help="trainer overrides for that backend's runs alone (repeat for another backend, once each)")
    parser.add_argument("overrides", nargs="*", help="trainer overrides, after --")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    check_arguments(parser, args, argv)
    args.json = json_file(args.json, __file__)
    runs_dir = Path(args.runs_dir).resolve()
    jobs = [(f"{args.name}-{backend}-s{seed}", backend, seed) for backend in args.backends for seed in args.seeds]
    if args.report:
        gpus, measured_on = None, {}
        rows = reported_rows(args, runs_dir, jobs)
    else:
        gpus = visible_gpus()
        check_before_training(parser, args, runs_dir, jobs, gpus)
        # Before the runs: the checkout may be edited, or switched, during their hours of training.
        measured_on = environment()
        rows = train_all(jobs, runs_dir, gpus, args)
    summary = summarize(rows, args.backends)

    print_runs(rows, runs_dir, args.at_epoch)
    print_summary(summary, args.backends[0])
    write_json(args, argv, rows, summary, gpus, measured_on)
    failed = [row for row in rows if row["returncode"] not in (0, None)]
    for row in failed:
        print(f"{row['run']} failed (exit {row['returncode']}): {last_line(Path(row['output']))}", file=sys.stderr)
    if failed:
        sys.exit(1)


def check_arguments(parser: argparse.ArgumentParser, args, argv: list[str]) -> None:
    """Ends in a usage error (exit 2) where --backend-overrides, the overrides or --graphs with --ranks cannot run."""
    if args.backend_overrides and "--" not in argv:  # else the common overrides went to the last backend alone
        parser.error("--backend-overrides takes every word after it up to --: end it with --, then the overrides "
                     "common to every backend (none: end with --)")
    given_for = [backend for backend, *_ in args.backend_overrides or []]
    for backend, *overrides in args.backend_overrides or []:
        if given_for.count(backend) > 1:  # backend_overrides keeps the last one's: the others' would be dropped
            parser.error(f"--backend-overrides {backend} is given more than once: give all its overrides after one")
        if backend not in args.backends or not overrides or not all("=" in override for override in overrides):
            parser.error(f"--backend-overrides {backend} {' '.join(overrides)}: give one of --backends "
                         f"({' '.join(args.backends)}), then KEY=VALUE overrides")
    given = [*args.overrides, *(override for _, *overrides in args.backend_overrides or [] for override in overrides)]
    taken = sorted({key for override in given if (key := override.split("=", 1)[0].lstrip("+~")) in RUN_KEYS})
    if taken:
        parser.error(f"{', '.join(taken)}: set for each run by this script (from --backends, --seeds, --name and "
                     "--runs-dir); leave them out of the overrides")
    if args.graphs and args.ranks > 1:
        parser.error("--graphs needs one GPU per rank (NCCL), and --ranks puts a run's ranks on one GPU (gloo): use "
                     "--ranks 1")


def reported_rows(args, runs_dir: Path, jobs: list[tuple[str, str, int]]) -> list[dict]:
    """--report's rows, each run as it stands in runs_dir; ends with exit 2 where none of the runs is there, or every
    one there has a file the report cannot read."""
    if not any((runs_dir / name).is_dir() for name, _, _ in jobs):  # a misspelt --name or --runs-dir
        nothing_to_report(f"none of the runs {args.name}-BACKEND-sSEED is in {runs_dir}")
    rows = [report(runs_dir, name, backend, seed, args.ranks, args.at_epoch) for name, backend, seed in jobs]
    if all(row.get("damaged") or not (runs_dir / row["run"]).is_dir() for row in rows):
        for row in rows:
            if row.get("damaged"):
                print(f"{row['run']}: {row['damaged']}", file=sys.stderr)
        nothing_to_report(f"nothing to report: every run of {args.name}-BACKEND-sSEED in {runs_dir} has a file "
                          "it cannot read")
    return rows


def check_before_training(parser: argparse.ArgumentParser, args, runs_dir: Path, jobs: list[tuple[str, str, int]],
                          gpus: list[str]) -> None:
    """Makes runs_dir, and ends in a usage error (exit 2) where it cannot be made or Hydra would misread it, where
    the trainer refuses a backend's overrides, or where a run needs a GPU and `gpus` is empty, and in CannotWrite
    where a run's output file cannot be opened: found before any run starts, not in each run's output."""
    if "${" in str(runs_dir):  # Hydra stores the run's folder resolved, then resolves it again where it reads it
        parser.error(f"--runs-dir {runs_dir}: Hydra would read its ${{ as an interpolation (${{oc.env:HOME}}: "
                     "that variable's value), whatever the escape, and train elsewhere; name a folder without one")
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a file of that name: a traceback, where a usage error belongs
        parser.error(f"--runs-dir {runs_dir}: {error.strerror or error}")
    for name, backend, seed in jobs[::len(args.seeds)]:  # each backend's overrides, as its first run gets them
        # Else a misspelt key or a sweep's value (model.cell=gru,lstm) failed every run, each after its start.
        settings = run_settings(runs_dir / name, backend, seed, overrides_of(args, backend), args.graphs)
        if check_overrides.main([f"run_name={name}", *settings]):
            sys.exit(2)
    # The overrides' check passes device=auto, which each run would resolve to the CPU, and refuse there.
    if not gpus:
        if "persistent" in args.backends:
            parser.error("--backends persistent needs a CUDA GPU, and none is visible")
        if args.graphs and set(args.backends) != {"cudnn"}:
            parser.error("--graphs needs a CUDA GPU, and none is visible")
    # Last, so that a refusal above leaves no file: each opened as train() opens it, where a folder of that name
    # ended the command in a traceback once the other runs had trained.
    for name, _, _ in jobs:
        output = runs_dir / f"{name}.out"
        with cannot_write(output):
            open(output, "a").close()


def print_runs(rows: list[dict], runs_dir: Path, at_epoch: int | None) -> None:
    """The table of runs, then a line for each run left out of the means or with evaluations left out, and why."""
    if at_epoch is not None:
        print(f"\nas the runs stood after epoch {at_epoch} (a run short of it has no WER):")
    print(f"\n{'run':<28} {'exit':>4} {'epochs':>6} {'last WER %':>10} {'best WER %':>10} {'last CER %':>10} "
          f"{'run s':>7}")
    for row in rows:
        elapsed = "-" if row["elapsed_s"] is None else f"{row['elapsed_s']:.0f}"
        exit_status = "-" if row["returncode"] is None else row["returncode"]
        epochs = "-" if row["epochs"] is None else row["epochs"]
        print(f"{row['run']:<28} {exit_status:>4} {epochs:>6} {percent(row['last_wer']):>10} "
              f"{percent(row['best_wer']):>10} {percent(row['last_cer']):>10} {elapsed:>7}")
    for row in rows:
        if row.get("damaged"):
            print(f"{row['run']}: left out of the report: {row['damaged']}")
        if row.get("unfinished"):
            print(f"{row['run']}: stopped after epoch {row['epochs']} of {planned_epochs(runs_dir / row['run'])}: "
                  "left out of the means (--at-epoch compares runs where all of them got to)")
        if row["partial_epochs"]:
            print(f"{row['run']}: left out the evaluations after epochs {row['partial_epochs']}, which could not "
                  "read the whole test set (eval_unreadable) or have no WER (null, NaN)")


def print_summary(summary: list[dict], first_backend: str) -> None:
    """The table of backends: runs, mean and standard deviation of the last WER, the paired difference from the first
    backend."""
    print(f"\n{'backend':<12} {'runs':>4} {'mean WER %':>10} {'std':>6} {'vs ' + first_backend + ', paired':>22}")
    for entry in summary:
        versus = ""
        if entry.get("difference") is not None:
            versus = f"{entry['difference']:+.2f}"
            if entry["difference_stderr"] is not None:
                versus += f" +- {entry['difference_stderr']:.2f}"
            versus += f" ({entry['paired_seeds']} seeds)"
        print(f"{entry['backend']:<12} {entry['runs']:>4} {percent(entry['mean_wer']):>10} "
              f"{percent(entry['std_wer']):>6} {versus:>22}")


def write_json(args, argv: list[str], rows: list[dict], summary: list[dict], gpus: list[str] | None,
               measured_on: dict) -> None:
    """The JSON: the runs, the summary and the configuration, with the command as typed and `measured_on`, environment()
    as the runs started. A report runs nothing here, and has none: this machine's GPU and versions would describe a
    training that did not happen (each run's own devices are in its row)."""
    config = {"command": shlex.join(["python", "-m", "benchmarks.wer_parity", *argv]),
              "backends": args.backends, "seeds": args.seeds, "graphs": args.graphs,
              "ranks": args.ranks, "overrides": args.overrides, "backend_overrides": backend_overrides(args),
              "at_epoch": args.at_epoch, "gpus": gpus,
              "report": args.report, **measured_on}
    write_results(args.json, {"config": config, "runs": rows, "summary": summary})
    say_written(args.json)


def last_line(path: Path) -> str:
    """A run's output's last line that is not blank: what the trainer says when it stops on an error."""
    if path.exists() and not path.is_file():  # as read_text says: read, /dev/zero or a pipe never ended
        return f"{path} is not a file (a pipe, a device)"
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()] if path.exists() else []
    return lines[-1].strip() if lines else f"{path} is empty"


if __name__ == "__main__":
    sys.exit(run_tool(main))
