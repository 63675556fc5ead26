"""Resuming a run: which checkpoint train.resume names (checkpoint_to_resume), whether it is this run's own, and each
of its parts handed back to the model, optimizer, schedule and training state it came from, refused in one line
naming the file and the part that does not fit (restore); resume_into takes a job's run up from it on every rank.
Also the run's best.pt: the evaluation a resumed run must beat (best_to_beat), and one best.pt kept per test set
(settle_best)."""
import filecmp
import logging
import math
import os
from pathlib import Path
from typing import NamedTuple

import torch
from omegaconf import DictConfig

from data.values import is_int, is_number, is_real, json_objects
from trainer import build, checkpoint, distributed
from trainer.config import RUN_NAME_SETTING, check_resumable, noting_what_does_nothing_here
from trainer.distributed import DistEnv
from trainer.metrics import scores_better

log = logging.getLogger(__name__)


def checkpoint_to_resume(resume: str | None, run_dir: Path) -> Path | None:
    """train.resume: null starts afresh, a path resumes from that checkpoint, and "auto" from this run directory's
    last.pt, else its best.pt (own_last_checkpoint: a restarted or requeued job under the same run name continues),
    afresh where it holds neither.
    Raises before the data and the model are built: ValueError rather than start afresh over checkpoints already in
    the run directory, which it would replace, and for a path or auto's checkpoint whose file it cannot read
    (FileNotFoundError where there is none)."""
    if resume is not None and resume != "auto":
        return readable_resume(resume)
    last = run_dir / "checkpoints" / "last.pt"
    own = own_last_checkpoint(run_dir) if resume == "auto" else None
    if own is not None:
        checkpoint.check_readable(own)
        if own != last:
            log.info("train.resume=auto: no %s, continuing from %s, written at the same step", last, own)
        return own
    held = already_holds_a_run(run_dir)
    if held:  # under auto: none is last.pt or best.pt, which auto would take (a checkpoint saved by another name)
        remedy = "train.resume=PATH" if resume == "auto" else "train.resume=auto (or train.resume=PATH)"
        raise ValueError(f"{held}, which starting afresh would overwrite: continue it with {remedy}, or give this run "
                         f"another {RUN_NAME_SETTING}")
    if resume == "auto":
        log.info("train.resume=auto: no %s yet, starting afresh", last)
    return None


def readable_resume(path: str) -> Path:
    """train.resume=PATH's checkpoint; FileNotFoundError or ValueError naming it and the key where it is no file this
    process can open (checkpoint.check_readable). Its content unread: trainer.check_overrides asks it before a job
    starts."""
    try:
        checkpoint.check_readable(Path(path))
    except (FileNotFoundError, ValueError) as error:
        raise type(error)(f"{error} (train.resume)") from None
    return Path(path)


def own_last_checkpoint(run_dir: Path) -> Path | None:
    """The run directory's checkpoint that train.resume=auto continues from: last.pt, else best.pt (written just before
    last.pt, whose first save did not finish); None where it holds neither. A link to nothing (a disk not mounted) is
    one, for the resume to refuse naming it: passed over, an older best.pt was taken, and the run's records since."""
    for name in ("last.pt", "best.pt"):
        path = run_dir / "checkpoints" / name
        if path.is_file() or path.is_symlink():
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
    """The run id in the last job's line of the run directory's jobs.jsonl, past any line that is none (half of one a
    job killed while it wrote it left, a note added by hand); None without one (no job yet, or jobs from before run
    ids)."""
    jobs = run_dir / "jobs.jsonl"
    # Not a file: a link to a device, which the run writes through (jobs.jsonl -> /dev/null: run_directory takes it),
    # or a pipe, records no job. Read, /dev/zero took all the memory, and a pipe waited for a writer for ever.
    if not jobs.is_file():
        return None
    try:
        # A line that is not UTF-8 (a note added by hand) is none of the trainer's, whose lines are ASCII: it is passed
        # over as the others are, not the whole file with it.
        text = jobs.read_text(errors="surrogateescape")
    except OSError:
        return None
    jobs_recorded = [job for _, job in json_objects(text)]
    return jobs_recorded[-1].get("run_id") if jobs_recorded else None


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
                         f"command run again, a requeued job), or give this run another {RUN_NAME_SETTING}")
    # Said here, once the checkpoint is known to be no copy of this run's (whose metrics.jsonl goes on) and the resume
    # is not refused, rather than for every path outside checkpoints/.
    log.info("train.resume=%s is another run directory's checkpoint: this run writes to %s, its metrics.jsonl from "
             "the checkpoint's next step on and its best.pt from its own evaluations (train.resume=auto under that "
             "run's %s continues it in its own directory)", path, run_dir, RUN_NAME_SETTING)
    return None


