"""Utterances from manifests as (features, target ids), and their collation into padded batches."""
import hashlib
import json
import logging
import math
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.utils.data import Dataset, get_worker_info

from data.audio import AudioError, NoSuchAudioFile, audio_header, load_audio
from data.features import FeatureExtractor, SpecAugment, non_finite_detail
from data.files import is_stream, write_out
from data.manifest import Utterance, file_identity, printable, read_manifest
from data.sampler import epoch_seed
from data.text import counted, encode, invalid_characters, normalize_text

logger = logging.getLogger(__name__)


@dataclass
class Sample:
    features: torch.Tensor  # (T, F) float32
    targets: torch.Tensor  # (L,) int64, no blanks
    index: int  # position in the dataset


# Reasons an utterance is left out, as `skipped`, Unusable.counted_as and count_reasons word them.
UNREADABLE = "unreadable"
TOO_LONG_FOR_STRIDE = "too long for stride"
LONGER_THAN_MAX_DURATION = "longer than max_duration"
UNUSABLE_REASONS = (UNREADABLE, TOO_LONG_FOR_STRIDE, LONGER_THAN_MAX_DURATION)  # what an Unusable can be counted as


@dataclass(frozen=True)
class Unusable:
    """What the dataset gives for an item whose audio cannot train: its position, the warning naming the file and why,
    and the reason it is counted under: the one `skipped` counts where the manifest's duration already shows it.
    missing: the file is not there (NoSuchAudioFile), of those counted as UNREADABLE."""
    index: int
    warning: str
    counted_as: str = UNREADABLE
    missing: bool = False


class SharedMemoryFull(RuntimeError):
    """A data-loading worker's batch that shared memory (/dev/shm) could not take: full, or a file size limit. torch
    raises it again in the process that asked for the batch, the worker's traceback as its message."""

    @property
    def reason(self) -> str:
        """The worker's own words (torch's: `unable to write to file </torch_...>: No space left on device (28)`)."""
        return str(self).splitlines()[-1].removeprefix(f"{__name__}.{type(self).__name__}: ")


@dataclass
class Batch:
    features: torch.Tensor  # (B, T_max, F) float32, zero after each utterance's end
    feature_lengths: torch.Tensor  # (B,) int64
    targets: torch.Tensor  # (sum of L,) int64, the utterances' targets one after another
    target_lengths: torch.Tensor  # (B,) int64
    indices: torch.Tensor  # (B,) int64 dataset positions
    unusable: tuple[Unusable, ...] = ()  # items of this batch dropped because their audio could not be used

    @property
    def num_unusable(self) -> int:
        return len(self.unusable)

    def num_unusable_as(self, reason: str) -> int:
        """How many of `unusable` are counted under `reason` (Unusable.counted_as)."""
        return sum(item.counted_as == reason for item in self.unusable)

    def pin_memory(self) -> "Batch":
        """Called by DataLoader(pin_memory=True), so that `to(..., non_blocking=True)` really overlaps."""
        return self._map(lambda tensor: tensor.pin_memory())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return self._map(lambda tensor: tensor.to(device, non_blocking=non_blocking))

    def _map(self, function) -> "Batch":
        return replace(
            self,
            features=function(self.features),
            feature_lengths=function(self.feature_lengths),
            targets=function(self.targets),
            target_lengths=function(self.target_lengths),
            indices=function(self.indices),
        )


def min_ctc_frames(targets: Sequence[int]) -> int:
    """Output frames CTC needs for `targets`: one per label, plus a blank between equal adjacent labels."""
    num_repeats = sum(first == second for first, second in zip(targets, targets[1:]))
    return len(targets) + num_repeats


# A corpus of 281k utterances with a few % unusable named thousands of files before training started, burying the rest
# of the log: past this many of one reason, the log counts them, and a list where one is kept names every one.
NAMED_PER_REASON = 5


