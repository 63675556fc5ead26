"""Resuming a run: which checkpoint train.resume names (checkpoint_to_resume), whether it is this run's own, and each
of its parts handed back to the model, optimizer, schedule and training state it came from, refused in one line
naming the file and the part that does not fit (restore)."""
import json
import logging
import math
from pathlib import Path

import torch

from trainer import checkpoint
from trainer.config import is_int

log = logging.getLogger(__name__)


def checkpoint_to_resume(resume: str | None, run_dir: Path) -> Path | None:
    """train.resume: null starts afresh, a path resumes from that checkpoint, and "auto" from this run directory's
    last.pt when there is one (a restarted or requeued job under the same run name continues), afresh otherwise.
    Raises ValueError rather than start afresh over checkpoints already in the run directory: it would replace them,
    and for a path that holds no file it can read (FileNotFoundError where there is none), before the data and the
    model are built."""
    if resume is not None and resume != "auto":
        try:
            checkpoint.check_readable(Path(resume))
        except (FileNotFoundError, ValueError) as error:
            raise type(error)(f"{error} (train.resume)") from None
        return Path(resume)
    last = run_dir / "checkpoints" / "last.pt"
    own = own_last_checkpoint(run_dir) if resume == "auto" else None
    if own is not None:
        if own != last:
            log.info("train.resume=auto: no %s, continuing from %s, written at the same step", last, own)
        return own
    held = already_holds_a_run(run_dir)
    if held:  # under auto: none is last.pt or best.pt, which auto would take (a checkpoint saved by another name)
        remedy = "train.resume=PATH" if resume == "auto" else "train.resume=auto (or train.resume=PATH)"
        raise ValueError(f"{held}, which starting afresh would overwrite: continue it with {remedy}, or give this run "
                         "another run_name")
    if resume == "auto":
        log.info("train.resume=auto: no %s yet, starting afresh", last)
    return None


def own_last_checkpoint(run_dir: Path) -> Path | None:
    """The run directory's checkpoint that train.resume=auto continues from: last.pt, else best.pt (written just before
    last.pt, whose first save did not finish); None where it holds neither."""
    for name in ("last.pt", "best.pt"):
        path = run_dir / "checkpoints" / name
        if path.is_file():
            return path
    return None


def already_holds_a_run(run_dir: Path) -> str:
    """For a refusal, "RUN_DIR already holds a run (best.pt, last.pt in checkpoints/)", or "" where the run directory
    holds no checkpoint."""
    held = sorted(path.name for path in (run_dir / "checkpoints").glob("*.pt"))
    return f"{run_dir} already holds a run ({', '.join(held)} in checkpoints/)" if held else ""


def is_own_checkpoint(path: Path, run_dir: Path) -> bool:
    """Whether `path` is a file of the run directory's checkpoints/, which may be a link to another disk."""
    return path.resolve().parent == (run_dir / "checkpoints").resolve()


def recorded_run_id(run_dir: Path) -> str | None:
    """The run id in the last whole line of the run directory's jobs.jsonl (a job killed while it wrote its line
    leaves half of one); None without one (no job yet, or jobs from before run ids)."""
    try:
        lines = (run_dir / "jobs.jsonl").read_text().splitlines()
    except (OSError, ValueError):
        return None
    for line in reversed(lines):
        try:
            job = json.loads(line)
        except ValueError:
            continue
        return job.get("run_id") if isinstance(job, dict) else None
    return None


def is_this_runs(saved: dict, path: Path, run_dir: Path) -> bool:
    """Whether the checkpoint `saved`, read from `path`, is the run directory's run's: its own file, or a copy of one,
    whose run id the directory's jobs.jsonl records."""
    theirs = saved.get("run_id")
    return is_own_checkpoint(path, run_dir) or (theirs is not None and theirs == recorded_run_id(run_dir))


def start_of_run(saved: dict) -> dict | None:
    """What a run started from another run's checkpoint `saved` records of it (its checkpoints' "started_from"), to
    know it again: that run's id and step. None for one from before run ids, which nothing tells from another run's
    checkpoint at the same step."""
    train_state = saved["train_state"]
    step = train_state.get("step") if isinstance(train_state, dict) else None  # not a mapping: restore refuses it
    return None if saved.get("run_id") is None else {"run_id": saved["run_id"], "step": step}


def run_started_from(path: Path, saved: dict, run_dir: Path) -> tuple[Path, dict] | None:
    """The run directory's last checkpoint (own_last_checkpoint) and what it holds, where its run was started from
    `path` as `path` is now (the run id and step its checkpoints record): the command that started the run, run again
    (a requeued job: launch/slurm.sbatch passes train.resume=auto before the user's PATH), continues it as
    train.resume=auto would, where starting from `path` again would overwrite it. None otherwise."""
    start = start_of_run(saved)
    own = own_last_checkpoint(run_dir)
    if start is None or own is None or is_this_runs(saved, path, run_dir):
        return None
    own_saved = checkpoint.load(own, checkpoint.TRAINING_PARTS)
    if own_saved.get("started_from") != start:  # another start, or checkpoints from before runs recorded theirs
        return None
    log.info("train.resume=%s is the checkpoint this run directory's run started from (run %s at step %s): the same "
             "command run again continues that run from %s, as train.resume=auto would", path, start["run_id"],
             start["step"], own)
    return own, own_saved


