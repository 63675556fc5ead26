"""Checkpoints: named parts in one file, written atomically, read back with weights_only=True.

A checkpoint holds only state dicts, tensors and plain data (the resolved config as a dict), so loading one
never runs code: torch.load(..., weights_only=True) refuses anything else.
"""
import math
import os
import pickle
import random
import re
import shutil
import stat
import warnings
import zipfile
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.files import (FULL_DISK, file_size_limit, remove_leftover_temporaries, space_left, temporary_beside,
                        write_whole)
from data.values import is_number, is_real


def rng_state(device: torch.device) -> dict:
    """This process's random-number state: the CPU's, Python's and, on a GPU, that of its own GPU only (a job may
    resume where another number of GPUs is visible)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        cuda = state["cuda"]
        if isinstance(cuda, list):  # checkpoints before 2026-11-28 hold every visible GPU's
            cuda = cuda[device.index] if device.index is not None and device.index < len(cuda) else cuda[0]
        torch.cuda.set_rng_state(cuda, device)


def rng_state_as_json(state: dict) -> dict:
    """rng_state's `state` as JSON data, for the ranks to gather as text (distributed.all_gather_json) rather than as
    pickles, which would run what they hold: each generator's bytes as a list of numbers."""
    return {name: value.tolist() if isinstance(value, torch.Tensor) else value for name, value in state.items()}


def rng_state_from_json(state: dict) -> dict:
    """rng_state_as_json's `state` as rng_state gave it, the form the checkpoint holds."""
    return {name: _python_rng_state(value) if name == "python" else torch.tensor(value, dtype=torch.uint8)
            for name, value in state.items()}


def _python_rng_state(state: list | tuple) -> tuple:
    """random.getstate()'s (version, the generator's words, the next Gaussian or None) from JSON's lists: setstate
    takes tuples only."""
    version, words, next_gaussian = state
    return version, tuple(words), next_gaussian


class CheckpointWriteError(ValueError):
    """A checkpoint that could not be written: a full disk, a quota, a folder the job may not write in. Something the
    user fixes, not a fault of the trainer, so a ValueError: the trainer says it in one line and exits 2."""


def save(path: Path, state: dict) -> None:
    """Writes to a temporary file beside the target, flushed to disk, then renames: a crash or a full disk mid-write
    never leaves half a file, and the checkpoint already at `path` stays as it was. CheckpointWriteError naming the
    file where it cannot be written, and no temporary file left behind."""
    _write(path, lambda file: torch.save(state, file))


def save_same(source: Path, path: Path) -> None:
    """Makes `path` hold the checkpoint `source` holds without serialising it again (the 100-layer model's is large): a
    hard link, put in place by a rename as save's file is, or a copy where the file system has no hard links. Both
    names then share one file until either is saved again: every save writes a new file and renames it over the name,
    never into the file the name had, so the other name keeps it."""
    temporary = temporary_beside(path)
    try:
        os.link(source, temporary)
    except OSError:
        with open(source, "rb") as original:
            _write(path, lambda file: shutil.copyfileobj(original, file))
        return
    os.replace(temporary, path)


def _write(path: Path, write_into) -> None:
    """save's writing: `write_into(file)` fills a file beside `path`, which then replaces it (data.files)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # The job holds the run directory (trainer.run_directory): one left beside `path` is a killed job's, as large as
        # a checkpoint, and each preemption would leave another.
        remove_leftover_temporaries(path)
        write_whole(path, write_into)
    except Exception as error:
        if _interrupted(error):  # torch's writer turns a Ctrl-C inside its write callback into a RuntimeError
            raise KeyboardInterrupt from None
        raise CheckpointWriteError(f"cannot write checkpoint {path} ({_write_refusal(error, path)}); "
                                   f"{path.name} there, if any, is as it was") from error


def _write_refusal(error: Exception, path: Path) -> str:
    """Why `path` could not be written: the system's words where its folder refuses it (Permission denied, Read-only
    file system), which the space left would only cloud. torch reports a failed write as "unexpected pos 206784 vs
    206672", without the reason: for it and a full disk, the space left, and the file size limit where there is one
    (ulimit -f), which fails the write on a disk with space. The system's words alone, not its error's: that names
    `path` (data.files.errors_naming), which the line names already."""
    system = isinstance(error, OSError) and error.strerror
    if system and error.errno not in FULL_DISK:
        return error.strerror
    reason = error.strerror if system else f"{type(error).__name__}: {_reason(error)}"
    return f"{reason}{space_left(path.parent, 'on its file system')}{file_size_limit()}"


def _interrupted(error: BaseException | None) -> bool:
    """Whether a KeyboardInterrupt is in the chain of exceptions that led to `error`."""
    while error is not None:
        if isinstance(error, KeyboardInterrupt):
            return True
        error = error.__cause__ or error.__context__
    return False


def a_type(value) -> str:
    """'a list', 'an int': the type of a value found where another belongs, for a message."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiouAEIOU' else 'a'} {name}"