class SkipWarnings:
    """The utterances left out, each counted by reason in `counts` and named in a warning, the first NAMED_PER_REASON
    of each reason alone; `close` writes every one, named or not, to `list_path` (one JSON object a line: the file,
    the reason, why), where one is given, then says how many more of each were left out, naming that list. A caller
    that must not write yet calls `close` later, so that the count names a list only once it holds them."""

    def __init__(self, log: logging.Logger, counts: Counter[str], list_path: str | os.PathLike | None = None):
        self.log = log
        self.counts = counts
        self.list_path = list_path
        self.listed: list[dict[str, str]] = []
        self.named: Counter[str] = Counter()
        self.unnamed: Counter[str] = Counter()

    def warn(self, audio_filepath: str | os.PathLike, reason: str, detail: str) -> None:
        self.counts[reason] += 1
        self.listed.append({"audio_filepath": str(audio_filepath), "reason": reason, "detail": detail})
        if self.named[reason] < NAMED_PER_REASON:
            self.named[reason] += 1
            self.log.warning("skipping %s: %s", printable(audio_filepath), detail)
        else:
            self.unnamed[reason] += 1

    def close(self) -> None:
        self.write_list()
        self.say_the_rest()

    def say_the_rest(self) -> None:
        where = (f"every one left out is listed in {printable(self.list_path)}" if self.list_path
                 else "not named one by one")
        for reason, count in self.unnamed.items():  # in the words of the lines before and of count_reasons
            self.log.warning("skipping %s (%s); %s", counted(count, "more utterance"), reason, where)

    def write_list(self) -> None:
        if self.list_path is None:
            return
        path = Path(self.list_path)
        if not self.listed and not is_stream(path) and not path.is_symlink():
            path.unlink(missing_ok=True)  # an earlier list would name files since mended or removed
        else:
            # ASCII JSON: a path that is not UTF-8 (its bytes as surrogates) is written as escapes a reader gives back.
            # Into a pipe even with nothing: that ends its reader.
            write_out(path, b"".join((json.dumps(entry) + "\n").encode() for entry in self.listed))


def count_reasons(counts: Counter) -> str:
    """'2 utterances (too long for stride), 1 utterance (empty transcript)': the log's and tools' way of saying how
    many were left out and why ('' for none)."""
    return ", ".join(f"{counted(count, 'utterance')} ({reason})" for reason, count in counts.items())