def continued_run_id(saved: dict, path: Path, run_dir: Path) -> str | None:
    """The run id a job resuming from `path` carries on: the checkpoint's where it is this run's (is_this_runs), None
    where a new run starts from another's. ValueError where that other run's checkpoint would overwrite the checkpoints
    the directory holds, and its metrics.jsonl keep this run's lines up to the checkpoint's step."""
    theirs = saved.get("run_id")
    if is_this_runs(saved, path, run_dir):
        return theirs
    ours = recorded_run_id(run_dir)
    held = already_holds_a_run(run_dir)
    if held:
        # Most often the command that started this run from `path`, run again, where `path` has moved on since or the
        # run started before its checkpoints recorded their start (run_started_from): another run_name alone would
        # start over from `path`, leaving this run's steps since behind.
        raise ValueError(f"{held}, and {path} is not one of its checkpoints (run {theirs} against {ours}): resuming "
                         "from it there would overwrite them; continue the run there with train.resume=auto (the same "
                         "command run again, a requeued job), or give this run another run_name")
    # Said here, once the checkpoint is known to be no copy of this run's (whose metrics.jsonl goes on) and the resume
    # is not refused, rather than for every path outside checkpoints/.
    log.info("train.resume=%s is another run directory's checkpoint: this run writes to %s, its metrics.jsonl from "
             "the checkpoint's next step on and its best.pt from its own evaluations (run_name=NAME "
             "train.resume=auto continues run NAME in its own directory)", path, run_dir)
    return None


# How an optimizer runs, not what it computes: the optimizer as built keeps its own. Checkpoints from before both
# optimizers were fused (2026-11-27) hold fused=None, which took torch's unfused step, and that refuses found_inf.
IMPLEMENTATION_OPTIONS = ("fused", "foreach", "capturable", "differentiable")


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    checkpoint.check_optimizer_state(saved, optimizer)
    groups = [{**saved_group, **{key: group[key] for key in IMPLEMENTATION_OPTIONS if key in group}}
              for saved_group, group in zip(saved["param_groups"], optimizer.param_groups)]
    optimizer.load_state_dict({**saved, "param_groups": groups})


def check_same_training_set(saved: dict, fingerprint: str, path: Path) -> None:
    """A checkpoint's sampler position names global batches of its own training set: another set behind the same
    manifest paths would train some utterances of the epoch twice and skip others."""
    if saved.get("train_set", fingerprint) != fingerprint:  # checkpoints from before 2026-12-02 hold none
        raise ValueError(f"cannot resume from {path}: it was written for another training set ({saved['train_set']}; "
                         f"{fingerprint} here): a manifest changed since (prepared again, or edited)")


def resumed_train_state(state: dict, saved_state: dict) -> dict:
    """A checkpoint's train_state, each of `state`'s entries a number from 0 up (infinite only where `state`'s is:
    best.pt's figures before any evaluation), a count (a non-negative integer) where `state` holds one; ValueError
    naming those that are not and their values. No evaluation beats a NaN best_wer: best.pt would stay as it was."""
    # Checkpoints from before elapsed_s count from here; those from before best_unreadable read whole test sets.
    resumed = {"elapsed_s": 0.0, "best_unreadable": 0, **saved_state}

    def fits(key, value):
        if isinstance(state[key], int):
            return is_int(value) and value >= 0
        return (isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
                and (math.isfinite(value) or math.isinf(state[key])))

    wrong = [key for key in state if not fits(key, resumed.get(key))]
    if wrong:
        raise ValueError(f"no number from 0 up, or no count where one belongs, for "
                         f"{', '.join(f'{key}={resumed.get(key)!r}' for key in wrong)}")
    return resumed


def restore(path: Path, saved: dict, loaders: dict) -> None:
    """Hands each part of a checkpoint to its loader; ValueError naming the file and the part one refuses (a file
    edited by hand or written by other code: a checkpoint holds plain data, which nothing else checks)."""
    for part, load_part in loaders.items():
        try:
            load_part(saved[part])
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as error:
            reason = " ".join(str(error).split()[:40]) or type(error).__name__
            raise ValueError(f"cannot resume from {path}: its {part} does not fit this run ({reason})") from error


def known_entries(saved: dict, current: dict) -> dict:
    """The entries of a saved state dict that the current one has, each refused (ValueError) unless of the same type:
    a scheduler copies whatever keys it is given onto itself (an "optimizer" of 1 replaced its optimizer), and torch
    versions add and drop a key or two."""
    if not isinstance(saved, dict):
        raise ValueError(f"it is {checkpoint.a_type(saved)}, not a mapping")
    odd = [key for key, value in current.items() if key in saved and type(saved[key]) is not type(value)]
    if odd:
        key = odd[0]
        raise ValueError(f"its {key} is {checkpoint.a_type(saved[key])}, not {checkpoint.a_type(current[key])}")
    return {key: value for key, value in saved.items() if key in current}