# What every checkpoint holds, and what resuming a run needs besides.
MODEL_PARTS = ("model", "config")
TRAINING_PARTS = (*MODEL_PARTS, "optimizer", "scheduler", "sampler", "train_state", "rng")


def _reason(error: Exception) -> str:
    """torch's error in one line; for a file the safe loader refuses, only the sentence saying what it found, not
    torch's advice around it (to load the file with weights_only=False, or to allow what it found)."""
    if isinstance(error, pickle.UnpicklingError):
        for sentence in re.split(r"(?<=\.)\s+|\n+", str(error)):
            if "nsupported" in sentence:
                return " ".join(sentence.split()).removeprefix("WeightsUnpickler error: ")
    return " ".join(str(error).split())


def check_readable(path: Path) -> None:
    """FileNotFoundError or ValueError naming `path` where it is no file this process can open: an absent one, a folder,
    a pipe, one it may not read or a name too long, each said as such rather than as a damaged checkpoint."""
    try:
        mode = path.stat().st_mode
        if stat.S_ISREG(mode):  # only a file: opening a pipe would wait for a writer
            open(path, "rb").close()
    except FileNotFoundError:
        if path.is_symlink():  # `ls` lists it: "not found" alone left the user to find the link's target missing
            raise FileNotFoundError(f"checkpoint {path} is a symbolic link to {os.readlink(path)}, which does not "
                                    "exist") from None
        raise FileNotFoundError(f"checkpoint not found: {path}{_last_instead(path)}") from None
    except OSError as error:  # no permission (to the file or a folder on its way), a name past the file system's limit
        raise ValueError(f"cannot read checkpoint {path}: {error.strerror or error}") from None
    if stat.S_ISDIR(mode):
        raise ValueError(f"checkpoint {path} is a folder; name a .pt file in it")
    if not stat.S_ISREG(mode):  # torch.load seeks in it
        raise ValueError(f"checkpoint {path} is not a file (a pipe, <(...), a device); save it to one and name that")


def _last_instead(missing: Path) -> str:
    """For a missing best.pt beside a last.pt, a hint naming that last.pt: a run stopped (train.max_steps) before its
    first evaluation wrote no best.pt, the file README's examples name."""
    last = missing.with_name("last.pt")
    if missing.name != "best.pt" or not last.is_file():
        return ""
    return f" (a run writes best.pt at its first evaluation; {last} holds its latest checkpoint)"


class DamagedArchive(ValueError):
    """A checkpoint's zip archive that is not as torch.save wrote it, for a reason load finds itself."""