# How an optimizer runs, not what it computes: the optimizer as built keeps its own. Checkpoints from before both
# optimizers were fused (2026-11-27) hold fused=None, which took torch's unfused step, and that refuses found_inf.
IMPLEMENTATION_OPTIONS = ("fused", "foreach", "capturable", "differentiable")


def load_finite_model(model: torch.nn.Module, saved: dict) -> None:
    model.load_state_dict(saved)
    # The trainer saves no such model (trainer.train.refuse_if_diverged): edited by hand, or written by other code.
    # Resumed, it skipped every step of an epoch, which then ended in advice on optim.lr.
    if not_finite := build.entries_not_finite(model):
        raise ValueError(f"its weights hold values that are not finite, in {not_finite}")


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    checkpoint.check_optimizer_state(saved, optimizer)
    for saved_group, group in zip(saved["param_groups"], optimizer.param_groups):
        for name, value in saved_group.items():
            if name in group and name not in ("params", *IMPLEMENTATION_OPTIONS):
                check_setting(f"param_groups' {name}", value, group[name])
    groups = [{**saved_group, **{key: group[key] for key in IMPLEMENTATION_OPTIONS if key in group}}
              for saved_group, group in zip(saved["param_groups"], optimizer.param_groups)]
    optimizer.load_state_dict({**saved, "param_groups": groups})


def known_entries(saved: dict, current: dict) -> dict:
    """The entries of a saved state dict that the current one has, each refused (ValueError) unless of the same type:
    a scheduler copies whatever keys it is given onto itself (an "optimizer" of 1 replaced its optimizer), and torch
    versions add and drop a key or two; and unless of the form of the current one's (check_setting)."""
    if not isinstance(saved, dict):
        raise ValueError(f"it is {checkpoint.a_type(saved)}, not a mapping")
    odd = [key for key, value in current.items() if key in saved and type(saved[key]) is not type(value)]
    if odd:
        key = odd[0]
        raise ValueError(f"its {key} is {checkpoint.a_type(saved[key])}, not {checkpoint.a_type(current[key])}")
    for key, value in current.items():
        if key in saved:
            check_setting(key, saved[key], value)
    return {key: value for key, value in saved.items() if key in current}


def fits_setting(value, current) -> bool:
    """Whether a saved optimizer's or schedule's setting `value` has the form of this run's (`current`): a finite number
    from 0 up where it holds a number (a rate, a beta, a decay, a count), as many of them where it holds a list or a
    tuple (betas, base_lrs), else a value of its type (a bool, None)."""
    if is_real(current):
        return is_number(value) and value >= 0
    if isinstance(current, list | tuple):
        return (isinstance(value, list | tuple) and len(value) == len(current)
                and all(fits_setting(entry, entry_here) for entry, entry_here in zip(value, current)))
    return type(value) is type(current)


def check_setting(name: str, value, current) -> None:
    """ValueError unless a saved setting fits this run's (fits_setting). The trainer saves those its config checks
    (trainer.config: finite, none below 0) and the rates its schedule gives: another, resumed, turned every weight to
    NaN at the first step (or trained up the gradient), the run then said to have diverged as if a lower optim.lr could
    help, or ended that step in a traceback (betas of 3)."""
    if not fits_setting(value, current):
        raise ValueError(f"its {name} is {value!r}, not of the form of this run's {current!r} (finite numbers from 0 "
                         "up)")


def check_same_training_set(saved: dict, fingerprint: str, path: Path) -> None:
    """A checkpoint's sampler position names global batches of its own training set: another set behind the same
    manifest paths would train some utterances of the epoch twice and skip others."""
    if saved.get("train_set", fingerprint) != fingerprint:  # checkpoints from before 2026-12-02 hold none
        raise ValueError(f"cannot resume from {path}: it was written for another training set ({saved['train_set']}; "
                         f"{fingerprint} here): a manifest changed since (prepared again, or edited)")


def check_sampler_position(saved_sampler: dict, state: dict, path: Path) -> None:
    """ValueError unless a checkpoint's sampler stands where its restored training `state` does, as the trainer saves
    them: at global batch epoch_step of its epoch. An edited file's other position trained the epoch's batches before
    it again, or skipped those after it, while the step count went on from the training state's."""
    sampler_at = (saved_sampler.get("epoch"), saved_sampler.get("position"))
    if sampler_at != (state["epoch"], state["epoch_step"]):
        raise ValueError(f"cannot resume from {path}: its sampler (epoch {sampler_at[0]}, position {sampler_at[1]}) is "
                         f"not where its train_state stands (epoch {state['epoch']}, epoch_step {state['epoch_step']})")


