"""One training step: one call of `train_step` is exactly one optimizer step (a skipped one updates nothing), the same
on every rank; and the tally of an epoch's steps, which refuses to save or evaluate an epoch that trained nothing."""
import logging
import math
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from data.dataset import UNREADABLE, UNUSABLE_REASONS, Batch, Unusable
from data.text import BLANK, counted
from models.cuda_graphs import CudaGraphed
from trainer import build, distributed
from trainer.distributed import DistEnv
from trainer.stop import STOP_SIGNALS, received_counts, stop_requests

log = logging.getLogger(__name__)


STOPPED = "stopped"  # train_step's outcome where a stop signal came first: nothing trained, the step not counted
NON_FINITE = "non-finite loss or gradient"  # train_step's outcome where it dropped the update
# What to try, in each refusal of a model whose losses or weights are not finite.
KEEP_FINITE = "a lower optim.lr or train.grad_clip_norm may keep the model finite"


class StepResult(NamedTuple):
    """What one train_step did, the same on every rank."""
    outcome: str  # "ok", STOPPED, or why the step was skipped
    loss: float  # mean loss per utterance of the global batch; nan for a step skipped or stopped
    utterances: int  # in the global batch, over all ranks
    unusable: Counter  # reason (UNUSABLE_REASONS) -> utterances of the global batch the ranks' loaders dropped
    stop_requests: dict  # stop signal -> how many ranks received it (trainer.stop.stop_requests); {} unless STOPPED


def train_step(model, batch: Batch | None, optimizer, scheduler, cfg: DictConfig, env: DistEnv,
               stop_signal: signal.Signals | None = None) -> StepResult:
    """One optimizer step on this rank's shard of a global batch. Ranks always agree on skipping, so none waits on a
    collective that another never joins, and on stopping: stop_signal is the one this rank received, if any. batch is
    None where this rank stopped waiting for it on stop_signal (trainer.stop.start_data_workers): the step stops."""
    device = env.device
    local_count = len(batch.indices) if batch is not None else 0
    num_frames = batch.features.shape[1] if batch is not None else 0
    unusable_here = [batch.num_unusable_as(reason) if batch is not None else 0 for reason in UNUSABLE_REASONS]
    inner = getattr(model, "module", model)  # DDP holds the model it wraps as .module
    graphed = isinstance(inner, CudaGraphed)
    # Host sync 1: every rank must know the global utterance count (the loss normaliser), whether a shard is empty and
    # which stop signals the ranks received; rank 0's log counts the whole batch's dropped utterances too, by reason.
    counts = distributed.all_reduce_sum(torch.tensor(
        [local_count, int(local_count == 0), *unusable_here, *received_counts(stop_signal)], dtype=torch.float64,
        device=device,
    ))
    if graphed:
        # Ranks replay one graph together (CudaGraphed): its shape is the shards' size and their longest frames.
        local_shape = torch.tensor([local_count, -local_count, num_frames], dtype=torch.float64, device=device)
        counts = torch.cat([counts, distributed.all_reduce_max(local_shape)])
    global_count, empty_shards, *rest = (int(count) for count in counts.tolist())
    unusable = Counter({reason: count for reason, count in zip(UNUSABLE_REASONS, rest) if count})
    rest = rest[len(UNUSABLE_REASONS):]
    requests, shape = stop_requests(rest[:len(STOP_SIGNALS)]), rest[len(STOP_SIGNALS):]

    def skipped(reason: str) -> StepResult:
        return StepResult(reason, math.nan, global_count, unusable, requests)

    if requests:  # a signal during the step before (or an evaluation): the run stops at that step's end, as it said
        return skipped(STOPPED)
    if empty_shards:
        return skipped("empty shard (all its audio unreadable)")
    forward_options = {}
    if graphed:
        largest_shard, negated_smallest_shard, longest = shape
        if largest_shard != -negated_smallest_shard:
            return skipped("shards of unequal size under CUDA graphs (audio unreadable)")
        forward_options["min_frames"] = longest
        graph_shape = inner.graph_shape(local_count, num_frames, longest)
        if not inner.is_captured(graph_shape):
            log.info("capturing CUDA graphs of the training forward and backward for batch %d, %d frames",
                     *graph_shape)

    # Batch-norm running statistics change in the forward pass; kept aside so a skipped step leaves no trace.
    statistics = [buffer.clone() for buffer in model.buffers()]
    with build.autocast(cfg.train.amp, device):
        log_probs, out_lengths = model(
            batch.features.to(device, non_blocking=True), batch.feature_lengths.to(device, non_blocking=True),
            **forward_options,
        )
    loss_sum = F.ctc_loss(
        log_probs.float(),
        batch.targets.to(device, non_blocking=True),
        out_lengths,
        batch.target_lengths.to(device, non_blocking=True),
        blank=BLANK,
        reduction="sum",
        zero_infinity=True,
    )
    # DDP averages gradients over ranks, so scaling by world / global count gives the global per-utterance mean.
    (loss_sum * (env.world_size / global_count)).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip_norm)
    mean_loss = distributed.all_reduce_sum(loss_sum.detach().clone()) / global_count  # over all ranks, for the log
    # A non-finite gradient norm (allreduced gradients, so the same on every rank) skips the update inside the fused
    # optimizer (GradScaler's found_inf input), so the host queues the step behind the backward instead of waiting
    # for it first: on a deep model the step's launches cost the host milliseconds.
    optimizer.found_inf = (~torch.isfinite(grad_norm)).float()
    optimizer.step()
    del optimizer.found_inf
    optimizer.zero_grad(set_to_none=True)
    # Host sync 2: a skipped step also puts back the batch-norm statistics and leaves the schedule where it was.
    loss_value, norm_value = torch.stack([mean_loss, grad_norm.detach()]).tolist()
    if not math.isfinite(norm_value):
        with torch.no_grad():
            for buffer, saved in zip(model.buffers(), statistics):
                buffer.copy_(saved)
        return skipped(NON_FINITE)
    scheduler.step()
    return StepResult("ok", loss_value, global_count, unusable, requests)


