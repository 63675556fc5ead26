"""The real entry points end to end on CPU: `python -m trainer` on real AN4 speech, resume, bad input, user errors,
sweeps (`-m`), then `python -m trainer.evaluate` and `python -m trainer.transcribe` on what it wrote."""
import contextlib
import fcntl
import json
import math
import os
import pickle
import re
import resource
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from conftest import REPO_ROOT, TINY, compose_config, data_loading_workers, wait_for_file, wait_for_text, write_slice
from data.manifest import read_manifest
from trainer import build
from trainer.train import LARGE_FOR_A_CPU, cpu_size_warning, left_out_of_each_epoch

def run(module: str, args: list[str], timeout: float = 900, cwd=REPO_ROOT, env=None) -> subprocess.CompletedProcess:
    """`python -m module args` on this checkout's code, in `cwd` (relative outputs such as runs/ land there), with
    `env` over the environment."""
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "HYDRA_FULL_ERROR": "0", "PYTHONPATH": python_path, **(env or {})},
    )
    result.output = result.stdout + result.stderr
    return result


def train_arguments(run_dir, manifest, *overrides) -> list[str]:
    return ["data=manifest", f"data.train_manifests=[{manifest}]", f"data.eval_manifest={manifest}",
            f"hydra.run.dir={run_dir}", *TINY, *overrides]


def train(run_dir, manifest, *overrides, check=True, timeout=900):
    result = run("trainer", train_arguments(run_dir, manifest, *overrides), timeout)
    if check:
        assert result.returncode == 0, result.output[-4000:]
    return result


def trainer_with(patch: str) -> str:
    """Code for `python -c` that runs `python -m trainer` (given the arguments after the code) with `patch` run first:
    Python that replaces something the trainer calls, to record its calls or act on one."""
    return (f"import runpy, sys\n{patch}"
            "sys.argv = ['trainer', *sys.argv[1:]]\n"
            "runpy.run_module('trainer', run_name='__main__', alter_sys=True)\n")


def recording_saves(saves: Path) -> str:
    """A trainer_with patch that records each torch.save the trainer makes in `saves`, a line each: the file and the
    step saved, tab-separated."""
    return ("import torch\n"
            "real_save = torch.save\n"
            "def recorded_save(state, file, *args, **kwargs):\n"
            f"    with open({str(saves)!r}, 'a') as out:\n"
            "        out.write(f\"{getattr(file, 'name', file)}\\t{state['train_state']['step']}\\n\")\n"
            "    real_save(state, file, *args, **kwargs)\n"
            "torch.save = recorded_save\n")


def strict_json(text: str):
    """JSON as the standard has it: Python's reader takes NaN and Infinity, which others (JSON.parse) refuse."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def read_metrics(run_dir):
    lines = [strict_json(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {line["step"]: line["loss"] for line in lines if "step" in line}
    epochs = [line for line in lines if "eval_wer" in line]
    assert len(steps) == sum("step" in line for line in lines), "a step is listed twice"
    assert len({line["epoch"] for line in epochs}) == len(epochs), "an epoch is evaluated twice"
    return steps, epochs


@pytest.mark.slow
def test_training_on_an4_words_learns_then_evaluate_and_transcribe(an4_train, tmp_path):
    # AN4's one-word commands (YES, NO, GO, STOP, START, HELP, REPEAT): 64 to train on, the rest, spoken by
    # other speakers, to test on.
    words = [u for u in an4_train if len(u.text.split()) == 1 and u.text != "THIRTY"]
    train_manifest = write_slice(tmp_path / "train.jsonl", words[:64])
    test_manifest = write_slice(tmp_path / "test.jsonl", words[64:])
    run_dir = tmp_path / "run"
    args = ["data=manifest", f"data.train_manifests=[{train_manifest}]", f"data.eval_manifest={test_manifest}",
            f"hydra.run.dir={run_dir}", *TINY, "train.epochs=20", "optim.lr=3e-3", "optim.anneal=1.0"]
    result = run("trainer", args)
    assert result.returncode == 0, result.output[-4000:]
    assert "final test WER" in result.stdout
    assert "recurrent layers on the reference recurrence (plain PyTorch): 8 utterances a rank, fp32" in result.output

    steps, epochs = read_metrics(run_dir)
    first, last = np.mean(list(steps.values())[:8]), np.mean(list(steps.values())[-8:])
    assert last < 0.2 * first, f"loss fell only from {first:.1f} to {last:.1f}"
    best_wer = min(epoch["eval_wer"] for epoch in epochs)
    assert epochs[0]["eval_wer"] > 90 and best_wer < 70, [epoch["eval_wer"] for epoch in epochs]
    # The last line quotes the last epoch's figures, not the best one's, and counts epochs from 1.
    assert result.stdout.splitlines()[-1] == (f"final test WER {epochs[-1]['eval_wer']:.2f}%  "
                                              f"CER {epochs[-1]['eval_cer']:.2f}%  (epoch 20)"), result.stdout[-2000:]
    assert not any("peak_gpu_allocated_gib" in epoch for epoch in epochs) and "peak GPU memory" not in result.output
    assert (run_dir / "config.yaml").exists() and (run_dir / "checkpoints" / "last.pt").exists()

    # The evaluation tool reproduces the best epoch's WER from best.pt and writes one line per utterance.
    errors = tmp_path / "errors.tsv"
    result = run("trainer.evaluate", ["--checkpoint", str(run_dir / "checkpoints" / "best.pt"),
                                      "--manifest", str(test_manifest), "--out", str(errors)])
    assert result.returncode == 0, result.output
    assert f"WER {best_wer:.2f}%" in result.stdout
    rows = errors.read_text().splitlines()
    assert len(rows) == 1 + len(words[64:]) and rows[0].startswith("audio_filepath\tword_errors")

    # A word model of the training transcripts, and the beam search with it.
    lm_path = tmp_path / "words.arpa"
    result = run("trainer.lm", ["--manifest", str(train_manifest), "--order", "2", "--out", str(lm_path)])
    assert result.returncode == 0, result.output
    result = run("trainer.evaluate", ["--checkpoint", str(run_dir / "checkpoints" / "best.pt"),
                                      "--manifest", str(test_manifest), "--beam", "8", "--lm", str(lm_path)])
    assert result.returncode == 0, result.output
    assert result.stdout.startswith("WER "), result.output
    result = run("trainer.evaluate", ["--checkpoint", str(run_dir / "checkpoints" / "best.pt"),
                                      "--lm", str(tmp_path / "absent.arpa")])
    assert result.returncode == 2 and "absent.arpa" in result.output, result.output

    audio = [read_manifest(test_manifest)[index].audio_filepath for index in (0, 1)]
    best = str(run_dir / "checkpoints" / "best.pt")
    result = run("trainer.transcribe", ["--checkpoint", best, "--beam", "4", *audio])
    assert result.returncode == 0, result.output
    transcripts = dict(line.split("\t") for line in result.stdout.splitlines())
    assert set(transcripts) == set(audio)
    assert all(set(text) <= set("'ABCDEFGHIJKLMNOPQRSTUVWXYZ ") for text in transcripts.values())

    # A reader that stops early ends the tool quietly; an output that is one of its inputs, a folder given as the
    # checkpoint, and a relative manifest of the run's read from another folder are one line each.
    many = [read_manifest(test_manifest)[index].audio_filepath for index in range(6)]
    transcribe = shlex.join([sys.executable, "-m", "trainer.transcribe", "--checkpoint", best, *many])
    piped = subprocess.run(["bash", "-c", f"{transcribe} | head -1; exit ${{PIPESTATUS[0]}}"], cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert piped.returncode == 1 and piped.stdout.count("\n") == 1 and "Traceback" not in piped.stderr, piped.stderr
    manifest_text = test_manifest.read_text()
    for tool, arguments in (("trainer.evaluate", ["--checkpoint", best, "--manifest", str(test_manifest)]),
                            ("trainer.lm", ["--manifest", str(test_manifest)])):
        result = run(tool, [*arguments, "--out", str(test_manifest)])
        assert result.returncode == 2 and result.stderr == (f"error: {test_manifest} is also an input of this "
                                                            "command: writing it would destroy it\n"), result.output
    assert test_manifest.read_text() == manifest_text
    result = run("trainer.evaluate", ["--checkpoint", str(run_dir / "checkpoints")])
    assert result.returncode == 2 and "is a folder; name a .pt file in it" in result.stderr, result.output
    saved = torch.load(best, weights_only=True)
    saved["config"]["data"]["eval_manifest"] = "manifests/test.jsonl"
    torch.save(saved, tmp_path / "relative.pt")
    result = run("trainer.evaluate", ["--checkpoint", str(tmp_path / "relative.pt")], cwd=tmp_path)
    assert result.returncode == 2 and ("the run's data.eval_manifest manifests/test.jsonl is relative to the folder "
                                       "its training ran in") in result.stderr, result.output


@pytest.mark.slow
def test_resume_continues_exactly_where_it_stopped(an4_train, tmp_path):
    utterances = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:16])
    common = ["model.hidden=32", "train.global_batch_size=4", "train.num_workers=1", "data.augment.enabled=true"]
    # 16 utterances in global batches of 4: 4 steps an epoch, so step 6 is in the second epoch.
    whole_run = train(tmp_path / "whole", utterances, *common, "train.max_steps=6", "train.progress_line_s=0")
    assert "epoch 1: step 1 of 4, loss " in whole_run.output and "epoch 2: step 2 of 4, loss " in whole_run.output
    # Its last line names the stop, and the evaluation it quotes is epoch 1's, not the stopped model's.
    assert re.search(r"^stopped at step 6 \(train\.max_steps\); the last evaluation, after epoch 1 \(step 4\): "
                     r"test WER [\d.]+%  CER [\d.]+%$", whole_run.stdout, re.MULTILINE), whole_run.stdout
    assert "final test WER" not in whole_run.stdout
    first = train(tmp_path / "split", utterances, *common, "train.max_steps=3")
    assert "stopped at step 3 (train.max_steps), before this job's first evaluation" in first.stdout, first.stdout
    # The same limit again trains nothing.
    assert ("stopped at step 3 (train.max_steps); train.resume=auto under the same run_name (RUN_NAME in the launch "
            "scripts) and overrides but a higher train.max_steps (or null) continues it from") in first.output
    checkpoint_path = tmp_path / "split" / "checkpoints" / "last.pt"
    shutil.copy(checkpoint_path, tmp_path / "step3.pt")
    resumed = train(tmp_path / "split", utterances, *common, "train.max_steps=6", f"train.resume={checkpoint_path}")
    assert "epoch 1 (step 4, from the resume): loss" in resumed.output  # not a whole epoch's loss and count
    assert "another run directory's checkpoint" not in resumed.output

    whole, _ = read_metrics(tmp_path / "whole")
    split, _ = read_metrics(tmp_path / "split")
    assert sorted(split) == [1, 2, 3, 4, 5, 6]
    lines = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["epoch"]) for line in lines if "step" in line] == [
        (1, 1), (2, 1), (3, 1), (4, 1), (5, 2), (6, 2)]  # counted as the evaluation after step 4 counts epoch 1
    assert [line["epoch"] for line in lines if "eval_wer" in line] == [1]
    jobs = [json.loads(line) for line in (tmp_path / "split" / "jobs.jsonl").read_text().splitlines()]
    assert [job["from_step"] for job in jobs] == [0, 3] and jobs[1]["device"].startswith("CPU"), jobs
    for step in (4, 5, 6):
        assert split[step] == pytest.approx(whole[step], rel=1e-6, abs=0), f"step {step}"
    whole_model = torch.load(tmp_path / "whole" / "checkpoints" / "last.pt", weights_only=True)["model"]
    split_model = torch.load(checkpoint_path, weights_only=True)["model"]
    for name, tensor in whole_model.items():
        torch.testing.assert_close(split_model[name], tensor, rtol=1e-6, atol=1e-7, msg=name)

    # Started again with the limit it already reached (a requeued job), the run trains nothing more; started with
    # another model, it stops before loading anything.
    again = train(tmp_path / "split", utterances, *common, "train.max_steps=6", f"train.resume={checkpoint_path}")
    # Its position as the log counts epochs, from 1: step 6 is the second epoch's (it said "reached epoch 1, step 6").
    assert f"nothing to train: {checkpoint_path} reached step 6 (step 2 of epoch 2; train.epochs=" in again.output
    assert sorted(read_metrics(tmp_path / "split")[0]) == [1, 2, 3, 4, 5, 6]
    saved = torch.load(checkpoint_path, weights_only=True)
    assert saved["train_state"]["step"] == 6 and saved["train_set"].startswith("16 utterances, sha256 ")
    other = train(tmp_path / "split", utterances, *common, "model.hidden=48", f"train.resume={checkpoint_path}",
                  check=False)
    assert other.returncode == 2 and "Traceback" not in other.output
    assert "it was written by a run with other settings (model.hidden=32 there, 48 here)" in other.output
    assert "hidden: 32" in (tmp_path / "split" / "config.yaml").read_text()  # the refused run changed nothing
    # Started afresh (no train.resume) over the run, it stops before replacing anything.
    fresh = train(tmp_path / "split", utterances, *common, "train.max_steps=6", check=False)
    assert fresh.returncode == 2 and "which starting afresh would overwrite" in fresh.output, fresh.output
    assert torch.load(checkpoint_path, weights_only=True)["train_state"]["step"] == 6
    # Resumed from another run's checkpoint, it stops before replacing this one's.
    foreign = train(tmp_path / "split", utterances, *common, "train.max_steps=6",
                    f"train.resume={tmp_path / 'whole' / 'checkpoints' / 'last.pt'}", check=False)
    assert foreign.returncode == 2 and "is not one of its checkpoints" in foreign.output, foreign.output[-4000:]
    assert torch.load(checkpoint_path, weights_only=True)["train_state"]["step"] == 6

    # Resumed from an earlier checkpoint (a job that died after its last checkpoint), the run logs steps 4-6 again:
    # TensorBoard, like metrics.jsonl, holds each step once.
    again = train(tmp_path / "split", utterances, *common, "train.max_steps=6", f"train.resume={tmp_path / 'step3.pt'}")
    # A copy of its own checkpoint: the run goes on in its metrics.jsonl, which the log said it started afresh.
    assert "another run directory's checkpoint" not in again.output
    assert sorted(read_metrics(tmp_path / "split")[0]) == [1, 2, 3, 4, 5, 6]
    events = EventAccumulator(str(tmp_path / "split" / "tensorboard"))
    events.Reload()
    assert [event.step for event in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    assert [event.step for event in events.Scalars("eval/wer")] == [4]  # epoch 1 ended at step 4

    # Resumed from another run's checkpoint where a failed attempt left records but no checkpoint: a run of its own,
    # whose records start at the checkpoint's next step.
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    (attempt / "metrics.jsonl").write_text(json.dumps({"step": 1, "epoch": 1, "loss": 1.0}) + "\n")
    (attempt / "jobs.jsonl").write_text(json.dumps({"run_id": "a failed attempt's", "from_step": 0}) + "\n")
    with SummaryWriter(attempt / "tensorboard") as attempts_events:
        attempts_events.add_scalar("train/loss", 1.0, 1)
    own = train(attempt, utterances, *common, "train.max_steps=4", f"train.resume={tmp_path / 'step3.pt'}")
    assert "another run directory's checkpoint: this run writes to" in own.output
    assert sorted(read_metrics(attempt)[0]) == [4]
    # TensorBoard too: purged from the checkpoint's next step on, as a continued run's events are, the attempt's
    # step 1 was left among this run's.
    events = EventAccumulator(str(attempt / "tensorboard"))
    events.Reload()
    assert [event.step for event in events.Scalars("train/loss")] == [4]
    assert [json.loads(line)["from_step"] for line in (attempt / "jobs.jsonl").read_text().splitlines()] == [3]


def test_a_run_train_resume_auto_started_afresh_says_so_in_its_job_line(an4_train, tmp_path):
    """A run_name mistyped under train.resume=auto starts a new run: the one line that said so came before the
    config's 60 lines and scrolled away. The job's line, after them, says it; a job that continues does not."""
    utterances = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    common = ["model.hidden=16", "train.global_batch_size=4", "train.resume=auto"]  # 2 steps an epoch
    run_dir = tmp_path / "run"
    first = train(run_dir, utterances, *common, "train.max_steps=1")
    assert (f"this job: from step 0 (a new run: train.resume=auto found no checkpoint in {run_dir}), world size 1, "
            "rank 0 on CPU") in first.output, first.output[-4000:]
    again = train(run_dir, utterances, *common, "train.max_steps=2")
    assert "this job: from step 1, world size 1, rank 0 on CPU" in again.output, again.output[-4000:]


@pytest.mark.slow
def test_a_resume_with_nothing_to_train_leaves_the_runs_records_as_they_were(an4_train, tmp_path):
    utterances = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:16])
    common = ["model.hidden=32", "train.global_batch_size=4"]  # 4 steps an epoch
    run_dir = tmp_path / "run"
    train(run_dir, utterances, *common, "train.max_steps=3")
    shutil.copy(run_dir / "checkpoints" / "last.pt", tmp_path / "step3.pt")
    train(run_dir, utterances, *common, "train.max_steps=6", "train.resume=auto")
    records = {name: (run_dir / name).read_text() for name in ("metrics.jsonl", "jobs.jsonl", "config.yaml")}
    # From the copy of its step-3 checkpoint, with the limit that checkpoint reached: last.pt, at step 6, stays, so
    # the records of steps 4-6 and of epoch 1's evaluation must too (they were dropped, and TensorBoard's purged).
    again = train(run_dir, utterances, *common, "train.max_steps=3", f"train.resume={tmp_path / 'step3.pt'}")
    assert {name: (run_dir / name).read_text() for name in records} == records
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [event.step for event in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    assert [event.step for event in events.Scalars("eval/wer")] == [4]
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["train_state"]["step"] == 6
    assert "nothing to train: " in again.output and "the run directory is left as it was" in again.output


def test_a_run_whose_max_steps_ends_its_last_epoch_is_finished_with_nothing_to_resume(an4_train, tmp_path):
    """train.max_steps reached at the last epoch's end leaves a finished run: its last line gives the final WER, not
    "stopped at step" with a higher limit to continue it (a mutant saying so passed every test), and last.pt holds
    that epoch's step, though the epoch improved the WER and wrote best.pt (one writing best.pt alone passed too). Run
    again with train.resume=auto and no step limit (a requeue after its end), its train.epochs all trained, it has
    nothing to train and leaves its records as they were: only a train.max_steps reached was tested, and a resume at
    the last epoch's end passed for one with epochs left, adding a job to jobs.jsonl."""
    utterances = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    common = ["model.hidden=16", "train.global_batch_size=4", "train.epochs=1", "train.resume=auto"]  # 2 steps
    run_dir = tmp_path / "run"
    first = train(run_dir, utterances, *common, "train.max_steps=2")
    assert first.stdout.splitlines()[-1].startswith("final test WER"), first.output[-4000:]
    assert "stopped " not in first.output, first.output[-4000:]
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["train_state"]["step"] == 2
    records = {name: (run_dir / name).read_text() for name in ("metrics.jsonl", "jobs.jsonl", "config.yaml")}
    again = train(run_dir, utterances, *common, "train.max_steps=null")
    assert {name: (run_dir / name).read_text() for name in records} == records
    assert "nothing to train: " in again.output and "train.epochs=1" in again.output, again.output[-4000:]


