"""Training, top to bottom: distributed init -> data -> model -> optimizer -> epochs of (steps, evaluation, checkpoint).

Each step is one call of trainer.step's `train_step`; trainer.records writes what the run records of its jobs, steps and
epochs. Only rank 0 writes checkpoints, logs, TensorBoard and the progress bar; every rank can resume from what it
wrote. SIGUSR1, SIGTERM or Ctrl-C stops training after a step with its checkpoint (trainer.stop).
"""
import contextlib
import logging
import math
import os
import random
import sys
import time
import uuid
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader
from tqdm import tqdm

from data.cli import shows_a_progress_bar
from data.dataset import SpeechDataset, collate
from data.features import FeatureExtractor
from data.files import errors_naming, replace_whole
from data.prepare import prepare_an4
from data.sampler import BucketBatchSampler, epoch_seed, eval_shards
from data.text import counted
from models.cuda_graphs import CudaGraphed, check_capturable
from trainer import build, checkpoint, distributed
from trainer.config import (CUDA_GRAPHS_NEED_A_GPU, RUN_NAME_SETTING, check_config, global_batch_refusal,
                            per_rank_batch_size, rank_settings)
from trainer.distributed import DistEnv
from trainer.evaluate import evaluate
from trainer.inputs import naming_the_an4_source
from trainer.metrics import ErrorCounts
from trainer.records import open_metrics, record_epoch, record_job, record_step, tensorboard_writer
from trainer.resume import (
    checkpoint_to_resume, known_entries, load_finite_model, load_optimizer_state, position_in_epochs, resume_into,
    settle_best,
)
from trainer.run_directory import hold_run_directory
from trainer.step import KEEP_FINITE, STOPPED, EpochTally, train_step
from trainer.stop import StopSignals, ignore_in_data_workers, received_counts, start_data_workers, stop_requests

log = logging.getLogger(__name__)


@contextlib.contextmanager
def warnings_from_rank_0_alone(env: DistEnv, logger: logging.Logger):
    """In the block, `logger` warns on rank 0 alone: for what every rank does alike (reading the same manifests),
    where the others' warnings would name each thing once a rank. Their errors still come through."""
    if env.is_main:
        yield
        return
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def prepare_manifests(data_cfg: DictConfig, env: DistEnv) -> None:
    """With `data.an4_source` set, rank 0 writes the AN4 manifests (skipped when up to date); the others wait."""
    if data_cfg.an4_source is not None and env.is_main:
        with naming_the_an4_source():
            prepare_an4(Path(data_cfg.an4_source), Path(data_cfg.manifest_dir))
    distributed.barrier()


def train_loader(train_set: SpeechDataset, sampler: BucketBatchSampler, cfg: DictConfig, env: DistEnv,
                 epoch: int) -> DataLoader:
    """One epoch's batches, pinned for asynchronous copies to the GPU except under CUDA graphs: the pin-memory
    thread allocates page-locked memory as it goes, a CUDA call that invalidates a graph capture under way on the
    main thread (make_graphed_callables captures in global mode)."""
    return DataLoader(
        train_set,
        batch_sampler=sampler,
        collate_fn=collate,
        num_workers=cfg.train.num_workers,
        pin_memory=env.device.type == "cuda" and not cfg.train.cuda_graphs,
        generator=torch.Generator().manual_seed(epoch_seed(cfg.seed, epoch)),
        worker_init_fn=ignore_in_data_workers,
    )


def checked_recurrent_backend(model, cfg: DictConfig, key: str, batch_size: int, dtype: torch.dtype,
                              device: torch.device) -> str:
    """model.recurrent_backend at `batch_size` utterances a rank, the batch the config's `key` gives. Where
    model.backend=persistent cannot run it because of the batch, the error names `key`, and model.batch_slice where that
    slices the batch: models/ knows no config keys, and its message names only a batch size. Where one utterance is
    refused alike (no GPU, say), the batch is not why, and the error names model.backend instead."""
    try:
        return model.recurrent_backend(batch_size, dtype, device)
    except ValueError as error:
        try:
            model.recurrent_backend(1, dtype, device)
        except ValueError as error_at_one:
            if str(error_at_one) == str(error):
                raise ValueError(f"model.backend={cfg.model.backend}: {error}") from None
        batch_slice = cfg.model.batch_slice
        slices = f", in slices of model.batch_slice={batch_slice}" if batch_slice and batch_slice < batch_size else ""
        raise ValueError(f"{key}={OmegaConf.select(cfg, key)} ({counted(batch_size, 'utterance')} a rank{slices}): "
                         f"{error}") from None


