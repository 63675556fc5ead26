"""What the persistent kernels run on this GPU, from the support query: for each cell, precision and hidden size,
the most utterances it runs (forward and backward) and the most at which both directions of a bidirectional layer
run in one launch.

    python -m benchmarks.support_table [--cells relu gru lstm] [--precisions fp32 bf16] [--hiddens H ...]
        [--max-batch 16] [--json PATH | --json -]

The default sizes are the multiples of 128 up to 6272. Each shape's counts run from 1 utterance up (the query is
asked at each count: the table says so where a larger count runs and a smaller does not). A size where nothing runs
shows "-", and the JSON gives the query's reason at one utterance. `--json -` writes the JSON alone on stdout and
the table on stderr. Building the extension, the first time, takes a minute or two.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

from prnn_kernels.persistent import CELLS, MAX_BATCH, directions_run_together, support

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
HIDDENS = tuple(range(128, 6273, 128))


def fits(cell: str, hidden_size: int, dtype: torch.dtype, max_batch: int) -> dict:
    """{"batches": the utterance counts that run, "together": those that run both directions in one launch,
    "reason": why one utterance does not run, else None} for one shape on the current GPU."""
    batches = [batch for batch in range(1, max_batch + 1) if support(cell, hidden_size, batch, dtype, "cuda").ok]
    together = [batch for batch in batches if directions_run_together(cell, hidden_size, batch, dtype, "cuda")]
    reason = None if 1 in batches else support(cell, hidden_size, 1, dtype, "cuda").reason
    return {"batches": batches, "together": together, "reason": reason}


def counts(batches: list[int]) -> str:
    """"-" for none, the largest where they run from 1 up, else each one."""
    if not batches:
        return "-"
    return str(batches[-1]) if batches == list(range(1, len(batches) + 1)) else ",".join(map(str, batches))


def is_stdout(path: str) -> bool:
    """Whether `path` is the file stdout writes to: /dev/stdout, or the file or pipe stdout is redirected to."""
    try:
        return os.path.samestat(os.stat(path), os.fstat(sys.stdout.fileno()))
    except (OSError, ValueError):  # no such file yet, or a stdout with no file behind it
        return False


def count_from_1_to(largest: int):
    def integer(text: str) -> int:  # argparse names the function in "invalid integer value: 'x'"
        value = int(text)
        if not 1 <= value <= largest:
            raise argparse.ArgumentTypeError(f"must be 1 to {largest}, not {value}")
        return value
    return integer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.support_table", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", nargs="+", choices=CELLS, default=["relu", "gru", "lstm"],
                        help="tanh runs as relu does")
    parser.add_argument("--precisions", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS))
    parser.add_argument("--hiddens", nargs="+", type=count_from_1_to(1 << 16), default=list(HIDDENS))
    parser.add_argument("--max-batch", type=count_from_1_to(MAX_BATCH), default=16)
    parser.add_argument("--json", metavar="PATH", help='write the table, the device and the reasons to PATH as JSON; '
                                                       '"-" for stdout, the table then on stderr')
    args = parser.parse_args(argv)
    json_to_stdout = args.json == "-"
    table_out = sys.stderr if json_to_stdout else sys.stdout
    if args.json and not json_to_stdout:  # now, not after the queries, whose JSON the write would then lose
        try:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:  # a file where a folder of the path should be
            parser.error(f"argument --json: cannot make the folder of {args.json}: {error}")
        if Path(args.json).is_dir():
            parser.error(f"argument --json: {args.json} is a folder; name a file in it")
        # Its open would truncate a redirected stdout, the table printed before it lost, or mix the two in a pipe.
        if is_stdout(args.json):
            parser.error(f"argument --json: {args.json} is where the table goes (stdout); --json - writes the JSON "
                         "alone there and the table on stderr")
    if not torch.cuda.is_available():
        print("error: the support query answers for a CUDA GPU, and none is visible", file=sys.stderr)
        return 2
    columns = [(cell, precision) for cell in args.cells for precision in args.precisions]
    device = torch.cuda.get_device_properties(torch.cuda.current_device())
    print(f"{device.name} ({device.multi_processor_count} SMs, {device.L2_cache_size >> 20} MB of L2): the most "
          f"utterances (of 1..{args.max_batch}) a layer runs, and in brackets with both directions in one launch",
          file=table_out)
    print(f"{'H':>5} " + " ".join(f"{cell + ' ' + precision:>13}" for cell, precision in columns), file=table_out,
          flush=True)
    table = []
    for hidden in args.hiddens:
        row = {f"{cell}_{precision}": fits(cell, hidden, PRECISIONS[precision], args.max_batch)
               for cell, precision in columns}
        table.append({"hidden": hidden, **row})
        print(f"{hidden:>5} " + " ".join(
            f"{counts(shape['batches']) + ' (' + counts(shape['together']) + ')':>13}" for shape in row.values()),
            file=table_out, flush=True)
    results = {"device": device.name, "sms": device.multi_processor_count, "l2_bytes": device.L2_cache_size,
               "torch": torch.__version__, "max_batch": args.max_batch, "rows": table}
    if json_to_stdout:
        json.dump(results, sys.stdout, indent=1)
        print()
    elif args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
