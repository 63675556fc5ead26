"""Reading speech audio as a mono float waveform at the model's sample rate."""
import itertools
import math
import os
import stat
from collections.abc import Iterable, Iterator

import numpy as np
import soundfile
import torch
import torchaudio.transforms

from data.manifest import printable


class AudioError(ValueError):
    """An audio file that cannot be used, for a reason audio_header or load_audio gives: unreadable, not audio, without
    samples or with NaN/infinite ones, a header past this module's limits, or a rate too costly to resample. Its
    message names the file as data.manifest.printable writes it: the name comes from a manifest or a corpus's files."""


class NoSuchAudioFile(AudioError):
    """An audio file that is not there: where every file is, a manifest's relative paths taken from another folder or
    a node without the corpus, rather than audio that cannot be used."""


# What a file's header may claim before anything is decoded. A corrupt header can claim 2^36 frames or a sample rate
# of a megahertz; decoding or resampling that would take hundreds of GiB instead of failing on the one file.
MAX_SECONDS = 3600
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 1000, 384_000
MAX_CHANNELS = 16  # a microphone array's
# Frames decoded, their channels averaged, and samples resampled at once. Decoded whole, an hour of 16 channels at
# 384 kHz took 88 GB as float32 before its mean (5.5 GB) was taken; resampled whole, a waveform takes some seven times
# its size besides in torchaudio's convolution (38 GB for that hour).
BLOCK_FRAMES = 2**16
# libsndfile's frame count where a header gives none (a FLAC written to a pipe, which cannot go back to fill it in).
UNKNOWN_FRAMES = 2**63 - 1
# Resampling between two rates builds a filter of one phase per output sample of their ratio in lowest terms, each
# spanning that ratio's input samples: 16001 -> 16000 Hz takes 16000 phases of 16015 taps (14 s and 4 GB, whatever the
# clip's length), 100100 -> 16000 Hz 160 phases of 1077 (as quick as 44100 -> 16000). An odd rate whose filter would
# take more taps than this is resampled as the nearest multiple of 100 Hz instead (16001 -> 16000: a 0.006 % change of
# pitch and speed); where the model's own rate is the odd one, that does not help, and the file is refused. The most an
# accepted filter takes, 2 million taps, is 16 MB while torchaudio builds it in float64.
MAX_RESAMPLING_TAPS = 2_000_000
# A model rate that resamples every multiple of 100 Hz within MIN_SAMPLE_RATE-MAX_SAMPLE_RATE under MAX_RESAMPLING_TAPS.
RATE_THAT_TAKES_ANY_FILE = 16000
# torchaudio.functional.resample's defaults, which size its filter.
LOWPASS_FILTER_WIDTH, ROLLOFF = 6, 0.99


def load_audio(path: str | os.PathLike, sample_rate: int = 16000, header=None) -> torch.Tensor:
    """Read `path` (any format libsndfile knows: FLAC, WAV, NIST SPHERE...) as a mono waveform.

    Channels are averaged and other sample rates resampled to `sample_rate` (an odd rate such as 16001 Hz as the
    nearest multiple of 100 Hz, see MAX_RESAMPLING_TAPS). `header` is the file's audio_header where the caller has
    read it already (the dataset, for its max_duration), so that it is not read again.

    Returns:
        (N,) float32 samples, in [-1, 1] for integer formats (float files hold what they hold).
    Raises:
        AudioError naming the file and the reason when it cannot be read, its header claims more than MAX_SECONDS of
        audio or a sample rate outside MIN_SAMPLE_RATE-MAX_SAMPLE_RATE, it holds no samples, or holds non-finite
        ones (a float file can; they would turn the whole batch's loss into NaN), or resampling it to `sample_rate`
        would take a filter of more than MAX_RESAMPLING_TAPS taps even from the nearest multiple of 100 Hz.
    """
    if header is None:
        header = audio_header(path)
    # Before decoding: a model given an odd rate decoded every file whole, only to refuse it.
    from_rate = _rate_to_resample_from(path, header.samplerate, sample_rate)
    waveform = _resample(_mono_blocks(path, header.frames), from_rate, sample_rate, header.frames)
    if len(waveform) == 0:
        raise AudioError(f"{printable(path)}: audio holds no samples")
    return waveform


