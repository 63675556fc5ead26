"""Reading speech audio as a mono float waveform at the model's sample rate."""
import os

import soundfile
import torch
import torchaudio.functional


class AudioError(ValueError):
    """An audio file that cannot be used: unreadable, not audio, without samples, or with NaN/infinite samples."""


def load_audio(path: str | os.PathLike, sample_rate: int = 16000) -> torch.Tensor:
    """Read `path` (any format libsndfile knows: FLAC, WAV, NIST SPHERE...) as a mono waveform.

    Channels are averaged and other sample rates resampled to `sample_rate`.

    Returns:
        (N,) float32 samples in [-1, 1].
    Raises:
        AudioError naming the file and the reason when it cannot be read, holds no samples, or holds non-finite
        ones (a float file can; they would turn the whole batch's loss into NaN).
    """
    # libsndfile reports a missing file as "System error"; say what it is.
    if not os.path.isfile(path):
        raise AudioError(f"{path}: no such audio file")
    try:
        samples, file_rate = soundfile.read(path, dtype="float32", always_2d=True)  # (N, C)
    except soundfile.LibsndfileError as error:
        raise AudioError(f"{path}: cannot read audio ({error.error_string})") from None
    if samples.shape[0] == 0:
        raise AudioError(f"{path}: audio holds no samples")
    waveform = torch.from_numpy(samples).mean(dim=1)  # (N,)
    if not torch.isfinite(waveform).all():
        raise AudioError(f"{path}: audio holds NaN or infinite samples")
    if file_rate != sample_rate:
        waveform = torchaudio.functional.resample(waveform, file_rate, sample_rate)
    return waveform
