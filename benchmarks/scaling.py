"""Strong scaling of the training step at a fixed global batch, one process per GPU over MPI.

    mpirun -np N python -m benchmarks.scaling [--model an4|deep|deep100|cpu_demo] [--global-batch 8]
        [--backend auto|cudnn|persistent|reference] [--cell relu|tanh|gru|lstm] [--steps 20] [--warmup 5]
        [--frames 300] [--compute-batches 1 2 4 ...] [--amp bf16|none] [--device auto|cpu|cuda] [--cuda-graphs]
        [--seed 1234] [--timeout-s 300] [--json PATH] [--baseline ONE_GPU.json]

Each rank trains on global_batch / N random utterances of AN4's shape (--frames frames of the recipe's features,
lengths ragged between 80% and 100% of that, about 12 characters a second of random targets). The step is the
trainer's own (trainer.step.train_step) on the trainer's own model, optimizer and config (conf/ composed by Hydra:
--model an4 is experiment=an4_gpu, 5 bidirectional GRU layers of 800 over 161 spectrogram features; deep the same
with 7 layers of 1152; deep100 experiment=deep100, 100 residual bidirectional GRU layers of 512; cpu_demo the small
model of experiment=cpu_demo, sized for a CPU smoke test). --cuda-graphs
replays the model's forward and backward from CUDA graphs as train.cuda_graphs=true does (models.cuda_graphs), in
every measure that runs the step.

Times are medians over --steps after --warmup; each one is bracketed by device synchronisation, follows a barrier,
and is the slowest rank's time for that step:
  step             the training step with DDP (no DDP in a world of one)
  step no_sync     the same step inside DDP's no_sync(): no gradient allreduce (sync batch norm still talks)
  exposed comm     step - step no_sync: the gradient communication that backward did not hide
  allreduce        one all_reduce of a flat fp32 buffer as large as all gradients (what DDP reduces, in one piece);
                   bus bandwidth = 2 (N - 1) / N * bytes / time, as nccl-tests reports it
  compute          the step on each rank alone (no DDP, no sync batch norm) at several per-rank batches: the fixed
                   and per-sample cost that benchmarks.scaling_model projects from
Strong-scaling efficiency, with --baseline (this script's JSON from one GPU of the same kind, same settings):
t(1) / (N * t(N)).
"""
if __name__ == "__main__":  # first: the imports below take seconds (torch), in which a signal printed a
    # traceback (Ctrl-C) or ended the tool without a word (SIGTERM)
    from data.cli import end_at_once_on_a_signal

    end_at_once_on_a_signal()

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from benchmarks.fields import COUNT, POSITIVE, DamagedFile, field
from data.cli import Terminated, input_path, signals_raise, stdout_failures_end_the_tool, stopped_line
from data.dataset import Batch
from data.text import NUM_CLASSES, counted
from models import MaskedBatchNorm
from models.cuda_graphs import CudaGraphed, check_capturable
from models.deepspeech2 import CELLS
from prnn_kernels import BACKENDS
from trainer import build, distributed, launch_ranks
from trainer.cli import (DEFAULT_JSON_HELP, EachOnce, check_not_an_input, int_at_least, json_file, json_output,
                         positive_int, say_written, seconds_up_to, write_results)
from trainer.config import MAX_SEED
from trainer.distributed import DistEnv
from trainer.environment import command_line, device_name, versions
from trainer.step import train_step

CONF = Path(__file__).resolve().parent.parent / "conf"
# --model: the conf/experiment/ preset and further overrides.
MODELS = {
    "an4": ("an4_gpu", []),
    "deep": ("an4_gpu", ["model.depth=7", "model.hidden=1152"]),
    "deep100": ("deep100", []),
    "cpu_demo": ("cpu_demo", []),
}
# Characters per 10 ms feature frame in the random targets: AN4 speakers say about 12 characters a second.
CHARS_PER_FRAME = 0.12
# DistributedDataParallel's default gradient bucket, recorded for benchmarks.scaling_model.
DDP_BUCKET_CAP_MB = 25


