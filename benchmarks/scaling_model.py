"""Projected strong-scaling efficiency on many GPUs, from one benchmarks.scaling measurement and an allreduce model.

    python -m benchmarks.scaling_model --measured PATH.json --out DIR [--global-batch 128 512] [--overlap ...]
        [--gpus 1 2 4 8 16 32 64 128] [cluster options, see --help]

Writes DIR/scaling_projection.png (efficiency and step-time breakdown against GPUs), DIR/scaling_projection.md
(the assumptions and the tables) and DIR/scaling_projection.json (the same as data).

At global batch G on N GPUs each GPU trains b = G / N utterances per step, and a step takes
    t(N) = compute(b) + small collectives(N) + exposed gradient allreduce(N, b)
  compute(b)          the measured compute-only step time at per-GPU batch b ("compute" in the JSON), linear between
                      measured batches and, beyond them, extended at the per-sample cost of the nearest measured
                      interval: a fixed per-step part plus b times a per-sample part, the latter never negative
                      (a dip between two measured batches is timing noise, not a batch that computes faster)
  small collectives   latency-bound allreduces on the critical path: the trainer's utterance and stop-signal counts
                      before the step and its loss after the backward (and under CUDA graphs the shards' shape), and
                      for each synchronised batch norm one allreduce of its statistics forward (3 fp32 numbers per
                      channel) and one of their gradients backward (2 per channel)
  gradient allreduce  DDP's gradient buckets (fp32 gradients in buckets of the recorded cap, 25 MB), each allreduced
  exposed             gradient allreduce - min(overlap * gradient allreduce, backward share * compute(b)): DDP hides
                      the `overlap` fraction of it behind backward, but never more than backward lasts
Strong-scaling efficiency(N) = t(1) / (N t(N)), with t(1) = compute(G): one GPU, the whole global batch, no
communication (whether G fits in one GPU's memory is not modelled).

Allreduce of S bytes over n GPUs in a ring: 2 (n-1)/n * S / bandwidth + 2 (n-1) * latency per hop. Inside a node
of `gpus-per-node` GPUs the ring runs over NVLink. Across nodes it is hierarchical: reduce-scatter inside each node,
then each GPU allreduces its S / g shard in a ring over the nodes (the g rings of a node share its NICs), then
all-gather inside the node; the in-node reduce-scatter plus all-gather cost exactly one in-node ring allreduce.
"""
if __name__ == "__main__":  # first: the imports below take seconds (torch), in which a signal printed a
    # traceback (Ctrl-C) or ended the tool without a word (SIGTERM)
    from data.cli import end_at_once_on_a_signal

    end_at_once_on_a_signal()

import argparse
import bisect
import importlib
import math
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.fields import COUNT, POSITIVE, field
from benchmarks.scaling import read_result
from data.cli import input_path
from data.dataset import UNUSABLE_REASONS
from trainer.cli import (EachOnce, output_file, positive_int, run_tool, write_binary_output, write_output,
                         write_results)
from trainer.stop import STOP_SIGNALS

# The allreduces of trainer.step.train_step, in bytes: the utterance counts and each stop signal's count of ranks that
# received it (float64 numbers: the shard's utterances, whether it is empty, its unusable ones by reason, then one a
# signal) and the loss (one float32), and under CUDA graphs the shards' shape (three float64 numbers) besides.
STEP_ALLREDUCE_BYTES = (8 * (2 + len(UNUSABLE_REASONS) + len(STOP_SIGNALS)), 4)
GRAPHED_STEP_ALLREDUCE_BYTES = (*STEP_ALLREDUCE_BYTES, 24)
# Synchronised batch norm, per channel in float32: forward its sum, sum of squares and count; backward the sums of
# the gradient and of the gradient times the normalised input.
BATCH_NORM_FORWARD_BYTES_PER_CHANNEL = 3 * 4
BATCH_NORM_BACKWARD_BYTES_PER_CHANNEL = 2 * 4