class SpeechDataset(Dataset):
    """The utterances of one or more manifests, as Samples of features and target ids.

    Utterances that can never train are dropped at construction, counted by reason in `skipped` and named in
    warnings (SkipWarnings: the first few of each reason, every one in `skip_list` where given): an empty transcript,
    characters outside the alphabet, or a transcript with more characters than the model's output frames can hold
    (estimated from the manifest's duration). Utterances longer than `max_duration` seconds are dropped too, counted
    but not named one by one: that is a choice, not a fault in the data. So is a later listing of an audio file
    already kept (a manifest given twice, corpora that share files, or one file under another name through a symbolic
    or hard link), which would train twice an epoch and count twice in a WER: one warning counts them and names the
    first.

    Audio is read when an item is asked for; `__getitem__` returns an Unusable naming the file and why when it
    cannot be read, has no samples, gives non-finite features (float samples near the float range's end), turns
    out too short for its transcript after all, or lasts more than a second beyond `max_duration` whatever the
    manifest said (its header says so, before it is decoded). `collate` sets these aside in `Batch.unusable`, and
    `warn_once` (called where the batches arrive: loader processes start from a fresh copy of the dataset every epoch,
    and would warn every epoch) logs each once, the first few of each reason alone.

    Args:
        manifest_paths: JSONL manifests (see data.manifest), read in order.
        features: turns a waveform into (T, F) features; its sample rate is the one audio is read at.
        augment: applied to the features of every item (pass it for training data only).
        time_stride: how many feature frames the model merges into one output frame.
        max_duration: seconds; longer utterances are dropped. None keeps all.
        seed: with `set_epoch`, fixes the augmentation of each item (see `_augmented`).
        skip_list: a JSONL file that `write_skip_list` lists every utterance left out at construction in, with why
            (removed where none is); the warnings name it.
    """

    def __init__(
        self,
        manifest_paths: Sequence[str | os.PathLike],
        features: FeatureExtractor,
        augment: SpecAugment | None = None,
        time_stride: int = 1,
        max_duration: float | None = None,
        seed: int = 0,
        skip_list: str | os.PathLike | None = None,
    ):
        if isinstance(manifest_paths, str | os.PathLike):
            manifest_paths = [manifest_paths]  # a lone path would otherwise be read as a list of characters
        if time_stride < 1:
            raise ValueError(f"time_stride must be at least 1, got {time_stride}")
        self.features = features
        self.augment = augment
        self.time_stride = time_stride
        self.max_duration = max_duration
        self.seed = seed
        self.epoch = 0
        self.utterances: list[Utterance] = []
        self.targets: list[list[int]] = []
        self.skipped: Counter[str] = Counter()
        self._warned: set[int] = set()
        self._warned_per_reason: Counter[str] = Counter()
        self._skip_warnings = SkipWarnings(logger, self.skipped, skip_list)
        self._read(manifest_paths, self._skip_warnings)
        if not self.utterances:
            raise ValueError(f"no usable utterance in {', '.join(map(str, manifest_paths))}: skipped "
                             f"{count_reasons(self.skipped) or 'none, the manifest is empty'}")
        logger.info(
            "%s from %s; skipped %s",
            counted(len(self.utterances), "utterance"),
            ", ".join(map(str, manifest_paths)),
            count_reasons(self.skipped) or "none",
        )

    def write_skip_list(self) -> None:
        """Writes the construction's `skip_list`, where one was given, then counts those left out past the named ones,
        naming the list: a training job writes it only once it goes on, so that one refused, or with nothing to
        train, leaves its run directory's list as it was, and said before, the count named a list holding an earlier
        job's files."""
        if self._skip_warnings.list_path is not None:
            self._skip_warnings.close()

    def fingerprint(self) -> str:
        """The utterances kept, in order, as a count and a digest of their file names, durations and transcripts:
        another set behind the same manifest paths (a corpus prepared again, a manifest edited) gives another one,
        the same corpus in another folder the same one."""
        digest = hashlib.sha256()
        for utterance in self.utterances:
            entry = [Path(utterance.audio_filepath).name, utterance.duration, utterance.text]
            digest.update(json.dumps(entry, ensure_ascii=False).encode() + b"\n")
        return f"{len(self.utterances)} utterances, sha256 {digest.hexdigest()[:16]}"

    def _read(self, manifest_paths: Sequence[str | os.PathLike], skip_warnings: SkipWarnings) -> None:
        """Keeps each utterance that can train, at its audio file's first listing; counts and warns about the rest."""
        kept_files: set[tuple[int, int] | str] = set()
        first_repeat = None
        for path in manifest_paths:
            for utterance in read_manifest(path):
                # Before the transcript is checked: a repeat whose own transcript cannot train was warned about as
                # "skipping FILE", of a file that trains under its first listing, and counted under that reason.
                audio_file = file_identity(utterance.audio_filepath)
                if audio_file in kept_files:
                    self.skipped["audio listed before"] += 1
                    first_repeat = first_repeat or utterance.audio_filepath
                    continue
                targets = self._trainable_targets(utterance, skip_warnings)
                if targets is None:
                    continue
                kept_files.add(audio_file)
                self.utterances.append(utterance)
                self.targets.append(targets)
        if skip_warnings.list_path is None:  # with a list: once it is written (write_skip_list)
            skip_warnings.say_the_rest()
        if first_repeat is not None:
            logger.warning("skipping %s whose audio file is listed before (the first: %s)",
                           counted(self.skipped["audio listed before"], "utterance"), printable(first_repeat))

    def _trainable_targets(self, utterance: Utterance, skip_warnings: SkipWarnings) -> list[int] | None:
        """The utterance's target ids, or None (counted in `skipped`, most through `skip_warnings`) where it can never
        train."""
        if self.max_duration is not None and utterance.duration > self.max_duration:
            self.skipped[LONGER_THAN_MAX_DURATION] += 1
            return None
        text = normalize_text(utterance.text)
        if not text:
            skip_warnings.warn(utterance.audio_filepath, "empty transcript", "its transcript is empty")
            return None
        bad = invalid_characters(text)
        if bad:
            detail = f"its transcript has characters outside the alphabet: {bad}"
            skip_warnings.warn(utterance.audio_filepath, "characters outside the alphabet", detail)
            return None
        targets = encode(text)
        num_samples = round(utterance.duration * self.features.sample_rate)
        if too_long := self._too_long_detail(self.features.num_frames(num_samples), targets):
            if utterance.duration == 0:  # the transcript is not what is wrong
                skip_warnings.warn(utterance.audio_filepath, "duration 0", "its manifest gives a duration of 0 s "
                                   "(empty audio, or a duration not filled in)")
            else:
                skip_warnings.warn(utterance.audio_filepath, TOO_LONG_FOR_STRIDE, too_long)
            return None
        return targets

    def _too_long_detail(self, num_frames: int, targets: list[int]) -> str | None:
        """Why `targets` cannot be trained on from `num_frames` feature frames, or None where the model's output
        frames for them, `time_stride` feature frames apart, are enough for CTC."""
        num_outputs = math.ceil(num_frames / self.time_stride)
        if num_outputs >= min_ctc_frames(targets):
            return None
        return (
            f"the model has {counted(num_outputs, 'output frame')} for it at time stride {self.time_stride}, "
            f"fewer than the {min_ctc_frames(targets)} its {len(targets)}-character transcript needs"
        )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def durations(self) -> list[float]:
        """Seconds of each utterance, in dataset order (what the batch sampler buckets by)."""
        return [utterance.duration for utterance in self.utterances]

    def __len__(self) -> int:
        return len(self.utterances)

    def __getitem__(self, index: int) -> Sample | Unusable:
        utterance, targets = self.utterances[index], self.targets[index]
        try:
            # From the header, before decoding: a lecture the manifest lists as 2 s was decoded (and resampled) whole,
            # up to an hour of audio and gigabytes, every epoch in every loader process, only to be skipped.
            header = audio_header(utterance.audio_filepath)
            if self.max_duration is not None and header.duration > self.max_duration + 1:
                return self._unusable(index, f"its audio lasts {header.duration:.1f} s, more than max_duration "
                                             f"({self.max_duration} s); the manifest says {utterance.duration} s",
                                      LONGER_THAN_MAX_DURATION)
            waveform = load_audio(utterance.audio_filepath, self.features.sample_rate, header=header)
        except AudioError as error:
            return Unusable(index, f"skipping {error}", missing=isinstance(error, NoSuchAudioFile))
        features = self.features(waveform)  # (T, F)
        if detail := non_finite_detail(features, waveform):
            return self._unusable(index, detail)
        if too_long := self._too_long_detail(len(features), targets):
            return self._unusable(index, too_long, TOO_LONG_FOR_STRIDE)
        if self.augment is not None:
            features = self._augmented(features, index)
        return Sample(features, torch.tensor(targets, dtype=torch.int64), index)

    def _augmented(self, features: torch.Tensor, index: int) -> torch.Tensor:
        """Item `index`'s features masked by `augment`, the masks drawn from a generator seeded by (seed, epoch, item):
        the same whichever worker loads the item, so a run resumed mid-epoch augments exactly as the uninterrupted run
        did."""
        with torch.random.fork_rng(devices=[]):
            # Wrapped into the 64 bits a seed may take: a date such as 20240101 as the run's seed overflows them.
            torch.manual_seed((epoch_seed(self.seed, self.epoch) * 1_000_033 + index) % 2**64)
            return self.augment(features)

    def _unusable(self, index: int, detail: str, counted_as: str = UNREADABLE) -> Unusable:
        return Unusable(index, f"skipping {printable(self.utterances[index].audio_filepath)}: {detail}", counted_as)

    def warn_once(self, unusable: Sequence[Unusable]) -> None:
        """Logs the warning of each item not warned about before, the first NAMED_PER_REASON of each reason alone (as
        SkipWarnings names those left out at construction), then one line saying the rest are counted, not named: a
        corpus with thousands of files that cannot be decoded named each of them, on every rank."""
        for item in unusable:
            if item.index in self._warned:
                continue
            self._warned.add(item.index)
            self._warned_per_reason[item.counted_as] += 1
            if self._warned_per_reason[item.counted_as] <= NAMED_PER_REASON:
                logger.warning(item.warning)
            elif self._warned_per_reason[item.counted_as] == NAMED_PER_REASON + 1:
                logger.warning("skipping more utterances (%s) without naming them; the counts of those left out "
                               "include them", item.counted_as)