@pytest.mark.slow
def test_the_command_that_started_a_run_from_another_runs_checkpoint_run_again_continues_that_run(an4_train, tmp_path):
    """A requeued fine-tuning job (launch/slurm.sbatch: train.resume=auto, then the user's train.resume=PATH) was
    refused once its run directory held its own checkpoints, exit code 2, where it continues from them."""
    utterances = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:16])
    common = ["model.hidden=32", "train.global_batch_size=4"]  # 4 steps an epoch
    parent, run_dir = tmp_path / "parent", tmp_path / "ft"
    train(parent, utterances, *common, "train.max_steps=3")
    start = parent / "checkpoints" / "last.pt"
    train(run_dir, utterances, *common, "train.max_steps=5", f"train.resume={start}")
    again = train(run_dir, utterances, *common, "train.max_steps=7", "train.resume=auto", f"train.resume={start}")
    assert (f"train.resume={start} is the checkpoint this run directory's run started from (run "
            in again.output), again.output[-4000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'last.pt'} at step 5 " in again.output
    assert sorted(read_metrics(run_dir)[0]) == [4, 5, 6, 7]  # the first job's steps kept, each listed once
    jobs = [json.loads(line) for line in (run_dir / "jobs.jsonl").read_text().splitlines()]
    assert [job["from_step"] for job in jobs] == [3, 5] and jobs[0]["run_id"] == jobs[1]["run_id"], jobs
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["train_state"]["step"] == 7

    # PATH holds another step of the run it names now (that run went on): a start this run did not come from.
    train(parent, utterances, *common, "train.max_steps=4", "train.resume=auto")
    moved_on = train(run_dir, utterances, *common, "train.max_steps=9", f"train.resume={start}", check=False)
    assert moved_on.returncode == 2 and "is not one of its checkpoints" in moved_on.output, moved_on.output[-4000:]
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["train_state"]["step"] == 7


@pytest.mark.slow
def test_in_a_pipe_the_progress_is_log_lines_not_a_bar(an4_train, tmp_path):
    """A batch job's log is a pipe or a file, where each redraw of a bar would land as a line of its own."""
    utterances = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    result = train(tmp_path / "run", utterances, "train.progress_bar=true", "train.progress_line_s=0",
                   "train.global_batch_size=4", "train.epochs=2")
    assert "\r" not in result.output and "epoch 1: step 1 of 2, loss " in result.output, result.output[-3000:]
    assert "epoch 2: step 1 of 2, loss " in result.output, result.output[-3000:]  # the epoch's steps, not the run's
    assert "evaluating: batch 1 of " in result.output, result.output[-3000:]
    assert re.search(r"epoch 1: loss [\d.]+, 8 utterances in \d+ s, evaluated in \d+ s; test WER", result.output)


@pytest.mark.slow
def test_on_a_terminal_of_no_width_the_progress_is_log_lines(an4_train, tmp_path):
    """A terminal no one gave a size (docker run -t or a pod's tty with none attached, script -c) is one where tqdm
    draws nothing: the run showed no progress at all, no bar and, as though the bar showed it, no line either."""
    utterances = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    controller, terminal = os.openpty()  # of 0 rows and 0 columns until someone sizes it
    try:
        job = subprocess.run(
            [sys.executable, "-m", "trainer", *train_arguments(tmp_path / "run", utterances, "train.progress_bar=true",
                                                               "train.progress_line_s=0", "train.global_batch_size=4",
                                                               "train.epochs=1")],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=terminal, text=True, timeout=600,
        )
    finally:
        os.close(terminal)
        os.close(controller)
    assert job.returncode == 0, job.stdout[-3000:]
    assert "epoch 1: step 1 of 2, loss " in job.stdout and "evaluating: batch 1 of " in job.stdout, job.stdout[-3000:]


@pytest.mark.slow
def test_a_resumed_runs_progress_bar_counts_on_from_the_step_it_resumed_at(an4_train, tmp_path):
    """On a terminal that has a width, the epoch's bar starts at the step the job resumed from: one started at 0
    passed every test, and a job resumed at step 1 of 4 ended its epoch's bar at 3/4."""
    utterances = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:16])
    common = ["model.hidden=16", "train.global_batch_size=4", "train.epochs=1", "train.resume=auto",
              "train.progress_bar=true"]  # 4 steps an epoch
    train(tmp_path / "run", utterances, *common, "train.max_steps=1")
    controller, terminal = os.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    drawn = []

    def read_the_terminal():  # as the job writes, so that a full terminal buffer cannot stop it
        with contextlib.suppress(OSError):  # EIO once the job, the terminal's last writer, has ended
            while chunk := os.read(controller, 4096):
                drawn.append(chunk.decode(errors="replace"))

    reader = threading.Thread(target=read_the_terminal)
    reader.start()
    try:
        job = subprocess.run([sys.executable, "-m", "trainer", *train_arguments(tmp_path / "run", utterances, *common)],
                             cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=terminal, text=True, timeout=600)
    finally:
        os.close(terminal)
        reader.join(timeout=60)
        os.close(controller)
    bars = "".join(drawn)
    assert job.returncode == 0, job.stdout[-3000:] + bars[-3000:]
    assert re.search(r"epoch 1/1:[^\r\n]* 4/4 ", bars) and not re.search(r"epoch 1/1:[^\r\n]* 0/4 ", bars), bars


@pytest.mark.slow
def test_the_log_words_a_count_of_one_in_the_singular(an4_train, tmp_path):
    """One utterance, in global batches of one: each count of the log's lines is 1, and its noun singular."""
    utterance = write_slice(tmp_path / "one.jsonl", [u for u in an4_train if u.duration < 2.5][:1])
    result = train(tmp_path / "run", utterance, "model.hidden=32", "train.global_batch_size=1", "train.epochs=1")
    for line in (f"1 utterance from {utterance}; skipped none", "1 step per epoch, leaving out 0 utterances of each\n",
                 "(plain PyTorch): 1 utterance a rank, fp32"):
        assert line in result.output, result.output[-3000:]
    assert re.search(r"epoch 1: loss [\d.]+, 1 utterance in \d+ s", result.output), result.output[-3000:]