def checked_batches(cfg: DictConfig, env: DistEnv, num_features: int) -> tuple[int, torch.dtype, str]:
    """This rank's share of the global batch, and the recurrent layers' dtype and backend (checked_recurrent_backend's)
    for it. Asked before the corpus is prepared and read (minutes, for a large one), so that a shape the persistent
    backend cannot run ends the job at once, saying why: the training batch, and the evaluation's, which would otherwise
    fail only after the first epoch. An uneven split too, which the sampler, built from the corpus, would refuse only
    after it (a resume on another number of GPUs), and whose rounded-down share the backend's check would judge."""
    one_layer = build.backend_probe(cfg.model, num_features)
    per_rank_batch = per_rank_batch_size(cfg, env.world_size)
    dtype = build.compute_dtype(cfg.train.amp, env.device)
    backend = checked_recurrent_backend(one_layer, cfg, "train.global_batch_size", per_rank_batch, dtype, env.device)
    checked_recurrent_backend(one_layer, cfg, "train.eval_batch_size", cfg.train.eval_batch_size, dtype, env.device)
    if cfg.train.cuda_graphs:
        check_capturable(one_layer, per_rank_batch, dtype, env.device)
    return per_rank_batch, dtype, backend


def recurrent_backend_name(backend: str, device: torch.device) -> str:
    """How the log names a model.recurrent_backend answer."""
    if backend == "cudnn":
        return "cuDNN (torch.nn)" if device.type == "cuda" else "torch.nn"
    return {"persistent": "the persistent kernels", "reference": "the reference recurrence (plain PyTorch)"}[backend]


# Past this many parameters a model trained on the CPU gets a warning: experiment=cpu_demo's 1.3M train there in
# minutes an epoch, the default 41M were sized for a GPU.
LARGE_FOR_A_CPU = 10_000_000


def cpu_size_warning(parameters: int, device: torch.device) -> str | None:
    """The warning for a model far larger than the CPU demo's trained on the CPU, or None: on a machine without a GPU
    `python -m trainer` takes the GPU recipe's model, and nothing said why its epochs crawled."""
    if device.type != "cpu" or parameters <= LARGE_FOR_A_CPU:
        return None
    return (f"training a {build.millions_or_billions(parameters)}-parameter model on the CPU: its epochs will be slow "
            "(experiment=cpu_demo is the model sized for a CPU)")


def peak_gpu_memory_gib(device: torch.device) -> tuple[float, float] | None:
    """The most GPU memory any rank's allocator held since the last reset, (allocated by tensors, reserved from the
    GPU) in GiB, or None off the GPU: logged each epoch, so that a deeper or wider model's headroom shows before it
    runs out. Every rank must call it (a collective)."""
    if device.type != "cuda":
        return None
    peaks = torch.tensor([torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)],
                         dtype=torch.float64, device=device)
    allocated, reserved = (distributed.all_reduce_max(peaks) / 2**30).tolist()
    return allocated, reserved


def refuse_if_diverged(model: torch.nn.Module, step: int, name: str) -> None:
    """Before a checkpoint is written: ValueError where the model holds values that are not finite. An update that
    overflowed (at a finite gradient) leaves weights that would resume only to skip every step, and that no tool
    evaluates; the evaluation at an epoch's end stops such a run, but a checkpoint inside an epoch
    (train.checkpoint_every_steps, train.max_steps, a stop signal) comes before it."""
    not_finite = build.entries_not_finite(model)
    if not_finite:
        raise ValueError(f"after step {step} the model holds values that are not finite (in {not_finite}): its "
                         f"weights diverged, so {name} was not written and the earlier checkpoints stay "
                         f"({KEEP_FINITE})")


def stops_at_max_steps(max_steps: int | None, state: dict, steps_per_epoch: int) -> bool:
    """Whether train.max_steps stops training where `state` stands: its step reached, with no evaluation due. An epoch's
    last step is evaluated first; a stop during that evaluation saved the step with its evaluation still to make,
    which is no step, so train.max_steps reached there leaves the evaluation to the job that resumes it."""
    evaluation_due = state["epoch_step"] == steps_per_epoch
    return max_steps is not None and state["step"] >= max_steps and not evaluation_due


def how_to_continue(continue_with: str, stopped_by: str) -> str:
    """What continues a stopped run, for its last log line: where train.max_steps stopped it, the same limit again
    trains nothing."""
    if stopped_by == "train.max_steps":
        return f"{continue_with} but a higher train.max_steps (or null)"
    return continue_with


