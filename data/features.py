"""Log spectral features of a waveform, and SpecAugment masking for training.

Features are time-major, (T, F): T frames of F features.
"""
import warnings

import torch
import torchaudio.transforms
from torch import nn

from data.audio import MAX_SAMPLE_RATE, MIN_SAMPLE_RATE
from data.text import counted
from data.values import is_int, is_number

FEATURE_KINDS = ("spectrogram", "mel")
# A window or hop longer than this is a mistake: a window of 1e9 ms would take 64 GB. Checked here, and not only in the
# trainer's config, because a checkpoint's stored settings build an extractor too (trainer.evaluate, transcribe).
MAX_WINDOW_MS = 1000


def _has_empty_mel_band(sample_rate: int, n_fft: int, n_mels: int) -> bool:
    """Whether one of MelSpectrogram's `n_mels` triangular filters (its defaults: 0 Hz to half the rate, HTK scale)
    falls between two FFT bins and so weighs none."""
    with warnings.catch_warnings():  # torchaudio's warning names neither the window nor a value that works
        warnings.simplefilter("ignore")
        filters = torchaudio.functional.melscale_fbanks(n_fft // 2 + 1, 0.0, float(sample_rate // 2), n_mels,
                                                        sample_rate)  # (bins, n_mels)
    return bool((filters.amax(dim=0) == 0).any())


def _most_mel_bands(sample_rate: int, n_fft: int) -> int:
    """The largest n_mels without an empty band: adding bands only narrows the lowest, so a bisection finds it."""
    works, fails = 1, n_fft // 2 + 2  # one band spans every bin; more bands than bins leave one empty
    while fails - works > 1:
        middle = (works + fails) // 2
        works, fails = (works, middle) if _has_empty_mel_band(sample_rate, n_fft, middle) else (middle, fails)
    return works


def _check_n_mels(n_mels, sample_rate: int, n_fft: int, window_ms: float) -> None:
    """ValueError where `n_mels` is not a positive integer or leaves a mel band without an FFT bin."""
    if not (is_int(n_mels) and n_mels >= 1):
        raise ValueError(f"n_mels={n_mels!r} must be a positive integer")
    if n_mels > n_fft // 2 + 1 or _has_empty_mel_band(sample_rate, n_fft, n_mels):
        raise ValueError(f"n_mels={n_mels} at {sample_rate} Hz and window_ms={window_ms} (an FFT of {n_fft} points) "
                         f"gives mel bands that hold no FFT bin, features that never change: at most "
                         f"{_most_mel_bands(sample_rate, n_fft)} bands work there")


def _window_and_hop_lengths(sample_rate, window_ms, hop_ms) -> tuple[int, int]:
    """The window and the hop in samples; ValueError where the rate or either length is unusable."""
    # An integer rate: audio at other rates is resampled to it, which takes whole numbers of Hz.
    if not (is_int(sample_rate) and MIN_SAMPLE_RATE <= sample_rate <= MAX_SAMPLE_RATE
            and is_number(window_ms) and 0 < window_ms <= MAX_WINDOW_MS
            and is_number(hop_ms) and 0 < hop_ms <= MAX_WINDOW_MS):
        raise ValueError(f"sample_rate={sample_rate!r} must be an integer number of Hz from {MIN_SAMPLE_RATE} to "
                         f"{MAX_SAMPLE_RATE}, window_ms={window_ms!r} and hop_ms={hop_ms!r} numbers of "
                         f"milliseconds in (0, {MAX_WINDOW_MS}]")
    window_length = round(sample_rate * window_ms / 1000)
    hop_length = round(sample_rate * hop_ms / 1000)
    for what, milliseconds, length, shortest in (("window", window_ms, window_length, 2),
                                                 ("hop", hop_ms, hop_length, 1)):
        if length < shortest:
            raise ValueError(f"{what}_ms={milliseconds} is too short at {sample_rate} Hz: {counted(length, 'sample')}, "
                             f"and a {what} takes at least {shortest}")
    if hop_length > window_length:  # frames would skip the audio between them
        raise ValueError(f"hop_ms={hop_ms} is longer than window_ms={window_ms}")
    return window_length, hop_length


