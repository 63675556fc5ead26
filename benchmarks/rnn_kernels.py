"""Persistent RNN kernels vs cuDNN (torch.nn) vs a CUDA-graph loop of one matmul per step, on one GPU.

    python -m benchmarks.rnn_kernels [--cells relu gru lstm] [--batches ...] [--hiddens ...] [--precisions fp32 bf16]
        [--quick] [--json PATH]

One layer, input size = hidden size, T = 256, every sample running all steps, for each cell, batch, hidden size and
precision, one direction; then, at batch 4, both directions of a bidirectional layer. fp32 rows compare fp32
everywhere (the persistent layer's fp32 GEMMs run on tensor cores at fp32's accuracy, 3xTF32, prnn_kernels.products,
as the modules' persistent backend runs them; with torch.backends.cuda.matmul.allow_tf32 on, on cuBLAS), with cuDNN in
TF32 beside it; bf16 rows run the persistent kernel in bf16 against cuDNN in fp16 and in bf16. Times are
medians of CUDA-event timings after warm-up, in microseconds per timestep:
  persistent layer  input GEMM (products.input_projection) + the persistent recurrence, the same work as one cuDNN
                    layer, as called from Python (the speed-ups' numerator)
  graphed           the same layer call replayed as a CUDA graph (as train.cuda_graphs=true runs it): the
                    GPU's time alone; below about 2 ms a call (the bf16 ReLU, and bf16 layers at H <= 1152, at B = 4)
                    a layer's forward+backward from Python is bound by the host, so its time there moves with the CPU
                    between processes
  kernel only       the persistent recurrence alone on a precomputed input projection (forward), replayed as a
                    CUDA graph so that the host's per-call work (~0.2-0.5 ms of Python and ATen) cannot leave the GPU
                    idle; the JSON also splits it into a per-call prologue and a marginal per-step cost from a second
                    graph at T = 64
  cuDNN             torch.nn.RNN(nonlinearity="relu") / GRU / LSTM, one layer; fp32 rows run it twice, in fp32
                    (torch.backends.cudnn.allow_tf32 off, the reference of their speed-ups) and with torch's default,
                    which lets cuDNN multiply in TF32 (10 mantissa bits); bf16 rows in fp16 (the reference) and bf16.
                    Each is timed called from Python and replayed as a CUDA graph: cuDNN issues two kernels a
                    timestep from the host (a small GEMM and the cell), so where those take less GPU time than the
                    host takes to issue them (fp16 layers, fp32 ones up to about H = 1152, at B = 4) its time called
                    from Python is the host's and moves with the CPU between processes, while the graphed time is
                    the GPU's. The speed-ups are given both ways: called from Python over called from Python (the
                    targets' measure), and graphed over graphed
  matmul loop       h_t = h_{t-1} @ U^T (U: G*H x H), one torch.mm per step, replayed as a CUDA graph (forward only)
"fwd+bwd" rows time forward plus the gradients of the input and every parameter. TFLOP/s counts the input GEMM and
the recurrence (2 T B G H (I + H) per direction forward, three times that for forward and backward). Bidirectional
rows say whether the two directions ran in one launch. Each supported row's JSON also records how each pass launched
(`persistent_launch_plans`: CTAs, threads, thread-block cluster size, units per CTA, shared memory, and how much of
it holds weights).
"""
if __name__ == "__main__":  # first: the imports below take seconds (torch), in which a signal printed a
    # traceback (Ctrl-C) or ended the tool without a word (SIGTERM)
    from data.cli import end_at_once_on_a_signal

    end_at_once_on_a_signal()

import argparse
import contextlib
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch import nn

from models.cuda_graphs import collector_paused
from prnn_kernels.persistent import (
    launch_plans,
    persistent_bidirectional_layer,
    persistent_layer,
    support,
)
from prnn_kernels.products import input_projection
from prnn_kernels.reference import NUM_GATES
from trainer.cli import (DEFAULT_JSON_HELP, EachOnce, json_file, json_output, positive_int, run_tool, say_written,
                         write_results)
from trainer.environment import command_line, device_name, refuse_without_gpu, versions

