"""Prints the transcript of each audio file: `python -m trainer.transcribe --checkpoint best.pt a.flac b.wav`
(greedy; `--beam` and `--lm` as for python -m trainer.evaluate). A file it cannot use is named on stderr with why, the
others transcribed, and the exit code is then 1; a checkpoint or decoder option it refuses, 2. A file of more than
five minutes is named on stderr, with its length, before it is transcribed; stdout holds the transcripts alone."""
if __name__ == "__main__":  # first: the imports below take seconds (torch), in which a signal printed a
    # traceback (Ctrl-C) or ended the tool without a word (SIGTERM)
    from data.cli import end_at_once_on_a_signal

    end_at_once_on_a_signal()

import argparse
import sys

import torch

from data.audio import AudioError, load_audio
from data.cli import input_path
from data.features import non_finite_detail
from data.manifest import print_paths_printable, printable
from trainer import decode
from trainer.cli import run_tool
from trainer.inference import MODEL_ERRORS, add_model_arguments, load_model

# A file longer than this is named on stderr before its transcription starts: the default model takes some 8 s a
# minute of audio on a CPU, and a half-hour recording kept the tool silent for 4 minutes.
ANNOUNCED_PAST_S = 300


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.transcribe", description=__doc__)
    add_model_arguments(parser)
    parser.add_argument("audio", nargs="+", type=input_path,
                        help="audio files (.flac, .wav, .sph; resampled to the rate the model was trained at)")
    args = parser.parse_args(argv)
    try:
        model, features, _, device = load_model(args)
        decoder = decode.from_arguments(args)
    except MODEL_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    failures = 0
    with torch.no_grad():
        for path in args.audio:
            try:
                waveform = load_audio(path, features.sample_rate)
                feats = features(waveform)
                if detail := non_finite_detail(feats, waveform):
                    raise AudioError(f"{printable(path)}: {detail}")
            except AudioError as error:  # NoSuchAudioFile too: load_audio raises it for a missing file
                print(f"{path}\terror: {str(error).removeprefix(f'{printable(path)}: ')}", file=sys.stderr, flush=True)
                failures += 1
                continue
            seconds = len(waveform) / features.sample_rate
            if seconds > ANNOUNCED_PAST_S:
                print(f"transcribing {path}: {seconds / 60:.0f} minutes of audio", file=sys.stderr, flush=True)
            log_probs, out_lengths = model(feats.unsqueeze(0).to(device), torch.tensor([feats.shape[0]], device=device))
            try:
                transcript = decoder(log_probs, out_lengths)[0]
            except ValueError as error:  # the model's output not finite (decode.check_finite), from finite features
                print(f"error: {args.checkpoint}: {error} (for {path})", file=sys.stderr)
                return 2
            # In order with the errors, which go to stderr; a reader that stops early or a full disk: run_tool.
            print(f"{path}\t{transcript}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    if sys.stdout is None:  # Python's for a stdout closed as the tool started: print() would drop every transcript
        print("error: stdout is closed (>&-): the transcripts would be lost", file=sys.stderr)
        sys.exit(2)
    # The paths printed name the files to find them by: one that is not UTF-8 (b"\xff.wav") as its own bytes, where
    # strict UTF-8 output (a locale such as en_US.UTF-8) would end the tool in a traceback.
    sys.stdout.reconfigure(errors="surrogateescape")
    print_paths_printable(sys.stderr)  # its messages, an unreadable file's line among them, as the other tools'
    sys.exit(run_tool(main))