def compose_config(model_name: str, backend: str, cell: str | None, amp: str):
    """The trainer's own config (conf/, composed by Hydra) for one of MODELS, with the recurrent `backend`, `cell`
    (None: the recipe's) and autocast setting."""
    experiment, model_overrides = MODELS[model_name]
    overrides = [f"experiment={experiment}", f"model.backend={backend}", f"train.amp={amp}", *model_overrides]
    if cell:
        overrides.append(f"model.cell={cell}")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def random_batch(batch_size: int, num_frames: int, num_features: int, seed: int, device: torch.device) -> Batch:
    """One padded batch, already on `device`. The first utterance is `num_frames` long, as the longest one of a
    length-bucketed batch is; the others 80-100 % of that."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(batch_size, num_frames, num_features, generator=generator)
    lengths = torch.randint(int(0.8 * num_frames), num_frames + 1, (batch_size,), generator=generator)
    lengths[0] = num_frames
    target_lengths = (lengths * CHARS_PER_FRAME).long().clamp_min(1)
    targets = torch.randint(1, NUM_CLASSES, (int(target_lengths.sum()),), generator=generator)
    batch = Batch(features, lengths, targets, target_lengths, torch.arange(batch_size))
    return batch.to(device)


def model_optimizer_schedule(cfg, num_features: int, seed: int, device: torch.device):
    """The trainer's model on `device`, its weights drawn from `seed`, with its optimizer and learning-rate schedule."""
    torch.manual_seed(seed)
    model = build.model(cfg.model, num_features).to(device)
    optimizer = build.optimizer(cfg.optim, model.parameters())
    # The epoch length only places the rate's anneal steps, which change no step's time.
    schedule = build.lr_schedule(cfg.optim, optimizer, steps_per_epoch=1000)
    return model, optimizer, schedule


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(function, num_warmup: int, num_steps: int, device: torch.device) -> list[float]:
    """Milliseconds of each of `num_steps` calls after `num_warmup`: for each call, the slowest rank's time."""
    for _ in range(num_warmup):
        function()
    times = []
    for _ in range(num_steps):
        synchronize(device)
        distributed.barrier()
        start = time.perf_counter()
        function()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def summary(times_ms: list[float], **fields) -> dict:
    return {**fields, "median_ms": statistics.median(times_ms), "times_ms": times_ms}


def allreduce_bus_GBps(num_bytes: int, seconds: float, world_size: int) -> float:
    """An all-reduce's bus bandwidth as nccl-tests reports it: num_bytes / seconds (its algorithm bandwidth) times
    2 (N - 1) / N, what a ring sends over each rank's link for every byte reduced, so that it reads against the link's
    speed at any N (none at N = 1, where nothing is sent)."""
    return 2 * (world_size - 1) / world_size * num_bytes / seconds / 1e9


# Far past the few kilobytes this script writes.
MAX_RESULT_BYTES = 64 << 20


def read_result(path: str) -> dict:
    """A JSON that this script wrote, read from `path`, with the world_size and config every reader takes from it
    (config.cuda_graphs false where it predates --cuda-graphs); DamagedFile in one line naming the file where it cannot
    be read, is not JSON or is not this script's. The one reader of the format: --baseline and
    benchmarks.scaling_model's --measured refused the same bad file in other words."""
    try:
        with open(path, "rb") as file:
            text = file.read(MAX_RESULT_BYTES + 1)
    except OSError as error:  # a folder, a missing file: its own text was "[Errno 21] Is a directory: 'PATH'"
        raise DamagedFile(f"{path}: {error.strerror or error}") from None
    if len(text) > MAX_RESULT_BYTES:  # /dev/zero, or a pipe that never ends: read whole, it took all the memory
        raise DamagedFile(f"{path} is larger than {MAX_RESULT_BYTES >> 20} MiB, which no benchmarks.scaling JSON is")
    try:
        result = json.loads(text)
    except ValueError as error:  # not JSON (or not UTF-8): its own text names no file
        raise DamagedFile(f"{path} is not JSON: {error}") from None
    if not isinstance(result, dict) or result.get("benchmark") != "scaling":
        raise DamagedFile(f'{path} is not a benchmarks.scaling JSON (no "benchmark": "scaling")')
    field(path, result, "world_size", kind=COUNT)
    field(path, result, "config", kind="an object")
    result["config"].setdefault("cuda_graphs", False)  # JSONs from before --cuda-graphs ran without
    return result


# Settings a baseline must share with the run it is compared with.
COMPARABLE = ("model_config", "global_batch", "frames", "amp", "num_features", "cuda_graphs")


