"""The options and loading shared by the tools that run a trained model (python -m trainer.evaluate, .transcribe):
a checkpoint, a device and a decoder."""
import argparse

import torch

from trainer import build, decode

# What loading a model may raise with a one-line message: a missing or foreign checkpoint, a bad decoder option, or
# (RuntimeError) a device torch does not know or cannot reach (--device cuda without a driver).
MODEL_ERRORS = (FileNotFoundError, ValueError, RuntimeError)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--checkpoint, --device and the decoder's options (trainer.decode)."""
    parser.add_argument("--checkpoint", required=True, help="a .pt file written by python -m trainer")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the model runs: cpu, cuda or cuda:N (default: cuda where a GPU is visible)")
    decode.add_arguments(parser)


def load_model(args: argparse.Namespace):
    """(model, features, config, decoder, device) as add_model_arguments' options say; raises one of MODEL_ERRORS."""
    device = torch.device(args.device)
    model, features, cfg = build.from_checkpoint(args.checkpoint, device)
    return model, features, cfg, decode.from_arguments(args), device
