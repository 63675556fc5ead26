"""A field of a file a benchmark reads (a run's metrics.jsonl or config.yaml, a benchmarks.scaling JSON), checked
against what its writer writes there: another value (a hand edit, a copy cut short) is refused in one line naming the
file, the field and what it must be, where it ended in a TypeError or KeyError traceback."""
import reprlib

from data.values import is_int, is_number, is_real


class DamagedFile(ValueError):
    """A file that is not as its writer writes it, in one line naming the file and what is wrong."""


def is_count(value) -> bool:
    return is_int(value) and value >= 0


# What a field may hold, by the words a refusal says it in. A COUNT is 1 or more: a world size or a batch of 0 divided
# by zero, and one below it was projected from a step of no utterances.
COUNT = "a whole number of at least 1"
# A time or a rate a measure took: a 0 divided by zero, and a NaN (which Python's reader takes) was printed and written
# as it stood.
POSITIVE = "a positive finite number"
KINDS = {
    "a number": is_real,
    "a finite number": is_number,
    POSITIVE: lambda value: is_number(value) and value > 0,
    "a count": is_count,
    COUNT: lambda value: is_count(value) and value >= 1,
    "true or false": lambda value: isinstance(value, bool),
    "a string": lambda value: isinstance(value, str),
    "an object": lambda value: isinstance(value, dict),
    "a list": lambda value: isinstance(value, list),
}


# How a refusal quotes the value it found: six entries of a list or object, two levels deep, and the start of a long
# string. A YAML file's aliases nest one list in the next many times over: 561 bytes of config.yaml held 10^8 strings,
# whose whole repr ran out of memory.
_QUOTED = reprlib.Repr()
_QUOTED.maxlevel, _QUOTED.maxstring, _QUOTED.maxother = 2, 80, 80


def field(path, data, *keys: str | int, kind: str, or_null: bool = False, within: str = ""):
    """The value at `keys` (into objects and lists) of `data`, read from `path`, which must be `kind`, one of KINDS,
    or with `or_null` null or missing (None); else DamagedFile naming the file and the field, after `within` (the part
    of the file `data` is)."""
    value = data
    for depth, key in enumerate(keys):
        container = "a list" if isinstance(key, int) else "an object"
        if not KINDS[container](value):
            raise DamagedFile(f"{path}: {within}{field_name(keys[:depth])} must be {container}, got "
                              f"{_QUOTED.repr(value)}")
        if key not in (range(len(value)) if isinstance(key, int) else value):
            if or_null:
                return None
            raise DamagedFile(f"{path} lacks {within}{field_name(keys)}, which must be {kind}")
        value = value[key]
    if or_null and value is None:
        return None
    if not KINDS[kind](value):
        # repr, not JSON: a YAML date (epochs: 2020-01-01) is no JSON value.
        raise DamagedFile(f"{path}: {within}{field_name(keys)} must be {kind}{' or null' * or_null}, got "
                          f"{_QUOTED.repr(value)}")
    return value


def field_name(keys: tuple) -> str:
    """("compute", 0, "median_ms") -> compute[0].median_ms"""
    return "".join(f"[{key}]" if isinstance(key, int) else f".{key}" for key in keys).removeprefix(".")
