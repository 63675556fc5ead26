"""What a training run's config may hold, and what must match where runs meet: check_config refuses a value the
trainer would take as it comes (a negative clip norm, a string batch size) naming its key; check_resumable compares a
checkpoint's config with this run's; rank_settings is what every rank of a job must agree on."""
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigTypeError, OmegaConfBaseException

from data.audio import MAX_SAMPLE_RATE, MIN_SAMPLE_RATE
from data.features import FEATURE_KINDS, MAX_WINDOW_MS
from data.sampler import shard_size
from data.values import is_int, is_number
from models.deepspeech2 import BACKENDS, CELLS
from trainer import build, checkpoint, distributed


# Each optimizer's own key (its config group sets it; the other group has none), and what its value must be.
OPTIMIZER_KEYS = {
    "adamw": ("optim.betas", lambda v: isinstance(v, Sequence) and not isinstance(v, str) and len(v) == 2
              and all(is_number(beta) and 0 <= beta < 1 for beta in v), "two numbers in [0, 1)"),
    "sgd": ("optim.momentum", lambda v: is_number(v) and 0 < v < 1,
            "a number in (0, 1) (Nesterov momentum needs one; at 1 or more the momentum never decays)"),
}
# The most SpecAugment masks of a kind an utterance takes: its published policies use a few.
MAX_MASKS = 100
# The most units, channels or lookahead frames a model's layer takes. One recurrent layer of 2**20 units already holds
# trillions of parameters, which build.check_model_fits refuses naming the sizes; at 10**10 a weight held more bytes
# than torch can count, and the model it counts them on (on the meta device) ended in a traceback.
MAX_MODEL_WIDTH = 2**20
# The largest seed the trainer takes: the benchmarks' --seed and --seeds refuse one above it before they start.
MAX_SEED = 2**32 - 1
# A checkpoint's config holds at most checkpoint.MAX_CONFIG_ENTRIES entries, one a training manifest and some 60 the
# rest: a run of more manifests wrote checkpoints that its resume and trainer.evaluate refused.
MAX_TRAIN_MANIFESTS = checkpoint.MAX_CONFIG_ENTRIES // 2
# run_name where a message asks for it: the launch scripts' users set it as RUN_NAME (single_node.sh, multi_node.sh and
# slurm.sbatch pass run_name= from it).
RUN_NAME_SETTING = "run_name (RUN_NAME in the launch scripts)"
SET_MANIFESTS = (" (data=manifest takes them from the command line: data.train_manifests=[a.jsonl,b.jsonl] "
                 "data.eval_manifest=c.jsonl)")
CUDA_GRAPHS_NEED_A_GPU = ("train.cuda_graphs=true needs a CUDA device, this run is on {device} "
                          "(train.cuda_graphs=false runs it without them)")
