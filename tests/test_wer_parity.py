"""benchmarks.wer_parity end to end on CPU: two backends, two seeds each, side by side on a slice of AN4; then the same
command again, which continues the finished runs (they end at once) instead of training them anew."""
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks import wer_parity
from benchmarks.wer_parity import evaluations, summarize, visible_gpus
from conftest import MPIEXEC, REPO_ROOT, TINY, needs_mpiexec, within_seconds, write_slice
from trainer.cli import run_tool

# The tiny model's settings less those wer_parity sets for each run itself (and refuses among the overrides).
TINY_RUN = [setting for setting in TINY if setting.split("=")[0] not in wer_parity.RUN_KEYS]


@pytest.mark.slow
def test_runs_each_backend_and_seed_then_continues_them(an4_train, tmp_path):
    manifest = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:16])
    overrides = ["data=manifest", f"data.train_manifests=[{manifest}]", f"data.eval_manifest={manifest}", *TINY_RUN,
                 "train.epochs=1"]
    command = [sys.executable, "-m", "benchmarks.wer_parity", "--backends", "reference", "cudnn", "--seeds", "1", "2",
               "--parallel", "2", "--runs-dir", str(tmp_path / "runs"), "--json", str(tmp_path / "wer.json"), "--",
               *overrides]

    # Two named GPUs, which these CPU runs never open: the runs take them in turn.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "3,5"}
    first = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    result = json.loads((tmp_path / "wer.json").read_text())
    assert [(run["backend"], run["seed"]) for run in result["runs"]] == [
        ("reference", 1), ("reference", 2), ("cudnn", 1), ("cudnn", 2)]
    assert [run["gpu"] for run in result["runs"]] == ["3", "5", "3", "5"] and result["config"]["gpus"] == ["3", "5"]
    for run in result["runs"]:
        assert run["returncode"] == 0 and run["epochs"] == 1 and run["devices"][0].startswith("CPU"), run
        assert 0 <= run["last_wer"] < math.inf and run["best_wer"] == run["last_wer"]  # WER may pass 100 %
        assert "final test WER" in (tmp_path / "runs" / f"{run['run']}.out").read_text()
    reference, cudnn = result["summary"]
    assert reference["runs"] == cudnn["runs"] == 2
    # Both seeds finished on both backends: the mean per-seed difference is the difference of the means.
    assert cudnn["paired_seeds"] == 2 and math.isclose(cudnn["difference"], cudnn["mean_wer"] - reference["mean_wer"])
    assert (result["config"]["backends"], result["config"]["seeds"]) == (["reference", "cudnn"], [1, 2])

    again = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    continued = json.loads((tmp_path / "wer.json").read_text())
    # Finished runs end at once: the same evaluations, and the time they took to train, not this call's.
    for key in ("last_wer", "elapsed_s"):
        assert [run[key] for run in continued["runs"]] == [run[key] for run in result["runs"]]
    assert all(run["elapsed_s"] > 0 for run in continued["runs"])
    for run in continued["runs"]:
        assert "resumed from" in (tmp_path / "runs" / f"{run['run']}.out").read_text()