# Past the largest step TensorBoard's events hold (an int64), a resumed step failed its first record in "Value out of
# range", which named neither the checkpoint nor the key.
MAX_COUNT = 2**63 - 1


def resumed_train_state(state: dict, saved_state: dict) -> dict:
    """A checkpoint's train_state, each of `state`'s entries a number from 0 up (infinite only where `state`'s is:
    best.pt's figures before any evaluation), a count (an integer from 0 below MAX_COUNT) where `state` holds one;
    ValueError naming those that are not and their values. No evaluation beats a NaN best_wer: best.pt would stay as
    it was."""
    # Checkpoints from before elapsed_s count from here; those from before best_unreadable read whole test sets.
    resumed = {"elapsed_s": 0.0, "best_unreadable": 0, **saved_state}

    def fits(key, value):
        if isinstance(state[key], int):
            return is_int(value) and 0 <= value < MAX_COUNT
        return is_real(value) and (value == math.inf == state[key] or is_number(value) and value >= 0)

    wrong = [key for key in state if not fits(key, resumed.get(key))]
    if wrong:
        raise ValueError(f"no number from 0 up, or no count where one belongs, for "
                         f"{', '.join(f'{key}={resumed.get(key)!r}' for key in wrong)}")
    return resumed


def restore(path: Path, saved: dict, loaders: dict) -> None:
    """Hands each part of a checkpoint to its loader; ValueError naming the file and the part one refuses (a file
    edited by hand or written by other code: a checkpoint holds plain data, which nothing else checks). OverflowError
    too: Python's generator refuses a word of its state past a C long so."""
    for part, load_part in loaders.items():
        try:
            load_part(saved[part])
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError, OverflowError) as error:
            reason = " ".join(str(error).split()[:40]) or type(error).__name__
            raise ValueError(f"cannot resume from {path}: its {part} does not fit this run ({reason})") from error


REFUSED_BEST = ("(the run's {name}, whose evaluation a resumed run must beat to replace it: move it away to resume "
                "without it)")


# Where a run keeps a best.pt that records no test set: no fingerprint's digest, whose letters and digits it could take.
UNKNOWN_TEST_SET_BEST = "best-unknown-test-set.pt"


class BestToBeat(NamedTuple):
    """What best_to_beat found of the run directory's best.pt."""
    figures: dict  # the best_unreadable and best_wer an evaluation must beat to replace best.pt
    kept_as: Path | None  # where best.pt is another test set's: the name settle_best keeps it under
    kept_is_best: bool  # a best-DIGEST.pt kept for this test set is the best on it (best.pt again), not a stale name


def best_to_beat(run_dir: Path, resumed: Path, saved: dict, state: dict, test_fingerprint: str) -> BestToBeat:
    """The best_unreadable and best_wer an evaluation on this test set (`test_fingerprint`) must beat to replace the run
    directory's best.pt, and the name to keep best.pt under where it is another test set's, whose WERs do not compare.
    `saved` is the checkpoint resumed from, read from `resumed`; ValueError naming a best.pt that cannot be read."""
    best = run_dir / "checkpoints" / "best.pt"
    nothing_to_beat = {"best_unreadable": math.inf, "best_wer": math.inf}
    kept_here = kept_best(best, test_fingerprint)  # this test set's, kept while the run was on another
    back = kept_here.is_file()
    # A best.pt linked to nothing (a disk not mounted) is refused, as one that cannot be read is: taken for none, it was
    # replaced by the first evaluation, however worse.
    if not best.is_file() and not best.is_symlink():
        if not back:  # no evaluation in this run directory yet
            return BestToBeat(nothing_to_beat, None, False)
        # best.pt deleted by hand while the run was on another test set: settle_best makes the kept one best.pt again.
        log.info("no %s: the evaluation to beat is that of %s, the best on this test set", best, kept_here.name)
        return BestToBeat(recorded_best(kept_here, resumed, saved, state)[1], None, True)
    # best.pt's own figures, not the resumed checkpoint's: an earlier checkpoint's, or a copy's, let an epoch worse than
    # best.pt's replace it.
    best_saved, figures = recorded_best(best, resumed, saved, state)
    their_test_set = best_saved.get("test_set")
    if their_test_set == test_fingerprint:
        return best_of_this_test_set(best, figures, kept_here, resumed, saved, state)
    to_beat = (f"the evaluation to beat is that of {kept_here.name}, the best on this test set" if back
               else "the first evaluation here replaces best.pt")
    # What is kept and moved, settle_best says as it does it: a job with nothing left to train does neither.
    if their_test_set is None:  # its WER may be over this test set or another: either way it is kept, not lost
        kept_as = best.with_name(UNKNOWN_TEST_SET_BEST)
        log.info("%s records no test set (written before checkpoints recorded theirs, 2026-12-02), and WERs over "
                 "other test sets do not compare: %s", best, to_beat)
    else:
        kept_as = kept_best(best, their_test_set)
        log.info("the test set is not the one %s was evaluated on (%s there, %s here), and WERs over other test sets "
                 "do not compare: %s", best, their_test_set, test_fingerprint, to_beat)
    check_free_to_keep(best, kept_as)
    return BestToBeat(recorded_best(kept_here, resumed, saved, state)[1] if back else nothing_to_beat, kept_as, back)