# Values the trainer would otherwise take as they come: a negative clip norm flips the gradient, a string batch size
# fails deep inside the sampler. Each entry: key, test, what the value must be.
CONFIG_RULES = (
    ("seed", lambda v: is_int(v) and 0 <= v <= MAX_SEED, "an integer from 0 to 2**32 - 1"),
    ("train.epochs", lambda v: is_int(v) and v >= 1, "a positive integer"),
    ("train.global_batch_size", lambda v: is_int(v) and v >= 1, "a positive integer"),
    ("train.eval_batch_size", lambda v: is_int(v) and v >= 1, "a positive integer"),
    ("train.max_steps", lambda v: v is None or is_int(v) and v >= 1, "a positive integer or null"),
    ("train.checkpoint_every_steps", lambda v: v is None or is_int(v) and v >= 1, "a positive integer or null"),
    ("train.grad_clip_norm", lambda v: is_number(v) and v > 0, "a positive number"),
    ("train.amp", lambda v: v in ("bf16", "none"), "bf16 or none"),
    ("train.num_workers", lambda v: is_int(v) and v >= 0, "a non-negative integer"),
    ("train.graph_pad_frames", lambda v: is_int(v) and v >= 1, "a positive integer"),
    ("train.progress_line_s", lambda v: is_number(v) and v >= 0, "a non-negative number of seconds"),
    ("device", lambda v: v in distributed.DEVICES, f"one of {', '.join(distributed.DEVICES)}"),
    ("model.cell", lambda v: v in CELLS, f"one of {', '.join(CELLS)}"),
    ("model.backend", lambda v: v in BACKENDS, f"one of {', '.join(BACKENDS)}"),
    ("model.batch_slice", lambda v: v is None or is_int(v) and v >= 1, "a positive integer or null"),
    ("model.depth", lambda v: is_int(v) and v >= 1, "a positive integer"),
    *((f"model.{key}", lambda v, least=least: is_int(v) and least <= v <= MAX_MODEL_WIDTH,
       f"an integer from {least} to {MAX_MODEL_WIDTH:,}") for key, least in (
        ("hidden", 1), ("conv_channels", 1), ("lookahead", 0))),
    ("optim.lr", lambda v: is_number(v) and v > 0, "a positive number"),
    ("optim.warmup_steps", lambda v: is_int(v) and v >= 0, "a non-negative integer"),
    # A factor: deepspeech.pytorch's learning_anneal of 1.1 (a divisor) is 0.9091 here, and 1.1 would grow the rate.
    ("optim.anneal", lambda v: is_number(v) and 0 < v <= 1, "a number in (0, 1], the factor the rate is multiplied by "
     "each epoch"),
    ("optim.weight_decay", lambda v: is_number(v) and v >= 0, "a non-negative number"),
    ("optim.name", lambda v: v in OPTIMIZER_KEYS, f"one of {', '.join(OPTIMIZER_KEYS)}, as optim=NAME picks it with "
     "its settings"),
    ("data.max_duration", lambda v: v is None or is_number(v) and v > 0, "a positive number of seconds or null"),
    ("data.train_manifests", lambda v: isinstance(v, Sequence) and not isinstance(v, str)
     and 0 < len(v) <= MAX_TRAIN_MANIFESTS and all(isinstance(path, str) and path.strip() for path in v),
     f"a list of 1 to {MAX_TRAIN_MANIFESTS:,} manifest paths" + SET_MANIFESTS),
    ("data.eval_manifest", lambda v: isinstance(v, str) and v.strip() != "", "a manifest's path" + SET_MANIFESTS),
    # Its message names PRNN_AN4: an empty one (PRNN_AN4= in a script) comes here as a value the user never typed.
    ("data.an4_source", lambda v: v is None or isinstance(v, str) and v.strip() != "",
     "null or AN4's folder (PRNN_AN4 sets its default)"),
    ("data.manifest_dir", lambda v: isinstance(v, str) and v.strip() != "", "a folder's path"),
    ("data.features.kind", lambda v: v in FEATURE_KINDS, f"one of {', '.join(FEATURE_KINDS)}"),
    ("data.features.sample_rate", lambda v: is_int(v) and MIN_SAMPLE_RATE <= v <= MAX_SAMPLE_RATE,
     f"an integer number of Hz from {MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE}"),
    *((f"data.features.{key}", lambda v: is_number(v) and 0 < v <= MAX_WINDOW_MS,
       f"a number of milliseconds in (0, {MAX_WINDOW_MS}]") for key in ("window_ms", "hop_ms")),
    ("data.features.n_mels", lambda v: is_int(v) and v >= 1, "a positive integer"),
    *((f"data.augment.masks.{key}", lambda v: is_int(v) and v >= 0, "a non-negative integer")
      for key in ("freq_mask", "time_mask")),
    # Each mask is a module of its own, built whenever the config is checked and run on every utterance: 10**11 (a
    # width typed as a count) took all the memory for minutes, without a word.
    *((f"data.augment.masks.{key}", lambda v: is_int(v) and 0 <= v <= MAX_MASKS, f"an integer from 0 to {MAX_MASKS}")
      for key in ("num_freq_masks", "num_time_masks")),
    ("data.augment.masks.max_time_fraction", lambda v: is_number(v) and 0 <= v <= 1, "a number from 0 to 1"),
    ("train.resume", lambda v: v is None or isinstance(v, str) and v.strip() != "",
     "null, auto or a checkpoint's path"),
    ("distributed.timeout_s", lambda v: is_number(v) and 0 < v <= distributed.MAX_TIMEOUT_S,
     f"a positive number of seconds up to {distributed.MAX_TIMEOUT_S:g}"),
    # On/off keys: a string such as "no" would be true, and turn on what the user turned off.
    *((key, lambda v: isinstance(v, bool), "true or false") for key in (
        "model.bidirectional", "model.residual", "data.sortagrad", "data.augment.enabled", "data.features.normalize",
        "train.cuda_graphs", "train.sync_batch_norm", "train.progress_bar", "distributed.share_gpus")),
)


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
CONFIG_GROUPS = ("model", "data", "optim")