NUM_STEPS = 256
SHORT_STEPS = 64  # a second sequence length for the kernel-only timing
CELLS = ("relu", "gru", "lstm")
PRECISIONS = ("fp32", "bf16")
BATCHES = (1, 4, 8, 16)
HIDDENS = (2048, 1152, 1024, 2304, 2816)  # the targets' sizes first
QUICK_BATCHES = (4,)
QUICK_HIDDENS = (2048, 1152, 1024)
BIDIRECTIONAL_BATCH = 4
WARMUP = 3
REPEATS = 15
# The cuDNN runs each precision's rows are compared with: (name, dtype, whether cuDNN may multiply in TF32); the first
# is the reference of the speed-ups. torch's default lets cuDNN run fp32 layers in TF32, which rounds the inputs of
# every product to 10 mantissa bits, while the persistent kernels compute in fp32: so fp32 is timed against cuDNN in
# fp32, as the kernels' speed targets were set, and TF32 is recorded beside it.
BASELINES = {"fp32": (("fp32", torch.float32, False), ("tf32", torch.float32, True)),
             "bf16": (("fp16", torch.float16, False), ("bf16", torch.bfloat16, False))}


def flops(num_steps, batch_size, gate_rows, hidden_size, input_size, backward):
    forward = 2 * num_steps * batch_size * gate_rows * (input_size + hidden_size)
    return 3 * forward if backward else forward


def median_ms(fn):
    """Median over REPEATS of fn's GPU time, after WARMUP calls."""
    for _ in range(WARMUP):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPEATS)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


class Problem:
    """Random inputs and one layer's parameters (one or two directions) in one dtype, torch.nn's initialisation."""

    def __init__(self, cell, batch_size, hidden_size, dtype, bidirectional=False):
        self.cell, self.dtype, self.bidirectional = cell, dtype, bidirectional
        if cell in ("relu", "tanh"):
            module = nn.RNN(hidden_size, hidden_size, nonlinearity=cell, bidirectional=bidirectional)
        else:
            module = {"gru": nn.GRU, "lstm": nn.LSTM}[cell](hidden_size, hidden_size, bidirectional=bidirectional)
        self.module = module.cuda().to(dtype)
        num_directions = 2 if bidirectional else 1
        self.x = torch.randn(NUM_STEPS, batch_size, hidden_size, device="cuda", dtype=dtype, requires_grad=True)
        self.h0 = torch.zeros(num_directions, batch_size, hidden_size, device="cuda", dtype=dtype)
        self.lengths = torch.full((batch_size,), NUM_STEPS, device="cuda", dtype=torch.int64)
        self.grad_output = torch.randn(NUM_STEPS, batch_size, num_directions * hidden_size, device="cuda", dtype=dtype)
        self.leaves = [self.x, *self.module.parameters()]

    def directions(self):
        """Per direction: (weight_ih, weight_hh, bias_ih, bias_hh)."""
        return self.module.all_weights

    def state(self, direction):
        return (self.h0[direction], self.h0[direction]) if self.cell == "lstm" else self.h0[direction]

    def persistent(self):
        weights = self.directions()
        if self.bidirectional:
            input_proj = input_projection(self.x, torch.cat([w[0] for w in weights]),
                                          torch.cat([w[2] for w in weights]))
            return persistent_bidirectional_layer(self.cell, input_proj, [self.state(0), self.state(1)],
                                                  [w[1] for w in weights], [w[3] for w in weights], self.lengths)
        weight_ih, weight_hh, bias_ih, bias_hh = weights[0]
        return persistent_layer(self.cell, input_projection(self.x, weight_ih, bias_ih), self.state(0), weight_hh,
                                bias_hh, self.lengths, False)

    def cudnn(self):
        return self.module(self.x, (self.h0, self.h0) if self.cell == "lstm" else self.h0)

    def forward_backward(self, layer):
        def run():
            output, _ = layer()
            torch.autograd.grad(output, self.leaves, self.grad_output)

        return run

    def kernel_only(self, num_steps=NUM_STEPS):
        """A CUDA graph of one forward launch on a precomputed input projection."""
        weight_ih, weight_hh, bias_ih, bias_hh = self.directions()[0]
        lengths = self.lengths.clamp(max=num_steps)
        with torch.no_grad():
            input_proj = F.linear(self.x[:num_steps], weight_ih, bias_ih)
            hx = self.state(0)
            return graphed(lambda: persistent_layer(self.cell, input_proj, hx, weight_hh, bias_hh, lengths, False))

    def matmul_loop(self):
        """A CUDA graph of NUM_STEPS dependent matmuls h_t = h_{t-1} @ U^T, keeping the first H of the G*H outputs."""
        weight_t = self.directions()[0][1].detach().t()  # (H, G*H)
        hidden_size = weight_t.shape[0]
        states = torch.empty(NUM_STEPS + 1, self.h0.shape[1], weight_t.shape[1], device="cuda", dtype=self.dtype)
        states[0].normal_()

        def loop():
            for t in range(NUM_STEPS):
                torch.mm(states[t, :, :hidden_size], weight_t, out=states[t + 1])

        with torch.no_grad():
            return graphed(loop)