def collate(samples: Sequence[Sample | Unusable]) -> Batch:
    """Pad the usable samples into one Batch; Unusable items go into `Batch.unusable`.

    With no usable sample the Batch has B = 0 (features of shape (0, 0, 0)): the training loop skips it.
    """
    usable = [sample for sample in samples if isinstance(sample, Sample)]
    feature_lengths = torch.tensor([len(sample.features) for sample in usable], dtype=torch.int64)
    num_features = usable[0].features.shape[1] if usable else 0
    max_frames = int(feature_lengths.max()) if usable else 0
    features = torch.zeros(len(usable), max_frames, num_features)  # (B, T_max, F)
    for row, sample in enumerate(usable):
        features[row, : len(sample.features)] = sample.features
    targets = [sample.targets for sample in usable]
    batch = Batch(
        features=features,
        feature_lengths=feature_lengths,
        targets=torch.cat(targets) if targets else torch.zeros(0, dtype=torch.int64),
        target_lengths=torch.tensor([len(target) for target in targets], dtype=torch.int64),
        indices=torch.tensor([sample.index for sample in usable], dtype=torch.int64),
        unusable=tuple(sample for sample in samples if isinstance(sample, Unusable)),
    )
    if get_worker_info() is None:
        return batch
    # A worker hands its batch over in shared memory (/dev/shm). Moved there here, not by the queue's feeder thread as
    # it sends the batch, a failure (/dev/shm full, a file size limit) is the worker's error, which reaches the training
    # process: in the feeder thread it was printed there and the batch lost, the training process waiting for it until
    # its timeout and then blaming a stuck worker. torch's default_collate allocates in shared memory too.
    try:
        return batch._map(torch.Tensor.share_memory_)
    except RuntimeError as error:
        raise SharedMemoryFull(str(error)) from None
