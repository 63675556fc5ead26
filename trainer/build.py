"""Builds features, model, optimizer and schedule from the config: shared by training, evaluation and transcription."""
import math
import os

from omegaconf import DictConfig, OmegaConf

import torch

from data.features import FeatureExtractor, SpecAugment
from data.text import NUM_CLASSES, counted
from models import DeepSpeech2
from trainer import checkpoint


def features(data_cfg: DictConfig) -> FeatureExtractor:
    try:
        return FeatureExtractor(**OmegaConf.to_container(data_cfg.features, resolve=True))
    except ValueError as error:  # it names its own arguments: hop_ms, n_mels
        raise ValueError(f"data.features: {error}") from None


def spec_augment(data_cfg: DictConfig, num_features: int) -> SpecAugment | None:
    """The training set's SpecAugment, None where data.augment.enabled is false. Raises ValueError where a frequency
    mask could be wider than the `num_features` features of a frame: such a mask zeros them all (over 13 mel bands,
    the default width of 15 zeroed every feature of a quarter of the utterances)."""
    if not data_cfg.augment.enabled:
        return None
    masks = OmegaConf.to_container(data_cfg.augment.masks, resolve=True)
    if masks["freq_mask"] > num_features:
        raise ValueError(f"data.augment.masks.freq_mask={masks['freq_mask']} must be at most the {num_features} "
                         f"features of a frame (data.features.kind={data_cfg.features.kind}): a wider mask can zero "
                         "them all")
    return SpecAugment(**masks)


def uses_amp(amp: str, device: torch.device) -> bool:
    """Whether a pass runs under bf16 autocast: train.amp=bf16 on a GPU (a CPU always runs fp32)."""
    return amp == "bf16" and device.type == "cuda"


