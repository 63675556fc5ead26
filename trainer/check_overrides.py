"""`python -m trainer.check_overrides [-m] [overrides...]`: checks the overrides of `python -m trainer [-m]
[overrides...]` without training, in seconds, so that the launch scripts refuse a job before its kernel build and its
ranks' start. Each config the command would train, every job of a sweep (Hydra's BasicSweeper splits it), is composed
as Hydra composes it and checked as the trainer checks it (trainer.config.check_config: every key known, every value
CONFIG_RULES takes). The first refusal is one line on stderr, as the trainer's, and exit code 2; nothing is written.
"""
import copy
import sys

from hydra import initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict

from trainer.__main__ import user_error_message
from trainer.config import CONF_DIR, check_config
from trainer.override_errors import refused_in_one_line

SWEEP_FLAGS = ("-m", "--multirun")


def job_configs(overrides: list[str], sweep: bool) -> list[tuple[list[str], DictConfig]]:
    """Each job's config, Hydra's node included, and the overrides that tell it from the sweep's other jobs: one job,
    or a sweep's, composed as Hydra's multirun composes them (Sweeper.validate_batch_is_legal), the sweeper's params
    included."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="trainer"):
        hydra = GlobalHydra.instance().hydra
        if not sweep:
            return [([], hydra.compose_config("train", overrides, run_mode=RunMode.RUN))]
        sweep_cfg = hydra.compose_config("train", overrides, run_mode=RunMode.MULTIRUN)
        arguments = [f"{key}={value}" for key, value in (sweep_cfg.hydra.sweeper.params or {}).items()]
        arguments += list(sweep_cfg.hydra.overrides.task)
        parsed = OverridesParser.create(config_loader=hydra.config_loader).parse_overrides(arguments)
        swept = {override.get_key_element() for override in parsed if override.is_sweep_override()}
        jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
        return [([override for override in job if override.partition("=")[0] in swept],
                 hydra.config_loader.load_sweep_config(sweep_cfg, job)) for job in jobs]


def check_job(cfg: DictConfig) -> None:
    """check_config on the config a job's task gets: Hydra's node taken out, and readable through ${hydra:...}."""
    HydraConfig.instance().set_config(cfg)
    task_cfg = copy.deepcopy(cfg)
    with open_dict(task_cfg):
        del task_cfg["hydra"]
    check_config(task_cfg)


def refusal(overrides: list[str], sweep: bool) -> str | None:
    """What the trainer would refuse first, in its words, or None."""
    for number, (job, cfg) in enumerate(job_configs(overrides, sweep)):
        try:
            check_job(cfg)
        except ValueError as error:
            said = user_error_message(error, CONF_DIR)  # its folder is read only for a full disk, which no check meets
            return f"sweep job {number} ({' '.join(job)}): {said}" if job else said
    return None


def main(arguments: list[str]) -> int:
    sweep = bool(arguments) and arguments[0] in SWEEP_FLAGS
    refused = refused_in_one_line(lambda: refusal(arguments[sweep:], sweep))  # Hydra's refusals end here, exit 2
    if refused is not None:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