def _mono_blocks(path: str | os.PathLike, frames: int) -> Iterator[torch.Tensor]:
    """The file's float32 samples, its channels averaged, BLOCK_FRAMES frames at a time (each checked finite: a float
    file can hold NaN, which would turn the whole batch's loss into NaN); `frames` at most, fewer where the file ends
    before them."""
    try:
        file = soundfile.SoundFile(os.fsencode(path))
    except Exception as error:
        raise _unreadable(path, error) from None
    with file:
        block = np.empty((min(BLOCK_FRAMES, frames), file.channels), np.float32)
        decoded = 0
        while decoded < frames:
            try:
                samples = file.read(out=block[:frames - decoded])
            except Exception as error:
                raise _unreadable(path, error) from None
            if len(samples) == 0:
                break
            mono = torch.from_numpy(samples).mean(dim=1)
            if not torch.isfinite(mono).all():
                raise AudioError(f"{printable(path)}: audio holds NaN or infinite samples")
            decoded += len(samples)
            yield mono


def _resample(blocks: Iterable[torch.Tensor], from_rate: int, to_rate: int, frames: int) -> torch.Tensor:
    """torchaudio's resampling of the (N,) waveform that `blocks` make one after another (`frames` samples at most),
    about BLOCK_FRAMES of its samples at a time, as they come: the waveform at `from_rate` is never held whole."""
    if from_rate == to_rate:  # the model's own rate, or an odd one rounded to it
        resampler, from_step, to_step, width = torch.nn.Identity(), 1, 1, 0
    else:
        resampler = torchaudio.transforms.Resample(from_rate, to_rate, dtype=torch.float32)
        from_step, to_step, width = from_rate // resampler.gcd, to_rate // resampler.gcd, resampler.width
    # Each run of to_step output samples is filtered from from_step input samples and the filter's width either side,
    # zeros past the waveform's ends: a block of whole runs, resampled with whole runs either side that cover that
    # width, gives what resampling the whole waveform gives there.
    block = math.ceil(BLOCK_FRAMES / from_step) * from_step
    margin = math.ceil(width / from_step) * from_step
    resampled = torch.empty(-(-frames * to_step // from_step))
    written = 0
    for start, window, lead in _block_windows(blocks, block, margin):
        skipped = lead // from_step * to_step
        piece = resampler(window)[skipped:skipped + block // from_step * to_step]
        at = start // from_step * to_step
        resampled[at:at + len(piece)] = piece
        written = at + len(piece)
    # A header that claims more frames than the file holds (an Ogg whose last page gives a later sample) leaves the
    # allocation partly unwritten, and a view of what was written would keep all of it held as long as the waveform
    # is (each item of a batch). Copied where most of it is unwritten; a header a little off keeps the view rather
    # than copying the waveform for the few samples it spares.
    return resampled[:written].clone() if written < len(resampled) // 2 else resampled[:written]


def _block_windows(blocks: Iterable[torch.Tensor], block: int, margin: int) -> Iterator[tuple[int, torch.Tensor, int]]:
    """(start, window, lead) for each `block` samples of the waveform that `blocks` make one after another: the first
    sample's position, and the block in a window of up to `margin` samples either side, `lead` of them before it. The
    waveform's samples are held only while a window still needs them."""
    held, first, start = torch.empty(0), 0, 0  # the samples from position `first` on
    for samples in itertools.chain(blocks, [None]):  # None: the waveform's end, after which no margin will come
        if samples is not None:
            held = torch.cat([held, samples])
        while first + len(held) >= start + block + margin or (samples is None and start < first + len(held)):
            yield start, held[:start + block + margin - first], start - first
            start += block
            held, first = held[max(0, start - margin) - first:], max(0, start - margin)


def _rate_to_resample_from(path: str | os.PathLike, file_rate: int, sample_rate: int) -> int:
    """`file_rate`, or the nearest multiple of 100 Hz where resampling from it would take a filter of more than
    MAX_RESAMPLING_TAPS taps; AudioError where that takes too many as well."""
    if _resampling_filter_taps(file_rate, sample_rate) <= MAX_RESAMPLING_TAPS:
        return file_rate
    rounded_rate = max(100, round(file_rate / 100) * 100)
    taps = _resampling_filter_taps(rounded_rate, sample_rate)
    if taps > MAX_RESAMPLING_TAPS:  # the model's own rate is the odd one
        raise AudioError(f"{printable(path)}: resampling {rounded_rate} Hz to the model's {sample_rate} Hz would take "
                         f"a filter of {taps} taps, more than {MAX_RESAMPLING_TAPS}: give the model a rate such as "
                         f"{RATE_THAT_TAKES_ANY_FILE} Hz, which takes audio at any rate")
    return rounded_rate


def audio_header(path: str | os.PathLike):
    """The file's header as libsndfile reads it (samplerate, frames, duration...); AudioError naming the file where
    there is no such file, it cannot be opened (the reason given), it is not audio, or its header claims what
    load_audio refuses: no samples, more than MAX_SECONDS, a sample rate outside MIN_SAMPLE_RATE-MAX_SAMPLE_RATE or
    more than MAX_CHANNELS channels (so a manifest never lists such a file with the duration it claims), or no length
    at all."""
    _require_readable_file(path)
    # Whatever a file that is not what it claims makes libsndfile or soundfile raise (a RAW file without a rate
    # raises TypeError), the message names the file. The name goes as bytes: soundfile encodes a str strictly, and a
    # name that is not UTF-8 (b"\xff.wav", which Python holds as "\udcff.wav") would not open.
    try:
        header = soundfile.info(os.fsencode(path))
    except Exception as error:
        raise _unreadable(path, error) from None
    if not MIN_SAMPLE_RATE <= header.samplerate <= MAX_SAMPLE_RATE:
        raise AudioError(f"{printable(path)}: its header gives a sample rate of {header.samplerate} Hz, outside "
                         f"{MIN_SAMPLE_RATE}-{MAX_SAMPLE_RATE} Hz")
    if not 1 <= header.channels <= MAX_CHANNELS:
        raise AudioError(f"{printable(path)}: its header gives {header.channels} channels, outside 1-{MAX_CHANNELS}")
    if header.frames == 0:
        raise AudioError(f"{printable(path)}: audio holds no samples")
    if header.frames == UNKNOWN_FRAMES:  # it would be decoded into an array of that length
        raise AudioError(f"{printable(path)}: its header gives no length, as a FLAC written to a pipe leaves it: "
                         "encode it again into a file")
    if header.frames > MAX_SECONDS * header.samplerate:
        raise AudioError(f"{printable(path)}: its header gives {header.frames / header.samplerate:.0f} s of audio, "
                         f"more than the {MAX_SECONDS} s a file may hold")
    return header


def _require_readable_file(path: str | os.PathLike) -> None:
    """AudioError naming `path` where it is missing, cannot be opened, is not a regular file or is empty. libsndfile
    reports the first two as "System error", which says neither, and would wait on a pipe for a writer."""
    try:
        status = os.stat(path)
        if stat.S_ISREG(status.st_mode):
            open(path, "rb").close()
    except (FileNotFoundError, NotADirectoryError):
        raise NoSuchAudioFile(f"{printable(path)}: no such audio file") from None
    except OSError as error:  # no permission (to the file or a folder on its way), a name past the file system's limit
        raise AudioError(f"{printable(path)}: cannot read audio ({error.strerror or error})") from None
    if not stat.S_ISREG(status.st_mode):
        raise AudioError(f"{printable(path)}: " + ("a folder, not an audio file" if stat.S_ISDIR(status.st_mode) else
                                        "not a file (a pipe, <(...), a device); save the audio to one and name that"))
    if status.st_size == 0:  # a download or copy that wrote nothing, which libsndfile calls an unknown format
        raise AudioError(f"{printable(path)}: an empty file (0 bytes), not audio")


def _resampling_filter_taps(from_rate: int, to_rate: int) -> int:
    """The size of the filter torchaudio.functional.resample builds between the two rates."""
    gcd = math.gcd(from_rate, to_rate)
    from_step, to_step = from_rate // gcd, to_rate // gcd
    width = math.ceil(LOWPASS_FILTER_WIDTH * from_step / (ROLLOFF * min(from_step, to_step)))
    return to_step * (from_step + 2 * width)


def _unreadable(path: str | os.PathLike, error: Exception) -> AudioError:
    reason = getattr(error, "error_string", None) or str(error) or type(error).__name__
    return AudioError(f"{printable(path)}: cannot read audio ({reason})")