class FeatureExtractor(nn.Module):
    """Waveform -> (T, F) float32 log features.

    kind="spectrogram": log(1 + |STFT|) with a Hamming window, n_fft = window length (20 ms at 16 kHz: 320
    samples -> 161 bins), as DeepSpeech2 uses. kind="mel": log of an `n_mels`-band mel power spectrogram; its FFT
    is zero-padded to the next power of two because 80 mel bands over 161 bins would leave the narrow
    low-frequency bands without a bin. Frames are centred, so N samples give 1 + N // hop frames (one fewer where the
    FFT's length is odd and N a multiple of hop: num_frames); the ends are padded with zeros, not reflected, so that
    audio shorter than half a window still gives a frame.

    normalize: scale each feature to zero mean and unit variance over the utterance, which removes the
    recording's gain and channel colour.
    """

    def __init__(
        self,
        kind: str = "spectrogram",
        sample_rate: int = 16000,
        window_ms: float = 20,
        hop_ms: float = 10,
        n_mels: int = 80,
        normalize: bool = True,
    ):
        super().__init__()
        if kind not in FEATURE_KINDS:
            raise ValueError(f"feature kind {kind!r} is not one of {FEATURE_KINDS}")
        self.kind = kind
        self.sample_rate = sample_rate
        self.normalize = normalize
        window_length, self.hop_length = _window_and_hop_lengths(sample_rate, window_ms, hop_ms)
        if kind == "spectrogram":
            self.n_fft = window_length
            self.transform = torchaudio.transforms.Spectrogram(
                n_fft=self.n_fft,
                win_length=window_length,
                hop_length=self.hop_length,
                window_fn=torch.hamming_window,
                pad_mode="constant",
                power=1.0,
            )
            self.num_features = self.n_fft // 2 + 1
        else:
            self.n_fft = 1 << (window_length - 1).bit_length()
            _check_n_mels(n_mels, sample_rate, self.n_fft, window_ms)
            self.transform = torchaudio.transforms.MelSpectrogram(
                sample_rate=sample_rate,
                n_fft=self.n_fft,
                win_length=window_length,
                hop_length=self.hop_length,
                n_mels=n_mels,
                window_fn=torch.hamming_window,
                pad_mode="constant",
            )
            self.num_features = n_mels

    def num_frames(self, num_samples: int) -> int:
        """Frames produced from `num_samples` samples: centred frames, the signal padded by n_fft // 2 each side."""
        return 1 + (num_samples + 2 * (self.n_fft // 2) - self.n_fft) // self.hop_length

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        """(N,) waveform at `sample_rate` -> (T, F) float32 features, T = num_frames(N)."""
        spectrum = self.transform(waveform.float())  # (F, T)
        if self.kind == "spectrogram":
            features = torch.log1p(spectrum)
        else:
            # The floor keeps log finite in digital silence.
            features = torch.log(spectrum.clamp(min=1e-10))
        features = features.T.contiguous()  # (T, F)
        if self.normalize:
            mean = features.mean(dim=0, keepdim=True)
            std = features.std(dim=0, keepdim=True, correction=0)
            features = (features - mean) / (std + 1e-5)
        return features


def non_finite_detail(features: torch.Tensor, waveform: torch.Tensor) -> str | None:
    """Why `features` of `waveform` cannot be used, or None if they are finite: float samples near the end of the
    float range overflow the spectrum (shared by the dataset, which skips such a file, and transcription)."""
    if torch.isfinite(features).all():
        return None
    return f"its features are not finite (its largest sample is {float(waveform.abs().max()):.3g})"


class SpecAugment(nn.Module):
    """SpecAugment (Park et al. 2019) without time warping: zero bands of features and spans of frames.

    Each of the `num_freq_masks` masks zeros fewer than `freq_mask` adjacent features, each of the `num_time_masks`
    fewer than `time_mask` adjacent frames and, where `max_time_fraction` is below 1, fewer than that share of them,
    so that short utterances can keep most of their speech: torchaudio draws each width from 0 to one less than its
    limit, every width as likely, so freq_mask=1 never masks. Zero is the mean of normalised features. Draws from
    torch's global generator, so `torch.manual_seed` makes it repeatable (the dataset seeds it for each item and epoch,
    whichever worker loads it).
    """

    def __init__(
        self,
        freq_mask: int = 15,
        time_mask: int = 35,
        num_freq_masks: int = 2,
        num_time_masks: int = 2,
        max_time_fraction: float = 1.0,
    ):
        super().__init__()
        masks = [torchaudio.transforms.FrequencyMasking(freq_mask) for _ in range(num_freq_masks)]
        masks += [torchaudio.transforms.TimeMasking(time_mask, p=max_time_fraction) for _ in range(num_time_masks)]
        self.masks = nn.Sequential(*masks)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """(T, F) features -> (T, F) features with the masked entries zeroed."""
        return self.masks(features.T).T  # torchaudio masks (F, T)
