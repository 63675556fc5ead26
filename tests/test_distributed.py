"""Data-parallel training over MPI: two ranks train exactly as one process does at the same global batch, on CPU
(gloo) and, where two GPUs are visible, on GPUs (NCCL, persistent kernels, eager and replayed from CUDA graphs); a rank
that raises ends the whole job with its message, one killed ends it too, and so does one whose data-loading worker is
stuck or killed, saying so; benchmarks.scaling and benchmarks.scaling_model run.

Every job runs under mpiexec (MPICH, from the `test` extra) in its own session and under a timeout, so a hang fails
its test, with the job killed, instead of stalling CI.
"""
import contextlib
import json
import math
import os
import re
import shlex
import signal
import shutil
import socket
import subprocess
import sys
import time
import textwrap
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from benchmarks import scaling, scaling_model
from conftest import (
    MPIEXEC, REPO_ROOT, data_loading_workers, find_an4, needs_mpiexec, running, wait_for_file, wait_for_text,
)
from data.dataset import Sample, Unusable, collate
from data.prepare import prepare_an4
from data.text import encode
from trainer import build, distributed, launch_ranks
from trainer.step import train_step

# One thread per rank: two ranks share CI's two cores. The OMPI_* variables let OpenMPI's mpiexec run as root too.
# NVIDIA_TF32_OVERRIDE=0 keeps cuDNN's convolutions in fp32 on GPUs: TF32 rounds differently at each batch size.
JOB_ENV = {
    **os.environ, "OMP_NUM_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "NVIDIA_TF32_OVERRIDE": "0",
}
# The job's launcher is MPICH's (its --version names its Hydra process manager; OpenMPI's names Open MPI or OpenRTE).
LAUNCHER_IS_MPICH = MPIEXEC is not None and "HYDRA" in subprocess.run([MPIEXEC, "--version"], capture_output=True,
                                                                     text=True).stdout
# MPICH's mpiexec passes SIGTERM on to the ranks and waits for them; OpenMPI's kills them a second later, before they
# can save (README, Multi-GPU training: the launch/ scripts pass signals to its ranks themselves, tested with a
# stand-in).
signals_the_launcher = pytest.mark.skipif(MPIEXEC is not None and not LAUNCHER_IS_MPICH,
                                          reason="SIGTERM to a bare mpiexec reaches the ranks as such under MPICH only")
TRAIN_TIMEOUT_S = 120
# A failing job must end well within a minute; a hang would last the trainer's collective timeout (300 s).
FAILURE_TIMEOUT_S = 60

# A tiny model on 16 short AN4 utterances, 4 a step, 2 epochs: 8 steps, two evaluations, augmentation on (seeded per
# epoch and item, so the ranks see exactly what one process sees). 40 mel bands: with 20 the second conv gets 10
# frequency rows and oneDNN's CPU convolution backward crashes (torch 2.14.1).
TINY_RUN = [
    "data=manifest", "device=cpu", "model.depth=1", "model.hidden=32", "model.conv_channels=4",
    "model.backend=reference", "data.features.kind=mel", "data.features.n_mels=40", "data.augment.enabled=true",
    "optim.warmup_steps=0", "train.global_batch_size=4", "train.eval_batch_size=4", "train.epochs=2",
    "train.num_workers=0", "train.progress_bar=false", "train.amp=none",
]
NUM_STEPS = 8
# The same run on GPUs, its GRU layers on the persistent kernels.
ON_GPUS = ("device=cuda", "model.backend=persistent")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def start_job(command: list) -> subprocess.Popen:
    """Starts `command` from the repository root in its own session, stdout and stderr together."""
    return subprocess.Popen(
        [str(part) for part in command], cwd=REPO_ROOT, env=JOB_ENV, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )


def finish_job(process: subprocess.Popen, timeout_s: float) -> tuple[int, str]:
    """(exit code, output) of a started job. A job still running after `timeout_s` is killed with its process group
    and fails the test."""
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"still running after {timeout_s} s, killed: {' '.join(process.args)}\n{output[-4000:]}")
    return process.returncode, output


def run_job(command: list, timeout_s: float) -> tuple[int, str]:
    return finish_job(start_job(command), timeout_s)


def launch(world_size: int) -> list:
    return [MPIEXEC, "-n", world_size, sys.executable] if world_size > 1 else [sys.executable]


def trainer_command(manifests: dict, run_dir: Path, world_size: int, *overrides: str) -> list:
    """TINY_RUN on the slice in `run_dir`; an override replaces TINY_RUN's setting of the same key."""
    replaced = {override.split("=", 1)[0] for override in overrides}
    settings = [setting for setting in TINY_RUN if setting.split("=", 1)[0] not in replaced]
    return launch(world_size) + [
        "-m", "trainer", *settings, f"data.train_manifests=[{manifests['train']}]",
        f"data.eval_manifest={manifests['test']}", f"hydra.run.dir={run_dir}", *overrides,
    ]


@pytest.fixture(scope="module")
def an4_slice(an4_source, tmp_path_factory) -> dict:
    """{"train": 16 utterances of at most 1.5 s, "test": 6 more}, cut from AN4's prepared manifests."""
    folder = tmp_path_factory.mktemp("an4_slice")
    prepared = prepare_an4(an4_source, folder / "prepared")
    manifests = {}
    for split, count in (("train", 16), ("test", 6)):
        lines = [line for line in prepared[split].read_text().splitlines() if json.loads(line)["duration"] <= 1.5]
        manifests[split] = folder / f"{split}.jsonl"
        manifests[split].write_text("\n".join(lines[:count]) + "\n")
    return manifests


@pytest.fixture(scope="module")
def two_rank_run(an4_slice, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("two_ranks")
    code, output = run_job(trainer_command(an4_slice, run_dir, 2), TRAIN_TIMEOUT_S)
    assert code == 0, output
    assert output.count("final test WER") == 1, output  # rank 0 alone reports the figures
    return run_dir


def assert_tensors_match(expected: dict, actual: dict, what: str, rtol: float, atol: float = 0.0) -> None:
    """Each tensor as a whole (norm of the difference) within rtol of its norm plus atol per element."""
    assert expected.keys() == actual.keys(), what
    for name, tensor in expected.items():
        error = (actual[name].double() - tensor.double()).norm().item()
        scale = tensor.double().norm().item()
        bound = rtol * scale + atol * tensor.numel() ** 0.5
        assert error <= bound, f"{what} {name}: error {error:.3g} against norm {scale:.3g}"


def optimizer_tensors(saved: dict) -> dict:
    states = saved["optimizer"]["state"]
    return {f"{index}.{key}": value for index, state in states.items() for key, value in state.items()}


def evaluations(run_dir: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(row["epoch"], row["eval_wer"], row["eval_cer"]) for row in rows if "eval_wer" in row]


def assert_trained_alike(one_dir: Path, two_dir: Path) -> None:
    """The run in two_dir (two ranks) ended where the run in one_dir (one process) did."""
    one = torch.load(one_dir / "checkpoints" / "last.pt", weights_only=True)
    two = torch.load(two_dir / "checkpoints" / "last.pt", weights_only=True)
    untimed = [{key: value for key, value in run["train_state"].items() if key != "elapsed_s"} for run in (one, two)]
    assert untimed[0] == untimed[1]
    assert two["train_state"]["step"] == NUM_STEPS
    assert len(two["rng"]) == 2  # each rank's stream, for an exact resume
    assert two["rng"][0]["python"] != two["rng"][1]["python"] and not torch.equal(two["rng"][0]["torch"],
                                                                                    two["rng"][1]["torch"])
    assert all(type(rank["python"]) is tuple and rank["torch"].dtype == torch.uint8 for rank in two["rng"])
    # atol: a thousandth of the distance AdamW (lr 1e-3) moves each weight in one step, for tensors such as batch
    # norm biases that start at zero and have moved little.
    assert_tensors_match(one["model"], two["model"], "model", rtol=1e-5, atol=1e-6)
    # AdamW's moments keep the gradients' scale, which its update normalises away: a loss normalised by the wrong
    # count would still move the weights alike, but not these. The gradients agree to about 2e-5: each rank pads
    # its shard to its own longest utterance, so float32 sums run in another order.
    assert_tensors_match(optimizer_tensors(one), optimizer_tensors(two), "optimizer", rtol=1e-4)
    # Split evaluation: each rank decodes half the test set and the error counts are summed.
    assert evaluations(one_dir) == evaluations(two_dir)
    assert [epoch for epoch, _, _ in evaluations(two_dir)] == [1, 2]


@needs_mpiexec
def test_two_ranks_train_exactly_as_one_process(an4_slice, two_rank_run, tmp_path):
    code, output = run_job(trainer_command(an4_slice, tmp_path, 1), TRAIN_TIMEOUT_S)
    assert code == 0, output
    assert_trained_alike(tmp_path, two_rank_run)


# A clip far under the tiny model's gradient norm (about 40) and one far over it, each with a rate that moves the
# weights well past float rounding without diverging.
CLIPPED_OR_NOT = {"clipped": (1.0, 1e-2), "not clipped": (1e3, 1e-3)}


def tiny_sgd_steps(out_dir: str) -> None:
    """Three train_steps of SGD on a tiny model, each a global batch of 4 utterances, the second's last unusable (in
    rank 1's shard on 2 ranks), under each of CLIPPED_OR_NOT; rank 0 saves how far they moved each weight and buffer,
    and the losses the steps logged, to out_dir/WORLD_SIZE.pt. Run by 2 ranks under mpiexec, and by one process for
    the reference."""
    env = distributed.init("cpu")
    with initialize_config_dir(str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["optim=sgd", "model.depth=1", "model.hidden=16", "model.conv_channels=2",
                                          "model.backend=reference", "data.features.kind=mel",
                                          "data.features.n_mels=20", "train.amp=none"])
    generator = torch.Generator().manual_seed(0)
    words = ["YES", "NO", "TWO", "SIX"]
    batches = [[Sample(torch.randn(40 + 10 * index, 20, generator=generator), torch.tensor(encode(word)), index)
                for index, word in enumerate(words[step:] + words[:step])] for step in range(3)]
    batches[1][3] = Unusable(3, "unreadable")
    shard = 4 // env.world_size
    moved, losses = {}, {}
    for name, (clip, lr) in CLIPPED_OR_NOT.items():
        cfg.train.grad_clip_norm, cfg.optim.lr = clip, lr
        torch.manual_seed(0)
        model = build.model(cfg.model, 20)
        start = {key: tensor.clone() for key, tensor in model.state_dict().items()}
        wrapped = model
        if env.world_size > 1:
            model.sync_batch_norm(True)
            wrapped = distributed.data_parallel(model, env.device, graphed=False)
        optimizer = build.optimizer(cfg.optim, model.parameters())
        schedule = build.lr_schedule(cfg.optim, optimizer, steps_per_epoch=10)
        losses[name] = []
        for batch in batches:
            step = train_step(wrapped, collate(batch[env.rank * shard:(env.rank + 1) * shard]), optimizer, schedule,
                              cfg, env)
            assert step.outcome == "ok", step
            losses[name].append(step.loss)
        moved[name] = {key: tensor - start[key] for key, tensor in model.state_dict().items()}
    if env.is_main:
        torch.save({"moved": moved, "losses": losses}, Path(out_dir) / f"{env.world_size}.pt")
    distributed.shutdown()


@needs_mpiexec
def test_two_ranks_step_as_one_process_with_the_gradient_clipped_or_not_and_an_utterance_unusable(tmp_path):
    """Clipping takes the norm of the global batch's gradient (DDP's all-reduced one), not a rank's own, and the loss
    normaliser counts the utterances that trained on all ranks: a step where rank 1 has one utterance to rank 0's two
    takes the mean over the three on both. Each weight's move over 3 steps, and each step's logged loss (the mean
    per utterance of the global batch, not of a rank's shard), 2 ranks against 1 process."""
    code, output = run_job(launch(2) + ["-c", "import sys; sys.path.insert(0, 'tests'); import test_distributed; "
                                              f"test_distributed.tiny_sgd_steps({str(tmp_path)!r})"],
                           TRAIN_TIMEOUT_S)
    assert code == 0, output
    tiny_sgd_steps(str(tmp_path))
    one, two = (torch.load(tmp_path / f"{world_size}.pt", weights_only=True) for world_size in (1, 2))
    for name in CLIPPED_OR_NOT:
        assert_tensors_match(one["moved"][name], two["moved"][name], f"{name}: moved", rtol=1e-4)
        assert two["losses"][name] == pytest.approx(one["losses"][name], rel=1e-5), name


def with_corrupt_first_file(an4_slice: dict, folder: Path) -> dict:
    """The slice with its first training utterance's audio replaced by bytes no decoder reads."""
    lines = an4_slice["train"].read_text().splitlines()
    corrupt = folder / "corrupt.wav"
    corrupt.write_bytes(b"not audio at all" * 64)
    lines[0] = json.dumps({**json.loads(lines[0]), "audio_filepath": str(corrupt)})
    manifest = folder / "train.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    return {**an4_slice, "train": manifest}


@needs_mpiexec
def test_the_epoch_log_counts_every_ranks_utterances(an4_slice, tmp_path):
    """Rank 0 logs the epoch's utterances and the unreadable ones over all ranks, whichever rank's shard lost one."""
    command = trainer_command(with_corrupt_first_file(an4_slice, tmp_path), tmp_path / "run", 2, "train.epochs=1")
    code, output = run_job(command, TRAIN_TIMEOUT_S)
    assert code == 0, output
    assert "epoch 1: loss" in output, output
    assert "15 utterances in" in output and "skipped: 1 utterance unreadable\n" in output, output
    # The run's log is rank 0's (the dataset's lines once, not once a rank); rank 1 adds only its warnings, tagged.
    log = (tmp_path / "run" / "__main__.log").read_text()
    assert log.count("utterances from") == 2, log  # the training set and the test set
    rank_1 = [line for line in log.splitlines() if "[rank 1]" in line]
    assert any("[rank 1] rank 1 of 2 (local rank 1)" in line for line in rank_1), log  # its own device, rendezvous
    assert all("[WARNING]" in line or "[ERROR]" in line or "[rank 1] rank 1 of 2" in line for line in rank_1), log


@needs_mpiexec
def test_warnings_every_rank_would_give_alike_are_rank_0s_alone(an4_slice, tmp_path):
    """Every rank reads the same manifests and agrees on each skipped step: each utterance left out at start and each
    step skipped was named once a rank, 64 times over on 64 ranks. At one utterance a rank, the unreadable one leaves
    its rank's shard empty, which skips the step on both."""
    manifests = with_corrupt_first_file(an4_slice, tmp_path)
    listed = json.loads(manifests["train"].read_text().splitlines()[1])
    shutil.copyfile(listed["audio_filepath"], tmp_path / "copy.flac")  # another file: a repeat is counted as one
    untranscribed = {**listed, "audio_filepath": str(tmp_path / "copy.flac"), "text": ""}
    with manifests["train"].open("a") as manifest:
        manifest.write(json.dumps(untranscribed) + "\n")
    command = trainer_command(manifests, tmp_path / "run", 2, "train.epochs=1", "train.global_batch_size=2")
    code, output = run_job(command, TRAIN_TIMEOUT_S)
    assert code == 0, output
    assert output.count("its transcript is empty") == 1, output
    assert len(re.findall(r"step \d+ skipped: empty shard", output)) == 1, output
    assert "1 step skipped: empty shard (all its audio unreadable)" in output, output  # the epoch's line


@needs_mpiexec
def test_in_a_sweep_every_jobs_log_is_rank_0s(an4_slice, tmp_path):
    """Hydra sets up logging again for each job of a sweep: rank 1 adds only its warnings, errors and start line to
    the second job's log too, not its own copy of every line."""
    command = trainer_command(an4_slice, tmp_path, 2, "train.epochs=1", "seed=1,2", "run_name=sweep",
                              f"hydra.sweep.dir={tmp_path / 'sweep'}")
    command.insert(command.index("trainer") + 1, "-m")
    code, output = run_job(command, TRAIN_TIMEOUT_S)
    assert code == 0, output
    # Hydra's own lines, rank 0's alone: rank 1's came too, the first two untagged, before its first job began.
    for hydra_line in ("[HYDRA] Launching 2 jobs locally", "[HYDRA] \t#0 : ", "[HYDRA] \t#1 : "):
        assert output.count(hydra_line) == 1, output
    assert "[HYDRA] [rank 1]" not in output, output
    logs = sorted((tmp_path / "sweep").glob("*/__main__.log"))
    assert len(logs) == 2, output
    for log in (path.read_text() for path in logs):
        assert log.count("utterances from") == 2, log
        rank_1 = [line for line in log.splitlines() if "[rank 1]" in line]
        # Its start line in each job's log: the all() below passed where rank 1 wrote no line there at all.
        assert any("[rank 1] rank 1 of 2 (local rank 1)" in line for line in rank_1), log
        assert all("[WARNING]" in line or "[ERROR]" in line or "[rank 1] rank 1 of 2" in line for line in rank_1), log


@needs_mpiexec
def test_a_sweep_under_mpiexec_whose_global_batch_its_ranks_cannot_split_is_refused_before_its_first_job(
        an4_slice, tmp_path):
    """mpiexec -n 2 python -m trainer -m train.global_batch_size=2,3, without the launch scripts: the trainer's own
    check of the sweep took the job for one rank, so job 0 trained and job 1 was refused only as it started."""
    command = trainer_command(an4_slice, tmp_path, 2, "train.epochs=1", "train.global_batch_size=2,3",
                              "run_name=sweep", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    command.insert(command.index("trainer") + 1, "-m")
    code, output = run_job(command, FAILURE_TIMEOUT_S)
    assert code == 2, output
    refusal = ("error: sweep job 1 (train.global_batch_size=3): train.global_batch_size=3: global_batch_size 3 must "
               "be a positive multiple of world_size 2; no job of the sweep ran")
    assert output.count(refusal) == 2 and f"[rank 1] {refusal}" in output, output  # each rank's own line
    assert "Launching" not in output and not (tmp_path / "sweep").exists(), output


@needs_mpiexec
def test_a_bad_value_the_distributed_start_takes_is_one_line_on_every_rank(an4_slice, tmp_path):
    run_dir = tmp_path / "run"
    code, output = run_job(trainer_command(an4_slice, run_dir, 2, "distributed.timeout_s=abc"), FAILURE_TIMEOUT_S)
    assert code == 2 and "Traceback" not in output, output
    refusal = "error: distributed.timeout_s must be a positive number of seconds up to 1e+09, not 'abc'"
    assert output.count(refusal) == 2 and f"[rank 1] {refusal}" in output, output  # each rank's own line
    assert not run_dir.exists(), output  # refused on every rank before the run's folder was made


def assert_gpu_ranks_train_as_one_gpu(an4_slice, run_dir: Path, *overrides: str) -> str:
    """One GPU process, then two ranks with `overrides`, both with GRU layers on the persistent kernels (batch 2 per
    rank against 4 in one process) in fp32; the two-rank job's output."""
    from prnn_kernels.build import load_extension

    load_extension()  # built once here, not inside the jobs' time limit
    for world_size in (1, 2):
        command = trainer_command(an4_slice, run_dir / f"{world_size}", world_size, *ON_GPUS, *overrides)
        code, output = run_job(command, TRAIN_TIMEOUT_S)
        assert code == 0, output
    assert_trained_alike(run_dir / "1", run_dir / "2")
    return output


@needs_mpiexec
@pytest.mark.cuda
@needs_two_gpus
def test_two_gpus_over_nccl_train_exactly_as_one_gpu(an4_slice, tmp_path):
    """The same on GPUs: gradients and batch-norm statistics all-reduced by NCCL."""
    output = assert_gpu_ranks_train_as_one_gpu(an4_slice, tmp_path)
    assert "over nccl" in output, output


@needs_mpiexec
@pytest.mark.cuda
@needs_two_gpus
def test_two_gpus_over_nccl_train_graphed_exactly_as_one_gpu(an4_slice, tmp_path):
    """train.cuda_graphs=true on two ranks: the batch norms' all-reduces replayed inside the graphs, DDP's outside."""
    output = assert_gpu_ranks_train_as_one_gpu(an4_slice, tmp_path, "train.cuda_graphs=true")
    assert "over nccl" in output and "capturing CUDA graphs" in output, output


@needs_mpiexec
@pytest.mark.cuda
@needs_two_gpus
def test_graphed_ranks_skip_a_step_whose_shards_differ_in_size(an4_slice, tmp_path):
    """An unreadable utterance leaves its rank's shard one short: under CUDA graphs the ranks would replay graphs of
    different shapes, whose captured all-reduces do not pair, so every rank skips that step, says why and goes on."""
    from prnn_kernels.build import load_extension

    load_extension()
    command = trainer_command(with_corrupt_first_file(an4_slice, tmp_path), tmp_path / "run", 2, *ON_GPUS,
                              "train.cuda_graphs=true")
    code, output = run_job(command, TRAIN_TIMEOUT_S)
    assert code == 0, output
    assert "corrupt.wav" in output, output
    # Once per epoch: the file is read, and fails, in both.
    assert output.count("1 step skipped: shards of unequal size under CUDA graphs (audio unreadable)") == 2, output


@needs_mpiexec
@pytest.mark.cuda
def test_two_ranks_sharing_one_gpu_train_exactly_as_one_gpu(an4_slice, tmp_path, monkeypatch):
    """distributed.share_gpus: both ranks on the one visible GPU, all-reducing over gloo, as two GPUs would."""
    monkeypatch.setitem(JOB_ENV, "CUDA_VISIBLE_DEVICES", "0")
    code, output = run_job(trainer_command(an4_slice, tmp_path / "refused", 2, "device=cuda"), FAILURE_TIMEOUT_S)
    assert code != 0, output
    assert "error on rank 0: 2 ranks on this node but 1 GPU visible" in output, output
    graphed = trainer_command(an4_slice, tmp_path / "graphed", 2, *ON_GPUS, "distributed.share_gpus=true",
                              "train.cuda_graphs=true")
    code, output = run_job(graphed, FAILURE_TIMEOUT_S)
    assert code != 0, output
    assert "train.cuda_graphs=true in a job of 2 ranks needs NCCL" in output, output
    output = assert_gpu_ranks_train_as_one_gpu(an4_slice, tmp_path, "distributed.share_gpus=true")
    assert "rank 1 of 2 (local rank 1) on cuda:0 over gloo" in output, output


def clear_launcher_variables(monkeypatch) -> None:
    """No MPI launcher's variables in this process, whatever the shell that runs the tests holds."""
    for names in launch_ranks.LAUNCHER_VARIABLES:
        for name in names:
            monkeypatch.delenv(name, raising=False)


def test_the_launchers_ranks_are_read_without_torch_or_mpi():
    """trainer.launch_ranks answers before any process group exists (the trainer's first checks, Hydra's refusals,
    the run directory's callback): importing it loads neither torch nor mpi4py, which init alone starts."""
    loaded = subprocess.run([sys.executable, "-c", "import sys, trainer.launch_ranks; "
                             "print(sorted({name.split('.')[0] for name in sys.modules} & {'torch', 'mpi4py'}))"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert loaded.stdout == "[]\n", loaded.stdout + loaded.stderr


def test_ranks_take_their_own_gpu_or_share_them_when_allowed():
    assert [launch_ranks.rank_gpu(rank, 4, 8, share_gpus=False) for rank in range(4)] == [0, 1, 2, 3]
    assert [launch_ranks.rank_gpu(rank, 2, 2, share_gpus=False) for rank in range(2)] == [0, 1]  # as many as GPUs
    assert [launch_ranks.rank_gpu(rank, 5, 2, share_gpus=True) for rank in range(5)] == [0, 1, 0, 1, 0]
    # A Slurm user who asked for fewer GPUs than launch/slurm.sbatch (--gpus-per-node=4) still has its 8 tasks a node.
    with pytest.raises(ValueError, match=r"8 ranks on this node but 4 GPUs visible, .* per node \(sbatch and srun: "
                                         r"--ntasks-per-node=4, which launch/slurm.sbatch sets to 8\)"):
        launch_ranks.rank_gpu(0, 8, 4, share_gpus=False)
    with pytest.raises(ValueError, match="2 ranks on this node but 1 GPU visible, .* start at most 1 rank per node"):
        launch_ranks.rank_gpu(0, 2, 1, share_gpus=False)


def test_ranks_on_the_node_are_read_from_each_launcher_or_bounded_by_the_local_rank(monkeypatch):
    clear_launcher_variables(monkeypatch)
    for variables, expected in [
        ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, (5, 8, 1, 4)),
        ({"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}, (5, 8, 1, 4)),
        ({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "3", "SLURM_NTASKS_PER_NODE": "4"},
         (3, 4, 3, 4)),
        ({"PMIX_RANK": "3", "PMIX_SIZE": "4", "PMIX_LOCAL_RANK": "1", "PMIX_LOCAL_SIZE": "2"}, (3, 4, 1, 2)),
        # srun without --ntasks-per-node: at least the ranks up to this one share the node
        ({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "3"}, (3, 4, 3, 4)),
    ]:
        with monkeypatch.context() as scope:
            for name, value in variables.items():
                scope.setenv(name, value)
            assert launch_ranks.ranks_from_launcher() == expected
            # The rank in the job, not on the node: it picks the rank that writes the log (leave_the_log_to_rank_0)
            assert launch_ranks.launcher_rank() == expected[0], variables
            # The job's size, as a sweep is checked before MPI starts (trainer.run_directory)
            assert launch_ranks.launcher_world_size() == expected[1], variables


def test_a_lone_process_inside_a_slurm_allocation_is_a_world_of_one(monkeypatch):
    """A batch script or salloc shell holds the allocation's SLURM_NTASKS and SLURM_PROCID=0; only srun's tasks hold
    their step's count. Taken for an srun launch, a process started there without srun waited for ranks that never
    came (or, with mpi4py, was refused as an MPI that does not see the launcher's ranks)."""
    clear_launcher_variables(monkeypatch)
    for name, value in {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "8", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                        "SLURM_NTASKS_PER_NODE": "8"}.items():
        monkeypatch.setenv(name, value)
    assert not launch_ranks.launched_by_mpi() and launch_ranks.launcher_world_size() == 1
    assert distributed.init("cpu").world_size == 1
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "8")  # what srun sets in each task it starts
    assert launch_ranks.launched_by_mpi()


def test_init_refuses_a_device_it_does_not_take_in_the_config_rules_words():
    """The config refuses it first (CONFIG_RULES); the benchmarks and a program of the user's call init directly."""
    with pytest.raises(ValueError, match=r"^device must be one of auto, cpu, cuda, not 'cuda:0'$"):
        distributed.init("cuda:0")


def test_a_launcher_count_cleared_to_empty_is_a_world_of_one(monkeypatch):
    """`export OMPI_COMM_WORLD_SIZE=` (or a container's `-e NAME=`) clears a variable: the trainer ended in int()'s
    traceback, "invalid literal for int() with base 10: ''"."""
    for names in launch_ranks.LAUNCHER_VARIABLES:
        for name in names:
            monkeypatch.setenv(name, "")
    assert not launch_ranks.launched_by_mpi() and launch_ranks.launcher_rank() == 0
    assert launch_ranks.launcher_world_size() == 1
    assert distributed.init("cpu").world_size == 1


def test_a_process_torchrun_started_is_refused_not_trained_as_a_world_of_one(monkeypatch):
    """torchrun's RANK, WORLD_SIZE and LOCAL_RANK are no MPI launcher's: each of its processes trained alone."""
    clear_launcher_variables(monkeypatch)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=re.escape("WORLD_SIZE=2 says this process is one of several, as torchrun "
                                                   "starts them, but the ranks come from MPI")):
        distributed.init("cpu")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert distributed.init("cpu") == distributed.DistEnv(0, 1, torch.device("cpu"))


@pytest.mark.parametrize("size", ["0", "-1", "abc", "2.5", "\N{SUPERSCRIPT TWO}"])  # ²: a digit to isdigit, not to int
def test_a_world_size_that_is_no_count_is_refused_as_that(monkeypatch, size):
    """WORLD_SIZE=0, -1 or abc was refused as "says this process is one of several", which it does not say."""
    clear_launcher_variables(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", size)
    with pytest.raises(ValueError) as refused:
        distributed.init("cpu")
    assert str(refused.value) == (f"WORLD_SIZE={size} is no count of processes (a whole number above 0), and the "
                                  "ranks come from MPI: unset WORLD_SIZE")


@pytest.mark.parametrize("size", ["2", "abc"])
def test_a_world_size_beside_an_mpi_launchers_variables_is_left_alone(monkeypatch, size):
    """The ranks come from the MPI launcher, whatever WORLD_SIZE a cluster's profile or a job script exports beside it:
    only a WORLD_SIZE that no launcher's variables back is torchrun's."""
    clear_launcher_variables(monkeypatch)
    for name, value in (("PMI_SIZE", "2"), ("PMI_RANK", "1"), ("WORLD_SIZE", size)):
        monkeypatch.setenv(name, value)
    launch_ranks.check_not_one_of_torchruns_ranks()
    launch_ranks.refuse_unusable_launch()


# The programs whose first step refuses a launch it cannot take ranks from (refuse_unusable_launch).
PROGRAMS_THAT_START_RANKS = [["trainer", "experiment=cpu_demo", "train.max_steps=1", "hydra.run.dir={run}"],
                             ["benchmarks.scaling", "--model", "cpu_demo", "--device", "cpu"],
                             ["benchmarks.train_step"]]


def refused_launch(tmp_path, program: list[str], launch: dict) -> list[str]:
    """The stderr lines of `program` (PROGRAMS_THAT_START_RANKS') started with the `launch` variables and no launcher's
    others, which refuses it with exit code 2 before it writes anything (its run directory under tmp_path)."""
    launchers = {name for names in launch_ranks.LAUNCHER_VARIABLES for name in names}
    env = {name: value for name, value in JOB_ENV.items() if name not in launchers}
    ran = subprocess.run([sys.executable, "-m", *(part.format(run=tmp_path / "run") for part in program)],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=FAILURE_TIMEOUT_S,
                         env={**env, **launch})
    assert ran.returncode == 2, ran.stderr
    assert not (tmp_path / "run").exists()
    return ran.stderr.splitlines()


@pytest.mark.parametrize("program", PROGRAMS_THAT_START_RANKS)
def test_torchruns_processes_are_refused_in_a_line_that_names_no_rank_before_anything_is_written(tmp_path, program):
    """Every one of torchrun's processes prints the refusal, and none is a rank of ours: each said "error on rank 0",
    the trainer's after Hydra had made each process a run directory and its log."""
    assert refused_launch(tmp_path, program, {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}) == [
        "error: WORLD_SIZE=2 says this process is one of several, as torchrun starts them, but the ranks come from "
        "MPI, and each process would train alone: start them with launch/single_node.sh N (mpirun) or srun, or unset "
        "WORLD_SIZE"]


@pytest.mark.parametrize("variables, refusal", [
    ({"OMPI_COMM_WORLD_SIZE": "abc"}, "OMPI_COMM_WORLD_SIZE=abc is no whole number"),
    ({"OMPI_COMM_WORLD_SIZE": "\N{SUPERSCRIPT TWO}"}, "OMPI_COMM_WORLD_SIZE=\N{SUPERSCRIPT TWO} is no whole number"),
    ({"PMI_SIZE": "2", "PMI_RANK": "\N{ARABIC-INDIC DIGIT ONE}"},  # a digit to isdigit, and 1 to int
     "PMI_RANK=\N{ARABIC-INDIC DIGIT ONE} is no whole number"),
    ({"PMI_SIZE": "2", "PMI_RANK": "x"}, "PMI_RANK=x is no whole number"),
    ({"PMIX_SIZE": "2", "PMIX_RANK": "1", "PMIX_LOCAL_RANK": "-1"}, "PMIX_LOCAL_RANK=-1 is no whole number"),
    ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0", "SLURM_NTASKS_PER_NODE": "two"},
     "SLURM_NTASKS_PER_NODE=two is no whole number"),
    ({"PMI_SIZE": "2", "PMI_RANK": ""}, "PMI_RANK is unset or empty, where PMI_SIZE=2 says a launcher started this "
                                        "process as one of several"),
])
def test_a_launchers_variable_that_holds_no_number_is_refused_naming_it(monkeypatch, variables, refusal):
    """int() of such a variable ended in a traceback naming neither the variable nor its value."""
    clear_launcher_variables(monkeypatch)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(refusal)):
        launch_ranks.ranks_from_launcher()


@pytest.mark.parametrize("program", PROGRAMS_THAT_START_RANKS)
def test_a_launchers_variable_that_holds_no_number_is_refused_in_one_line_before_anything_is_written(tmp_path,
                                                                                                       program):
    """Each program ended in int()'s traceback, the trainer's after Hydra had made the run directory where the
    local rank held none."""
    assert refused_launch(tmp_path, program, {"PMI_SIZE": "2", "PMI_RANK": "0", "MPI_LOCALRANKID": "z"}) == [
        "error: MPI_LOCALRANKID=z is no whole number, as an MPI launcher sets it: start the processes with "
        "launch/single_node.sh N (mpirun) or srun, which set it, or unset it"]


def test_check_overrides_names_a_refused_override_whatever_launcher_variables_its_shell_holds(monkeypatch, capsys):
    """The launch scripts run the check in their own shell, whose leftover launcher variables are not the ranks': there
    a misspelt key under PMI_SIZE=abc ended in a ValueError's traceback about PMI_SIZE, the key's line lost."""
    from trainer.check_overrides import main

    clear_launcher_variables(monkeypatch)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setenv("PMI_SIZE", "abc")
    with pytest.raises(SystemExit) as refused:
        main(["model.depthh=2"])
    assert refused.value.code == 2
    assert capsys.readouterr().err == "error: unknown config key model.depthh (did you mean model.depth?)\n"


# Each launcher's size at 0, then a node's count at 0 where the launch's size says the process is one of several.
COUNTS_OF_0 = [*({names[1]: "0"} for names in launch_ranks.LAUNCHER_VARIABLES),
               {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "00"}]


def count_of_0_refusal(variables: dict) -> str:
    name, value = list(variables.items())[-1]
    return (f"error: {name}={value} is no count of processes (a whole number above 0), as an MPI launcher sets it: "
            "start the processes with launch/single_node.sh N (mpirun) or srun, which set it, or unset it")


@pytest.mark.parametrize("variables", COUNTS_OF_0)
def test_a_launchers_count_of_0_is_refused_naming_it(monkeypatch, capsys, variables):
    """PMI_SIZE=0 (any launcher's size at 0) ran as a world of one, where WORLD_SIZE=0 was refused as no count; a
    node's count of 0 was taken for none given."""
    clear_launcher_variables(monkeypatch)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as refused:
        launch_ranks.refuse_unusable_launch()
    assert refused.value.code == 2
    assert capsys.readouterr().err.splitlines() == [count_of_0_refusal(variables)]


@pytest.mark.parametrize("program", PROGRAMS_THAT_START_RANKS)
def test_a_launchers_count_of_0_is_refused_in_one_line_before_anything_is_written(tmp_path, program):
    assert refused_launch(tmp_path, program, {"PMI_SIZE": "0"}) == [count_of_0_refusal({"PMI_SIZE": "0"})]


@pytest.mark.parametrize("variables, refusal", [
    ({"PMI_RANK": "5", "PMI_SIZE": "2"},
     "PMI_RANK=5 is no rank of PMI_SIZE=2 processes, which a launcher numbers 0 to 1"),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2"},
     "OMPI_COMM_WORLD_RANK=2 is no rank of OMPI_COMM_WORLD_SIZE=2 processes"),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
     "OMPI_COMM_WORLD_LOCAL_RANK=3 is no rank of OMPI_COMM_WORLD_LOCAL_SIZE=2 processes, which a launcher numbers 0 "
     "to 1"),
])
def test_a_launchers_rank_past_its_count_is_refused_naming_both(monkeypatch, variables, refusal):
    """Without mpi4py rank 5 of 2 waited out the rendezvous's timeout, then blamed MASTER_ADDR and MASTER_PORT; local
    rank 3 of 2 made 4 ranks share the node (a GPU node of 2 refused as '4 ranks on this node but 2 GPUs')."""
    clear_launcher_variables(monkeypatch)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(refusal)):
        launch_ranks.ranks_from_launcher()


