"""Persistent RNN kernel vs cuDNN (torch.nn.RNN) vs a CUDA-graph loop of one matmul per step, on one GPU.

    python -m benchmarks.rnn_kernels [--json PATH] [--quick]

One ReLU layer, input size = hidden size, T = 256, every sample running all steps, for each batch, hidden size and
precision: fp32 rows compare fp32 everywhere; bf16 rows run the persistent kernel in bf16 against cuDNN in fp16 and in
bf16. Times are medians of CUDA-event timings after warm-up, in microseconds per timestep:
  persistent layer  input GEMM (F.linear) + persistent_layer, the same work as one cuDNN layer
  kernel only       persistent_layer alone on a precomputed input projection (forward); the JSON also splits it
                    into a per-call prologue and a marginal per-step cost from a second run at T = 64
  cuDNN             torch.nn.RNN(nonlinearity="relu"), one layer (torch's default TF32 setting, recorded in the JSON)
  matmul loop       h_t = h_{t-1} @ U^T, one torch.mm per step, replayed as a CUDA graph (forward only)
"fwd+bwd" rows time forward plus the gradients of the input and every parameter. TFLOP/s counts the input GEMM and
the recurrence (2 T B H (I + H) forward, three times that for forward and backward).
"""
import argparse
import json
import platform
import statistics
import sys

import torch
import torch.nn.functional as F
from torch import nn

from prnn_kernels.persistent import persistent_layer, support

NUM_STEPS = 256
SHORT_STEPS = 64  # a second sequence length for the kernel-only timing
BATCHES = (1, 4, 8, 16)
HIDDENS = (2048, 1152, 2304, 2816)  # the target size first
QUICK_BATCHES = (4,)
QUICK_HIDDENS = (2048, 1152)
WARMUP = 3
REPEATS = 15


def flops(num_steps, batch_size, hidden_size, input_size, backward):
    forward = 2 * num_steps * batch_size * hidden_size * (input_size + hidden_size)
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
    """Random inputs and one layer's parameters in one dtype (torch.nn's initialisation)."""

    def __init__(self, batch_size, hidden_size, dtype):
        self.dtype = dtype
        self.module = nn.RNN(hidden_size, hidden_size, nonlinearity="relu").cuda().to(dtype)
        self.x = torch.randn(NUM_STEPS, batch_size, hidden_size, device="cuda", dtype=dtype, requires_grad=True)
        self.h0 = torch.zeros(1, batch_size, hidden_size, device="cuda", dtype=dtype)
        self.lengths = torch.full((batch_size,), NUM_STEPS, device="cuda", dtype=torch.int64)
        self.grad_output = torch.randn_like(self.x)
        self.grad_h_n = torch.randn_like(self.h0)
        self.leaves = [self.x, *self.module.parameters()]

    def persistent(self):
        m = self.module
        input_proj = F.linear(self.x, m.weight_ih_l0, m.bias_ih_l0)
        output, h_n = persistent_layer(
            "relu", input_proj, self.h0[0], m.weight_hh_l0, m.bias_hh_l0, self.lengths, False
        )
        return output, h_n.unsqueeze(0)

    def cudnn(self):
        return self.module(self.x, self.h0)

    def forward_backward(self, layer):
        def run():
            output, h_n = layer()
            torch.autograd.grad((output, h_n), self.leaves, (self.grad_output, self.grad_h_n))

        return run

    def kernel_only(self, num_steps=NUM_STEPS):
        m = self.module
        with torch.no_grad():
            input_proj = F.linear(self.x[:num_steps], m.weight_ih_l0, m.bias_ih_l0)
        hx, weight_hh, bias_hh = self.h0[0], m.weight_hh_l0, m.bias_hh_l0
        return lambda: persistent_layer("relu", input_proj, hx, weight_hh, bias_hh, self.lengths, False)

    def matmul_loop(self):
        """A CUDA graph of NUM_STEPS dependent matmuls h_t = h_{t-1} @ U^T."""
        weight_t = self.module.weight_hh_l0.detach().t()
        states = torch.empty(NUM_STEPS + 1, *self.h0.shape[1:], device="cuda", dtype=self.dtype)
        states[0].normal_()
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad():
            for _ in range(2):  # warm-up: cuBLAS handles and workspaces exist before capture
                torch.mm(states[0], weight_t, out=states[1])
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                for t in range(NUM_STEPS):
                    torch.mm(states[t], weight_t, out=states[t + 1])
        return graph.replay


def per_step_us(milliseconds):
    return milliseconds * 1e3 / NUM_STEPS