def load(path: str | Path, parts: tuple[str, ...] = MODEL_PARTS, record_only: bool = False) -> dict:
    """Loads a checkpoint written by `python -m trainer`, which must hold `parts`; ValueError naming the file else.
    `record_only`: for its plain data alone (a best.pt's WER and test set), its tensors mapped from the file rather
    than read, and only its plain data checked against their checksums, not its tensors: a resume read a deep model's
    weights (gigabytes, on every rank) for two numbers."""
    path = Path(path)
    check_readable(path)
    if path.stat().st_size == 0:  # a copy that wrote nothing (a full disk): torch's EOFError for it has no message
        raise ValueError(f"cannot load checkpoint {path}: it is empty (0 bytes)")
    try:
        archived = zipfile.is_zipfile(path)  # torch.save's format since torch 1.6; only it can be mapped
        if not archived and _starts_a_zip(path):  # torch said so in 400 characters of miniz's words and advice
            raise DamagedArchive("it is cut short (a copy, transfer or save interrupted): its zip archive lacks the "
                                 "directory of its entries, which torch.save writes at its end")
        if archived:
            with zipfile.ZipFile(path) as archive:
                compressed = any(entry.compress_type != zipfile.ZIP_STORED for entry in archive.infolist())
                # torch.load does not check the CRC-32 torch.save writes for each entry: bytes changed on disk loaded
                # as wrong weights, which a resume trained on.
                changed = None if compressed else _changed_entry(archive, record_only)
            if compressed:  # torch.save stores its entries as they are; a compressed one could unpack to any size
                raise DamagedArchive("it holds compressed entries, which torch.save never writes")
            if changed is not None:
                raise DamagedArchive(f"its entry {changed} does not match its CRC-32 checksum: its bytes changed "
                                     "after torch.save wrote them")
        with warnings.catch_warnings():
            # A pickle that torch.save did not write (pickle.dump's protocol) drew torch's warning over two lines
            # before the one line that refuses it, or that says what it lacks.
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            saved = torch.load(path, map_location="cpu", weights_only=True, mmap=record_only and archived)
    except DamagedArchive as error:  # its own reason alone, not the guesses at what torch's error meant
        raise ValueError(f"cannot load checkpoint {path}: {error}") from None
    except Exception as error:  # torch raises several types for a bad or unsafe file; name the file in one message
        raise ValueError(f"cannot load checkpoint {path}: not a complete checkpoint that torch.save wrote, or one "
                         f"holding more than tensors and plain data ({type(error).__name__}: {_reason(error)})"
                         ) from error
    not_the_trainers = f"{path} is not a checkpoint written by python -m trainer"
    missing = [part for part in parts if not isinstance(saved, dict) or part not in saved]
    if missing:
        raise ValueError(f"{not_the_trainers}: it has no {', '.join(missing)}")
    if not isinstance(saved["config"], dict):  # a string would be parsed as YAML, where \u0024{ spells ${
        raise ValueError(f"{not_the_trainers}: its config is {a_type(saved['config'])}, not a mapping")
    unresolved = _unresolved(saved["config"])
    if unresolved:
        raise ValueError(f"{not_the_trainers}: its {unresolved}, which the trainer's resolved config never holds")
    # The trainer writes uuid's hex, or None before run ids. An edited file's tensor ended a resume in a traceback as it
    # took the run up, and a list went on into jobs.jsonl and the run's next checkpoints.
    if saved.get("run_id") is not None and not isinstance(saved["run_id"], str):
        raise ValueError(f"{not_the_trainers}: its run_id is {a_type(saved['run_id'])}, not a run's id (a string)")
    odd_tensor = _odd_tensor(saved)
    if odd_tensor:
        raise ValueError(f"{not_the_trainers}: its {odd_tensor}, where the trainer writes dense tensors with values")
    return saved


def _starts_a_zip(path: Path) -> bool:
    """Whether the file begins as a zip archive does (a local file header), as torch.save's first bytes do."""
    with open(path, "rb") as file:
        return file.read(4) == b"PK\x03\x04"


def _changed_entry(archive: zipfile.ZipFile, record_only: bool) -> str | None:
    """The first entry of a torch.save archive whose bytes do not match their CRC-32, else None; with `record_only`,
    of the entries other than the tensors' (ARCHIVE/data/KEY)."""
    if not record_only:
        return archive.testzip()
    for entry in archive.infolist():
        if entry.filename.split("/")[1:2] != ["data"]:
            try:
                archive.read(entry)  # zipfile checks the CRC-32 of an entry read whole
            except zipfile.BadZipFile:
                return entry.filename
    return None


def stored_config(config: dict) -> DictConfig:
    """A resolved config (a loaded checkpoint's, or the run's for its config.yaml), each string the text it is: a "${"
    in one (a corpus folder named so, given on the command line as "\\${") is no interpolation to resolve, so none
    reads the environment (`${oc.env:...}`)."""
    return OmegaConf.create(_escape_interpolations(config))


def _escape_interpolations(value):
    """`value` with OmegaConf's escape before each "${" of its strings, the backslashes already before it doubled."""
    if isinstance(value, str):
        return re.sub(r"(\\*)\$\{", lambda match: match[1] * 2 + "\\${", value)
    if isinstance(value, dict):
        return {key: _escape_interpolations(entry) for key, entry in value.items()}
    if isinstance(value, list | tuple):
        return [_escape_interpolations(entry) for entry in value]
    return value


def _entries(value) -> list:
    """(name, entry) for each entry of a mapping, list or tuple of loaded data, none for anything else."""
    if isinstance(value, dict):
        return list(value.items())
    return list(enumerate(value)) if isinstance(value, list | tuple) else []


def _odd_tensor(saved: dict) -> str | None:
    """A tensor of a checkpoint's that the safe loader takes but no model or optimizer can use, named with its
    key: a sparse or other non-dense layout, a nested tensor, or a meta tensor (shape alone, no values). Loading one
    into the model ended in torch's errors, a page of its dispatcher's backends or none naming the key; else None."""
    pending = list(saved.items())
    seen = set()  # a pickle may hold one list many times over, or inside itself
    while pending:
        key, value = pending.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            kind = ("nested" if value.is_nested else f"{value.layout} (not dense)" if value.layout != torch.strided
                    else "meta (shape alone, no values)" if value.is_meta else None)
            if kind:
                return f"{key} is a {kind} tensor"
        pending += [(f"{key}.{name}", entry) for name, entry in _entries(value)]
    return None