@pytest.mark.slow
def test_a_console_whose_reader_ends_leaves_the_run_to_finish_in_its_log(an4_train, tmp_path):
    """python -m trainer ... | head: every log line after head ended printed logging's traceback on stderr, and the run,
    trained to its end, then failed on its last line with exit code 1. The log file has every line."""
    utterance = write_slice(tmp_path / "one.jsonl", [u for u in an4_train if u.duration < 2.5][:1])
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    job = subprocess.Popen(
        [sys.executable, "-m", "trainer", *train_arguments(tmp_path / "run", utterance, "model.hidden=32",
                                                           "train.global_batch_size=1", "train.epochs=1")],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": python_path})
    job.stdout.readline()
    job.stdout.close()  # as head does once it has its lines
    errors = job.stderr.read()
    assert job.wait(timeout=600) == 0 and "Traceback" not in errors, errors[-3000:]
    assert "final test WER" not in errors and "epoch 1: loss " in (tmp_path / "run" / "__main__.log").read_text()



# A trainer whose console's reader ends (`| head`), or whose console's disk fills up, just after its run's last log
# line, before the job's last line: its stdout then writes into a pipe of no reader (CONSOLE_GONE=pipe) or /dev/full.
CONSOLE_GONE_BEFORE_THE_LAST_LINE = trainer_with(
    "import os, trainer.train\n"
    "real_train = trainer.train.train\n"
    "def train_then_lose_the_console(*args, **kwargs):\n"
    "    result = real_train(*args, **kwargs)\n"
    "    sys.stdout.flush()\n"
    "    if os.environ['CONSOLE_GONE'] == 'pipe':\n"
    "        reader, console = os.pipe()\n"
    "        os.close(reader)\n"
    "    else:\n"
    "        console = os.open('/dev/full', os.O_WRONLY)\n"
    "    os.dup2(console, sys.stdout.fileno())\n"
    "    return result\n"
    "trainer.train.train = train_then_lose_the_console\n")


@pytest.mark.slow
@pytest.mark.parametrize("gone, said", [
    ("pipe", ""), ("full", "warning: cannot write the console (No space left on device): the run's log file has its "
                           "lines\n")])
def test_a_console_lost_just_before_the_last_line_leaves_the_run_finished(an4_train, tmp_path, gone, said):
    """`python -m trainer ... | head -n N` whose N lines end with the run's last log line, or `> train.out` on a disk
    that fills up there: the job's last line, the first write after, failed the finished run in Hydra's "Error
    executing job", exit code 1 (2 and "error: cannot write stdout" for the full disk)."""
    utterance = write_slice(tmp_path / "one.jsonl", [u for u in an4_train if u.duration < 2.5][:1])
    result = subprocess.run([sys.executable, "-c", CONSOLE_GONE_BEFORE_THE_LAST_LINE, *train_arguments(
        tmp_path / "run", utterance, "model.hidden=32", "train.global_batch_size=1", "train.epochs=1")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "CONSOLE_GONE": gone})
    assert result.returncode == 0 and result.stderr == said, result.stderr[-3000:]
    assert "epoch 1: loss " in result.stdout and "final test WER" not in result.stdout, result.stdout[-3000:]


@pytest.mark.slow
def test_a_console_on_a_full_disk_is_said_once_and_the_run_finishes_with_its_log_file(an4_train, tmp_path):
    """`python -m trainer ... > train.out` on a disk that fills up (another than the run's): each log line printed
    logging's traceback of some 30 lines, and the run, trained to its end, failed on its last line with Hydra's "Error
    executing job" and exit code 2."""
    utterance = write_slice(tmp_path / "one.jsonl", [u for u in an4_train if u.duration < 2.5][:1])
    with open("/dev/full", "w") as full:
        job = subprocess.run([sys.executable, "-m", "trainer", *train_arguments(
            tmp_path / "run", utterance, "model.hidden=32", "train.global_batch_size=1", "train.epochs=1")],
            cwd=REPO_ROOT, stdout=full, stderr=subprocess.PIPE, text=True, timeout=600,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert job.returncode == 0 and job.stderr == ("warning: cannot write the console (No space left on device): "
                                                  "the run's log file has its lines\n"), job.stderr[-3000:]
    assert "epoch 1: loss " in (tmp_path / "run" / "__main__.log").read_text()

@pytest.mark.slow
@pytest.mark.parametrize("closed, console", [(">&-", "stderr"), ("2>&-", "stdout")])
def test_a_run_started_with_stdout_or_stderr_closed_trains_and_gives_its_log_and_last_line_on_the_other(
        an4_train, tmp_path, closed, console):
    """python -m trainer ... >&- or 2>&- (a cron job, a daemon): Python gives a closed stream as None, and the run
    ended in an AttributeError's traceback, exit code 1: at once for stdout, once training began for stderr (where the
    progress bar would be drawn)."""
    utterance = write_slice(tmp_path / "one.jsonl", [u for u in an4_train if u.duration < 2.5][:1])
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    trainer = shlex.join([sys.executable, "-m", "trainer", *train_arguments(
        tmp_path / "run", utterance, "model.hidden=32", "train.global_batch_size=1", "train.epochs=1",
        "train.progress_bar=true")])
    job = subprocess.run(["bash", "-c", f"{trainer} {closed}"], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": python_path})
    output = getattr(job, console)
    assert job.returncode == 0 and "Traceback" not in output, output[-3000:]
    assert "epoch 1: loss " in output and output.splitlines()[-1].startswith("final test WER "), output[-3000:]



@pytest.mark.slow
@pytest.mark.parametrize("closed, console", [(">&-", "stderr"), ("2>&-", "stdout")])
def test_a_run_started_with_stdout_or_stderr_closed_that_fails_ends_in_its_one_line_on_the_other(
        an4_train, tmp_path, closed, console):
    """Its error logged, the job's end flushed both streams, the closed one (Python's None) too: an AttributeError's
    traceback after the line, and exit code 1 rather than the error's 2."""
    manifest = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    trainer = shlex.join([sys.executable, "-m", "trainer", *train_arguments(
        tmp_path / "run", manifest, "model.hidden=32", "train.epochs=1", "train.global_batch_size=2",
        "optim.lr=1e38", "optim.warmup_steps=0")])  # weights that diverge: refused at the epoch's evaluation
    job = subprocess.run(["bash", "-c", f"{trainer} {closed}"], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": python_path, "HYDRA_FULL_ERROR": "0"})
    output = getattr(job, console)
    assert job.returncode == 2 and "Traceback" not in output, output[-3000:]
    assert "error on rank 0: evaluating after epoch 1 (step 4): " in output.splitlines()[-1], output[-3000:]

def test_the_default_model_on_a_cpu_is_warned_of_and_the_cpu_demos_is_not():
    def parameters(overrides):
        cfg = compose_config(overrides)
        return sum(p.numel() for p in build.model(cfg.model, build.features(cfg.data).num_features).parameters())

    default, demo = parameters([]), parameters(["experiment=cpu_demo"])
    assert cpu_size_warning(default, torch.device("cpu")) == (
        f"training a {default / 1e6:.1f}M-parameter model on the CPU: its epochs will be slow "
        "(experiment=cpu_demo is the model sized for a CPU)")
    assert cpu_size_warning(default, torch.device("cuda")) is None
    assert cpu_size_warning(demo, torch.device("cpu")) is None
    assert cpu_size_warning(LARGE_FOR_A_CPU, torch.device("cpu")) is None  # past it, as the README says
    assert cpu_size_warning(LARGE_FOR_A_CPU + 1, torch.device("cpu")) is not None
    assert cpu_size_warning(2_000_000_000, torch.device("cpu")).startswith("training a 2.0B-parameter model")


@pytest.mark.slow
def test_a_run_of_a_model_past_10m_parameters_on_the_cpu_warns_in_its_log(an4_train, tmp_path):
    """The warning reaches the log, not cpu_size_warning alone: TINY's model at the default's 800 units a layer (12M
    parameters), one utterance of one step."""
    utterance = write_slice(tmp_path / "one.jsonl", [u for u in an4_train if u.duration < 2.5][:1])
    result = train(tmp_path / "run", utterance, "model.hidden=800", "train.global_batch_size=1", "train.epochs=1")
    assert re.search(r"\[WARNING\] - training a 12\.0M-parameter model on the CPU: its epochs will be slow "
                     r"\(experiment=cpu_demo is the model sized for a CPU\)", result.output), result.output[-3000:]


def test_the_log_says_which_utterances_an_epoch_leaves_out_only_where_it_leaves_some():
    assert left_out_of_each_epoch(4, sortagrad=True) == (
        "4 utterances (the longest in a SortaGrad epoch, a random choice after it)")
    assert left_out_of_each_epoch(1, sortagrad=False) == "1 utterance (a random choice)"
    assert left_out_of_each_epoch(0, sortagrad=True) == "0 utterances"  # it named "the longest" of none


@pytest.mark.slow
def test_config_yaml_reads_back_as_the_values_the_run_used(an4_train, tmp_path, monkeypatch):
    """A "${" the command line escaped ("\\${") is text, which the run used as it is; config.yaml wrote it as an
    interpolation, so OmegaConf.load's readers (wer_parity) resolved it (${oc.env:...}: that variable) or failed."""
    utterance = write_slice(tmp_path / "one.jsonl", [u for u in an4_train if u.duration < 2.5][:1])
    monkeypatch.setenv("PRNN_SECRET", "read")
    train(tmp_path / "run", utterance, "model.hidden=32", "train.global_batch_size=1", "train.max_steps=1",
          r"run_name=a\${oc.env:PRNN_SECRET}")
    config = OmegaConf.load(tmp_path / "run" / "config.yaml")
    assert config.run_name == "a${oc.env:PRNN_SECRET}"


def test_config_yaml_a_job_cannot_write_whole_leaves_the_one_before_it_as_it_was(an4_train, tmp_path):
    """A file size limit (ulimit -f) fails a write part way, as a job killed or a disk filling up while it writes:
    config.yaml was written in place, so the job left it cut short, which a resume's readers (wer_parity --report)
    took for a damaged run."""
    manifest = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    before = "run_name: an earlier job's\n"
    (run_dir / "config.yaml").write_text(before)
    limit = 1000  # bytes: less than config.yaml's, more than any file the job writes before it
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "trainer", *train_arguments(run_dir, manifest, "model.hidden=32", "train.max_steps=1")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": python_path},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY)))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stdout[-2000:] + result.stderr[-2000:]
    output = result.stdout + result.stderr
    assert f"cannot write {run_dir / 'config.yaml'}: File too large" in output, output[-2000:]
    assert (run_dir / "config.yaml").read_text() == before


@pytest.mark.slow
def test_tensorboard_gives_each_step_the_rate_it_trained_at(an4_train, tmp_path):
    utterances = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    # 2 steps an epoch: a warm-up of 3 steps, then the rate halves with each epoch.
    train(tmp_path / "run", utterances, "model.hidden=32", "train.global_batch_size=4", "train.epochs=2",
          "optim.lr=1e-3", "optim.warmup_steps=3", "optim.anneal=0.5")
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    rates = [(event.step, event.value) for event in events.Scalars("train/lr")]
    assert rates == [(1, pytest.approx(1e-3 / 3)), (2, pytest.approx(2e-3 / 3)), (3, pytest.approx(0.5e-3)),
                     (4, pytest.approx(0.5e-3))], rates


def test_the_suite_started_with_ctrl_c_ignored_starts_its_trainers_taking_it():
    """pytest started in the background (`make test &`, nohup, a CI runner) inherits Ctrl-C ignored, and so did each
    trainer a test started, which then ignores SIGINT (data.cli.ctrl_c_ignored): the Ctrl-C tests waited for an
    answer that never came, training on until killed."""
    result = subprocess.run([sys.executable, "-c", "import signal, conftest\n"
                             "print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"],
                            cwd=REPO_ROOT / "tests", capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "False\n"


@pytest.mark.slow
def test_a_second_ctrl_c_interrupts_at_once_in_one_line(an4_train, tmp_path):
    utterances = write_slice(tmp_path / "slice.jsonl", an4_train[:128])
    job = subprocess.Popen(  # steps of seconds: 64 utterances through 512 units
        [sys.executable, "-m", "trainer", *train_arguments(tmp_path / "run", utterances, "train.epochs=1000",
                                                          "train.global_batch_size=64", "model.hidden=512")],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        wait_for_file(tmp_path / "run" / "metrics.jsonl", job, 300)
        wait_for_text(tmp_path / "run" / "metrics.jsonl", '"step"', job)  # training has begun
        time.sleep(0.5)  # inside the second step
        os.killpg(job.pid, signal.SIGINT)
        log = tmp_path / "run" / "__main__.log"
        # As a user presses again once the first is answered (two at once arrive as one).
        wait_for_text(log, "SIGINT received", job)
        os.killpg(job.pid, signal.SIGINT)
        output = job.communicate(timeout=300)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 128 + signal.SIGINT, output[-4000:]
    assert "SIGINT received: stopping when" in output, output[-4000:]
    assert "interrupted by Ctrl-C; no checkpoint of this run was written" in output, output[-4000:]
    assert "Traceback" not in output, output[-4000:]


@pytest.mark.slow
def test_killed_or_signalled_runs_resume_exactly_where_their_checkpoints_stopped(an4_train, tmp_path):
    """A job killed mid-epoch (out of memory, a node lost) and started again under the same run directory with
    train.resume=auto continues from its last periodic checkpoint. A job sent SIGTERM (a scheduler preempting it: the
    signal reaches its data-loading worker too) stops at the end of a step with its checkpoint and exits 143, as a
    process SIGTERM ended would, and continues from that step. Both then train exactly as an uninterrupted run."""
    utterances = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:16])
    common = ["model.hidden=32", "train.global_batch_size=4", "data.augment.enabled=true", "train.max_steps=12",
              "train.num_workers=1", "train.resume=auto"]  # 4 steps an epoch; the first start finds nothing to resume
    whole_run = train(tmp_path / "whole", utterances, *common)
    # Stopped by train.max_steps at an epoch's end: not the run's final WER either.
    assert "stopped at step 12 (train.max_steps); the last evaluation, after epoch 3 (step 12): test WER" in (
        whole_run.stdout), whole_run.stdout

    def start(run_dir, *overrides):
        return subprocess.Popen(
            [sys.executable, "-m", "trainer", *train_arguments(run_dir, utterances, *common, *overrides)],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )

    killed = tmp_path / "killed"
    job = start(killed, "train.checkpoint_every_steps=2")
    wait_for_file(killed / "checkpoints" / "last.pt", job, 300)
    os.killpg(job.pid, signal.SIGKILL)
    job.communicate()
    killed_at = torch.load(killed / "checkpoints" / "last.pt", weights_only=True)["train_state"]["step"]
    assert 2 <= killed_at < 12, killed_at

    signalled = tmp_path / "signalled"
    job = start(signalled)
    wait_for_file(signalled / "metrics.jsonl", job, 300)
    wait_for_text(signalled / "metrics.jsonl", '"step"', job)  # training has begun
    os.killpg(job.pid, signal.SIGTERM)
    output = job.communicate(timeout=300)[0]
    assert job.returncode == 128 + signal.SIGTERM, output[-4000:]
    stopped_at = torch.load(signalled / "checkpoints" / "last.pt", weights_only=True)["train_state"]["step"]
    assert 1 <= stopped_at < 12, stopped_at
    assert "SIGTERM received: stopping when the training step or evaluation in progress ends" in output, (
        output[-4000:])
    assert ("(SIGTERM); train.resume=auto under the same run_name (RUN_NAME in the launch scripts) and overrides "
            "continues it from") in output, (
        output[-4000:])
    assert "final test WER" not in output and "Traceback" not in output, output[-4000:]
    assert sorted(read_metrics(signalled)[0]) == list(range(1, stopped_at + 1))  # the checkpoint's step is the last

    whole, _ = read_metrics(tmp_path / "whole")
    for run_dir, saved_step in ((killed, killed_at), (signalled, stopped_at)):
        result = train(run_dir, utterances, *common)
        assert f"resumed from {run_dir / 'checkpoints' / 'last.pt'}" in result.output
        resumed, _ = read_metrics(run_dir)
        assert sorted(resumed) == list(range(1, 13))
        for step in range(saved_step + 1, 13):
            assert resumed[step] == pytest.approx(whole[step], rel=1e-6, abs=0), f"{run_dir.name}, step {step}"


def start_a_run_and_find_its_data_workers(an4_train, tmp_path, stage: str, after_step: int, *overrides):
    """A small run in a session of its own, 16 steps an epoch and an evaluation long enough to reach, and the
    data-loading workers of its `stage` (training or evaluation), once step `after_step` is in its metrics."""
    train_set = write_slice(tmp_path / "train.jsonl", an4_train[:64])  # 16 steps: more than the loader prefetches
    test_set = write_slice(tmp_path / "test.jsonl", an4_train[64:364])
    run_dir = tmp_path / "run"
    arguments = train_arguments(run_dir, train_set, "model.hidden=32", "train.global_batch_size=4",
                                "train.eval_batch_size=1", f"data.eval_manifest={test_set}", *overrides)
    job = subprocess.Popen([sys.executable, "-m", "trainer", *arguments], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_for_file(run_dir / "metrics.jsonl", job, 300)
        wait_for_text(run_dir / "metrics.jsonl", f'"step": {after_step},', job)
        workers = data_loading_workers(job.pid)
        if stage == "evaluation":  # the training workers gone, the evaluation's started
            training = workers
            while not (workers := data_loading_workers(job.pid) - training) and job.poll() is None:
                time.sleep(0.02)
    except BaseException:
        os.killpg(job.pid, signal.SIGKILL)
        raise
    return job, run_dir, workers


def the_one_error_line(output: str) -> str:
    errors = [line for line in output.splitlines() if "ERROR" in line or "Traceback" in line]
    assert len(errors) == 1, output[-4000:]
    return errors[0]


@pytest.mark.parametrize("stage, device", [
    ("training", "cpu"), ("evaluation", "cpu"),
    pytest.param("training", "cuda", marks=pytest.mark.cuda),  # batches pass through torch's pin-memory thread
])
def test_a_data_loading_worker_that_stops_answering_ends_the_run_in_one_line(an4_train, tmp_path, stage, device):
    """A worker stuck on a file system that stopped answering, or stopped (SIGSTOP here): the run waited for its batch
    for ever, a SIGTERM only asked it to stop after that batch, and Python's exit waited for the stopped worker too."""
    job, _, workers = start_a_run_and_find_its_data_workers(an4_train, tmp_path, stage, 1, "train.num_workers=1",
                                                            "distributed.timeout_s=5", f"device={device}")
    try:
        (worker,) = workers
        os.kill(worker, signal.SIGSTOP)
        stopped = time.monotonic()
        output = job.communicate(timeout=120)[0]
        waited = time.monotonic() - stopped
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 1, output[-4000:]
    assert the_one_error_line(output).endswith(
        "error on rank 0: no batch came from the data-loading workers within 5 s (distributed.timeout_s): one is stuck "
        "(on a file system that stopped answering, or stopped) or far too slow, and they were killed; "
        "train.resume=auto under the same run_name (RUN_NAME in the launch scripts) and overrides continues the run "
        "from its last checkpoint"), (
        output[-4000:])
    assert waited < 30, waited
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left stopped
        os.kill(worker, 0)


def test_a_stop_signal_while_an_evaluations_worker_is_stuck_stops_the_run_at_once_for_the_resume_to_evaluate(
        an4_train, tmp_path):
    """SIGTERM while the evaluation waits for a batch from its stopped worker: the run stops as on any signal during
    an evaluation, last.pt at the epoch's last step. It waited out distributed.timeout_s, then failed with exit 1."""
    job, run_dir, workers = start_a_run_and_find_its_data_workers(an4_train, tmp_path, "evaluation", 1,
                                                                  "train.num_workers=1", "distributed.timeout_s=60")
    try:
        (worker,) = workers
        os.kill(worker, signal.SIGSTOP)
        time.sleep(3)  # the evaluation uses up the batches its worker had made, then waits
        signalled = time.monotonic()
        os.killpg(job.pid, signal.SIGTERM)
        output = job.communicate(timeout=120)[0]
        waited = time.monotonic() - signalled
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 128 + signal.SIGTERM, output[-4000:]
    assert waited < 20, waited
    assert "stopped after epoch 1's training, before its evaluation ended (SIGTERM)" in output, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert saved["sampler"] == {"epoch": 0, "position": 16}, saved["sampler"]
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left stopped
        os.kill(worker, 0)


@pytest.mark.parametrize("stage, num_workers, device", [
    ("training", 2, "cpu"), ("evaluation", 1, "cpu"),
    pytest.param("training", 2, "cuda", marks=pytest.mark.cuda),  # batches pass through torch's pin-memory thread
])
def test_a_data_loading_worker_killed_as_the_out_of_memory_killer_does_ends_the_run_in_one_line(
        an4_train, tmp_path, stage, num_workers, device):
    """SIGKILL, which the kernel's out-of-memory killer sends: the run ended in torch's traceback, or, where the death
    first surfaced as a batch that could not be unpickled, in two."""
    job, run_dir, workers = start_a_run_and_find_its_data_workers(  # past the first checkpoint, at step 4
        an4_train, tmp_path, stage, 5, f"train.num_workers={num_workers}", "train.checkpoint_every_steps=4",
        f"device={device}")
    try:
        assert len(workers) == num_workers
        killed = min(workers)
        os.kill(killed, signal.SIGKILL)
        output = job.communicate(timeout=120)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 1, output[-4000:]
    assert the_one_error_line(output).endswith(
        f"error on rank 0: data-loading worker (pid {killed}) was killed by SIGKILL, which the kernel's out-of-memory "
        f"killer sends: fewer train.num_workers ({num_workers} here), a smaller train.global_batch_size or "
        "train.eval_batch_size, or more memory may keep it alive; train.resume=auto under the same run_name "
        "(RUN_NAME in the launch scripts) and overrides continues the run from its last checkpoint"), output[-4000:]
    for worker in workers:  # the others killed too, and every one reaped
        with pytest.raises(ProcessLookupError):
            os.kill(worker, 0)
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["train_state"]["step"] >= 4
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == ["last.pt"]


SHARED_MEMORY_FULL = trainer_with(  # in the data-loading workers, which the training process forks
    "import torch\n"
    "def full(tensor):\n"
    "    raise RuntimeError('unable to write to file </torch_1_2_0>: No space left on device (28)')\n"
    "torch.Tensor.share_memory_ = full\n")


def test_a_batch_that_shared_memory_cannot_take_ends_the_run_in_one_line(an4_train, tmp_path):
    """/dev/shm full as a worker hands its batch over: the run ended in torch's traceback ("training failed on rank 0",
    "Caught RuntimeError in DataLoader worker process 0"), where Bad input promises one line naming the cause and what
    to try."""
    utterances = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    result = subprocess.run([sys.executable, "-c", SHARED_MEMORY_FULL,
                             *train_arguments(tmp_path / "run", utterances, "model.hidden=32", "train.num_workers=1")],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-4000:]
    assert the_one_error_line(output).endswith(
        "error on rank 0: a data-loading worker could not hand its batch over in shared memory (unable to write to "
        "file </torch_1_2_0>: No space left on device (28)): /dev/shm is full, or a file size limit (ulimit -f) too "
        "low; train.num_workers=0 (1 here: batches made in the training process itself) or a larger /dev/shm (docker "
        "run --shm-size) may keep it from happening; train.resume=auto under the same run_name (RUN_NAME in the launch "
        "scripts) and overrides continues the run from its last checkpoint"), output[-4000:]


def test_a_run_refused_once_started_leaves_its_log_and_the_corrected_run_starts_there(an4_train, tmp_path):
    """A refusal that depends on the machine (AN4's folder missing on this node) comes once the run has started and
    leaves the run directory holding its log: the corrected command under the same name must start there afresh,
    neither refused as a run over another's nor taking the log for one."""
    utterances = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    run_dir = tmp_path / "run"
    refused = train(run_dir, utterances, "model.hidden=32", "train.max_steps=1",
                    f"data.an4_source={tmp_path / 'not-here'}", check=False)
    assert refused.returncode == 2, refused.output[-3000:]
    assert sorted(path.name for path in run_dir.iterdir()) == [".lock", "__main__.log"]
    assert f"folder {tmp_path / 'not-here'} does not exist" in (run_dir / "__main__.log").read_text()
    train(run_dir, utterances, "model.hidden=32", "train.max_steps=1")
    assert (run_dir / "checkpoints" / "last.pt").is_file()
    assert "does not exist" in (run_dir / "__main__.log").read_text()  # appended to, not replaced


def test_periodic_checkpoints_come_every_k_steps_of_the_run_inside_epochs_only(an4_train, tmp_path):
    """train.checkpoint_every_steps=K writes last.pt at each K-th step of the run inside an epoch, the epoch's end
    writing its own. Each torch.save the trainer makes is recorded here with its step: writing at every step, at the
    K-th step of each epoch, or twice at an epoch's end passed every test."""
    utterances = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:12])
    run_dir, saves = tmp_path / "run", tmp_path / "saves.txt"
    # 3 steps an epoch: steps 2 and 4 are inside epochs 1 and 2, step 6 is epoch 2's last.
    overrides = ["model.hidden=32", "train.epochs=2", "train.global_batch_size=4", "train.checkpoint_every_steps=2"]
    result = subprocess.run([sys.executable, "-c", trainer_with(recording_saves(saves)),
                             *train_arguments(run_dir, utterances, *overrides)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert [int(line.split("\t")[1]) for line in saves.read_text().splitlines()] == [2, 3, 4, 6]


def test_elapsed_s_goes_on_from_the_checkpoint_a_job_resumes(an4_train, tmp_path):
    """metrics.jsonl's elapsed_s and the checkpoints' count the run's seconds over all of its jobs: a clock started
    anew in each job passed every test. The first job's seconds are set to 1000 in its checkpoint, so that the
    second's, a few, cannot pass for the sum."""
    utterances = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    common = ["model.hidden=32", "train.global_batch_size=4", "train.epochs=1"]  # 2 steps an epoch
    run_dir = tmp_path / "run"
    train(run_dir, utterances, *common, "train.max_steps=1")
    last = run_dir / "checkpoints" / "last.pt"
    saved = torch.load(last, weights_only=True)
    saved["train_state"]["elapsed_s"] = 1000.0
    torch.save(saved, last)
    train(run_dir, utterances, *common, "train.resume=auto")
    [epoch] = read_metrics(run_dir)[1]
    assert 1000 < epoch["elapsed_s"] < 1000 + 600, epoch
    assert 1000 < torch.load(last, weights_only=True)["train_state"]["elapsed_s"] < 1000 + 600


def test_the_metrics_are_on_disk_as_far_as_each_checkpoint_before_it_is_written(an4_train, tmp_path):
    """A machine that crashes loses what its page cache held: a checkpoint, flushed to disk, then outlived the metrics
    lines of its steps, which a resume never writes again. Each fsync the trainer makes is recorded here with the size
    metrics.jsonl has at that moment."""
    utterances = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:12])
    run_dir, fsyncs = tmp_path / "run", tmp_path / "fsyncs.txt"
    metrics = run_dir / "metrics.jsonl"
    recording = trainer_with(
        "import os\n"
        "real_fsync = os.fsync\n"
        "def recorded_fsync(fd):\n"
        "    real_fsync(fd)\n"
        "    fd = fd if isinstance(fd, int) else fd.fileno()\n"
        f"    size = os.path.getsize({str(metrics)!r}) if os.path.exists({str(metrics)!r}) else -1\n"
        f"    with open({str(fsyncs)!r}, 'a') as out:\n"
        "        out.write(f\"{os.path.basename(os.readlink(f'/proc/self/fd/{fd}'))} {size}\\n\")\n"
        "os.fsync = recorded_fsync\n"
    )
    overrides = ["model.hidden=32", "train.epochs=1", "train.global_batch_size=4", "train.checkpoint_every_steps=1"]
    result = subprocess.run([sys.executable, "-c", recording, *train_arguments(run_dir, utterances, *overrides)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    records = [line.split() for line in fsyncs.read_text().splitlines()]
    checkpoints = [index for index, (name, _) in enumerate(records) if re.fullmatch(r"\.\w+\.pt\..+\.tmp", name)]
    assert len(checkpoints) >= 3, records  # after steps 1 and 2, and the epoch's best.pt (last.pt the same file)
    for index in checkpoints:
        metrics_syncs = [size for name, size in records[:index] if name == "metrics.jsonl"]
        assert metrics_syncs and metrics_syncs[-1] == records[index][1], (records[index], records[:index])


def test_an_epoch_that_improves_the_wer_serialises_its_checkpoint_once_for_best_pt_and_last_pt(an4_train, tmp_path):
    """best.pt and last.pt of such an epoch are the same checkpoint: serialised twice, the 100-layer model's made two
    large writes an epoch. Each torch.save the trainer makes is recorded here; the files must still hold what they
    should after epochs that do and do not improve and a resume, last.pt replaced while best.pt stays."""
    utterances = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    run_dir, saves = tmp_path / "run", tmp_path / "saves.txt"
    common = ["model.hidden=32", "train.global_batch_size=4", "optim.lr=3e-3"]  # 2 steps an epoch
    for epochs, overrides in ((1, []), (3, ["train.resume=auto"])):
        result = subprocess.run([sys.executable, "-c", trainer_with(recording_saves(saves)),
                                 *train_arguments(run_dir, utterances, *common, f"train.epochs={epochs}", *overrides)],
                                cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
        # The first epoch always improves on no evaluation: a last.pt left out there passed where later epochs did not.
        assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["train_state"]["step"] == 2 * epochs
    assert len(saves.read_text().splitlines()) == 3, saves.read_text()  # one an epoch, best.pt or not

    wers = [epoch["eval_wer"] for epoch in read_metrics(run_dir)[1]]
    best_epoch = wers.index(min(wers)) + 1  # the first of equals: a later one must beat it
    best = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert (best["train_state"]["step"], best["train_state"]["best_wer"]) == (2 * best_epoch, min(wers)), wers
    assert last["train_state"]["step"] == 6 and last["train_state"]["best_wer"] == min(wers)
    if best_epoch < 3:
        assert any(not torch.equal(tensor, last["model"][name]) for name, tensor in best["model"].items())
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))


@pytest.mark.slow
@pytest.mark.parametrize("max_steps", [None, 4])
def test_a_signal_during_an_evaluation_ends_it_and_the_resume_makes_it(an4_train, tmp_path, max_steps):
    """A large test set can take longer to evaluate than a scheduler waits after its SIGTERM: the evaluation ends
    after the batch in progress, last.pt holds the epoch's last step, and the resume evaluates that epoch first. With
    train.max_steps at that step, the resume (the same command, as a requeued job runs it) said "nothing to train" and
    never made the evaluation."""
    short = [u for u in an4_train if u.duration < 2.5]
    train_set = write_slice(tmp_path / "train.jsonl", short[:16])  # 4 steps an epoch
    test_set = write_slice(tmp_path / "test.jsonl", short[16:136])  # an evaluation long enough to signal it
    run_dir = tmp_path / "run"
    arguments = train_arguments(run_dir, train_set, "model.hidden=32", "train.epochs=2", "train.global_batch_size=4",
                                "train.eval_batch_size=1", f"data.eval_manifest={test_set}", "train.resume=auto",
                                f"train.max_steps={'null' if max_steps is None else max_steps}")
    job = subprocess.Popen([sys.executable, "-m", "trainer", *arguments], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    wait_for_file(run_dir / "metrics.jsonl", job, 300)
    wait_for_text(run_dir / "metrics.jsonl", '"step": 4,', job)  # the epoch's last step: its evaluation comes next
    time.sleep(1)  # into the evaluation (120 batches)
    os.killpg(job.pid, signal.SIGTERM)
    output = job.communicate(timeout=300)[0]
    assert job.returncode == 128 + signal.SIGTERM, output[-4000:]
    assert ("stopped after epoch 1's training, before its evaluation ended (SIGTERM); train.resume=auto under the same "
            "run_name (RUN_NAME in the launch scripts) and overrides continues it with that evaluation from"
            ) in output, output[-4000:]
    steps, epochs = read_metrics(run_dir)
    assert sorted(steps) == [1, 2, 3, 4] and epochs == [], epochs
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert saved["train_state"]["step"] == 4 and saved["sampler"] == {"epoch": 0, "position": 4}, saved["sampler"]

    resumed = run("trainer", arguments, timeout=300)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert "epoch 1 (its steps trained before the resume): evaluated in" in resumed.output, resumed.output[-4000:]
    steps, epochs = read_metrics(run_dir)
    if max_steps is None:
        assert sorted(steps) == list(range(1, 9)) and [line["epoch"] for line in epochs] == [1, 2], epochs
    else:
        assert sorted(steps) == [1, 2, 3, 4] and [line["epoch"] for line in epochs] == [1], epochs
        assert "stopped after epoch 1 (train.max_steps)" in resumed.output, resumed.output[-4000:]


# `python -m trainer` that sends itself SIGTERM as it scores its first evaluation's last utterance, of a test set of 4
# (to its main thread, whose handler runs before pthread_kill returns: no race with the evaluation's end).
SIGNAL_ON_THE_FIRST_EVALUATIONS_LAST_SCORE = trainer_with(
    "import signal, threading\n"
    "from trainer.metrics import ErrorCounts\n"
    "add, scored = ErrorCounts.add, [0]\n"
    "def add_and_signal_on_the_last(self, *args):\n"
    "    scored[0] += 1\n"
    "    if scored[0] == 4:\n"
    "        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)\n"
    "    return add(self, *args)\n"
    "ErrorCounts.add = add_and_signal_on_the_last\n"
)


def signalled_on_the_first_evaluations_last_score(an4_train, tmp_path, *overrides, multirun=False):
    """(the run's arguments, its finished process), the run 4 steps an epoch and its test set 4 batches of 1."""
    short = [u for u in an4_train if u.duration < 2.5]
    train_set = write_slice(tmp_path / "train.jsonl", short[:16])
    test_set = write_slice(tmp_path / "test.jsonl", short[16:20])
    arguments = train_arguments(tmp_path / "run", train_set, "model.hidden=32", "train.global_batch_size=4",
                                "train.eval_batch_size=1", f"data.eval_manifest={test_set}", "train.resume=auto",
                                *overrides)
    finished = subprocess.run([sys.executable, "-c", SIGNAL_ON_THE_FIRST_EVALUATIONS_LAST_SCORE,
                               *(["-m"] if multirun else []), *arguments],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    finished.output = finished.stdout + finished.stderr
    return arguments, finished


@pytest.mark.slow
def test_a_signal_during_an_evaluations_last_batch_lets_the_finished_evaluation_count(an4_train, tmp_path):
    """The evaluation, its every batch made, was thrown away and made again by the resume: on a large test set,
    minutes of a scheduler's job."""
    run_dir = tmp_path / "run"
    arguments, stopped = signalled_on_the_first_evaluations_last_score(an4_train, tmp_path, "train.epochs=2")
    output = stopped.output
    assert stopped.returncode == 128 + signal.SIGTERM, output[-4000:]
    assert re.search(r" - epoch 1: loss .* test WER", output), output[-4000:]
    assert ("stopped after epoch 1 (SIGTERM); train.resume=auto under the same run_name (RUN_NAME in the launch "
            "scripts) and overrides continues it from") in output, output[-4000:]
    steps, epochs = read_metrics(run_dir)
    assert sorted(steps) == [1, 2, 3, 4] and [line["epoch"] for line in epochs] == [1], epochs
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert saved["sampler"] == {"epoch": 1, "position": 0} and saved["train_state"]["best_wer"] == epochs[0][
        "eval_wer"], saved["train_state"]
    assert (run_dir / "checkpoints" / "best.pt").exists()

    resumed = run("trainer", arguments, timeout=300)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert "epoch 1 " not in resumed.output and "epoch 2: loss" in resumed.output, resumed.output[-4000:]
    steps, epochs = read_metrics(run_dir)  # each epoch's evaluation listed once
    assert sorted(steps) == list(range(1, 9)) and [line["epoch"] for line in epochs] == [1, 2], epochs


@pytest.mark.slow
@pytest.mark.parametrize("overrides, last_line", [
    (["train.epochs=1"], "final test WER"),
    # Stopped by train.max_steps at the same step: it named train.max_steps, yet exited 143 with no last line, where a
    # signal during the step train.max_steps stops at inside an epoch exits 0.
    (["train.epochs=2", "train.max_steps=4"],
     "stopped at step 4 (train.max_steps); the last evaluation, after epoch 1"),
])
def test_a_signal_after_the_last_evaluation_began_lets_the_run_finish(an4_train, tmp_path, overrides, last_line):
    """Every epoch trained and evaluated, the run stopped on the signal all the same (exit 143, no final WER line):
    launch/slurm.sbatch would queue it again for a job with nothing to train."""
    _, finished = signalled_on_the_first_evaluations_last_score(an4_train, tmp_path, *overrides)
    assert finished.returncode == 0, finished.output[-4000:]
    assert "SIGTERM received after this job's last evaluation, its work done: it ends as a finished run" in (
        finished.output), finished.output[-4000:]
    assert finished.stdout.splitlines()[-1].startswith(last_line), finished.output[-4000:]
    assert "(SIGTERM)" not in finished.output, finished.output[-4000:]
    steps, epochs = read_metrics(tmp_path / "run")
    assert sorted(steps) == [1, 2, 3, 4] and [line["epoch"] for line in epochs] == [1], epochs


@pytest.mark.slow
def test_a_signal_after_a_sweep_jobs_last_evaluation_began_stops_the_sweep_after_that_job(an4_train, tmp_path):
    """The job that got it ends as a finished run, and the signal then ended no job: the sweep ran on, each job after it
    trained whole, until the scheduler that sent it killed the sweep."""
    sweep_dir = tmp_path / "sweep"
    _, finished = signalled_on_the_first_evaluations_last_score(
        an4_train, tmp_path, f"hydra.sweep.dir={sweep_dir}", "train.epochs=1", "model.cell=relu,gru", multirun=True)
    assert finished.returncode == 128 + signal.SIGTERM, finished.output[-4000:]
    assert "SIGTERM received after this job's last evaluation, its work done: it ends as a finished run" in (
        finished.output), finished.output[-4000:]
    assert "final test WER" in finished.stdout, finished.output[-4000:]
    assert "SIGTERM received before training began" in finished.output, finished.output[-4000:]
    jobs = sweep_jobs(sweep_dir)
    assert list(jobs) == ["relu"] and (jobs["relu"] / "checkpoints" / "last.pt").exists(), jobs


@pytest.mark.slow
def test_a_second_job_in_a_run_directory_in_use_is_refused_changing_nothing(an4_train, tmp_path):
    """Launched twice, or requeued while the first job still runs: two jobs in one run directory would overwrite each
    other's checkpoints and metrics.jsonl. The second is refused before it changes anything there, and once the first
    has ended, however it ended, the directory is free again."""
    manifest = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    run_dir = tmp_path / "run"
    common = ["model.hidden=32", "train.global_batch_size=4", "train.resume=auto"]
    first = subprocess.Popen(
        [sys.executable, "-m", "trainer",
         *train_arguments(run_dir, manifest, *common, "train.epochs=50", "train.checkpoint_every_steps=1")],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        wait_for_file(run_dir / "checkpoints" / "last.pt", first, 300)
        second = train(run_dir, manifest, *common, "train.max_steps=1", check=False, timeout=300)
        assert second.returncode == 2, second.output[-4000:]
        assert f"{run_dir} is in use by another job (pid {first.pid} on " in second.output, second.output[-4000:]
        assert "Traceback" not in second.output and first.poll() is None
        assert len((run_dir / "jobs.jsonl").read_text().splitlines()) == 1  # the first job's line only
        # Its settings nowhere but in its refusal's log lines (Hydra's .hydra/ would hold its config and overrides).
        written = [path for path in run_dir.rglob("*") if path.is_file() and path.suffix not in (".log", ".pt")
                   and "max_steps=1" in path.read_text(errors="replace").replace(": ", "=")]
        assert not written, written
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    again = train(run_dir, manifest, *common, "train.max_steps=1", timeout=300)
    assert "resumed from" in again.output


@pytest.mark.parametrize("sweep", [[], ["-m", "model.hidden=8,16"]])
def test_a_run_directory_that_cannot_be_made_is_one_line_and_exit_2(tmp_path, sweep):
    (tmp_path / "runs").write_text("")  # a file where runs/ should be
    result = run("trainer", [*sweep, "experiment=cpu_demo", "run_name=r"], timeout=300, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.output, result.output[-4000:]
    assert result.stderr == "error: cannot make the run directory runs/r: runs is a file, not a folder\n", \
        result.output[-4000:]


@pytest.mark.parametrize("overrides, refusal", [
    (["model.depht=3"], "unknown config key model.depht (did you mean model.depth?)"),  # not Hydra's +model.depht=3
    (["-m", "model.depht=1,2"], "unknown config key model.depht (did you mean model.depth?)"),
    (["experiments=cpu_demo"], "unknown config key experiments (did you mean experiment?)"),  # a group's name
    (["model.size=3"], "unknown config key model.size: model has depth, hidden, cell, bidirectional, lookahead, "
                       "residual, backend, conv_channels, batch_slice"),
    (["experiment=cpu-demo"], "In 'train': Could not find 'experiment/cpu-demo' (did you mean experiment=cpu_demo?); "
                              "the options of experiment: an4_gpu, cpu_demo, deep100"),
    (["+foo"], "cannot parse the override +foo: missing EQUAL at '<EOF>'; See "
               "https://hydra.cc/docs/1.2/advanced/override_grammar/basic for details"),
    # Hydra's defaults list raised a ValueError of its own: a traceback and exit code 1.
    (["experiment=null"], "Config group override must be a string or a list. Got NoneType: a config group (data, "
                          "experiment, model, optim) takes the name of one of its options (experiment's default is "
                          "none: leave it out)"),
    # Hydra's line under the override put a ^ under the character it stopped at.
    (["data.eval_manifest=/corpus ü/test.jsonl"], "cannot parse the override data.eval_manifest=/corpus ü/test.jsonl: "
     "LexerNoViableAltException: data.eval_manifest=/corpus ü/test.jsonl (at 'ü'); See "
     "https://hydra.cc/docs/1.2/advanced/override_grammar/basic for details"),
])
def test_an_override_hydra_refuses_is_one_line_naming_it_and_exit_2(tmp_path, overrides, refusal):
    """Hydra's report was several lines (its config search path, advice to add the key with +, which the trainer then
    refuses) and exit code 1, where every other refusal of the trainer is one line and exit code 2."""
    result = run("trainer", overrides, timeout=300, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr == f"error: {refusal}\n", result.output[-4000:]
    assert list(tmp_path.iterdir()) == []  # a sweep's too: Hydra's sweeper wrote runs/NAME/multirun.yaml first


@pytest.mark.parametrize("overrides, refusal", [
    (["model.depth=2,0"], "sweep job 1 (model.depth=0): model.depth must be a positive integer, not 0"),
    # An override the job resolves (its number): the check resolved it as it split the sweep, and failed; Hydra took
    # that for a warning, and every job ran.
    (["seed=${hydra:job.num}", "model.depth=0,-1"],
     "sweep job 0 (model.depth=0): model.depth must be a positive integer, not 0"),
    (["model.cell=gru", "+model.size=1,2"], "sweep job 0 (+model.size=1): unknown config key "
     "model.size: conf/train.yaml and conf/{model,data,optim}/ define no such key (misspelt in an experiment file, or "
     "added by a + override?)"),
    (["run_name=same", "model.cell=gru", "train.max_steps=1,2"], "sweep job 1 (train.max_steps=2): "
     "runs/same/model.cell=gru is job 0's folder too: sweep job folders are named by the overrides "
     "less run_name, train.resume, train.max_steps, train.epochs, train.checkpoint_every_steps, train.num_workers, "
     "train.eval_batch_size, train.progress_bar, train.progress_line_s, distributed.timeout_s, so a sweep over one of "
     "those puts its jobs in one folder (sweep over it in separate runs, or set hydra.sweep.subdir, e.g. to "
     "${hydra.job.num})"),
])
def test_a_sweep_with_a_job_the_trainer_refuses_is_refused_before_any_job_runs_leaving_nothing(tmp_path, overrides,
                                                                                                refusal):
    """Job 0 trained (and its data was prepared), then the refused job failed, as a sweep's failing job does, and the
    sweep's multirun.yaml stayed behind: a refused single run leaves nothing."""
    result = run("trainer", ["-m", *overrides], timeout=300, cwd=tmp_path)
    assert result.returncode == 2, result.output[-4000:]
    assert result.stderr == f"error: {refusal}; no job of the sweep ran\n", result.output[-4000:]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("overrides, refusal", [
    (["optim.lr=abc"], "optim.lr must be a positive number, not 'abc'"),
    (["run_name=x", "model.depth=0"], "model.depth must be a positive integer, not 0"),
])
def test_a_single_run_the_trainer_refuses_is_refused_before_its_folder_is_made(tmp_path, overrides, refusal):
    """Hydra made the run's folder before the trainer refused the config: each refused attempt left a runs/<its start
    time>/ (or runs/x/) holding only Hydra's log, where a refused sweep leaves nothing."""
    result = run("trainer", ["experiment=cpu_demo", *overrides], timeout=300, cwd=tmp_path)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"error: {refusal}\n"), result.output[-4000:]
    assert list(tmp_path.iterdir()) == []


def test_hydra_full_error_still_gives_hydras_trace_of_an_override_it_refuses(tmp_path):
    result = run("trainer", ["model.depht=3"], timeout=300, cwd=tmp_path, env={"HYDRA_FULL_ERROR": "1"})
    assert result.returncode == 1 and "Traceback" in result.stderr, result.output[-4000:]
    assert result.stderr.rstrip().endswith("Could not override 'model.depht'.\nTo append to your config use "
                                           "+model.depht=3"), result.output[-4000:]


@pytest.mark.parametrize("run_name", ["..", "", "a/b", "null"])
def test_a_run_name_that_is_no_folder_of_runs_is_refused(tmp_path, run_name):
    """`..` wrote the run into the working directory, an empty name into runs/ itself, null into runs/None."""
    result = run("trainer", ["experiment=cpu_demo", f"run_name={run_name}"], timeout=300, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.output, result.output[-4000:]
    assert result.stderr.startswith("error: run_name=") and "must name one folder of runs/" in result.stderr, (
        result.output[-4000:])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("module", ["trainer", "trainer.check_overrides"])
@pytest.mark.parametrize("sweep", [[], ["-m"]])
def test_a_run_name_that_does_not_resolve_is_one_line_and_exit_2(tmp_path, module, sweep):
    """Hydra resolved it for the run's folder after the check, and ended in a traceback, exit 1."""
    result = run(module, [*sweep, "experiment=cpu_demo", "run_name=${nope}"], timeout=300, cwd=tmp_path)
    assert result.returncode == 2, result.output[-4000:]
    assert result.stderr == "error: run_name: Interpolation key 'nope' not found\n", result.output[-4000:]
    assert list(tmp_path.iterdir()) == []


class MakesAFileWhenUnpickled:
    """What a pickle may hold: a call, made as it is loaded (here Path.touch on `made`)."""

    def __init__(self, made: Path):
        self.made = made

    def __reduce__(self):
        return Path.touch, (self.made,)


@pytest.mark.parametrize("module", ["trainer", "trainer.check_overrides"])
@pytest.mark.parametrize("spelling", [["--experimental-rerun", "{}"], ["--experimental={}"]],
                         ids=["flag", "abbreviated"])
def test_a_pickled_config_to_rerun_is_refused_unread(tmp_path, module, spelling):
    """Hydra's --experimental-rerun FILE unpickled FILE, which runs whatever call the file holds: the trainer made
    the file this one names, then failed on what it loaded; the launch scripts' check passed it. Hydra's parser takes
    an abbreviation of the flag, and FILE after "=", as the flag itself: refused too."""
    made = tmp_path / "made by the pickle"
    pickled = tmp_path / "config.pickle"
    pickled.write_bytes(pickle.dumps(MakesAFileWhenUnpickled(made)))
    result = run(module, [word.format(pickled) for word in spelling], timeout=300, cwd=tmp_path)
    assert result.returncode == 2, result.output[-4000:]
    assert result.stderr == (f"error: --experimental-rerun {pickled}: the trainer does not load pickled configs, whose "
                             "loading can run any code; continue a run with train.resume=auto under its run_name "
                             "(RUN_NAME in the launch scripts) and the overrides it was started with (its run "
                             "directory's jobs.jsonl records each job's command)\n"), result.output[-4000:]
    assert not made.exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["config.pickle"]


@pytest.mark.slow
def test_a_checkpoint_folder_that_cannot_be_written_is_refused_before_training(an4_train, tmp_path):
    manifest = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("")  # a file where the folder should be
    result = train(tmp_path / "run", manifest, "model.hidden=32", "train.max_steps=1", check=False, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.output, result.output[-4000:]
    assert f"{tmp_path / 'run' / 'checkpoints'} is not a folder: the run writes its checkpoints there" in result.output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before training


@pytest.mark.slow
def test_a_full_disk_under_the_run_records_is_one_line_and_exit_2(an4_train, tmp_path):
    manifest = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "jobs.jsonl").symlink_to("/dev/full")  # every write there: "No space left on device"
    result = train(tmp_path / "run", manifest, "model.hidden=32", "train.max_steps=1", check=False, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.output, result.output[-4000:]
    assert f"cannot write {tmp_path / 'run' / 'jobs.jsonl'}: No space left on device; " in result.output, \
        result.output[-4000:]
    assert f" MiB free in {tmp_path / 'run'}; checkpoints are written whole or not at all" in result.output


@pytest.mark.slow
def test_a_log_file_the_disk_cannot_hold_is_said_once_and_the_run_goes_on(an4_train, tmp_path):
    """A disk that fills up refuses the log's lines first: logging printed a traceback of some 30 lines for each one,
    the trainer's own error line among them, while the run went on to its next checkpoint."""
    manifest = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "__main__.log").symlink_to("/dev/full")  # every write there: "No space left on device"
    result = train(run_dir, manifest, "model.hidden=32", "train.max_steps=1", timeout=300)
    assert "Logging error" not in result.output and "Traceback" not in result.output, result.output[-4000:]
    warning = (f"warning: cannot write the log file {run_dir / '__main__.log'} (No space left on device): the lines "
               "it cannot take are on the console only")
    assert result.stderr.splitlines().count(warning) == 1, result.stderr[-4000:]
    assert "stopped at step 1 (train.max_steps)" in result.stdout  # the console has the whole log
    assert (run_dir / "checkpoints" / "last.pt").is_file()


@pytest.mark.slow
def test_bad_input_is_skipped_named_and_counted(an4_train, tmp_path):
    short = [u for u in an4_train if u.duration < 2.5]
    good, spare = short[:8], short[8:11]  # spare: audio no other line lists, or its line would count as a repeat
    (tmp_path / "corrupt.flac").write_bytes(b"not audio at all" * 64)
    soundfile.write(tmp_path / "empty.wav", np.zeros(0, np.float32), 16000)
    soundfile.write(tmp_path / "nan.wav", np.full(16000, np.nan, np.float32), 16000, subtype="FLOAT")
    template = good[0]
    bad = [
        template.__class__(str(tmp_path / "corrupt.flac"), 1.0, "YES", "x"),
        template.__class__(str(tmp_path / "empty.wav"), 1.0, "NO", "x"),
        template.__class__(str(tmp_path / "nan.wav"), 1.0, "GO", "x"),
        template.__class__(spare[0].audio_filepath, spare[0].duration, "   ", "x"),  # empty transcript
        template.__class__(spare[1].audio_filepath, spare[1].duration, "NUMBER 42", "x"),  # digits: not in the alphabet
        template.__class__(spare[2].audio_filepath, 0.05, "A VERY LONG TRANSCRIPT FOR A TINY CLIP", "x"),
    ]
    manifest = write_slice(tmp_path / "mixed.jsonl", good + bad)
    result = train(tmp_path / "run", manifest, "model.hidden=32", "train.epochs=1", "train.global_batch_size=2")

    for name in ("corrupt.flac", "empty.wav", "nan.wav"):
        assert name in result.output, f"{name} not named"
    assert "empty transcript" in result.output and "characters" in result.output and "['2', '4']" in result.output
    assert "too long for stride" in result.output
    # Three unreadable files skipped at load time, counted in the epoch summary; training finished and evaluated.
    assert "skipped: 3 utterances unreadable" in result.output
    # The test set is the same manifest: its WER is over the readable part, and says so.
    _, epochs = read_metrics(tmp_path / "run")
    assert len(epochs) == 1 and epochs[0]["eval_unreadable"] == 3
    assert ("the test WER is over 8 of the test set's 14 utterances: left out 1 utterance (empty transcript), 1 "
            "utterance (characters outside the alphabet), 1 utterance (too long for stride), 3 utterances (unreadable)"
            in result.output), result.output[-3000:]
    best = str(tmp_path / "run" / "checkpoints" / "best.pt")
    result = run("trainer.evaluate", ["--checkpoint", best, "--manifest", str(manifest)])
    assert result.returncode == 0 and ("(8 utterances, " in result.output and "; left out: 1 utterance (empty "
                                       "transcript), 1 utterance (characters outside the alphabet), 1 utterance (too "
                                       "long for stride), 3 utterances (unreadable))" in result.output), (
        result.output[-2000:])
    unreadable_only = write_slice(tmp_path / "unreadable.jsonl", bad[:3])
    result = run("trainer.evaluate", ["--checkpoint", best, "--manifest", str(unreadable_only)])
    assert result.returncode == 1 and "none of the 3 utterances" in result.output, result.output[-2000:]


def test_test_audio_too_short_for_its_transcript_is_counted_under_that_reason(an4_train, tmp_path):
    """Audio whose manifest duration hides that it is too short for its transcript is found out when loaded: the
    epoch's warning counted it as unreadable, under the warning naming why. metrics.jsonl's eval_unreadable counts
    every test utterance left out when loaded, as it did."""
    good = write_slice(tmp_path / "good.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    (tmp_path / "corrupt.flac").write_bytes(b"not audio at all" * 64)
    soundfile.write(tmp_path / "short.wav", np.full(1, 0.1, np.float32), 16000)
    template = an4_train[0]
    test_set = write_slice(tmp_path / "test.jsonl", an4_train[:2] + [
        template.__class__(str(tmp_path / "corrupt.flac"), 1.0, "YES", "x"),
        template.__class__(str(tmp_path / "short.wav"), 1.0, "NO", "x"),
    ])
    result = train(tmp_path / "run", good, f"data.eval_manifest={test_set}", "model.hidden=32", "train.epochs=1",
                   "train.eval_batch_size=1", "train.progress_line_s=0")
    assert ("the test WER is over 2 of the test set's 4 utterances: left out 1 utterance (unreadable), 1 utterance "
            "(too long for stride)" in result.output), result.output[-3000:]
    # In batches of train.eval_batch_size, not of the training's 8: the evaluation took either, and no test could tell.
    assert "evaluating: batch 4 of 4" in result.output, result.output[-3000:]
    _, epochs = read_metrics(tmp_path / "run")
    assert epochs[0]["eval_unreadable"] == 2


def test_a_training_set_with_many_left_out_names_a_few_and_lists_every_one_in_the_run_directory(an4_train, tmp_path):
    """A punctuated corpus ("YES.") gave a warning for each utterance left out before training: thousands of lines
    for one of LibriSpeech's size. The log names the first 5 of a reason and counts the rest; skipped_train.jsonl in
    the run directory lists every one."""
    good = [u for u in an4_train if u.duration < 2.5][:8]
    punctuated = [good[0].__class__(str(tmp_path / f"said{number}.wav"), 1.0, "YES.", "x") for number in range(7)]
    training_set = write_slice(tmp_path / "train.jsonl", good + punctuated)
    result = train(tmp_path / "run", training_set, f"data.eval_manifest={write_slice(tmp_path / 'test.jsonl', good)}",
                   "model.hidden=32", "train.epochs=1", "train.global_batch_size=8")
    skipping = [line.split(" - ", 1)[1] for line in result.output.splitlines() if " - skipping " in line]
    assert [line.split(": ")[0] for line in skipping[:-1]] == [
        f"skipping {utterance.audio_filepath}" for utterance in punctuated[:5]], result.output[-3000:]
    assert skipping[-1] == ("skipping 2 more utterances (characters outside the alphabet); every one left out is "
                            f"listed in {tmp_path / 'run' / 'skipped_train.jsonl'}"), result.output[-3000:]
    listed = [json.loads(line) for line in (tmp_path / "run" / "skipped_train.jsonl").read_text().splitlines()]
    assert [entry["audio_filepath"] for entry in listed] == [utterance.audio_filepath for utterance in punctuated]
    assert not (tmp_path / "run" / "skipped_test.jsonl").exists()


@pytest.mark.slow
def test_a_job_that_leaves_the_run_directory_as_it_was_leaves_its_skip_lists_too(an4_train, tmp_path):
    """The lists were written as the corpus was read, before the resume's checks: a resume refused, or one with
    nothing to train (whose log says the run directory is left as it was), under another test set removed the run's
    skipped_test.jsonl, the list of what its recorded evaluations left out."""
    good = [u for u in an4_train if u.duration < 2.5][:8]
    unspellable = good[0].__class__(str(tmp_path / "said.wav"), 1.0, "YES.", "x")
    run_dir, training_set = tmp_path / "run", write_slice(tmp_path / "train.jsonl", good)
    common = ["model.hidden=32", "train.epochs=1", "train.global_batch_size=4"]
    test_set = write_slice(tmp_path / "test.jsonl", good + [unspellable])
    train(run_dir, training_set, *common, f"data.eval_manifest={test_set}")
    listed = (run_dir / "skipped_test.jsonl").read_text()
    assert json.loads(listed)["audio_filepath"] == unspellable.audio_filepath
    another_test_set = f"data.eval_manifest={write_slice(tmp_path / 'other.jsonl', good)}"
    refused = train(run_dir, training_set, *common, another_test_set, "train.resume=auto", "model.hidden=48",
                    check=False)
    assert refused.returncode == 2 and "model.hidden=32 there, 48 here" in refused.output, refused.output[-3000:]
    nothing = train(run_dir, training_set, *common, another_test_set, "train.resume=auto")
    assert "the run directory is left as it was" in nothing.output, nothing.output[-3000:]
    assert (run_dir / "skipped_test.jsonl").read_text() == listed


def test_training_audio_left_out_when_loaded_is_counted_by_reason_in_each_epochs_line(an4_train, tmp_path):
    """A corrupt file, audio too short for its transcript and audio longer than data.max_duration, each hidden by its
    manifest duration: the epoch's line counts each under its own reason, in evaluation's words, where it lumped them
    as 'unreadable or too long'. Each file is named once a run, not once an epoch."""
    (tmp_path / "corrupt.flac").write_bytes(b"not audio at all" * 64)
    soundfile.write(tmp_path / "short.wav", np.full(1, 0.1, np.float32), 16000)
    soundfile.write(tmp_path / "long.wav", np.random.default_rng(0).uniform(-0.1, 0.1, 5 * 16000).astype(np.float32),
                    16000)
    good = [u for u in an4_train if u.duration < 2.5][:8]
    template = good[0]
    training_set = write_slice(tmp_path / "train.jsonl", good + [
        template.__class__(str(tmp_path / name), 1.0, text, "x")
        for name, text in (("corrupt.flac", "YES"), ("short.wav", "NO"), ("long.wav", "GO"))
    ])
    result = train(tmp_path / "run", training_set, f"data.eval_manifest={write_slice(tmp_path / 'test.jsonl', good)}",
                   "model.hidden=32", "train.epochs=2", "train.global_batch_size=11", "data.max_duration=3.0")
    reasons = ("skipped: 1 utterance unreadable, 1 utterance too long for stride, 1 utterance longer than "
               "max_duration")
    assert result.output.count(reasons) == 2, result.output[-3000:]  # each epoch's line
    for name in ("corrupt.flac", "short.wav", "long.wav"):
        assert result.output.count(f"skipping {tmp_path / name}") == 1, result.output[-3000:]


def test_a_path_that_is_not_utf8_is_logged_to_the_console_and_the_log_file(tmp_path, monkeypatch):
    """A manifest in a folder named with the byte \\xff names its audio through that folder; the warning naming a
    missing one reaches the console and the log file, written as \\xff as the tools name it (it was \\udcff, which
    names no byte), where UTF-8 output refuses the name (a locale such as en_US.UTF-8, or PYTHONIOENCODING, makes its
    errors strict)."""
    monkeypatch.setenv("PYTHONIOENCODING", "utf-8")
    corpus = Path(os.fsdecode(bytes(tmp_path) + b"/corpus\xff"))
    corpus.mkdir()
    noise = np.random.default_rng(0).uniform(-0.1, 0.1, 16000).astype(np.float32)
    with open(corpus / "train.jsonl", "w", encoding="utf-8") as manifest:
        for index in range(9):  # the last one missing
            if index < 8:
                soundfile.write(os.fsencode(corpus / f"{index}.wav"), noise, 16000)  # soundfile encodes a str strictly
            manifest.write(json.dumps({"audio_filepath": f"{index}.wav", "duration": 1.0, "text": "YES"}) + "\n")
    run_dir = tmp_path / "run"
    result = train(run_dir, f"'{corpus / 'train.jsonl'}'", "model.hidden=32", "train.max_steps=1",
                   "train.epochs=1")
    warning = "corpus\\xff/8.wav: no such audio file"
    assert "Logging error" not in result.output and warning in result.stdout, result.output[-4000:]
    assert warning in (run_dir / "__main__.log").read_text()


@pytest.mark.slow
def test_an_epoch_that_could_read_none_of_its_audio_ends_the_run(an4_train, tmp_path):
    """A manifest of relative audio paths, reached through a symlink in another folder: its paths are taken relative
    to the symlink's folder, where no audio is, so every step is skipped. The run ends at the epoch's end, naming
    why, rather than evaluate and exit 0 as if it had trained."""
    corpus = tmp_path / "corpus"
    (corpus / "wav").mkdir(parents=True)
    utterances = [u for u in an4_train if u.duration < 2.5][:8]
    for utterance in utterances:
        shutil.copy(utterance.audio_filepath, corpus / "wav")
    with open(corpus / "train.jsonl", "w") as manifest:
        for utterance in utterances:
            manifest.write(json.dumps({"audio_filepath": f"wav/{Path(utterance.audio_filepath).name}",
                                       "duration": utterance.duration, "text": utterance.text}) + "\n")
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "train.jsonl").symlink_to(corpus / "train.jsonl")
    arguments = train_arguments(tmp_path / "run", tmp_path / "links" / "train.jsonl", "model.hidden=32",
                                "train.global_batch_size=4", "train.epochs=2")
    arguments[2] = f"data.eval_manifest={corpus / 'train.jsonl'}"
    # Nor is anything saved where a step limit or a periodic checkpoint comes before the epoch's end.
    for limit, skipped in (([], "its 2 steps was skipped (8 utterances unreadable, 2 steps skipped"),
                           (["train.max_steps=1"], "its 1 step was skipped (4 utterances unreadable, 1 step"),
                           (["train.checkpoint_every_steps=1"], "its 1 step was skipped (4 utterances unreadable")):
        result = run("trainer", [*arguments, *limit], timeout=300)
        assert result.returncode == 2 and "Traceback" not in result.output, result.output[-4000:]
        assert f"{tmp_path / 'links' / 'wav'}/" in result.output and "no such audio file" in result.output
        assert f"epoch 1 trained nothing: each of {skipped}" in result.output, result.output[-4000:]
        assert "; a manifest's relative audio paths are taken relative to its own folder" in result.output
        assert not (tmp_path / "run" / "checkpoints" / "last.pt").exists() and "final test WER" not in result.output


@pytest.mark.slow
def test_a_run_whose_weights_diverge_stops_at_its_evaluation_saving_nothing_of_them(an4_train, tmp_path):
    manifest = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    result = train(tmp_path / "run", manifest, "model.hidden=32", "train.epochs=1", "train.global_batch_size=2",
                   "optim.lr=1e38", "optim.warmup_steps=0", check=False)
    assert result.returncode == 2 and "Traceback" not in result.output, result.output[-2000:]
    assert "evaluating after epoch 1 (step 4): log_probs hold NaN" in result.output, result.output[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.parametrize("limit", ["train.checkpoint_every_steps=2", "train.max_steps=2"])
def test_a_model_whose_weights_diverged_is_not_saved_inside_an_epoch_either(an4_train, tmp_path, limit):
    # Step 1 trains at an absurd rate, which leaves weights that overflow; step 2 is then skipped, and the
    # checkpoint after it would hold a model that resumes only to skip every step and evaluates nowhere.
    manifest = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    result = train(tmp_path / "run", manifest, "model.hidden=32", "train.epochs=1", "train.global_batch_size=2",
                   "optim.lr=1e38", "optim.warmup_steps=0", limit, check=False)
    assert result.returncode == 2 and "Traceback" not in result.output, result.output[-2000:]
    assert "after step 2 the model holds values that are not finite" in result.output, result.output[-2000:]
    assert not (tmp_path / "run" / "checkpoints" / "last.pt").exists()


# `python -m trainer` whose CTC loss is NaN at the training steps POISONED_STEPS names (this process's count), as one
# batch's overflow under bf16 gives: a fake for what a CPU run cannot make happen on its own. It sends itself SIGTERM
# during the step SIGTERM_AT_STEP names, where given.
POISONED_TRAINER = """import os, runpy, signal, sys
import torch
import torch.nn.functional as F
poisoned = {int(step) for step in os.environ["POISONED_STEPS"].split(",")}
sigterm_at_step = int(os.environ.get("SIGTERM_AT_STEP", 0))
ctc_loss, steps = F.ctc_loss, [0]
def poisoned_ctc_loss(*args, **kwargs):
    loss = ctc_loss(*args, **kwargs)
    if torch.is_grad_enabled():  # a training step, not an evaluation
        steps[0] += 1
        loss = loss * float("nan") if steps[0] in poisoned else loss
        if steps[0] == sigterm_at_step:
            os.kill(os.getpid(), signal.SIGTERM)
    return loss
F.ctc_loss = poisoned_ctc_loss
sys.argv[0] = "trainer"
runpy.run_module("trainer", run_name="__main__")
"""


def train_poisoned(tmp_path, run_dir, manifest, poisoned_steps: str, *overrides,
                   sigterm_at_step: int = 0) -> tuple[int, str]:
    """A run of POISONED_TRAINER with POISONED_STEPS=`poisoned_steps` (and SIGTERM_AT_STEP): its exit code and
    output."""
    wrapper = tmp_path / "poisoned_trainer.py"
    wrapper.write_text(POISONED_TRAINER)
    result = subprocess.run(
        [sys.executable, str(wrapper), *train_arguments(run_dir, manifest, *overrides)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "POISONED_STEPS": poisoned_steps, "SIGTERM_AT_STEP": str(sigterm_at_step),
             "PYTHONPATH": str(REPO_ROOT), "HYDRA_FULL_ERROR": "0"},
    )
    return result.returncode, result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("limit", ["train.checkpoint_every_steps=3", "train.max_steps=3"])
def test_a_step_whose_loss_is_not_finite_is_skipped_though_a_checkpoint_follows_it(an4_train, tmp_path, limit):
    """One such step at an epoch's start, then a checkpoint inside the epoch (or a stop): the run goes on from it, as
    from any skipped step, rather than refuse it as an epoch that trained nothing, which a resume would meet again."""
    manifest = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    # 2 steps an epoch: step 3 is epoch 2's first.
    returncode, output = train_poisoned(tmp_path, tmp_path / "run", manifest, "3", "model.hidden=32",
                                        "train.global_batch_size=4", "train.epochs=2", limit)
    assert returncode == 0 and "trained nothing" not in output, output[-3000:]
    assert "step 3 skipped: non-finite loss or gradient" in output, output[-3000:]
    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert saved["train_state"]["step"] == (3 if "max_steps" in limit else 4)


@pytest.mark.slow
def test_a_resumed_jobs_non_finite_first_step_in_epoch_1_is_skipped_though_a_stop_follows_it(an4_train, tmp_path):
    """As above inside epoch 1, which trained before this job's resume: its steps from before count as an earlier
    epoch's would. A run that took only epochs before this one for training before (epoch > 0) passed every test, and
    refused this job as an epoch that trained nothing, which every resume would meet again."""
    manifest = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:16])
    common = ["model.hidden=32", "train.global_batch_size=4", "train.epochs=1", "train.resume=auto"]  # 4 steps
    train(tmp_path / "run", manifest, *common, "train.max_steps=1")
    returncode, output = train_poisoned(tmp_path, tmp_path / "run", manifest, "1", *common, "train.max_steps=2")
    assert returncode == 0 and "trained nothing" not in output, output[-3000:]
    assert "step 2 skipped: non-finite loss or gradient" in output, output[-3000:]
    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert saved["train_state"]["step"] == 2


@pytest.mark.slow
def test_a_stop_signal_after_a_first_step_whose_loss_is_not_finite_stops_the_run_for_its_resume(an4_train, tmp_path):
    """A first step that overflowed (fp16's first loss scales often do), then SIGTERM: the run stops as on any signal,
    exit code 143 and last.pt for the resume, which goes on from the skipped step. It was refused as an epoch that
    trained nothing, exit code 2, which a scheduler's requeue on the signal's exit code took for a failure."""
    manifest = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:16])
    common = ["model.hidden=32", "train.global_batch_size=4", "train.epochs=1"]  # 4 steps
    returncode, output = train_poisoned(tmp_path, tmp_path / "run", manifest, "1", *common, sigterm_at_step=1)
    assert returncode == 128 + signal.SIGTERM and "trained nothing" not in output, output[-3000:]
    assert "step 1 skipped: non-finite loss or gradient" in output, output[-3000:]
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["train_state"]["step"] == 1


@pytest.mark.slow
def test_an_epoch_after_the_first_whose_every_loss_is_not_finite_ends_the_run_at_its_end(an4_train, tmp_path):
    """Steps skipped for a non-finite loss pass at a checkpoint inside an epoch of a run that trained before, not at an
    epoch's end: a run whose second epoch skipped every step was evaluated and saved as if it had trained (a mutant
    that let them pass there too passed every test)."""
    manifest = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    # 2 steps an epoch: epoch 2 is steps 3 and 4.
    returncode, output = train_poisoned(tmp_path, tmp_path / "run", manifest, "3,4", "model.hidden=32",
                                        "train.global_batch_size=4", "train.epochs=2")
    assert returncode == 2, output[-3000:]
    assert "epoch 2 trained nothing: each of its 2 steps was skipped" in output, output[-3000:]
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["train_state"]["step"] == 2


@pytest.mark.slow
def test_a_run_resumed_on_another_test_set_chooses_best_pt_among_the_evaluations_on_it(an4_train, tmp_path):
    """And keeps the best.pt of the first test set beside it, which the first evaluation on the other replaced for
    good; a resume back on the first test set makes that one best.pt again, keeping the other's."""
    utterances = [u for u in an4_train if u.duration < 2.5]
    manifest = write_slice(tmp_path / "slice.jsonl", utterances[:8])
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    common = ["model.hidden=32", "train.global_batch_size=4"]  # 2 steps an epoch
    train(run_dir, manifest, *common, "train.epochs=1")
    # As if epoch 1 had scored 0 % on its test set: no WER on another set could beat it, nor should it have to.
    last = checkpoints / "last.pt"
    saved = torch.load(last, weights_only=True)
    saved["train_state"]["best_wer"] = 0.0
    torch.save(saved, last)

    def recorded(name):
        kept = torch.load(checkpoints / name, weights_only=True)
        return kept["train_state"]["step"], kept["train_state"]["best_wer"] > 0, kept["test_set"]

    first = saved["test_set"]
    kept_first = f"best-{first.split()[-1]}.pt"
    other_test_set = write_slice(tmp_path / "other.jsonl", utterances[8:16])
    result = train(run_dir, manifest, *common, "train.epochs=2", "train.resume=auto",
                   f"data.eval_manifest={other_test_set}")
    assert "the test set is not the one" in result.output, result.output[-3000:]
    assert (checkpoints / kept_first).is_file(), sorted(path.name for path in checkpoints.iterdir())
    assert recorded(kept_first) == (2, False, first)
    assert f"best.pt, the best on its test set, kept as {checkpoints / kept_first}" in result.output
    other = recorded("best.pt")[2]
    assert recorded("best.pt") == (4, True, other) and other != first

    result = train(run_dir, manifest, *common, "train.epochs=3", "train.resume=auto")  # back on the first test set
    kept_other = f"best-{other.split()[-1]}.pt"
    assert f"{checkpoints / kept_first}, the best on this test set, is {checkpoints / 'best.pt'} again" in result.output
    assert recorded("best.pt") == (2, False, first)  # its 0 % unbeaten
    assert recorded(kept_other) == (4, True, other)
    assert sorted(path.name for path in checkpoints.iterdir()) == sorted(["best.pt", "last.pt", kept_other])


@pytest.mark.slow
def test_a_run_moved_to_another_test_set_and_back_before_an_evaluation_there_keeps_no_second_name_for_best_pt(
        an4_train, tmp_path):
    """The job on the other test set kept best.pt as best-DIGEST.pt, a link, and replaced neither (its evaluation
    decoded nothing); back on the first set, that name stayed beside best.pt, an alias that best.pt's next evaluation
    would leave holding an older model that looked like the best on its test set."""
    utterances = [u for u in an4_train if u.duration < 2.5]
    manifest = write_slice(tmp_path / "slice.jsonl", utterances[:8])
    checkpoints = tmp_path / "run" / "checkpoints"
    common = ["model.hidden=32", "train.global_batch_size=4"]  # 2 steps an epoch
    train(tmp_path / "run", manifest, *common, "train.epochs=1")
    kept = checkpoints / f"best-{torch.load(checkpoints / 'best.pt', weights_only=True)['test_set'].split()[-1]}.pt"
    missing = [utterances[0].__class__(str(tmp_path / f"gone{i}.flac"), 1.0, "YES", "x") for i in range(3)]
    unreadable = write_slice(tmp_path / "unreadable.jsonl", missing)
    train(tmp_path / "run", manifest, *common, "train.epochs=2", "train.resume=auto",
          f"data.eval_manifest={unreadable}")
    assert kept.samefile(checkpoints / "best.pt")
    result = train(tmp_path / "run", manifest, *common, "train.epochs=3", "train.resume=auto")  # back on the first
    assert f"{kept} removed: {checkpoints / 'best.pt'} is the best on this test set again" in result.output
    assert sorted(path.name for path in checkpoints.iterdir()) == ["best.pt", "last.pt"]


@pytest.mark.slow
def test_a_resume_keeps_a_better_best_pt_kept_for_its_test_set_over_a_worse_best_pt_beside_it(an4_train, tmp_path):
    """A run directory left by a resume before 2026-12-05 (best.pt deleted by hand on another test set, the first
    evaluation back, however worse, became best.pt beside the kept best-DIGEST.pt): the next resume beat best.pt's
    evaluation and removed the better kept one as an alias of best.pt."""
    manifest = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    checkpoints = tmp_path / "run" / "checkpoints"
    common = ["model.hidden=32", "train.global_batch_size=4"]  # 2 steps an epoch
    train(tmp_path / "run", manifest, *common, "train.epochs=1")
    saved = torch.load(checkpoints / "best.pt", weights_only=True)
    assert saved["train_state"]["best_wer"] > 0
    # As if the kept one had scored 0 % on the test set best.pt is also of: no epoch can beat it.
    saved["train_state"]["best_wer"] = 0.0
    kept = checkpoints / f"best-{saved['test_set'].split()[-1]}.pt"
    torch.save(saved, kept)
    result = train(tmp_path / "run", manifest, *common, "train.epochs=2", "train.resume=auto")
    assert f"{kept} scores better on this test set than {checkpoints / 'best.pt'} (WER 0.00%" in result.output
    assert f"{kept}, the best on this test set, is {checkpoints / 'best.pt'} again" in result.output
    assert sorted(path.name for path in checkpoints.iterdir()) == ["best.pt", "last.pt"]
    assert torch.load(checkpoints / "best.pt", weights_only=True)["train_state"]["best_wer"] == 0.0


def test_a_resume_from_a_copy_of_an_earlier_checkpoint_keeps_a_better_best_pt(an4_train, tmp_path):
    """A copy of the run's checkpoint outside checkpoints/ (or an earlier one) resumed: best.pt was chosen afresh, so
    the next epoch, worse than best.pt's, replaced the best model. best.pt's own evaluation is the one to beat."""
    manifest = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    run_dir, copy = tmp_path / "run", tmp_path / "copy.pt"
    common = ["model.hidden=32", "train.global_batch_size=4"]  # 2 steps an epoch
    train(run_dir, manifest, *common, "train.epochs=1")
    shutil.copy(run_dir / "checkpoints" / "last.pt", copy)
    # As if best.pt had scored 0 % (a later epoch of the run, which the copy precedes): no epoch can beat it.
    best = run_dir / "checkpoints" / "best.pt"
    saved = torch.load(best, weights_only=True)
    saved["train_state"]["best_wer"] = 0.0
    torch.save(saved, tmp_path / "best.pt")
    os.replace(tmp_path / "best.pt", best)  # not into the file last.pt shares
    train(run_dir, manifest, *common, "train.epochs=2", f"train.resume={copy}")
    kept = torch.load(best, weights_only=True)["train_state"]
    assert (kept["step"], kept["best_wer"]) == (2, 0.0), kept
    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["train_state"]
    assert (last["step"], last["best_wer"]) == (4, 0.0), last


def sweep(cwd, manifest, *overrides, timeout=900):
    """`python -m trainer -m` in `cwd`, whose runs/ then holds the jobs where the default config puts them: 8
    utterances in global batches of 4, two steps an epoch."""
    data = ["data=manifest", f"data.train_manifests=[{manifest}]", f"data.eval_manifest={manifest}"]
    return run("trainer", ["-m", *data, *TINY, "model.hidden=16", "model.depth=1", "train.global_batch_size=4",
                           *overrides], timeout, cwd=cwd)


def sweep_jobs(sweep_dir, key="model.cell") -> dict:
    """{key's value: job folder} of the sweep's jobs that ran (wrote config.yaml)."""
    folders = [path.parent for path in sweep_dir.glob("*/config.yaml")]
    return {OmegaConf.select(OmegaConf.load(folder / "config.yaml"), key): folder for folder in folders}


@pytest.mark.slow
def test_a_sweep_run_again_with_resume_auto_continues_each_job_in_its_own_folder(an4_train, tmp_path):
    manifest = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    first = sweep(tmp_path, manifest, "run_name=sw", "model.cell=relu,gru", "train.max_steps=1")
    assert first.returncode == 0, first.output[-4000:]
    jobs = sweep_jobs(tmp_path / "runs" / "sw")
    assert sorted(jobs) == ["gru", "relu"] and not (tmp_path / "multirun").exists(), first.output[-4000:]
    for folder in jobs.values():
        # Named by its overrides, less those that do not change what it trains (run again below: a higher max_steps).
        assert folder.parent == tmp_path / "runs" / "sw" and "train.max_steps" not in folder.name, folder
        # Its run_name as a launch-script user sets it too: the stop line of a run says so.
        hint = ("the same sweep (its -m and overrides; train.max_steps and train.epochs may change) with "
                "train.resume=auto under the same run_name (RUN_NAME in the launch scripts), sw, but a higher "
                "train.max_steps (or null) continues it from "
                f"{folder / 'checkpoints' / 'last.pt'}")  # the same train.max_steps again trains nothing
        assert hint in first.output

    # With another evaluation batch, which a resume may change: it named the jobs' folders, so each started afresh.
    again = sweep(tmp_path, manifest, "model.cell=relu,gru", "train.max_steps=2", "train.resume=auto", "run_name=sw",
                  "train.eval_batch_size=3")
    assert again.returncode == 0, again.output[-4000:]
    assert sweep_jobs(tmp_path / "runs" / "sw") == jobs  # no new folder
    for folder in jobs.values():
        assert f"resumed from {folder / 'checkpoints' / 'last.pt'} at step 1 (step 1 of epoch 1)" in again.output
        assert sorted(read_metrics(folder)[0]) == [1, 2]
        records = [json.loads(line) for line in (folder / "jobs.jsonl").read_text().splitlines()]
        assert [record["from_step"] for record in records] == [0, 1]


@pytest.mark.slow
def test_a_failing_sweep_job_leaves_the_jobs_after_it_to_run_and_the_sweep_ends_non_zero(an4_train, tmp_path):
    manifest = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    # Job 1 keeps no utterance: a failure of its own, which checking the sweep's configs first does not catch.
    result = sweep(tmp_path, manifest, "run_name=bad", "data.max_duration=20,0.01,10", "train.max_steps=1")
    assert result.output.count("stopped at step 1 (train.max_steps), before this job's first evaluation") == 2, (
        result.output[-4000:])  # job 2 ran
    assert result.returncode == 2, result.output[-4000:]  # a user error, as a run's would be
    assert sorted(sweep_jobs(tmp_path / "runs" / "bad", "data.max_duration")) == [10, 20], result.output[-4000:]
    bogus = f"no usable utterance in {manifest}: skipped 8 utterances (longer than max_duration)"
    assert f"error on rank 0: {bogus}" in result.output and "Traceback" not in result.output
    assert "sweep job 1 failed; the jobs after it still run" in result.output
    # The sweep names the failed job, and where its log is, at the end; nothing about a stack trace.
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"failed: sweep job 1 ({tmp_path / 'runs' / 'bad'}/") and last_line.endswith(
        f"): {bogus}"), result.stderr[-2000:]
    folder = Path(last_line.removeprefix("failed: sweep job 1 (").removesuffix(f"): {bogus}"))
    assert (folder / "__main__.log").read_text().count(bogus) == 1
    assert folder not in sweep_jobs(folder.parent, "data.max_duration").values()
    assert "HYDRA_FULL_ERROR" not in result.output

    # A sweep over a key that job folder names leave out would put two jobs in one folder: the sweep is refused before
    # its first job trains (it trained, then the second job was refused).
    result = sweep(tmp_path, manifest, "run_name=same", "train.max_steps=1,2")
    assert result.returncode == 2 and "is job 0's folder too" in result.output, result.output[-4000:]
    assert not (tmp_path / "runs" / "same").exists()


@pytest.mark.slow
def test_a_sweep_stopped_by_a_signal_still_names_the_jobs_that_failed_before(an4_train, tmp_path):
    manifest = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:8])
    data = ["data=manifest", f"data.train_manifests=[{manifest}]", f"data.eval_manifest={manifest}"]
    job = subprocess.Popen(
        [sys.executable, "-m", "trainer", "-m", *data, *TINY, "model.hidden=16", "model.depth=1",
         "train.global_batch_size=4", "train.epochs=1000", "run_name=stopped", "data.max_duration=0.01,20"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not list((tmp_path / "runs" / "stopped").glob("*/checkpoints/last.pt")):  # the second job trains
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-4000:]
            time.sleep(0.1)
        job.send_signal(signal.SIGUSR1)
        stderr = job.communicate(timeout=300)[1]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 128 + signal.SIGUSR1, stderr[-4000:]
    assert "failed: sweep job 0 (" in stderr and "no usable utterance in" in stderr, stderr[-4000:]


@pytest.mark.parametrize("overrides, returncode, message", [
    ([], 2, "error on rank 0: manifest TMP/absent.jsonl does not exist"),  # the manifest the arguments name
    (["train.checkpoint_every_steps=0"], 2, "train.checkpoint_every_steps must be a positive integer or null, not 0"),
    (["train.grad_clip_norm=-1"], 2, "train.grad_clip_norm must be a positive number, not -1"),
    (["train.cuda_graphs=true"], 2,  # experiment=deep100 device=cpu too: it named no way on
     "train.cuda_graphs=true needs a CUDA device, this run is on cpu (train.cuda_graphs=false runs it without them)"),
    (["data.an4_source=NO_AN4"], 2,  # a corpus folder that is not there
     "error on rank 0: folder NO_AN4 does not exist (data.an4_source, AN4's folder; PRNN_AN4 sets its default)"),
    # A checkpoint that is not there, named before the data are read (the manifest here is missing too).
    (["train.resume=NO_AN4/last.pt"], 2, "checkpoint not found: NO_AN4/last.pt (train.resume)"),
    (["train.resume=TMP/" + "x" * 300], 2,  # a name past the file system's 255 bytes ended in a traceback
     "cannot read checkpoint TMP/" + "x" * 300 + ": File name too long (train.resume)"),
    (["data.train_manifests=[TMP/" + "x" * 300 + "]"], 2,  # a manifest that cannot be opened ended in a traceback
     "error on rank 0: cannot open TMP/" + "x" * 300 + ": File name too long"),
    (["model.hidden=${nope}"], 2, "error: model.hidden: Interpolation key 'nope' not found"),  # 3 lines
    # Named under its group (it was 'hop_ms=1000 ...'), and before the corpus is read (preparing it takes minutes).
    (["data.features.hop_ms=1000", "data.an4_source=NO_AN4"], 2,
     "error: data.features: hop_ms=1000 is longer than window_ms=20"),
    # Over 13 mel bands the default mask width of 15 zeroed every feature of a quarter of the training utterances.
    (["data.features.n_mels=13", "data.augment.enabled=true", "data.an4_source=NO_AN4"], 2,
     "error: data.augment.masks.freq_mask=15 must be at most the 13 features of a frame "
     "(data.features.kind=mel): a wider mask can zero them all"),
    (["model.depht=3"], 2, "error: unknown config key model.depht (did you mean model.depth?)"),  # Hydra refused it
    # A quoted shell variable that is unset but for a space: taken as a relative folder named " ".
    (["data.an4_source=' '"], 2, "error: data.an4_source must be null or AN4's folder (PRNN_AN4 sets its "
                                  "default), not ' '"),
    (["data.manifest_dir=' '"], 2, "error: data.manifest_dir must be a folder's path, not ' '"),
])
def test_a_user_error_is_one_clear_error_before_training(tmp_path, overrides, returncode, message):
    overrides = [override.replace("NO_AN4", str(tmp_path / "no_an4")).replace("TMP", str(tmp_path))
                 for override in overrides]
    result = train(tmp_path / "run", tmp_path / "absent.jsonl", *overrides, check=False, timeout=300)
    assert result.returncode == returncode, result.output[-2000:]
    # The error's own line: the config the trainer logs first names the same paths.
    message = message.replace("NO_AN4", str(tmp_path / "no_an4")).replace("TMP", str(tmp_path))
    assert any(line.endswith(message) or line.startswith(message) for line in result.output.splitlines()), (
        result.output[-2000:])
    assert "Traceback" not in result.output


def test_an4_with_no_usable_audio_is_one_line_naming_its_fileids_before_training(tmp_path):
    """AN4's etc/ files without their audio (wav/ not unpacked): the run wrote manifests of 0 bytes from them, then
    refused those as empty, which did not say why."""
    source = tmp_path / "an4"
    (source / "etc").mkdir(parents=True)
    for split in ("train", "test"):
        (source / "etc" / f"an4_{split}.fileids").write_text("an4_clstk/fash/an251-fash-b\n")
        (source / "etc" / f"an4_{split}.transcription").write_text("<s> YES </s> (an251-fash-b)\n")
    manifests = tmp_path / "manifests"
    result = run("trainer", ["data=an4", f"data.an4_source={source}", f"data.manifest_dir={manifests}",
                             f"hydra.run.dir={tmp_path / 'run'}", *TINY], timeout=300)
    assert result.returncode == 2, result.output[-2000:]
    assert f"skipping {source}/wav/an4_clstk/fash/an251-fash-b: no .flac / .wav / .sph file" in result.output
    assert result.output.rstrip().endswith(f"error on rank 0: no usable utterance in {source}/etc/an4_train.fileids: "
                                           "skipped 1 utterance (no audio file)"), result.output[-2000:]
    assert not manifests.exists() or list(manifests.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the experiment runs")
def test_a_gpu_experiment_on_a_cpu_says_which_experiment_runs_there(tmp_path):
    # It said only "device=cuda was asked for but no CUDA GPU is visible", which the user had not asked for by name.
    result = run("trainer", ["experiment=an4_gpu", f"hydra.run.dir={tmp_path / 'run'}"], timeout=300, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.output, result.output[-2000:]
    assert result.output.rstrip().endswith(
        "error on rank 0: device=cuda (experiment=an4_gpu and deep100 set it) was asked for, but no CUDA GPU is "
        "visible: on a CPU, train experiment=cpu_demo, or set device=cpu"), result.output[-2000:]


GRAPHED_ON_A_GPU = ["device=cuda", "model.backend=persistent", "train.amp=bf16", "data.features.kind=spectrogram",
                    "train.cuda_graphs=true", "train.num_workers=2", "train.global_batch_size=32", "train.epochs=2"]


@pytest.mark.cuda
def test_graphed_training_captures_each_length_while_the_loader_works(an4_train, tmp_path):
    # Batches of 32 real utterances from two loader processes, shortest first: each new padded length is captured
    # while the loader prepares the next batches, which broke every capture after the first when batches were pinned.
    utterances = write_slice(tmp_path / "slice.jsonl", an4_train[:96])
    result = train(tmp_path / "run", utterances, *GRAPHED_ON_A_GPU)
    assert "recurrent layers on the persistent kernels: 32 utterances a rank, bf16" in result.output
    assert result.output.count("capturing CUDA graphs") >= 2, result.output[-4000:]
    steps, epochs = read_metrics(tmp_path / "run")
    assert sorted(steps) == list(range(1, 7)) and all(math.isfinite(loss) for loss in steps.values())
    assert [line["epoch"] for line in epochs] == [1, 2]
    # Each epoch logs the most GPU memory its training and evaluation held.
    assert all(0 < line["peak_gpu_allocated_gib"] <= line["peak_gpu_reserved_gib"] < 200 for line in epochs), epochs
    assert result.output.count("GiB reserved") == 2, result.output[-4000:]


def test_persistent_backend_it_cannot_run_is_one_clear_error_before_training(an4_source, an4_train, tmp_path):
    """Refused before the corpus is prepared and read: that took minutes for a large one, to no use."""
    utterances = write_slice(tmp_path / "slice.jsonl", an4_train[:8])
    manifests = tmp_path / "manifests"
    result = train(tmp_path / "run", utterances, "model.backend=persistent", f"data.an4_source={an4_source}",
                   f"data.manifest_dir={manifests}", check=False, timeout=300)
    assert result.returncode == 2
    # The batch is not why: the message leads with the setting that is.
    assert "model.backend=persistent: prnn_kernels.GRU: backend='persistent' cannot run: needs a CUDA GPU" in (
        result.output), result.output[-2000:]
    assert "utterances a rank" not in result.output, result.output[-2000:]
    assert "parameters;" not in result.output and "Traceback" not in result.output
    assert not manifests.exists() and "utterances from" not in result.output, result.output[-2000:]


@pytest.mark.parametrize("batch_slice, refused", [(None, "(40 utterances a rank): "),
                                                   (36, "(40 utterances a rank, in slices of model.batch_slice=36): ")])
def test_a_batch_the_persistent_kernels_refuse_names_the_setting_that_gives_it(an4_train, tmp_path, batch_slice,
                                                                               refused):
    # The kernels take at most 32 utterances; their size check comes before the GPU's, so a CPU reaches it too, under
    # device=auto: device=cpu is refused with the config, for want of a GPU whatever the batch.
    utterances = write_slice(tmp_path / "slice.jsonl", an4_train[:40])
    result = train(tmp_path / "run", utterances, "model.backend=persistent", "train.global_batch_size=40",
                   "device=auto", f"model.batch_slice={'null' if batch_slice is None else batch_slice}", check=False,
                   timeout=300)
    assert result.returncode == 2
    expected = (f"train.global_batch_size=40 {refused}prnn_kernels.GRU: backend='persistent' cannot run: batch size "
                f"{batch_slice or 40} is out of range (1..32")
    assert expected in result.output, result.output[-2000:]
    assert "parameters;" not in result.output and "Traceback" not in result.output


def test_a_test_set_none_of_which_can_be_read_gives_no_wer_and_valid_json(an4_train, tmp_path):
    utterances = write_slice(tmp_path / "train.jsonl", an4_train[:8])
    missing = [an4_train[0].__class__(str(tmp_path / f"gone{i}.flac"), 1.0, "YES", "x") for i in range(3)]
    test_set = write_slice(tmp_path / "test.jsonl", missing)
    result = train(tmp_path / "run", utterances, f"data.eval_manifest={test_set}", "train.epochs=1")
    _, epochs = read_metrics(tmp_path / "run")  # strict JSON: NaN would not parse
    assert epochs[0]["eval_wer"] is None and epochs[0]["eval_cer"] is None and epochs[0]["eval_unreadable"] == 3
    assert "none of the test set's 3 utterances could be decoded" in result.output, result.output[-3000:]
    assert "; no test WER" in result.output and "nan%" not in result.output, result.output[-3000:]
    assert "final test WER and CER none: no test utterance could be decoded  (epoch 1)" in result.stdout, result.stdout
    assert not (tmp_path / "run" / "checkpoints" / "best.pt").exists()


@pytest.mark.parametrize("size", ["model.hidden=300000", "model.conv_channels=100000"])
def test_a_model_larger_than_the_devices_memory_is_one_clear_error_before_allocating_it(an4_source, an4_train, tmp_path,
                                                                                       size):
    """Refused before any rank builds its model (whose memory another rank's check would count out), so before the
    corpus is prepared, which ends in the ranks' barrier."""
    utterances = write_slice(tmp_path / "slice.jsonl", an4_train[:8])
    manifests = tmp_path / "manifests"
    result = train(tmp_path / "run", utterances, size, f"data.an4_source={an4_source}",
                   f"data.manifest_dir={manifests}", check=False, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.output, result.output[-2000:]
    assert not manifests.exists(), result.output[-2000:]
    assert size in result.output and "more than the" in result.output and " GiB cpu has for it" in result.output, (
        result.output[-2000:])


@pytest.mark.cuda
@pytest.mark.parametrize("overrides, refusal", [
    (["model.backend=cudnn", "train.cuda_graphs=true"],
     "train.cuda_graphs=true cannot run with model.backend=cudnn, whose packed sequences need their lengths on the "
     "host"),
    (["model.backend=persistent", "train.eval_batch_size=64"], "train.eval_batch_size=64 (64 utterances a rank): "
     "prnn_kernels.GRU: backend='persistent' cannot run: batch size 64 is out of range"),
])
def test_a_gpu_setting_that_cannot_run_ends_the_job_before_training(an4_train, tmp_path, overrides, refusal):
    utterances = write_slice(tmp_path / "slice.jsonl", an4_train[:8])
    result = train(tmp_path / "run", utterances, "device=cuda", *overrides, check=False, timeout=300)
    assert result.returncode == 2 and refusal in result.output, result.output[-2000:]
    assert "epoch 1:" not in result.output and "Traceback" not in result.output, result.output[-2000:]
    assert not (tmp_path / "run" / "config.yaml").exists()


