"""What the persistent kernels run on this GPU, from the support query: for each cell, precision and hidden size,
the most utterances it runs (forward and backward) and the most at which both directions of a bidirectional layer
run in one launch.

    python -m benchmarks.support_table [--cells relu gru lstm] [--precisions fp32 bf16] [--hiddens H ...]
        [--max-batch 16] [--json PATH]

The default sizes are the multiples of 128 up to 6272. Each shape's counts run from 1 utterance up (the query is
asked at each count: the table says so where a larger count runs and a smaller does not). A size where nothing runs
shows "-", and the JSON gives the query's reason at one utterance. `--json /dev/stdout` writes the JSON alone on
stdout and the table on stderr. Building the extension, the first time, takes a minute or two.
"""
if __name__ == "__main__":  # first: the imports below take seconds (torch), in which a signal printed a
    # traceback (Ctrl-C) or ended the tool without a word (SIGTERM)
    from data.cli import end_at_once_on_a_signal

    end_at_once_on_a_signal()

import argparse
import sys

import torch

from prnn_kernels.persistent import CELLS, MAX_BATCH, directions_run_together, support
from trainer.cli import (DEFAULT_JSON_HELP, EachOnce, int_at_least, json_file, json_output, lines_stream, run_tool,
                         say_written, write_results)
from trainer.environment import command_line, device_name, refuse_without_gpu, versions

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.support_table", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", nargs="+", action=EachOnce, choices=CELLS, default=["relu", "gru", "lstm"],
                        help="tanh runs as relu does")
    parser.add_argument("--precisions", nargs="+", action=EachOnce, choices=list(PRECISIONS), default=list(PRECISIONS))
    parser.add_argument("--hiddens", nargs="+", action=EachOnce, type=int_at_least(1, 1 << 16), default=list(HIDDENS))
    parser.add_argument("--max-batch", type=int_at_least(1, MAX_BATCH), default=16)
    parser.add_argument("--json", metavar="PATH", type=json_output,
                        help="write the table, the device and the reasons to PATH as JSON; of /dev/stdout (or the "
                             "file stdout is redirected to), the JSON alone, the table then on stderr"
                             + DEFAULT_JSON_HELP)
    args = parser.parse_args(argv)
    if refuse_without_gpu("benchmarks.support_table"):
        return 2
    args.json = json_file(args.json, __file__)
    table_out = lines_stream(args.json)  # stderr where the JSON goes to stdout, which then holds it alone
    columns = [(cell, precision) for cell in args.cells for precision in args.precisions]
    cuda = torch.device("cuda")
    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    # Before the queries: the checkout may be edited, or switched, while they run.
    measured_on = {"device": device_name(cuda), "sms": properties.multi_processor_count,
                   "l2_bytes": properties.L2_cache_size, **versions(cuda)}
    print(f"{device_name(cuda)} ({properties.multi_processor_count} SMs, {properties.L2_cache_size >> 20} MB of L2): "
          f"the most utterances (of 1..{args.max_batch}) a layer runs, and in brackets with both directions in one "
          "launch", file=table_out)
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
    results = {**measured_on, "max_batch": args.max_batch, "command": command_line(), "rows": table}
    write_results(args.json, results)
    say_written(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