def graphed(fn):
    """fn captured once as a CUDA graph, returned as its replay: fn's GPU work without the host's time between
    launches. Warmed up first on a side stream, as torch asks of captures that run autograd, so that the extension,
    launch plans, cuBLAS workspaces and the allocator's blocks exist before the capture."""
    side_stream = torch.cuda.Stream()
    side_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_stream):
        for _ in range(WARMUP):
            fn()
    torch.cuda.current_stream().wait_stream(side_stream)
    graph = torch.cuda.CUDAGraph()
    with collector_paused(), torch.cuda.graph(graph):
        fn()
    return graph.replay


@contextlib.contextmanager
def cudnn_allowing_tf32(allowed):
    """cuDNN with torch.backends.cudnn.allow_tf32 = allowed inside the block, the caller's setting after it."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = saved


def per_step_us(milliseconds):
    return milliseconds * 1e3 / NUM_STEPS


def kernel_only_split(long_ms, short_ms):
    """The kernel's marginal cost per step and its prologue per call, in us, from its times at NUM_STEPS steps and at
    SHORT_STEPS: a call costs prologue + steps x per-step, and two lengths separate them."""
    step_ms = (long_ms - short_ms) / (NUM_STEPS - SHORT_STEPS)
    return {"kernel_only_fwd_marginal_us": step_ms * 1e3,
            "kernel_only_fwd_prologue_us": (short_ms - SHORT_STEPS * step_ms) * 1e3}


def measure(cell, batch_size, hidden_size, precision, bidirectional=False):
    """All timings of one (cell, batch, hidden, precision, directions) row; unsupported persistent shapes are
    recorded with why."""
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    row = {"cell": cell, "batch": batch_size, "hidden": hidden_size, "precision": precision,
           "bidirectional": bidirectional, "num_steps": NUM_STEPS}
    problem = Problem(cell, batch_size, hidden_size, dtype, bidirectional)
    verdict = support(cell, hidden_size, batch_size, dtype, "cuda")
    row["persistent_supported"] = verdict.ok
    row["persistent_reason"] = verdict.reason
    if verdict.ok:
        row["persistent_fwd_us"] = per_step_us(median_ms(problem.persistent))
        row["persistent_fwdbwd_us"] = per_step_us(median_ms(problem.forward_backward(problem.persistent)))
        row["persistent_fwd_graphed_us"] = per_step_us(median_ms(graphed(problem.persistent)))
        row["persistent_fwdbwd_graphed_us"] = per_step_us(
            median_ms(graphed(problem.forward_backward(problem.persistent))))
        plans = launch_plans(cell, hidden_size, batch_size, dtype, "cuda", directions=2 if bidirectional else 1)
        row["persistent_launch_plans"] = plans
        if bidirectional:
            row["directions_in_one_launch"] = all(plan["directions_in_one_launch"] for plan in plans)
        else:
            long_ms = median_ms(problem.kernel_only())
            row["kernel_only_fwd_us"] = per_step_us(long_ms)
            row.update(kernel_only_split(long_ms, median_ms(problem.kernel_only(SHORT_STEPS))))
    if not bidirectional:
        row["matmul_loop_fwd_us"] = per_step_us(median_ms(problem.matmul_loop()))
    for name, baseline_dtype, tf32 in BASELINES[precision]:
        baseline = (problem if baseline_dtype == dtype
                    else Problem(cell, batch_size, hidden_size, baseline_dtype, bidirectional))
        with cudnn_allowing_tf32(tf32):
            row[f"cudnn_{name}_fwd_us"] = per_step_us(median_ms(baseline.cudnn))
            row[f"cudnn_{name}_fwdbwd_us"] = per_step_us(median_ms(baseline.forward_backward(baseline.cudnn)))
            row[f"cudnn_{name}_fwd_graphed_us"] = per_step_us(median_ms(graphed(baseline.cudnn)))
            row[f"cudnn_{name}_fwdbwd_graphed_us"] = per_step_us(
                median_ms(graphed(baseline.forward_backward(baseline.cudnn))))
    if verdict.ok:
        add_rates(row)
    return row


def add_rates(row):
    """The persistent layer's TFLOP/s and its speed-ups over its precision's reference cuDNN run, forward and forward
    plus backward, from a supported row's times per step."""
    reference, _ = cudnn_keys(row["precision"])
    num_directions = 2 if row["bidirectional"] else 1
    num_steps, hidden_size = row["num_steps"], row["hidden"]
    gate_rows = NUM_GATES[row["cell"]] * hidden_size
    for direction, backward in (("fwd", False), ("fwdbwd", True)):
        persistent_us = row[f"persistent_{direction}_us"]
        work = num_directions * flops(num_steps, row["batch"], gate_rows, hidden_size, hidden_size, backward)
        row[f"persistent_{direction}_tflops"] = work / (persistent_us * num_steps * 1e-6) / 1e12
        row[f"speedup_{direction}_over_{reference}"] = row[f"{reference}_{direction}_us"] / persistent_us
        row[f"speedup_{direction}_graphed_over_{reference}"] = (
            row[f"{reference}_{direction}_graphed_us"] / row[f"persistent_{direction}_graphed_us"])


