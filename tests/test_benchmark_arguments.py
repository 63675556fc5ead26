"""The GPU benchmarks refuse a size or count they cannot measure before anything runs, naming the argument, on any
machine."""
import argparse
import contextlib
import errno
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT, without_root_privilege
from trainer import cli


# scaling_model's required flags: argparse refuses a value before either path is read.
SCALING_MODEL_PATHS = ["--measured", "unread.json", "--out", "unwritten"]


@pytest.mark.parametrize("module, arguments, complaint", [
    ("benchmarks.rnn_kernels", ["--hiddens", "0"], "argument --hiddens: must be at least 1, not 0"),
    ("benchmarks.rnn_kernels", ["--batches", "4", "-1"], "argument --batches: must be at least 1, not -1"),
    ("benchmarks.rnn_stack", ["--depths", "0", "2"], "argument --depths: must be at least 1, not 0"),
    ("benchmarks.rnn_stack", ["--batch", "0"], "argument --batch: must be at least 1, not 0"),
    # These two named no value: "--batches and --steps must be positive, --warmup at least 0, --frames at least 10".
    ("benchmarks.train_step", ["--batches", "4", "0"], "argument --batches: must be at least 1, not 0"),
    ("benchmarks.train_step", ["--frames", "5"], "argument --frames: must be at least 10, not 5"),
    ("benchmarks.scaling", ["--compute-batches", "0"], "argument --compute-batches: must be at least 1, not 0"),
    ("benchmarks.scaling", ["--warmup", "-1"], "argument --warmup: must be at least 0, not -1"),
    ("benchmarks.scaling", ["--steps", "x"], "argument --steps: invalid integer value: 'x'"),
    ("benchmarks.scaling", ["--timeout-s", "0"], "argument --timeout-s: must be a positive number of seconds up to "
                                                 "1e+09, not 0"),
    ("benchmarks.train_step", ["--timeout-s", "inf"], "argument --timeout-s: must be a finite number, not inf"),
    # A seed torch cannot take ended the run in "Overflow when unpacking long long" once it started measuring.
    ("benchmarks.scaling", ["--seed", str(2**64)], f"argument --seed: must be at most {2**32 - 1}, not {2**64}"),
    ("benchmarks.train_step", ["--seed", "-1"], "argument --seed: must be at least 0, not -1"),
    # The first two said "--parallel and --ranks must be at least 1", naming neither which nor the value; the three
    # exited 1, where every other usage error exits 2.
    ("benchmarks.wer_parity", ["--parallel", "0"], "argument --parallel: must be at least 1, not 0"),
    ("benchmarks.wer_parity", ["--ranks", "-2"], "argument --ranks: must be at least 1, not -2"),
    ("benchmarks.wer_parity", ["--at-epoch", "0"], "argument --at-epoch: must be at least 1, not 0"),
    # "invalid parse value", argparse naming the type function, before the support table took trainer.cli's types.
    ("benchmarks.support_table", ["--hiddens", "abc"], "argument --hiddens: invalid integer value: 'abc'"),
    ("benchmarks.support_table", ["--max-batch", "33"], "argument --max-batch: must be at most 32, not 33"),
    # scaling_model checked these by hand after parsing, each in its own words ("--global-batch values must be at least
    # 1, got [-128]", "--gpus-per-node must be positive and finite, got 0"); --gpus 0 was once refused as "must be at
    # most --gpus-per-node 8 or a multiple of it", which 0 is.
    ("benchmarks.scaling_model", [*SCALING_MODEL_PATHS, "--global-batch", "128", "-128"],
     "argument --global-batch: must be at least 1, not -128"),
    ("benchmarks.scaling_model", [*SCALING_MODEL_PATHS, "--gpus", "0"], "argument --gpus: must be at least 1, not 0"),
    ("benchmarks.scaling_model", [*SCALING_MODEL_PATHS, "--gpus-per-node", "0"],
     "argument --gpus-per-node: must be at least 1, not 0"),
    ("benchmarks.scaling_model", [*SCALING_MODEL_PATHS, "--nics-per-node", "0"],
     "argument --nics-per-node: must be at least 1, not 0"),
])
def test_a_size_or_count_below_one_is_refused_by_name(module, arguments, complaint):
    result = subprocess.run([sys.executable, "-m", module, *arguments], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and complaint in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("module", ["benchmarks.train_step", "benchmarks.scaling"])
def test_graphed_steps_are_timed_after_their_capture(module):
    result = subprocess.run([sys.executable, "-m", module, "--cuda-graphs", "--warmup", "0"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    # train_step exited 1 (sys.exit), where scaling exits 2 for the same, as for every other usage error.
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    # Both as a usage error, before any rank starts: scaling said it as "error on rank 0" after its process group's
    # start, in a check of its own beside train_step's.
    complaint = (f"python -m {module}: error: --cuda-graphs needs --warmup of at least 1: the graphs' capture would "
                 "be timed")
    assert complaint in result.stderr, result.stderr[-2000:]


def test_rnn_stack_with_one_depth_is_a_usage_error_before_it_looks_for_a_gpu():
    # It exited 1, and only on a machine with a GPU: without one, its "needs a CUDA GPU" came first.
    result = subprocess.run([sys.executable, "-m", "benchmarks.rnn_stack", "--depths", "4"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.endswith("error: argument --depths: give at least two depths to fit the per-layer cost\n"), (
        result.stderr[-2000:])


@pytest.mark.cuda
def test_scaling_refuses_a_batch_the_persistent_kernels_cannot_run_before_measuring_any():
    """The default --compute-batches run to 512 utterances, past what the kernels hold: refused before the smaller
    batches' minutes of measures, which it would otherwise end with nothing written."""
    result = subprocess.run([sys.executable, "-m", "benchmarks.scaling", "--backend", "persistent", "--compute-batches",
                             "1", "4096", "--steps", "1", "--warmup", "0", "--frames", "50"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "error on rank 0: per-rank batch 4096: prnn_kernels.GRU: backend='persistent' cannot run" in result.stderr, (
        result.stderr[-2000:])


@pytest.mark.cuda
def test_scaling_asks_the_backend_for_the_steps_per_rank_batch_too_before_measuring():
    """The step's per-rank batch, which --compute-batches need not name, is asked with theirs: left out, a batch the
    kernels cannot run ended the run after the compute measures, unwritten. Named as the step's, from --global-batch:
    the line pointed at --compute-batches, which did not name it."""
    result = subprocess.run([sys.executable, "-m", "benchmarks.scaling", "--backend", "persistent", "--global-batch",
                             "4096", "--compute-batches", "2", "--steps", "1", "--warmup", "0", "--frames", "50"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "error on rank 0: per-rank batch 4096: prnn_kernels.GRU: backend='persistent' cannot run" in result.stderr, (
        result.stderr[-2000:])
    assert "(the step's: --global-batch 4096 over 1 rank)" in result.stderr, result.stderr[-2000:]


def test_scaling_refuses_cuda_graphs_at_a_batch_run_on_cudnn_before_measuring_any(monkeypatch):
    """--cuda-graphs with --backend auto, the default, whose batches past what the persistent kernels hold run on
    cuDNN: the graphs' capture refused the first such batch, ending the run after the smaller batches' measures with
    nothing written. Here on a CPU, its recurrent layers answering as a GPU's would: persistent up to batch 1."""
    from benchmarks import scaling
    from prnn_kernels.modules import _BackendChoice

    timed = []
    monkeypatch.setattr(scaling, "time_ms", lambda *arguments: timed.append(arguments) or [1.0])
    monkeypatch.setattr(_BackendChoice, "backend_for", lambda layer, batch_size, dtype, device:
                        "persistent" if batch_size <= 1 else "cudnn")
    args = argparse.Namespace(model="cpu_demo", backend="auto", cell=None, global_batch=1, frames=20, steps=1,
                              warmup=1, compute_batches=[1, 2], amp="none", cuda_graphs=True, seed=1)
    cfg = scaling.compose_config(args.model, args.backend, args.cell, args.amp)
    config = {"num_features": scaling.build.features(cfg.data).num_features, "amp": False}
    env = scaling.DistEnv(0, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^per-rank batch 2: CUDA graphs: recurrent layer .* runs on cuDNN at batch 2 "
                                         r".*\(--compute-batches names the batches measured\)$"):
        scaling.measure(args, env, cfg, config, None)
    # On cuDNN at every batch, as --backend cudnn: no batch option is why.
    monkeypatch.setattr(_BackendChoice, "backend_for", lambda layer, batch_size, dtype, device: "cudnn")
    with pytest.raises(ValueError, match=r"^--backend auto: CUDA graphs: recurrent layer .* runs on cuDNN at batch 1 "):
        scaling.measure(args, env, cfg, config, None)
    assert timed == []


def test_scaling_names_the_backend_where_no_batch_would_run():
    """On a CPU the persistent backend refuses every batch: the line blamed the smallest and pointed at
    --compute-batches, which no value of would help."""
    result = subprocess.run([sys.executable, "-m", "benchmarks.scaling", "--backend", "persistent", "--device", "cpu",
                             "--model", "cpu_demo", "--global-batch", "1", "--compute-batches", "2", "--steps", "1",
                             "--warmup", "0", "--frames", "50"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert ("error on rank 0: --backend persistent: prnn_kernels.GRU: backend='persistent' cannot run: needs a CUDA "
            "GPU") in result.stderr, result.stderr[-2000:]
    assert "per-rank batch" not in result.stderr and "--compute-batches" not in result.stderr, result.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU it would measure")
@pytest.mark.parametrize("module", ["benchmarks.rnn_kernels", "benchmarks.rnn_stack", "benchmarks.train_step",
                                    "benchmarks.support_table"])
def test_a_gpu_benchmark_on_a_machine_without_a_gpu_is_a_usage_error(module):
    # It exited 1, where benchmarks.scaling exits 2 for the same.
    result = subprocess.run([sys.executable, "-m", module], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr == f"error: {module} needs a CUDA GPU, and none is visible\n", result.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU it would measure")
def test_scaling_on_a_machine_without_a_gpu_refuses_the_gpu_models_unless_asked():
    result = subprocess.run([sys.executable, "-m", "benchmarks.scaling"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "no GPU here, and the an4 model's measures would take hours on a CPU" in result.stderr, result.stderr[-2000:]



@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU it would measure")
def test_scaling_asked_for_a_gpu_on_a_machine_without_one_names_its_own_flags():
    # It gave the trainer's refusal: "device=cuda (experiment=an4_gpu and deep100 set it) ... set device=cpu".
    result = subprocess.run([sys.executable, "-m", "benchmarks.scaling", "--device", "cuda", "--model", "cpu_demo"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr == ("error on rank 0: --device cuda: no CUDA GPU is visible; --device cpu measures on the "
                             "CPU\n"), result.stderr[-2000:]

# benchmarks.scaling's smallest measures, a few seconds on a CPU.
SMALL_CPU_SCALING = ["--model", "cpu_demo", "--compute-batches", "1", "2", "--global-batch", "2", "--steps", "1",
                     "--warmup", "0", "--frames", "50"]


@pytest.mark.parametrize("module", ["benchmarks.rnn_kernels", "benchmarks.rnn_stack", "benchmarks.train_step",
                                    "benchmarks.scaling", "benchmarks.wer_parity", "benchmarks.support_table"])
def test_a_json_path_that_is_a_folder_is_refused_before_measuring(tmp_path, module):
    """benchmarks.scaling measured for minutes, printed its table, then ended in IsADirectoryError with the JSON lost;
    the others lost their first row or stack so, and wer_parity its hours of training."""
    report_only = ["--report", "--runs-dir", str(tmp_path / "none")] if module == "benchmarks.wer_parity" else []
    result = subprocess.run([sys.executable, "-m", module, *report_only, "--json", str(tmp_path)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"argument --json: {tmp_path} is a folder; name a file in it" in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("module, arguments", [("benchmarks.scaling", SMALL_CPU_SCALING),
                                               ("benchmarks.support_table", ["--hiddens", "256"])])
def test_a_json_path_of_a_dash_is_refused_not_written_as_a_file_so_named(tmp_path, module, arguments):
    """The benchmarks wrote a file named "-"; the support table took it for stdout, alone among them."""
    result = subprocess.run([sys.executable, "-m", module, *arguments, "--json", "-"],
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2 and not (tmp_path / "-").exists(), result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.endswith(
        "argument --json: '-' is no file name here: /dev/stdout writes to stdout\n"), result.stderr[-2000:]


def test_a_json_to_dev_stdout_under_a_redirection_follows_the_table(tmp_path):
    """--json /dev/stdout > scaling.txt truncated the table printed before it and wrote the JSON from the file's start,
    where the "wrote" line after it landed inside the JSON; then it followed the JSON on stdout, which a reader of the
    JSON had to cut off."""
    with open(tmp_path / "scaling.txt", "w") as stdout:
        result = subprocess.run([sys.executable, "-m", "benchmarks.scaling", *SMALL_CPU_SCALING, "--json",
                                 "/dev/stdout"], cwd=REPO_ROOT, stdout=stdout, stderr=subprocess.PIPE, text=True,
                                timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    table, _, written = (tmp_path / "scaling.txt").read_text().partition("\n{\n")
    assert "compute, one rank alone" in table and json.loads("{" + written)["config"]["global_batch"] == 2, written
    assert result.stderr.endswith("wrote /dev/stdout\n"), result.stderr[-2000:]


def test_scaling_refuses_a_json_path_that_is_its_baseline_before_measuring(tmp_path):
    """--json one.json --baseline one.json measured, then wrote the run over its baseline: the one-process measurement
    was lost, and a run of several ranks left a file no later --baseline takes."""
    baseline = tmp_path / "one.json"
    made = subprocess.run([sys.executable, "-m", "benchmarks.scaling", *SMALL_CPU_SCALING, "--json", str(baseline)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    measured = baseline.read_text()
    result = subprocess.run([sys.executable, "-m", "benchmarks.scaling", *SMALL_CPU_SCALING, "--json", str(baseline),
                             "--baseline", str(baseline)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr == (f"error on rank 0: {baseline} is also an input of this command: writing it would destroy "
                             "it\n"), result.stderr[-2000:]
    assert baseline.read_text() == measured


def test_a_json_path_in_a_missing_folder_has_it_made_before_measuring(tmp_path):
    folder = tmp_path / "results" / "today"
    result = subprocess.run([sys.executable, "-m", "benchmarks.wer_parity", "--json", str(folder / "wer.json"),
                             "--report", "--runs-dir", str(tmp_path / "no_runs")], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert folder.is_dir(), result.stdout[-2000:] + result.stderr[-2000:]


def test_a_benchmark_without_json_writes_a_new_file_in_the_results_folder(tmp_path):
    """Without --json a benchmark printed its table and wrote no JSON: a long GPU measurement run as the README gives
    it was lost to a scrolled-away terminal."""
    results = tmp_path / "results"  # made where missing
    result = subprocess.run([sys.executable, "-m", "benchmarks.scaling", *SMALL_CPU_SCALING], cwd=REPO_ROOT,
                            env={**os.environ, cli.RESULTS_FOLDER_VARIABLE: str(results)}, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    written = list(results.iterdir()) if results.is_dir() else []
    assert [re.fullmatch(r"scaling-\d{8}-\d{6}\.json", path.name) is not None for path in written] == [True], written
    assert json.loads(written[0].read_text())["config"]["global_batch"] == 2
    assert result.stdout.endswith(f"\nwrote {written[0]}\n"), result.stdout[-2000:]


def test_the_default_json_file_is_beside_the_script_and_a_second_in_its_second_takes_another_name(tmp_path,
                                                                                                  monkeypatch):
    """Two runs started in the same second, each finding the file of that second's name free, would have written one
    file, the later run's over the earlier's. Each takes its name as it starts; one that ends without a result leaves
    no empty file behind. Without $PRNN_BENCHMARK_RESULTS the folder is results/ beside the script, wherever it runs
    from."""
    monkeypatch.delenv(cli.RESULTS_FOLDER_VARIABLE)
    script = tmp_path / "package" / "tool.py"
    take_two = ("import sys\nfrom trainer.cli import json_file\n"
                "first = json_file(None, sys.argv[1])\nopen(first, 'w').write('{}')\n"
                "print(first)\nprint(json_file(None, sys.argv[1]))")  # the second run, which ends without a result
    result = subprocess.run([sys.executable, "-c", take_two, str(script)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    first, second = map(Path, result.stdout.split())
    assert first.parent == second.parent == tmp_path / "package" / "results", result.stdout
    assert re.fullmatch(r"tool-\d{8}-\d{6}\.json", first.name), first
    if second.stem.startswith(first.stem):  # unless a second ended between them
        assert second.stem == f"{first.stem}-2"
    assert list(first.parent.iterdir()) == [first] and first.read_text() == "{}"
    assert cli.json_file("given.json", str(script)) == "given.json"


def test_the_default_json_files_are_git_ignored_and_one_renamed_to_keep_is_not(tmp_path, monkeypatch):
    """The names json_file takes stay out of `git status`, a second run's `-2` too; one renamed to say what it
    measured, the time kept (`...-031500-h100.json`), was ignored too, and `git add -A` passed it over."""
    monkeypatch.setenv(cli.RESULTS_FOLDER_VARIABLE, str(tmp_path))
    taken = [Path(cli.json_file(None, str(REPO_ROOT / "benchmarks" / "rnn_kernels.py"))) for _ in range(2)]
    taken.append(taken[0].with_name(f"{taken[0].stem}-1000.json"))  # the last name json_file takes in a second
    renamed = [taken[0].with_name(f"{taken[0].stem}-h100.json"), taken[0].with_name(f"{taken[0].stem}_h100.json")]
    asked = [f"benchmarks/results/{path.name}" for path in [*taken, *renamed]]
    result = subprocess.run(["git", "check-ignore", "--no-index", *asked], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode in (0, 1), result.stderr
    assert result.stdout.split() == asked[:len(taken)]


def test_the_thousandth_results_file_of_a_second_is_taken_and_the_next_refused_counting_them(tmp_path, monkeypatch):
    """The other tests take two names a second: the last name taken, and the refusal's count of those that exist,
    had none (mutants that stopped one short, or counted one too many, passed every test)."""
    monkeypatch.setenv(cli.RESULTS_FOLDER_VARIABLE, str(tmp_path))
    second = cli.time.gmtime(0)
    monkeypatch.setattr(cli.time, "gmtime", lambda *seconds: second)  # every name of one second
    stem = "tool-19700101-000000"
    for count in range(1, cli.MAX_RUNS_A_SECOND):
        (tmp_path / (f"{stem}.json" if count == 1 else f"{stem}-{count}.json")).write_text("{}")
    assert cli.json_file(None, "tool.py") == str(tmp_path / f"{stem}-1000.json")
    with pytest.raises(cli.CannotWrite, match=f"^cannot write {tmp_path}/{stem}.json: it and 999 more of that second "
                                              f"exist{re.escape(cli.JSON_ELSEWHERE)}$"):
        cli.json_file(None, "tool.py")


def test_a_results_folder_that_cannot_be_made_is_named(tmp_path, monkeypatch):
    taken = tmp_path / "results"
    taken.write_text("")
    monkeypatch.setenv(cli.RESULTS_FOLDER_VARIABLE, str(taken))
    with pytest.raises(cli.CannotWrite, match=f"^cannot make the folder {taken}: File exists; --json PATH or "
                                              "PRNN_BENCHMARK_RESULTS=DIR puts the JSON elsewhere$"):
        cli.json_file(None, str(tmp_path / "tool.py"))


def test_a_results_folder_that_cannot_be_written_in_is_refused_saying_where_else_to_write(tmp_path):
    """A read-only checkout's results/, which exists, refused every benchmark in a line naming the file alone, where
    --json or $PRNN_BENCHMARK_RESULTS would have let it run."""
    results = tmp_path / "results"
    results.mkdir(mode=0o555)
    take = ("from trainer.cli import CannotWrite, json_file\ntry:\n    json_file(None, 'tool.py')\n"
            "except CannotWrite as error:\n    print(error, end='')\n")
    result = subprocess.run(without_root_privilege([sys.executable, "-c", take]), cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60, env={**os.environ, cli.RESULTS_FOLDER_VARIABLE: str(results)})
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(rf"cannot write {re.escape(str(results))}/tool-\d{{8}}-\d{{6}}\.json: Permission denied; "
                        r"--json PATH or PRNN_BENCHMARK_RESULTS=DIR puts the JSON elsewhere", result.stdout), \
        result.stdout


def test_the_support_table_makes_a_missing_json_folder_and_refuses_one_it_cannot_make(tmp_path, monkeypatch, capsys):
    """A file where a folder of the path should be ended in mkdir's FileExistsError traceback, with or without a
    GPU; a missing folder is made as the arguments are read, before the GPU is asked for."""
    from benchmarks import support_table

    table = tmp_path / "table"
    table.write_text("")
    for path, why in ((table / "t.json", "File exists"), (table / "sub" / "t.json", "Not a directory")):
        with pytest.raises(SystemExit) as exit_info:
            support_table.main(["--hiddens", "256", "--json", str(path)])
        assert exit_info.value.code == 2
        assert f"error: argument --json: cannot make the folder of {path}: {why}\n" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert support_table.main(["--hiddens", "256", "--json", str(tmp_path / "new" / "table.json")]) == 2
    assert (tmp_path / "new").is_dir()


def test_a_measurement_or_baseline_that_is_not_json_is_named(tmp_path, capsys):
    """A truncated JSON was refused as "Expecting ',' delimiter: line 2 column 1 (char 24)", naming no file."""
    from benchmarks import scaling_model

    truncated = tmp_path / "one_gpu.json"
    truncated.write_text('{"benchmark": "scaling"\n')
    assert scaling_model.main(["--measured", str(truncated), "--out", str(tmp_path / "out")]) == 2
    assert f"error: {truncated} is not JSON: Expecting ',' delimiter" in capsys.readouterr().err
    result = subprocess.run([sys.executable, "-m", "benchmarks.scaling", *SMALL_CPU_SCALING, "--baseline",
                             str(truncated)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    # It said "--baseline PATH: Expecting ',' delimiter", where benchmarks.scaling_model said the file is not JSON.
    assert f"error on rank 0: {truncated} is not JSON: Expecting ',' delimiter" in result.stderr, result.stderr[-2000:]



def test_a_measurement_that_cannot_be_read_is_named_without_errnos_words(tmp_path, capsys):
    """It read "error: [Errno 21] Is a directory: '/tmp/...'"."""
    from benchmarks import scaling_model

    for measured, why in ((tmp_path, "Is a directory"), (tmp_path / "missing.json", "No such file or directory")):
        assert scaling_model.main(["--measured", str(measured), "--out", str(tmp_path / "out")]) == 2
        assert capsys.readouterr().err == f"error: {measured}: {why}\n"
    assert not (tmp_path / "out").exists()


def test_a_measurement_without_end_is_refused_once_past_any_json_of_the_script(tmp_path, capsys):
    """--measured /dev/zero (or a link to it, or a pipe that never ends) was read whole: all the memory, then a
    MemoryError traceback. --baseline reads the file the same way."""
    from benchmarks import scaling_model

    assert scaling_model.main(["--measured", "/dev/zero", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == ("error: /dev/zero is larger than 64 MiB, which no benchmarks.scaling JSON "
                                       "is\n")


def test_scaling_model_refuses_an_overlap_that_is_not_a_number(tmp_path, capsys):
    """--overlap nan was taken, and the projection written with every efficiency NaN (exit 0)."""
    from benchmarks import scaling_model

    assert scaling_model.main(["--measured", str(tmp_path / "unread.json"), "--out", str(tmp_path / "out"),
                               "--overlap", "0.5", "nan"]) == 2
    assert "error: --overlap values must lie in [0, 1], got [0.5, nan]" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_scaling_model_without_matplotlib_names_the_extra_before_writing(tmp_path, monkeypatch, capsys):
    """Installed without the bench extra, it wrote the Markdown and JSON, then ended in ModuleNotFoundError."""
    from benchmarks import scaling_model

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an import finds where matplotlib is not installed
    measured = REPO_ROOT / "benchmarks" / "results" / "scaling_an4_cudnn_2gpu.json"
    assert scaling_model.main(["--measured", str(measured), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == ("error: the plot needs matplotlib, which the bench extra installs: "
                                       "pip install -e '.[bench]'\n")
    assert not (tmp_path / "out").exists()


def quoted_commands(document: str) -> list[list[str]]:
    """Each `python -m benchmarks.X ...` command the document quotes, in a code block or inline, as its words from
    `python` on (after `mpirun -np N`, say); synopses, whose brackets mark what is optional, and a tool named without
    arguments left out."""
    text = (REPO_ROOT / document).read_text()
    blocks = re.findall(r"^```\w*\n(.*?)^```$", text, re.S | re.M)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    prose = re.sub(r"^```\w*\n.*?^```$", "", text, flags=re.S | re.M)
    spans = re.findall(r"`([^`]*?)`", prose)
    tool = re.compile(r"python -m\s+benchmarks\.")
    commands = [(words := shlex.split(command))[words.index("python"):] for command in [*lines, *spans]
                if tool.search(command) and "[" not in command]
    return [words for words in commands if len(words) > 3]


# What the documents write for a value the reader chooses.
PLACEHOLDERS = {"M": "an4", "OVERRIDES": "optim.lr=1e-3"}


class Parsed(Exception):
    """Raised in place of the work a command would start once its arguments are parsed."""


@pytest.mark.parametrize("document", ["README.md", "benchmarks/README.md"])
def test_every_benchmark_command_the_documents_quote_parses(document, monkeypatch, capsys, tmp_path):
    """A flag renamed or a choice dropped in the code left the commands the figures were measured with unrunnable as
    written. Each command's own main parses it here and stops there: argparse refuses an unknown flag or a bad value."""
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, *arguments, **options):
        parse(parser, *arguments, **options)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.chdir(tmp_path)  # --json makes the folders of the file it names as it is parsed
    commands = quoted_commands(document)
    assert len(commands) >= 5, commands
    for words in commands:
        module = words[2]
        monkeypatch.setattr(sys, "argv", [module, *(PLACEHOLDERS.get(word, word) for word in words[3:])])
        try:
            importlib.import_module(module).main()  # each reads sys.argv, as run from a shell
        except SystemExit as refused:
            pytest.fail(f"{' '.join(words)}: exit code {refused.code}: {capsys.readouterr().err}")
        except Parsed:
            continue
        pytest.fail(f"{' '.join(words)}: parsed no arguments")


@pytest.mark.parametrize("module, arguments", [
    ("benchmarks.scaling_model", ["--measured", str(REPO_ROOT / "benchmarks/results/scaling_an4_cudnn_2gpu.json"),
                                  "--out", "{tmp_path}"]),
    ("benchmarks.wer_parity", ["--report", "--runs-dir", "{tmp_path}", "--backends", "cudnn", "--seeds", "1"]),
])
def test_a_reader_that_stops_early_ends_the_tables_quietly(module, arguments, tmp_path):
    # Both ended in a BrokenPipeError's traceback, as the trainer's tools did before run_tool.
    (tmp_path / "wer-cudnn-s1").mkdir()
    command = shlex.join([sys.executable, "-m", module, *(part.format(tmp_path=tmp_path) for part in arguments)])
    piped = subprocess.run(["bash", "-c", f"{command} | true; exit ${{PIPESTATUS[0]}}"], cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=300)
    assert piped.returncode == 1 and "Traceback" not in piped.stderr, piped.stderr


def test_scaling_model_refuses_an_out_it_cannot_write_whole_before_writing(tmp_path, capsys):
    """A folder in the place of its .json ended the run in IsADirectoryError's traceback; as no permission did."""
    from benchmarks import scaling_model

    (tmp_path / "scaling_projection.json").mkdir()
    measured = str(REPO_ROOT / "benchmarks/results/scaling_an4_cudnn_2gpu.json")
    assert scaling_model.main(["--measured", measured, "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"error: --out {tmp_path}: {tmp_path}/scaling_projection.json is a folder; name "
                                       "a file in it\n")
    assert [path.name for path in tmp_path.iterdir()] == ["scaling_projection.json"]


def test_scaling_model_a_write_refused_part_way_leaves_the_projection_before_it_as_it_was(tmp_path):
    """A file size limit (ulimit -f) fails a write part way, as a disk filling up does: the .json and .md were
    written in place, so such a run left them cut short."""
    import resource

    before = '{"rows": "an earlier projection"}\n'
    (tmp_path / "scaling_projection.json").write_text(before)
    measured = str(REPO_ROOT / "benchmarks/results/scaling_an4_cudnn_2gpu.json")
    limit = 2000  # bytes: less than the projection's .json
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.scaling_model", "--measured", measured, "--out", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY)))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"cannot write {tmp_path}/scaling_projection.json: File too large" in result.stderr, result.stderr
    assert (tmp_path / "scaling_projection.json").read_text() == before


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_scaling_model_a_plot_cut_short_leaves_the_earlier_one_as_it_was(failure, tmp_path, monkeypatch, capsys):
    """The .json and .md were written beside and renamed, but savefig wrote straight into scaling_projection.png: a
    full disk or a Ctrl-C mid-write left a PNG cut short beside a complete JSON."""
    from matplotlib.figure import Figure

    from benchmarks import scaling_model
    from trainer.cli import run_tool

    def savefig_cut_short(figure, into, **settings):
        with open(into, "wb") if isinstance(into, (str, os.PathLike)) else contextlib.nullcontext(into) as file:
            file.write(b"\x89PNG cut short")
        raise failure

    monkeypatch.setattr(Figure, "savefig", savefig_cut_short)
    earlier = tmp_path / "scaling_projection.png"
    earlier.write_bytes(b"an earlier plot")
    measured = str(REPO_ROOT / "benchmarks/results/scaling_an4_cudnn_2gpu.json")
    exit_code = 2 if isinstance(failure, OSError) else 130
    assert run_tool(lambda: scaling_model.main(["--measured", measured, "--out", str(tmp_path)])) == exit_code
    assert earlier.read_bytes() == b"an earlier plot"
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "scaling_projection.json", "scaling_projection.md", "scaling_projection.png"]
    if isinstance(failure, OSError):
        assert capsys.readouterr().err.endswith(f"error: cannot write {earlier}: No space left on device\n")


@pytest.mark.parametrize("empty", ["--measured", "--out"])
def test_scaling_model_refuses_an_empty_path(empty, tmp_path, monkeypatch, capsys):
    """--out "$OUT" unset wrote the projection into the current folder (exit 0)."""
    from benchmarks import scaling_model

    monkeypatch.chdir(tmp_path)
    arguments = {"--measured": str(REPO_ROOT / "benchmarks/results/scaling_an4_cudnn_2gpu.json"), "--out": "out",
                 empty: ""}
    with pytest.raises(SystemExit) as exit_info:
        scaling_model.main([word for pair in arguments.items() for word in pair])
    assert exit_info.value.code == 2
    assert f"error: argument {empty}: an empty path (an unset shell variable?)" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("module, arguments", [
    # --baseline "$ONE" unset measured for minutes without the efficiency it was given to compute (exit 0).
    ("benchmarks.scaling", [*SMALL_CPU_SCALING, "--baseline"]),
    # --runs-dir "$RUNS" unset trained (or reported) in the current folder in place of runs/.
    ("benchmarks.wer_parity", ["--report", "--runs-dir"]),
])
def test_an_empty_baseline_or_runs_folder_is_refused(module, arguments, tmp_path):
    result = subprocess.run([sys.executable, "-m", module, *arguments, ""], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.endswith(f"error: argument {arguments[-1]}: an empty path (an unset shell variable?)\n"), (
        result.stderr[-2000:])
    assert list(tmp_path.iterdir()) == []


BENCHMARKS = ["rnn_kernels", "rnn_stack", "support_table", "train_step", "wer_parity", "scaling", "scaling_model"]


def benchmark_parser(name: str, monkeypatch) -> argparse.ArgumentParser:
    """The argument parser of benchmarks.`name`, as its main builds it."""
    parsers = []

    def record_then_stop(parser, *arguments, **options):
        parsers.append(parser)
        raise Parsed

    with monkeypatch.context() as patched:
        patched.setattr(argparse.ArgumentParser, "parse_args", record_then_stop)
        patched.setattr(sys, "argv", [f"benchmarks.{name}"])
        with pytest.raises(Parsed):
            importlib.import_module(f"benchmarks.{name}").main()
    return parsers[0]


@pytest.mark.parametrize("name", BENCHMARKS)
def test_each_benchmarks_synopsis_in_its_readme_names_every_flag(name, monkeypatch):
    """benchmarks/README.md gives each script's command with every flag it takes: train_step's and scaling's left out
    --timeout-s, which a reader of their sections could not know they take."""
    parser = benchmark_parser(name, monkeypatch)
    flags = {flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")}
    text = (REPO_ROOT / "benchmarks" / "README.md").read_text()
    synopsis = re.search(rf"^```\n((?:mpirun -np N )?python -m benchmarks\.{name} .*?)^```$", text, re.S | re.M)
    assert synopsis, f"benchmarks/README.md gives no synopsis of benchmarks.{name}"
    assert flags - {"--help"} - set(re.findall(r"--[\w-]+", synopsis.group(1))) == set()
    # --json showed as JSON in most scripts' --help and as PATH in support_table's and in these synopses.
    for action in parser._actions:
        if "--json" in action.option_strings:
            assert f"[--json {action.metavar or action.dest.upper()}]" in synopsis.group(1)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_a_value_repeated_in_a_list_flag_is_refused_naming_it(name, monkeypatch, capsys):
    """`--hiddens 800 800`, `--batches 4 4` or `--cells relu relu` measured the point twice, where scaling_model
    dropped a repeat and wer_parity refused one without naming it: every list flag refuses a repeat, naming it."""
    parser = benchmark_parser(name, monkeypatch)
    required = [word for action in parser._actions if action.required and action.option_strings
                for word in (action.option_strings[0], "x")]  # scaling_model's --measured and --out
    # --backend-overrides is a backend and its trainer overrides, not a list of points.
    list_flags = [action for action in parser._actions
                  if action.nargs == "+" and action.option_strings and action.dest != "backend_overrides"]
    assert list_flags
    for action in list_flags:
        text = str([*(action.choices or action.default or [1])][0])
        shown = text if action.choices else action.type(text)
        flag = action.option_strings[0]
        with pytest.raises(SystemExit) as exited:
            parser.parse_args([*required, flag, text, text])
        assert exited.value.code == 2
        assert capsys.readouterr().err.endswith(f"error: argument {flag}: {shown} is given more than once\n"), flag


@pytest.mark.parametrize("name", BENCHMARKS)
def test_a_list_flag_given_twice_is_refused_not_its_first_values_dropped(name, monkeypatch, capsys):
    """`--batches 1 --batches 4` measured batch 4 alone, and `--cells relu --cells gru` the GRU alone: argparse keeps
    a list flag's last values, and the first were dropped without a word."""
    parser = benchmark_parser(name, monkeypatch)
    required = [word for action in parser._actions if action.required and action.option_strings
                for word in (action.option_strings[0], "x")]  # scaling_model's --measured and --out
    list_flags = [action for action in parser._actions
                  if action.nargs == "+" and action.option_strings and action.dest != "backend_overrides"]
    for action in list_flags:
        first, second = [*action.choices][:2] if action.choices else ["1", "2"]
        flag = action.option_strings[0]
        with pytest.raises(SystemExit) as exited:
            parser.parse_args([*required, flag, first, flag, second])
        assert exited.value.code == 2
        assert capsys.readouterr().err.endswith(
            f"error: argument {flag}: is given more than once: name all its values after one {flag}\n"), flag
