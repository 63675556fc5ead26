"""Training-step time of the same DeepSpeech2 model on each recurrent backend, in one process on one GPU.

    python -m benchmarks.train_step [--models an4 deep] [--backends cudnn persistent]
        [--batches 1 4 8 16 32] [--cuda-graphs] [--frames 300] [--steps 20] [--warmup 5] [--amp bf16|none]
        [--seed 1234] [--timeout-s 300] [--json PATH]

The step is the trainer's own (trainer.step.train_step: forward under --amp's autocast, CTC, backward, gradient
clipping, AdamW) on the trainer's own model and config, as benchmarks.scaling builds them: --models an4 is
experiment=an4_gpu (5 bidirectional GRU layers of 800), deep the same with 7 layers of 1152, deep100 is
experiment=deep100 (100 residual bidirectional GRU layers of 512), cpu_demo experiment=cpu_demo's small model (on the
GPU still). Inputs are random utterances of AN4's shape (benchmarks.scaling.random_batch). Every backend starts from the
same initial weights. Times are medians over --steps after --warmup, each step bracketed by device synchronisation.
Beside each, the GPU time of a step: the summed durations of the kernels and copies that torch.profiler records over
--steps further steps. A step whose wall time is well above its GPU time is bound by the host (Python and ATen
dispatching its hundreds of kernels), not by the GPU. --cuda-graphs adds, for every backend but cuDNN (whose packed
sequences a graph cannot hold), the same step with the model's forward and backward replayed from CUDA graphs, as
train.cuda_graphs=true trains (models.cuda_graphs). The persistent kernels run at most 32 utterances, fewer for large
layers; a shape they refuse is recorded with the reason, not timed.
"""
if __name__ == "__main__":  # first: the imports below take seconds (torch), in which a signal printed a
    # traceback (Ctrl-C) or ended the tool without a word (SIGTERM)
    from data.cli import end_at_once_on_a_signal

    end_at_once_on_a_signal()

import argparse
import gc
import json
import platform
import sys

import torch
from omegaconf import OmegaConf

from benchmarks.scaling import (MODELS, TIMEOUT_FLAG, add_seed_flag, add_timeout_flag, compose_config,
                                layers_in_words, model_optimizer_schedule, random_batch, refuse_graphs_without_warmup,
                                summary, time_ms)
from models.cuda_graphs import CudaGraphed
from prnn_kernels.persistent import directions_run_together, support
from trainer import build, distributed, launch_ranks
from trainer.cli import (DEFAULT_JSON_HELP, EachOnce, int_at_least, json_file, json_output, positive_int, run_tool,
                         say_written, write_results)
from trainer.environment import command_line, device_name, refuse_without_gpu, versions
from trainer.step import train_step


def persistent_verdict(cfg, batch_size: int, device) -> dict:
    """Whether the model's recurrent layers run on the persistent kernels at this batch, and both directions of a
    layer in one launch."""
    dtype = build.compute_dtype(cfg.train.amp, device)
    model = cfg.model
    verdict = support(model.cell, model.hidden, batch_size, dtype, device)
    together = verdict.ok and model.bidirectional and directions_run_together(
        model.cell, model.hidden, batch_size, dtype, device
    )
    return {"supported": verdict.ok, "reason": verdict.reason, "directions_in_one_launch": together}


def gpu_ms_per_call(function, num_calls: int) -> float:
    """Milliseconds of GPU work per call: the kernels and copies of `num_calls` calls, as torch.profiler records
    them (one stream, so their durations add up to the time the GPU was busy)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(num_calls):
            function()
        torch.cuda.synchronize()
    busy_us = sum(event.device_time_total for event in profiler.key_averages()
                  if event.device_type == torch.autograd.DeviceType.CUDA)
    return busy_us / 1e3 / num_calls


def measure(args, model_name: str, backend: str, cuda_graphs: bool, batch_size: int, device) -> dict:
    cfg = compose_config(model_name, backend, None, args.amp)
    amp = build.uses_amp(cfg.train.amp, device)
    row = {"model": model_name, "backend": backend, "cuda_graphs": cuda_graphs, "batch": batch_size}
    if backend == "persistent":
        row["persistent"] = persistent_verdict(cfg, batch_size, device)
        if not row["persistent"]["supported"]:
            return row
    num_features = build.features(cfg.data).num_features
    # The same seed for every backend: the same initial weights.
    model, optimizer, schedule = model_optimizer_schedule(cfg, num_features, args.seed, device)
    batch = random_batch(batch_size, args.frames, num_features, args.seed, device)
    env = distributed.DistEnv(0, 1, device)
    # The frame count is fixed, so padding to a multiple of it makes one graph, captured in the warm-up.
    network = CudaGraphed(model, args.frames, amp) if cuda_graphs else model
    step = lambda: train_step(network, batch, optimizer, schedule, cfg, env)
    times = time_ms(step, args.warmup, args.steps, device)
    row.update(summary(times), gpu_ms=gpu_ms_per_call(step, args.steps),
               parameters=sum(p.numel() for p in model.parameters()),
               peak_memory_gb=torch.cuda.max_memory_allocated(device) / 1e9)
    row["samples_per_s"] = batch_size / row["median_ms"] * 1e3
    return row


def add_speedups(rows: list[dict]) -> None:
    """speedup_over_cudnn on each other row: cuDNN's median step time over its own, same model and batch."""
    cudnn = {(r["model"], r["batch"]): r["median_ms"] for r in rows if r["backend"] == "cudnn" and "median_ms" in r}
    for row in rows:
        key = (row["model"], row["batch"])
        if row["backend"] != "cudnn" and "median_ms" in row and key in cudnn:
            row["speedup_over_cudnn"] = cudnn[key] / row["median_ms"]


