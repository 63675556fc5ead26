"""The run's records, on rank 0: its jobs (jobs.jsonl), its steps' and evaluations' figures (metrics.jsonl and
TensorBoard's scalars) and each evaluated epoch's log line. A resumed run lists each step once; a write the disk refuses
names its file."""
import json
import logging
import math
import threading
import time
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from data.dataset import SpeechDataset, count_reasons
from data.files import errors_naming, replace_whole
from data.text import counted
from data.values import json_objects
from trainer.distributed import DistEnv
from trainer.environment import command_line, device_name, versions
from trainer.evaluate import left_out
from trainer.metrics import ErrorCounts
from trainer.step import EpochTally, count_skipped

log = logging.getLogger(__name__)


def tensorboard_writer(log_dir: Path, purge_step: int) -> SummaryWriter:
    """TensorBoard's writer, whose thread's write errors (a full disk) reach the run as one line: the thread keeps its
    error for the next add_scalar to raise (__main__.user_error_message words it), and would also raise it itself,
    which Python prints as a traceback of its own before that line."""
    threading.excepthook = _leave_tensorboard_write_errors_to_the_writer
    with errors_naming(log_dir):  # the events file it opens is named in bytes, b'/runs/x/tensorboard/events.out...'
        return EventsWriter(log_dir, purge_step=purge_step)


class EventsWriter(SummaryWriter):
    """A SummaryWriter whose write errors name its folder: its thread's OSError, which the next call raises, names no
    file. The folder, not the events file: torch gives no public way to that file's name."""

    def add_scalar(self, *args, **kwargs) -> None:
        with errors_naming(self.log_dir):
            super().add_scalar(*args, **kwargs)

    def flush(self) -> None:
        with errors_naming(self.log_dir):
            super().flush()

    def close(self) -> None:
        with errors_naming(self.log_dir):
            super().close()


def _leave_tensorboard_write_errors_to_the_writer(args, print_it=threading.excepthook) -> None:
    if not (type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError)):
        print_it(args)


def open_metrics(path: Path, resumed: dict | None):
    """The run's metrics.jsonl, open for appending. A fresh run starts it empty; a resumed one keeps the lines its
    checkpoint covers (losses up to its step, evaluations up to its epoch) and drops those of the steps it is about to
    train again, and a line a killed job left half written, so that every step and epoch is listed once. The kept lines
    are written beside it, then renamed over it: a full disk leaves the file as it was."""
    kept = []
    if resumed is not None and path.exists() and not path.is_file():
        # A run directory copied from elsewhere may hold a link to a device or a pipe here (metrics.jsonl -> /dev/zero),
        # which holds none of the run's lines: read whole, it took all the memory or waited for a writer for ever.
        log.warning("%s is not a file (a pipe, a device): it holds none of the run's lines; a file replaces it", path)
    elif resumed is not None and path.exists():
        # A line that is not UTF-8 (a note added by hand) is none of the trainer's, whose lines are ASCII: it goes.
        for line, record in json_objects(path.read_text(errors="surrogateescape")):
            key = "step" if "step" in record else "epoch"
            if type(record.get(key)) is not int:
                continue  # not a line the trainer wrote
            if record[key] <= resumed[key]:  # covered by the checkpoint
                kept.append(line + "\n")
    replace_whole(path, "".join(kept))
    return open(path, "a", buffering=1)  # line by line, so that `tail -f` and a killed job see every step


def record_job(path: Path, run_id: str, from_step: int, env: DistEnv, resumed: bool,
               auto_found_no_checkpoint: bool = False) -> None:
    """Logs where this job runs and adds it to the run's jobs.jsonl, one line per job: a resumed run may go on on other
    hardware or software, or with other overrides, and its figures should say so. A fresh run starts the file anew.
    auto_found_no_checkpoint: train.resume=auto found none to continue, which the line says: a run_name mistyped
    started a new run, and checkpoint_to_resume's line saying so scrolled away above the config."""
    software = versions(env.device)
    job = {"run_id": run_id, "from_step": from_step, "world_size": env.world_size, "device": device_name(env.device),
           **software, "command": command_line()}
    torn = resumed and path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
    with errors_naming(path), open(path, "a" if resumed else "w") as jobs:
        # A job killed or a disk filling up while it wrote its line left half of one: this one would be glued to it.
        jobs.write("\n" * torn + json.dumps(job) + "\n")
    new_run = (f" (a new run: train.resume=auto found no checkpoint in {path.parent})" if auto_found_no_checkpoint
               else "")
    log.info("this job: from step %d%s, world size %d, rank 0 on %s; %s", from_step, new_run, env.world_size,
             job["device"], ", ".join(f"{name} {version}" for name, version in software.items()))


