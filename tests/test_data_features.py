"""Audio reading, log spectral features and SpecAugment."""
import math
import os
import re
import struct
import subprocess
import sys
import threading
import tracemalloc

import numpy as np
import pytest
import soundfile
import torch
import torchaudio.functional

from conftest import REPO_ROOT, error_without_root_privilege
from data.audio import (MAX_CHANNELS, MAX_RESAMPLING_TAPS, MAX_SAMPLE_RATE, MIN_SAMPLE_RATE, RATE_THAT_TAKES_ANY_FILE,
                        AudioError, _resample, _resampling_filter_taps, audio_header, load_audio)
from data.features import MAX_WINDOW_MS, FeatureExtractor, SpecAugment


def tone(frequency: float, seconds: float, rate: int) -> np.ndarray:
    return (0.5 * np.sin(2 * np.pi * frequency * np.arange(round(seconds * rate)) / rate)).astype(np.float32)


def test_stereo_is_averaged_to_mono_float32(tmp_path):
    left_right = np.stack([np.full(1000, 0.25), np.full(1000, 0.5)], axis=1).astype(np.float32)
    soundfile.write(tmp_path / "stereo.wav", left_right, 16000, subtype="FLOAT")
    waveform = load_audio(tmp_path / "stereo.wav")
    assert waveform.dtype == torch.float32 and waveform.shape == (1000,)
    torch.testing.assert_close(waveform, torch.full((1000,), 0.375))


def test_other_sample_rates_are_resampled_keeping_the_pitch(tmp_path):
    soundfile.write(tmp_path / "8k.flac", tone(440, 1.0, 8000), 8000)
    waveform = load_audio(tmp_path / "8k.flac", sample_rate=16000)
    assert waveform.shape == (16000,)
    spectrum = torch.fft.rfft(waveform).abs()  # 1 Hz per bin over 1 s
    assert int(spectrum.argmax()) == 440


def test_nist_sphere_is_read(tmp_path):
    samples = tone(300, 0.5, 16000)
    soundfile.write(tmp_path / "a.sph", samples, 16000, format="NIST", subtype="PCM_16")
    torch.testing.assert_close(load_audio(tmp_path / "a.sph"), torch.from_numpy(samples), atol=1e-4, rtol=0)


def test_audio_whose_file_name_is_not_utf8_is_read(tmp_path):
    soundfile.write(tmp_path / "a.wav", tone(300, 0.2, 16000), 16000, subtype="FLOAT")
    name = os.fsdecode(b"\xff.wav")  # how Python gives such a name from os.listdir or the command line
    os.rename(tmp_path / "a.wav", tmp_path / name)
    assert audio_header(tmp_path / name).frames == 3200
    assert torch.equal(load_audio(str(tmp_path / name)), torch.from_numpy(tone(300, 0.2, 16000)))


def test_unusable_audio_raises_audio_error_naming_file_and_reason(tmp_path):
    (tmp_path / "corrupt.flac").write_bytes(b"this is not audio" * 100)
    soundfile.write(tmp_path / "empty.wav", np.zeros(0, np.float32), 16000)
    (tmp_path / "zero-bytes.flac").touch()  # a download or copy that wrote nothing: it was "Format not recognised."
    soundfile.write(tmp_path / "nan.wav", np.array([0.1, np.nan, 0.2] * 100, np.float32), 16000, subtype="FLOAT")
    soundfile.write(tmp_path / "inf.wav", np.array([0.1, -np.inf, 0.2] * 100, np.float32), 16000, subtype="FLOAT")
    soundfile.write(tmp_path / "slow.wav", tone(100, 0.2, 999), 999)
    # Headers that lie are refused before anything is decoded: this FLAC would take 256 GiB.
    soundfile.write(tmp_path / "a.flac", tone(300, 0.2, 16000), 16000)
    flac = bytearray((tmp_path / "a.flac").read_bytes())
    flac[21] |= 0x0F  # STREAMINFO's 36-bit sample count, all ones: 2^36 - 1 samples, 50 days at 16 kHz
    flac[22:26] = b"\xff\xff\xff\xff"
    (tmp_path / "huge.flac").write_bytes(bytes(flac))
    soundfile.write(tmp_path / "a.wav", tone(300, 0.2, 16000), 16000)
    wav = bytearray((tmp_path / "a.wav").read_bytes())
    wav[24:28] = struct.pack("<I", 1_000_003)  # the fmt chunk's sample rate
    (tmp_path / "megahertz.wav").write_bytes(bytes(wav))
    wav[22:24] = struct.pack("<H", 1024)  # the fmt chunk's channels: each decoded before they are averaged
    wav[24:28] = struct.pack("<I", 16000)
    (tmp_path / "channels.wav").write_bytes(bytes(wav))
    (tmp_path / "headerless.raw").write_bytes(b"\x00\x01" * 4000)  # RAW: soundfile wants a rate and raises TypeError
    (tmp_path / "folder.wav").mkdir()
    os.mkfifo(tmp_path / "pipe.wav")  # transcribe's /dev/stdin under `cat a.wav |`, or <(...): it said no such file
    (tmp_path / "device.wav").symlink_to("/dev/zero")
    reasons = {
        "nan.wav": "audio holds NaN or infinite samples",
        "inf.wav": "audio holds NaN or infinite samples",
        "slow.wav": "its header gives a sample rate of 999 Hz, outside 1000-384000 Hz",
        "corrupt.flac": r"cannot read audio \(Format not recognised\.\)$",  # libsndfile's reason, not its own line
        "empty.wav": "audio holds no samples",
        "zero-bytes.flac": r"an empty file \(0 bytes\), not audio$",
        "missing.wav": "no such audio file",
        "a.wav/missing.wav": "no such audio file",  # a file where the path has a folder: Not a directory
        "folder.wav": "a folder, not an audio file",
        "pipe.wav": r"not a file \(a pipe, <\(...\), a device\); save the audio to one and name that",
        "device.wav": "not a file",
        "huge.flac": "its header gives 4294967 s of audio, more than the 3600 s a file may hold",
        "megahertz.wav": "its header gives a sample rate of 1000003 Hz, outside 1000-384000 Hz",
        "headerless.raw": "cannot read audio",
        "channels.wav": "its header gives 1024 channels, outside 1-16",
    }
    # A writer that comes and goes: a pipe handed to libsndfile then gives "cannot read audio", where it waited for
    # a writer forever and hung the test instead of failing it. Opened for reading at the end until the writer is gone
    # (the writer waits for a reader to open it after its own open began).
    writer = threading.Thread(target=lambda: os.close(os.open(tmp_path / "pipe.wav", os.O_WRONLY)), daemon=True)
    writer.start()
    try:
        for name, reason in reasons.items():
            with pytest.raises(AudioError, match=f"{name}: {reason}"):
                load_audio(tmp_path / name)
    finally:
        while writer.is_alive():
            os.close(os.open(tmp_path / "pipe.wav", os.O_RDONLY | os.O_NONBLOCK))
            writer.join(0.1)
    assert issubclass(AudioError, ValueError)