def best_of_this_test_set(best: Path, figures: dict, kept_here: Path, resumed: Path, saved: dict,
                          state: dict) -> BestToBeat:
    """Where best.pt (`best`, its evaluation `figures`) is this test set's: the better of it and the best-DIGEST.pt
    kept for this test set (`kept_here`), if any."""
    if not kept_here.is_file():
        return BestToBeat(figures, None, False)
    kept_figures = recorded_best(kept_here, resumed, saved, state)[1]
    if not scores_better(kept_figures["best_unreadable"], kept_figures["best_wer"], figures["best_unreadable"],
                         figures["best_wer"]):  # most often the name best.pt was kept under: the same model
        return BestToBeat(figures, None, False)
    # Left by resumes before 2026-12-05 (37d5cee): best.pt deleted by hand on another test set, the first evaluation
    # back on this one, however worse, became best.pt beside the kept one, which the next resume removed as its alias.
    log.info("%s scores better on this test set than %s (%s against %s), which an older resume left beside it: the "
             "evaluation to beat is that of %s, the best on this test set", kept_here, best, described(kept_figures),
             described(figures), kept_here.name)
    return BestToBeat(kept_figures, None, True)


def described(figures: dict) -> str:
    return f"WER {figures['best_wer']:.2f}%, {figures['best_unreadable']} test utterances not decoded"


def check_free_to_keep(best: Path, kept_as: Path) -> None:
    """ValueError where `kept_as` already holds another checkpoint than best.pt (`best`), which keeping best.pt under
    that name would overwrite: above all a second best.pt that records no test set. The same one is a job killed after
    keeping it, resumed again: a hard link, or a copy where the file system has none."""
    if kept_as.is_file() and not (kept_as.samefile(best) or filecmp.cmp(kept_as, best, shallow=False)):
        raise ValueError(f"cannot resume: {best} is to be kept as {kept_as.name}, which already holds another "
                         f"checkpoint that keeping it would overwrite: move one of them away")


def recorded_best(path: Path, resumed: Path, saved: dict, state: dict) -> tuple[dict, dict]:
    """The checkpoint at `path`, a best.pt, and its best_unreadable and best_wer; ValueError naming it where it cannot
    be read. `saved` where it is the file resumed from, which is not read again (the 100-layer model's is large)."""
    figures = {}
    try:
        checkpoint.check_readable(path)
        best_saved = saved if path.samefile(resumed) else checkpoint.load(path, checkpoint.TRAINING_PARTS,
                                                                          record_only=True)
        restore(path, best_saved, {"train_state": lambda best_state: figures.update(
            resumed_train_state(state, best_state))})
    except (FileNotFoundError, ValueError) as error:
        raise ValueError(f"{error} {REFUSED_BEST.format(name=path.name)}") from None
    return best_saved, {key: figures[key] for key in ("best_unreadable", "best_wer")}


def kept_best(best: Path, test_set) -> Path:
    """best-DIGEST.pt beside the run's best.pt (`best`), where the run keeps the best.pt of the test set whose
    fingerprint (SpeechDataset's, "8 utterances, sha256 DIGEST") is `test_set` while it evaluates on another;
    ValueError where best.pt records no such fingerprint (an edited file), which would name no file beside it."""
    digest = str(test_set).rsplit(" ", 1)[-1]
    if not digest.isascii() or not digest.isalnum():
        raise ValueError(f"cannot resume from {best}: its test_set {test_set!r} is no test set's fingerprint "
                         f"{REFUSED_BEST.format(name=best.name)}")
    return best.with_name(f"best-{digest}.pt")