MAX_CONFIG_DEPTH = 16  # the trainer's configs nest 4 deep
# The trainer's configs hold about 60 entries and one per training manifest (at most 5,000: trainer.config). A pickle
# stores a list once however often it recurs: a kilobyte of lists each holding the next many times over spelled 10**16
# entries, which were walked and given to OmegaConf for hours.
MAX_CONFIG_ENTRIES = 10_000


def _unresolved(config: dict) -> str | None:
    """What in a stored config OmegaConf would not take as plain data, named with its key: its missing value `???`,
    nesting past MAX_CONFIG_DEPTH, more than MAX_CONFIG_ENTRIES entries, or a value of a type it holds none of (a
    tensor), which a resume said without the file; or a key that is no name (5, None): a resume sorted the keys of
    its config among this run's in a TypeError's traceback, and OmegaConf refused None over three lines. Else None."""
    pending, entries = [("config", config, 0)], 0
    while pending:
        key, value, depth = pending.pop()
        entries += 1
        if entries > MAX_CONFIG_ENTRIES:
            return f"config holds more than {MAX_CONFIG_ENTRIES:,} entries"
        if depth > MAX_CONFIG_DEPTH:
            return f"{key} nests deeper than {MAX_CONFIG_DEPTH} levels"
        if isinstance(value, str) and value == "???":
            return f"{key} holds a missing value (???)"
        not_names = [name for name in value if not isinstance(name, str)] if isinstance(value, dict) else []
        if not_names:
            return f"{key} has the key {not_names[0]!r}, {a_type(not_names[0])}"
        pending += [(f"{key}.{name}", entry, depth + 1) for name, entry in reversed(_entries(value))]
    try:
        stored_config(config)
    except OmegaConfBaseException as error:
        key = f"config.{error.full_key}" if error.full_key else "config"
        return f"{key} holds what OmegaConf refuses ({str(error).splitlines()[0]})"
    return None


def check_optimizer_state(saved: dict, optimizer: torch.optim.Optimizer) -> None:
    """ValueError unless each tensor of a saved optimizer's per-parameter state (Adam's moments, SGD's momentum) is a
    whole tensor of its parameter's shape and dtype: a fused step writes its parameter's size into each, whatever
    theirs (a smaller one corrupted memory, an expanded one took gigabytes on resume), and finite; and each "step" a
    count."""
    saved_ids = [index for group in saved["param_groups"] for index in group["params"]]
    parameters = dict(zip(saved_ids, (p for group in optimizer.param_groups for p in group["params"]), strict=False))
    if not isinstance(saved["state"], dict):  # torch's own loader would end in an AttributeError
        raise ValueError(f"its state is {a_type(saved['state'])}, not a mapping of parameters to their state")
    for index, entries in saved["state"].items():
        if not isinstance(entries, dict):
            raise ValueError(f"its state of parameter {index} is {a_type(entries)}, not a mapping")
        parameter = parameters.get(index)
        for name, value in entries.items():
            if name == "step":
                _check_update_count(value, index)
                continue
            if not isinstance(value, torch.Tensor):
                continue
            whole = value.untyped_storage().nbytes() >= value.numel() * value.element_size()
            if parameter is None or value.shape != parameter.shape or value.dtype != parameter.dtype or not whole:
                expected = f"{parameter.dtype} {tuple(parameter.shape)}" if parameter is not None else "(none)"
                raise ValueError(f"its state {name!r} of parameter {index} is a {value.dtype} tensor of shape "
                                 f"{tuple(value.shape)}, not its parameter's {expected}")
            # The trainer saves no such state (its weights are checked finite first, and a step whose gradient is
            # not finite is skipped): resumed, it turned the weights to NaN at the first step, and the epoch was then
            # refused as if a lower optim.lr could help.
            if value.is_floating_point() and value.numel() and not math.isfinite(
                    torch.linalg.vector_norm(value, ord=math.inf)):
                raise ValueError(f"its state {name!r} of parameter {index} holds values that are not finite")


def _check_update_count(value, index) -> None:
    """ValueError unless an optimizer state's "step" (Adam raises its betas to it to correct its moments) is one finite
    number, 0 or more: a negative one turned every weight to NaN at the first step, a vector ended it in a traceback."""
    count = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    if is_number(count) and count >= 0:
        return
    if is_real(count):
        found = repr(count)
    elif isinstance(value, torch.Tensor):
        found = f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    else:
        found = a_type(value)
    raise ValueError(f"its state 'step' of parameter {index} is {found}, not a count of updates (0 or more)")