def note_stop(result: dict, step: int, where: str, stopped_by: str, continue_with: str, run_dir: Path,
              what_continues: str = "it") -> None:
    """Records in `result` the step the run stopped at, and logs where and why (stop_for, or train.max_steps) and what
    continues `what_continues` from the last.pt just saved."""
    result["stopped_at_step"] = step
    log.info("stopped %s (%s); %s continues %s from %s", where, stopped_by, how_to_continue(continue_with, stopped_by),
             what_continues, run_dir / "checkpoints" / "last.pt")


def stop_for(requests: dict, world_size: int, result: dict) -> str:
    """Why the run stops, for the log, from {signal: how many ranks received it}; the signal most ranks received
    gives every rank's exit code (result["stop_signal"], trainer/__main__.py)."""
    result["stop_signal"] = max(requests, key=requests.get)
    return signals_received(requests, world_size)


def signals_received(requests: dict, world_size: int) -> str:
    """"SIGTERM", or "SIGTERM on 1 of 2 ranks", from {signal: how many ranks received it}."""
    return ", ".join(number.name + (f" on {ranks} of {world_size} ranks" if world_size > 1 else "")
                     for number, ranks in requests.items())


def stop_requests_of_all_ranks(stop_signals: StopSignals, env: DistEnv) -> dict:
    """{signal: how many ranks received it} over every rank, a collective: a signal that reached one rank alone stops
    every rank alike (its evaluation too, where the others would evaluate their whole shard while it waited)."""
    return stop_requests(distributed.all_reduce_sum(torch.tensor(
        received_counts(stop_signals.received), dtype=torch.float64, device=env.device)).tolist())


# The overrides too: a resume's settings are its command line's, and without them it is the default config, refused.
CONTINUE_RUN = f"train.resume=auto under the same {RUN_NAME_SETTING} and overrides"


def train(cfg: DictConfig, run_dir: Path, continue_with: str = CONTINUE_RUN) -> dict:
    """Trains as the config says; returns the last evaluation's figures ({"wer", "cer", "epoch", "step"}, where this
    job made one), with "stop_signal" where a stop signal ended it and "stopped_at_step" where train.max_steps (or a
    signal) stopped it before its last epoch's end; {} where the checkpoint it resumed had nothing left to train.
    continue_with: what continues the run where train.max_steps or a stop signal stops it, for the log (a sweep's
    job: the sweep run again)."""
    check_config(cfg)  # before the distributed start, which takes three of its values
    with StopSignals() as stop_signals:
        env = distributed.init(cfg.device, cfg.distributed.timeout_s, cfg.distributed.share_gpus)
        distributed.check_same_on_every_rank(rank_settings(cfg))
        with hold_run_directory(run_dir, env.is_main):
            result = _train(cfg, run_dir, env, continue_with, stop_signals)
    # On success only, not in a `finally`: a rank that raised must keep its connections open until __main__ has logged
    # its error and aborted the job; closing them first lets another rank fail on the closed peer and abort before it.
    distributed.shutdown(cfg.distributed.timeout_s)
    return result


def left_out_of_each_epoch(count: int, sortagrad: bool) -> str:
    """The utterances each epoch leaves out (the training set's remainder modulo the global batch) and which they are;
    the count alone where it is 0 (it said "0 utterances of each (the longest in a SortaGrad epoch, ...)")."""
    if not count:
        return counted(count, "utterance")
    which = "the longest in a SortaGrad epoch, a random choice after it" if sortagrad else "a random choice"
    return f"{counted(count, 'utterance')} ({which})"


def utterances_per_second(utterances: int, seconds: float) -> str:
    """A training rate for the progress line and bar: one decimal at 1 utterance a second or more, two significant
    digits below, where a deep model on a CPU (a 100-layer stack at tens of seconds a step) read as 0.0."""
    rate = utterances / seconds
    return f"{rate:.1f}" if rate >= 1 else f"{rate:.2g}"


def evaluate_unless_stopped(model, eval_set: SpeechDataset, eval_batches: list, cfg: DictConfig, env: DistEnv,
                            stop_signals: StopSignals, show_progress_bar: bool, epoch: int, step: int
                            ) -> ErrorCounts | None:
    """The evaluation after `epoch`'s training, ending at step `step`: this rank's counts, or None where a stop signal
    cut it short. evaluate() asks before each batch and ends at the first yes; every rank gets the same answer (a
    collective), so all of them agree whether their evaluation was cut short."""
    cut_short = False

    def stop_evaluation() -> bool:
        nonlocal cut_short
        cut_short = bool(stop_requests_of_all_ranks(stop_signals, env))
        return cut_short

    try:
        counts, _ = evaluate(model, eval_set, eval_batches, env.device, cfg.train.amp, cfg.train.num_workers,
                             worker_timeout_s=cfg.distributed.timeout_s, progress_bar=show_progress_bar,
                             progress_line_s=cfg.train.progress_line_s if env.is_main else None,
                             stop=stop_evaluation, stopping=stop_signals.came)
    except ValueError as error:  # a model whose weights diverged: say where, and that nothing of it was saved
        raise ValueError(f"evaluating after epoch {epoch + 1} (step {step}): {error}; this epoch's model was not "
                         f"saved ({KEEP_FINITE})") from error
    return None if cut_short else counts


