"""What a value read from a file (a manifest's JSON, a config's YAML, a checkpoint, a benchmark's JSON) counts as.
JSON's and YAML's true and false arrive as Python's bool, an int subclass: neither is a number or a count here. And
which lines of a run's JSON-lines records (metrics.jsonl, jobs.jsonl) count as records (json_objects)."""
import json
import math
from collections.abc import Iterator


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value) -> bool:
    """An int or a float, NaN and infinities among them (Python's JSON reader takes them)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A finite int or float; not an int past a float's range (10**400), which math.isfinite and every computation
    with floats end in an OverflowError."""
    if not is_real(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def json_objects(text: str) -> Iterator[tuple[str, dict]]:
    """Each line of `text`, a run's JSON-lines record, that holds a JSON object, with that object. The trainer writes
    objects alone, so any other line is none of its own, and is passed over: half a line a killed job left, a note
    added by hand, and JSON Python will not read (an integer of more than 4300 digits, nesting past its recursion
    limit), which ended a resume and the WER report in a traceback."""
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict):
            yield line, record
