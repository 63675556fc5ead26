"""Prints the transcript of each audio file: `python -m trainer.transcribe --checkpoint best.pt a.flac b.wav`
(greedy; `--beam` and `--lm` as for python -m trainer.evaluate)."""
import argparse
import sys

import torch

from data.audio import AudioError, load_audio
from trainer import build, decode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.transcribe", description=__doc__)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("audio", nargs="+",
                        help="audio files (.flac, .wav, .sph; resampled to the rate the model was trained at)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    decode.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
        model, features, _ = build.from_checkpoint(args.checkpoint, device)
        decoder = decode.from_arguments(args)
    # RuntimeError: a device torch does not know or cannot reach (--device cuda without a driver)
    except (FileNotFoundError, ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    failures = 0
    with torch.no_grad():
        for path in args.audio:
            try:
                feats = features(load_audio(path, features.sample_rate))
                if not torch.isfinite(feats).all():  # float samples past float32's range, as the dataset skips
                    raise AudioError(f"{path}: its features are not finite (samples out of range?)")
            except (AudioError, FileNotFoundError) as error:
                print(f"{path}\terror: {error}", file=sys.stderr)
                failures += 1
                continue
            log_probs, out_lengths = model(feats.unsqueeze(0).to(device), torch.tensor([feats.shape[0]], device=device))
            print(f"{path}\t{decoder(log_probs, out_lengths)[0]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