@dataclass(frozen=True)
class Cluster:
    """The machine the projection assumes; defaults describe H100 / H200 nodes of 8 GPUs (DGX / HGX layout)."""

    gpus_per_node: int = 8
    nvlink_GBps: float = 450.0  # per GPU and direction: NVLink 4, 18 links x 25 GB/s, through NVSwitch
    nvlink_latency_us: float = 2.0  # per ring hop inside a node
    nic_Gbps: float = 400.0  # per NIC (InfiniBand NDR / 400 GbE)
    nics_per_node: int = 8  # one NIC per GPU, as on DGX H100 / H200
    network_latency_us: float = 8.0  # per ring hop between nodes

    def network_GBps_per_ring(self, rings_per_node: int) -> float:
        """Bandwidth of each of `rings_per_node` concurrent inter-node rings: the node's NICs shared among them."""
        return self.nics_per_node * self.nic_Gbps / 8 / rings_per_node

    def can_model(self, num_gpus: int) -> bool:
        """Whether allreduce_s models `num_gpus`: part of one node, or whole nodes."""
        return num_gpus <= self.gpus_per_node or num_gpus % self.gpus_per_node == 0


def ring_allreduce_s(num_bytes: float, num_ranks: int, bandwidth_GBps: float, latency_us: float) -> float:
    """Seconds to allreduce `num_bytes` over a ring of `num_ranks`: reduce-scatter then all-gather."""
    if num_ranks == 1:
        return 0.0
    hops = num_ranks - 1
    return 2 * hops / num_ranks * num_bytes / (bandwidth_GBps * 1e9) + 2 * hops * latency_us * 1e-6


def allreduce_s(num_bytes: float, num_gpus: int, cluster: Cluster) -> float:
    """Seconds to allreduce `num_bytes` over `num_gpus`: one ring within a node, hierarchical across nodes."""
    in_node = min(num_gpus, cluster.gpus_per_node)
    num_nodes = num_gpus // in_node
    assert cluster.can_model(num_gpus), "validated by check_gpu_counts and main"
    inside = ring_allreduce_s(num_bytes, in_node, cluster.nvlink_GBps, cluster.nvlink_latency_us)
    across = ring_allreduce_s(
        num_bytes / in_node, num_nodes, cluster.network_GBps_per_ring(in_node), cluster.network_latency_us
    )
    return inside + across


def check_gpu_counts(gpu_counts: list[int], cluster: Cluster) -> None:
    for num_gpus in gpu_counts:
        if not cluster.can_model(num_gpus):
            raise ValueError(
                f"--gpus {num_gpus} must be at most --gpus-per-node {cluster.gpus_per_node} or a multiple of it"
            )


class Measurement:
    """What the projection takes from a benchmarks.scaling JSON: compute time per per-GPU batch, gradient bytes,
    synchronised batch norms, DDP's bucket cap, and (from a run on several GPUs) the measured overlap and efficiency."""

    def __init__(self, path: str):
        self.path = path
        self.data = data = read_result(path)
        num_points = len(self.list_field("compute", kind="an object"))
        points = sorted((self.field("compute", index, "per_rank_batch", kind=COUNT),
                         self.field("compute", index, "median_ms", kind=POSITIVE)) for index in range(num_points))
        self.gradient_bytes = self.field("model", "gradient_bytes", kind=COUNT)
        self.batch_norm_channels = self.list_field("model", "sync_batch_norm_channels", kind=COUNT)
        self.bucket_bytes = self.field("model", "ddp_bucket_cap_mb", kind=POSITIVE) * 1024 * 1024
        self.world_size = data["world_size"]
        self.cuda_graphs = self.field("config", "cuda_graphs", kind="true or false")
        self.batches = [batch for batch, _ in points]
        self.compute_times_ms = [ms for _, ms in points]
        if len(set(self.batches)) != len(self.batches) or len(self.batches) < 2:
            raise ValueError(f"{path}: the compute measure needs at least two distinct per-rank batches, and has "
                             f"{', '.join(map(str, self.batches))}: measure them with benchmarks.scaling "
                             "--compute-batches (1 2 4, say)")

    def field(self, *keys: str | int, kind: str):
        """The measurement's value at `keys`, which must be `kind`, as benchmarks.fields.field refuses it (a string
        where a number belongs ended the run in a TypeError traceback)."""
        return field(self.path, self.data, *keys, kind=kind)

    def list_field(self, *keys: str | int, kind: str) -> list:
        """The list at `keys`, each of its values `kind`, as field refuses them."""
        return [self.field(*keys, index, kind=kind) for index in range(len(self.field(*keys, kind="a list")))]

    def compute_ms(self, batch: float) -> float:
        """Compute-only step time at per-GPU `batch`: piecewise linear through the measured points, and beyond them
        along the extension lines."""
        if not self.is_measured(batch):
            fixed, per_sample = self.extension(upward=batch > self.batches[-1])
            return fixed + per_sample * batch
        index = max(bisect.bisect_left(self.batches, batch), 1)
        (b0, b1), (t0, t1) = self.batches[index - 1 : index + 1], self.compute_times_ms[index - 1 : index + 1]
        return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)

    def extension(self, upward: bool) -> tuple[float, float]:
        """(fixed ms, ms per sample) of the line that extends the measurement above its largest batch (upward) or
        below its smallest: through the nearest measured point at the nearest interval's per-sample cost, never
        negative. A larger batch never computes faster; a measured dip is timing noise, and extended it would reach
        negative times."""
        index = len(self.batches) - 1 if upward else 1
        (b0, b1), (t0, t1) = self.batches[index - 1 : index + 1], self.compute_times_ms[index - 1 : index + 1]
        per_sample = max((t1 - t0) / (b1 - b0), 0.0)
        end_batch, end_ms = (b1, t1) if upward else (b0, t0)
        return end_ms - per_sample * end_batch, per_sample

    def is_measured(self, batch: float) -> bool:
        return self.batches[0] <= batch <= self.batches[-1]

    def measured_overlap(self) -> float | None:
        """The fraction of the flat allreduce's time that DDP hid in the measured step, from a run on several GPUs."""
        if self.world_size == 1:
            return None
        exposed_ms = self.field("exposed_communication_ms", kind="a finite number")
        hidden = 1 - exposed_ms / self.field("allreduce", "median_ms", kind=POSITIVE)
        return min(max(hidden, 0.0), 1.0)