def evaluation_batches(eval_set: SpeechDataset, env: DistEnv, batch_size: int) -> list[list[int]]:
    """This rank's shard of the test set in batches, as many as the rank with the most (empty ones more where this
    rank has fewer): the evaluation asks the ranks for stop signals before each batch, a collective every rank must
    join."""
    shards = eval_shards(eval_set.durations, env.world_size, batch_size)
    return shards[env.rank] + [[]] * (max(map(len, shards)) - len(shards[env.rank]))


def datasets(cfg: DictConfig, features: FeatureExtractor, time_stride: int,
             run_dir: Path | None = None) -> tuple[SpeechDataset, SpeechDataset]:
    """The training set and the test set of a model whose outputs are `time_stride` frames apart. Only the training
    set is SpecAugmented (data.augment) and left without utterances past data.max_duration: each evaluation scores
    every test utterance as it sounds. Its masks are drawn from the run's seed (with the epoch and the item: the same
    whichever rank or worker loads it). Each set's utterances left out at the start are to be listed in `run_dir`,
    where given, as skipped_train.jsonl and skipped_test.jsonl (SpeechDataset.write_skip_list)."""
    def skip_list(name: str) -> Path | None:
        return run_dir / f"skipped_{name}.jsonl" if run_dir is not None else None

    augment = build.spec_augment(cfg.data, features.num_features)
    train_set = SpeechDataset(
        list(cfg.data.train_manifests), features, augment, time_stride, cfg.data.max_duration, seed=cfg.seed,
        skip_list=skip_list("train"),
    )
    return train_set, SpeechDataset([cfg.data.eval_manifest], features, None, time_stride, skip_list=skip_list("test"))


def training_batches(train_set: SpeechDataset, cfg: DictConfig, env: DistEnv) -> BucketBatchSampler:
    """This rank's share of each global batch of the training set, in the order the run's seed and data.sortagrad
    give; ValueError naming train.global_batch_size where the set cannot fill one."""
    try:
        return BucketBatchSampler(
            train_set.durations, cfg.train.global_batch_size, env.rank, env.world_size, cfg.seed, cfg.data.sortagrad
        )
    except ValueError as error:
        raise global_batch_refusal(cfg, error) from None


def model_to_train(model: torch.nn.Module, cfg: DictConfig, env: DistEnv) -> torch.nn.Module:
    """`model` as train_step runs it: in CUDA graphs where train.cuda_graphs says so, and over several ranks in DDP,
    its batch norms averaging their statistics over the ranks where train.sync_batch_norm says so. The evaluations and
    the checkpoints take `model` itself."""
    if env.world_size > 1:
        model.sync_batch_norm(cfg.train.sync_batch_norm)
    wrapped = model
    if cfg.train.cuda_graphs:
        wrapped = CudaGraphed(model, cfg.train.graph_pad_frames, build.uses_amp(cfg.train.amp, env.device))
    if env.world_size > 1:
        wrapped = distributed.data_parallel(wrapped, env.device, graphed=cfg.train.cuda_graphs)
    return wrapped


def check_cuda_graphs_can_run(cfg: DictConfig, env: DistEnv) -> None:
    """ValueError where train.cuda_graphs=true cannot run on this job: off a GPU, or over a backend other than NCCL."""
    if cfg.train.cuda_graphs and env.device.type != "cuda":
        raise ValueError(CUDA_GRAPHS_NEED_A_GPU.format(device=env.device))
    if cfg.train.cuda_graphs and env.world_size > 1 and distributed.backend() != "nccl":
        raise ValueError(
            f"train.cuda_graphs=true in a job of {env.world_size} ranks needs NCCL, one GPU per rank: these ranks "
            f"all-reduce over {distributed.backend()} (distributed.share_gpus), whose collectives a CUDA graph cannot "
            "capture; set train.cuda_graphs=false"
        )