def known_config_keys() -> set[str]:
    """Every key a config may hold: conf/train.yaml's and those of each option of its groups. Hydra refuses other
    keys on the command line, but not those an experiment file (or a `+key=value` override) brings in."""
    files = [("", CONF_DIR / "train.yaml")]
    files += [(f"{group}.", path) for group in CONFIG_GROUPS for path in sorted((CONF_DIR / group).glob("*.yaml"))]
    keys = set()
    for prefix, path in files:
        entries = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        keys |= _leaf_keys({key: value for key, value in entries.items() if key not in ("defaults", "hydra")}, prefix)
    return keys


def _leaf_keys(entries: dict, prefix: str = "") -> set[str]:
    return {leaf for key, value in entries.items()
            for leaf in (_leaf_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"])}


def config_error_line(error: Exception) -> str:
    """One line for a config refused: check_config's own message, or an interpolation that does not resolve named by
    its key (OmegaConf's next lines give the key and its type again)."""
    if isinstance(error, OmegaConfBaseException) and error.full_key:
        return f"{error.full_key}: {str(error).splitlines()[0]}"
    return str(error)


def per_rank_batch_size(cfg: DictConfig, world_size: int) -> int:
    """Each of `world_size` ranks' share of train.global_batch_size; ValueError where they cannot split it evenly."""
    try:
        return shard_size(cfg.train.global_batch_size, world_size)
    except ValueError as error:
        raise global_batch_refusal(cfg, error) from None


def global_batch_refusal(cfg: DictConfig, error: ValueError) -> ValueError:
    """data.sampler's refusal of the global batch, naming the key to change: data/ knows no config keys."""
    return ValueError(f"train.global_batch_size={cfg.train.global_batch_size}: {error}")


def check_config(cfg: DictConfig) -> None:
    """Raises ValueError naming the first key no config file defines (or a group of keys given a value of its own, or a
    key given a mapping), or else the first value CONFIG_RULES refuses (interpolations resolved first), or else the
    chosen optimizer's own setting refused or the other optimizer's given (OPTIMIZER_KEYS), train.cuda_graphs=true
    with model.backend=cudnn or device=cpu, feature and SpecAugment settings that cannot work together, or a
    model.backend that device=cpu cannot run."""
    known = known_config_keys()
    unknown = sorted(_leaf_keys(OmegaConf.to_container(cfg, resolve=False)) - known)
    # A known group given a value in place of its keys (train=null) is a leaf no config file defines, yet no misspelt
    # key: said so, it sent the user looking for one.
    if unknown and (inside := sorted(key for key in known if key.startswith(f"{unknown[0]}."))):
        raise ValueError(f"{unknown[0]} must be a mapping of its keys ({', '.join(inside[:2])}, ...), not "
                         f"{OmegaConf.select(cfg, unknown[0])!r}")
    # Nor is a leaf under a known key given a mapping in place of its value (model.depth={layers:5}).
    above = [unknown[0].rsplit(".", dots)[0] for dots in range(unknown[0].count("."), 0, -1)] if unknown else []
    if valued_key := next((key for key in above if key in known), None):
        raise ValueError(f"{valued_key} must be a value, not the mapping {OmegaConf.select(cfg, valued_key)!r}")
    if unknown:
        raise ValueError(f"unknown config key {unknown[0]}: conf/train.yaml and conf/{{{','.join(CONFIG_GROUPS)}}}/ "
                         "define no such key (misspelt in an experiment file, or added by a + override?)")
    for key, valid, what in CONFIG_RULES:
        value = OmegaConf.select(cfg, key)
        if not valid(value):
            raise ValueError(f"{key} must be {what}, not {value!r}")
    key, valid, what = OPTIMIZER_KEYS[cfg.optim.name]
    value = OmegaConf.select(cfg, key)
    if not valid(value):
        raise ValueError(f"{key} must be {what} for optim.name={cfg.optim.name}, not {value!r} (optim=NAME "
                         "picks an optimizer with its settings)")
    for name, (key, _, _) in OPTIMIZER_KEYS.items():  # known, since the other optimizer's file has it, but unread
        if name != cfg.optim.name and key.split(".")[1] in cfg.optim:
            raise ValueError(f"{key} is {name}'s setting, which optim.name={cfg.optim.name} does not read (optim=NAME "
                             "picks an optimizer with its settings)")
    # Refused on any device (off a GPU, graphs are; on one, models.cuda_graphs.check_capturable refuses each cuDNN
    # layer): here too, so that the launch scripts' check and a sweep refuse it before the build and the ranks' start.
    if cfg.train.cuda_graphs and cfg.model.backend == "cudnn":
        raise ValueError("train.cuda_graphs=true cannot run with model.backend=cudnn, whose packed sequences need "
                         "their lengths on the host, which a graph cannot capture; use model.backend=persistent or "
                         "train.cuda_graphs=false")
    if cfg.train.cuda_graphs and cfg.device == "cpu":  # device=auto off a GPU is trainer.train's to refuse
        raise ValueError(CUDA_GRAPHS_NEED_A_GPU.format(device="cpu"))
    # Values each in range that cannot work together (a mel band with no FFT bin, a hop longer than the window, a
    # frequency mask wider than the features), refused as the run builds them: here too, so that a sweep and the
    # launch scripts' check (trainer.check_overrides) refuse them before any job, build or rank starts.
    num_features = build.features(cfg.data).num_features
    build.spec_augment(cfg.data, num_features)
    if cfg.device == "cpu":  # on a GPU the backend's answer depends on the batch and the GPU: trainer.train asks there
        refuse_backend_off_a_gpu(cfg, num_features)


def refuse_backend_off_a_gpu(cfg: DictConfig, num_features: int) -> None:
    """ValueError where model.backend cannot run on the CPU (persistent, which needs a GPU), in the words the run's
    start would use: so that the launch scripts' check and a sweep refuse it before any rank starts."""
    cpu = torch.device("cpu")
    try:
        build.backend_probe(cfg.model, num_features).recurrent_backend(1, build.compute_dtype(cfg.train.amp, cpu), cpu)
    except ValueError as error:
        raise ValueError(f"model.backend={cfg.model.backend}: {error}") from None


# What a checkpoint's run must share with this one: for its weights and optimizer state to fit, and for its sampler
# position to name the same global batches (another batch size, seed or utterance set would train some utterances of
# the epoch twice and skip others). The optimizer's settings too: its state restores the checkpoint's rate, betas
# and decay, so new values would be written to config.yaml but not used. The backend and the batch slicing may change
# on resume: the same function, run by other kernels; so may the world size, which the global batch does not depend on.
RESUME_MUST_MATCH = ("model.depth", "model.hidden", "model.cell", "model.bidirectional", "model.lookahead",
                     "model.residual", "model.conv_channels", "data.features", "optim", "train.global_batch_size",
                     "seed", "data.sortagrad", "data.train_manifests", "data.max_duration")


# A run's settings are its command line's, not its directory's: a resume given only run_name and train.resume (as the
# stop line words it) is the default config, refused for its model's every setting, so the refusal says where the
# run's own overrides are.
RESUME_TAKES_THE_COMMAND_LINE = ("a resume takes its settings from the command line, not the checkpoint: give the "
                                 "overrides its run was started with (its run directory's jobs.jsonl records each "
                                 "job's command)")


# Keys whose values differ between the jobs of one run without changing its training (run_name: each job's start
# time where hydra.run.dir names the directory), left out of the settings a resume logs as changed.
RESUME_UNLOGGED = ("run_name", "train.resume")


def check_resumable(saved_config: dict, cfg: DictConfig, path: Path, holds_train_set: bool = False) -> list[str]:
    """ValueError naming the settings in RESUME_MUST_MATCH that differ between a checkpoint's config and this run's;
    else the other settings that differ, which the run takes from here on, for the log (config.yaml says only this
    job's). holds_train_set: the checkpoint holds its training set's digest, which check_same_training_set compares
    instead of the manifests' paths, so that the same corpus in another folder (another machine's) resumes."""
    saved = checkpoint.stored_config(saved_config)
    # A bidirectional model has no lookahead convolution: its model.lookahead changes nothing; nor does model.residual
    # where the one recurrent layer is the first, which has none. Selected, not read as an attribute: a config without
    # the key (another program's) is refused below, naming it, not with a traceback.
    bidirectional = _selected(saved, "model.bidirectional", None) and cfg.model.bidirectional
    unused = {"model.lookahead"} if bidirectional else set()
    if _selected(saved, "model.depth", None) == cfg.model.depth == 1:
        unused.add("model.residual")
    if holds_train_set:
        unused.add("data.train_manifests")
    differ = [difference for key in RESUME_MUST_MATCH if key not in unused
              for difference in _differences(saved, cfg, key)]
    if differ:
        raise ValueError(f"cannot resume from {path}: it was written by a run with other settings "
                         f"({'; '.join(differ)}); {RESUME_TAKES_THE_COMMAND_LINE}")
    unlogged = tuple(f"{key}=" for key in RESUME_UNLOGGED)
    return [difference for key in sorted(set(saved) | set(cfg)) for difference in _differences(saved, cfg, key)
            if not difference.startswith(unlogged)]


def noting_what_does_nothing_here(changes: list[str], device: torch.device) -> list[str]:
    """check_resumable's changed settings, a change of train.amp said to do nothing where this job's device runs no
    autocast whatever it says (build.uses_amp: a CPU computes in fp32); later jobs on a GPU take it."""
    if build.uses_amp("bf16", device):
        return changes
    return [f"{change} (nothing changes on {device.type}, which computes in fp32)" if change.startswith("train.amp=")
            else change for change in changes]


_UNSET = object()  # a key one config lacks, told apart from one set to null


def _selected(config: DictConfig, key: str, default=_UNSET):
    """The value at `key`, a dotted path, or `default` where the config lacks it: also where the path runs through a
    list or a value (a checkpoint's config edited to hold model: [1, 2]), which OmegaConf.select indexed with a name
    and ended the resume in its ConfigTypeError, a traceback."""
    try:
        return OmegaConf.select(config, key, default=default)
    except ConfigTypeError:
        return default


def _differences(saved: DictConfig, cfg: DictConfig, key: str) -> list[str]:
    """How `key` differs between a checkpoint's config and this one's, a group's entries one by one."""
    there, here = _selected(saved, key), _selected(cfg, key)
    if isinstance(there, DictConfig) and isinstance(here, DictConfig):
        return [difference for entry in sorted(set(there) | set(here))
                for difference in _differences(saved, cfg, f"{key}.{entry}")]
    return [] if there == here else [f"{key}={_as_override(there)} there, {_as_override(here)} here"]


def _as_override(value) -> str:
    """A setting's value as an override writes it, so that the one a message names can be given back: Python's None
    given back is Hydra's string 'None', which the config rules refuse where null is meant."""
    if value is _UNSET:
        return "(not set)"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value)


# What a rank may hold apart from the others: the run's name (by default each rank's start time, which can differ by a
# second; rank 0's names the run directory), where its node keeps the corpus (the sets' contents are compared instead,
# check_same_on_every_rank) and how it loads and shows its work.
RANKS_MAY_DIFFER = ("run_name", "data.an4_source", "data.manifest_dir", "data.train_manifests", "data.eval_manifest",
                    "train.num_workers", "train.progress_bar", "train.progress_line_s")


def rank_settings(cfg: DictConfig) -> dict[str, str]:
    """The resolved config as {dotted key: its value as JSON}, less RANKS_MAY_DIFFER."""
    settings = {}

    def add(node, key):
        if isinstance(node, dict) and node:
            for name, value in node.items():
                add(value, f"{key}.{name}" if key else str(name))
        elif key not in RANKS_MAY_DIFFER:
            settings[key] = json.dumps(node)

    add(OmegaConf.to_container(cfg, resolve=True), "")
    return settings