def read_baseline(path: str, config: dict, device: str) -> dict:
    """A world-of-one JSON of this script with the same COMPARABLE settings as `config`, on `device` (device_name)."""
    baseline = read_result(path)
    if baseline["world_size"] != 1:
        raise ValueError(f"--baseline {path} must be a benchmarks.scaling JSON from one process, not "
                         f"{baseline['world_size']}")
    for key in COMPARABLE:
        if baseline["config"].get(key) != config[key]:
            raise ValueError(f"--baseline {path} has {key}={baseline['config'].get(key)!r}, this run {config[key]!r}")
    # A CPU's name ends in its threads per rank, which the world size changes.
    if field(path, baseline, "device", kind="a string").split(" (")[0] != device.split(" (")[0]:
        raise ValueError(f"--baseline {path} ran on {baseline['device']}, this run on {device}: an efficiency "
                         "compares one kind of device")
    # The efficiency's t(1), read after every measure: without it the run ended in a traceback there, unwritten.
    field(path, baseline, "step", "median_ms", kind=POSITIVE)
    return baseline


def layers_in_words(model_config: dict) -> str:
    """The model's recurrent layers as the benchmarks' tables name them: "5 x bi-GRU 800"."""
    bidirectional = "bi-" if model_config["bidirectional"] else ""
    return f"{model_config['depth']} x {bidirectional}{model_config['cell'].upper()} {model_config['hidden']}"


def print_table(result: dict) -> None:
    config, model = result["config"], result["model"]
    print(
        f"DeepSpeech2 {config['model']} ({layers_in_words(config['model_config'])}, "
        f"{build.millions_or_billions(model['parameters'])} parameters, "
        f"{model['gradient_bytes'] / 1e6:.1f} MB of gradients), backend {config['backend']}"
        f"{' + CUDA graphs' if config['cuda_graphs'] else ''}, "
        f"{result['world_size']} x {result['device']}, global batch {config['global_batch']}, "
        f"{config['frames']} frames, {'bf16' if config['amp'] else 'fp32'}"
    )
    header = f"{'measure':<28} {'per-rank batch':>14} {'median ms':>10} {'samples/s':>10}"
    print(header)
    print("-" * len(header))

    def row(name, entry, global_samples=None):
        rate = f"{global_samples / entry['median_ms'] * 1e3:>10.1f}" if global_samples else f"{'':>10}"
        batch = entry.get("per_rank_batch", "")
        print(f"{name:<28} {batch:>14} {entry['median_ms']:>10.3f} {rate}")

    row("step", result["step"], config["global_batch"])
    if result["world_size"] > 1:
        row("step no_sync", result["step_no_sync"], config["global_batch"])
        print(f"{'exposed comm':<28} {'':>14} {result['exposed_communication_ms']:>10.3f}")
        allreduce = result["allreduce"]
        bus = f"bus {allreduce['bus_GBps']:.1f} GB/s"
        print(f"{'allreduce (flat)':<28} {'':>14} {allreduce['median_ms']:>10.3f}   {bus}")
    for entry in result["compute"]:
        row("compute, one rank alone", entry, entry["per_rank_batch"])
    if "baseline" in result:
        print(f"strong-scaling efficiency t(1) / ({result['world_size']} t({result['world_size']})): "
              f"{result['baseline']['strong_scaling_efficiency']:.3f}  (t(1) = {result['baseline']['step_ms']:.3f} ms)")