def test_a_launchers_rank_past_its_count_is_refused_in_one_line_before_anything_is_written(tmp_path):
    assert refused_launch(tmp_path, PROGRAMS_THAT_START_RANKS[0], {"PMI_SIZE": "2", "PMI_RANK": "5"}) == [
        "error: PMI_RANK=5 is no rank of PMI_SIZE=2 processes, which a launcher numbers 0 to 1: they are left over "
        "from a launcher that did not start this process, or set by hand; unset them, or start the processes with "
        "launch/single_node.sh N (mpirun) or srun"]


@needs_mpiexec  # mpi4py's MPI, the one mpiexec belongs to
def test_an_mpi_that_does_not_see_the_launchers_ranks_is_one_clear_error(tmp_path):
    """srun with the wrong --mpi starts each task as an MPI world of one: each would train alone, all into one run."""
    environment = {name: value for name, value in os.environ.items()
                   if not any(name in names for names in launch_ranks.LAUNCHER_VARIABLES)}
    environment |= {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "1"}
    result = subprocess.run([sys.executable, "-c", "from trainer import distributed; distributed.init('cpu')"],
                            cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "MPI sees 1 process(es) where the launcher started 2 (SLURM_STEP_NUM_TASKS=2)" in result.stderr, (
        result.stderr)
    # The same where no launcher started the process and the variable is left from one that started its shell (a
    # shell of an srun step of several tasks): the message blamed the MPI library alone.
    assert "or SLURM_STEP_NUM_TASKS is left over from a launcher that did not start this process (unset it)" in (
        result.stderr), result.stderr


@needs_mpiexec
def test_a_launchers_rank_other_than_mpis_is_one_clear_error(tmp_path):
    """OpenMPI's variables left in the shell of an MPICH job, their count its own: both ranks took the launcher's
    rank 0, so both wrote the log as rank 0 and rank 1's errors said "error on rank 0"."""
    environment = {name: value for name, value in JOB_ENV.items()
                   if not any(name in names for names in launch_ranks.LAUNCHER_VARIABLES)}
    environment |= {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}
    started = ("from trainer import distributed\n"
               "try:\n"
               "    distributed.init('cpu')\n"
               "except ValueError as error:\n"
               "    print(f'error: {error}', flush=True)\n"
               "    distributed.abort_job(2)\n")
    result = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-c", started], cwd=REPO_ROOT, env=environment,
                            capture_output=True, text=True, timeout=FAILURE_TIMEOUT_S)
    assert result.returncode != 0
    assert ("error: MPI calls this process rank 1 where OMPI_COMM_WORLD_RANK=0: OMPI_COMM_WORLD_RANK and "
            "OMPI_COMM_WORLD_SIZE are left over from a launcher that did not start this process, or set by hand "
            "(unset them)") in result.stdout, result.stdout + result.stderr


def test_a_job_across_nodes_refuses_a_loopback_rendezvous_address():
    with pytest.raises(ValueError, match="rank 0's address localhost is a loopback address, which the ranks on other "
                                         "nodes cannot reach: set MASTER_ADDR"):
        distributed.check_reachable_from_other_nodes("localhost", on_rank_0s_node=False)
    distributed.check_reachable_from_other_nodes("192.0.2.7", on_rank_0s_node=False)
    # On rank 0's node loopback reaches rank 0. The launch scripts set MASTER_ADDR to that node's name, which its
    # /etc/hosts maps to 127.0.1.1 on Ubuntu and cloud-init hosts: rank 0 refused a job whose other ranks reach it.
    distributed.check_reachable_from_other_nodes("127.0.1.1", on_rank_0s_node=True)
    distributed.check_reachable_from_other_nodes("localhost", on_rank_0s_node=True)


def test_master_addr_is_rank_0s_address_over_its_host_names(monkeypatch):
    """launch/multi_node.sh sets MASTER_ADDR to the hostfile's first host, on the network the nodes share: rank 0's
    host name may resolve to 127.0.1.1, which the other nodes' ranks refuse (check_reachable_from_other_nodes)."""
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.7")
    assert distributed._main_address() == "192.0.2.7"
    monkeypatch.delenv("MASTER_ADDR")
    assert distributed._main_address() == socket.gethostbyname(socket.gethostname())


def test_a_host_name_that_does_not_resolve_is_refused_naming_master_addr(monkeypatch):
    """Rank 0 of a container whose host name is in no /etc/hosts nor DNS ended the job on socket.gaierror's
    traceback, which named neither the host nor MASTER_ADDR."""
    def unresolved(name):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setattr(socket, "gethostname", lambda: "pod-7f3c")
    monkeypatch.setattr(socket, "gethostbyname", unresolved)
    with pytest.raises(ValueError,
                       match=r"host name pod-7f3c does not resolve .*Name or service not known.*MASTER_ADDR"):
        distributed._main_address()


@pytest.mark.parametrize("address, port, refusal", [
    (None, "29511", "MASTER_ADDR unset: without mpi4py, every rank needs rank 0's address"),
    ("192.0.2.7", None, "MASTER_PORT unset: without mpi4py"),
    (None, None, "MASTER_ADDR and MASTER_PORT unset: without mpi4py"),
    ("192.0.2.7", "abc", "MASTER_PORT must be a port number from 1 to 65535, not 'abc'"),
    ("192.0.2.7", "70000", "MASTER_PORT must be a port number from 1 to 65535, not '70000'"),
    ("192.0.2.7", "0", "MASTER_PORT must be a port number from 1 to 65535, not '0'"),
])
def test_without_mpi4py_rank_0s_address_and_port_are_refused_before_the_rendezvous_naming_the_variable(
        monkeypatch, address, port, refusal):
    """A rank without MASTER_ADDR took its own host's address and, on another node than rank 0's, waited out the
    timeout; a MASTER_PORT torch cannot use failed in its traceback, or (0) waited out the timeout too."""
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # as where it is not installed
    clear_launcher_variables(monkeypatch)
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "2")
    for name, value in (("MASTER_ADDR", address), ("MASTER_PORT", port)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(refusal)):
        distributed._ranks_and_rendezvous(5, distributed.TRAINER_TIMEOUT_SETTING)
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.7")
    for port in (1, 29511, 65535):  # the highest port too, which a bound one short of it refused passing every test
        monkeypatch.setenv("MASTER_PORT", str(port))
        assert distributed._ranks_and_rendezvous(5, distributed.TRAINER_TIMEOUT_SETTING) == (1, 2, 0, 1, "192.0.2.7",
                                                                                             port)