def refuse_if_nothing_trained(epoch: int, steps: int, trained: int, skipped: Counter, overflows_pass: bool = False,
                              unreadable_here: Unusable | None = None) -> None:
    """Before the epoch's steps so far are saved or evaluated: ValueError where each of them was skipped (audio no rank
    could use, or one rank could not: a corpus moved, relative paths taken from another folder, a node without the
    corpus; or losses that were not finite); saving would carry the run on as if it had trained. overflows_pass: at a
    checkpoint inside an epoch of a run that trained before it, steps skipped each for a loss that was not finite pass:
    the run goes on past such a step (one batch's overflow) with its weights as they were, where refusing would end it
    there on every resume; the epoch's end still refuses an epoch whose every loss was not finite. unreadable_here:
    an utterance this rank could not read (EpochTally.unreadable_here), which says why the unreadable ones were."""
    if steps == 0 or trained or overflows_pass and skipped[skipped_step(NON_FINITE)] == steps:
        return
    hint = unreadable_hint(unreadable_here) if skipped[unusable_utterances(UNREADABLE)] else ""
    # Without residual connections a deep stack's gradients can overflow at its initial weights, whatever the rate.
    hint += (f"; {KEEP_FINITE}, and model.residual=true a deep stack's gradients"
             if skipped[skipped_step(NON_FINITE)] else "")
    raise ValueError(f"epoch {epoch + 1} trained nothing: each of its {counted(steps, 'step')} was skipped "
                     f"({count_skipped(skipped)}){hint}")


def unreadable_hint(unreadable_here: Unusable | None) -> str:
    """What the line refusing an epoch says of its unreadable audio: for a file not there, how relative paths are read;
    for one refused for what it holds (a sample rate out of bounds, not audio), which was given that advice too, the
    file and why; where this rank read all of its own, that the others did not."""
    if unreadable_here is None:
        return "; other ranks could not read theirs: every rank must be able to read the manifests' audio files"
    if unreadable_here.missing:
        return ("; a manifest's relative audio paths are taken relative to its own folder (a symlink's, not its "
                "target's), and every rank must be able to read them")
    return f"; the first on this rank: {unreadable_here.warning.removeprefix('skipping ')}"


# An epoch counts what it skipped under (noun, what): count_skipped words the count with its noun.
def unusable_utterances(reason: str) -> tuple[str, str]:
    """Utterances its loaders dropped for `reason` (UNUSABLE_REASONS), in the words an evaluation counts them with."""
    return "utterance", reason


def skipped_step(outcome: str) -> tuple[str, str]:
    return "step", f"skipped: {outcome}"


def count_skipped(skipped: Counter) -> str:
    """'1 utterance unreadable, 2 utterances too long for stride, 2 steps skipped: non-finite loss or gradient'."""
    return ", ".join(f"{counted(count, noun)} {what}" for (noun, what), count in skipped.items())


@dataclass
class EpochTally:
    """What an epoch's steps in this job came to, for the checks before it is saved and for its log line."""
    epoch: int  # counted from 0
    first_step: int  # the epoch's steps trained before this job: past 0 where it resumed inside the epoch
    started: float = field(default_factory=time.perf_counter)
    trained_s: float = math.nan  # set when its steps end, before its evaluation
    losses: list[float] = field(default_factory=list)  # of the steps trained
    utterances: int = 0  # in the steps trained
    skipped: Counter = field(default_factory=Counter)  # (noun, what) -> count: count_skipped words it
    unreadable_here: Unusable | None = None  # this rank's first unreadable utterance, or first one not there

    def count(self, step: StepResult, unusable: tuple[Unusable, ...] = ()) -> None:
        """Adds a step trained or skipped (not one stopped, which the run does not count), and what this rank's shard
        of it could not use (Batch.unusable)."""
        for item in unusable:  # one not there first: its advice (relative paths) is what mends most of them
            kept = self.unreadable_here
            if item.counted_as == UNREADABLE and (kept is None or item.missing and not kept.missing):
                self.unreadable_here = item
        for reason, count in step.unusable.items():
            self.skipped[unusable_utterances(reason)] += count
        if step.outcome != "ok":
            self.skipped[skipped_step(step.outcome)] += 1
        else:
            self.losses.append(step.loss)
            self.utterances += step.utterances

    def refuse_if_nothing_trained(self, epoch_step: int, overflows_pass: bool) -> None:
        """refuse_if_nothing_trained for this job's steps of the epoch, up to `epoch_step`."""
        refuse_if_nothing_trained(self.epoch, epoch_step - self.first_step, len(self.losses), self.skipped,
                                  overflows_pass, self.unreadable_here)

    @property
    def mean_loss(self) -> float:
        """Of the steps trained. An epoch that trained none has no mean loss (ZeroDivisionError), not one of 0: its line
        (trainer.records.record_epoch) leaves the loss out."""
        return sum(self.losses) / len(self.losses)
