"""Length-bucketed batches split across data-parallel ranks, resumable mid-epoch at any world size.

A global batch is the `global_batch_size` utterances that all ranks together train on in one step. It is
built from utterances of similar duration (little padding) and cut into `world_size` contiguous shards, one
per rank, so that every rank gets utterances of similar length and no rank waits long for the others.
"""
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler

from data.values import is_int


def epoch_seed(seed: int, epoch: int) -> int:
    """One seed for each (seed, epoch): seed + epoch gave seed s's epoch e + 1 the order of seed s + 1's epoch e."""
    return seed * 1_000_003 + epoch


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")


def shard_size(global_batch_size: int, world_size: int) -> int:
    """Each rank's share of a global batch; ValueError where the ranks cannot split it evenly."""
    if global_batch_size < 1 or global_batch_size % world_size != 0:
        raise ValueError(
            f"global_batch_size {global_batch_size} must be a positive multiple of world_size {world_size}"
        )
    return global_batch_size // world_size


class BucketBatchSampler(Sampler[list[int]]):
    """Yields this rank's dataset indices for each global batch of an epoch.

    Epoch 0 with `sortagrad`: global batches from shortest to longest (SortaGrad, DeepSpeech2 sec. 3.1: short
    utterances first steady early training). Other epochs: utterances sorted by duration after a seeded
    relative jitter of up to +-`jitter` so groupings change from epoch to epoch, then the global batches in a
    seeded random order. Each epoch drops `len(durations) % global_batch_size` utterances so that every rank
    takes the same number of steps: the longest in the SortaGrad epoch, a seeded random choice after it, each
    utterance as likely as any other (dropping from the ends of the sorted order left AN4's shortest utterances
    out of two epochs in three). Everything depends on `seed` and the epoch only, never on the rank, so ranks
    agree; seed and epoch are mixed so that neighbouring seeds do not share their orders an epoch apart.

    The state ({"epoch", "position"}: global batches handed out so far this epoch) does not depend on rank or
    world size, so a run saved with N ranks resumes with M. Finishing an epoch's iteration moves to the next
    epoch; `set_epoch` moves to another one and starts it from the beginning.
    """

    def __init__(
        self,
        durations: Sequence[float],
        global_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        sortagrad: bool = True,
        jitter: float = 0.1,
    ):
        super().__init__()
        _check_rank(rank, world_size)
        self.shard_size = shard_size(global_batch_size, world_size)
        if len(durations) < global_batch_size:
            raise ValueError(
                f"{len(durations)} utterances do not fill one global batch of global_batch_size {global_batch_size}"
            )
        self.durations = torch.tensor(durations, dtype=torch.float64)
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.seed = seed
        self.sortagrad = sortagrad
        self.jitter = jitter
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        """Global batches (steps) per epoch."""
        return len(self.durations) // self.global_batch_size

    def global_batches(self, epoch: int) -> list[list[int]]:
        """The epoch's global batches in training order, each `global_batch_size` dataset indices."""
        num_batches = len(self)
        num_used = num_batches * self.global_batch_size
        if self.sortagrad and epoch == 0:
            # A stable sort keeps equal durations in manifest order, so this is the same on every rank.
            order = torch.argsort(self.durations, stable=True)[:num_used]
            return order.view(num_batches, self.global_batch_size).tolist()
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        kept = torch.randperm(len(self.durations), generator=generator)[:num_used]
        noise = torch.rand(num_used, generator=generator, dtype=torch.float64) * 2 - 1
        order = kept[torch.argsort(self.durations[kept] * (1 + self.jitter * noise), stable=True)]
        batches = order.view(num_batches, self.global_batch_size)
        return batches[torch.randperm(num_batches, generator=generator)].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.global_batches(self.epoch)
        first = self.rank * self.shard_size
        while self.position < len(batches):
            batch = batches[self.position]
            # Counted before it is handed out: a state saved after training on it resumes with the next one.
            self.position += 1
            yield batch[first : first + self.shard_size]
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its first global batch, unless it is the current epoch (keep a resumed position)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.position = 0

    def state_dict(self) -> dict[str, int]:
        """{"epoch", "position"}. With a DataLoader that prefetches (num_workers > 0), `position` is ahead of
        the steps trained by the batches in flight; a trainer that needs the exact step stores its own count
        of steps taken this epoch as `position`."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from `state`: the next iteration starts with global batch `position` of `epoch`."""
        if not all(is_int(state[key]) for key in ("epoch", "position")):
            raise ValueError(f"sampler epoch and position must be integers, got {state['epoch']!r} and "
                             f"{state['position']!r}")
        if state["epoch"] < 0:
            raise ValueError(f"sampler epoch {state['epoch']} is negative")
        if not 0 <= state["position"] <= len(self):
            raise ValueError(f"sampler position {state['position']} is outside an epoch of {len(self)} global batches")
        self.epoch = state["epoch"]
        self.position = state["position"]


# An evaluation batch's longest utterance is at most this many times its shortest, so a long recording among short
# ones is padded to in a batch of its own: a 10-minute file among 15 AN4 clips took trainer.evaluate 547 s and 6.3 GB
# on a CPU in one batch of 16, and 13 s and 1.0 GB alone. 4, not 2: AN4's test set (0.7-6.2 s) keeps its batches.
EVAL_LENGTH_SPREAD = 4.0


def eval_shards(durations: Sequence[float], world_size: int, batch_size: int) -> list[list[list[int]]]:
    """Every rank's batches for evaluating every utterance exactly once across `world_size` ranks, rank r's at r.

    Utterances sorted by duration are dealt to ranks in turn, a row of `world_size` at a time, and every rank's
    batches are cut between the same rows: batch k of every rank holds its share of the same rows, at most
    `batch_size` of them, whose longest is at most EVAL_LENGTH_SPREAD times their shortest. So the world's k-th
    batches share one length range, below the (k+1)-th's, and a rank that waits for the others at each batch waits
    on batches like its own. A rank whose share of the last rows is none holds a batch fewer than the others.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    order = torch.argsort(torch.tensor(durations, dtype=torch.float64), stable=True).tolist()
    rows = [order[start:start + world_size] for start in range(0, len(order), world_size)]
    shards = [[] for _ in range(world_size)]
    for run in _runs_of_rows(rows, durations, batch_size):
        for rank in range(len(run[0])):  # only the last row can be short: it leaves out the last ranks
            shards[rank].append([row[rank] for row in run if rank < len(row)])
    return shards


def _runs_of_rows(rows: list[list[int]], durations: Sequence[float], batch_size: int) -> list[list[list[int]]]:
    """`rows` (indices, shortest first, each row after the one before) in the runs eval_shards cuts batches from."""
    runs = []
    for row in rows:
        run = runs[-1] if runs else None
        if run and len(run) < batch_size and durations[row[-1]] <= EVAL_LENGTH_SPREAD * durations[run[0][0]]:
            run.append(row)
        else:
            runs.append([row])
    return runs