def test_audio_that_cannot_be_opened_is_said_so_with_the_reason(tmp_path):
    # libsndfile says "System error" for a file it may not open, and a name past the file system's 255 bytes was
    # "no such audio file".
    too_long = tmp_path / ("x" * 300 + ".wav")
    with pytest.raises(AudioError, match=f"^{re.escape(str(too_long))}: cannot read audio \\(File name too long\\)$"):
        load_audio(too_long)
    # Its name quoted in escapes, as every other reason's is: raw, an ESC in it wrote to the terminal.
    with pytest.raises(AudioError, match=f"^{re.escape(str(tmp_path))}/\\\\x1b\\[2Jx+\\.wav: cannot read audio "):
        load_audio(tmp_path / ("\x1b[2J" + "x" * 300 + ".wav"))
    locked = tmp_path / "locked.wav"
    soundfile.write(locked, tone(300, 0.1, 16000), 16000)
    locked.chmod(0)
    assert (error_without_root_privilege("data.audio.load_audio", "data.audio.AudioError", locked)
            == f"{locked}: cannot read audio (Permission denied)")


def test_audio_at_the_ends_of_the_header_limits_is_taken(tmp_path):
    # The limits refuse what lies beyond them only: the slowest and fastest rates, the most channels, an hour.
    soundfile.write(tmp_path / "slowest.wav", tone(100, 0.1, 1000), 1000)
    soundfile.write(tmp_path / "fastest.wav", tone(1000, 0.1, 384_000), 384_000)
    soundfile.write(tmp_path / "array.wav", np.tile(tone(300, 0.1, 16000)[:, None], (1, 16)), 16000)
    for name in ("slowest.wav", "fastest.wav", "array.wav"):  # 0.1 s each
        assert load_audio(tmp_path / name, sample_rate=16000).shape == (1600,)
    soundfile.write(tmp_path / "hour.wav", np.zeros(3600 * 1000, np.int16), 1000)
    assert audio_header(tmp_path / "hour.wav").frames == 3600 * 1000
    soundfile.write(tmp_path / "longer.wav", np.zeros(3601 * 1000, np.int16), 1000)
    with pytest.raises(AudioError, match="longer.wav: its header gives 3601 s of audio, more than the 3600 s"):
        audio_header(tmp_path / "longer.wav")


@pytest.mark.parametrize("channels", [1, 2, 5, 8])  # FLAC's most
@pytest.mark.parametrize("name,audio_format,subtype", [("a.wav", "WAV", "PCM_16"), ("a.wav", "WAV", "FLOAT"),
                                                       ("a.flac", "FLAC", "PCM_24"), ("a.sph", "NIST", "PCM_16"),
                                                       ("a.ogg", "OGG", "VORBIS")])