@pytest.mark.slow
@needs_mpiexec
def test_ranks_make_each_run_a_data_parallel_job(an4_train, tmp_path):
    """--ranks 2: the run is a two-rank job of launch/single_node.sh, here on CPUs (gloo)."""
    manifest = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:16])
    overrides = ["data=manifest", f"data.train_manifests=[{manifest}]", f"data.eval_manifest={manifest}", *TINY_RUN,
                 "train.epochs=1"]
    command = [sys.executable, "-m", "benchmarks.wer_parity", "--backends", "reference", "--seeds", "1", "--ranks",
               "2", "--runs-dir", str(tmp_path / "runs"), "--json", str(tmp_path / "wer.json"), "--", *overrides]
    env = {**os.environ, "MPIRUN": MPIEXEC, "OMP_NUM_THREADS": "1"}
    finished = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    result = json.loads((tmp_path / "wer.json").read_text())
    (run,) = result["runs"]
    assert (run["ranks"], run["returncode"], run["epochs"], result["config"]["ranks"]) == (2, 0, 1, 2), run
    output = (tmp_path / "runs" / f"{run['run']}.out").read_text()
    assert "rank 1 of 2" in output and output.count("final test WER") == 1, output[-3000:]
    assert json.loads((tmp_path / "runs" / run["run"] / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1


def test_summary_pairs_each_backend_with_the_first_by_seed():
    rows = [{"backend": backend, "seed": seed, "returncode": returncode, "last_wer": wer}
            for backend, seed, returncode, wer in [
                ("cudnn", 1, 0, 10.0), ("cudnn", 2, 0, 12.0), ("cudnn", 3, 0, 20.0),
                ("persistent", 1, 0, 11.0), ("persistent", 2, None, 15.0),  # None: reported, not run by this call
                ("persistent", 3, 1, 99.0),  # failed: left out, and its seed is not paired
                ("persistent", 4, 0, None)]]  # no evaluation yet
    cudnn, persistent = summarize(rows, ["cudnn", "persistent"])
    assert (cudnn["runs"], cudnn["mean_wer"]) == (3, 14.0) and "difference" not in cudnn
    # The sample standard deviation (n - 1), over the seeds: WERs 10, 12 and 20 square off 16 + 4 + 36 from 14.
    assert math.isclose(cudnn["std_wer"], math.sqrt(56 / 2))
    assert (persistent["runs"], persistent["mean_wer"], persistent["paired_seeds"]) == (2, 13.0, 2)
    # Two runs give a standard deviation too: WERs 11 and 15 square off 4 + 4 from 13.
    assert math.isclose(persistent["std_wer"], math.sqrt(8 / 1))
    # Per-seed differences 1 and 3.
    assert persistent["difference"] == 2.0 and math.isclose(persistent["difference_stderr"], 1.0)


def test_summary_pairs_by_seed_where_a_seed_finished_on_one_backend_alone():
    """Seed 1 failed on cuDNN: persistent's seeds 2 and 3 pair with cuDNN's, 1 point apart each. Paired in the order
    the runs finished, persistent's seed 1 (40) met cuDNN's seed 2 (10), and the difference came out 12.5 +- 17.5."""
    rows = [{"backend": backend, "seed": seed, "returncode": returncode, "last_wer": wer}
            for backend, seed, returncode, wer in [
                ("cudnn", 1, 1, None), ("cudnn", 2, 0, 10.0), ("cudnn", 3, 0, 16.0),
                ("persistent", 1, 0, 40.0), ("persistent", 2, 0, 11.0), ("persistent", 3, 0, 17.0)]]
    _, persistent = summarize(rows, ["cudnn", "persistent"])
    assert (persistent["paired_seeds"], persistent["difference"], persistent["difference_stderr"]) == (2, 1.0, 0.0)


def test_summary_gives_the_mean_paired_difference_over_three_seeds_and_its_standard_error():
    """The tests above paired two seeds, where a median is the mean: a paired difference taken as the median of the
    per-seed ones passed them, and over three seeds or more (the module docstring's --seeds 1234 7 11) hides the
    one that moved most."""
    rows = [{"backend": backend, "seed": seed, "returncode": 0, "last_wer": wer}
            for backend, seed, wer in [("cudnn", 1, 10.0), ("cudnn", 2, 10.0), ("cudnn", 3, 10.0),
                                       ("persistent", 1, 11.0), ("persistent", 2, 12.0), ("persistent", 3, 16.0)]]
    _, persistent = summarize(rows, ["cudnn", "persistent"])
    # Differences 1, 2 and 6: mean 3; they square off 4 + 1 + 9 from it, a sample variance of 7, over sqrt(3) seeds.
    assert (persistent["paired_seeds"], persistent["difference"]) == (3, 3.0)
    assert math.isclose(persistent["difference_stderr"], math.sqrt(7 / 3))


def write_metrics(run_dir, wers, elapsed_per_epoch=5.0):
    run_dir.mkdir(parents=True)
    lines = [{"step": 1, "epoch": 0, "loss": 9.0}]
    lines += [{"epoch": epoch, "eval_wer": wer, "eval_cer": wer / 2, "elapsed_s": epoch * elapsed_per_epoch}
              for epoch, wer in enumerate(wers, start=1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_evaluations_give_the_last_and_best(tmp_path):
    write_metrics(tmp_path / "run", [80.0, 70.0, 72.0])
    assert evaluations(tmp_path / "run") == {"epochs": 3, "last_wer": 72.0, "last_cer": 36.0, "best_wer": 70.0,
                                             "elapsed_s": 15.0, "partial_epochs": [], "unfinished": False}
    assert evaluations(tmp_path / "missing")["epochs"] == 0


def test_an_evaluation_without_a_cer_gives_its_wer(tmp_path):
    """eval_cer may be null or missing (EVALUATION_FIELDS): a line without it passed the check, then ended the report
    in a KeyError traceback."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"epoch": 1, "eval_wer": 30.0, "elapsed_s": 5.0}\n')
    assert evaluations(tmp_path / "run") == {"epochs": 1, "last_wer": 30.0, "last_cer": None, "best_wer": 30.0,
                                             "elapsed_s": 5.0, "partial_epochs": [], "unfinished": False}


def test_evaluations_leave_out_those_over_part_of_the_test_set(tmp_path):
    write_metrics(tmp_path / "run", [80.0, 70.0, 72.0])
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    lines[2] = json.dumps({"epoch": 2, "eval_wer": 0.0, "eval_cer": 0.0, "elapsed_s": 10.0, "eval_unreadable": 130})
    (tmp_path / "run" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert evaluations(tmp_path / "run") == {"epochs": 3, "last_wer": 72.0, "last_cer": 36.0, "best_wer": 72.0,
                                             "elapsed_s": 15.0, "partial_epochs": [2], "unfinished": False}
    assert evaluations(tmp_path / "run", at_epoch=1)["partial_epochs"] == []


def test_report_leaves_out_evaluations_without_a_wer_and_lines_that_are_no_object(tmp_path):
    """A null WER (the trainer's where it read no test utterance) ended the report in TypeError, a NaN one (which json
    reads) in statistics' AttributeError, a line that is JSON but no object in TypeError, and one that Python does not
    read (nested past its recursion limit, an integer of more than 4300 digits) in RecursionError or ValueError."""
    runs = tmp_path / "runs"
    write_metrics(runs / "x-cudnn-s1", [50.0, math.nan])
    write_metrics(runs / "x-persistent-s1", [40.0, 30.0])
    with open(runs / "x-persistent-s1" / "metrics.jsonl", "a") as metrics:
        metrics.write('7\n{"epoch": 3, "eval_wer": null, "eval_cer": null, "elapsed_s": 15.0}\n')
        metrics.write("[" * 100_000 + "\n" + "1" * 5000 + "\n")
    wer_parity.main(["--report", "--name", "x", "--seeds", "1", "--runs-dir", str(runs),
                     "--json", str(tmp_path / "wer.json")])

    def refuse(constant):
        raise ValueError(f"{constant} is not strict JSON")

    result = json.loads((tmp_path / "wer.json").read_text(), parse_constant=refuse)
    assert [(run["last_wer"], run["best_wer"], run["partial_epochs"]) for run in result["runs"]] == [
        (50.0, 50.0, [2]), (30.0, 30.0, [3])]
    assert result["summary"][1]["difference"] == -20.0


def test_a_report_to_dev_stdout_under_a_redirection_is_the_table_then_the_json(tmp_path):
    """--json /dev/stdout > report.txt truncated the table printed before it and wrote the JSON at the file's start,
    where the "wrote" line after it landed in the middle of the JSON; then it followed the JSON on stdout, which a
    reader of the JSON had to cut off."""
    write_metrics(tmp_path / "runs" / "x-cudnn-s1", [50.0, 40.0])
    with open(tmp_path / "report.txt", "w") as stdout:
        result = subprocess.run([sys.executable, "-m", "benchmarks.wer_parity", "--report", "--name", "x", "--seeds",
                                 "1", "--backends", "cudnn", "--runs-dir", str(tmp_path / "runs"), "--json",
                                 "/dev/stdout"], cwd=REPO_ROOT, stdout=stdout, stderr=subprocess.PIPE, text=True,
                                timeout=120)
    assert result.returncode == 0, result.stderr
    table, _, written = (tmp_path / "report.txt").read_text().partition("\n{\n")
    assert "x-cudnn-s1" in table and json.loads("{" + written)["runs"][0]["last_wer"] == 40.0, table + written
    assert result.stderr == "wrote /dev/stdout\n"


def test_evaluations_at_an_epoch_give_the_run_as_it_stood_then(tmp_path):
    write_metrics(tmp_path / "run", [80.0, 70.0, 60.0])
    assert evaluations(tmp_path / "run", at_epoch=2) == {"epochs": 2, "last_wer": 70.0, "last_cer": 35.0,
                                                         "best_wer": 70.0, "elapsed_s": 10.0, "partial_epochs": []}
    short = evaluations(tmp_path / "run", at_epoch=4)
    assert short["epochs"] == 3 and short["last_wer"] is None and short["best_wer"] is None


def test_a_run_short_of_its_epochs_or_with_a_half_written_line_is_read_as_it_stands(tmp_path, capsys):
    """A crashed run is no finished run: its config.yaml says how many epochs it was set to train."""
    runs = tmp_path / "runs"
    for name, wers in (("x-cudnn-s1", [50.0, 8.0]), ("x-cudnn-s2", [60.0, 7.0]), ("x-persistent-s1", [50.0, 9.0]),
                       ("x-persistent-s2", [85.0])):
        write_metrics(runs / name, wers)
        (runs / name / "config.yaml").write_text("train:\n  epochs: 2\n  max_steps: null\n")
    with open(runs / "x-persistent-s2" / "metrics.jsonl", "a") as metrics:
        metrics.write('{"step": 31, "epoch": 1, "lo')  # the job killed mid-write
    # Its ranks are its last job's: resumed on 8 ranks after a first job on 2.
    jobs = [{"from_step": 0, "world_size": 2, "device": "GPU A"}, {"from_step": 30, "world_size": 8, "device": "GPU A"}]
    (runs / "x-persistent-s1" / "jobs.jsonl").write_text("".join(json.dumps(job) + "\n" for job in jobs))
    wer_parity.main(["--report", "--name", "x", "--seeds", "1", "2", "--runs-dir", str(runs),
                     "--json", str(tmp_path / "wer.json")])
    result = json.loads((tmp_path / "wer.json").read_text())
    assert [(run["run"], run["unfinished"], run["ranks"]) for run in result["runs"]] == [
        ("x-cudnn-s1", False, 1), ("x-cudnn-s2", False, 1), ("x-persistent-s1", False, 8),
        ("x-persistent-s2", True, 1)]
    cudnn, persistent = result["summary"]
    assert (cudnn["runs"], persistent["runs"], persistent["paired_seeds"], persistent["difference"]) == (2, 1, 1, 1.0)
    assert "x-persistent-s2: stopped after epoch 1 of 2" in capsys.readouterr().out
    assert evaluations(runs / "x-persistent-s2", at_epoch=1)["last_wer"] == 85.0  # as it stood then, it counts


def test_a_run_set_to_stop_at_max_steps_counts_as_it_stands(tmp_path):
    """train.max_steps ends a run before its epochs: its config.yaml cannot tell when it ends, so a run stopped at
    epoch 1 of 2 counts, where the same run without max_steps is unfinished. One read as unfinished whatever its
    max_steps passed every test."""
    write_metrics(tmp_path / "run", [60.0])
    (tmp_path / "run" / "config.yaml").write_text("train:\n  epochs: 2\n  max_steps: 30\n")
    assert evaluations(tmp_path / "run")["unfinished"] is False
    (tmp_path / "run" / "config.yaml").write_text("train:\n  epochs: 2\n  max_steps: null\n")
    assert evaluations(tmp_path / "run")["unfinished"] is True


def test_the_tables_give_each_value_under_its_heading(tmp_path, capsys):
    """The runs' and the backends' tables, value by value: last and best WER, or a backend's mean and standard
    deviation, printed in each other's column, or the difference's standard error left out, passed every test."""
    runs = tmp_path / "runs"
    for name, wers in (("x-cudnn-s1", [80.0, 70.0, 72.0]), ("x-cudnn-s2", [60.0, 50.0]),
                       ("x-persistent-s1", [75.0, 73.0]), ("x-persistent-s2", [58.0, 53.0])):
        write_metrics(runs / name, wers)
    wer_parity.main(["--report", "--name", "x", "--seeds", "1", "2", "--runs-dir", str(runs)])
    lines = capsys.readouterr().out.splitlines()
    runs_header = lines.index(next(line for line in lines if line.startswith("run ")))
    assert lines[runs_header].split() == ["run", "exit", "epochs", "last", "WER", "%", "best", "WER", "%", "last",
                                          "CER", "%", "run", "s"]
    assert lines[runs_header + 1].split() == ["x-cudnn-s1", "-", "3", "72.00", "70.00", "36.00", "15"]
    backends_header = lines.index(next(line for line in lines if line.startswith("backend ")))
    assert lines[backends_header].split() == ["backend", "runs", "mean", "WER", "%", "std", "vs", "cudnn,", "paired"]
    # Last WERs 72 and 50 against 73 and 53: per-seed differences 1 and 3.
    assert lines[backends_header + 1].split() == ["cudnn", "2", "61.00", f"{math.sqrt(2 * 11**2):.2f}"]
    assert lines[backends_header + 2].split() == ["persistent", "2", "63.00", f"{math.sqrt(2 * 10**2):.2f}", "+2.00",
                                                  "+-", "1.00", "(2", "seeds)"]


def test_report_summarises_runs_where_they_stand_without_training(tmp_path, capsys):
    runs = tmp_path / "runs"
    write_metrics(runs / "x-cudnn-s1", [50.0, 40.0, 30.0])
    write_metrics(runs / "x-cudnn-s2", [60.0, 45.0])
    write_metrics(runs / "x-persistent-s1", [50.0, 35.0, 33.0, 31.0])
    write_metrics(runs / "x-persistent-s2", [55.0])  # stopped short of epoch 2
    jobs = [{"from_step": 0, "device": "GPU A"}, {"from_step": 90, "device": "GPU B"},
            {"from_step": 99, "device": "GPU A"}]
    (runs / "x-cudnn-s1" / "jobs.jsonl").write_text("".join(json.dumps(job) + "\n" for job in jobs))
    wer_parity.main(["--report", "--name", "x", "--seeds", "1", "2", "--runs-dir", str(runs), "--at-epoch", "2",
                     "--json", str(tmp_path / "wer.json")])
    result = json.loads((tmp_path / "wer.json").read_text())
    assert [(run["run"], run["returncode"], run["epochs"], run["last_wer"]) for run in result["runs"]] == [
        ("x-cudnn-s1", None, 2, 40.0), ("x-cudnn-s2", None, 2, 45.0), ("x-persistent-s1", None, 2, 35.0),
        ("x-persistent-s2", None, 1, None)]
    assert [run["devices"] for run in result["runs"]] == [["GPU A", "GPU B"], [], [], []]
    cudnn, persistent = result["summary"]
    assert cudnn["mean_wer"] == 42.5 and (persistent["runs"], persistent["paired_seeds"]) == (1, 1)
    assert persistent["difference"] == -5.0 and persistent["difference_stderr"] is None
    # Nothing trained here, so this machine's GPU and versions are not the runs'.
    assert result["config"]["report"] and result["config"]["at_epoch"] == 2 and "device" not in result["config"]
    assert "after epoch 2" in capsys.readouterr().out

    # A misspelt --name finds none: a usage error's exit code 2, where it was 1, which says that a run failed.
    with pytest.raises(SystemExit) as exited:
        wer_parity.main(["--report", "--name", "y", "--runs-dir", str(runs)])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"--report: none of the runs y-BACKEND-sSEED is in {runs}\n"


def test_a_report_summarises_the_runs_it_finds_where_others_are_missing(tmp_path):
    """A backend's runs not copied over yet, or not started: the others are reported, and the missing one has no WER.
    A report that needed every run (all for any) exited 2 here, and passed every test."""
    write_metrics(tmp_path / "runs" / "x-cudnn-s1", [50.0, 40.0])
    wer_parity.main(["--report", "--name", "x", "--seeds", "1", "--runs-dir", str(tmp_path / "runs"), "--json",
                     str(tmp_path / "wer.json")])
    result = json.loads((tmp_path / "wer.json").read_text())
    assert [(run["run"], run["epochs"], run["last_wer"]) for run in result["runs"]] == [
        ("x-cudnn-s1", 2, 40.0), ("x-persistent-s1", 0, None)]
    assert [entry["runs"] for entry in result["summary"]] == [1, 0]


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, GPU-8f1c,")
    assert visible_gpus() == ["2", "GPU-8f1c"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []


def runs_end_at_once(monkeypatch, started: list | None = None) -> None:
    """Each run wer_parity starts (the trainer, or the launch script of a run of several ranks) ends at once, exit 0,
    added to `started`."""
    def run_to_end(runs, command, env, log):
        if started is not None:
            started.append(command)
        return 0

    monkeypatch.setattr(wer_parity.Runs, "run_to_end", run_to_end)


def test_backend_overrides_reach_that_backends_runs_alone(tmp_path, monkeypatch, capsys):
    started = []
    runs_end_at_once(monkeypatch, started)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    wer_parity.main(["--backends", "cudnn", "persistent", "--seeds", "1", "--runs-dir", str(tmp_path),
                     "--backend-overrides", "persistent", "model.batch_slice=4", "--", "train.epochs=3"])
    commands = {next(part for part in command if part.startswith("seed="))
                + next(part for part in command if part.startswith("model.backend=")): command for command in started}
    cudnn, persistent = commands["seed=1model.backend=cudnn"], commands["seed=1model.backend=persistent"]
    assert "train.epochs=3" in cudnn and "train.epochs=3" in persistent
    assert "model.batch_slice=4" in persistent and not any("batch_slice" in part for part in cudnn)
    capsys.readouterr()
    for arguments, refusal in [
        (["--backends", "cudnn", "persistent", "--backend-overrides", "reference", "model.batch_slice=4", "--"],
         "--backend-overrides reference model.batch_slice=4: give one of --backends"),
        # Without --, the common overrides would be the last backend's alone: each backend would train another recipe.
        (["--backends", "cudnn", "persistent", "--backend-overrides", "persistent", "model.batch_slice=4",
          "experiment=an4_gpu"], "--backend-overrides takes every word after it up to --"),
        (["--backend-overrides", "persistent", "train.resume=null", "--", "+seed=3"],
         "seed, train.resume: set for each run by this script"),
        (["--seeds", "1", "1"], "argument --seeds: 1 is given more than once"),
        # Each of these was accepted by a refusal one step off, and passed every test.
        (["--", "train.progress_bar=true", "hydra.run.dir=elsewhere"],
         "hydra.run.dir, train.progress_bar: set for each run by this script"),
        (["--backend-overrides", "persistent", "--"], "--backend-overrides persistent : give one of --backends"),
        (["--backend-overrides", "persistent", "model.batch_slice", "--"],
         "--backend-overrides persistent model.batch_slice: give one of --backends"),
        (["--graphs", "--ranks", "2"], "--graphs needs one GPU per rank (NCCL)"),
        # The last one's overrides alone reached the runs: model.batch_slice=4 was dropped without a word.
        (["--backend-overrides", "persistent", "model.batch_slice=4", "--backend-overrides", "persistent",
          "train.epochs=3", "--"], "--backend-overrides persistent is given more than once: give all its overrides "
                                   "after one"),
    ]:
        with pytest.raises(SystemExit) as exited:
            wer_parity.main(arguments)
        # A usage error, exit 2 as argparse's own: these exited 1, as a comparison whose runs failed does.
        assert exited.value.code == 2 and f"error: {refusal}" in capsys.readouterr().err, arguments


def test_graphs_reach_every_backend_but_cudnn_and_the_json_records_the_overrides(tmp_path, monkeypatch):
    """--graphs given to cuDNN's runs too failed each of them (its packed sequences cannot be captured); the JSON
    without its graphs, overrides or backend overrides passed every test, and named no recipe the runs trained."""
    commands = {}

    def run_to_end(runs, command, env, log):
        commands[next(part for part in command if part.startswith("model.backend="))] = command
        return 0

    monkeypatch.setattr(wer_parity.Runs, "run_to_end", run_to_end)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    wer_parity.main(["--backends", "cudnn", "persistent", "--seeds", "1", "--graphs", "--runs-dir", str(tmp_path),
                     "--json", str(tmp_path / "wer.json"), "--backend-overrides", "persistent", "model.batch_slice=4",
                     "--", "train.epochs=3"])
    assert "train.cuda_graphs=true" in commands["model.backend=persistent"]
    assert not any("cuda_graphs" in part for part in commands["model.backend=cudnn"])
    config = json.loads((tmp_path / "wer.json").read_text())["config"]
    assert (config["graphs"], config["overrides"], config["backend_overrides"]) == (
        True, ["train.epochs=3"], {"persistent": ["model.batch_slice=4"]})


def test_the_plan_words_one_run_rank_and_gpu_in_the_singular(tmp_path, monkeypatch, capsys):
    # It read "1 runs of 1 rank(s), 1 at once on 1 GPU(s)".
    runs_end_at_once(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    wer_parity.main(["--backends", "cudnn", "--seeds", "1", "--runs-dir", str(tmp_path)])
    assert capsys.readouterr().out.startswith(f"1 run of 1 rank, 1 at once on 1 GPU; output in {tmp_path}/wer-*.out\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    wer_parity.main(["--backends", "cudnn", "reference", "--seeds", "1", "--ranks", "2", "--runs-dir", str(tmp_path)])
    assert capsys.readouterr().out.startswith("2 runs of 2 ranks, 2 at once on 2 GPUs;")


def test_on_a_machine_without_a_gpu_the_plan_and_each_run_say_so(tmp_path, monkeypatch, capsys):
    # They read "1 at once on 0 GPUs" and "wer-reference-s1 (GPU None): exit 0, ...".
    runs_end_at_once(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    wer_parity.main(["--backends", "reference", "--seeds", "1", "--runs-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.startswith("1 run of 1 rank, 1 at once on no GPU;") and "wer-reference-s1 (no GPU): exit 0" in out
    assert "None" not in out


@pytest.mark.parametrize("arguments, refusal", [
    (["--backends", "cudnn", "persistent"], "--backends persistent needs a CUDA GPU, and none is visible"),
    (["--backends", "reference", "--graphs"], "--graphs needs a CUDA GPU, and none is visible"),
])
def test_runs_that_need_a_gpu_are_refused_before_any_starts_where_none_is_visible(tmp_path, monkeypatch, capsys,
                                                                                arguments, refusal):
    """Under device=auto each such run started, then refused itself: one line a run in its .out file, exit 1."""
    started = []
    runs_end_at_once(monkeypatch, started)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(SystemExit) as exited:
        wer_parity.main([*arguments, "--seeds", "1", "--runs-dir", str(tmp_path)])
    assert exited.value.code == 2 and f"error: {refusal}\n" in capsys.readouterr().err and not started


def test_a_failed_run_fails_the_comparison_naming_its_last_line(tmp_path, monkeypatch, capsys):
    """The runs' output goes to files: the one line that says why a run failed reaches the terminal, and the exit
    status says a run failed. --json into a folder not made yet is made first, not after the training."""
    def run_to_end(runs, command, env, log):
        failing = "model.backend=persistent" in command
        log.write("error on rank 0: backend='persistent' cannot run: needs a CUDA GPU\n\n" if failing else "ok\n")
        return 2 if failing else 0

    monkeypatch.setattr(wer_parity.Runs, "run_to_end", run_to_end)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    json_path = tmp_path / "not" / "made" / "wer.json"
    with pytest.raises(SystemExit) as stopped:
        wer_parity.main(["--backends", "cudnn", "persistent", "--seeds", "1", "--runs-dir", str(tmp_path / "runs"),
                         "--json", str(json_path), "--", "hydra.job.name=a b"])
    assert stopped.value.code == 1
    assert json.loads(json_path.read_text())["config"]["command"].endswith("-- 'hydra.job.name=a b'")
    assert ("wer-persistent-s1 failed (exit 2): error on rank 0: backend='persistent' cannot run: needs a CUDA GPU"
            in capsys.readouterr().err)


def test_the_json_names_the_commit_the_runs_started_on(tmp_path, monkeypatch):
    """wer_parity asked git for the commit as it wrote its JSON, after the runs: a checkout edited, or switched to
    another branch, during their hours of training was named as the code that had trained."""
    checkout = {"commit": "started"}

    def run_to_end(runs, command, env, log):
        checkout["commit"] = "edited"
        return 0

    monkeypatch.setattr(wer_parity.Runs, "run_to_end", run_to_end)
    monkeypatch.setattr("trainer.environment.versions", lambda device: dict(checkout))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    wer_parity.main(["--backends", "cudnn", "--seeds", "1", "--runs-dir", str(tmp_path / "runs"),
                     "--json", str(tmp_path / "wer.json")])
    assert checkout["commit"] == "edited"
    assert json.loads((tmp_path / "wer.json").read_text())["config"]["commit"] == "started"


@pytest.mark.parametrize("number, to_the_group", [(signal.SIGINT, True), (signal.SIGTERM, False)])
def test_a_stop_signal_stops_the_runs_in_progress_and_starts_no_more(tmp_path, number, to_the_group):
    """A Ctrl-C stopped the run in progress, which gets it too, and then the thread pool's shutdown started each
    queued run, to train for hours: one Ctrl-C per queued run. A SIGTERM to the script alone (`kill PID`) reached no
    run: the one in progress and then every queued one trained to its end. Here each run's MPI job is a stand-in that
    runs until a stop signal, which it answers as the trainer does."""
    started = tmp_path / "started"
    mpirun = tmp_path / "mpirun"
    # Python, as the launcher is a background job of the launch script, which starts it with Ctrl-C ignored: a bash
    # trap could not take it back. The script first asks `$MPIRUN --version` (Open MPI or not).
    mpirun.write_text(f"#!{sys.executable}\nimport signal, sys, time\nif sys.argv[1:] != ['--version']:\n"
                      "    for number in (signal.SIGINT, signal.SIGTERM):\n"
                      "        signal.signal(number, lambda number, _: sys.exit(128 + number))\n"
                      f"    with open({str(started)!r}, 'a') as started:\n        started.write('run\\n')\n"
                      "    time.sleep(300)\n")
    mpirun.chmod(0o755)
    command = [sys.executable, "-m", "benchmarks.wer_parity", "--backends", "cudnn", "--seeds", "1", "2", "3",
               "--ranks", "2", "--parallel", "1", "--runs-dir", str(tmp_path / "runs")]
    comparison = subprocess.Popen(command, cwd=REPO_ROOT, env={**os.environ, "MPIRUN": str(mpirun)},
                                  start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1)  # the first run under way
        if to_the_group:  # as a terminal's Ctrl-C: the script and its runs
            os.killpg(comparison.pid, number)
        else:
            comparison.send_signal(number)
        _, stderr = comparison.communicate(timeout=60)
    finally:
        if comparison.poll() is None:
            os.killpg(comparison.pid, signal.SIGKILL)
            comparison.communicate()
    assert comparison.returncode == 128 + number, stderr[-3000:]
    assert started.read_text() == "run\n"
    assert stderr.endswith("the runs in progress stopped at their checkpoints and 2 runs did not start; the same "
                           "command continues them all\n"), stderr[-3000:]


def test_a_runs_dir_that_cannot_be_made_is_a_usage_error(tmp_path, capsys):
    # It ended in mkdir's FileExistsError traceback.
    taken = tmp_path / "runs"
    taken.write_text("")
    with pytest.raises(SystemExit) as exited:
        wer_parity.main(["--runs-dir", str(taken)])
    assert exited.value.code == 2 and f"error: --runs-dir {taken}: File exists" in capsys.readouterr().err


def test_a_runs_output_file_that_cannot_be_opened_is_refused_in_one_line_before_any_run(tmp_path, monkeypatch, capsys):
    # A folder in its place ended the command in IsADirectoryError's traceback from the run's thread.
    started = []
    runs_end_at_once(monkeypatch, started)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    (tmp_path / "wer-reference-s2.out").mkdir()
    arguments = ["--backends", "cudnn", "reference", "--seeds", "1", "2", "--runs-dir", str(tmp_path)]
    assert run_tool(lambda: wer_parity.main(arguments)) == 2 and not started
    assert capsys.readouterr().err == f"error: cannot write {tmp_path}/wer-reference-s2.out: Is a directory\n"


@pytest.mark.parametrize("name", ["ab/c", "a,b", ""])
def test_a_name_no_run_could_take_is_refused_before_any_run(name, tmp_path, capsys):
    # A / ended the script in a traceback (no folder for the run's .out), a comma every run in Hydra's refusal.
    with pytest.raises(SystemExit) as exited:
        wer_parity.main(["--name", name, "--runs-dir", str(tmp_path)])
    assert exited.value.code == 2 and "argument --name" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("overrides, refusal", [
    (["--", "model.cell=gru,lstm"], "error: Ambiguous value for argument 'model.cell=gru,lstm'"),
    (["--backend-overrides", "persistent", "model.batch_slize=4", "--"],
     "error: unknown config key model.batch_slize (did you mean model.batch_slice?)\n"),
    (["--", "model.depth=0"], "error: model.depth must be a positive integer, not 0\n"),
])
def test_overrides_the_trainer_refuses_are_refused_before_any_run_starts(overrides, refusal, tmp_path, capsys):
    # Every run started, each failed on its overrides in its own .out, and the script ended as if runs had failed.
    with pytest.raises(SystemExit) as exited:
        wer_parity.main(["--backends", "cudnn", "persistent", "--seeds", "1", "2", "--runs-dir", str(tmp_path),
                         *overrides])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith(refusal), err
    assert not any(tmp_path.iterdir())



@pytest.mark.parametrize("seed", ["-5", "4294967296"])
def test_a_seed_the_trainer_refuses_is_refused_before_any_run_starts(seed, tmp_path, monkeypatch, capsys):
    # The overrides are checked with each backend's first seed alone: a later one out of range failed its runs, each
    # in its own .out after the others had trained.
    started = []
    runs_end_at_once(monkeypatch, started)
    with pytest.raises(SystemExit) as exited:
        wer_parity.main(["--backends", "reference", "--seeds", "1", seed, "--runs-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "argument --seeds: must be at " in err and f", not {seed}\n" in err, err
    assert not started and not any(tmp_path.iterdir())


@pytest.mark.parametrize("folder", ["a,b [it's]", "it\\'s"])
def test_a_runs_dir_with_a_comma_quote_or_backslash_reaches_hydra_as_that_path(tmp_path, monkeypatch, folder):
    # Unquoted, Hydra refused hydra.run.dir=.../a,b/wer-cudnn-s1 as an ambiguous list, and every run failed; the quote
    # after a backslash was escaped as \\', which Hydra reads as a backslash, then the string's end: every run refused.
    from hydra.core.override_parser.overrides_parser import OverridesParser

    commands = []
    runs_end_at_once(monkeypatch, commands)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    runs_dir = tmp_path / folder
    wer_parity.main(["--backends", "cudnn", "--seeds", "1", "--runs-dir", str(runs_dir)])
    override = next(part for part in commands[0] if part.startswith("hydra.run.dir="))
    assert OverridesParser.create().parse_overrides([override])[0].value() == str(runs_dir / "wer-cudnn-s1")


def test_a_runs_dir_with_an_interpolation_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    # Its runs trained in .../home /root/wer-cudnn-s1, where this script, reading .../home ${oc.env:HOME}, found none.
    runs_end_at_once(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(SystemExit) as exited:
        wer_parity.main(["--backends", "cudnn", "--seeds", "1", "--runs-dir", str(tmp_path / "home ${oc.env:HOME}")])
    assert exited.value.code == 2 and "--runs-dir" in capsys.readouterr().err.splitlines()[-1]
    assert not any(tmp_path.iterdir())


def test_a_run_file_that_is_a_pipe_or_a_device_is_left_out_in_one_line_unread(tmp_path, capsys):
    """A runs folder copied from elsewhere (tar keeps pipes and links) may hold a pipe, or a link to a device or a
    pipe, where the trainer writes a file: read whole, a link to /dev/zero took all the memory and a pipe waited for a
    writer for ever."""
    runs = tmp_path / "runs"
    write_metrics(runs / "x-cudnn-s1", [50.0, 40.0])
    write_metrics(runs / "x-persistent-s1", [50.0, 30.0])
    os.mkfifo(tmp_path / "pipe")
    (runs / "x-cudnn-s1" / "metrics.jsonl").unlink()
    os.mkfifo(runs / "x-cudnn-s1" / "metrics.jsonl")
    (runs / "x-persistent-s1" / "config.yaml").symlink_to(tmp_path / "pipe")
    (runs / "x-persistent-s1.out").symlink_to(tmp_path / "pipe")
    with within_seconds(10):
        with pytest.raises(SystemExit) as exited:
            wer_parity.main(["--report", "--name", "x", "--seeds", "1", "--runs-dir", str(runs)])
        assert wer_parity.last_line(runs / "x-persistent-s1.out") == (f"{runs}/x-persistent-s1.out is not a file (a "
                                                                       "pipe, a device)")
    errors = capsys.readouterr().err.splitlines()
    assert exited.value.code == 2 and errors[-1].startswith("--report: nothing to report"), errors
    assert errors[:2] == [f"{name}: {runs}/{name}/{file}: not a file (a pipe, a device), which the trainer never "
                          "writes there" for name, file in (("x-cudnn-s1", "metrics.jsonl"),
                                                            ("x-persistent-s1", "config.yaml"))], errors


def test_a_config_yaml_whose_aliases_nest_lists_many_times_over_is_quoted_in_a_few_entries(tmp_path):
    """YAML's aliases put one list in the next many times over: the refusal quoted the whole value, which for the 561
    bytes of nine levels of ten was 10^8 strings, and the report ran out of memory. Five levels here, 10^5 strings."""
    run_dir = tmp_path / "runs" / "x-cudnn-s1"
    write_metrics(run_dir, [50.0, 40.0])
    levels = ['a0: &a0 ["xxxxxxxxxx", "xxxxxxxxxx", "xxxxxxxxxx", "xxxxxxxxxx", "xxxxxxxxxx", "xxxxxxxxxx", '
              '"xxxxxxxxxx", "xxxxxxxxxx", "xxxxxxxxxx", "xxxxxxxxxx"]']
    levels += [f"a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * 10)}]" for level in range(1, 5)]
    (run_dir / "config.yaml").write_text("\n".join(levels) + "\ntrain: {epochs: *a4}\n")
    row = wer_parity.report(tmp_path / "runs", "x-cudnn-s1", "cudnn", 1, 1, None)
    assert row["damaged"].startswith(f"{run_dir}/config.yaml: train.epochs must be a count or null, got [[[...], "
                                     "[...], "), row["damaged"][:200]
    assert len(row["damaged"]) < 500, len(row["damaged"])


@pytest.mark.parametrize("file, text, message", [
    ("metrics.jsonl", '{"eval_wer": 30.0, "eval_cer": 10.0, "elapsed_s": 15.0}\n',
     "metrics.jsonl lacks an evaluation's epoch, which must be a count"),
    ("metrics.jsonl", '{"epoch": "3", "eval_wer": 30.0, "eval_cer": 10.0, "elapsed_s": 15.0}\n',
     "metrics.jsonl: an evaluation's epoch must be a count, got '3'"),
    ("metrics.jsonl", '{"epoch": 3, "eval_wer": 30.0, "eval_cer": true, "elapsed_s": 15.0}\n',
     "metrics.jsonl: an evaluation's eval_cer must be a number or null, got True"),
    ("metrics.jsonl", b"\xff\xfe\n", "metrics.jsonl: cannot read it ('utf-8' codec can't decode byte 0xff"),
    # true is a number to Python (1): the report read it as epoch 1.
    ("metrics.jsonl", '{"epoch": true, "eval_wer": 30.0, "eval_cer": 10.0, "elapsed_s": 15.0}\n',
     "metrics.jsonl: an evaluation's epoch must be a count, got True"),
    ("jobs.jsonl", '{"from_step": 0}\n', "jobs.jsonl lacks a job's device, which must be a string"),
    ("jobs.jsonl", None, "jobs.jsonl: cannot read it (Is a directory)"),
    ("config.yaml", "train: [epochs: 2\n",
     "config.yaml: not YAML (expected ',' or ']', but got '<stream end>' at line 2)"),
    ("config.yaml", "- train\n", "config.yaml: not the mapping of settings, train among them, that the trainer writes"),
    # YAML's reader nests as deep as the file: a traceback of RecursionError.
    ("config.yaml", "train: " + "[" * 100_000 + "\n", "config.yaml: YAML nested too deeply to read"),
    ("config.yaml", "train:\n  epochs: ${oc.env:HOME}\n",
     "config.yaml: train.epochs must be a count or null, got '${oc.env:HOME}'"),
    # A YAML date is no JSON value: the refusal ended in json.dumps's TypeError traceback.
    ("config.yaml", "train:\n  epochs: 2020-01-01\n",
     "config.yaml: train.epochs must be a count or null, got datetime.date(2020, 1, 1)"),
])
def test_a_run_with_a_damaged_file_is_left_out_in_one_line_naming_it(tmp_path, capsys, file, text, message):
    """A run's file edited by hand or cut short by a copy ended the report in a traceback (KeyError, TypeError, YAML's
    error over several lines): that run is left out, in one line naming the file and what is wrong; the others count."""
    runs = tmp_path / "runs"
    write_metrics(runs / "x-cudnn-s1", [50.0, 40.0])
    write_metrics(runs / "x-persistent-s1", [50.0, 30.0])
    path = runs / "x-persistent-s1" / file
    if text is None:
        path.mkdir()
    elif isinstance(text, bytes):
        path.write_bytes(text)
    else:
        with open(path, "a") as damaged:
            damaged.write(text)
    wer_parity.main(["--report", "--name", "x", "--seeds", "1", "--runs-dir", str(runs),
                     "--json", str(tmp_path / "wer.json")])
    result = json.loads((tmp_path / "wer.json").read_text())
    cudnn, persistent = result["runs"]
    assert "damaged" not in cudnn and persistent["damaged"].startswith(f"{path.parent}/{message}"), persistent
    assert persistent["last_wer"] is None and [entry["runs"] for entry in result["summary"]] == [1, 0]
    assert f"x-persistent-s1: left out of the report: {persistent['damaged']}\n" in capsys.readouterr().out

    # With the other run damaged too, there is nothing to report.
    (runs / "x-cudnn-s1" / "config.yaml").write_text("train:\n  epochs: two\n")
    with pytest.raises(SystemExit) as exited:
        wer_parity.main(["--report", "--name", "x", "--seeds", "1", "--runs-dir", str(runs)])
    errors = capsys.readouterr().err.splitlines()
    assert exited.value.code == 2 and errors[-1].startswith("--report: nothing to report"), errors
    assert errors[0] == f"x-cudnn-s1: {runs}/x-cudnn-s1/config.yaml: train.epochs must be a count or null, got 'two'"
