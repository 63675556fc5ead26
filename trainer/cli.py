"""Argument types the trainer's command lines share: argparse refuses a bad value, naming its argument, before any
work starts."""
import argparse
from pathlib import Path


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def output_file(text: str) -> str:
    """A file to write, in a folder that exists: found out before the work whose result it would hold."""
    folder = Path(text).absolute().parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"no folder {folder}")
    return text