def cudnn_keys(precision):
    """The JSON key prefixes of a precision's cuDNN runs: (the speed-ups' reference, the one beside it)."""
    return tuple(f"cudnn_{name}" for name, _, _ in BASELINES[precision])


def print_table(rows):
    header = (f"{'cell':>4} {'dirs':>4} {'prec':>4} {'B':>3} {'H':>5} {'pass':>6} | {'persist':>8} {'graphed':>8} "
              f"{'kernel':>7} {'TFLOP/s':>7} | {'cuDNN':>7} {'graphed':>8} {'cuDNN alt':>10} {'mm loop':>7} | "
              f"{'speed-up':>8} {'graphed':>8}")
    print(f"us per timestep (T = {NUM_STEPS}, one layer); cuDNN: fp32 for fp32 rows, fp16 for bf16 rows (the "
          "speed-ups' reference), called from Python and replayed as a CUDA graph; cuDNN alt: TF32 for fp32 rows, bf16 "
          "for bf16 rows; speed-ups: called from Python, and graphed over graphed")
    print(header)
    print("-" * len(header))
    for row in rows:
        reference, alternative = cudnn_keys(row["precision"])
        directions = "2" + ("*" if row.get("directions_in_one_launch") else "") if row["bidirectional"] else "1"
        for direction in ("fwd", "fwdbwd"):
            kernel = table_entry(row, "kernel_only_fwd_us", 7) if direction == "fwd" else f"{'':>7}"
            loop = table_entry(row, "matmul_loop_fwd_us", 7) if direction == "fwd" else f"{'':>7}"
            print(f"{row['cell']:>4} {directions:>4} {row['precision']:>4} {row['batch']:>3} {row['hidden']:>5} "
                  f"{direction:>6} | {table_entry(row, f'persistent_{direction}_us', 8)} "
                  f"{table_entry(row, f'persistent_{direction}_graphed_us', 8)} {kernel} "
                  f"{table_entry(row, f'persistent_{direction}_tflops', 7)} | "
                  f"{table_entry(row, f'{reference}_{direction}_us', 7)} "
                  f"{table_entry(row, f'{reference}_{direction}_graphed_us', 8)} "
                  f"{table_entry(row, f'{alternative}_{direction}_us', 10)} {loop} | "
                  f"{table_entry(row, f'speedup_{direction}_over_{reference}', 7, 1)}x "
                  f"{table_entry(row, f'speedup_{direction}_graphed_over_{reference}', 7, 1)}x")
        if not row["persistent_supported"]:
            print(f"     persistent kernel refused {row['cell']} B={row['batch']} H={row['hidden']} "
                  f"{row['precision']}: {row['persistent_reason']}")
    print("dirs 2*: both directions in one launch")