def print_table(rows: list[dict], configs: dict) -> None:
    for model_name, model_config in configs.items():
        print(f"{model_name}: {layers_in_words(model_config)}")
    header = (f"{'model':<7} {'backend':<19} {'batch':>5} {'median ms':>10} {'GPU ms':>7} {'samples/s':>10} "
              f"{'peak GB':>8} {'speed-up':>9}")
    print(header)
    print("-" * len(header))
    for row in rows:
        backend = row["backend"] + (" + graphs" if row["cuda_graphs"] else "")
        if "median_ms" not in row:
            print(f"{row['model']:<7} {backend:<19} {row['batch']:>5}   refused: {row['persistent']['reason']}")
            continue
        speedup = f"{row['speedup_over_cudnn']:>8.2f}x" if "speedup_over_cudnn" in row else f"{'':>9}"
        print(f"{row['model']:<7} {backend:<19} {row['batch']:>5} {row['median_ms']:>10.2f} "
              f"{row['gpu_ms']:>7.2f} {row['samples_per_s']:>10.1f} {row['peak_memory_gb']:>8.2f} {speedup}")


def main(argv=None) -> int | None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.train_step", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--models", nargs="+", action=EachOnce, choices=sorted(MODELS), default=["an4", "deep"])
    parser.add_argument("--backends", nargs="+", action=EachOnce, choices=("cudnn", "persistent", "reference"),
                        default=["cudnn", "persistent"])
    parser.add_argument("--batches", nargs="+", action=EachOnce, type=positive_int, default=[1, 4, 8, 16, 32])
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="also time each backend but cuDNN with the model's passes replayed from CUDA graphs")
    parser.add_argument("--frames", type=int_at_least(10), default=300,
                        help="feature frames of the longest utterance (10 ms each)")
    parser.add_argument("--steps", type=positive_int, default=20, help="timed steps per point")
    parser.add_argument("--warmup", type=int_at_least(0), default=5, help="untimed steps before each point")
    parser.add_argument("--amp", choices=("bf16", "none"), default="bf16", help="autocast, as the trainer's train.amp")
    add_seed_flag(parser)
    add_timeout_flag(parser)
    parser.add_argument("--json", metavar="PATH", type=json_output,
                        help="write the results, versions and configuration here" + DEFAULT_JSON_HELP)
    args = parser.parse_args(argv)
    refuse_graphs_without_warmup(parser, args)
    if refuse_without_gpu("benchmarks.train_step"):
        return 2
    args.json = json_file(args.json, __file__)
    device = distributed.init("cuda", args.timeout_s, timeout_setting=TIMEOUT_FLAG).device
    torch.cuda.init()  # before the memory statistics are reset
    configs = {name: OmegaConf.to_container(compose_config(name, "cudnn", None, args.amp).model)
               for name in args.models}
    # Before the rows: the checkout may be edited, or switched, while they are measured.
    measured_on = {"benchmark": "train_step", "device": device_name(device), "host": platform.node(),
                   "versions": versions(device)}
    rows = []
    for model_name in args.models:
        for batch_size in args.batches:
            variants = [(backend, False) for backend in args.backends]
            if args.cuda_graphs:
                variants += [(backend, True) for backend in args.backends if backend != "cudnn"]
            for backend, cuda_graphs in variants:
                torch.cuda.reset_peak_memory_stats(device)
                rows.append(measure(args, model_name, backend, cuda_graphs, batch_size, device))
                # A graphed row's model sits in a reference cycle (torch.cuda.make_graphed_callables points the
                # module's forward at a closure holding the module), so only the cyclic collector frees it: left to
                # run when it will, its weights and gradients counted in the next rows' peak memory.
                gc.collect()
                torch.cuda.empty_cache()
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "times_ms"}), flush=True)
                add_speedups(rows)
                # Rewritten after every row, so a run cut short keeps what it measured.
                write_json(args, measured_on, rows, configs, so_far=True)
    print(f"training step on {device_name(device)}, {args.frames} frames, amp {args.amp}")
    print_table(rows, configs)
    write_json(args, measured_on, rows, configs)
    say_written(args.json)
    distributed.shutdown(args.timeout_s, TIMEOUT_FLAG)


def write_json(args, measured_on: dict, rows: list[dict], configs: dict, so_far: bool = False) -> None:
    result = {**measured_on, "config": {**vars(args), "model_configs": configs, "command": command_line()},
              "rows": rows}
    write_results(args.json, result, so_far)


if __name__ == "__main__":
    launch_ranks.refuse_unusable_launch()
    sys.exit(run_tool(main))