def measure(args, env: DistEnv, cfg, config: dict, baseline: dict | None) -> dict:
    """Every measure of the docstring on this rank; returns the result that rank 0 prints and writes."""
    device = env.device
    # Before the timings: the checkout may be edited, or switched, while they run.
    measured_on = {"device": device_name(device), "host": platform.node(), "versions": versions(device)}
    num_features = config["num_features"]
    # The same seed on every rank: the same initial model.
    model, optimizer, schedule = model_optimizer_schedule(cfg, num_features, args.seed, device)
    num_parameters = sum(p.numel() for p in model.parameters())

    def graphed(network):
        """The model as the trainer runs it under train.cuda_graphs: a new instance captures afresh."""
        return CudaGraphed(network, cfg.train.graph_pad_frames, config["amp"]) if args.cuda_graphs else network

    def step_on(network, per_rank_batch, world_size):
        batch = random_batch(per_rank_batch, args.frames, num_features, args.seed + env.rank, device)
        step_env = DistEnv(env.rank, world_size, device)
        return lambda: train_step(network, batch, optimizer, schedule, cfg, step_env)

    def timed(function):
        return time_ms(function, args.warmup, args.steps, device)

    # Every batch asked first: backend=persistent raises, naming why, at a batch its kernels cannot run, and under
    # --cuda-graphs a batch run on cuDNN is refused, either of which would otherwise end the run after the smaller
    # batches' measures, with nothing written.
    per_rank_batch = args.global_batch // env.world_size
    dtype = build.compute_dtype(cfg.train.amp, device)

    def check_runs(batch_size):
        model.recurrent_backend(batch_size, dtype, device)
        if args.cuda_graphs:  # backend=auto runs a batch past the kernels' on cuDNN, whose capture would fail
            check_capturable(model, batch_size, dtype, device)

    try:
        check_runs(1)
    except ValueError as error:  # refused whatever the batch (on a CPU, say): no batch option is why
        raise ValueError(f"--backend {args.backend}: {error}") from None
    for batch_size in sorted({*args.compute_batches, per_rank_batch}):
        try:
            check_runs(batch_size)
        except ValueError as error:
            given_by = ("--compute-batches names the batches measured" if batch_size in args.compute_batches else
                        f"the step's: --global-batch {args.global_batch} over {counted(env.world_size, 'rank')}")
            raise ValueError(f"per-rank batch {batch_size}: {error} ({given_by})") from None

    # Compute alone first, while the model is not yet wrapped: each rank on its own, as in a world of one.
    alone = graphed(model)
    compute = [
        summary(timed(step_on(alone, batch_size, 1)), per_rank_batch=batch_size) for batch_size in args.compute_batches
    ]
    result = {
        "benchmark": "scaling",
        "world_size": env.world_size,
        **measured_on,
        "command": command_line(),
        "config": config,
        "model": {
            "parameters": num_parameters,
            "gradient_bytes": 4 * num_parameters,  # fp32 gradients: autocast leaves parameters in fp32
            "sync_batch_norm_channels": [m.weight.numel() for m in model.modules() if isinstance(m, MaskedBatchNorm)],
            "ddp_bucket_cap_mb": DDP_BUCKET_CAP_MB,
        },
        "compute": compute,
    }
    if env.world_size == 1:
        result["step"] = summary(timed(step_on(alone, per_rank_batch, 1)), per_rank_batch=per_rank_batch)
    else:
        # Graphs captured from here on hold the batch norms' all-reduces.
        model.sync_batch_norm(cfg.train.sync_batch_norm)
        wrapped = distributed.data_parallel(graphed(model), device, args.cuda_graphs, bucket_cap_mb=DDP_BUCKET_CAP_MB)
        step = step_on(wrapped, per_rank_batch, env.world_size)
        result["step"] = summary(timed(step), per_rank_batch=per_rank_batch)

        def step_without_sync():
            with wrapped.no_sync():
                step()

        result["step_no_sync"] = summary(timed(step_without_sync), per_rank_batch=per_rank_batch)
        result["exposed_communication_ms"] = result["step"]["median_ms"] - result["step_no_sync"]["median_ms"]
        flat = torch.zeros(num_parameters, dtype=torch.float32, device=device)
        allreduce = summary(timed(lambda: dist.all_reduce(flat)), bytes=flat.numel() * flat.element_size())
        allreduce["bus_GBps"] = allreduce_bus_GBps(allreduce["bytes"], allreduce["median_ms"] * 1e-3, env.world_size)
        result["allreduce"] = allreduce
    result["step"]["samples_per_s"] = args.global_batch / result["step"]["median_ms"] * 1e3
    if baseline:
        one, many = baseline["step"]["median_ms"], result["step"]["median_ms"]
        result["baseline"] = {
            "path": args.baseline, "step_ms": one, "strong_scaling_efficiency": one / (env.world_size * many)
        }

    return result


TIMEOUT_FLAG = "--timeout-s"


def add_timeout_flag(parser: argparse.ArgumentParser) -> None:
    """The benchmarks' own distributed.timeout_s, which trainer.distributed's lines of a wait that ran out name."""
    parser.add_argument(TIMEOUT_FLAG, type=seconds_up_to(distributed.MAX_TIMEOUT_S),
                        default=distributed.DEFAULT_TIMEOUT_S,
                        help="seconds MPI's start, the ranks' rendezvous and the job's end wait for every rank before "
                             "one ends the job")


def add_seed_flag(parser: argparse.ArgumentParser) -> None:
    """The seed of the benchmark's model and inputs, in the trainer's range."""
    parser.add_argument("--seed", type=int_at_least(0, MAX_SEED), default=1234, help="0 to 2**32 - 1, as the trainer's")