def test_audio_decoded_a_block_at_a_time_is_what_decoding_it_whole_gives(tmp_path, monkeypatch, channels, name,
                                                                         audio_format, subtype):
    monkeypatch.setattr("data.audio.BLOCK_FRAMES", 1000)  # 3.3 blocks
    samples = np.random.default_rng(channels).uniform(-0.5, 0.5, (3300, channels)).astype(np.float32)
    soundfile.write(tmp_path / name, samples, 16000, format=audio_format, subtype=subtype)
    whole = torch.from_numpy(soundfile.read(tmp_path / name, dtype="float32", always_2d=True)[0]).mean(dim=1)
    assert torch.equal(load_audio(tmp_path / name, sample_rate=16000), whole)


def test_channels_are_averaged_without_decoding_them_all_at_once(tmp_path, monkeypatch):
    # An hour of 16 channels at 384 kHz, which the header limits let through, took 88 GB decoded whole (as float32)
    # before its mean; the blocks' channels take what the mono waveform does at most. Tracing sees soundfile's arrays.
    monkeypatch.setattr("data.audio.BLOCK_FRAMES", 4096)
    soundfile.write(tmp_path / "array.wav", np.tile(tone(300, 10, 16000)[:, None], (1, MAX_CHANNELS)), 16000)
    tracemalloc.start()
    try:
        waveform = load_audio(tmp_path / "array.wav", sample_rate=16000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < waveform.nbytes
    whole = torch.from_numpy(soundfile.read(tmp_path / "array.wav", dtype="float32", always_2d=True)[0]).mean(dim=1)
    assert torch.equal(waveform, whole)


def test_audio_is_checked_for_non_finite_samples_a_block_at_a_time(tmp_path, monkeypatch):
    # torch.isfinite of a whole waveform takes 1.6 times its size: 1.1 GB more for an hour at 48 kHz.
    monkeypatch.setattr("data.audio.BLOCK_FRAMES", 4096)
    checked = []
    isfinite = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda samples: checked.append(samples.numel()) or isfinite(samples))
    soundfile.write(tmp_path / "a.wav", tone(440, 1, 16000), 16000, subtype="FLOAT")
    samples = tone(440, 1, 16000)
    samples[-1] = np.inf
    soundfile.write(tmp_path / "inf.wav", samples, 16000, subtype="FLOAT")
    assert load_audio(tmp_path / "a.wav", sample_rate=16000).shape == (16000,)
    with pytest.raises(AudioError, match="inf.wav: audio holds NaN or infinite samples"):
        load_audio(tmp_path / "inf.wav", sample_rate=16000)
    assert len(checked) > 2 and max(checked) <= 4096


@pytest.fixture
def rates(monkeypatch) -> list[tuple[int, int]]:
    """The (from, to) rates of each resampling while the test runs."""
    rates = []
    resampler = torchaudio.transforms.Resample
    monkeypatch.setattr(torchaudio.transforms, "Resample",
                        lambda orig, new, **options: rates.append((orig, new)) or resampler(orig, new, **options))
    return rates


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000, 100_100])
def test_audio_resampled_a_block_at_a_time_is_what_resampling_it_whole_gives(tmp_path, monkeypatch, rate):
    monkeypatch.setattr("data.audio.BLOCK_FRAMES", 1000)
    samples = np.random.default_rng(rate).uniform(-0.5, 0.5, 7777).astype(np.float32)
    soundfile.write(tmp_path / "a.wav", samples, rate, subtype="FLOAT")
    whole = torchaudio.functional.resample(torch.from_numpy(samples), rate, 16000)
    torch.testing.assert_close(load_audio(tmp_path / "a.wav", sample_rate=16000), whole, atol=1e-6, rtol=0)


# (from, to): 1:2 and 3:1 in lowest terms take a filter margin wider than the smallest blocks; 441:160 a run of input
# samples wider than them; 16000 -> 16000 no filter at all.
@pytest.mark.parametrize("from_rate, to_rate", [(8000, 16000), (48000, 16000), (44100, 16000), (100_100, 16000),
                                                (16000, 8000), (16000, 16000)])
def test_a_waveform_of_any_length_in_blocks_of_any_sizes_is_resampled_as_it_would_be_whole(monkeypatch, from_rate,
                                                                                           to_rate):
    # The blocks' ends are where a window's margin, the last block and the file's end meet: a waveform shorter than a
    # block, exactly one, one sample either side of a block's end, decoded blocks of uneven sizes, and a header that
    # claims more frames than the blocks bring.
    rng = np.random.default_rng(from_rate + to_rate)
    for block_frames in (1, 2, 5, 64, 441, 1000):
        monkeypatch.setattr("data.audio.BLOCK_FRAMES", block_frames)
        step = from_rate // math.gcd(from_rate, to_rate)
        block = math.ceil(block_frames / step) * step
        for length in {1, 2, block - 1, block, block + 1, 2 * block, *rng.integers(1, 8 * block, 3)} - {0}:
            waveform = torch.from_numpy(rng.uniform(-0.5, 0.5, length).astype(np.float32))
            cuts = np.sort(rng.choice(np.arange(1, length), min(length - 1, rng.integers(0, 6)), replace=False))
            blocks = torch.tensor_split(waveform, cuts.tolist())
            whole = waveform if from_rate == to_rate else torchaudio.functional.resample(waveform, from_rate, to_rate)
            for frames in (length, length + int(rng.integers(1, 4 * block))):
                resampled = _resample(iter(blocks), from_rate, to_rate, frames)
                torch.testing.assert_close(resampled, whole, atol=1e-6, rtol=0,
                                           msg=lambda message: f"{block_frames=} {length=} {frames=}: {message}")