def test_without_mpi4py_a_rendezvous_that_ran_out_names_master_addr_and_port_not_mpi(monkeypatch, caplog, capfd):
    """Without mpi4py no rank started MPI: the line said "another rank stopped answering after MPI started" where
    rank 0 was not at MASTER_ADDR and MASTER_PORT (stopped, or another address set for this rank). Before it, torch's
    C++ log gave each of its tries to reach rank 0 with some 20 lines of C++ stack frames, on stderr."""
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # as where it is not installed
    clear_launcher_variables(monkeypatch)
    port = distributed._free_port()  # no rank 0 listens there
    for name, value in (("PMI_RANK", "1"), ("PMI_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port)):
        monkeypatch.setenv(name, str(value))

    def ends_the_job(exit_code: int = 1):
        raise SystemExit(exit_code)

    monkeypatch.setattr(distributed, "abort_job", ends_the_job)
    with pytest.raises(SystemExit):
        distributed.init("cpu", 1)
    [line] = [record.getMessage() for record in caplog.records if record.name == distributed.log.name]
    assert line.startswith(f"error on rank 1: the process group's rendezvous did not complete within "
                           f"distributed.timeout_s (1 s): a rank did not reach rank 0 at MASTER_ADDR and MASTER_PORT "
                           f"(127.0.0.1:{port}): it stopped or hung, or another MASTER_ADDR or MASTER_PORT than this "
                           "rank's was set for it; this rank ends the job ("), line
    assert "MPI" not in line.replace("MASTER_", ""), line
    stderr = capfd.readouterr().err
    assert "frame #" not in stderr and "Exception raised from" not in stderr, stderr


# A rank without mpi4py, rank 0's address and port from MASTER_ADDR and MASTER_PORT; rank 0 calls init once the test
# says so on its stdin. Each says when it began init, and its first collective's sum, rank 0 `argv[2]` s after init.
RANK_STARTED_BY_THE_TEST = textwrap.dedent("""
    import logging, sys, time
    sys.modules["mpi4py"] = None
    import torch
    from trainer import distributed, launch_ranks
    logging.basicConfig(format="%(created)f %(message)s")
    timeout_s, collective_after_s = float(sys.argv[1]), float(sys.argv[2])
    if launch_ranks.launcher_rank() == 0:
        sys.stdin.readline()
    print(f"{time.time()} init", flush=True)
    distributed.init("cpu", timeout_s)
    time.sleep(collective_after_s if launch_ranks.launcher_rank() == 0 else 0)
    print(f"summed {int(distributed.all_reduce_sum(torch.ones(1)))}", flush=True)
""")


def late_rendezvous(world_size: int, timeout_s: float, late_s: float, collective_after_s: float = 0.0) -> list[str]:
    """The output of ranks 0 and 1 of `world_size` (any others never start), RANK_STARTED_BY_THE_TEST's: rank 0
    begins init, and opens its rendezvous's port, `late_s` after rank 1 began its wait for that port."""
    environment = {name: value for name, value in JOB_ENV.items()
                   if not any(name in names for names in launch_ranks.LAUNCHER_VARIABLES)}
    environment |= {"PMI_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(distributed._free_port())}
    rank_0, rank_1 = (subprocess.Popen(
        [sys.executable, "-c", RANK_STARTED_BY_THE_TEST, str(timeout_s), str(collective_after_s)], cwd=REPO_ROOT,
        env=environment | {"PMI_RANK": str(rank)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True) for rank in (0, 1))
    rank_1_began = ""
    while "init" not in rank_1_began and rank_1.poll() is None:
        rank_1_began += rank_1.stdout.readline()
    time.sleep(late_s)
    rank_0.stdin.write("\n")
    rank_0.stdin.flush()
    return [finish_job(rank_0, FAILURE_TIMEOUT_S)[1], rank_1_began + finish_job(rank_1, FAILURE_TIMEOUT_S)[1]]


def test_a_rank_waits_for_rank_0s_port_and_the_rendezvous_within_the_timeout_together():
    """Rank 1 waited up to the timeout for rank 0's port, then the rendezvous the whole timeout again: where rank 0
    opened its port late and rank 2 never came, rank 1 ended the job after about twice the timeout (7 s of 4 s)."""
    rank_0, rank_1 = late_rendezvous(3, timeout_s=4, late_s=2.5)
    began = float(re.search(r"^([\d.]+) init$", rank_1, re.M)[1])
    ended = re.search(r"^([\d.]+) (error on rank 1: the process group's rendezvous did not complete within "
                      r"distributed.timeout_s \(4 s\).*)$", rank_1, re.M)
    assert ended and "timed out connecting" not in ended[2], rank_1  # rank 0's port answered; the rendezvous ran out
    assert float(ended[1]) - began < 4 + distributed.LEAST_RENDEZVOUS_WAIT_S, rank_1
    assert "error on rank 0: the process group's rendezvous did not complete" in rank_0, rank_0


def test_a_rendezvous_past_its_deadline_waits_a_second_or_the_whole_timeout_where_that_is_shorter():
    """A timeout under LEAST_RENDEZVOUS_WAIT_S bounds the rendezvous's least wait too: one of a second whatever the
    timeout passed every test, and distributed.timeout_s=0.5 would have waited twice its limit."""
    past = time.monotonic() - 10
    assert distributed.rendezvous_wait_s(past, 4) == distributed.LEAST_RENDEZVOUS_WAIT_S
    assert distributed.rendezvous_wait_s(past, 0.5) == 0.5
    assert 2 < distributed.rendezvous_wait_s(time.monotonic() + 3, 4) <= 3


def test_a_rank_whose_rank_0_never_opens_its_port_stops_waiting_at_its_deadline():
    """wait_for_rank_0s_rendezvous gives up at its deadline: one that waited 5 s past it passed every test."""
    with socket.socket() as held:  # bound, not listening: it refuses connections, and no other process takes it
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        began = time.monotonic()
        with pytest.raises(torch.distributed.DistNetworkError, match=f"timed out connecting to 127.0.0.1:{port}"):
            distributed.wait_for_rank_0s_rendezvous("127.0.0.1", port, began + 0.5)
        assert 0.5 <= time.monotonic() - began < 2


def test_cpu_ranks_share_their_nodes_cores(monkeypatch):
    """Each of a node's CPU ranks takes its share of the cores, at least one: one that took them all passed every
    test, and more compute threads than cores make OpenMP's spin-waits crawl."""
    threads = torch.get_num_threads()
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    try:
        assert distributed._device_and_backend(False, 0, 2, False) == (torch.device("cpu"), 2, "gloo")
        assert torch.get_num_threads() == 4
        distributed._device_and_backend(False, 0, 16, False)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_a_late_rendezvous_leaves_the_collectives_the_whole_timeout():
    """The rendezvous gets what is left of the timeout after rank 0's port answered (1.5 s of 4 s), but
    init_process_group's timeout is its collectives' too: rank 1's first collective, waiting 2.5 s for rank 0's, would
    have timed out with it."""
    rank_0, rank_1 = late_rendezvous(2, timeout_s=4, late_s=2.5, collective_after_s=2.5)
    assert "summed 2" in rank_0 and "summed 2" in rank_1, rank_0 + rank_1


def test_a_run_outside_mpi_ends_with_the_exit_code_its_error_asks_for(monkeypatch):
    """A single process's error ends through abort_job as a rank's does, exit code 2 for a user's error: only training
    runs in a subprocess reached this exit, and a mutant that exited 1 passed the one of them tried."""
    monkeypatch.setattr(distributed, "launched_by_mpi", lambda: False)
    for code in (1, 2, 130):
        with pytest.raises(SystemExit) as ended:
            distributed.abort_job(code)
        assert ended.value.code == code


def test_the_watchdog_of_mpis_start_is_not_forked_once_mpi_has_started(monkeypatch):
    """A sweep's later jobs find MPI started: a fork then makes OpenMPI warn, and InfiniBand's registered memory may
    not survive it."""
    def refuse_to_fork():
        raise AssertionError("ended_past forked a watchdog with MPI started")

    monkeypatch.setitem(sys.modules, "mpi4py.MPI", object())
    monkeypatch.setattr(os, "fork", refuse_to_fork)
    with distributed.ended_past(30, 0):
        pass


def launch_script(script: str, *arguments: str, **environment: str | None) -> subprocess.CompletedProcess:
    """launch/SCRIPT with MPIRUN=echo: its stdout's last line is the mpirun command it would run. A variable given as
    None is left out of its environment."""
    environment = {**os.environ, "PYTHON": sys.executable, "MPIRUN": "echo", **environment}
    return subprocess.run([str(REPO_ROOT / "launch" / script), *arguments], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120,
                          env={name: value for name, value in environment.items() if value is not None})


def test_launch_scripts_pass_the_job_on_and_refuse_what_mpirun_would_misread(tmp_path):
    # Every character a run name may hold besides letters and digits.
    ran = launch_script("single_node.sh", "4", "experiment=cpu_demo", RUN_NAME="first try_v1.2+b@ib-0")
    command = ran.stdout.splitlines()[-1]
    assert ran.returncode == 0 and command.startswith("-np 4 --bind-to none "), ran.stderr
    # Quoted, so that Hydra keeps any name a string: unquoted, 1e5 named the run 100000.0 and null None.
    assert command.endswith("-m trainer run_name='first try_v1.2+b@ib-0' experiment=cpu_demo")
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("# the allocation\n\nnode01 max_slots=8 slots=8\r\nnode02 slots=8\r\n")  # written on Windows
    # OpenMPI passes other nodes only the variables -x names: a user's TORCH_NCCL_* timeouts (which the trainer leaves
    # as set), gloo's interface and the extension's build folder, which this node builds into, reached this node's
    # ranks alone.
    ran = launch_script("multi_node.sh", str(hosts), "16", "experiment=an4_gpu", NCCL_P2P_DISABLE="1",
                        NCCL_IB_HCA="mlx5", TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC="900", TORCH_EXTENSIONS_DIR="/scratch/ext",
                        GLOO_SOCKET_IFNAME="ib0")
    command = ran.stdout.splitlines()[-1]
    # --bind-to none: OpenMPI binds each rank by default (to a core, or a socket past two ranks), its data workers too.
    # mpirun reads a copy without the \r (test_the_multi_node_script_gives_mpirun_a_windows_hostfile_without_its_...).
    assert ran.returncode == 0 and re.match(r"--hostfile \S+ -np 16 --bind-to none ", command), ran.stderr
    assert "--map-by ppr:8:node" in command and "-x NCCL_P2P_DISABLE" in command and "-x NCCL_IB_HCA" in command
    assert "-x TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC" in command and "-x TORCH_EXTENSIONS_DIR" in command, command
    assert "-x GLOO_SOCKET_IFNAME" in command, command
    sweep = launch_script("multi_node.sh", str(hosts), "16", "-m", "seed=1,2", RUN_NAME="sweep_v1.2+b@ib-0")
    assert sweep.stdout.splitlines()[-1].endswith("-m trainer -m run_name='sweep_v1.2+b@ib-0' seed=1,2"), sweep.stderr
    (tmp_path / "bare.txt").write_text("node01\n")
    for script in ["single_node.sh", "multi_node.sh"]:
        missing = launch_script(script, *(["2"] if script == "single_node.sh" else [str(hosts), "16"]),
                                MPIRUN="mpirun-not-installed -v")
        # Its one line before anything slow: the extension's build (a minute on a GPU node; on CPUs a line on stdout)
        # ran first.
        assert missing.returncode == 127 and len(missing.stderr.splitlines()) == 1, missing.stderr
        assert missing.stdout == "", missing.stdout
        assert "no MPI launcher 'mpirun-not-installed' on PATH" in missing.stderr and "set MPIRUN" in missing.stderr
    for script, arguments, environment, refusal in [
        ("single_node.sh", ["experiment=cpu_demo"], {},
         "NUM_GPUS must be a positive integer, not 'experiment=cpu_demo'"),
        ("single_node.sh", [], {}, "NUM_GPUS must be a positive integer, not ''; usage: launch/single_node.sh"),
        ("single_node.sh", ["0"], {}, "NUM_GPUS must be a positive integer, not '0'"),
        ("single_node.sh", ["2"], {"RUN_NAME": "lr=3e-4"}, "RUN_NAME 'lr=3e-4': use letters, digits, spaces"),
        ("single_node.sh", ["2"], {"RUN_NAME": ".."}, "RUN_NAME '..': use letters, digits, spaces and ._+@-, not dots"),
        ("multi_node.sh", [], {}, "no readable hostfile ''; usage: launch/multi_node.sh"),
        ("multi_node.sh", [str(tmp_path / "none.txt"), "16"], {}, f"no readable hostfile '{tmp_path / 'none.txt'}'"),
        # A folder passed -r and ended in tr's "read error: Is a directory", exit code 1.
        ("multi_node.sh", [str(tmp_path), "16"], {}, f"no readable hostfile '{tmp_path}'"),
        ("multi_node.sh", [str(tmp_path / "bare.txt"), "16"], {},
         "its first host line must read 'NAME slots=GPUS', got 'node01'"),
        ("multi_node.sh", [str(hosts), "0"], {}, "NUM_PROCESSES must be a positive integer, not '0'"),
        ("multi_node.sh", [str(hosts), "16"], {"RUN_NAME": "lr=3e-4"}, "RUN_NAME 'lr=3e-4': use letters, digits"),
        ("multi_node.sh", [str(hosts), "16"], {"RUN_NAME": ".."}, "RUN_NAME '..': use letters, digits, spaces"),
    ]:
        refused = launch_script(script, *arguments, **environment)
        assert refused.returncode == 2 and refusal in refused.stderr and "trainer" not in refused.stdout, refused.stderr


@pytest.mark.parametrize("lines, refusal", [
    (["node02 slots=4"], "line 3: 'node02 slots=4'"),  # 8 ranks on a node of 4 GPUs (--map-by ppr:8:node)
    (["node02"], "line 3: 'node02'"),
    (["node02 slots=eight"], "line 3: 'node02 slots=eight'"),
    (["slots=8"], "line 3: 'slots=8'"),  # no name
])
def test_the_multi_node_script_refuses_a_host_line_unlike_the_first_before_the_build(tmp_path, lines, refusal):
    """Only the first host line was checked: a later one without a name, without slots= or with another count went
    on to the build and mpirun, which refused it then or put the first line's count of ranks on that node."""
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("\n".join(["node01 max_slots=8 slots=8", "# the second node", *lines, ""]))
    refused = launch_script("multi_node.sh", str(hosts), "16", "experiment=cpu_demo")
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout + refused.stderr
    assert refused.stderr == f"{hosts}: every host line must read 'NAME slots=8', the first line's count, {refusal}\n"


def test_the_multi_node_script_reads_a_hosts_slots_past_a_comment_at_the_lines_end(tmp_path):
    """OpenMPI's hostfile parser ends a line at its #: a slots= in a comment after a host's own was taken for a
    second count (refused as the garbled 'NAME slots=4slots=8'), or for the line's count, where it hid another."""
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("node01 slots=4  # was slots=8\nnode02 slots=4#slots=8\n")
    ran = launch_script("multi_node.sh", str(hosts), "8", "experiment=cpu_demo", PRNN_AN4=str(find_an4()))
    assert ran.returncode == 0 and " --map-by ppr:4:node " in ran.stdout.splitlines()[-1], ran.stdout + ran.stderr
    hosts.write_text("node01 slots=8\nnode02 slots=4 # was slots=8\n")
    refused = launch_script("multi_node.sh", str(hosts), "16", "experiment=cpu_demo")
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout + refused.stderr
    assert refused.stderr == (f"{hosts}: every host line must read 'NAME slots=8', the first line's count, "
                              "line 2: 'node02 slots=4'\n")


def test_the_multi_node_script_refuses_a_host_listed_twice_before_the_build(tmp_path):
    """OpenMPI takes a host listed twice for one node, its slots added up, where --map-by ppr:N:node places N ranks:
    8 ranks on `node01 slots=4` twice passed the script's count of 8 slots, and mpirun refused them after the build."""
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("node01 slots=4\n# the second node\nnode01 slots=4\n")
    refused = launch_script("multi_node.sh", str(hosts), "8", "experiment=cpu_demo")
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout + refused.stderr
    assert refused.stderr == (f"{hosts}: host node01 is listed twice, lines 1 and 3, which OpenMPI takes for one node "
                              "of 4 ranks: list each node once\n")


def test_the_multi_node_script_refuses_more_ranks_than_the_hosts_slots_before_the_build(tmp_path):
    """9 ranks on two nodes of 4 slots went on to the check, the build and mpirun, which refused them then."""
    calls, python = tmp_path / "python_calls.txt", tmp_path / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("# the allocation\nnode01 slots=4\n\nnode02 slots=4\n")
    refused = launch_script("multi_node.sh", str(hosts), "9", "experiment=cpu_demo", PYTHON=str(python))
    assert refused.returncode == 2 and refused.stdout == "" and not calls.exists(), refused.stdout + refused.stderr
    assert refused.stderr == f"NUM_PROCESSES 9 is more than the 8 slots of {hosts} (2 host lines of slots=4)\n"
    # A count of one in the singular, as the trainer's messages word one (data.text.counted): "1 host lines".
    for line, refusal in [("node01 slots=4", "the 4 slots of {} (1 host line of slots=4)"),
                          ("node01 slots=1", "the 1 slot of {} (1 host line of slots=1)")]:
        one_host = tmp_path / "one_host.txt"
        one_host.write_text(f"{line}\n")
        refused = launch_script("multi_node.sh", str(one_host), "5", "experiment=cpu_demo")
        assert (refused.returncode, refused.stderr) == (2, f"NUM_PROCESSES 5 is more than {refusal.format(one_host)}\n")
    for fewer_or_as_many in ("4", "8"):
        ran = launch_script("multi_node.sh", str(hosts), fewer_or_as_many, "experiment=cpu_demo",
                            "train.global_batch_size=16")
        assert ran.returncode == 0, ran.stderr
        command = ran.stdout.splitlines()[-1]
        assert command.startswith(f"--hostfile {hosts} -np {fewer_or_as_many} "), ran.stdout
        assert " --map-by ppr:4:node " in command, command  # the hosts' slots: 4 ranks a node, not 8


@pytest.mark.parametrize("overrides, refusal", [
    (["train.epoch=3"], "error: unknown config key train.epoch (did you mean train.epochs?)"),
    (["model.depth=0"], "error: model.depth must be a positive integer, not 0"),
    (["-m", "seed=1,2", "optim.lr=0.1,-1"],
     "error: sweep job 1 (seed=1 optim.lr=-1): optim.lr must be a positive number, not -1"),
    (["-m", "seed=1,2", "train.epoch=3"], "error: unknown config key train.epoch (did you mean train.epochs?)"),
    (["-m", "seed=${hydra:job.num}", "model.depth=2,0"],  # the check resolved it: a traceback, exit 1
     "error: sweep job 1 (model.depth=0): model.depth must be a positive integer, not 0"),
    # A run_name the trainer refuses, given after the script's own: it passed the check, and every rank refused it.
    *[(sweep + ["run_name=a/b"], "error: run_name='a/b' must name one folder of runs/: a name, not empty, null or "
       "true/false, not dots alone, no / or \\") for sweep in ([], ["-m", "seed=1,2"])],
])
def test_the_launch_scripts_refuse_a_jobs_overrides_before_the_build(tmp_path, overrides, refusal):
    """A misspelt key, a value the trainer refuses, or either in one job of a sweep, was found out by the ranks, after
    the extension's build (a minute on a GPU node; on CPUs its line on stdout) and every rank's start."""
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("node01 slots=8\n")
    for script, counts in [("single_node.sh", ["2"]), ("multi_node.sh", [str(hosts), "8"])]:
        refused = launch_script(script, *counts, *overrides)
        assert refused.returncode == 2 and refused.stderr == f"{refusal}\n", refused.stderr
        assert refused.stdout == "", refused.stdout


def test_the_launch_scripts_refuse_a_global_batch_their_rank_count_does_not_divide_before_the_build(tmp_path):
    """The check knew no rank count: the job passed it and the build, then every rank refused it, leaving runs/NAME/
    with its .lock and log behind. A sweep's every job, as the ranks would refuse the job's own."""
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("node01 slots=4\nnode02 slots=4\nnode03 slots=4\n")
    refusal = "train.global_batch_size=32: global_batch_size 32 must be a positive multiple of world_size 12\n"
    for script, counts in [("single_node.sh", ["12"]), ("multi_node.sh", [str(hosts), "12"])]:
        refused = launch_script(script, *counts, "experiment=an4_gpu", RUN_NAME="uneven")
        assert refused.returncode == 2 and refused.stderr == f"error: {refusal}", refused.stderr
        assert refused.stdout == "", refused.stdout
    refused = launch_script("single_node.sh", "2", "-m", "experiment=cpu_demo", "train.global_batch_size=2,3",
                            RUN_NAME="uneven")
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout + refused.stderr
    assert refused.stderr == ("error: sweep job 1 (train.global_batch_size=3): train.global_batch_size=3: "
                              "global_batch_size 3 must be a positive multiple of world_size 2\n"), refused.stderr
    assert not (REPO_ROOT / "runs" / "uneven").exists()


@pytest.mark.parametrize("flags, refused_flag", [
    (["--config-name", "other"], "--config-name other"),
    (["-cn", "other"], "--config-name other"),
    (["--config-path=../elsewhere"], "--config-path ../elsewhere"),
    (["--config-dir", "conf"], "--config-dir conf"),
])
def test_the_launch_scripts_refuse_another_config_than_the_one_checked_before_the_build(flags, refused_flag):
    """The check composed conf/train.yaml whatever --config-name named: `single_node.sh 2 --config-name other` passed
    it and the build, then every rank failed ("Cannot find primary config 'other'")."""
    refused = launch_script("single_node.sh", "2", *flags, RUN_NAME="other")
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout + refused.stderr
    assert refused.stderr == (f"error: {refused_flag}: the launch scripts and their check of the overrides take "
                              "conf/train.yaml only; choose a recipe with experiment=NAME (conf/experiment/NAME.yaml)\n"
                              ), refused.stderr


def test_the_launch_scripts_refuse_hydras_printing_flags_before_the_build():
    """`single_node.sh 2 --cfg job` passed the check and the build, then every rank printed the config."""
    refused = launch_script("single_node.sh", "2", "--cfg", "job", RUN_NAME="printed")
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout + refused.stderr
    assert refused.stderr.startswith("error: --cfg job prints and trains nothing, once on every rank"), refused.stderr


def test_the_launch_scripts_refuse_an_unknown_flag_in_one_line_before_the_build():
    """The check refused it after argparse's usage block, nine lines of Hydra's flags."""
    refused = launch_script("single_node.sh", "2", "--foo", RUN_NAME="other")
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout + refused.stderr
    assert refused.stderr == "error: unrecognized arguments: --foo\n", refused.stderr


@pytest.mark.parametrize("flag", [["--world-size", "4"], ["--wor", "4"], ["--world-size=4"]])
def test_the_launch_scripts_refuse_a_world_size_among_the_overrides_before_the_build(flag):
    """The trainer takes no --world-size: the check took one among the overrides for its count of ranks in place of
    the script's, passing a global batch of 8 that 3 ranks cannot split, then every rank failed on the flag."""
    refused = launch_script("single_node.sh", "3", "experiment=cpu_demo", *flag, RUN_NAME="counted")
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout + refused.stderr
    assert refused.stderr.startswith("error: ") and "--world-size" in refused.stderr, refused.stderr
    assert len(refused.stderr.splitlines()) == 1, refused.stderr


def test_the_launch_scripts_refuse_a_sweep_two_of_whose_jobs_get_one_folder_before_the_build():
    """As the trainer refuses it before its first job: here it was found out after the build and every rank's start."""
    refused = launch_script("single_node.sh", "2", "-m", "train.max_steps=1,2", RUN_NAME="one")
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout + refused.stderr
    assert refused.stderr.startswith("error: sweep job 1 (train.max_steps=2): runs/one is job 0's folder too: "), (
        refused.stderr)


def test_the_launch_scripts_pass_a_sweep_whose_m_follows_its_overrides_as_the_trainer_takes_it():
    """python -m trainer seed=1,2 -m is a sweep: the check took the -m for an override it could not parse, exit 2."""
    sweep = launch_script("single_node.sh", "2", "seed=1,2", "-m", RUN_NAME="sweep")
    assert sweep.returncode == 0 and sweep.stderr == "", sweep.stderr
    assert sweep.stdout.splitlines()[-1].endswith("-m trainer run_name='sweep' seed=1,2 -m"), sweep.stdout
    sweep = launch_script("single_node.sh", "2", "--multirun", "seed=1,2", RUN_NAME="sweep")  # first, as -m
    assert sweep.returncode == 0 and sweep.stderr == "", sweep.stderr
    assert sweep.stdout.splitlines()[-1].endswith("-m trainer --multirun run_name='sweep' seed=1,2"), sweep.stdout
    refused = launch_script("single_node.sh", "2", "model.depth=0,2", "--multirun", RUN_NAME="sweep")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr == "error: sweep job 0 (model.depth=0): model.depth must be a positive integer, not 0\n"


def test_the_launch_scripts_check_a_sweep_leaving_nothing_behind(tmp_path):
    """The check composes each job without making its run directory, its sweep's multirun.yaml or .hydra/."""
    sweep = launch_script("single_node.sh", "2", "-m", "seed=1,2", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                          f"hydra.run.dir={tmp_path / 'run'}", RUN_NAME="sweep")
    assert sweep.returncode == 0, sweep.stderr
    assert sweep.stdout.splitlines()[-1].endswith(f"-m trainer -m run_name='sweep' seed=1,2 "
                                                  f"hydra.sweep.dir={tmp_path / 'sweep'} "
                                                  f"hydra.run.dir={tmp_path / 'run'}"), sweep.stdout
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def test_the_launch_scripts_answer_help_with_their_usage_and_settings():
    """`launch/single_node.sh --help` was refused as a count, "NUM_GPUS must be a positive integer, not '--help'",
    exit code 2, and the settings the scripts read from the environment were written only in their source. Among the
    overrides (`single_node.sh 2 experiment=cpu_demo --help`), the check of the overrides printed its own help, exit
    code 0, then the script built and started the job, every rank printing the trainer's help."""
    for script, settings in [("single_node.sh", ["PYTHON", "MPIRUN", "RUN_NAME"]),
                             ("multi_node.sh", ["PYTHON", "MPIRUN", "RUN_NAME", "MASTER_ADDR", "MASTER_PORT",
                                                "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "GLOO_SOCKET_IFNAME"])]:
        for arguments in (["--help"], ["-h"], ["2", "experiment=cpu_demo", "--help"]):
            ran = launch_script(script, *arguments)
            assert ran.returncode == 0 and ran.stderr == "", ran.stderr
            assert ran.stdout.startswith(f"usage: launch/{script} "), ran.stdout
            assert all(setting in ran.stdout for setting in settings), ran.stdout
            assert "#" not in ran.stdout and "-np " not in ran.stdout, ran.stdout  # no comment marks, nothing launched


@pytest.mark.parametrize("flag", ["--hel", "--he", "-mh"])
def test_the_launch_scripts_refuse_a_help_abbreviated_or_grouped_before_the_build(flag):
    """Hydra's parser takes `--hel` and `-mh` for --help, which the scripts' own answer, to -h and --help alone, let
    through: the check of the overrides printed its help, exit code 0, then the script started the job, every rank
    printing the trainer's."""
    ran = launch_script("single_node.sh", "2", "experiment=cpu_demo", flag)
    assert ran.returncode == 2 and "-np " not in ran.stdout, (ran.stdout, ran.stderr)
    assert ran.stderr.startswith("error: ") and "--help" in ran.stderr and len(ran.stderr.splitlines()) == 1, ran.stderr


@pytest.mark.parametrize("arguments", [["--help"], ["-m", "experiment=an4_gpu", "-h"]])
def test_the_slurm_script_answers_help_with_its_usage_and_starts_nothing(tmp_path, arguments):
    """Outside an allocation `launch/slurm.sbatch --help` was refused as not a batch job; inside one, among the
    overrides, the check of the overrides printed its own help, then srun built and started every rank."""
    ran = subprocess.run(["bash", str(REPO_ROOT / "launch" / "slurm.sbatch"), *arguments], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60, env={**os.environ, "SLURM_JOB_ID": ""})
    assert ran.returncode == 0 and ran.stderr == "", ran.stderr
    assert ran.stdout.startswith("usage: sbatch [options] launch/slurm.sbatch "), ran.stdout
    assert all(setting in ran.stdout for setting in ("PYTHON", "RUN_NAME", "SRUN_MPI", "MASTER_ADDR")), ran.stdout
    assert not any(line.startswith("#") for line in ran.stdout.splitlines()), ran.stdout  # comment marks taken off
    ran, recorded = slurm_script(tmp_path, *arguments)
    assert ran.returncode == 0 and ran.stdout.startswith("usage: ") and recorded == [], (ran.stdout, recorded)


def test_the_multi_node_script_forwards_only_the_variables_that_are_set(tmp_path):
    """OpenMPI's mpirun warns of each -x name it does not find (`Warning: could not find environment variable
    "PRNN_AN4"`, OpenMPI 4.1.6), which every start without PRNN_AN4 or PYTHONPATH set printed."""
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("node01 slots=8\nnode02 slots=8\n")
    # AN4's folder named as an override: the check refuses a default (../shared/data/an4) missing where this runs.
    ran = launch_script("multi_node.sh", str(hosts), "16", f"data.an4_source={find_an4()}", PRNN_AN4=None,
                        PYTHONPATH=None, MASTER_PORT=None, LD_LIBRARY_PATH="/usr/local/cuda/lib64", NCCL_IB_HCA="mlx5")
    command = ran.stdout.splitlines()[-1]
    assert ran.returncode == 0 and "-x PATH -x LD_LIBRARY_PATH -x MASTER_ADDR " in command, ran.stderr
    assert "-x NCCL_IB_HCA " in command, command
    assert "PRNN_AN4" not in command and "PYTHONPATH" not in command and "MASTER_PORT" not in command, command
    ran = launch_script("multi_node.sh", str(hosts), "16", PRNN_AN4=str(find_an4()), PYTHONPATH=None, MASTER_PORT=None)
    assert "-x MASTER_ADDR -x PRNN_AN4 " in ran.stdout.splitlines()[-1], ran.stdout
    # Without mpi4py every rank reads rank 0's port from MASTER_PORT: the other nodes' ranks, not given it, were
    # refused as "MASTER_PORT unset" of a job whose user had set it.
    ran = launch_script("multi_node.sh", str(hosts), "16", f"data.an4_source={find_an4()}", PRNN_AN4=None,
                        PYTHONPATH=None, MASTER_PORT="29511")
    assert "-x MASTER_ADDR -x MASTER_PORT " in ran.stdout.splitlines()[-1], ran.stdout


def test_the_multi_node_script_gives_the_ranks_the_first_hosts_address_unless_one_is_set(tmp_path):
    """Rank 0's address for the process group: the hostfile's first host past its comments, or the user's MASTER_ADDR
    (an address on the fast network)."""
    mpirun = tmp_path / "mpirun"  # says the address its ranks would get
    mpirun.write_text('#!/bin/sh\necho "MASTER_ADDR=$MASTER_ADDR"\n')
    mpirun.chmod(0o755)
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("# the allocation\n\nnode01 slots=8\nnode02 slots=8\n")
    for master_addr, expected in [(None, "node01"), ("node01-ib", "node01-ib")]:
        ran = launch_script("multi_node.sh", str(hosts), "16", MPIRUN=str(mpirun), MASTER_ADDR=master_addr)
        assert ran.returncode == 0 and ran.stdout.splitlines()[-1] == f"MASTER_ADDR={expected}", ran.stdout + ran.stderr


def test_the_multi_node_script_gives_mpirun_a_windows_hostfile_without_its_carriage_returns(tmp_path):
    """OpenMPI's hostfile lexer (ORTE's and PRRTE's hostfile_lex.l) takes no \\r for white space: a hostfile saved by
    a Windows editor passed the script's own checks, which take the \\r off, and mpirun then stopped on it with "a
    parse error in the hostfile", after the check and the build."""
    mpirun = tmp_path / "mpirun"  # says what the hostfile it was given holds, \r as <CR>, and its path
    mpirun.write_text('#!/bin/sh\n[ "$1" = --hostfile ] || exit 0\necho "path=$2"\nsed "s/\\r/<CR>/g" "$2"\n')
    mpirun.chmod(0o755)
    folder = tmp_path / "a folder"
    folder.mkdir()
    for text, path_given in [("# the allocation\r\nnode01 slots=8\r\nnode02 slots=8", False),
                             ("# the allocation\nnode01 slots=8\nnode02 slots=8\n", True)]:
        hosts = folder / "hosts.txt"
        hosts.write_bytes(text.encode())
        ran = launch_script("multi_node.sh", str(hosts), "16", MPIRUN=str(mpirun), TMPDIR=str(folder),
                            PRNN_AN4=str(find_an4()))
        assert ran.returncode == 0, ran.stdout + ran.stderr
        given, *lines = ran.stdout.split("path=", 1)[-1].splitlines()
        assert lines == ["# the allocation", "node01 slots=8", "node02 slots=8"], ran.stdout
        assert (given == str(hosts)) == path_given, given
        assert sorted(folder.iterdir()) == [hosts], "the copy is left behind"
        assert hosts.read_bytes() == text.encode()


def test_the_launch_scripts_build_the_extension_once_after_the_check_and_before_the_ranks(tmp_path):
    """Ranks started without the script's build each built the extension on first use, in turn under the build's
    lock (a minute each on a GPU node)."""
    calls, python = tmp_path / "python_calls.txt", tmp_path / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("node01 slots=8\n")
    for script, counts in [("single_node.sh", ["2"]), ("multi_node.sh", [str(hosts), "8"])]:
        calls.unlink(missing_ok=True)
        ran = launch_script(script, *counts, "experiment=cpu_demo", PYTHON=str(python), RUN_NAME="built")
        assert ran.returncode == 0, ran.stderr
        assert calls.read_text().splitlines() == [f"-m trainer.check_overrides --world-size {counts[-1]} "
                                                  "run_name='built' experiment=cpu_demo",
                                                  "-m prnn_kernels.build --if-gpu"], calls.read_text()
        assert ran.stdout.splitlines()[-1].endswith(f"{python} -m trainer run_name='built' experiment=cpu_demo")


@needs_mpiexec
def test_a_sweep_runs_through_the_launch_script(an4_slice, tmp_path):
    """`launch/single_node.sh 2 -m key=a,b`: the script's run_name came before -m, and Hydra's parser, which takes the
    overrides as one run of arguments, refused the rest on every rank ("unrecognized arguments")."""
    settings = [*TINY_RUN, "train.epochs=1", f"data.train_manifests=[{an4_slice['train']}]",
                f"data.eval_manifest={an4_slice['test']}", f"hydra.sweep.dir={tmp_path}", "seed=1,2"]
    ran = launch_script("single_node.sh", "2", "-m", *settings, RUN_NAME="sweep", MPIRUN=MPIEXEC,
                        **{name: JOB_ENV[name] for name in ("OMP_NUM_THREADS", "OMPI_ALLOW_RUN_AS_ROOT",
                                                            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")})
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.count("final test WER") == 2, ran.stdout  # each job's, from rank 0


@needs_mpiexec
def test_the_multi_node_script_refuses_mpichs_launcher_naming_it(tmp_path):
    """launch/multi_node.sh passes OpenMPI's options (-x, --map-by); MPICH's mpiexec, which pip's mpich installs as
    mpirun too, stopped on them with a parse error of its own, exit code 255."""
    if not LAUNCHER_IS_MPICH:
        pytest.skip("this mpiexec is not MPICH's")
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("node01 slots=2\n")
    refused = launch_script("multi_node.sh", str(hosts), "2", "experiment=cpu_demo", MPIRUN=f"{MPIEXEC} -v")
    assert refused.returncode == 2, refused.stderr
    assert f"MPIRUN '{MPIEXEC} -v' is MPICH's launcher: launch/multi_node.sh" in refused.stderr, refused.stderr


def test_the_multi_node_script_refuses_mpichs_launcher_however_it_writes_its_version(tmp_path):
    """The check read `mpirun --version | grep -q HYDRA` under pipefail: grep stops at its first match, and a launcher
    still writing then dies of SIGPIPE, which failed the pipe and let MPICH's launcher through at random."""
    launcher = tmp_path / "mpiexec"  # MPICH's banner first, then more lines after grep has read it
    launcher.write_text("#!/bin/sh\necho 'HYDRA build details:'\nsleep 0.5\nseq 100000\n")
    launcher.chmod(0o755)
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("node01 slots=2\n")
    refused = launch_script("multi_node.sh", str(hosts), "2", "experiment=cpu_demo", MPIRUN=str(launcher))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"MPIRUN '{launcher}' is MPICH's launcher" in refused.stderr, refused.stderr


RANK_STAND_IN = """
import os, signal, sys, time
from pathlib import Path
# Set by the stand-in mpirun, or by MPICH's or OpenMPI's mpiexec.
rank = os.environ.get("RANK") or os.environ.get("PMI_RANK") or os.environ["OMPI_COMM_WORLD_RANK"]

def stop(number, frame):  # as the trainer does: the step in progress, then last.pt (STOP_S), then 128 + number
    if Path(f"stopping{rank}").exists():  # a second Ctrl-C: out at once, in one line (the trainer aborts the job)
        Path(f"rank{rank}").write_text("interrupted")
        os._exit(128 + number)
    Path(f"stopping{rank}").write_text("")
    time.sleep(float(os.environ.get("STOP_S", "1.5")))
    Path(f"rank{rank}").write_text(signal.Signals(number).name)
    sys.exit(128 + number)

for number in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
    signal.signal(number, stop)
Path(f"ready{rank}").write_text("")
time.sleep(60)
"""

# OpenMPI's mpirun as measured (README, Multi-GPU training), only harsher: on Ctrl-C or SIGTERM it kills its ranks at
# once, where OpenMPI passes SIGTERM on and kills a second later; it passes no SIGUSR1 on. Beside its two ranks it
# starts a process as its connection to another node, which must not be signalled.
OPENMPI_STAND_IN = """#!/usr/bin/env bash
[[ $1 == --version ]] && { echo "VERSION"; exit 0; }
shift 4  # -np 2 --bind-to none
sleep 60 & children=($!)
for rank in 0 1; do RANK=$rank "$@" & children+=($!); done
trap 'kill -KILL "${children[@]}"; touch terminated; exit 1' INT TERM
trap '' USR1
status=0
for pid in "${children[@]:1}"; do wait "$pid" || status=$?; done
kill -0 "${children[0]}" || exit 99  # the connection died
kill "${children[0]}"
exit $status
"""


def start_single_node_script(tmp_path: Path, mpirun: str, **environment: str) -> subprocess.Popen:
    """`single_node.sh 2 experiment=cpu_demo` under `mpirun`, in a session of its own, its output piped, in `tmp_path`
    with a stand-in `trainer` package there: its check of the overrides passes, and its ranks run RANK_STAND_IN."""
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "__init__.py").write_text("")
    (tmp_path / "trainer" / "__main__.py").write_text(RANK_STAND_IN)
    (tmp_path / "trainer" / "check_overrides.py").write_text("")
    return subprocess.Popen(
        [str(REPO_ROOT / "launch" / "single_node.sh"), "2", "experiment=cpu_demo"], cwd=tmp_path,
        env={**os.environ, "PYTHON": sys.executable, "MPIRUN": mpirun, "PYTHONPATH": str(REPO_ROOT), **environment},
        start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def start_launch_script(tmp_path, mpirun: str | None = None, version: str = "mpirun (Open MPI) 4.1.6",
                        stop_s: float = 1.5) -> subprocess.Popen:
    """single_node.sh with 2 ranks under `mpirun` (default: the stand-in OpenMPI mpirun, saying `version`), whose
    ranks run a stand-in `trainer` package in the working directory; returns once both ranks have started."""
    if mpirun is None:
        mpirun = str(tmp_path / "mpirun")
        (tmp_path / "mpirun").write_text(OPENMPI_STAND_IN.replace("VERSION", version))
        (tmp_path / "mpirun").chmod(0o755)
    script = start_single_node_script(tmp_path, mpirun, STOP_S=str(stop_s))
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{rank}").exists() for rank in (0, 1)):
        if script.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(script.pid, signal.SIGKILL)
            pytest.fail(script.communicate()[0])
        time.sleep(0.1)
    return script


@pytest.mark.parametrize("mpi", ["openmpi_stand_in", "openmpi_mpiexec_stand_in",
                                 pytest.param("mpiexec", marks=needs_mpiexec)])
@pytest.mark.parametrize("stop_signal, to_the_group", [(signal.SIGINT, True), (signal.SIGUSR1, False),
                                                       (signal.SIGTERM, False), (signal.SIGHUP, True)])
def test_the_launch_script_passes_stop_signals_on_to_the_ranks_once(tmp_path, mpi, stop_signal, to_the_group):
    """A terminal's Ctrl-C or hangup (to every process of its group) or a signal to the script reaches each rank
    once, as itself (a hangup as SIGTERM), and the ranks have the time to stop cleanly: under OpenMPI's mpirun, which
    would not wait for them, from the script itself; under MPICH's mpiexec, which passes signals on, through it. The
    real mpiexec is MPICH's where the `test` extra installed it, OpenMPI's on the GPU machine."""
    if mpi == "mpiexec":
        script = start_launch_script(tmp_path, MPIEXEC)
    else:  # OpenMPI's mpiexec calls itself OpenRTE
        version = "mpiexec (OpenRTE) 4.1.6" if mpi == "openmpi_mpiexec_stand_in" else "mpirun (Open MPI) 4.1.6"
        script = start_launch_script(tmp_path, version=version)
    try:
        os.killpg(script.pid, stop_signal) if to_the_group else os.kill(script.pid, stop_signal)
        output = script.communicate(timeout=60)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(script.pid, signal.SIGKILL)
    stopped_by = signal.SIGTERM if stop_signal == signal.SIGHUP else stop_signal
    assert script.returncode == 128 + stopped_by, output
    assert [(tmp_path / f"rank{rank}").read_text() for rank in (0, 1)] == [stopped_by.name] * 2


@pytest.mark.parametrize("mpirun_exit", [1, 0])  # 0: the job had ended as the signal came
def test_under_openmpi_a_stop_signal_reaches_mpirun_where_this_node_runs_no_rank(tmp_path, mpirun_exit):
    """A script started on a node outside the job's hosts (multi_node.sh from a login node): mpirun's children here
    are its connections to the nodes, none of them a rank, so the signal goes to mpirun, which passes it on there.
    The script's exit code is mpirun's, after the signal as before it."""
    mpirun = tmp_path / "mpirun"
    mpirun.write_text('#!/usr/bin/env bash\n[[ $1 == --version ]] && { echo "mpirun (Open MPI) 4.1.6"; exit 0; }\n'
                      'sleep 60 & connection=$!\n'
                      f'trap \'kill $connection; touch terminated; exit {mpirun_exit}\' TERM\n'
                      'touch started\nwait $connection\n')
    mpirun.chmod(0o755)
    script = start_single_node_script(tmp_path, str(mpirun))
    try:
        wait_for_file(tmp_path / "started", script, timeout_s=60)
        script.send_signal(signal.SIGTERM)
        output = script.communicate(timeout=30)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(script.pid, signal.SIGKILL)
    assert script.returncode == mpirun_exit and (tmp_path / "terminated").exists(), output


@needs_mpiexec
def test_under_mpich_a_second_ctrl_c_reaches_the_ranks_not_mpiexec(tmp_path):
    """MPICH's mpiexec takes a second Ctrl-C as an order to kill the job at once (exit 255, and no rank's line naming
    its checkpoint): the script passes the first on to it and the second to the ranks."""
    script = start_launch_script(tmp_path, MPIEXEC, stop_s=30)
    try:
        os.killpg(script.pid, signal.SIGINT)
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"stopping{rank}").exists() for rank in (0, 1)):
            assert time.monotonic() < deadline and script.poll() is None, script.communicate()[0]
            time.sleep(0.1)
        os.killpg(script.pid, signal.SIGINT)
        output = script.communicate(timeout=20)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(script.pid, signal.SIGKILL)
    assert script.returncode == 128 + signal.SIGINT, output
    assert [(tmp_path / f"rank{rank}").read_text() for rank in (0, 1)] == ["interrupted"] * 2, output


def test_under_mpich_a_second_ctrl_c_where_no_rank_runs_reaches_mpiexec(tmp_path):
    """Before mpiexec has started a rank, or after they have all ended, a second Ctrl-C found no rank to pass to and
    went nowhere (`pkill -P ""`, its usage on the terminal), and the job ran on; mpiexec gets it there."""
    # MPICH's as far as the script can tell, with no child: it takes a first Ctrl-C, and a second ends it. In Python,
    # as bash cannot trap the SIGINT that a script's background command starts with ignored.
    mpiexec = tmp_path / "mpiexec"
    mpiexec.write_text(f"#!{sys.executable}\n" + textwrap.dedent("""
        import pathlib, signal, sys, time
        if sys.argv[1:] == ["--version"]:
            sys.exit(print("HYDRA build details:"))
        def interrupted(number, frame):
            if pathlib.Path("interrupted").exists():
                sys.exit(130)
            pathlib.Path("interrupted").write_text("")
        signal.signal(signal.SIGINT, interrupted)
        pathlib.Path("started").write_text("")
        time.sleep(60)
        sys.exit(99)
        """))
    mpiexec.chmod(0o755)
    script = start_single_node_script(tmp_path, str(mpiexec))
    try:
        wait_for_file(tmp_path / "started", script, timeout_s=60)
        os.killpg(script.pid, signal.SIGINT)
        wait_for_file(tmp_path / "interrupted", script, timeout_s=30)
        os.killpg(script.pid, signal.SIGINT)
        output = script.communicate(timeout=30)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(script.pid, signal.SIGKILL)
    assert script.returncode == 130 and "Usage" not in output, output


def test_under_openmpi_a_launch_script_killed_outright_takes_mpirun_with_it(tmp_path):
    script = start_launch_script(tmp_path)
    os.killpg(script.pid, signal.SIGKILL)
    script.communicate(timeout=60)
    wait_until = time.monotonic() + 30
    while not (tmp_path / "terminated").exists():  # the stand-in mpirun got SIGTERM (and killed its ranks)
        assert time.monotonic() < wait_until, "mpirun runs on without the script"
        time.sleep(0.1)


def slurm_script(tmp_path: Path, *arguments: str, trainer_exit: int = 0,
                 **environment: str) -> tuple[subprocess.CompletedProcess, list]:
    """launch/slurm.sbatch run under stand-ins for srun and scontrol that record their arguments, its srun's trainer
    exiting `trainer_exit`, and `environment` added to the job's: what it did, and the stand-ins' calls."""
    calls = tmp_path / "calls.txt"
    srun = (f'echo "srun $* (SRUN_CPUS_PER_TASK=${{SRUN_CPUS_PER_TASK-}})" >> {calls}; '
            f'[[ $* == *" -m trainer "* ]] && exit {trainer_exit}; exit 0')
    environment = {**slurm_stand_ins(tmp_path, calls, srun), **environment}
    ran = subprocess.run(["bash", str(REPO_ROOT / "launch" / "slurm.sbatch"), *arguments], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60, env=environment)
    return ran, calls.read_text().splitlines() if calls.exists() else []


def slurm_stand_ins(tmp_path: Path, calls: Path, srun: str) -> dict:
    """The environment of a batch job of node07-08 whose srun runs the bash `srun` and whose scontrol records its
    calls in `calls`: both stand-ins in `tmp_path`, first on PATH."""
    # Both of the allocation's nodes, as `scontrol show hostnames node[07-08]` lists them: rank 0's is the first.
    scontrol = f'echo "scontrol $*" >> {calls}; [[ $1 == show ]] && printf "node07\\nnode08\\n"; exit 0'
    for tool, body in (("srun", srun), ("scontrol", scontrol)):
        (tmp_path / tool).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (tmp_path / tool).chmod(0o755)
    return {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_NTASKS": "16", "SLURM_CPUS_PER_TASK": "8",
            "PYTHON": sys.executable}


@pytest.mark.parametrize("sweep", [["-m"], ["--multirun"], []])
@pytest.mark.parametrize("trainer_exit", [0, 1, 128 + signal.SIGUSR1])
def test_the_slurm_script_queues_itself_again_when_the_time_limits_signal_stopped_the_trainer(tmp_path, trainer_exit,
                                                                                               sweep):
    """A trainer that exits 128 + SIGUSR1 (stopped ahead of the time limit, its checkpoint written) has the job
    requeued; any other exit is the job's own. A sweep's -m the script passes first."""
    ran, recorded = slurm_script(tmp_path, *sweep, "experiment=an4_gpu", trainer_exit=trainer_exit)
    assert ran.returncode == trainer_exit, ran.stderr
    # Each rank gets the allocation's cores per task (srun no longer takes them from it since Slurm 22.05).
    assert (f"srun --mpi=pmix {sys.executable} -m trainer {' '.join(sweep + [''])}run_name='slurm-4242' "
            "train.resume=auto experiment=an4_gpu (SRUN_CPUS_PER_TASK=8)") in recorded, recorded
    assert ("scontrol requeue 4242" in recorded) == (trainer_exit == 128 + signal.SIGUSR1), recorded


@pytest.mark.parametrize("name, ranks_exit", [
    ("SIGUSR1", 128 + signal.SIGUSR1), ("SIGTERM", 128 + signal.SIGTERM),
    ("SIGUSR1", 0),  # the ranks had finished the run when the signal came: the job is over, not to be queued again
])
def test_the_slurm_scripts_own_signal_reaches_the_ranks_and_the_time_limits_requeues_the_job(tmp_path, name,
                                                                                             ranks_exit):
    """scancel --batch or --full (and --signal=B:USR1@N) signal the batch script itself: under Slurm 22.05 it died at
    once of SIGUSR1 or SIGTERM, the ranks stopped only as the job ended, and a time limit's SIGUSR1 requeued nothing.
    The job's exit code is srun's, after the signal as before it."""
    calls, ranks_signal = tmp_path / "calls.txt", tmp_path / "ranks_signal"
    # The trainer's srun stands in for the ranks: it waits, then exits as they would on the signal it passed on.
    srun = (f'echo "srun $*" >> {calls}; [[ $* == *" -m trainer "* ]] || exit 0; '
            f'trap "echo USR1 > {ranks_signal}; exit {ranks_exit}" USR1; '
            f'trap "echo TERM > {ranks_signal}; exit {ranks_exit}" TERM; '
            f'echo started > {tmp_path}/started; for _ in {{1..300}}; do sleep 0.1; done; exit 1')
    script = subprocess.Popen(["bash", str(REPO_ROOT / "launch" / "slurm.sbatch"), "experiment=an4_gpu"],
                              cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=slurm_stand_ins(tmp_path, calls, srun))
    try:
        wait_until = time.monotonic() + 60
        while not (tmp_path / "started").exists():
            assert script.poll() is None and time.monotonic() < wait_until, script.communicate()
            time.sleep(0.1)
        script.send_signal(getattr(signal, name))
        out, err = script.communicate(timeout=30)
    finally:
        script.kill()
    assert ranks_signal.read_text().strip() == name.removeprefix("SIG"), (out, err)
    assert script.returncode == ranks_exit, (out, err)
    assert ("scontrol requeue 4242" in calls.read_text()) == (ranks_exit == 128 + signal.SIGUSR1), calls.read_text()


@pytest.mark.parametrize("overrides, refusal", [
    (["experiment=an4_gpu", "train.epoch=3"], "unknown config key train.epoch (did you mean train.epochs?)"),
    # Values the trainer's rules refuse, which a composition alone (--cfg job) let through, and a sweep's overrides,
    # which Hydra composes with no --cfg: found out after the build.
    (["model.depth=0"], "model.depth must be a positive integer, not 0"),
    (["-m", "train.epoch=3"], "unknown config key train.epoch (did you mean train.epochs?)"),
    (["-m", "optim.lr=0.1,-1"], "sweep job 1 (optim.lr=-1): optim.lr must be a positive number, not -1"),
])
def test_the_slurm_script_refuses_a_jobs_overrides_before_the_build(tmp_path, overrides, refusal):
    """The job built the extension (srun, a minute on a GPU node) before the ranks refused the overrides."""
    ran, recorded = slurm_script(tmp_path, *overrides)
    assert ran.returncode == 2 and ran.stderr == f"error: {refusal}\n", ran.stderr
    assert not any(call.startswith("srun ") for call in recorded), recorded


@pytest.mark.parametrize("run_name", ["lr=3e-4", ".."])
def test_the_slurm_script_refuses_a_run_name_before_srun(tmp_path, run_name):
    """As the other launch scripts: a '=' in it would end every rank in Hydra's parse error, after the build."""
    ran, recorded = slurm_script(tmp_path, "experiment=an4_gpu", RUN_NAME=run_name)
    assert ran.returncode == 2, ran.stderr
    assert ran.stderr == f"RUN_NAME '{run_name}': use letters, digits, spaces and ._+@-, not dots alone\n", ran.stderr
    assert recorded == [], recorded


@pytest.mark.parametrize("settings, pmi, master_addr, looked_up", [
    ({}, "pmix", "node07", ["scontrol show hostnames node[07-08]"]),
    # The user's, where set: pip's MPICH joins only under pmi2, and rank 0's address on the fast network.
    ({"SRUN_MPI": "pmi2", "MASTER_ADDR": "node07-ib"}, "pmi2", "node07-ib", []),
])
def test_the_slurm_script_builds_once_then_starts_the_ranks_with_the_first_nodes_address(tmp_path, settings, pmi,
                                                                                        master_addr, looked_up):
    """Ranks started without the build each built the extension on first use, in turn under the build's lock."""
    calls = tmp_path / "calls.txt"
    environment = slurm_stand_ins(tmp_path, calls, f'echo "srun $* (MASTER_ADDR=$MASTER_ADDR)" >> {calls}')
    environment.pop("MASTER_ADDR", None)
    environment.pop("SRUN_MPI", None)
    ran = subprocess.run(["bash", str(REPO_ROOT / "launch" / "slurm.sbatch"), "experiment=an4_gpu"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60, env={**environment, **settings})
    assert ran.returncode == 0, ran.stderr
    assert calls.read_text().splitlines() == [
        *looked_up,
        f"srun --ntasks=1 --nodes=1 {sys.executable} -m prnn_kernels.build --if-gpu (MASTER_ADDR={master_addr})",
        f"srun --mpi={pmi} {sys.executable} -m trainer run_name='slurm-4242' train.resume=auto experiment=an4_gpu "
        f"(MASTER_ADDR={master_addr})"], calls.read_text()


def test_the_slurm_script_refuses_a_global_batch_its_task_count_does_not_divide_before_the_build(tmp_path):
    """The batch script's SLURM_NTASKS is the job's rank count: the check knew none, and every rank refused it after
    the build."""
    ran, recorded = slurm_script(tmp_path, "experiment=an4_gpu", SLURM_NTASKS="12")
    assert ran.returncode == 2 and recorded == [], ran.stderr
    assert ran.stderr == ("error: train.global_batch_size=32: global_batch_size 32 must be a positive multiple of "
                          "world_size 12\n"), ran.stderr


def test_the_slurm_script_run_outside_a_slurm_job_says_so():
    """Run by hand (bash launch/slurm.sbatch) it ended on bash's "SLURM_JOB_ID: unbound variable", exit code 1."""
    environment = {name: value for name, value in os.environ.items() if not name.startswith("SLURM_")}
    ran = subprocess.run(["bash", str(REPO_ROOT / "launch" / "slurm.sbatch"), "experiment=an4_gpu"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60, env=environment)
    assert ran.returncode == 2, ran.stderr
    assert ran.stderr == ("launch/slurm.sbatch runs as a Slurm batch job, which it is not here: "
                          "sbatch [options] launch/slurm.sbatch [trainer overrides...]\n"), ran.stderr


def test_the_slurm_script_asks_for_the_time_limits_signal_and_may_be_requeued():
    """sbatch reads its options from the script's #SBATCH lines, up to the first command."""
    options = []
    for line in (REPO_ROOT / "launch" / "slurm.sbatch").read_text().splitlines()[1:]:
        if line.startswith("#SBATCH "):
            options += line.split()[1:]
        elif line.strip() and not line.startswith("#"):
            break
    # A requeued job keeps its id, so its log: without --open-mode=append the requeue truncated the first part.
    assert "--signal=USR1@180" in options and "--requeue" in options and "--open-mode=append" in options, options


def test_nccl_timeouts_end_the_process_within_the_timeout_unless_the_user_says_otherwise(monkeypatch):
    variables = ("TORCH_NCCL_ENABLE_MONITORING", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "TORCH_NCCL_DUMP_ON_TIMEOUT")
    for name in variables:  # set, then deleted: monkeypatch restores each as it was before the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    distributed.end_nccl_timeouts_promptly(10.4)
    assert [os.environ[name] for name in variables] == ["1", "10", "0"]
    # Rounded down to 0 (no heartbeat wait at all, which a mutant gave passing every test), a timeout under half a
    # second gets the monitor's least, 1 s.
    monkeypatch.delenv("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")
    distributed.end_nccl_timeouts_promptly(0.4)
    assert os.environ["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "1"
    monkeypatch.setenv("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "900")
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    distributed.end_nccl_timeouts_promptly(300)
    assert [os.environ[name] for name in variables] == ["1", "900", "1"]


def test_the_silent_rank_is_named_where_another_ranks_timeout_closed_its_connection():
    """Three ranks, rank 2 stopped: rank 1's collective timed out first, which closed its connections, so rank 0's
    failed on a peer gone, not a timeout of its own. Rank 1 said it timed out; rank 0 ended the job on a traceback
    naming no rank, before rank 1 had waited out the answers to name rank 2."""
    closed = RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:26512")
    timed_out = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv")
    assert distributed.silent_ranks_waited_for(closed, {1: distributed.TIMED_OUT_TOO, 2: None}) == [2]
    assert distributed.silent_ranks_waited_for(timed_out, {1: distributed.TIMED_OUT_TOO, 2: None}) == [2]
    assert distributed.silent_ranks_waited_for(timed_out, {1: None}) == [1]
    assert distributed.silent_ranks_waited_for(closed, {1: None, 2: None}) == []  # a rank ended: the rest may be alive


class SilentWorld:
    """An MPI world stand-in of `size` ranks, this one rank 0, whose other ranks never answer; a wait on it longer than
    `longest_s` fails the test at once rather than after the wait."""
    BYTE = None

    def __init__(self, size: int, longest_s: float):
        self.COMM_WORLD, self.size, self.deadline = self, size, time.monotonic() + longest_s

    def Get_size(self):
        return self.size

    def Get_rank(self):
        return 0

    def Test(self):
        assert time.monotonic() < self.deadline, "other_ranks_answers waited past the time it had"
        return False

    def Isend(self, *args, **kwargs):
        return self

    Irecv = Isend


@pytest.mark.parametrize("failure, timeout_s, waited_s", [
    ("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 500ms for recv operation to complete", 0.5, 0.5),
    ("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3600000ms for recv", 3600, 2.0),  # capped
    # Another collective of this rank's timed out first (DDP's bucket, beside sync batch norm's): no ms in the error.
    ("[gloo/transport/tcp/unbound_buffer.cc:81] Application timeout caused pair closure", 0.5, 0.5),
    ("[gloo/transport/tcp/pair.cc:561] Connection reset by peer [127.0.0.1]:26512", 0.5, 0.3),  # the abort's grace
    ("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:26512", 0.5, 0.3),
])
def test_a_failed_collective_waits_for_the_other_ranks_answers_as_long_as_it_says(monkeypatch, failure, timeout_s,
                                                                                   waited_s):
    """A timeout of gloo's waits the collectives' timeout for the other ranks to say theirs timed out too, at most
    LONGEST_ANSWER_WAIT_S; a peer gone waits the grace a failing rank gives its line."""
    monkeypatch.setattr(distributed, "LONGEST_ANSWER_WAIT_S", 2.0)
    monkeypatch.setattr(distributed, "ABORT_GRACE_S", 0.3)
    monkeypatch.setattr(distributed, "_mpi_of_a_gloo_job", lambda: SilentWorld(3, longest_s=waited_s + 1))
    start = time.monotonic()
    assert distributed.other_ranks_answers(RuntimeError(failure), timeout_s) == {1: None, 2: None}
    assert waited_s <= time.monotonic() - start < waited_s + 1
    assert distributed.other_ranks_answers(RuntimeError("CUDA out of memory"), timeout_s) is None


def test_a_collective_failed_by_another_of_its_ranks_timeouts_names_the_silent_rank():
    """gloo closes a rank's connections as one of its collectives times out, and another collective of that rank
    waiting beside it (sync batch norm's all-reduce in the backward, DDP's bucket timed out first) fails on the
    closure, in words that named no timeout: two ranks of experiment=cpu_demo, rank 1 stopped, ended on gloo's
    traceback, not the line naming rank 1."""
    closed_here = RuntimeError("Application timeout caused pair closure")
    assert distributed.silent_ranks_waited_for(closed_here, {1: None}) == [1]


@needs_mpiexec
def test_the_ranks_start_without_unpickling_what_another_rank_sent(tmp_path):
    """Rank 0's address and port, and which ranks share its node, reach the other ranks as bytes, not as mpi4py's
    pickles, which would run what they hold: with mpi4py's unpickling refused, two ranks still start their group."""
    # Each rank marks its start in a file of its own: two ranks' prints interleave in the job's output.
    start = ("import sys\n"
             "from pathlib import Path\n"
             "from mpi4py import MPI\n"
             "def refuse(*args):\n    raise AssertionError('a pickle from another rank was unpickled')\n"
             "MPI.pickle.__init__(loads=refuse)\n"
             "from trainer import distributed\n"
             "env = distributed.init('cpu', timeout_s=30)\n"
             "(Path(sys.argv[1]) / f'started rank {env.rank}').touch()\n"
             "distributed.shutdown()\n")
    code, output = run_job([MPIEXEC, "-n", 2, sys.executable, "-c", start, tmp_path], FAILURE_TIMEOUT_S)
    assert code == 0, output
    assert sorted(path.name for path in tmp_path.iterdir()) == ["started rank 0", "started rank 1"], output


def step_losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "step" in row}


@needs_mpiexec
@pytest.mark.parametrize("first, then", [(2, 1), (1, 2)])
def test_a_run_resumed_on_another_number_of_ranks_with_other_workers_trains_on_as_it_would_have(
        an4_slice, two_rank_run, tmp_path, first, then):
    """A node lost mid-epoch, or one added: the sampler's position counts global batches, the same utterances at any
    world size, so each later step trains on what the two ranks would have, the schedule going on from the step. A
    rank past those that wrote the checkpoint takes the last one's RNG state: with every test passing, its resume could
    be refused for want of one of its own."""
    code, output = run_job(trainer_command(an4_slice, tmp_path, first, "train.max_steps=3"), TRAIN_TIMEOUT_S)
    assert code == 0, output
    code, output = run_job(trainer_command(an4_slice, tmp_path, then, "train.resume=auto", "train.num_workers=1"),
                           TRAIN_TIMEOUT_S)
    assert code == 0, output
    assert "resumed from" in output and "at step 3 (step 3 of epoch 1)" in output, output
    whole, resumed = step_losses(two_rank_run), step_losses(tmp_path)
    assert sorted(resumed) == list(range(1, NUM_STEPS + 1))
    assert [resumed[step] for step in whole] == pytest.approx(list(whole.values()), rel=1e-5, abs=0)
    assert evaluations(tmp_path) == evaluations(two_rank_run)
    one = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    two = torch.load(two_rank_run / "checkpoints" / "last.pt", weights_only=True)
    assert_tensors_match(two["model"], one["model"], "model", rtol=1e-5, atol=1e-6)


@needs_mpiexec
def test_rank_that_raises_ends_the_job_with_its_message(an4_slice, two_rank_run, tmp_path):
    """Rank 1 fails resuming (its RNG state in the checkpoint is damaged) while rank 0 goes on into DDP's first
    broadcast, where it would wait for rank 1 until the collective timeout."""
    saved = torch.load(two_rank_run / "checkpoints" / "last.pt", weights_only=True)
    saved["rng"][1]["torch"] = torch.zeros(3, dtype=torch.uint8)
    torch.save(saved, tmp_path / "damaged.pt")
    code, output = run_job(
        trainer_command(an4_slice, tmp_path / "run", 2, f"train.resume={tmp_path / 'damaged.pt'}"), FAILURE_TIMEOUT_S
    )
    assert code != 0, output
    # The failing rank's own message, not a peer's "connection closed".
    assert f"error on rank 1: cannot resume from {tmp_path / 'damaged.pt'}: its rng does not fit this run" in output, \
        output


def mpmd_command(manifests: dict, run_dir: Path, rank_1_overrides: list) -> list:
    """Two ranks by MPI's MPMD form, rank 1 given `rank_1_overrides` on top of rank 0's command."""
    rank_0 = trainer_command(manifests, run_dir, 1)
    return [MPIEXEC, "-n", 1, *rank_0, ":", "-n", 1, *rank_0, *rank_1_overrides]


@needs_mpiexec
def test_a_rank_that_leaves_before_mpi_starts_ends_the_job(an4_slice, tmp_path):
    """Rank 1's Hydra refuses an override (a node whose conf/ differs) before MPI starts, while rank 0 goes on into
    MPI_Init, where MPICH's mpiexec left it waiting for ever."""
    code, output = run_job(mpmd_command(an4_slice, tmp_path, ["train.epoch=3"]), FAILURE_TIMEOUT_S)
    assert code == 2, output
    assert "error: unknown config key train.epoch (did you mean train.epochs?)" in output, output


@needs_mpiexec
def test_a_rank_refused_before_mpi_ends_the_job_past_the_timeout_where_another_is_stopped_before_mpi(tmp_path):
    """Rank 0's Hydra refuses an override and it starts MPI to end the job, while rank 1 stops before MPI (stuck
    importing): MPI_Init waits for every rank, so rank 0 waited there for ever."""
    refused = [sys.executable, "-m", "trainer", "train.epoch=3", "distributed.timeout_s=5", f"hydra.run.dir={tmp_path}"]
    stopped = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"]
    code, output = run_job([MPIEXEC, "-n", 1, *refused, ":", "-n", 1, *stopped], FAILURE_TIMEOUT_S)
    assert code != 0, output
    assert "error: unknown config key train.epoch (did you mean train.epochs?)" in output, output
    assert ("error on rank 0: MPI did not start within distributed.timeout_s (5 s): another rank stopped answering "
            "before it started MPI") in output, output


@needs_mpiexec
def test_an_override_every_rank_refuses_is_one_untagged_line_and_the_other_ranks_tagged(tmp_path):
    """A bare mpiexec (no launch script checked the overrides first): every rank refuses it alike, and rank 1's line,
    untagged, read as a second refusal."""
    code, output = run_job(launch(2) + ["-m", "trainer", "model.nope=0", f"hydra.run.dir={tmp_path}"],
                           FAILURE_TIMEOUT_S)
    assert code == 2, output
    refusals = [line for line in output.splitlines() if "unknown config key model.nope" in line]
    assert sorted(line.split("error: ")[0] for line in refusals) == ["", "[rank 1] "], output


@needs_mpiexec
def test_a_rank_stopped_before_mpi_starts_ends_the_job_after_the_timeout(an4_slice, tmp_path):
    """Rank 1 stops before it starts MPI (as one stuck importing from a file system that stopped answering) while rank
    0 goes on into MPI_Init, which has no timeout: rank 0 waited there for ever."""
    rank_0 = trainer_command(an4_slice, tmp_path, 1, "distributed.timeout_s=5")
    stopped = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"]
    code, output = run_job([MPIEXEC, "-n", 1, *rank_0, ":", "-n", 1, *stopped], FAILURE_TIMEOUT_S)
    assert code != 0, output
    assert ("error on rank 0: MPI did not start within distributed.timeout_s (5 s): another rank stopped answering "
            "before it started MPI") in output, output


def stopping_in(stops_in: str, command: list) -> list:
    """A one-process `command` (python -m MODULE ...: trainer_command's, scaling_command's), run with `stops_in` (a
    module's function) replaced by a SIGSTOP of the rank, as one hung there."""
    module, _, name = stops_in.rpartition(".")
    runs = command[2]
    stopping = (f"import importlib, os, runpy, signal, sys; setattr(importlib.import_module({module!r}), {name!r}, "
                f"lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGSTOP)); sys.argv[0] = {runs!r}; "
                f"runpy.run_module({runs!r}, run_name='__main__')")
    return [sys.executable, "-c", stopping, *command[3:]]


@needs_mpiexec
@pytest.mark.parametrize("stops_in, line", [
    ("trainer.distributed.shutdown", "error on rank 0: no answer from rank 1"),
    ("torch.distributed.init_process_group", "error on rank 0: the process group's rendezvous did not complete within "
                                             "distributed.timeout_s (5 s): another rank stopped answering after MPI"),
    ("torch.distributed.destroy_process_group", "error on rank 0: another rank did not reach the job's end within "
                                                "distributed.timeout_s (5 s) (stopped, or hung closing its process "),
])
def test_a_rank_stopped_at_the_jobs_start_or_end_ends_the_job_after_the_timeout(an4_slice, tmp_path, stops_in, line):
    """Rank 1 stops (SIGSTOP) before the process group's rendezvous, before its last barrier or in its teardown, past
    that barrier: rank 0 ends the job in one line, where it printed torch's traceback, or waited in MPI's last barrier
    for ever. Rank 1 runs the trainer with `stops_in` replaced."""
    rank_0 = trainer_command(an4_slice, tmp_path, 1, "train.epochs=1", "distributed.timeout_s=5")
    rank_1 = stopping_in(stops_in, rank_0)
    code, output = run_job([MPIEXEC, "-n", 1, *rank_0, ":", "-n", 1, *rank_1], FAILURE_TIMEOUT_S)
    assert code != 0, output
    assert line in output, output
    assert "Traceback" not in output, output
    if "init_process_group" not in stops_in:
        assert (tmp_path / "checkpoints" / "last.pt").exists(), output


@needs_mpiexec
def test_rank_0_stopped_before_the_rendezvous_it_serves_ends_the_job_in_one_line(an4_slice, tmp_path):
    """Rank 0 serves the rendezvous: rank 1, its connection timed out (torch's DistNetworkError, not the server's
    DistStoreError), printed torch's traceback and its C++ frames, and torch's C++ log the frames of each try."""
    rank_1 = trainer_command(an4_slice, tmp_path, 1, "train.epochs=1", "distributed.timeout_s=5")
    rank_0 = stopping_in("torch.distributed.init_process_group", rank_1)
    code, output = run_job([MPIEXEC, "-n", 1, *rank_0, ":", "-n", 1, *rank_1], FAILURE_TIMEOUT_S)
    assert code != 0, output
    assert ("error on rank 1: the process group's rendezvous did not complete within distributed.timeout_s (5 s): "
            "another rank stopped answering after MPI") in output, output
    assert "Traceback" not in output and "frame #" not in output, output


def test_the_watchdog_of_mpis_start_never_runs_on_into_the_trainers_code():
    """The watchdog ended_past forks is a copy of the rank: a Ctrl-C's KeyboardInterrupt there went up its copy of the
    stack, and the copy ran on as a second trainer."""
    code = textwrap.dedent("""
        import os, signal, time
        from trainer.distributed import ended_past
        try:
            with ended_past(30, 0):
                time.sleep(0.5)
                child = int(open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()[0])
                os.kill(child, signal.SIGINT)
                time.sleep(0.5)
        finally:
            print("ran on in", os.getpid(), flush=True)
    """)
    ran = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0 and ran.stdout.count("ran on in") == 1, (ran.stdout, ran.stderr)


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1], ids=lambda number: number.name)
def test_the_watchdog_of_mpis_start_outlives_a_stop_signal(stop_signal):
    """MPICH's mpiexec passes a stop signal on to each rank's process group, the watchdog ended_past forks among it.
    The rank's handler (StopSignals': it raises before training) ended the watchdog, while the rank, inside MPI_Init,
    could not run it: a job whose other rank never started MPI (stopped, or ended before MPI, not by the trainer: a
    failed import) waited for ever, SIGTERM after SIGTERM. The rank here sleeps as in MPI_Init."""
    code = textwrap.dedent(f"""
        import os, signal, time
        from trainer.distributed import ended_past
        from trainer.stop import StopSignals
        with StopSignals(), ended_past(2, 0):
            time.sleep(0.5)
            child = int(open(f"/proc/{{os.getpid()}}/task/{{os.getpid()}}/children").read().split()[0])
            os.kill(child, {int(stop_signal)})
            time.sleep(20)
    """)
    ran = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert ran.returncode == -signal.SIGKILL, (ran.stdout, ran.stderr)
    assert "error on rank 0: MPI did not start within distributed.timeout_s (2 s)" in ran.stderr, ran.stderr


@needs_mpiexec
@pytest.mark.parametrize("rank_1_override, difference", [
    ("seed=99", "rank 1 has seed=99 where rank 0 has 1234"),
    ("train.epochs=3", "rank 1 has train.epochs=3 where rank 0 has 2"),
    ("data.train_manifests=[{test}]", "rank 1 has the training set=6 utterances, sha256 "),
])
def test_ranks_started_with_other_settings_are_refused_naming_them(an4_slice, tmp_path, rank_1_override, difference):
    """Another seed shards batches that overlap (some utterances trained twice an epoch, some never), another step
    limit leaves a rank waiting for a collective until the timeout: each is refused by name before training."""
    override = rank_1_override.format(test=an4_slice["test"])
    code, output = run_job(mpmd_command(an4_slice, tmp_path, [override]), FAILURE_TIMEOUT_S)
    assert code == 2, output
    assert f"error on rank 0: the ranks were started with other settings ({difference}" in output, output
    assert "Traceback" not in output, output


@needs_mpiexec
def test_ranks_that_would_resume_from_other_checkpoints_are_refused(an4_slice, two_rank_run, tmp_path):
    """A rank whose run directory is not rank 0's (a node-local folder where every node should see one) finds no
    checkpoint and starts afresh while rank 0 resumes: their collectives no longer paired, and gloo aborted the job
    (signal 6) with no word of why, or, rank 0 having nothing left to train, the other waited out the timeout."""
    rank_0 = trainer_command(an4_slice, two_rank_run, 1, "train.resume=auto", "distributed.timeout_s=20")
    command = [MPIEXEC, "-n", 1, *rank_0, ":", "-n", 1, *rank_0, f"hydra.run.dir={tmp_path / 'elsewhere'}"]
    code, output = run_job(command, FAILURE_TIMEOUT_S)
    assert code == 2, output
    assert (f"error on rank 0: the ranks would resume from other checkpoints (rank 1 has the checkpoint resumed=none "
            f"where rank 0 has last.pt at step {NUM_STEPS}): every rank must see the run directory's checkpoints, a "
            "folder every node sees") in output, output


@needs_mpiexec
def test_user_error_on_rank_0_alone_ends_the_job(an4_slice, tmp_path):
    """Only rank 0 prepares the corpus: with a missing corpus folder it fails while rank 1 waits at a barrier."""
    missing = tmp_path / "no_corpus"
    command = trainer_command(an4_slice, tmp_path / "run", 2, f"data.an4_source={missing}")
    code, output = run_job(command, FAILURE_TIMEOUT_S)
    assert code != 0, output
    assert f"error on rank 0: folder {missing} does not exist" in output, output


def rank_process(rank: int, run_dir: Path) -> int:
    """The pid of the trainer process of `rank` whose command line names `run_dir`."""
    for entry in Path("/proc").iterdir():
        try:
            command_line = (entry / "cmdline").read_bytes().split(b"\0")
            environment = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue  # not a process, or one that has ended
        rank_settings = {f"{names[0]}={rank}".encode() for names in launch_ranks.LAUNCHER_VARIABLES}
        if f"hydra.run.dir={run_dir}".encode() in command_line and rank_settings.intersection(environment):
            return int(entry.name)
    raise LookupError(f"no process of rank {rank} for {run_dir}")


def on_two_gpus(*overrides: str):
    return pytest.param((*ON_GPUS, *overrides), marks=[pytest.mark.cuda, needs_two_gpus])


@needs_mpiexec
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the rank's process through /proc")
@pytest.mark.parametrize("signal_number", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
@pytest.mark.parametrize("overrides", [(), on_two_gpus(), on_two_gpus("train.cuda_graphs=true")],
                         ids=["cpu", "gpus", "gpus_graphed"])
def test_a_rank_killed_or_stopped_mid_training_ends_the_job(an4_slice, tmp_path, signal_number, overrides):
    """A rank that dies without a word (killed, out of memory) or stops answering must not leave the other waiting
    on a collective: the launcher ends a job whose rank died, and a collective that waits past
    distributed.timeout_s fails on the waiting rank, which ends the job. Over NCCL the process ends (the watchdog and
    its monitor, trainer.distributed.end_nccl_timeouts_promptly) rather than raising in the training loop; under CUDA
    graphs the waiting rank may be inside a replayed graph's all-reduce, and the eager collective after it times out
    all the same."""
    if overrides:
        from prnn_kernels.build import load_extension

        load_extension()  # built once here, not inside the job's time limit
    run_dir = tmp_path / "run"
    job = start_job(trainer_command(an4_slice, run_dir, 2, "train.epochs=100", "distributed.timeout_s=10",
                                    *overrides))
    wait_for_file(run_dir / "metrics.jsonl", job, FAILURE_TIMEOUT_S)  # rank 0 opens it as training starts
    rank_1 = rank_process(1, run_dir)
    os.kill(rank_1, signal_number)
    code, output = finish_job(job, FAILURE_TIMEOUT_S)
    assert code != 0, output
    # The launcher names the dead rank's process (MPICH: "PID N", not its rank, and at times a rank it killed after
    # it, which is why only the start line is checked); the start line ties that pid to rank 1.
    assert re.search(rf"\[rank 1\] rank 1 of 2 \(local rank 1\) on .*, process {rank_1} on ", output), output
    if signal_number == signal.SIGSTOP and not overrides:  # gloo's timeout names no rank: the trainer asks them
        assert "error on rank 0: no answer from rank 1: this rank's collective waited distributed" in output, output
        assert "Traceback" not in output, output  # gloo's, which named no rank, in place of that one line


def workers_once_logged(job: subprocess.Popen, log_file: Path, text: str, run_dir: Path) -> dict[int, set[int]]:
    """Each of a two-rank job's ranks' data-loading workers, once `log_file` holds `text`; the job killed where that
    fails."""
    try:
        wait_for_file(log_file, job, FAILURE_TIMEOUT_S)
        wait_for_text(log_file, text, job)
        return {rank: data_loading_workers(rank_process(rank, run_dir)) for rank in range(2)}
    except BaseException:
        os.killpg(job.pid, signal.SIGKILL)
        raise


def stop_the_job_while_its_worker_is_stuck(job: subprocess.Popen, worker: int) -> tuple[int, str, float]:
    """SIGSTOP to `worker`, then SIGTERM to the job once the worker's rank has used up the batches it had made: the
    job's exit code, its output, and how long it took to end after the SIGTERM."""
    os.kill(worker, signal.SIGSTOP)
    time.sleep(3)
    signalled = time.monotonic()
    job.send_signal(signal.SIGTERM)
    code, output = finish_job(job, FAILURE_TIMEOUT_S)
    return code, output, time.monotonic() - signalled


@needs_mpiexec
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks' processes through /proc")
@pytest.mark.parametrize("signal_number, failure", [
    (signal.SIGSTOP, "no batch came from the data-loading workers within 10 s (distributed.timeout_s): one is stuck "
                     "(on a file system that stopped answering, or stopped) or far too slow, and they were killed"),
    (signal.SIGKILL, "data-loading worker (pid {worker}) was killed by SIGKILL, which the kernel's out-of-memory "
                     "killer sends"),
], ids=["stopped", "killed"])
def test_a_data_loading_worker_stopped_or_killed_on_one_rank_ends_the_job_saying_so(an4_slice, tmp_path,
                                                                                      signal_number, failure):
    """Rank 1's worker stuck (stopped here) or killed (the out-of-memory killer's SIGKILL) while rank 0 waits for
    rank 1 in a collective, whose timeout names no cause: rank 1 says what befell its worker in one line and ends the
    job, and no worker of either rank is left behind, stopped or running. A stopped worker may hold a batch its rank
    has taken from the queue but cannot unpickle without it: that rank then waits too, and ends by the same timeout.
    Rank 0's collective, which timed out with it, printed its traceback; rank 0 now names rank 1 in one line."""
    run_dir = tmp_path / "run"
    # One utterance a rank, 8 steps an epoch: rank 1 still has batches to ask its worker for after step 2.
    job = start_job(trainer_command(an4_slice, run_dir, 2, "train.epochs=100", "train.global_batch_size=2",
                                    "train.num_workers=1", "distributed.timeout_s=10"))
    workers = workers_once_logged(job, run_dir / "metrics.jsonl", '"step": 2,', run_dir)
    (worker,) = workers[1]
    os.kill(worker, signal_number)
    code, output = finish_job(job, FAILURE_TIMEOUT_S)
    assert code == 1, output
    assert f"[rank 1] error on rank 1: {failure.format(worker=worker)}" in output, output
    assert "Traceback" not in output, output
    # mpiexec ends as it kills the ranks' process groups, with their workers, which may take a moment to end.
    deadline = time.monotonic() + FAILURE_TIMEOUT_S
    while (left := {pid for pid in set.union(*workers.values()) if running(pid)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"workers left running or stopped: {left}"


@needs_mpiexec
@signals_the_launcher
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks' processes through /proc")
def test_a_stop_signal_while_a_data_loading_worker_is_stuck_stops_the_job_promptly_with_its_checkpoint(an4_slice,
                                                                                                       tmp_path):
    """SIGTERM to the job (MPICH's mpiexec passes it on) while rank 1 waits for a batch from its stopped worker: the
    waiting rank stops waiting, as the step it waited for would not train anyway, and every rank stops there, rank 0
    writing last.pt. The run waited out distributed.timeout_s for the batch, then failed without the checkpoint."""
    run_dir = tmp_path / "run"
    job = start_job(trainer_command(an4_slice, run_dir, 2, "train.epochs=100", "train.global_batch_size=2",
                                    "train.num_workers=1", "distributed.timeout_s=40"))
    (worker,) = workers_once_logged(job, run_dir / "metrics.jsonl", '"step": 2,', run_dir)[1]
    code, output, waited = stop_the_job_while_its_worker_is_stuck(job, worker)
    assert waited < 20, output
    assert code == 128 + signal.SIGTERM, output
    stopped_at = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["train_state"]["step"]
    # Rank 0, inside the step's first all-reduce as the signal came, takes it once that ends: after that step.
    assert re.search(rf"stopped at step {stopped_at} \(SIGTERM on [12] of 2 ranks\)", output), output
    assert "Traceback" not in output, output


@needs_mpiexec
@signals_the_launcher
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks' processes through /proc")
def test_a_stop_signal_while_an_evaluations_worker_is_stuck_stops_the_job_promptly_with_its_checkpoint(an4_slice,
                                                                                                      tmp_path):
    """SIGTERM to the job while rank 1's evaluation waits for a batch from its stopped worker, and rank 0 waits for
    rank 1 in the evaluation's collective: rank 1 stops waiting and tells rank 0 so in that collective, and the job
    stops as on any signal during an evaluation. It waited out distributed.timeout_s, then failed without last.pt."""
    test_set = tmp_path / "test.jsonl"  # 129 of AN4's test utterances, one a batch: 64 batches or more a rank
    lines = (an4_slice["test"].parent / "prepared" / "an4_test.jsonl").read_text().splitlines()
    test_set.write_text("\n".join(lines[:129]) + "\n")
    run_dir = tmp_path / "run"
    job = start_job(trainer_command({**an4_slice, "test": test_set}, run_dir, 2, "train.eval_batch_size=1",
                                    "train.progress_line_s=0", "train.num_workers=1", "distributed.timeout_s=40"))
    # The evaluation's worker: the training's are gone by then.
    (worker,) = workers_once_logged(job, run_dir / "__main__.log", "evaluating: batch 2 of", run_dir)[1]
    code, output, waited = stop_the_job_while_its_worker_is_stuck(job, worker)
    assert waited < 20, output[-4000:]
    assert code == 128 + signal.SIGTERM, output[-4000:]
    assert re.search(r"stopped after epoch 1's training, before its evaluation ended \(SIGTERM on [12] of 2 ranks\)",
                     output), output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert saved["sampler"] == {"epoch": 0, "position": 4}, saved["sampler"]


@needs_mpiexec
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the rank's process through /proc")
def test_a_stop_signal_to_one_rank_stops_every_rank_after_the_same_step_with_its_checkpoint(an4_slice, tmp_path):
    """SIGUSR1 (which mpirun forwards to every rank, and SLURM sends ahead of a job's time limit) sent here to rank 1
    alone: the ranks agree in the next step's first all-reduce, which then trains nothing, rank 0 writes last.pt at the
    step the signal came in, and every rank exits 128 + SIGUSR1, so the launcher reports the job unfinished."""
    run_dir = tmp_path / "run"
    job = start_job(trainer_command(an4_slice, run_dir, 2, "train.epochs=100"))
    wait_for_file(run_dir / "metrics.jsonl", job, FAILURE_TIMEOUT_S)
    wait_for_text(run_dir / "metrics.jsonl", '"step"', job)  # training has begun
    os.kill(rank_process(1, run_dir), signal.SIGUSR1)
    code, output = finish_job(job, FAILURE_TIMEOUT_S)
    assert code == 128 + signal.SIGUSR1, output
    stopped_at = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["train_state"]["step"]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"step"' in line]
    assert steps == list(range(1, stopped_at + 1)), (steps, stopped_at)
    assert "[rank 1] SIGUSR1 received: stopping when the training step or evaluation in progress ends" in output, (
        output)
    # The stop line names where the checkpoint stands: inside an epoch its step; at an epoch's end (4 steps an epoch)
    # that step, or the epoch, where the signal came before or during its evaluation. A line naming another step
    # passed, as did one naming none.
    where = [f"at step {stopped_at}"] + ([f"after epoch {stopped_at // 4}"] if stopped_at % 4 == 0 else [])
    line = rf"stopped ({'|'.join(where)})\b[^(\n]*\(SIGUSR1 on 1 of 2 ranks\); train\.resume=auto "
    assert re.search(line, output), (where, output)
    assert "Traceback" not in output, output


@needs_mpiexec
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the rank's process through /proc")
def test_a_stop_signal_to_one_rank_during_an_evaluation_ends_every_ranks_evaluation(an4_slice, tmp_path):
    """SIGUSR1 to rank 1 alone while the ranks evaluate: rank 0, which did not receive it, ends its evaluation too,
    after a batch or so, rather than evaluate its whole shard while rank 1 waits for it in the all-reduce after the
    evaluation (past distributed.timeout_s, the job failed without its checkpoint). The resume makes that evaluation
    on both ranks, though one has a batch fewer."""
    test_set = tmp_path / "test.jsonl"  # 129 of AN4's test utterances, one a batch: 65 batches on rank 0, 64 on rank 1
    lines = (an4_slice["test"].parent / "prepared" / "an4_test.jsonl").read_text().splitlines()
    test_set.write_text("\n".join(lines[:129]) + "\n")
    run_dir = tmp_path / "run"
    command = trainer_command({**an4_slice, "test": test_set}, run_dir, 2, "train.eval_batch_size=1",
                              "train.progress_line_s=0", "train.resume=auto")  # rank 0 logs each evaluation batch
    job = start_job(command)
    log_file = run_dir / "__main__.log"
    wait_for_file(log_file, job, FAILURE_TIMEOUT_S)
    wait_for_text(log_file, "evaluating: batch 2 of", job)
    os.kill(rank_process(1, run_dir), signal.SIGUSR1)
    code, output = finish_job(job, FAILURE_TIMEOUT_S)
    assert code == 128 + signal.SIGUSR1, output[-4000:]
    assert "stopped after epoch 1's training, before its evaluation ended (SIGUSR1 on 1 of 2 ranks)" in output, (
        output[-4000:])
    assert "evaluating: batch 65 of 65" not in output, output[-4000:]
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert saved["sampler"] == {"epoch": 0, "position": 4}, saved["sampler"]

    code, output = run_job(command, TRAIN_TIMEOUT_S)
    assert code == 0, output[-4000:]
    assert "epoch 1 (its steps trained before the resume): evaluated in" in output, output[-4000:]
    assert [epoch for epoch, _, _ in evaluations(run_dir)] == [1, 2], evaluations(run_dir)


@needs_mpiexec
@signals_the_launcher
def test_a_stop_signal_before_training_began_ends_the_job_saying_so(an4_source, tmp_path):
    """SIGTERM to MPICH's mpiexec, which passes it on, while the ranks prepare AN4's manifests: with nothing to save
    yet, the job ends at once with 143 and a line saying why, as a run the signal ended would. The ranks had no
    handler yet and died of the signal, which mpiexec reported as exit code 15, without a word."""
    run_dir, manifests = tmp_path / "run", tmp_path / "manifests"
    settings = [setting for setting in TINY_RUN if setting != "data=manifest"]
    job = start_job(launch(2) + ["-m", "trainer", *settings, f"data.an4_source={an4_source}",
                                 f"data.manifest_dir={manifests}", f"hydra.run.dir={run_dir}"])
    log = run_dir / "__main__.log"
    wait_for_file(log, job, FAILURE_TIMEOUT_S)
    wait_for_text(log, "rank 0 of 2", job)  # the process group has started; the manifests come next
    job.send_signal(signal.SIGTERM)
    code, output = finish_job(job, FAILURE_TIMEOUT_S)
    assert code == 128 + signal.SIGTERM, output
    assert "SIGTERM received before training began; no checkpoint of this run was written" in output, output
    assert "Traceback" not in output, output


def import_stage(pid: int) -> str:
    """How far process `pid` has started: "importing" where it has a handler for SIGUSR1 (its SigCgt mask), which
    keep_early_stop_signal takes with SIGTERM (data.cli's, before it, takes SIGTERM alone), and has not yet loaded
    torch; "torch loaded" past that; "starting" before it, or where it has ended."""
    try:
        status, maps = Path(f"/proc/{pid}/status").read_text(), Path(f"/proc/{pid}/maps").read_text()
    except OSError:  # it has ended
        return "starting"
    if "libtorch" in maps:
        return "torch loaded"
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return "importing" if caught >> (signal.SIGUSR1 - 1) & 1 else "starting"


def both_ranks_importing(job: subprocess.Popen, run_dir: Path) -> bool:
    """Waits until both ranks of `job` have taken the stop signals and neither has loaded torch: True. False where that
    moment did not come (one rank loaded torch before the other took its handlers, as a busy machine can make it),
    the job then killed."""
    deadline = time.monotonic() + FAILURE_TIMEOUT_S
    ranks = {}
    while True:
        for rank in set(range(2)) - set(ranks):
            with contextlib.suppress(LookupError):
                ranks[rank] = rank_process(rank, run_dir)
        stages = [import_stage(pid) for pid in ranks.values()]
        if stages == ["importing"] * 2:
            return True
        if "torch loaded" in stages or job.poll() is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
            return False
        if time.monotonic() > deadline:
            os.killpg(job.pid, signal.SIGKILL)
            pytest.fail(f"the ranks took no SIGTERM before torch was loaded:\n{job.communicate()[0][-4000:]}")
        time.sleep(0.005)


@needs_mpiexec
@signals_the_launcher
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks' processes through /proc")
def test_a_stop_signal_while_the_ranks_import_ends_the_job_saying_so(an4_slice, tmp_path):
    """SIGTERM to MPICH's mpiexec, which passes it on, while the ranks still import torch (a second, 10-20 with the
    config on a busy machine): each rank died of it without a word, mpiexec exiting 15 (launch/slurm.sbatch requeues
    on 138 alone, and SIGUSR1 likewise gave 10), and Ctrl-C printed a traceback from inside torch's import on each
    rank, one of which crashed (SIGSEGV). The first signal is now kept until the trainer can end the job on it. The
    moment both ranks import is short: a job that passed it unseen (once in a CI run) is started again."""
    for attempt in range(5):
        run_dir = tmp_path / f"run{attempt}"
        job = start_job(trainer_command(an4_slice, run_dir, 2))
        if both_ranks_importing(job, run_dir):
            break
    else:
        pytest.fail("in five jobs the two ranks never imported torch at the same moment")
    job.send_signal(signal.SIGTERM)
    code, output = finish_job(job, FAILURE_TIMEOUT_S)
    assert code == 128 + signal.SIGTERM, output
    for rank in ("", "[rank 1] "):
        refusal = "SIGTERM received before training began; no checkpoint of this run was written"
        assert f"{rank}{refusal}" in output, output
    assert "Traceback" not in output, output


@needs_mpiexec
def test_global_batch_not_divisible_by_world_size(an4_slice, tmp_path):
    code, output = run_job(trainer_command(an4_slice, tmp_path, 2, "train.global_batch_size=5"), FAILURE_TIMEOUT_S)
    assert code == 2, output
    expected = "train.global_batch_size=5: global_batch_size 5 must be a positive multiple of world_size 2"
    assert expected in output, output
    # Before the corpus is prepared and read (minutes, for a large one), as a batch the backend cannot run is.
    assert "utterances from" not in output, output


def scaling_command(world_size: int, json_path: Path, *extra) -> list:
    return launch(world_size) + [
        "-m", "benchmarks.scaling", "--model", "cpu_demo", "--device", "cpu", "--global-batch", 2, "--frames", 60,
        "--steps", 2, "--warmup", 1, "--compute-batches", 1, 2, "--json", json_path, *extra,
    ]


def test_scaling_benchmark_refuses_cuda_graphs_on_a_cpu(tmp_path):
    code, output = run_job(scaling_command(1, tmp_path / "graphs.json", "--cuda-graphs"), FAILURE_TIMEOUT_S)
    assert code == 2, output
    assert "error on rank 0: --cuda-graphs needs a GPU, this run is on cpu" in output, output
    # Refused first, on any device: a refusal of --warmup 0 alone passed every test.
    code, output = run_job(scaling_command(1, tmp_path / "graphs.json", "--cuda-graphs", "--warmup", 0),
                           FAILURE_TIMEOUT_S)
    assert code == 2, output
    assert "benchmarks.scaling: error: --cuda-graphs needs --warmup of at least 1" in output, output


@needs_mpiexec
def test_scaling_benchmark_refuses_a_global_batch_its_ranks_cannot_share(tmp_path):
    # One not a multiple of the world size was measured at a per-rank batch rounded down, and passed every test.
    code, output = run_job(scaling_command(2, tmp_path / "odd.json", "--global-batch", 3), FAILURE_TIMEOUT_S)
    assert code == 2, output
    assert "error on rank 0: --global-batch 3 must be a positive multiple of the world size 2" in output, output
    assert not (tmp_path / "odd.json").exists()


@needs_mpiexec
def test_the_scaling_benchmarks_rendezvous_that_ran_out_names_its_own_flag(tmp_path):
    """Its rank 0 stopped before the rendezvous: rank 1's line named distributed.timeout_s, the trainer's Hydra key,
    which the benchmark, whose wait could not be changed, does not take."""
    rank_1 = scaling_command(1, tmp_path / "two.json", "--timeout-s", 5)
    rank_0 = stopping_in("torch.distributed.init_process_group", rank_1)
    code, output = run_job([MPIEXEC, "-n", 1, *rank_0, ":", "-n", 1, *rank_1], FAILURE_TIMEOUT_S)
    assert code != 0, output
    assert ("error on rank 1: the process group's rendezvous did not complete within --timeout-s (5 s): another rank "
            "stopped answering") in output, output
    assert "Traceback" not in output and "distributed.timeout_s" not in output, output


@pytest.fixture(scope="module")
def scaling_result(tmp_path_factory) -> dict:
    """benchmarks.scaling on two ranks, against its own one-process baseline."""
    folder = tmp_path_factory.mktemp("scaling")
    code, output = run_job(scaling_command(1, folder / "one.json"), TRAIN_TIMEOUT_S)
    assert code == 0, output
    code, output = run_job(scaling_command(2, folder / "two.json", "--baseline", folder / "one.json"), TRAIN_TIMEOUT_S)
    assert code == 0, output
    assert "strong-scaling efficiency" in output
    return {"path": folder / "two.json", "one": json.loads((folder / "one.json").read_text()),
            "two": json.loads((folder / "two.json").read_text())}


@needs_mpiexec
def test_scaling_benchmark_measures_the_trainers_model(scaling_result):
    one, two = scaling_result["one"], scaling_result["two"]
    with initialize_config_dir(str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=cpu_demo"])
    model = build.model(cfg.model, build.features(cfg.data).num_features)
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    assert two["model"]["parameters"] == num_parameters
    assert two["config"]["num_features"] == build.features(cfg.data).num_features
    assert two["allreduce"]["bytes"] == two["model"]["gradient_bytes"] == 4 * num_parameters
    assert two["world_size"] == 2 and two["step"]["per_rank_batch"] == 1 and one["step"]["per_rank_batch"] == 2
    assert [entry["per_rank_batch"] for entry in two["compute"]] == [1, 2]
    for measure in (two["step"], two["step_no_sync"], two["allreduce"], *two["compute"]):
        assert len(measure["times_ms"]) == 2 and measure["median_ms"] > 0
    assert two["exposed_communication_ms"] == pytest.approx(two["step"]["median_ms"] - two["step_no_sync"]["median_ms"])
    allreduce = two["allreduce"]
    assert allreduce["bus_GBps"] == scaling.allreduce_bus_GBps(allreduce["bytes"], allreduce["median_ms"] * 1e-3, 2)
    efficiency = one["step"]["median_ms"] / (2 * two["step"]["median_ms"])
    assert two["baseline"]["strong_scaling_efficiency"] == pytest.approx(efficiency)
    # The global batch's samples a second (a world of one, whose per-rank batch is the global batch, checked none), and
    # the baseline as the efficiency read it.
    assert two["step"]["samples_per_s"] == pytest.approx(2 / two["step"]["median_ms"] * 1e3)
    assert two["baseline"]["step_ms"] == one["step"]["median_ms"]
    assert two["baseline"]["path"] == str(scaling_result["path"].parent / "one.json")
    assert two["versions"]["torch"] == torch.__version__


@pytest.mark.parametrize("world_size, bus_per_algorithm_bandwidth", [(1, 0), (2, 1), (4, 1.5), (8, 1.75)])
def test_the_allreduce_bus_bandwidth_is_nccl_tests(world_size, bus_per_algorithm_bandwidth):
    """nccl-tests' busbw = algbw * 2 (N - 1) / N (its PERFORMANCE.md), algbw = bytes / time: the 2-rank test alone ran
    it, where the factor is 1, so that one without it passed: the algorithm bandwidth, 1.75 times less on 8 GPUs."""
    assert scaling.allreduce_bus_GBps(6e9, 2.0, world_size) == pytest.approx(3.0 * bus_per_algorithm_bandwidth)


def test_a_scaling_measure_is_the_median_of_its_times():
    # The mean (11 ms) passed every test, whose measures were timed once or twice.
    assert scaling.summary([2.0, 1.0, 30.0], bytes=8) == {"bytes": 8, "median_ms": 2.0, "times_ms": [2.0, 1.0, 30.0]}


def time_slowest_worker(rank, directory):
    """One of two gloo ranks timing a call that takes rank 0 0.3 s and rank 1 0.6 s."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank, world_size=2)
    try:
        times = scaling.time_ms(lambda: time.sleep(0.3 + 0.3 * rank), 0, 2, torch.device("cpu"))
        Path(directory, f"rank{rank}.json").write_text(json.dumps(times))
    finally:
        torch.distributed.destroy_process_group()


def test_a_scaling_time_is_the_slowest_ranks(tmp_path):
    """Each call's time is the slowest rank's, on every rank: rank 0's own time (0.3 s), or the ranks' sum or mean,
    passed every test, whose ranks took about as long as each other."""
    torch.multiprocessing.spawn(time_slowest_worker, args=(str(tmp_path),), nprocs=2)
    times = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert times[0] == times[1] and len(times[0]) == 2, times
    # 0.3 s clear of the sum (900 ms) and the mean (450 ms): a sleep overshoots by tens of ms on a busy machine.
    assert all(600 <= ms < 850 for ms in times[0]), times


def scaling_result_of_two_ranks() -> dict:
    """A result of benchmarks.scaling.measure on 2 ranks at global batch 8, against a baseline, in round numbers."""
    return {
        "world_size": 2, "device": "GPU X",
        "config": {"model": "an4", "global_batch": 8, "frames": 300, "amp": True, "cuda_graphs": False,
                   "backend": "cudnn",
                   "model_config": {"depth": 5, "bidirectional": True, "cell": "gru", "hidden": 800}},
        "model": {"parameters": 2_000_000, "gradient_bytes": 8_000_000},
        "step": {"median_ms": 20.0, "per_rank_batch": 4}, "step_no_sync": {"median_ms": 16.0, "per_rank_batch": 4},
        "exposed_communication_ms": 4.0, "allreduce": {"median_ms": 5.0, "bytes": 8_000_000, "bus_GBps": 1.6},
        "compute": [{"per_rank_batch": 1, "median_ms": 10.0}, {"per_rank_batch": 4, "median_ms": 16.0}],
        "baseline": {"path": "one.json", "step_ms": 32.0, "strong_scaling_efficiency": 0.8},
    }


def test_the_scaling_table_gives_each_measure_its_rate(capsys):
    """The step's rate is the global batch's samples a second, each compute row's its own batch's; the efficiency line
    gives t(1), the baseline's step. The per-rank batch's rate for the step, or this run's step for t(1), passed every
    test, none of which read the table."""
    scaling.print_table(scaling_result_of_two_ranks())
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("DeepSpeech2 an4 (5 x bi-GRU 800, 2.0M parameters, 8.0 MB of gradients), backend cudnn, "
                        "2 x GPU X, global batch 8, 300 frames, bf16")
    assert [line.split() for line in lines[3:]] == [
        ["step", "4", "20.000", "400.0"],
        ["step", "no_sync", "4", "16.000", "500.0"],
        ["exposed", "comm", "4.000"],
        ["allreduce", "(flat)", "5.000", "bus", "1.6", "GB/s"],
        ["compute,", "one", "rank", "alone", "1", "10.000", "100.0"],
        ["compute,", "one", "rank", "alone", "4", "16.000", "250.0"],
        ["strong-scaling", "efficiency", "t(1)", "/", "(2", "t(2)):", "0.800", "(t(1)", "=", "32.000", "ms)"],
    ]


@needs_mpiexec
def test_scaling_model_projects_a_measurement(scaling_result, tmp_path):
    assert scaling_model.main(["--measured", str(scaling_result["path"]), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "scaling_projection.png").read_bytes().startswith(b"\x89PNG")
    assert "## Assumptions" in (tmp_path / "scaling_projection.md").read_text()
    projection = json.loads((tmp_path / "scaling_projection.json").read_text())
    rows = projection["rows"]
    # Default: global batches 128 and 512 on 1..128 GPUs, at the measured overlap, 0 and 1 (fewer if they coincide).
    measured = scaling_model.Measurement(str(scaling_result["path"])).measured_overlap()
    overlaps = list(dict.fromkeys([measured, 0.0, 1.0]))
    assert sorted({row["overlap"] for row in rows}) == sorted(overlaps)
    assert len(rows) == 2 * 8 * len(overlaps)
    assert all(row["efficiency"] == 1.0 for row in rows if row["gpus"] == 1)
    assert projection["model_check"]["gpus"] == 2


def write_measurement(path: Path, compute_ms: dict = {1: 10.0, 4: 16.0}, **model) -> Path:
    """A benchmarks.scaling JSON from one process with these compute times per batch (by default 8 ms + 2 ms per
    utterance)."""
    path.write_text(json.dumps({
        "benchmark": "scaling", "world_size": 1, "device": "test", "model": model,
        "compute": [{"per_rank_batch": batch, "median_ms": ms} for batch, ms in compute_ms.items()],
        "config": {
            "model": "an4", "frames": 300, "amp": True,
            "model_config": {"depth": 5, "hidden": 800, "cell": "gru", "bidirectional": True, "backend": "cudnn"},
        },
    }))
    return path


def test_scaling_model_counts_the_allreduces_a_training_step_makes(monkeypatch):
    """STEP_ALLREDUCE_BYTES against trainer.step.train_step's own all-reduces on one CPU rank: the step's counts grew
    by the stop signals' (ff9eb78), and the model counted three float64 numbers where the step sends six."""
    from benchmarks.scaling import compose_config, random_batch
    from trainer.step import train_step

    reduced = []

    def recorded(tensor):
        reduced.append(tensor.numel() * tensor.element_size())
        return tensor

    monkeypatch.setattr(distributed, "all_reduce_sum", recorded)
    monkeypatch.setattr(distributed, "all_reduce_max", recorded)
    cfg = compose_config("cpu_demo", "cudnn", None, "none")
    cpu = torch.device("cpu")
    num_features = build.features(cfg.data).num_features
    model = build.model(cfg.model, num_features)
    optimizer = build.optimizer(cfg.optim, model.parameters())
    schedule = build.lr_schedule(cfg.optim, optimizer, steps_per_epoch=10)
    batch = random_batch(2, 40, num_features, seed=0, device=cpu)
    assert train_step(model, batch, optimizer, schedule, cfg, distributed.DistEnv(0, 1, cpu)).outcome == "ok"
    assert tuple(reduced) == scaling_model.STEP_ALLREDUCE_BYTES


def test_scaling_model_names_the_compute_line_of_two_measured_batches_once(tmp_path):
    # With two batches measured the smallest and the largest batches' line are one: it was written twice over.
    measured = write_measurement(tmp_path / "measured.json", gradient_bytes=2**20, ddp_bucket_cap_mb=25,
                                 sync_batch_norm_channels=[])
    assert scaling_model.main(["--measured", str(measured), "--out", str(tmp_path)]) == 0
    markdown = (tmp_path / "scaling_projection.md").read_text()
    assert markdown.count("8.00 ms + 2.000 ms per utterance through batches [1, 4]") == 1
    # A measurement from one process has no overlap of its own: the projection draws 0, 0.5 and 1.
    rows = json.loads((tmp_path / "scaling_projection.json").read_text())["rows"]
    assert sorted({row["overlap"] for row in rows}) == [0.0, 0.5, 1.0]


def test_scaling_model_arithmetic(tmp_path):
    # Nodes of 8 GPUs on 100 GB/s NVLink with 1 us hops; one 800 Gb/s NIC (100 GB/s) per node, 10 us hops.
    cluster = scaling_model.Cluster(gpus_per_node=8, nvlink_GBps=100, nvlink_latency_us=1, nic_Gbps=800,
                                    nics_per_node=1, network_latency_us=10)
    gigabyte = 1e9
    # Ring of 8: 2 * 7/8 * 1 GB / 100 GB/s = 17.5 ms, plus 14 hops of 1 us.
    assert scaling_model.allreduce_s(gigabyte, 8, cluster) == pytest.approx(0.0175 + 14e-6)
    # 16 GPUs: the ring of 8 in each node, then a ring of 2 nodes over 1 GB / 8 at 100 / 8 GB/s per ring: 10 ms
    # plus 2 hops.
    assert scaling_model.allreduce_s(gigabyte, 16, cluster) == pytest.approx(0.0175 + 14e-6 + 0.01 + 20e-6)
    assert scaling_model.allreduce_s(gigabyte, 1, cluster) == 0.0

    mebibyte = 2**20
    measurement = scaling_model.Measurement(str(write_measurement(
        tmp_path / "measured.json", gradient_bytes=50 * mebibyte, ddp_bucket_cap_mb=25, sync_batch_norm_channels=[]
    )))
    assert measurement.compute_ms(2) == pytest.approx(12.0)
    assert measurement.compute_ms(16) == pytest.approx(40.0)  # extrapolated along the same line
    row = scaling_model.step(measurement, cluster, global_batch=16, num_gpus=2, overlap=0.5, backward_share=2 / 3)
    # The step's counts (64 bytes: utterances, empty shards, unusable ones by their three reasons, three stop signals)
    # and loss (4), one ring hop each way.
    count_ms = (64 / 100e9 + 2e-6) * 1e3 + (4 / 100e9 + 2e-6) * 1e3
    bucket_ms = (25 * mebibyte / 100e9 + 2e-6) * 1e3
    assert row["compute_ms"] == pytest.approx(24.0)  # 8 utterances per GPU
    assert row["small_collectives_ms"] == pytest.approx(count_ms)
    assert row["gradient_allreduce_ms"] == pytest.approx(2 * bucket_ms)
    assert row["exposed_allreduce_ms"] == pytest.approx(bucket_ms)  # half hidden behind backward
    assert row["efficiency"] == pytest.approx(40.0 / (2 * (24.0 + count_ms + bucket_ms)))
    # Backward (1% of 10 ms here) caps how much allreduce it can hide, whatever the overlap.
    capped = scaling_model.step(measurement, cluster, global_batch=16, num_gpus=16, overlap=1.0, backward_share=0.01)
    assert capped["exposed_allreduce_ms"] == pytest.approx(capped["gradient_allreduce_ms"] - 0.1)
    # Under CUDA graphs the step also allreduces the shards' shape (24 bytes); a synchronised batch norm of 10
    # channels adds its statistics forward (120 bytes) and their gradients backward (80).
    path = write_measurement(tmp_path / "graphed.json", gradient_bytes=50 * mebibyte, ddp_bucket_cap_mb=25,
                             sync_batch_norm_channels=[10])
    measured = json.loads(path.read_text())
    measured["config"]["cuda_graphs"] = True
    path.write_text(json.dumps(measured))
    graphed = scaling_model.step(scaling_model.Measurement(str(path)), cluster, global_batch=16, num_gpus=2,
                                 overlap=0.5, backward_share=2 / 3)
    expected = [(num_bytes / 100e9 + 2e-6) * 1e3 for num_bytes in (64, 4, 24, 120, 80)]
    assert graphed["small_collectives_ms"] == pytest.approx(sum(expected))
    # 60 MiB of gradients: two full buckets and one of 10 MiB, where the 50 MiB above filled two (every bucket taken
    # as full passed every test). Compute measured in the order --compute-batches gave it, 4 before 1 and 2, is read
    # sorted: at batch 3, halfway between 2 and 4.
    path = write_measurement(tmp_path / "unsorted.json", {4: 16.0, 1: 10.0, 2: 11.0}, gradient_bytes=60 * mebibyte,
                             ddp_bucket_cap_mb=25, sync_batch_norm_channels=[])
    unsorted = scaling_model.Measurement(str(path))
    assert unsorted.compute_ms(3) == pytest.approx(13.5)
    row = scaling_model.step(unsorted, cluster, global_batch=16, num_gpus=2, overlap=0.5, backward_share=2 / 3)
    assert row["gradient_allreduce_ms"] == pytest.approx(2 * bucket_ms + (10 * mebibyte / 100e9 + 2e-6) * 1e3)


def test_scaling_model_checks_itself_at_the_overlap_the_measurement_shows(tmp_path):
    """A run on 2 GPUs whose step exposed 1 ms of a 4 ms flat allreduce hid 0.75 of it; the model's step for that run
    hides as much. An overlap taken as exposed / allreduce (0.25), or the model's step at overlap 0, passed every test
    and set the model's efficiency beside the measured one at an overlap no run showed."""
    path = write_measurement(tmp_path / "measured.json", gradient_bytes=50 * 2**20, ddp_bucket_cap_mb=25,
                             sync_batch_norm_channels=[])
    data = json.loads(path.read_text())
    data.update(world_size=2, exposed_communication_ms=1.0, allreduce={"median_ms": 4.0, "bus_GBps": 10.0},
                baseline={"strong_scaling_efficiency": 0.4}, step={"median_ms": 20.0})
    data["config"]["global_batch"] = 8
    path.write_text(json.dumps(data))
    measurement, cluster = scaling_model.Measurement(str(path)), scaling_model.Cluster()
    assert measurement.measured_overlap() == 0.75
    check = scaling_model.model_check(measurement, cluster, backward_share=2 / 3)
    hidden, exposed = (scaling_model.step(measurement, cluster, 8, 2, overlap, 2 / 3) for overlap in (1.0, 0.0))
    assert hidden["step_ms"] < exposed["step_ms"]  # the allreduce is not all hidden at overlap 0
    assert check["modelled_step_ms"] == pytest.approx(hidden["step_ms"] + 0.25 * (exposed["step_ms"]
                                                                                  - hidden["step_ms"]))
    assert check["modelled_efficiency"] == pytest.approx(measurement.compute_ms(8) / (2 * check["modelled_step_ms"]))
    assert (check["measured_efficiency"], check["measured_step_ms"], check["measured_bus_GBps"]) == (0.4, 20.0, 10.0)
    # Timing noise: a step that exposed more than the whole flat allreduce hid none of it, one faster than its no_sync
    # step all of it (unclamped, -0.5 and 1.25, and passed every test).
    for exposed_ms, overlap in ((6.0, 0.0), (-1.0, 1.0)):
        path.write_text(json.dumps({**data, "exposed_communication_ms": exposed_ms}))
        assert scaling_model.Measurement(str(path)).measured_overlap() == overlap


def test_scaling_model_writes_each_value_in_its_column(tmp_path):
    """The Markdown's rows against the JSON's, column by column, and what the JSON adds: the exposed allreduce in the
    gradient allreduce's column, the star on measured batches rather than extrapolated ones, the per-GPU batch's
    samples a second, no samples a second at all, the left-out pairs unlisted, or each GPU's inter-node ring given a
    node's NICs to itself, each passed every test."""
    measured = write_measurement(tmp_path / "measured.json", gradient_bytes=50 * 2**20, ddp_bucket_cap_mb=25,
                                 sync_batch_norm_channels=[])
    assert scaling_model.main(["--measured", str(measured), "--out", str(tmp_path), "--global-batch", "16", "--gpus",
                               "2", "3", "16", "--overlap", "0.5", "1"]) == 0
    projection = json.loads((tmp_path / "scaling_projection.json").read_text())
    markdown = (tmp_path / "scaling_projection.md").read_text().splitlines()
    # Batches 1 and 4 measured: 8 per GPU is extrapolated, 1 is not.
    for num_gpus, per_gpu_batch, star in ((2, 8, "*"), (16, 1, "")):
        half, whole = [row for row in projection["rows"] if row["gpus"] == num_gpus]
        assert (half["per_gpu_batch"], half["compute_extrapolated"]) == (per_gpu_batch, star == "*")
        assert half["exposed_allreduce_ms"] < half["gradient_allreduce_ms"]
        assert half["samples_per_s"] == pytest.approx(16 / half["step_ms"] * 1e3)
        assert (f"| {num_gpus} | {per_gpu_batch}{star} | {half['compute_ms']:.2f} | "
                f"{half['small_collectives_ms']:.3f} | {half['gradient_allreduce_ms']:.3f} | "
                f"{half['efficiency']:.3f} | {whole['efficiency']:.3f} |" in markdown)
    assert "Left out (global batch not divisible by the GPU count): G=16 on 3" in markdown
    # 8 NICs of 400 Gb/s a node, shared by its 8 GPUs' inter-node rings: 50 GB/s each.
    assert projection["assumptions"]["network_GBps_per_gpu_ring"] == 50.0
    assert any("8 x 400 Gb/s NICs per node, 50 GB/s for each GPU's inter-node ring" in line for line in markdown)


def test_scaling_model_never_extends_a_noisy_dip_to_negative_time(tmp_path):
    def measurement(compute_ms: dict) -> scaling_model.Measurement:
        return scaling_model.Measurement(str(write_measurement(
            tmp_path / "measured.json", compute_ms, gradient_bytes=1000, ddp_bucket_cap_mb=25,
            sync_batch_norm_channels=[],
        )))

    dip_at_the_start = measurement({1: 20.0, 2: 17.0, 4: 24.0})
    assert dip_at_the_start.compute_ms(2) == 17.0  # measured points stay as measured
    assert dip_at_the_start.compute_ms(3) == pytest.approx(20.5)
    assert dip_at_the_start.compute_ms(0.5) == 20.0  # below batch 1 flat, not rising
    assert dip_at_the_start.compute_ms(64) == pytest.approx(24.0 + (64 - 4) * 3.5)  # along the line from 2 to 4
    dip_at_the_end = measurement({1: 10.0, 2: 30.0, 4: 20.0})
    assert dip_at_the_end.compute_ms(1000) == 20.0  # flat, where the falling line would reach -4970 ms
    assert dip_at_the_end.extension(upward=True) == (20.0, 0.0)


@pytest.mark.parametrize("arguments, complaint", [
    (["--nic-Gbps", "0"], "--nic-Gbps must be positive and finite, got 0.0"),
    (["--nvlink-latency-us", "-1"], "--nvlink-latency-us must be finite and not negative, got -1.0"),
    # These two wrote a projection of NaN and Infinity (exit 0), which strict JSON readers refuse.
    (["--nic-Gbps", "inf"], "--nic-Gbps must be positive and finite, got inf"),
    (["--nvlink-latency-us", "inf"], "--nvlink-latency-us must be finite and not negative, got inf"),
    (["--backward-share", "-5"], "--backward-share must lie in [0, 1], got -5.0"),
    (["--gpus-per-node", "4"], "the measured run's 6 GPUs are not whole nodes of --gpus-per-node 4"),
    # Each of these was accepted by a check one step off, and passed every test.
    (["--backward-share", "1.5"], "--backward-share must lie in [0, 1], got 1.5"),
    (["--overlap", "0.5", "1.5"], "--overlap values must lie in [0, 1], got [0.5, 1.5]"),
    (["--gpus", "8", "12"], "--gpus 12 must be at most --gpus-per-node 8 or a multiple of it"),
])
def test_scaling_model_refuses_a_cluster_or_batch_it_cannot_model(tmp_path, capsys, arguments, complaint):
    measured = write_measurement(tmp_path / "measured.json", gradient_bytes=1000, ddp_bucket_cap_mb=25,
                                 sync_batch_norm_channels=[])
    six_gpus = {**json.loads(measured.read_text()), "world_size": 6}
    measured.write_text(json.dumps(six_gpus))
    assert scaling_model.main(["--measured", str(measured), "--out", str(tmp_path / "out"), *arguments]) == 2
    assert capsys.readouterr().err == f"error: {complaint}\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit, complaint", [
    (lambda data: data["config"].pop("model_config"), " lacks config.model_config, which must be an object"),
    # These two were refused in other words than every other field ("lacks 'device', which benchmarks.scaling writes",
    # from a KeyError), and a device of 5 or a depth of "x" not at all.
    (lambda data: data.pop("device"), " lacks device, which must be a string"),
    (lambda data: data["config"]["model_config"].pop("depth"),
     " lacks config.model_config.depth, which must be a whole number of at least 1"),
    (lambda data: data.update(world_size=2), " lacks exposed_communication_ms, which must be a finite number"),
    (lambda data: data.update(world_size=2, exposed_communication_ms=1.0, allreduce={"median_ms": 0.0}),
     ": allreduce.median_ms must be a positive finite number, got 0.0"),
    (lambda data: data.update(world_size=2, exposed_communication_ms=math.nan, allreduce={"median_ms": 2.0}),
     ": exposed_communication_ms must be a finite number, got nan"),
    # These four were checked by hand, each in its own words ("the compute times must be positive and finite, got [0.0,
    # 16.0] ms"); an infinite bucket cap was taken, and printed as "inf MiB".
    (lambda data: data["compute"][0].update(median_ms=0.0), ": compute[0].median_ms must be a positive finite number"),
    (lambda data: data["compute"][1].update(median_ms=math.nan),
     ": compute[1].median_ms must be a positive finite number, got nan"),
    (lambda data: data["model"].update(ddp_bucket_cap_mb=0),
     ": model.ddp_bucket_cap_mb must be a positive finite number, got 0"),
    (lambda data: data["model"].update(ddp_bucket_cap_mb=math.inf),
     ": model.ddp_bucket_cap_mb must be a positive finite number, got inf"),
    (lambda data: data.update(compute=data["compute"][:1]),
     ": the compute measure needs at least two distinct per-rank batches, and has 1: measure them with "
     "benchmarks.scaling --compute-batches (1 2 4, say)"),
    (lambda data: data.update(compute=[data["compute"][0]] * 2),
     ": the compute measure needs at least two distinct per-rank batches, and has 1, 1"),
    (lambda data: data.update(world_size=2, exposed_communication_ms=1.0, allreduce={"median_ms": 2.0, "bus_GBps": 1},
                              baseline={"strong_scaling_efficiency": 0.5}, step={"median_ms": 20.0},
                              config={**data["config"], "global_batch": 7}),
     ": config.global_batch 7 is not a multiple of world_size 2, as every run's is"),
])
def test_scaling_model_refuses_a_measurement_it_cannot_project_before_writing(tmp_path, capsys, edit, complaint):
    """Keys read after the first ones ended in a KeyError traceback, part of the files written; a zero time in
    ZeroDivisionError; a NaN one (json reads it) in a projection of NaN efficiencies, written as JSON's non-standard
    NaN; a global batch its world size does not divide was checked at a per-GPU batch rounded down."""
    measured = write_measurement(tmp_path / "measured.json", gradient_bytes=1000, ddp_bucket_cap_mb=25,
                                 sync_batch_norm_channels=[])
    data = json.loads(measured.read_text())
    edit(data)
    measured.write_text(json.dumps(data))
    assert scaling_model.main(["--measured", str(measured), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {measured}{complaint}")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit, complaint", [
    (lambda data: data["compute"][0].update(median_ms="10"),
     ": compute[0].median_ms must be a positive finite number, got '10'"),
    (lambda data: data["compute"][1].update(per_rank_batch=0),
     ": compute[1].per_rank_batch must be a whole number of at least 1, got 0"),
    (lambda data: data.update(compute=[1, 4]), ": compute[0] must be an object, got 1"),
    (lambda data: data.update(model=[]), ": model must be an object, got []"),
    (lambda data: data["model"].update(gradient_bytes=None),
     ": model.gradient_bytes must be a whole number of at least 1, got None"),
    (lambda data: data["model"].update(sync_batch_norm_channels=32),
     ": model.sync_batch_norm_channels must be a list, got 32"),
    (lambda data: data.update(world_size="2"), ": world_size must be a whole number of at least 1, got '2'"),
    (lambda data: data.update(world_size=0), ": world_size must be a whole number of at least 1, got 0"),
    (lambda data: data["config"].update(cuda_graphs="yes"), ": config.cuda_graphs must be true or false, got 'yes'"),
    (lambda data: data["config"].update(model_config="gru"), ": config.model_config must be an object, got 'gru'"),
    # Read only for the projection's title and assumptions, and printed as they stood: an amp of "no" as bf16.
    (lambda data: data["config"]["model_config"].update(depth="x"),
     ": config.model_config.depth must be a whole number of at least 1, got 'x'"),
    (lambda data: data.update(device=5), ": device must be a string, got 5"),
    (lambda data: data["config"].update(amp="no"), ": config.amp must be true or false, got 'no'"),
    (lambda data: data["config"].update(frames=300.5),
     ": config.frames must be a whole number of at least 1, got 300.5"),
    (lambda data: data.update(world_size=2, exposed_communication_ms=1.0, allreduce=3),
     ": allreduce must be an object, got 3"),
    (lambda data: data.update(world_size=2, exposed_communication_ms=1.0, allreduce={"median_ms": 2.0, "bus_GBps": 1},
                              baseline={"strong_scaling_efficiency": "0.5"}, step={"median_ms": 20.0}),
     ": baseline.strong_scaling_efficiency must be a positive finite number, got '0.5'"),
    # A NaN (which json reads) was set beside the model's in the Markdown as "nan" and in the JSON as non-standard NaN,
    # where read_baseline refused the same step time.
    (lambda data: data.update(world_size=2, exposed_communication_ms=1.0, allreduce={"median_ms": 2.0, "bus_GBps": 1},
                              baseline={"strong_scaling_efficiency": 0.5}, step={"median_ms": math.nan}),
     ": step.median_ms must be a positive finite number, got nan"),
    (lambda data: data.update(world_size=2, exposed_communication_ms=1.0, allreduce={"median_ms": 2.0, "bus_GBps": 0},
                              baseline={"strong_scaling_efficiency": 0.5}, step={"median_ms": 20.0}),
     ": allreduce.bus_GBps must be a positive finite number, got 0"),
])
def test_scaling_model_refuses_a_field_of_the_wrong_type_naming_it(tmp_path, capsys, edit, complaint):
    """A string where a number belongs, a list where an object does, ended the run in a TypeError traceback (one read
    only for the Markdown after the JSON was written); a world size of 0 in ZeroDivisionError."""
    measured = write_measurement(tmp_path / "measured.json", gradient_bytes=1000, ddp_bucket_cap_mb=25,
                                 sync_batch_norm_channels=[32])
    data = json.loads(measured.read_text())
    data["config"]["global_batch"] = 8
    edit(data)
    measured.write_text(json.dumps(data))
    assert scaling_model.main(["--measured", str(measured), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"error: {measured}{complaint}\n"
    assert not (tmp_path / "out").exists()


def test_scaling_model_refuses_a_file_it_cannot_read_or_write_in_one_line(tmp_path, capsys):
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "a_file").write_text("")
    measured = write_measurement(tmp_path / "measured.json", gradient_bytes=1000, ddp_bucket_cap_mb=25,
                                 sync_batch_norm_channels=[])
    for arguments, complaint in [
        (["--measured", str(tmp_path), "--out", str(tmp_path / "out")],
         f"error: {tmp_path}: Is a directory"),
        (["--measured", str(tmp_path / "list.json"), "--out", str(tmp_path / "out")],
         f"error: {tmp_path / 'list.json'} is not a benchmarks.scaling JSON"),
        (["--measured", str(measured), "--out", str(tmp_path / "a_file")], f"error: --out {tmp_path / 'a_file'}: "),
    ]:
        assert scaling_model.main(arguments) == 2
        assert capsys.readouterr().err.startswith(complaint)


def test_scaling_model_quotes_the_command_that_made_its_projection(tmp_path):
    # A repeated --gpus or --global-batch, which this counted once, is refused as every benchmark's list flags refuse
    # one (test_a_value_repeated_in_a_list_flag_is_refused_naming_it).
    measured = write_measurement(tmp_path / "measured.json", gradient_bytes=1000, ddp_bucket_cap_mb=25,
                                 sync_batch_norm_channels=[])
    arguments = ["--measured", str(measured), "--out", str(tmp_path), "--gpus", "8", "--global-batch", "64",
                 "--overlap", "0"]
    assert scaling_model.main(arguments) == 0
    projection = json.loads((tmp_path / "scaling_projection.json").read_text())
    assert len(projection["rows"]) == 1
    # What made it, quoted so that it runs as written.
    assert projection["assumptions"]["command"] == shlex.join(["python", "-m", "benchmarks.scaling_model", *arguments])
    assert f"Generated by `{projection['assumptions']['command']}`" in (tmp_path / "scaling_projection.md").read_text()


def test_scaling_refuses_a_baseline_that_is_not_its_own_json(tmp_path):
    from benchmarks.scaling import read_baseline

    config = {"model_config": {}, "global_batch": 8, "frames": 300, "amp": True, "num_features": 161,
              "cuda_graphs": False}
    for name, content, complaint in (
        ("list", [1, 2], "is not a benchmarks.scaling JSON"),
        ("bare", {"benchmark": "scaling"}, "lacks world_size, which must be a whole number of at least 1"),
        ("no_config", {"benchmark": "scaling", "world_size": 1}, "lacks config, which must be an object"),
    ):
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
        with pytest.raises(ValueError, match=f"{name}.json {complaint}"):
            read_baseline(str(tmp_path / f"{name}.json"), config, "NVIDIA H200")
    (tmp_path / "old.json").write_text(json.dumps({"benchmark": "scaling", "world_size": 1, "config": {"frames": 300}}))
    with pytest.raises(ValueError, match="has model_config=None, this run {}"):
        read_baseline(str(tmp_path / "old.json"), config, "NVIDIA H200")
    # Without a device it "ran on None", where benchmarks.scaling_model names the field as every other.
    (tmp_path / "nameless.json").write_text(json.dumps({"benchmark": "scaling", "world_size": 1, "config": config}))
    with pytest.raises(ValueError, match="nameless.json lacks device, which must be a string"):
        read_baseline(str(tmp_path / "nameless.json"), config, "NVIDIA H200")
    (tmp_path / "h100.json").write_text(json.dumps({"benchmark": "scaling", "world_size": 1, "config": config,
                                                   "device": "NVIDIA H100 80GB HBM3"}))
    with pytest.raises(ValueError, match="ran on NVIDIA H100 80GB HBM3, this run on NVIDIA H200: an efficiency"):
        read_baseline(str(tmp_path / "h100.json"), config, "NVIDIA H200")
    # Its step time is read after every measure, where a baseline without one ended the run in a KeyError, unwritten.
    with pytest.raises(ValueError, match="h100.json lacks step.median_ms, which must be a positive finite number"):
        read_baseline(str(tmp_path / "h100.json"), config, "NVIDIA H100 80GB HBM3")
    h100 = json.loads((tmp_path / "h100.json").read_text())
    for step_ms in (0.0, math.nan, True):  # true was taken for 1 ms
        (tmp_path / "h100.json").write_text(json.dumps({**h100, "step": {"median_ms": step_ms}}))
        with pytest.raises(ValueError, match=re.escape(
                f"h100.json: step.median_ms must be a positive finite number, got {step_ms!r}")):
            read_baseline(str(tmp_path / "h100.json"), config, "NVIDIA H100 80GB HBM3")
    (tmp_path / "h100.json").write_text(json.dumps({**h100, "step": {"median_ms": 12.5}}))
    assert read_baseline(str(tmp_path / "h100.json"), config, "NVIDIA H100 80GB HBM3")["world_size"] == 1
    # A CPU's name ends in its threads per rank, which the world size changes; a baseline from before --cuda-graphs has
    # no cuda_graphs, and ran without. Compared as they stood, each was refused, and passed every test.
    cpu = {**h100, "step": {"median_ms": 12.5}, "device": "CPU x86_64 (2 threads per rank)",
           "config": {key: value for key, value in config.items() if key != "cuda_graphs"}}
    (tmp_path / "cpu.json").write_text(json.dumps(cpu))
    assert read_baseline(str(tmp_path / "cpu.json"), config, "CPU x86_64 (1 thread per rank)")["world_size"] == 1
    with pytest.raises(ValueError, match="cpu.json has cuda_graphs=False, this run True"):
        read_baseline(str(tmp_path / "cpu.json"), {**config, "cuda_graphs": True}, "CPU x86_64 (1 thread per rank)")


@pytest.mark.parametrize("key, other", [("model_config", {"depth": 7}), ("global_batch", 16), ("frames", 600),
                                        ("amp", False), ("num_features", 80), ("cuda_graphs", True)])
def test_scaling_refuses_a_baseline_of_other_settings_or_several_ranks(tmp_path, key, other):
    """t(1) must be the same step on one process: a baseline at another global batch, length, precision or graphing,
    or one from two ranks, divided into this run's step gave an efficiency of another comparison. Only model_config
    was checked: any of the others dropped from the comparison passed every test."""
    from benchmarks.scaling import read_baseline

    config = {"model_config": {"depth": 5}, "global_batch": 8, "frames": 300, "amp": True, "num_features": 161,
              "cuda_graphs": False}
    baseline = {"benchmark": "scaling", "world_size": 1, "device": "NVIDIA H200", "step": {"median_ms": 12.5},
                "config": {**config, key: other}}
    (tmp_path / "one.json").write_text(json.dumps(baseline))
    with pytest.raises(ValueError, match=re.escape(f"one.json has {key}={other!r}, this run {config[key]!r}")):
        read_baseline(str(tmp_path / "one.json"), config, "NVIDIA H200")
    (tmp_path / "two.json").write_text(json.dumps({**baseline, "world_size": 2, "config": config}))
    with pytest.raises(ValueError, match="two.json must be a benchmarks.scaling JSON from one process"):
        read_baseline(str(tmp_path / "two.json"), config, "NVIDIA H200")


@pytest.mark.parametrize("content, complaint", [
    (None, ": Is a directory"),
    ('{"benchmark": "scaling"\n', " is not JSON: Expecting ',' delimiter"),
    ("[1, 2]", ' is not a benchmarks.scaling JSON (no "benchmark": "scaling")'),
    ('{"benchmark": "scaling", "config": {}}', " lacks world_size, which must be a whole number of at least 1"),
    ('{"benchmark": "scaling", "world_size": "1", "config": {}}',
     ": world_size must be a whole number of at least 1, got '1'"),
    ('{"benchmark": "scaling", "world_size": 1, "config": []}', ": config must be an object, got []"),
])
def test_a_scaling_json_is_refused_in_the_same_words_as_a_baseline_and_as_a_measurement(tmp_path, content, complaint):
    """benchmarks.scaling's --baseline and benchmarks.scaling_model's --measured read the one JSON that
    benchmarks.scaling writes, each with its own checks and words: a truncated file was "--baseline PATH: Expecting ','
    delimiter" to one and "PATH is not JSON: Expecting ',' delimiter" to the other, a world_size of "1" "must be a
    benchmarks.scaling JSON from one process" to one and the field named to the other."""
    path = tmp_path
    if content is not None:
        path = tmp_path / "scaling.json"
        path.write_text(content)
    refusals = []
    for read in (lambda: scaling.read_baseline(str(path), {}, "NVIDIA H200"),
                 lambda: scaling_model.Measurement(str(path))):
        with pytest.raises(ValueError) as refused:
            read()
        refusals.append(str(refused.value))
    assert refusals[0] == refusals[1] and refusals[0].startswith(f"{path}{complaint}"), refusals


def test_ranks_that_share_a_gpu_are_counted_on_it():
    assert [launch_ranks.ranks_sharing_gpu(gpu, 4, 8) for gpu in range(4)] == [1, 1, 1, 1]
    assert [launch_ranks.ranks_sharing_gpu(gpu, 5, 2) for gpu in range(2)] == [3, 2]  # rank_gpu's 0, 1, 0, 1, 0
    assert launch_ranks.ranks_sharing_gpu(0, 8, 1) == 8


def settings_check_worker(rank, directory):
    """One of two gloo ranks (no MPI: the check itself, not the launch): rank 1 holds six settings other than rank 0's,
    and a key rank 0 lacks."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank, world_size=2)
    try:
        settings = {f"key{index}": str(rank * index) for index in range(1, 7)} | ({"only_1": "x"} if rank else {})
        distributed.check_same_on_every_rank(settings, refusal="told apart", remedy="the remedy")
    except ValueError as error:
        Path(directory, f"rank{rank}.txt").write_text(str(error))
    finally:
        torch.distributed.destroy_process_group()


def test_ranks_with_several_other_settings_are_refused_on_every_rank_naming_the_first_four_and_counting_the_rest(
        tmp_path):
    """The mpiexec tests change one setting: with every difference listed, or none counted past the fourth, or a key
    only one rank holds left out, they passed."""
    torch.multiprocessing.spawn(settings_check_worker, args=(str(tmp_path),), nprocs=2)
    expected = ("told apart (rank 1 has key1=1 where rank 0 has 0; rank 1 has key2=2 where rank 0 has 0; rank 1 has "
                "key3=3 where rank 0 has 0; rank 1 has key4=4 where rank 0 has 0; 3 more): the remedy")
    assert [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)] == [expected, expected]
