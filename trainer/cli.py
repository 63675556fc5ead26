"""Argument types the trainer's command lines share: argparse refuses a bad value, naming its argument, before any
work starts."""
import argparse
import math
import os
from pathlib import Path


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text}")
    return value


def output_file(text: str) -> str:
    """A file to write, in a folder that exists and takes it: found out before the work whose result it would hold."""
    path = Path(text).absolute()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a folder; name a file in it")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"no folder {path.parent}")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{path} cannot be written (permissions)")
    return text
