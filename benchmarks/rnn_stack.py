"""What a stack of recurrent layers costs per layer: prnn_kernels' persistent backend vs cuDNN (torch.nn), one GPU.

    python -m benchmarks.rnn_stack [--cells gru] [--hiddens 800 1152] [--depths 1 2 4 7] [--dtypes float32 bfloat16]
        [--batch 4] [--json PATH]

Bidirectional stacks (input size = hidden size, T = 256, every sample running all steps) of each depth, built as
`prnn_kernels.GRU(..., backend="persistent")` and as `torch.nn.GRU` with the same weights, timed forward and forward +
backward (gradients of the input and every parameter) in one process, each called from Python and replayed from a CUDA
graph ("graphed": the GPU's time alone; called from Python, cuDNN's bf16 and small fp32 layers take the host's time,
see benchmarks.rnn_kernels). fp32 stacks are compared with cuDNN in fp32 and in TF32, bf16 stacks run in bf16 against
cuDNN in fp16 and in bf16 (benchmarks.rnn_kernels.BASELINES). Times are medians of CUDA-event timings after warm-up.
Per depth the table gives the stack's time in ms and its time per layer; "per added layer" is the slope of a
least-squares line through (depth, time), the marginal cost of one more layer, and "fixed" is that line at depth 0.
Shapes the persistent kernel refuses are reported with its reason and skipped.
"""
if __name__ == "__main__":  # first: the imports below take seconds (torch), in which a signal printed a
    # traceback (Ctrl-C) or ended the tool without a word (SIGTERM)
    from data.cli import end_at_once_on_a_signal

    end_at_once_on_a_signal()

import argparse
import sys

import torch
from torch import nn

import prnn_kernels
from benchmarks.rnn_kernels import BASELINES, NUM_STEPS, cudnn_allowing_tf32, graphed, median_ms
from prnn_kernels.persistent import support
from trainer.cli import (DEFAULT_JSON_HELP, EachOnce, json_file, json_output, positive_int, run_tool, say_written,
                         write_results)
from trainer.environment import command_line, device_name, refuse_without_gpu, versions

MODULES = {"relu": (prnn_kernels.RNN, nn.RNN), "gru": (prnn_kernels.GRU, nn.GRU), "lstm": (prnn_kernels.LSTM, nn.LSTM)}
# --dtypes name -> (torch dtype, the precision name benchmarks.rnn_kernels.BASELINES is keyed by)
DTYPES = {"float32": (torch.float32, "fp32"), "bfloat16": (torch.bfloat16, "bf16")}
# Each stack's timings: JSON key -> the table's label.
MEASURES = {"fwd_ms": "fwd", "fwd_bwd_ms": "fwd+bwd", "fwd_graphed_ms": "fwd graphed",
            "fwd_bwd_graphed_ms": "fwd+bwd graphed"}


def stack_pair(cell, hidden_size, depth, dtype):
    """(persistent, cudnn) bidirectional stacks of `depth` layers with the same weights, on the GPU in dtype."""
    ours_class, torch_class = MODULES[cell]
    kwargs = {"num_layers": depth, "bidirectional": True}
    if cell == "relu":
        kwargs["nonlinearity"] = "relu"
    ours = ours_class(hidden_size, hidden_size, backend="persistent", **kwargs).cuda().to(dtype)
    theirs = torch_class(hidden_size, hidden_size, **kwargs).cuda().to(dtype)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def time_stack(module, batch_size, hidden_size, dtype):
    """{measure: ms} of one stack on random inputs (MEASURES)."""
    x = torch.randn(NUM_STEPS, batch_size, hidden_size, device="cuda", dtype=dtype, requires_grad=True)
    grad_output = torch.randn(NUM_STEPS, batch_size, 2 * hidden_size, device="cuda", dtype=dtype)
    leaves = [x, *module.parameters()]

    def forward():
        with torch.no_grad():
            module(x)

    def forward_backward():
        output, _ = module(x)
        torch.autograd.grad(output, leaves, grad_output)

    return {"fwd_ms": median_ms(forward), "fwd_bwd_ms": median_ms(forward_backward),
            "fwd_graphed_ms": median_ms(graphed(forward)), "fwd_bwd_graphed_ms": median_ms(graphed(forward_backward))}


def line_fit(depths, times):
    """(intercept, slope) of the least-squares line time = intercept + slope * depth (at least two distinct depths)."""
    n = len(depths)
    mean_d, mean_t = sum(depths) / n, sum(times) / n
    spread = sum((d - mean_d) ** 2 for d in depths)
    slope = sum((d - mean_d) * (t - mean_t) for d, t in zip(depths, times)) / spread
    return mean_t - slope * mean_d, slope