def autocast(amp: str, device: torch.device) -> torch.autocast:
    """The context a forward pass runs in: bf16 autocast where uses_amp says so, none otherwise."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=uses_amp(amp, device))


def compute_dtype(amp: str, device: torch.device) -> torch.dtype:
    """What the recurrent layers compute in: bf16 under autocast (the persistent kernels' bf16), fp32 otherwise."""
    return torch.bfloat16 if uses_amp(amp, device) else torch.float32


def model(model_cfg: DictConfig, num_features: int, **changes) -> DeepSpeech2:
    """The model the config describes; `changes` replace some of its settings (depth=1)."""
    settings = {**OmegaConf.to_container(model_cfg, resolve=True), **changes}
    return DeepSpeech2(num_features=num_features, num_classes=NUM_CLASSES, **settings)


def backend_probe(model_cfg: DictConfig, num_features: int) -> DeepSpeech2:
    """A one-layer copy of the model on the meta device, to ask recurrent_backend: the layers share cell, size and
    backend, so one answers for all, and it holds no memory."""
    with torch.device("meta"):
        return model(model_cfg, num_features, depth=1)


def num_parameters(model_cfg: DictConfig, num_features: int) -> int:
    """The model's parameter count, from models of one and two recurrent layers on the meta device: every layer after
    the first is alike, so each adds what the second does. Building the whole stack, even on the meta device, takes
    about 4 ms a layer: a mistyped model.depth=1000000 would be counted for an hour before it was refused."""
    with torch.device("meta"):
        one, two = (sum(parameter.numel() for parameter in model(model_cfg, num_features, depth=depth).parameters())
                    for depth in (1, 2))
    return one + (model_cfg.depth - 1) * (two - one)


# Bytes each parameter holds whatever the batch: its fp32 weight and gradient, and the optimizer's state of it
# (AdamW's two moments, SGD's momentum buffer); its keys are the optimizers `optimizer` builds.
STATE_BYTES_PER_PARAMETER = {"adamw": 16, "sgd": 12}


def device_memory(device: torch.device) -> int:
    """Bytes a run can have on `device`: all of the GPU's memory, or on a CPU what Linux can give without its
    out-of-memory killer (available memory and free swap; the physical memory where there is no /proc/meminfo)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        with open("/proc/meminfo") as meminfo:
            kib = {name: int(value.split()[0]) for name, value in (line.split(":", 1) for line in meminfo)}
        return 1024 * (kib["MemAvailable"] + kib["SwapFree"])
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def millions_or_billions(count: int, decimals: int = 1) -> str:
    """A parameter count as it reads: 1.3M, 41.2M, 769.1B, where a mistyped model's 769,116.6M read as a sum."""
    if count >= 1e9:
        return f"{count / 1e9:,.{decimals}f}B"
    return f"{count / 1e6:,.{decimals}f}M"


def check_model_fits(model_cfg: DictConfig, optim_name: str, num_features: int, device: torch.device,
                     ranks_on_device: int = 1) -> None:
    """Raises ValueError naming the model's size settings where its weights, their gradients and the optimizer's state
    alone need more than the device has for them, each of the `ranks_on_device` ranks that share it holding its own
    copy. Counted on the meta device, so nothing is allocated: the real allocation would end in a traceback, at the
    build or at the first step, or on a CPU in the out-of-memory killer."""
    count = num_parameters(model_cfg, num_features)
    needed, memory = count * STATE_BYTES_PER_PARAMETER[optim_name], device_memory(device)
    available = memory // ranks_on_device
    if needed > available:
        shared = f" ({memory / 2**30:,.1f} GiB shared by {ranks_on_device} ranks)" if ranks_on_device > 1 else ""
        sizes = f"model.depth={model_cfg.depth} model.hidden={model_cfg.hidden} model.cell={model_cfg.cell}"
        # Both directions hold weights of their own: model.bidirectional=false halves the recurrent layers'.
        sizes += f" model.bidirectional={str(model_cfg.bidirectional).lower()}"
        sizes += f" model.conv_channels={model_cfg.conv_channels}"
        sizes += "" if model_cfg.bidirectional else f" model.lookahead={model_cfg.lookahead}"
        raise ValueError(f"the model ({sizes}) has {millions_or_billions(count)} parameters, whose weights, gradients "
                         f"and {optim_name} state need {needed / 2**30:,.1f} GiB, more than the "
                         f"{available / 2**30:,.1f} GiB {device} has for it{shared}")


def optimizer(optim_cfg: DictConfig, parameters) -> torch.optim.Optimizer:
    """A fused optimizer, CPU or GPU: one kernel per update instead of several per parameter chunk, and the only kind
    that takes GradScaler's found_inf input, which lets train_step queue a step that may yet be skipped."""
    parameters = list(parameters)
    if optim_cfg.name == "sgd":
        sgd = torch.optim.SGD(
            parameters, lr=optim_cfg.lr, momentum=optim_cfg.momentum, nesterov=True,
            weight_decay=optim_cfg.weight_decay, fused=True,
        )
        # Fused SGD leaves a first step's momentum buffers uninitialised when found_inf skips it, and later steps
        # would then read them. Zeros give the same first step (no dampening: the buffer becomes the gradient).
        for parameter in parameters:
            sgd.state[parameter]["momentum_buffer"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
        return sgd
    if optim_cfg.name == "adamw":
        return torch.optim.AdamW(
            parameters, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), weight_decay=optim_cfg.weight_decay,
            fused=True,
        )
    raise ValueError(f"optim.name must be one of {tuple(STATE_BYTES_PER_PARAMETER)}, got {optim_cfg.name!r}")


def lr_schedule(optim_cfg: DictConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int):
    """The rate after s weight updates: lr x min(1, (s + 1) / warmup_steps) x anneal ** (s // steps_per_epoch). The
    anneal runs from the first step, warm-up or not, so a warm-up longer than an epoch peaks below lr; a skipped step
    (the scheduler steps only with the weights) moves each later anneal one step past its epoch boundary."""

    def factor(step: int) -> float:
        warmup = min(1.0, (step + 1) / optim_cfg.warmup_steps) if optim_cfg.warmup_steps > 0 else 1.0
        return warmup * optim_cfg.anneal ** (step // steps_per_epoch)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def from_checkpoint(path, device: torch.device) -> tuple[DeepSpeech2, FeatureExtractor, DictConfig]:
    """Rebuilds the model and its feature extractor from the config stored inside a checkpoint (eval mode).

    A model trained on the persistent kernels is rebuilt on `auto`: the kernels where they run, torch.nn elsewhere
    (a CPU, an older GPU), which computes the same function, so a checkpoint evaluates wherever it is taken.
    Raises ValueError naming the file where it holds no model this code can build."""
    saved = checkpoint.load(path)
    try:
        cfg = checkpoint.stored_config(saved["config"])
        if cfg.model.backend == "persistent":
            cfg.model.backend = "auto"
        extractor = features(cfg.data)
        layers = {key.split(".")[1] for key in saved["model"] if key.startswith("layers.")}
        if cfg.model.depth != len(layers):  # building a model of the config's depth alone could take hours
            raise ValueError(f"its config gives model.depth={cfg.model.depth}, its weights "
                             f"{counted(len(layers), 'layer')}")
        # Built on the meta device, then given the checkpoint's tensors: a config that claims a larger model than
        # its weights allocates nothing before the shapes are compared.
        with torch.device("meta"):
            network = model(cfg.model, extractor.num_features)
        network.load_state_dict(saved["model"], assign=True)
    # What a config or state dict from elsewhere raises: missing or unknown keys (omegaconf's errors subclass
    # KeyError and AttributeError), wrong types, tensors of other shapes (RuntimeError: its heading and first detail,
    # a list of 100 layers' keys cut short).
    except (KeyError, AttributeError, TypeError, ValueError, RuntimeError) as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        reason = " ".join(lines[:2]) or type(error).__name__
        reason = reason if len(reason) <= 300 else reason[:297] + "..."
        raise ValueError(f"{path}: not a checkpoint of this trainer's model ({reason})") from error
    # assign keeps the stored dtypes, which a copy into the built model would have cast: weights kept in half precision
    # (to halve the file) met float32 features in a traceback. Before the check below: a float64 past float32's range
    # becomes infinite.
    network.float()
    not_finite = entries_not_finite(network)
    if not_finite:  # the trainer saves no such model (trainer.train.refuse_if_diverged): edited by hand
        raise ValueError(f"{path}: its model holds values that are not finite, in {not_finite}")
    return network.to(device).eval(), extractor, cfg


def entries_not_finite(model: torch.nn.Module) -> str:
    """The model's parameters and buffers that hold a value that is not finite, named for a message (the first three
    and a count), or "" where there are none. One host sync, whatever the count of entries."""
    # The largest magnitude is finite exactly where every entry is (NaN propagates; unlike a sum or a 2-norm it cannot
    # overflow), in one pass that allocates nothing: isfinite(tensor).all() took 3-9 s on a CPU for deep100's model.
    # An empty tensor has no largest magnitude, nor anything that is not finite.
    floating = {name: tensor for name, tensor in model.state_dict().items() if tensor.is_floating_point()
                and tensor.numel()}
    largest = [torch.linalg.vector_norm(tensor, ord=math.inf) for tensor in floating.values()]
    finite = torch.isfinite(torch.stack(largest)).tolist() if largest else []
    names = [name for name, is_finite in zip(floating, finite) if not is_finite]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