def step(measurement: Measurement, cluster: Cluster, global_batch: int, num_gpus: int, overlap: float,
         backward_share: float) -> dict:
    """The modelled step on `num_gpus` at `global_batch`: its parts in ms, and the strong-scaling efficiency."""
    per_gpu_batch = global_batch // num_gpus
    compute = measurement.compute_ms(per_gpu_batch)
    step_allreduces = GRAPHED_STEP_ALLREDUCE_BYTES if measurement.cuda_graphs else STEP_ALLREDUCE_BYTES
    small = sum(allreduce_s(num_bytes, num_gpus, cluster) for num_bytes in step_allreduces) + sum(
        allreduce_s(BATCH_NORM_FORWARD_BYTES_PER_CHANNEL * channels, num_gpus, cluster)
        + allreduce_s(BATCH_NORM_BACKWARD_BYTES_PER_CHANNEL * channels, num_gpus, cluster)
        for channels in measurement.batch_norm_channels
    )
    num_full_buckets, last_bucket = divmod(measurement.gradient_bytes, measurement.bucket_bytes)
    gradient = num_full_buckets * allreduce_s(measurement.bucket_bytes, num_gpus, cluster)
    gradient += allreduce_s(last_bucket, num_gpus, cluster) if last_bucket else 0.0
    small_ms, gradient_ms = small * 1e3, gradient * 1e3
    exposed_ms = gradient_ms - min(overlap * gradient_ms, backward_share * compute)
    step_ms = compute + small_ms + exposed_ms
    return {
        "global_batch": global_batch,
        "gpus": num_gpus,
        "per_gpu_batch": per_gpu_batch,
        "overlap": overlap,
        "compute_ms": compute,
        "compute_extrapolated": not measurement.is_measured(per_gpu_batch),
        "small_collectives_ms": small_ms,
        "gradient_allreduce_ms": gradient_ms,
        "exposed_allreduce_ms": exposed_ms,
        "step_ms": step_ms,
        "samples_per_s": global_batch / step_ms * 1e3,
        "efficiency": measurement.compute_ms(global_batch) / (num_gpus * step_ms),
    }


def projection(measurement, cluster, global_batches, gpu_counts, overlaps, backward_share) -> tuple[list, list]:
    """Rows for every (global batch, GPU count, overlap) whose per-GPU batch is a whole number, and the
    (global batch, GPU count) pairs left out because it is not."""
    rows, left_out = [], []
    for global_batch in global_batches:
        for num_gpus in gpu_counts:
            if global_batch % num_gpus:
                left_out.append((global_batch, num_gpus))
                continue
            rows += [
                step(measurement, cluster, global_batch, num_gpus, overlap, backward_share) for overlap in overlaps
            ]
    return rows, left_out