def measure(batch_size, hidden_size, precision):
    """All timings of one (batch, hidden, precision) cell; unsupported persistent shapes are recorded with why."""
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    row = {"batch": batch_size, "hidden": hidden_size, "precision": precision, "num_steps": NUM_STEPS}
    problem = Problem(batch_size, hidden_size, dtype)
    verdict = support("relu", hidden_size, batch_size, dtype, "cuda")
    row["persistent_supported"] = verdict.ok
    row["persistent_reason"] = verdict.reason
    if verdict.ok:
        row["persistent_fwd_us"] = per_step_us(median_ms(lambda: problem.persistent()))
        row["kernel_only_fwd_us"] = per_step_us(median_ms(problem.kernel_only()))
        # Per call = prologue + steps x per-step: two lengths separate them.
        short_ms = median_ms(problem.kernel_only(SHORT_STEPS))
        step_ms = (row["kernel_only_fwd_us"] * NUM_STEPS * 1e-3 - short_ms) / (NUM_STEPS - SHORT_STEPS)
        row["kernel_only_fwd_marginal_us"] = step_ms * 1e3
        row["kernel_only_fwd_prologue_us"] = (short_ms - SHORT_STEPS * step_ms) * 1e3
        row["persistent_fwdbwd_us"] = per_step_us(median_ms(problem.forward_backward(problem.persistent)))
    row["matmul_loop_fwd_us"] = per_step_us(median_ms(problem.matmul_loop()))
    baselines = {"fp32": [torch.float32]}.get(precision, [torch.float16, torch.bfloat16])
    for baseline_dtype in baselines:
        name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[baseline_dtype]
        baseline = problem if baseline_dtype == dtype else Problem(batch_size, hidden_size, baseline_dtype)
        row[f"cudnn_{name}_fwd_us"] = per_step_us(median_ms(lambda: baseline.cudnn()))
        row[f"cudnn_{name}_fwdbwd_us"] = per_step_us(median_ms(baseline.forward_backward(baseline.cudnn)))
    reference = "cudnn_fp32" if precision == "fp32" else "cudnn_fp16"
    for direction, backward in (("fwd", False), ("fwdbwd", True)):
        if verdict.ok:
            persistent_us = row[f"persistent_{direction}_us"]
            work = flops(NUM_STEPS, batch_size, hidden_size, hidden_size, backward)
            row[f"persistent_{direction}_tflops"] = work / (persistent_us * NUM_STEPS * 1e-6) / 1e12
            row[f"speedup_{direction}_over_{reference}"] = row[f"{reference}_{direction}_us"] / persistent_us
    return row


def print_table(rows):
    header = (f"{'prec':>4} {'B':>3} {'H':>5} {'pass':>6} | {'persist':>8} {'kernel':>7} {'TFLOP/s':>7} | "
              f"{'cuDNN':>7} {'cuDNN bf16':>10} {'mm loop':>7} | {'speed-up':>8}")
    print("us per timestep (T = 256, one ReLU layer); cuDNN column: fp32 for fp32 rows, fp16 for bf16 rows")
    print(header)
    print("-" * len(header))
    for row in rows:
        reference = "cudnn_fp32" if row["precision"] == "fp32" else "cudnn_fp16"
        for direction in ("fwd", "fwdbwd"):
            def cell(key, width, digits=2):
                value = row.get(key)
                return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"

            kernel = cell("kernel_only_fwd_us", 7) if direction == "fwd" else f"{'':>7}"
            loop = cell("matmul_loop_fwd_us", 7) if direction == "fwd" else f"{'':>7}"
            print(f"{row['precision']:>4} {row['batch']:>3} {row['hidden']:>5} {direction:>6} | "
                  f"{cell(f'persistent_{direction}_us', 8)} {kernel} {cell(f'persistent_{direction}_tflops', 7)} | "
                  f"{cell(f'{reference}_{direction}_us', 7)} {cell(f'cudnn_bf16_{direction}_us', 10)} {loop} | "
                  f"{cell(f'speedup_{direction}_over_{reference}', 7, 1)}x")
        if not row["persistent_supported"]:
            print(f"     persistent kernel refused B={row['batch']} H={row['hidden']} {row['precision']}: "
                  f"{row['persistent_reason']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results and the full configuration to this file")
    parser.add_argument("--quick", action="store_true", help=f"batch {QUICK_BATCHES}, hidden {QUICK_HIDDENS} only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks.rnn_kernels needs a CUDA GPU")
    torch.manual_seed(0)
    batches, hiddens = (QUICK_BATCHES, QUICK_HIDDENS) if args.quick else (BATCHES, HIDDENS)
    rows = []
    for hidden_size in hiddens:
        for batch_size in batches:
            for precision in ("fp32", "bf16"):
                rows.append(measure(batch_size, hidden_size, precision))
                print(json.dumps(rows[-1]), flush=True)
                if args.json:  # rewritten after every row, so a run cut short keeps what it measured
                    write_json(args.json, rows, batches, hiddens)
    print_table(rows)


def write_json(path, rows, batches, hiddens):
    properties = torch.cuda.get_device_properties(0)
    result = {
        "device": torch.cuda.get_device_name(0),
        "multiprocessors": properties.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(),
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "config": {"num_steps": NUM_STEPS, "batches": list(batches), "hiddens": list(hiddens), "cell": "relu",
                   "input_size": "hidden", "warmup": WARMUP, "repeats": REPEATS, "statistic": "median",
                   "command": " ".join(sys.argv)},
        "rows": rows,
    }
    with open(path, "w") as file:
        json.dump(result, file, indent=2)

if __name__ == "__main__":
    main()