def refuse_graphs_without_warmup(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A usage error where --cuda-graphs comes with --warmup 0: the graphs are captured in the first step."""
    if args.cuda_graphs and args.warmup < 1:
        parser.error("--cuda-graphs needs --warmup of at least 1: the graphs' capture would be timed")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.scaling", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="an4")
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="of the recurrent layers")
    parser.add_argument("--cell", choices=CELLS, help="recurrent cell instead of the recipe's")
    parser.add_argument("--global-batch", type=int, default=8, help="utterances per step over all ranks")
    parser.add_argument("--frames", type=int_at_least(10), default=300,
                        help="feature frames of the longest utterance (10 ms each)")
    parser.add_argument("--steps", type=positive_int, default=20, help="timed steps per measure")
    parser.add_argument("--warmup", type=int_at_least(0), default=5, help="untimed steps before each measure")
    parser.add_argument("--compute-batches", type=positive_int, nargs="+", action=EachOnce,
                        default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
                        help="per-rank batches of the compute-only measure (the projection's range)")
    parser.add_argument("--amp", choices=("bf16", "none"), default="bf16", help="autocast on a GPU; a CPU runs fp32")
    parser.add_argument("--device", choices=distributed.DEVICES, default="auto")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="the step as train.cuda_graphs=true runs it (a GPU, the persistent backend, NCCL)")
    add_seed_flag(parser)
    add_timeout_flag(parser)
    parser.add_argument("--json", metavar="PATH", type=json_output,
                        help="rank 0 writes the results, versions and full configuration here" + DEFAULT_JSON_HELP)
    parser.add_argument("--baseline", type=input_path,
                        help="this script's JSON from one process: report strong-scaling efficiency")
    args = parser.parse_args(argv)
    refuse_graphs_without_warmup(parser, args)

    if args.device == "cuda" and not torch.cuda.is_available():  # else the trainer's refusal, naming its settings
        raise ValueError("--device cuda: no CUDA GPU is visible; --device cpu measures on the CPU")
    env = distributed.init(args.device, args.timeout_s, timeout_setting=TIMEOUT_FLAG)
    if args.global_batch < 1 or args.global_batch % env.world_size:
        raise ValueError(
            f"--global-batch {args.global_batch} must be a positive multiple of the world size {env.world_size}"
        )
    # Written after the measures, it would replace the one-process JSON that this and every later efficiency needs.
    check_not_an_input(args.json, [args.baseline] if args.baseline else [])
    device = env.device
    if args.device == "auto" and device.type == "cpu" and args.model != "cpu_demo":
        raise ValueError(f"no GPU here, and the {args.model} model's measures would take hours on a CPU: pass --model "
                         "cpu_demo for the CPU's smoke test, or --device cpu to measure it anyway")
    if args.cuda_graphs and device.type != "cuda":
        raise ValueError(f"--cuda-graphs needs a GPU, this run is on {device}")
    cfg = compose_config(args.model, args.backend, args.cell, args.amp)
    num_features = build.features(cfg.data).num_features
    config = {
        **{key: value for key, value in vars(args).items() if key not in ("json", "baseline")},
        "amp": build.uses_amp(args.amp, device),
        "num_features": num_features,
        "model_config": OmegaConf.to_container(cfg.model),
        "trainer_config": OmegaConf.to_container(cfg, resolve=True),
    }
    baseline = read_baseline(args.baseline, config, device_name(device)) if args.baseline else None
    if env.is_main:
        args.json = json_file(args.json, __file__)
        print(f"measuring the {args.model} model on {env.world_size} x {device_name(device)}, compute batches "
              f"{args.compute_batches}, global batch {args.global_batch}", flush=True)

    result = measure(args, env, cfg, config, baseline)
    if env.is_main:
        print_table(result)
        write_results(args.json, result)
        say_written(args.json)
    distributed.shutdown(args.timeout_s, TIMEOUT_FLAG)


if __name__ == "__main__":
    launch_ranks.refuse_unusable_launch()
    with stdout_failures_end_the_tool():  # --help | head
        try:
            signals_raise()
            main()
        except (FileNotFoundError, ValueError) as error:
            print(f"error on rank {launch_ranks.launcher_rank()}: {error}", file=sys.stderr)
            distributed.abort_job(2)
        except (KeyboardInterrupt, Terminated) as stopped:  # its results are written once, at the end: none yet
            line, code = stopped_line(stopped)
            print(f"{line} on rank {launch_ranks.launcher_rank()}", file=sys.stderr)
            distributed.abort_job(code)
        except Exception:
            print(f"benchmark failed on rank {launch_ranks.launcher_rank()}:\n{traceback.format_exc()}",
                  file=sys.stderr)
            distributed.abort_job(1)