def model_check(measurement: Measurement, cluster: Cluster, backward_share: float) -> dict | None:
    """The measured efficiency of a multi-GPU run with a baseline, beside the model's for the same run."""
    if "baseline" not in measurement.data or measurement.world_size == 1:
        return None
    global_batch = measurement.field("config", "global_batch", kind=COUNT)
    num_gpus = measurement.world_size
    # No run has one: benchmarks.scaling and the trainer's sampler refuse it. step() would model a per-GPU batch
    # rounded down, against a measurement of something else.
    if global_batch % num_gpus:
        raise ValueError(f"{measurement.path}: config.global_batch {global_batch} is not a multiple of world_size "
                         f"{num_gpus}, as every run's is")
    modelled = step(measurement, cluster, global_batch, num_gpus, measurement.measured_overlap(), backward_share)
    return {
        "global_batch": global_batch,
        "gpus": num_gpus,
        "measured_efficiency": measurement.field("baseline", "strong_scaling_efficiency", kind=POSITIVE),
        "modelled_efficiency": modelled["efficiency"],
        "measured_step_ms": measurement.field("step", "median_ms", kind=POSITIVE),
        "modelled_step_ms": modelled["step_ms"],
        "measured_bus_GBps": measurement.field("allreduce", "bus_GBps", kind=POSITIVE),
    }


def model_description(measurement: Measurement) -> str:
    """The measured model in one phrase, "an4 (5 x bi-gru 800, backend cudnn)", each value checked as field checks it
    (a depth of "x" was printed as it stood, a missing one ended in a KeyError)."""
    measurement.field("config", "model_config", kind="an object")  # a missing one named as such, not by its depth

    def model_field(key: str, kind: str):
        return measurement.field("config", "model_config", key, kind=kind)

    bidirectional = "bi-" if model_field("bidirectional", kind="true or false") else ""
    return (f"{measurement.field('config', 'model', kind='a string')} ({model_field('depth', kind=COUNT)} x "
            f"{bidirectional}{model_field('cell', kind='a string')} {model_field('hidden', kind=COUNT)}, backend "
            f"{model_field('backend', kind='a string')})")


def assumptions(measurement: Measurement, cluster: Cluster, backward_share: float) -> dict:
    first_fixed, first_per_sample = measurement.extension(upward=False)
    last_fixed, last_per_sample = measurement.extension(upward=True)
    return {
        "measured": measurement.path,
        "measured_on": f"{measurement.world_size} x {measurement.field('device', kind='a string')}",
        "model": model_description(measurement),
        "amp_bf16": measurement.field("config", "amp", kind="true or false"),
        "frames": measurement.field("config", "frames", kind=COUNT),
        "gradient_bytes": measurement.gradient_bytes,
        "ddp_bucket_bytes": measurement.bucket_bytes,
        "sync_batch_norm_channels": measurement.batch_norm_channels,
        "cuda_graphs": measurement.cuda_graphs,
        "compute_measured_batches": measurement.batches,
        # The lines the projection extends below and above the measured batches.
        "compute_line_smallest_batches": {"batches": measurement.batches[:2], "fixed_ms": first_fixed,
                                          "per_sample_ms": first_per_sample},
        "compute_line_largest_batches": {"batches": measurement.batches[-2:], "fixed_ms": last_fixed,
                                         "per_sample_ms": last_per_sample},
        "backward_share_of_compute": backward_share,
        "measured_overlap": measurement.measured_overlap(),
        "cluster": asdict(cluster),
        "network_GBps_per_gpu_ring": cluster.network_GBps_per_ring(cluster.gpus_per_node),
    }


def compute_lines(assumed: dict) -> list[dict]:
    """The compute lines the Markdown names: the smallest batches' and the largest's, one line where two batches were
    measured and both are the same."""
    smallest, largest = assumed["compute_line_smallest_batches"], assumed["compute_line_largest_batches"]
    return [smallest] if largest == smallest else [smallest, largest]