def steps_from_the_resume(first_step: int, steps: int) -> str:
    """For an epoch's log line, the steps of an epoch of `steps` that this job trained, from `first_step` (the steps
    done before its resume) on: "" where it trained them all."""
    if not first_step:
        return ""
    if first_step == steps:  # stopped during its evaluation, which this job makes
        return " (its steps trained before the resume)"
    return f" ({f'step {steps}' if first_step + 1 == steps else f'steps {first_step + 1}-{steps}'}, from the resume)"


def record_step(step: int, epoch: int, loss: float, learning_rate: float, writer: SummaryWriter, metrics_file) -> None:
    """On rank 0, a trained step's line of metrics.jsonl and its TensorBoard scalars, as record_epoch records an epoch.
    learning_rate: the one the step trained at."""
    # The epoch counted from 1, as the log and the evaluations' lines count it.
    append_metrics(metrics_file, {"step": step, "epoch": epoch + 1, "loss": loss})
    writer.add_scalar("train/loss", loss, step)
    writer.add_scalar("train/lr", learning_rate, step)


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def record_epoch(tally: EpochTally, counts: ErrorCounts, peak_memory: tuple[float, float] | None,
                 eval_set: SpeechDataset, step: int, steps_per_epoch: int, run_started: float, writer: SummaryWriter,
                 metrics_file) -> None:
    """On rank 0, an evaluated epoch's log line, warnings for the test utterances its WER leaves out, TensorBoard's
    scalars and metrics.jsonl's line. counts: summed over every rank; peak_memory: as
    trainer.train.peak_gpu_memory_gib gives it."""
    epoch = tally.epoch
    log.info(
        "epoch %d%s: %sevaluated in %.0f s; %s%s%s",
        epoch + 1, steps_from_the_resume(tally.first_step, steps_per_epoch),
        f"loss {tally.mean_loss:.3f}, {counted(tally.utterances, 'utterance')} in {tally.trained_s:.0f} s, "
        if tally.losses else "",
        time.perf_counter() - tally.started - tally.trained_s,
        "no test WER" if math.isnan(counts.wer) else f"test WER {counts.wer:.2f}% CER {counts.cer:.2f}%",
        "; peak GPU memory %.1f GiB allocated, %.1f GiB reserved" % peak_memory if peak_memory else "",
        "; skipped: " + count_skipped(tally.skipped) if tally.skipped else "",
    )
    # At the step, as the training scalars are: a resumed run's purge (tensorboard_writer) goes by step.
    writer.add_scalar("eval/wer", counts.wer, step)
    writer.add_scalar("eval/cer", counts.cer, step)
    # A rate over no utterances is NaN, which JSON has no word for: null, so that strict readers take the file.
    record = {"epoch": epoch + 1, "eval_wer": finite_or_none(counts.wer),
              "eval_cer": finite_or_none(counts.cer), "elapsed_s": round(time.perf_counter() - run_started, 1)}
    if peak_memory:
        allocated, reserved = peak_memory
        record["peak_gpu_allocated_gib"] = round(allocated, 2)
        record["peak_gpu_reserved_gib"] = round(reserved, 2)
    if counts.not_decoded == len(eval_set):
        log.warning("epoch %d: none of the test set's %s could be decoded (warned about above): no test WER",
                    epoch + 1, counted(len(eval_set), "utterance"))
    elif reasons := left_out(eval_set, counts):
        # Those no model could transcribe (a transcript longer than its output frames) are left out as those
        # that could not be read are: a WER over fewer utterances than the manifest holds says so.
        log.warning("epoch %d: the test WER is over %d of the test set's %d utterances: left out %s (warned "
                    "about above)", epoch + 1, len(eval_set) - counts.not_decoded,
                    len(eval_set) + eval_set.skipped.total(), count_reasons(reasons))
    if counts.not_decoded:  # the key's meaning since it was written: every test utterance the evaluation left out
        record["eval_unreadable"] = counts.not_decoded
    append_metrics(metrics_file, record)


def append_metrics(metrics_file, record: dict) -> None:
    """A line of metrics.jsonl (open_metrics' file), on disk at once; a write the disk refuses names the file."""
    with errors_naming(metrics_file.name):
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()