def settle_best(run_dir: Path, found: BestToBeat, test_fingerprint: str) -> None:
    """Leaves the run directory one name for the best on this test set (`test_fingerprint`) before an evaluation can
    replace best.pt: a best.pt of another test set is kept first as found.kept_as (best_to_beat's), then the one kept
    for this test set, if any, is best.pt again where it is the best on it. A job killed in between leaves best.pt as it
    was, and the next resume makes the same moves."""
    best = run_dir / "checkpoints" / "best.pt"
    if found.kept_as is not None:
        checkpoint.save_same(best, found.kept_as)
        log.info("%s, the best on its test set, kept as %s", best, found.kept_as)
    kept_here = kept_best(best, test_fingerprint)
    if not kept_here.is_file():
        return
    if found.kept_is_best:
        # Without best.pt (deleted by hand) too: best_to_beat took the kept one's evaluation as the one to beat.
        os.replace(kept_here, best)  # a move, not a link: best.pt goes on, and the name would hold a stale copy
        log.info("%s, the best on this test set, is %s again", kept_here, best)
    else:
        # Most often the name best.pt, this test set's, was kept under on a move to another test set and back with no
        # evaluation between: after best.pt's next evaluation it would be an older model that looks like the best here.
        kept_here.unlink()
        log.info("%s removed: %s is the best on this test set again", kept_here, best)


def position_in_epochs(state: dict) -> str:
    """Where a run stands, its epochs counted from 1 as the log counts them: state["epoch"] is the epochs finished."""
    if state["epoch_step"]:
        return f"step {state['epoch_step']} of epoch {state['epoch'] + 1}"
    if not state["epoch"]:  # a run stopped by a signal before its first step wrote a checkpoint at step 0
        return "the start of epoch 1"
    return f"the end of epoch {state['epoch']}"


class RunStart(NamedTuple):
    """Where this job takes its run up, as resume_into found it."""
    checkpoint: Path | None  # the one resumed from (run_started_from's, where it continues that run), None afresh
    run_id: str | None  # carried by the run's checkpoints and jobs.jsonl (continued_run_id); None for a run of its own
    continues: bool  # this directory's run goes on: its metrics.jsonl and jobs.jsonl too
    started_from: dict | None  # the other run's checkpoint it started from (start_of_run): its checkpoints carry it
    best: BestToBeat | None  # what best_to_beat found of best.pt, for settle_best; None afresh


def resume_into(resume: Path | None, state: dict, cfg: DictConfig, run_dir: Path, env: DistEnv,
                train_fingerprint: str, test_fingerprint: str, loaders: dict) -> RunStart:
    """Where this job starts: afresh where `resume` (checkpoint_to_resume's) is None, otherwise from that checkpoint,
    refused where it does not fit this run, its parts handed to `loaders`, its training state to `state` and this rank's
    RNG states to the RNGs. Every rank must call it (a collective)."""
    start = RunStart(checkpoint=None, run_id=None, continues=False, started_from=None, best=None)
    if resume is not None:
        saved = checkpoint.load(resume, checkpoint.TRAINING_PARTS)
        resume, saved = run_started_from(resume, saved, run_dir) or (resume, saved)
        changed_settings = check_resumable(saved["config"], cfg, resume, holds_train_set="train_set" in saved)
        check_same_training_set(saved, train_fingerprint, resume)
        run_id = continued_run_id(saved, resume, run_dir)
        continues = run_id is not None or is_own_checkpoint(resume, run_dir)  # older checkpoints hold no run id
        restore(resume, saved, {
            **loaders,
            "train_state": lambda saved_state: state.update(resumed_train_state(state, saved_state)),
            "rng": lambda states: checkpoint.set_rng_state(states[min(env.rank, len(states) - 1)], env.device),
        })
        check_sampler_position(saved["sampler"], state, resume)
        best = best_to_beat(run_dir, resume, saved, state, test_fingerprint)
        state.update(best.figures)
        start = RunStart(resume, run_id, continues, saved.get("started_from") if continues else start_of_run(saved),
                         best)
        log.info("resumed from %s at step %d (%s)", resume, state["step"], position_in_epochs(state))
        if changed_settings:
            log.info("settings other than those %s was written under, taken from here on: %s", resume,
                     "; ".join(noting_what_does_nothing_here(changed_settings, env.device)))
    # A rank that found another checkpoint, or none (its run directory not rank 0's: a folder on its node only), would
    # pair its collectives with no other rank's. Its name and step, not its path: nodes may mount one folder apart.
    distributed.check_same_on_every_rank(
        {"the checkpoint resumed": "none" if resume is None else f"{resume.name} at step {state['step']}"},
        "the ranks would resume from other checkpoints",
        "every rank must see the run directory's checkpoints, a folder every node sees")
    return start