def write_markdown(path: Path, assumed: dict, rows: list, left_out: list, check: dict | None, overlaps: list) -> None:
    cluster = assumed["cluster"]
    lines = [
        "# Projected strong scaling",
        "",
        f"Generated by `{assumed['command']}` from `{assumed['measured']}` "
        f"(measured on {assumed['measured_on']}; model {assumed['model']}, {assumed['frames']} frames, "
        f"{'bf16 autocast' if assumed['amp_bf16'] else 'fp32'}). The formulas are in the module's docstring.",
        "",
        "## Assumptions",
        "",
        f"- Compute: the measured compute-only step at per-GPU batches {assumed['compute_measured_batches']}, "
        "linear in between and extended beyond along the nearest interval (its per-utterance cost floored at 0): "
        + "; ".join(f"{line['fixed_ms']:.2f} ms + {line['per_sample_ms']:.3f} ms per utterance through batches "
                    f"{line['batches']}" for line in compute_lines(assumed))
        + ". Per-GPU batches marked * are extrapolated.",
        f"- Gradients: {assumed['gradient_bytes'] / 1e6:.1f} MB of fp32, allreduced in DDP buckets of "
        f"{assumed['ddp_bucket_bytes'] / 2**20:.0f} MiB; backward is {assumed['backward_share_of_compute']:.2f} of "
        "compute and can hide at most that much allreduce.",
        "- Small collectives per step: the trainer's utterance and stop-signal counts and loss"
        + (" and, under CUDA graphs, the shards' shape" if assumed["cuda_graphs"] else "")
        + f"; 2 per synchronised batch norm (channels {assumed['sync_batch_norm_channels']}), latency-bound, not "
        "overlapped (NCCL would pick a tree for these tiny messages at large N; the ring latency here is pessimistic).",
        f"- Inside a node of {cluster['gpus_per_node']} GPUs: NVLink at {cluster['nvlink_GBps']:g} GB/s per GPU and "
        f"direction, {cluster['nvlink_latency_us']:g} us per ring hop.",
        f"- Between nodes: {cluster['nics_per_node']} x {cluster['nic_Gbps']:g} Gb/s NICs per node, "
        f"{assumed['network_GBps_per_gpu_ring']:g} GB/s for each GPU's inter-node ring, "
        f"{cluster['network_latency_us']:g} us per ring hop; hierarchical allreduce (reduce-scatter in node, ring "
        "across nodes, all-gather in node).",
        "- Overlap: the fraction of gradient allreduce DDP hides behind backward. "
        + (f"Measured: {assumed['measured_overlap']:.2f} (1 - exposed / flat allreduce time)."
           if assumed["measured_overlap"] is not None else "Not measured (the measurement ran on one process)."),
        "- Efficiency = t(1) / (N t(N)) with t(1) = compute at the whole global batch on one GPU (the 1-GPU row), "
        "memory permitting.",
        "",
    ]
    if check:
        lines += [
            "## Model against the measurement",
            "",
            f"On {check['gpus']} GPUs at global batch {check['global_batch']}: measured efficiency "
            f"{check['measured_efficiency']:.3f} (step {check['measured_step_ms']:.2f} ms), modelled "
            f"{check['modelled_efficiency']:.3f} (step {check['modelled_step_ms']:.2f} ms); measured flat-allreduce "
            f"bus bandwidth {check['measured_bus_GBps']:.1f} GB/s against the {cluster['nvlink_GBps']:g} GB/s assumed.",
            "",
        ]
    for global_batch in sorted({row["global_batch"] for row in rows}):
        lines += [
            f"## Global batch {global_batch}",
            "",
            "| GPUs | per-GPU batch | compute ms | small collectives ms | gradient allreduce ms | "
            + " | ".join(f"efficiency, overlap {overlap:.2f}" for overlap in overlaps) + " |",
            "|" + "---:|" * (5 + len(overlaps)),
        ]
        for num_gpus in sorted({row["gpus"] for row in rows if row["global_batch"] == global_batch}):
            same = [row for row in rows if row["global_batch"] == global_batch and row["gpus"] == num_gpus]
            first = same[0]
            lines.append(
                f"| {num_gpus} | {first['per_gpu_batch']}{'*' if first['compute_extrapolated'] else ''} | "
                f"{first['compute_ms']:.2f} | {first['small_collectives_ms']:.3f} | "
                f"{first['gradient_allreduce_ms']:.3f} | "
                + " | ".join(f"{row['efficiency']:.3f}" for row in same) + " |"
            )
        lines.append("")
    if left_out:
        lines += ["Left out (global batch not divisible by the GPU count): "
                  + ", ".join(f"G={g} on {n}" for g, n in left_out), ""]
    write_output(str(path), "\n".join(lines))