def measure(cell, hidden_size, depths, dtype_name, batch_size):
    """Rows of {backend, precision, depth, and the MEASURES} for one cell, size and persistent dtype; a cuDNN row's
    precision is its baseline's name (fp32, tf32, fp16, bf16)."""
    dtype, precision = DTYPES[dtype_name]
    rows = []
    for depth in depths:
        ours, theirs = stack_pair(cell, hidden_size, depth, dtype)
        runs = [("persistent", precision, dtype, False, ours)]
        runs += [("cudnn", name, d, tf32, theirs) for name, d, tf32 in BASELINES[precision]]
        for backend, label, run_dtype, tf32, module in runs:
            with cudnn_allowing_tf32(tf32):
                times = time_stack(module.to(run_dtype), batch_size, hidden_size, run_dtype)
            rows.append({"backend": backend, "precision": label, "depth": depth, **times})
        del ours, theirs
        torch.cuda.empty_cache()
    return rows


def summarise(rows):
    """Per (backend, precision): the fixed and per-added-layer cost of each of the MEASURES."""
    summary = []
    for key in dict.fromkeys((r["backend"], r["precision"]) for r in rows):
        mine = [r for r in rows if (r["backend"], r["precision"]) == key]
        entry = {"backend": key[0], "precision": key[1]}
        for measure_name in MEASURES:
            fixed, per_layer = line_fit([r["depth"] for r in mine], [r[measure_name] for r in mine])
            entry[f"{measure_name}_fixed"], entry[f"{measure_name}_per_layer"] = fixed, per_layer
        summary.append(entry)
    return summary


def print_table(cell, hidden_size, batch_size, rows, summary, depths):
    print(f"\n{cell} bidirectional stack, H = {hidden_size}, B = {batch_size}, T = {NUM_STEPS}: ms (ms per layer)")
    header = f"{'backend':<11}{'precision':<10}{'pass':<16}" + "".join(f"{f'depth {d}':>18}" for d in depths)
    print(header + f"{'per added layer':>17}{'fixed':>9}")
    for entry in summary:
        for name, label in MEASURES.items():
            cells = []
            for depth in depths:
                row = next(r for r in rows if (r["backend"], r["precision"], r["depth"]) ==
                           (entry["backend"], entry["precision"], depth))
                cells.append(f"{row[name]:8.2f} ({row[name] / depth:6.2f})")
            print(f"{entry['backend']:<11}{entry['precision']:<10}{label:<16}" + "".join(f"{c:>18}" for c in cells) +
                  f"{entry[name + '_per_layer']:17.2f}{entry[name + '_fixed']:9.2f}")
    persistent = summary[0]
    for baseline in summary[1:]:
        ratios = ", ".join(f"{label} {baseline[f'{name}_per_layer'] / persistent[f'{name}_per_layer']:.2f}x"
                           for name, label in MEASURES.items())
        print(f"per added layer, cuDNN {baseline['precision']} / persistent {persistent['precision']}: {ratios}")


def main():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rnn_stack", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", nargs="+", action=EachOnce, default=["gru"], choices=sorted(MODULES))
    parser.add_argument("--hiddens", nargs="+", action=EachOnce, type=positive_int, default=[800, 1152])
    parser.add_argument("--depths", nargs="+", action=EachOnce, type=positive_int, default=[1, 2, 4, 7])
    parser.add_argument("--dtypes", nargs="+", action=EachOnce, default=["float32", "bfloat16"], choices=sorted(DTYPES))
    parser.add_argument("--batch", type=positive_int, default=4)
    parser.add_argument("--json", metavar="PATH", type=json_output,
                        help="write the results and the configuration to this file" + DEFAULT_JSON_HELP)
    args = parser.parse_args()
    if len(args.depths) < 2:
        parser.error("argument --depths: give at least two depths to fit the per-layer cost")
    if refuse_without_gpu("benchmarks.rnn_stack"):
        return 2
    args.json = json_file(args.json, __file__)
    torch.manual_seed(0)
    config = {"batch": args.batch, "num_steps": NUM_STEPS, "depths": args.depths, "bidirectional": True,
              "device": device_name(torch.device("cuda")), **versions(torch.device("cuda")),
              "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32, "command": command_line()}
    results = []
    for cell in args.cells:
        for hidden_size in args.hiddens:
            for dtype_name in args.dtypes:
                verdict = support(cell, hidden_size, args.batch, DTYPES[dtype_name][0], "cuda")
                if not verdict.ok:
                    print(f"\n{cell} H = {hidden_size} {dtype_name}: persistent kernel refused: {verdict.reason}")
                    results.append({"cell": cell, "hidden": hidden_size, "persistent_dtype": dtype_name,
                                    "refused": verdict.reason})
                else:
                    rows = measure(cell, hidden_size, args.depths, dtype_name, args.batch)
                    summary = summarise(rows)
                    print_table(cell, hidden_size, args.batch, rows, summary, args.depths)
                    results.append({"cell": cell, "hidden": hidden_size, "persistent_dtype": dtype_name, "rows": rows,
                                    "summary": summary})
                # Rewritten after every stack, so a run cut short keeps what it measured.
                write_json(args.json, config, results, so_far=True)
    write_json(args.json, config, results)
    say_written(args.json)


def write_json(path, config, results, so_far=False):
    write_results(path, {"config": config, "results": results}, so_far)


if __name__ == "__main__":
    sys.exit(run_tool(main))