def test_audio_is_resampled_a_block_at_a_time(tmp_path, monkeypatch):
    # torchaudio's convolution over a whole waveform takes some seven times its size besides: 38 GB for an hour at
    # 384 kHz, on top of the 5.5 GB waveform.
    monkeypatch.setattr("data.audio.BLOCK_FRAMES", 4096)
    convolved = []
    conv1d = torch.nn.functional.conv1d
    monkeypatch.setattr(torch.nn.functional, "conv1d",
                        lambda waveform, *args, **kwargs: convolved.append(waveform.shape[-1]) or
                        conv1d(waveform, *args, **kwargs))
    soundfile.write(tmp_path / "a.wav", tone(440, 10, 48000), 48000, subtype="FLOAT")
    assert load_audio(tmp_path / "a.wav", sample_rate=16000).shape == (160_000,)
    assert len(convolved) > 1 and max(convolved) < 2 * 4096


def test_audio_whose_header_claims_more_frames_than_it_holds_holds_only_what_it_holds(tmp_path):
    # The waveform was a view of an allocation sized from the header: 6.4 MB held for 64 KB of samples here. An Ogg's
    # frame count is its last page's granule position (the last sample decoded), which libsndfile takes as it is here
    # (for a 1 s tone, which Vorbis put in a single audio page, it gave the length decoded instead).
    samples = np.random.default_rng(0).uniform(-0.5, 0.5, 16000).astype(np.float32)
    soundfile.write(tmp_path / "a.ogg", samples, 16000, format="OGG", subtype="VORBIS")
    ogg = bytearray((tmp_path / "a.ogg").read_bytes())
    last_page = ogg.rindex(b"OggS")
    struct.pack_into("<q", ogg, last_page + 6, 100 * 16000)  # its granule position: 100 s
    struct.pack_into("<I", ogg, last_page + 22, 0)  # its CRC, taken with the field as 0
    struct.pack_into("<I", ogg, last_page + 22, ogg_page_crc(ogg[last_page:]))
    (tmp_path / "overstated.ogg").write_bytes(bytes(ogg))
    assert audio_header(tmp_path / "overstated.ogg").frames == 100 * 16000
    waveform = load_audio(tmp_path / "overstated.ogg", sample_rate=16000)
    assert 16000 <= len(waveform) < 17000  # Vorbis decodes the last packet whole, past the 1 s written
    torch.testing.assert_close(waveform[:16000], load_audio(tmp_path / "a.ogg", sample_rate=16000))
    held = waveform.untyped_storage().nbytes()
    assert held == len(waveform) * 4, held


def test_audio_whose_header_claims_frames_but_holds_none_is_refused(tmp_path):
    # An Ogg whose one audio page is cut to its header, a granule position of 1 s and no packet: the header's frame
    # count passes its checks, and nothing is decoded.
    soundfile.write(tmp_path / "a.ogg", tone(440, 1, 16000), 16000, format="OGG", subtype="VORBIS")
    ogg = (tmp_path / "a.ogg").read_bytes()
    last_page = ogg.rindex(b"OggS")
    page = bytearray(ogg[last_page:last_page + 27])  # the page's header up to its count of segments
    page[26] = 0  # no segments, so no packet
    struct.pack_into("<I", page, 22, 0)
    struct.pack_into("<I", page, 22, ogg_page_crc(page))
    (tmp_path / "hollow.ogg").write_bytes(ogg[:last_page] + page)
    assert audio_header(tmp_path / "hollow.ogg").frames == 16000
    with pytest.raises(AudioError, match="hollow.ogg: audio holds no samples$"):
        load_audio(tmp_path / "hollow.ogg")


def test_audio_is_decoded_no_further_than_the_frames_of_the_header_given(tmp_path, monkeypatch):
    # The dataset reads a file's header (for max_duration) and passes it to load_audio: a file written again, longer,
    # in between gave more samples than the waveform had room for, and torch's error rather than an AudioError.
    monkeypatch.setattr("data.audio.BLOCK_FRAMES", 1000)
    samples = np.random.default_rng(0).uniform(-0.5, 0.5, 4000).astype(np.float32)
    soundfile.write(tmp_path / "a.wav", samples[:3300], 16000, subtype="FLOAT")
    header = audio_header(tmp_path / "a.wav")
    soundfile.write(tmp_path / "a.wav", samples, 16000, subtype="FLOAT")
    assert torch.equal(load_audio(tmp_path / "a.wav", 16000, header), torch.from_numpy(samples[:3300]))


def ogg_page_crc(page: bytes) -> int:
    """The CRC an Ogg page holds: CRC-32 of polynomial 0x04C11DB7 not bit-reversed, from 0 (not zlib's crc32)."""
    crc = 0
    for byte in page:
        crc ^= byte << 24
        for _ in range(8):
            crc = (crc << 1 ^ 0x04C11DB7 if crc & 0x80000000 else crc << 1) & 0xFFFFFFFF
    return crc