def plot(path: Path, rows: list, overlaps: list, assumed: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot

    figure, (left, right) = pyplot.subplots(1, 2, figsize=(13, 5))
    global_batches = sorted({row["global_batch"] for row in rows})
    styles = ["-", "--", ":", "-."]
    for color_index, global_batch in enumerate(global_batches):
        for overlap_index, overlap in enumerate(overlaps):
            curve = [row for row in rows if row["global_batch"] == global_batch and row["overlap"] == overlap]
            left.plot(
                [row["gpus"] for row in curve], [row["efficiency"] for row in curve],
                styles[overlap_index % len(styles)], color=f"C{color_index}", marker="o", markersize=3,
                label=f"global batch {global_batch}, overlap {overlap:.2f}",
            )
    left.axvline(assumed["cluster"]["gpus_per_node"], color="grey", linewidth=0.8, linestyle=":")
    left.set(xscale="log", xlabel="GPUs", ylabel="strong-scaling efficiency t(1) / (N t(N))", ylim=(0, 1.05),
             title="Projected efficiency (dotted line: one node)")
    gpu_counts = sorted({row["gpus"] for row in rows})
    left.set_xticks(gpu_counts, labels=[str(num_gpus) for num_gpus in gpu_counts])
    left.legend(fontsize=7)
    left.grid(alpha=0.3)

    # Where a step's time goes, for the largest global batch at the first overlap.
    curve = [row for row in rows if row["global_batch"] == global_batches[-1] and row["overlap"] == overlaps[0]]
    positions = range(len(curve))
    bottom = [0.0] * len(curve)
    for key, label in (("compute_ms", "compute"), ("small_collectives_ms", "small collectives"),
                       ("exposed_allreduce_ms", "exposed gradient allreduce")):
        shares = [row[key] / row["step_ms"] for row in curve]
        right.bar(positions, shares, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, shares)]
    right.set_xticks(list(positions), labels=[f"{row['gpus']}\n(b={row['per_gpu_batch']})" for row in curve])
    right.set(xlabel="GPUs (per-GPU batch)", ylabel="share of step time", ylim=(0, 1),
              title=f"Step time, global batch {global_batches[-1]}, overlap {overlaps[0]:.2f}")
    right.legend(fontsize=7, loc="lower left")
    figure.suptitle(f"{assumed['model']} — measured on {assumed['measured_on']}", fontsize=8)
    figure.tight_layout()
    write_binary_output(str(path), lambda file: figure.savefig(file, format="png", dpi=120))
    pyplot.close(figure)


def checked_cluster(args) -> Cluster:
    """The Cluster of the options; ValueError naming an option whose value no machine has."""
    cluster = Cluster(args.gpus_per_node, args.nvlink_GBps, args.nvlink_latency_us, args.nic_Gbps,
                      args.nics_per_node, args.network_latency_us)
    # An infinite one (an ideal network, say) made the times infinite, and 0 x infinity NaN, in a projection that
    # strict JSON readers refuse: 1e9 GB/s or 0 us serves.
    for name in ("nvlink_GBps", "nic_Gbps"):
        if not 0 < getattr(cluster, name) < math.inf:
            raise ValueError(f"--{name.replace('_', '-')} must be positive and finite, got {getattr(cluster, name)}")
    for name in ("nvlink_latency_us", "network_latency_us"):
        if not 0 <= getattr(cluster, name) < math.inf:
            raise ValueError(f"--{name.replace('_', '-')} must be finite and not negative, got "
                             f"{getattr(cluster, name)}")
    return cluster


def check_projection_arguments(args, cluster: Cluster) -> None:
    """ValueError naming a --backward-share, --gpus or --overlap value the projection cannot take."""
    if not 0 <= args.backward_share <= 1:
        raise ValueError(f"--backward-share must lie in [0, 1], got {args.backward_share}")
    check_gpu_counts(args.gpus, cluster)
    if not all(0 <= overlap <= 1 for overlap in args.overlap or []):  # NaN too, as --backward-share
        raise ValueError(f"--overlap values must lie in [0, 1], got {args.overlap}")


