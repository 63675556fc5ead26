"""The options and loading shared by the tools that run a trained model (python -m trainer.evaluate, .transcribe):
a checkpoint, a device and the decoder's options."""
import argparse

import torch

from data.cli import input_path
from data.text import counted
from trainer import build, decode

# What loading a model and its inputs may raise with a one-line message: a missing or foreign checkpoint, a bad decoder
# option, an input that cannot be read (OSError: no permission, a name too long; it names the file), or (RuntimeError)
# a GPU that cannot be reached.
MODEL_ERRORS = (OSError, ValueError, RuntimeError)


def device_argument(text: str) -> torch.device:
    """--device: cpu, or a CUDA GPU this machine has; argparse names the argument where it is neither."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: the model runs on cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no CUDA GPU is visible here")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {counted(torch.cuda.device_count(), 'CUDA GPU')}")
    return device


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--checkpoint, --device and the decoder's options (trainer.decode)."""
    parser.add_argument("--checkpoint", required=True, type=input_path, help="a .pt file written by python -m trainer")
    parser.add_argument("--device", type=device_argument, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the model runs: cpu, cuda or cuda:N (default: cuda where a GPU is visible)")
    decode.add_arguments(parser)


def load_model(args: argparse.Namespace):
    """(model, features, config, device) as add_model_arguments' options say, the decoder's checked before the
    checkpoint is read; raises one of MODEL_ERRORS. The decoder (decode.from_arguments) is the tool's to make after
    its other inputs are read: a language model can take minutes to read."""
    decode.check_arguments(args)
    device = args.device
    model, features, cfg = build.from_checkpoint(args.checkpoint, device)
    return model, features, cfg, device