def _train(cfg: DictConfig, run_dir: Path, env: DistEnv, continue_with: str, stop_signals: StopSignals) -> dict:
    training = Training(cfg, run_dir, env, continue_with, stop_signals)
    if training.has_nothing_to_train():
        # Returns before the run's records are touched: rewritten from an earlier checkpoint's step, they would lose
        # the steps that the directory's last.pt, left as it is, holds.
        return {}
    return training.run()


class Training:
    """One job of a run. The constructor builds the data, the model and the optimizer and resumes the checkpoint
    train.resume names; run() records the job, then trains epoch by epoch (train_epoch's steps, end_epoch's evaluation
    and checkpoints) until train.epochs, train.max_steps or a stop signal. `state` is what a checkpoint stores of the
    training, `result` what train() returns. What only a job that trains has, run() adds: run_id, `wrapped` (the model
    as train_step runs it), rank 0's `writer` and `metrics_file`, the clock `run_started` and show_progress_bar."""

    def __init__(self, cfg: DictConfig, run_dir: Path, env: DistEnv, continue_with: str, stop_signals: StopSignals):
        max_steps = cfg.train.max_steps
        check_cuda_graphs_can_run(cfg, env)
        if env.device.type == "cpu":
            # oneDNN's convolution weight gradient corrupts memory on the front end's small frequency maps (torch 2.14
            # CPU: segfaults and double frees); ATen's own convolution is exact and about 25 % slower.
            torch.backends.mkldnn.enabled = False
        resume = checkpoint_to_resume(cfg.train.resume, run_dir)
        torch.manual_seed(cfg.seed + env.rank)
        random.seed(cfg.seed + env.rank)
        if env.is_main:  # hold_run_directory made the run directory
            log.info("resolved config:\n%s", OmegaConf.to_yaml(cfg, resolve=True))
            log.info("run directory: %s (world size %d, device %s)", run_dir, env.world_size, env.device)

        features = build.features(cfg.data)  # before the manifests: preparing a corpus can take minutes
        # Before the manifests' barrier too, so that no rank has built its model yet: on a CPU, one built already would
        # take its share out of the memory another rank's check divides among all of them.
        build.check_model_fits(cfg.model, cfg.optim.name, features.num_features, env.device, env.ranks_on_device)
        per_rank_batch, recurrent_dtype, recurrent_backend = checked_batches(cfg, env, features.num_features)
        prepare_manifests(cfg.data, env)
        model = build.model(cfg.model, features.num_features).to(env.device)
        with warnings_from_rank_0_alone(env, logging.getLogger(SpeechDataset.__module__)):  # what they leave out
            train_set, eval_set = datasets(cfg, features, model.time_stride, run_dir if env.is_main else None)
        train_fingerprint = train_set.fingerprint()
        test_fingerprint = eval_set.fingerprint()
        distributed.check_same_on_every_rank({"the training set": train_fingerprint, "the test set": test_fingerprint})
        sampler = training_batches(train_set, cfg, env)
        eval_batches = evaluation_batches(eval_set, env, cfg.train.eval_batch_size)
        if env.is_main:
            parameters = sum(p.numel() for p in model.parameters())
            log.info(
                "model: %s parameters; %d training and %d test utterances; %s per epoch, leaving out %s of each",
                build.millions_or_billions(parameters, decimals=2), len(train_set), len(eval_set),
                counted(len(sampler), "step"),
                left_out_of_each_epoch(len(train_set) - len(sampler) * cfg.train.global_batch_size, cfg.data.sortagrad),
            )
            slices = f" in slices of {cfg.model.batch_slice}" if cfg.model.batch_slice else ""
            log.info("recurrent layers on %s: %s a rank%s, %s",
                     recurrent_backend_name(recurrent_backend, env.device), counted(per_rank_batch, "utterance"),
                     slices, "bf16" if recurrent_dtype == torch.bfloat16 else "fp32")
            if warning := cpu_size_warning(parameters, env.device):
                log.warning(warning)

        optimizer = build.optimizer(cfg.optim, model.parameters())
        scheduler = build.lr_schedule(cfg.optim, optimizer, len(sampler))
        # epoch_step counts the steps trained this epoch: the sampler's own position runs ahead of it by the batches
        # a prefetching DataLoader holds, so checkpoints store this count as the sampler position.
        # elapsed_s: seconds of training and evaluation over all of the run's jobs. best_unreadable and best_wer:
        # best.pt's evaluation (ErrorCounts.beats); best_unreadable is its not_decoded, the test utterances it could not
        # decode.
        state = {"epoch": 0, "epoch_step": 0, "step": 0, "best_unreadable": math.inf, "best_wer": math.inf,
                 "elapsed_s": 0.0}
        # The parts a checkpoint restores besides the training state and the RNGs, as save() writes them.
        start = resume_into(resume, state, cfg, run_dir, env, train_fingerprint, test_fingerprint, {
            "model": lambda saved_model: load_finite_model(model, saved_model),
            "optimizer": lambda saved_optimizer: load_optimizer_state(optimizer, saved_optimizer),
            "scheduler": lambda saved_scheduler: scheduler.load_state_dict(
                known_entries(saved_scheduler, scheduler.state_dict())),
            "sampler": sampler.load_state_dict,
        })
        self.cfg, self.run_dir, self.env = cfg, run_dir, env
        self.continue_with, self.stop_signals = continue_with, stop_signals
        self.max_steps = max_steps
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.train_set, self.eval_set, self.sampler, self.eval_batches = train_set, eval_set, sampler, eval_batches
        self.train_fingerprint, self.test_fingerprint = train_fingerprint, test_fingerprint
        self.resume, self.state, self.start = resume, state, start
        self.result = {}  # what train() returns

    def has_nothing_to_train(self) -> bool:
        """Whether the checkpoint resumed had reached train.epochs or train.max_steps already, which it logs."""
        state, epochs = self.state, self.cfg.train.epochs
        trained_out = state["epoch"] >= epochs or stops_at_max_steps(self.max_steps, state, len(self.sampler))
        if self.start.checkpoint is not None and trained_out:
            log.info("nothing to train: %s reached step %d (%s; train.epochs=%d, train.max_steps=%s); the run "
                     "directory is left as it was", self.start.checkpoint, state["step"], position_in_epochs(state),
                     epochs, "null" if self.max_steps is None else self.max_steps)
            return True
        return False

    def write_job_records(self) -> None:
        """Rank 0 writes the run's config and its record of this job, the sets' skip lists and, from a checkpoint of
        another run, its best.pt."""
        cfg, run_dir, env = self.cfg, self.run_dir, self.env
        self.run_id = self.start.run_id or uuid.uuid4().hex  # a fresh run, or one from another run's checkpoint
        # Only now: a run that stopped before here (a checkpoint refused) leaves the directory as it was.
        if env.is_main:
            # As the checkpoints store it: a "${" the command line escaped is text, not an interpolation for its
            # readers. Whole or not at all: a job killed while writing it left the run's readers (wer_parity --report)
            # half a file.
            replace_whole(run_dir / "config.yaml",
                          OmegaConf.to_yaml(checkpoint.stored_config(OmegaConf.to_container(cfg, resolve=True))))
            record_job(run_dir / "jobs.jsonl", self.run_id, self.state["step"], env, resumed=self.start.continues,
                       auto_found_no_checkpoint=cfg.train.resume == "auto" and self.resume is None)
            self.train_set.write_skip_list()
            self.eval_set.write_skip_list()
            # Afresh, the run directory holds no best.pt (checkpoint_to_resume refuses one).
            if self.start.best is not None:
                settle_best(run_dir, self.start.best, self.test_fingerprint)

    def run(self) -> dict:
        """Records the job, then trains from where the state stands; returns train()'s result."""
        cfg, env, state = self.cfg, self.env, self.state
        self.write_job_records()
        self.wrapped = model_to_train(self.model, cfg, env)
        self.writer, self.metrics_file = None, None
        if env.is_main:
            # So that each step is listed once: the events and lines of the steps this job trains again are dropped from
            # the earlier files, and all of them where it starts a run of its own (a failed attempt's, or a fresh run's
            # over one that left no checkpoint).
            continues = self.start.continues
            self.writer = tensorboard_writer(self.run_dir / "tensorboard", state["step"] + 1 if continues else 1)
            self.metrics_file = open_metrics(self.run_dir / "metrics.jsonl", state if continues else None)

        # The clock as if this job had run the whole run, so a resumed run's elapsed_s goes on from its checkpoint's.
        self.run_started = time.perf_counter() - state["elapsed_s"]
        # On a terminal that has a width only: in a pipe or a batch job's log each redraw would be a line of its own.
        self.show_progress_bar = env.is_main and cfg.train.progress_bar and shows_a_progress_bar(sys.stderr)
        # From here a stop signal ends the run at a step's end with its checkpoint; before, there is nothing to save.
        self.stop_signals.listen()
        # No epoch starts past train.max_steps: a resume whose checkpoint reached it returned in _train (nothing to
        # train), and the epoch's end that reaches it stops (end_epoch).
        for epoch in range(state["epoch"], cfg.train.epochs):
            tally, stopped_by = self.train_epoch(epoch)
            if state["epoch_step"] < len(self.sampler):  # stopped inside the epoch
                self.save("last.pt")
                note_stop(self.result, state["step"], f"at step {state['step']}", stopped_by, self.continue_with,
                          self.run_dir)
                break
            if self.end_epoch(epoch, tally, stopped_by):
                break

        if env.is_main:
            self.writer.close()
            self.metrics_file.close()
        return self.result

    def train_epoch(self, epoch: int) -> tuple[EpochTally, str | None]:
        """`epoch`'s steps from where the state stands to the epoch's end, or to train.max_steps or a stop signal inside
        it, with the checkpoints train.checkpoint_every_steps asks for on the way; returns the epoch's tally and why
        training stops (train.max_steps, the stop signals) or None."""
        cfg, env, state, sampler = self.cfg, self.env, self.state, self.sampler
        checkpoint_every = cfg.train.checkpoint_every_steps
        state["epoch"] = epoch
        sampler.set_epoch(epoch)
        self.train_set.set_epoch(epoch)
        loader = train_loader(self.train_set, sampler, cfg, env, epoch)
        tally = EpochTally(epoch, first_step=state["epoch_step"])
        # Each epoch end and checkpoint before this epoch refused one that trained nothing.
        trained_before = epoch > 0 or tally.first_step > 0
        if env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(env.device)
        self.wrapped.train()
        # Counted by hand: a bar that wraps the loader counts a batch only when the next one is asked for, so a stop
        # at train.max_steps left it a step behind.
        progress = tqdm(
            desc=f"epoch {epoch + 1}/{cfg.train.epochs}", disable=not self.show_progress_bar,
            initial=state["epoch_step"], total=len(sampler), dynamic_ncols=True,
        )
        last_progress_line = tally.started
        stopped_by = None  # why training stops in or after this epoch: train.max_steps or stop signals
        # A batch waited on for distributed.timeout_s ends the run, as a collective does; a stop signal ends the wait.
        for batch in start_data_workers(loader, cfg.distributed.timeout_s, stopping=self.stop_signals.came):
            if batch is not None and batch.unusable:
                self.train_set.warn_once(batch.unusable)
            learning_rate = self.scheduler.get_last_lr()[0]  # before train_step moves the schedule on to the next step
            step = train_step(self.wrapped, batch, self.optimizer, self.scheduler, cfg, env, self.stop_signals.received)
            if step.outcome == STOPPED:  # this batch untrained: a resume starts from it
                stopped_by = stop_for(step.stop_requests, env.world_size, self.result)
                break
            state["step"] += 1
            state["epoch_step"] += 1
            progress.update()
            tally.count(step, batch.unusable)
            if step.outcome != "ok":
                if env.is_main:  # every rank skips it, for the same reason
                    log.warning("step %d skipped: %s", state["step"], step.outcome)
            elif env.is_main:
                now = time.perf_counter()
                rate = utterances_per_second(tally.utterances, now - tally.started)
                progress.set_postfix(loss=f"{step.loss:.3f}", utt_per_s=rate)
                if not self.show_progress_bar and now - last_progress_line >= cfg.train.progress_line_s:
                    last_progress_line = now
                    log.info("epoch %d: step %d of %d, loss %.3f, %s utterances/s", epoch + 1,
                             state["epoch_step"], len(sampler), step.loss, rate)
                record_step(state["step"], epoch, step.loss, learning_rate, self.writer, self.metrics_file)
            # Inside the epoch only (stops_at_max_steps): at its last step the evaluation comes first, and the epoch's
            # end (end_epoch) stops there.
            if stops_at_max_steps(self.max_steps, state, len(sampler)):
                stopped_by = "train.max_steps"
                break
            # Mid-epoch only: the epoch's end saves last.pt anyway, after evaluation.
            if checkpoint_every and state["step"] % checkpoint_every == 0 and state["epoch_step"] < len(sampler):
                tally.refuse_if_nothing_trained(state["epoch_step"], overflows_pass=trained_before)
                self.save("last.pt")
        progress.close()
        # A stop signal's last.pt is one the resume goes on from, as from a checkpoint inside the epoch: steps skipped
        # for losses that were not finite pass there too, where refusing ended the run with exit code 2, not the
        # signal's, which a scheduler's requeue looks for (launch/slurm.sbatch).
        stopped_on_a_signal = stopped_by not in (None, "train.max_steps")
        overflows_pass = (trained_before or stopped_on_a_signal) and state["epoch_step"] < len(sampler)
        tally.refuse_if_nothing_trained(state["epoch_step"], overflows_pass=overflows_pass)
        return tally, stopped_by

    def end_epoch(self, epoch: int, tally: EpochTally, stopped_by: str | None) -> bool:
        """After `epoch`'s last step: its evaluation, its records, best.pt where it beats the best so far, and last.pt;
        returns whether training stops here: for a stop signal, train.max_steps, or `stopped_by` (train_epoch's, set
        where a stop signal came as the batch after the epoch's last was awaited)."""
        cfg, env, state = self.cfg, self.env, self.state
        tally.trained_s = time.perf_counter() - tally.started
        local_counts = evaluate_unless_stopped(self.model, self.eval_set, self.eval_batches, cfg, env,
                                               self.stop_signals, self.show_progress_bar, epoch, state["step"])
        # One that came during the last batch or after it, too late to cut the evaluation short: the epoch ends as
        # any other, its evaluation recorded, rather than have the resume make the whole evaluation again.
        requests = stop_requests_of_all_ranks(self.stop_signals, env)
        if local_counts is None:
            stopped_by = stop_for(requests, env.world_size, self.result)
            # A signal during the epoch's last step or its evaluation: a large test set can take longer than a
            # scheduler waits after its signal. last.pt at the epoch's last step, before the evaluation, lets the
            # resume make it.
            self.save("last.pt")
            note_stop(self.result, state["step"], f"after epoch {epoch + 1}'s training, before its evaluation ended",
                      stopped_by, self.continue_with, self.run_dir, what_continues="it with that evaluation")
            return True
        counts = ErrorCounts.from_tensor(distributed.all_reduce_sum(local_counts.as_tensor().to(env.device)).cpu())
        peak_memory = peak_gpu_memory_gib(env.device)
        state["epoch"], state["epoch_step"] = epoch + 1, 0
        self.result.update(epoch=epoch + 1, step=state["step"], wer=counts.wer, cer=counts.cer)
        if env.is_main:
            record_epoch(tally, counts, peak_memory, self.eval_set, state["step"], len(self.sampler), self.run_started,
                         self.writer, self.metrics_file)
        if counts.beats(state["best_unreadable"], state["best_wer"]):
            state["best_unreadable"], state["best_wer"] = counts.not_decoded, counts.wer
            self.save("best.pt", "last.pt")
        else:
            self.save("last.pt")
        reached_max_steps = stops_at_max_steps(self.max_steps, state, len(self.sampler))  # the epoch evaluated
        if requests and (epoch + 1 == cfg.train.epochs or reached_max_steps):
            # The job has done its work (as a signal during the step train.max_steps stops at inside an epoch leaves
            # it): stopping on the signal (exit 128 + its number) would have a scheduler's requeue
            # (launch/slurm.sbatch) start a job with nothing to train, which leaves no last line either.
            log.info("%s received after this job's last evaluation, its work done: it ends as a finished run",
                     signals_received(requests, env.world_size))
        elif requests:
            stopped_by = stop_for(requests, env.world_size, self.result)
        if reached_max_steps and epoch + 1 < cfg.train.epochs:
            stopped_by = "train.max_steps"
        if stopped_by:
            note_stop(self.result, state["step"], f"after epoch {epoch + 1}", stopped_by, self.continue_with,
                      self.run_dir)
            return True
        return False

    def save(self, name: str, *same: str) -> None:
        """Rank 0 writes `name`, and makes each of `same` hold the same checkpoint without writing it again; the RNG
        states of all ranks travel in one list so each rank resumes its own stream."""
        state, run_dir = self.state, self.run_dir
        refuse_if_diverged(self.model, state["step"], name)
        state["elapsed_s"] = time.perf_counter() - self.run_started
        rng_states = [checkpoint.rng_state_from_json(each) for each in
                      distributed.all_gather_json(checkpoint.rng_state_as_json(checkpoint.rng_state(self.env.device)))]
        if self.env.is_main:
            # The metrics first: after a crash of the machine, whose page cache is lost, they hold at least the steps
            # and epochs the checkpoint does (a resume drops those past it), never fewer for good.
            with errors_naming(self.metrics_file.name):
                self.metrics_file.flush()
                os.fsync(self.metrics_file.fileno())
            checkpoint.save(
                run_dir / "checkpoints" / name,
                {
                    "model": self.model.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "sampler": {"epoch": state["epoch"], "position": state["epoch_step"]},
                    "train_state": state,
                    "rng": rng_states,
                    "config": OmegaConf.to_container(self.cfg, resolve=True),
                    "train_set": self.train_fingerprint,
                    "test_set": self.test_fingerprint,  # what best_wer was measured on
                    "run_id": self.run_id,
                    "started_from": self.start.started_from,
                },
            )
            for other in same:
                checkpoint.save_same(run_dir / "checkpoints" / name, run_dir / "checkpoints" / other)