def main(argv=None) -> int:
    defaults = Cluster()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.scaling_model", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--measured", type=input_path, required=True, help="a JSON written by benchmarks.scaling")
    parser.add_argument("--out", type=input_path, required=True, help="folder for scaling_projection.{png,md,json}")
    parser.add_argument("--global-batch", type=positive_int, nargs="+", action=EachOnce, default=[128, 512])
    parser.add_argument("--gpus", type=positive_int, nargs="+", action=EachOnce, default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--overlap", type=float, nargs="+", action=EachOnce,
                        help="fractions of gradient allreduce hidden behind backward (default: the measured one if "
                             "the JSON is from several GPUs, then 0 and 1; else 0, 0.5 and 1)")
    parser.add_argument("--backward-share", type=float, default=2 / 3, help="backward's share of compute time")
    parser.add_argument("--gpus-per-node", type=positive_int, default=defaults.gpus_per_node)
    parser.add_argument("--nvlink-GBps", type=float, default=defaults.nvlink_GBps,
                        help="NVLink GB/s per GPU and direction (NVLink 4: 18 links x 25 GB/s)")
    parser.add_argument("--nvlink-latency-us", type=float, default=defaults.nvlink_latency_us)
    parser.add_argument("--nic-Gbps", type=float, default=defaults.nic_Gbps, help="gigabits per second of one NIC")
    parser.add_argument("--nics-per-node", type=positive_int, default=defaults.nics_per_node,
                        help="NICs per node, shared by its GPUs' inter-node rings")
    parser.add_argument("--network-latency-us", type=float, default=defaults.network_latency_us)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    try:
        # The plot's, asked for before any work: without it the run ended in a traceback after the other two files.
        importlib.import_module("matplotlib")
    except ImportError:
        print("error: the plot needs matplotlib, which the bench extra installs: pip install -e '.[bench]'",
              file=sys.stderr)
        return 2
    try:
        cluster = checked_cluster(args)
        check_projection_arguments(args, cluster)
        measurement = Measurement(args.measured)
        if not cluster.can_model(measurement.world_size):
            raise ValueError(f"the measured run's {measurement.world_size} GPUs are not whole nodes of "
                             f"--gpus-per-node {cluster.gpus_per_node}")
        # All else the projection reads from the measurement, read now: a file without it is refused before any is
        # written, not part way through them.
        measured_overlap = measurement.measured_overlap()
        assumed = {"command": shlex.join(["python", "-m", "benchmarks.scaling_model", *argv]),
                   **assumptions(measurement, cluster, args.backward_share)}
        check = model_check(measurement, cluster, args.backward_share)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    overlaps = args.overlap or ([measured_overlap, 0.0, 1.0] if measured_overlap is not None else [0.0, 0.5, 1.0])
    overlaps = list(dict.fromkeys(overlaps))  # a measured 0 or 1 would otherwise draw the same curve twice
    rows, left_out = projection(
        measurement, cluster, sorted(args.global_batch), sorted(args.gpus), overlaps, args.backward_share
    )
    if not rows:
        print("error: no --global-batch is divisible by any --gpus count", file=sys.stderr)
        return 2

    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        print(f"error: --out {out}: {error.strerror}", file=sys.stderr)
        return 2
    try:
        # Each asked for before any is written: one that could not be (no permission, a folder of its name) ended the
        # run in a traceback, the files before it written.
        for suffix in ("json", "md", "png"):
            output_file(str(out / f"scaling_projection.{suffix}"))
    except argparse.ArgumentTypeError as error:
        print(f"error: --out {out}: {error}", file=sys.stderr)
        return 2
    # Each whole or not at all: a disk filling up left them cut short.
    write_results(str(out / "scaling_projection.json"), {"assumptions": assumed, "model_check": check, "rows": rows})
    write_markdown(out / "scaling_projection.md", assumed, rows, left_out, check, overlaps)
    plot(out / "scaling_projection.png", rows, overlaps, assumed)
    print((out / "scaling_projection.md").read_text())
    print(f"wrote {out}/scaling_projection.png, .md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