def test_audio_is_resampled_as_it_is_decoded_without_holding_it_whole_at_its_own_rate(tmp_path):
    # Held whole before it was resampled: 5.5 GB for an hour at 384 kHz, where the resampled waveform takes 0.23 GB.
    # Measured in a process of its own (tracing does not see torch's allocations), as how far its peak resident memory
    # (VmHWM: ru_maxrss would keep pytest's from before the exec) rises over what it holds after a first file has
    # loaded what any file needs.
    soundfile.write(tmp_path / "first.wav", tone(440, 1, 384_000), 384_000)
    soundfile.write(tmp_path / "long.wav", tone(440, 30, 384_000), 384_000)  # 46 MB as float32
    script = (
        "import re, sys\n"
        "from data.audio import load_audio\n"
        "def kib(name): return int(re.search(name + r':\\s+(\\d+) kB', open('/proc/self/status').read())[1])\n"
        "load_audio(sys.argv[1], 16000)\n"
        "resident = kib('VmRSS')\n"
        "waveform = load_audio(sys.argv[2], 16000)\n"
        "print(len(waveform), (kib('VmHWM') - resident) * 1024)\n"
    )
    result = subprocess.run([sys.executable, "-c", script, tmp_path / "first.wav", tmp_path / "long.wav"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    samples, growth = map(int, result.stdout.split())
    assert samples == 30 * 16000 and growth < 30 * 384_000 * 4 / 4, growth  # a quarter of it at its own rate


def test_an_odd_sample_rate_is_resampled_as_the_nearest_100_hz(tmp_path, rates):
    # 16001 Hz in lowest terms against 16000 would need a filter of 256 million taps: 4 GB, whatever the clip's length.
    soundfile.write(tmp_path / "odd.wav", tone(440, 0.25, 16001), 16001, subtype="FLOAT")
    soundfile.write(tmp_path / "cd.wav", tone(440, 0.25, 44100), 44100, subtype="FLOAT")
    odd, cd = (load_audio(tmp_path / name, sample_rate=16000) for name in ("odd.wav", "cd.wav"))
    # 16001 Hz is taken as the model's 16000 Hz, which needs no filter; 44100 / 16000 is 441 / 160 in lowest terms:
    # resampled from 44100 Hz itself.
    assert rates == [(44100, 16000)]
    assert abs(len(odd) - 4000) <= 1 and len(cd) == 4000
    assert int(torch.fft.rfft(odd[:4000]).abs().argmax()) == int(torch.fft.rfft(cd).abs().argmax()) == 110  # 4 Hz bins
    # Where the model's own rate is the odd one, no file's rounding helps: each is refused, naming both rates.
    with pytest.raises(AudioError, match="cd.wav: resampling 44100 Hz to the model's 16001 Hz would take a filter of "
                                         "706188134 taps, more than 2000000: give the model a rate such as 16000 Hz, "
                                         "which takes audio at any rate$"):
        load_audio(tmp_path / "cd.wav", sample_rate=16001)
    assert rates == [(44100, 16000)]


def test_a_model_rate_no_file_can_be_resampled_to_is_refused_before_the_file_is_decoded(tmp_path):
    # It was refused only after the file was decoded whole, every file of every epoch. A FLAC with a sound header
    # over a corrupt body tells which came first: decoding it fails.
    soundfile.write(tmp_path / "a.flac", tone(440, 0.25, 44100), 44100)
    flac = bytearray((tmp_path / "a.flac").read_bytes())
    flac[200:] = b"\xaa" * (len(flac) - 200)  # past STREAMINFO (42 bytes) and the encoder's comment
    (tmp_path / "corrupt.flac").write_bytes(bytes(flac))
    assert audio_header(tmp_path / "corrupt.flac").frames == 11025
    with pytest.raises(AudioError, match="corrupt.flac: cannot read audio"):
        load_audio(tmp_path / "corrupt.flac", sample_rate=16000)
    with pytest.raises(AudioError, match="corrupt.flac: resampling 44100 Hz to the model's 16001 Hz would take"):
        load_audio(tmp_path / "corrupt.flac", sample_rate=16001)


def test_a_fast_rate_of_few_lowest_terms_is_resampled_exactly(tmp_path, rates):
    # 100100 / 16000 is 1001 / 160 in lowest terms: 160 phases of 1077 taps, as cheap as 44.1 kHz. It was refused, as
    # was every multiple of 100 Hz above 100 kHz sharing only 100 with 16000, with a message that blamed the model's
    # rate for not being in whole hundreds of Hz.
    for rate in (100_100, 300_100):
        soundfile.write(tmp_path / f"{rate}.wav", tone(440, 0.25, rate), rate, subtype="FLOAT")
        waveform = load_audio(tmp_path / f"{rate}.wav", sample_rate=16000)
        assert len(waveform) == 4000 and int(torch.fft.rfft(waveform).abs().argmax()) == 110  # 4 Hz bins
    assert rates == [(100_100, 16000), (300_100, 16000)]
    # The rate the refusal names takes every file: each rate a file can be resampled as.
    assert all(_resampling_filter_taps(rate, RATE_THAT_TAKES_ANY_FILE) <= MAX_RESAMPLING_TAPS
               for rate in range(MIN_SAMPLE_RATE, MAX_SAMPLE_RATE + 1, 100))



@pytest.mark.parametrize("from_rate, to_rate", [(44100, 16000), (100_100, 16000), (8000, 16000), (11025, 16000),
                                                (16000, 44100)])
def test_the_filter_size_the_limit_counts_is_torchaudios(from_rate, to_rate):
    # What MAX_RESAMPLING_TAPS limits: up from a lower rate too, where the filter's width follows the file's step.
    kernel = torchaudio.transforms.Resample(from_rate, to_rate).kernel
    assert _resampling_filter_taps(from_rate, to_rate) == kernel.numel()


def test_a_filter_of_the_most_taps_is_taken_and_an_odd_rate_rounds_to_the_nearest_100_hz(tmp_path, monkeypatch,
                                                                                       rates):
    monkeypatch.setattr("data.audio.MAX_RESAMPLING_TAPS", _resampling_filter_taps(22050, 16000))
    soundfile.write(tmp_path / "22050.wav", tone(440, 0.25, 22050), 22050, subtype="FLOAT")
    soundfile.write(tmp_path / "44099.wav", tone(440, 0.25, 44099), 44099, subtype="FLOAT")  # above 44050: up
    for name in ("22050.wav", "44099.wav"):
        load_audio(tmp_path / name, sample_rate=16000)
    assert rates == [(22050, 16000), (44100, 16000)]
    # and a rate rounded to whose filter takes the most taps: 44099 Hz as 44100 Hz
    monkeypatch.setattr("data.audio.MAX_RESAMPLING_TAPS", _resampling_filter_taps(44100, 16000))
    load_audio(tmp_path / "44099.wav", sample_rate=16000)
    assert rates == [(22050, 16000), (44100, 16000), (44100, 16000)]

def test_spectrogram_has_161_bins_100_frames_a_second_and_finds_the_tone():
    extractor = FeatureExtractor("spectrogram", normalize=False)
    features = extractor(torch.from_numpy(tone(1000, 1.0, 16000)))
    assert extractor.num_features == 161
    assert features.shape == (101, 161) == (extractor.num_frames(16000), 161)
    assert features.dtype == torch.float32 and bool((features >= 0).all())  # log(1 + magnitude)
    assert int(features[50].argmax()) == 20  # 1000 Hz / 50 Hz per bin


def test_spectrogram_is_log1p_of_a_hamming_windowed_stft_of_the_zero_padded_signal():
    x = torch.randn(4000, generator=torch.Generator().manual_seed(0))
    padded = torch.nn.functional.pad(x, (160, 160))
    spectrum = torch.stft(padded, 320, 160, window=torch.hamming_window(320), center=False, return_complex=True)
    expected = spectrum.abs().log1p().T
    torch.testing.assert_close(FeatureExtractor("spectrogram", normalize=False)(x), expected, rtol=1e-5, atol=1e-5)


def test_window_and_hop_are_their_lengths_in_samples_rounded_to_the_nearest():
    """Truncated, a window a hair under 20 ms was 319 samples (160 bins), the hop 159: every test passed."""
    extractor = FeatureExtractor("spectrogram", window_ms=19.99, hop_ms=9.99)
    assert (extractor.n_fft, extractor.hop_length, extractor.num_features) == (320, 160, 161)


def test_mel_features_are_the_log_mel_power_of_a_hamming_windowed_stft_of_the_zero_padded_signal():
    """Only the spectrogram's window was checked: a Hann window for the mel features passed every test."""
    x = torch.randn(4000, generator=torch.Generator().manual_seed(0))
    padded = torch.nn.functional.pad(x, (256, 256))  # centred frames of a 512-point FFT, zeros at the ends
    window = torch.nn.functional.pad(torch.hamming_window(320), (96, 96))  # 320 samples, centred in the FFT
    power = torch.stft(padded, 512, 160, window=window, center=False, return_complex=True).abs().pow(2)
    filters = torchaudio.functional.melscale_fbanks(257, 0.0, 8000.0, 40, 16000)  # (bins, bands)
    expected = (filters.T @ power).clamp(min=1e-10).log().T
    torch.testing.assert_close(FeatureExtractor("mel", n_mels=40, normalize=False)(x), expected, rtol=1e-4, atol=1e-4)


def test_mel_features():
    extractor = FeatureExtractor("mel", n_mels=64, normalize=False)
    loud = torch.from_numpy(tone(1000, 0.5, 16000))
    features = extractor(loud)
    assert extractor.num_features == 64 and features.shape == (51, 64)
    assert torch.isfinite(features).all()
    # Log power: half the amplitude is a quarter of the power, ln 4 less in the tone's band.
    band = features[25].argmax()
    assert features[25, band] - extractor(loud / 2)[25, band] == pytest.approx(math.log(4), abs=1e-3)
    # Digital silence sits on the floor, finite.
    assert torch.equal(extractor(torch.zeros(800)), torch.full((6, 64), math.log(1e-10)))


@pytest.mark.parametrize("kind", ["spectrogram", "mel"])
def test_normalised_features_have_zero_mean_unit_std_per_feature(kind):
    noise = 0.01 * torch.randn(16000, generator=torch.Generator().manual_seed(0))
    waveform = torch.from_numpy(tone(700, 1.0, 16000)) + noise
    features = FeatureExtractor(kind)(waveform)
    torch.testing.assert_close(features.mean(dim=0), torch.zeros(features.shape[1]), atol=1e-4, rtol=0)
    torch.testing.assert_close(features.std(dim=0, correction=0), torch.ones(features.shape[1]), atol=1e-3, rtol=0)


@pytest.mark.parametrize("settings, complaint", [
    (dict(kind="mel", n_mels=0), "n_mels=0 must be a positive integer"),
    (dict(kind="mel", n_mels=2.5), "n_mels=2.5 must be a positive integer"),
    (dict(kind="mel", n_mels=True), "n_mels=True must be a positive integer"),  # an int to isinstance
    # 128 bands over a 512-point FFT leave the lowest between two bins; more bands than bins leave many.
    (dict(kind="mel", n_mels=128), "n_mels=128 at 16000 Hz and window_ms=20 (an FFT of 512 points) gives mel bands "
                                   "that hold no FFT bin, features that never change: at most 114 bands work there"),
    (dict(kind="mel", n_mels=300), "n_mels=300 at 16000 Hz and window_ms=20 (an FFT of 512 points) gives mel bands "
                                   "that hold no FFT bin, features that never change: at most 114 bands work there"),
    # Refused by the count of bins before any filter is made: a bank of 10**12 bands would take terabytes.
    (dict(kind="mel", n_mels=10**12), "n_mels=1000000000000 at 16000 Hz and window_ms=20 (an FFT of 512 points) gives "
                                      "mel bands that hold no FFT bin"),
    (dict(kind="mel", n_mels=100, sample_rate=8000), "n_mels=100 at 8000 Hz and window_ms=20 (an FFT of 256 points) "
                                                     "gives mel bands that hold no FFT bin, features that never "
                                                     "change: at most 86 bands work there"),
    # A window of a power of two samples (256 at 16 ms) is its own FFT's length: with the next power of two above it
    # (512) these 80 bands were taken, and the test passed.
    (dict(kind="mel", window_ms=16), "n_mels=80 at 16000 Hz and window_ms=16 (an FFT of 256 points) gives mel bands "
                                     "that hold no FFT bin, features that never change: at most 57 bands work there"),
    (dict(hop_ms=30), "hop_ms=30 is longer than window_ms=20"),
    # A window of one sample (0.8 rounded) has no spectrum to speak of: with only an empty window refused, the test
    # passed.
    (dict(window_ms=0.05), "window_ms=0.05 is too short at 16000 Hz: 1 sample, and a window takes at least 2"),
    # Each named alone: the line named both whichever was short, and a user shortened the one that was not.
    (dict(hop_ms=0.01), "hop_ms=0.01 is too short at 16000 Hz: 0 samples, and a hop takes at least 1"),
    (dict(sample_rate=-16000), "sample_rate=-16000 must be an integer number of Hz from 1000 to 384000, window_ms=20 "
                               "and hop_ms=10 numbers of milliseconds in (0, 1000]"),
    (dict(sample_rate=16000.0), "sample_rate=16000.0 must be an integer"),  # resampling takes whole Hz
    # A checkpoint's stored settings are not the trainer's checked config: these windows took 64 GB and 22 GB.
    (dict(sample_rate=10**9, window_ms=1000), "sample_rate=1000000000 must be an integer number of Hz from 1000"),
    (dict(kind="mel", window_ms=1e7, hop_ms=10), "window_ms=10000000.0 and hop_ms=10 numbers of milliseconds in "
                                                 "(0, 1000]"),
    (dict(window_ms="20"), "window_ms='20'"),
    (dict(hop_ms=True), "hop_ms=True numbers of milliseconds"),  # not a hop of 1 ms
])
def test_feature_settings_that_cannot_work_are_refused_by_name(settings, complaint):
    with pytest.raises(ValueError, match=re.escape(complaint)):
        FeatureExtractor(**settings)


@pytest.mark.parametrize("settings", [
    dict(window_ms=20, hop_ms=20), dict(window_ms=MAX_WINDOW_MS, hop_ms=MAX_WINDOW_MS),
    dict(sample_rate=MIN_SAMPLE_RATE), dict(sample_rate=MAX_SAMPLE_RATE, kind="mel"), dict(kind="mel", n_mels=1),
])
def test_feature_settings_at_the_ends_of_their_ranges_are_taken(settings):
    """Only settings past the ends were tried: a hop as long as the window, a window of MAX_WINDOW_MS, the lowest
    rate or a single mel band refused passed every test."""
    extractor = FeatureExtractor(**settings)
    assert extractor(torch.zeros(4000)).shape == (extractor.num_frames(4000), extractor.num_features)


@pytest.mark.parametrize("sample_rate, most", [(16000, 114), (8000, 86)])
def test_the_most_mel_bands_named_give_features_that_all_change(sample_rate, most):
    noise = torch.randn(sample_rate, generator=torch.Generator().manual_seed(0))
    features = FeatureExtractor("mel", sample_rate=sample_rate, n_mels=most, normalize=False)(noise)
    assert (features.std(dim=0) > 0).all()  # no band without a bin, whose feature sits on the floor throughout


@pytest.mark.parametrize("settings", [dict(), dict(sample_rate=22050), dict(kind="mel", sample_rate=22050)])
def test_num_frames_counts_the_frames_the_features_have(settings):
    """An odd window (441 samples at 22050 Hz) pads by one sample less than it is long."""
    extractor = FeatureExtractor(**settings)
    for num_samples in range(1, 1200, 7):
        features = extractor(torch.zeros(num_samples))
        assert features.shape[0] == extractor.num_frames(num_samples) and torch.isfinite(features).all(), num_samples


def test_unknown_feature_kind_is_a_value_error():
    with pytest.raises(ValueError, match="'mfcc'"):
        FeatureExtractor("mfcc")


def test_spec_augment_zeroes_whole_bands_and_spans_and_repeats_under_a_seed():
    features = torch.ones(300, 161)  # (T, F)
    augment = SpecAugment(freq_mask=15, time_mask=35)
    torch.manual_seed(3)
    first = augment(features)
    torch.manual_seed(3)
    assert torch.equal(augment(features), first)
    assert not torch.equal(augment(features), first)  # the generator moved on
    zero = first == 0
    masked_features, masked_frames = zero.all(dim=0), zero.all(dim=1)
    assert 0 < int(masked_features.sum()) <= 2 * 14 and 0 < int(masked_frames.sum()) <= 2 * 34
    # Every zero lies in a masked band or span: nothing else is touched.
    assert torch.equal(zero, masked_features[None, :] | masked_frames[:, None])
    assert features.eq(1).all()  # the input is left alone


def test_spec_augment_time_masks_respect_max_time_fraction():
    augment = SpecAugment(num_freq_masks=0, time_mask=35, max_time_fraction=0.1)
    torch.manual_seed(0)
    masked = []
    for _ in range(20):
        masked.append(int((augment(torch.ones(100, 8)) == 0).all(dim=1).sum()))
    assert max(masked) <= 2 * 10 and sum(masked) > 0, masked


@pytest.mark.parametrize("kind", ["spectrogram", "mel"])
def test_audio_shorter_than_half_a_window_gives_one_frame(kind):
    extractor = FeatureExtractor(kind)
    features = extractor(torch.from_numpy(tone(440, 0.003, 16000)))  # 48 samples
    assert features.shape == (1, extractor.num_features) and torch.isfinite(features).all()


def test_features_are_float32_whatever_the_waveforms_dtype():
    # Without the conversion a float64 waveform (numpy's default) gave float64 features, which a float32 model does
    # not take, and int16 PCM none.
    for dtype in (torch.float64, torch.int16):
        assert FeatureExtractor()(torch.ones(4000, dtype=dtype)).dtype == torch.float32, dtype


def test_spec_augment_with_no_masks_of_either_kind_leaves_the_features_as_they_are():
    # data.augment.masks takes 0 of each kind: a time mask drawn where none was asked for passed.
    features = torch.ones(300, 161)
    torch.manual_seed(0)
    augment = SpecAugment(freq_mask=30, time_mask=100, num_freq_masks=0, num_time_masks=0)
    assert torch.equal(augment(features), features)


def test_spec_augment_masks_are_narrower_than_their_settings():
    # torchaudio draws a mask's width from [0, freq_mask) and floors it: freq_mask=15 zeros 0 to 14 features, each
    # width as likely, and freq_mask=1 never masks; a time mask stays under max_time_fraction of the frames too.
    fresh_seed = torch.Generator().seed()
    generator = torch.Generator().manual_seed(fresh_seed)

    def widths(augment, frames, axis):
        found = set()
        for _ in range(400):
            torch.manual_seed(int(torch.randint(2**31, (), generator=generator)))
            found.add(int((augment(torch.ones(frames, 40)) == 0).all(dim=axis).sum()))
        return found

    assert widths(SpecAugment(freq_mask=6, num_freq_masks=1, num_time_masks=0), 50, 0) == set(range(6)), fresh_seed
    assert widths(SpecAugment(freq_mask=1, num_freq_masks=1, num_time_masks=0), 50, 0) == {0}, fresh_seed
    fraction_limited = SpecAugment(num_freq_masks=0, time_mask=35, num_time_masks=1, max_time_fraction=0.1)
    assert widths(fraction_limited, 80, 1) == set(range(8)), fresh_seed  # int(0.1 * 80) = 8 frames, never reached
