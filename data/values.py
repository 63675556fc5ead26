"""What a value read from a file (a manifest's JSON, a config's YAML, a checkpoint, a benchmark's JSON) counts as.
JSON's and YAML's true and false arrive as Python's bool, an int subclass: neither is a number or a count here."""
import math


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value) -> bool:
    """An int or a float, NaN and infinities among them (Python's JSON reader takes them)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_number(value) -> bool:
    return is_real(value) and math.isfinite(value)