def table_entry(row, key, width, digits=2):
    """row[key] right-aligned in `width` characters; "-" where the row has none (a shape the kernel refused)."""
    value = row.get(key)
    return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


def main():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rnn_kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", type=json_output,
                        help="write the results and the full configuration to this file" + DEFAULT_JSON_HELP)
    parser.add_argument("--cells", nargs="+", action=EachOnce, default=list(CELLS), choices=list(NUM_GATES))
    parser.add_argument("--batches", nargs="+", action=EachOnce, type=positive_int, help=f"default {BATCHES}")
    parser.add_argument("--hiddens", nargs="+", action=EachOnce, type=positive_int, help=f"default {HIDDENS}")
    parser.add_argument("--precisions", nargs="+", action=EachOnce, default=list(PRECISIONS), choices=list(PRECISIONS))
    parser.add_argument("--quick", action="store_true",
                        help=f"default batches {QUICK_BATCHES} and hidden sizes {QUICK_HIDDENS}")
    args = parser.parse_args()
    if refuse_without_gpu("benchmarks.rnn_kernels"):
        return 2
    args.json = json_file(args.json, __file__)
    torch.manual_seed(0)
    batches = args.batches or (QUICK_BATCHES if args.quick else BATCHES)
    hiddens = args.hiddens or (QUICK_HIDDENS if args.quick else HIDDENS)
    configuration = {"num_steps": NUM_STEPS, "cells": args.cells, "batches": list(batches), "hiddens": list(hiddens),
                     "precisions": args.precisions,
                     "bidirectional_batch": BIDIRECTIONAL_BATCH, "input_size": "hidden", "warmup": WARMUP,
                     "repeats": REPEATS, "statistic": "median", "command": command_line()}
    grid = [(cell, batch, hidden, precision, False) for cell in args.cells for hidden in hiddens
            for batch in batches for precision in args.precisions]
    grid += [(cell, BIDIRECTIONAL_BATCH, hidden, precision, True) for cell in args.cells for hidden in hiddens
             for precision in args.precisions]
    measured_on = setting()  # before the rows: the checkout may be edited, or switched, while they are measured
    rows = []
    for point in grid:
        rows.append(measure(*point))
        print(json.dumps(rows[-1]), flush=True)
        # Rewritten after every row, so a run cut short keeps what it measured.
        write_json(args.json, measured_on, rows, configuration, so_far=True)
    print_table(rows)
    write_json(args.json, measured_on, rows, configuration)
    say_written(args.json)


def setting():
    """The device, the versions (the code's commit among them) and the baselines' settings the rows are measured
    with."""
    properties = torch.cuda.get_device_properties(0)
    return {
        "device": device_name(torch.device("cuda")),
        "multiprocessors": properties.multi_processor_count,
        **versions(torch.device("cuda")),
        "baselines": {precision: [{"name": name, "dtype": str(dtype), "cudnn_allow_tf32": tf32}
                                  for name, dtype, tf32 in baselines] for precision, baselines in BASELINES.items()},
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
    }


def write_json(path, measured_on, rows, configuration, so_far=False):
    result = {**measured_on, "config": configuration, "rows": rows}
    write_results(path, result, so_far)


if __name__ == "__main__":
    sys.exit(run_tool(main))
