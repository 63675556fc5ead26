"""Where a job runs, for the run directory's jobs.jsonl and the benchmarks' results: the device and the versions."""
import platform

import torch


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads per rank)"


def versions(device: torch.device) -> dict:
    found = {"python": platform.python_version(), "torch": torch.__version__}
    if device.type == "cuda":
        found.update(
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )
    return found
