"""`python -m trainer.check_overrides [-m] [--world-size N] [overrides...]`: checks the overrides of `python -m
trainer [-m] [overrides...]` without training, in seconds, so that the launch scripts refuse a job before its kernel
build and its ranks' start. The config the command would train is composed as Hydra composes it and checked as the
trainer checks it (its run_name, then trainer.config.check_config: every key known, every value CONFIG_RULES takes,
feature and SpecAugment settings that work together; that N ranks, default 1, split its train.global_batch_size
evenly; and that the files it reads are there and open, trainer.inputs.check_inputs, and train.resume=PATH's
checkpoint, trainer.resume.checkpoint_to_resume); a sweep's every job, as the
trainer checks them before its first job (trainer.run_directory.sweep_refusal), and its files too; and the run's
directory, that it holds no symbolic link, pipe or folder where the run writes a file in place
(trainer.run_directory.run_file_refusal), nor checkpoints that a fresh run would overwrite
(trainer.resume.checkpoint_to_resume). A command that passes prints nothing, exit code 0. The first refusal is one
line on stderr, as the trainer's, and exit code 2; nothing is written. So is an unknown flag; Hydra's --config-name,
--config-path and --config-dir, which would compose another config than conf/train.yaml, the one checked; its flags
that print instead of training (--cfg, --info, --hydra-help, --shell-completion, --version), which every rank would
print; -h / --help abbreviated or grouped (--hel, -mh), which the launch scripts do not answer themselves; and
--experimental-rerun, which the trainer refuses too (trainer.override_errors.pickled_config_refusal).
"""
if __name__ == "__main__":  # first: the imports below take a second or two (Hydra), in which a signal printed
    # a traceback (Ctrl-C) or ended the tool without a word (SIGTERM)
    from data.cli import end_at_once_on_a_signal

    end_at_once_on_a_signal()

import argparse
import sys
from typing import NoReturn

from hydra import initialize_config_dir
from hydra._internal.utils import get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode

from trainer.cli import GivenOnce, positive_int, run_tool
from trainer.config import CONF_DIR
from trainer.override_errors import pickled_config_refusal, refused_in_one_line
from trainer.run_directory import check_run_name, run_file_refusal, run_refusal, sweep_refusal


def refusal(overrides: list[str], sweep: bool, world_size: int = 1) -> str | None:
    """What the trainer would refuse first, in its words, or None: in a job of `world_size` ranks."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="trainer"):
        cfg = GlobalHydra.instance().hydra.compose_config("train", overrides,
                                                          run_mode=RunMode.MULTIRUN if sweep else RunMode.RUN)
        check_run_name(cfg)  # exits 2 in its own line, as the trainer's callback does before the run starts
        if sweep:
            return run_file_refusal(cfg.hydra.sweep.dir) or sweep_refusal(cfg, world_size, inputs=True)
        return run_refusal(cfg, world_size, inputs=True) or run_file_refusal(cfg.hydra.run.dir)


# Hydra's flags that choose another primary config: the trainer would compose it, this check composes train.yaml, and
# checking the other as Hydra finds it would copy Hydra's private search-path rules. experiment=NAME picks a recipe.
OTHER_CONFIG_FLAGS = {"config_name": "--config-name", "config_path": "--config-path", "config_dir": "--config-dir"}


def other_config_refusal(command_line: argparse.Namespace) -> str | None:
    """Where the command line names another config than conf/train.yaml: one line saying it is not checked."""
    for attribute, flag in OTHER_CONFIG_FLAGS.items():
        value = getattr(command_line, attribute)
        if value is not None:
            return (f"{flag} {value}: the launch scripts and their check of the overrides take conf/train.yaml only; "
                    "choose a recipe with experiment=NAME (conf/experiment/NAME.yaml)")
    return None


# Hydra's flags that print what they ask for and end the run untrained: through a launch script, once on every rank.
PRINTING_FLAGS = {"cfg": "--cfg", "info": "--info", "hydra_help": "--hydra-help",
                  "shell_completion": "--shell-completion"}


def printing_flag_refusal(command_line: argparse.Namespace) -> str | None:
    """Where the command line asks Hydra to print instead of train, one line pointing at the trainer itself."""
    for attribute, flag in PRINTING_FLAGS.items():
        value = getattr(command_line, attribute)
        if value not in (None, False):
            asked = flag if value is True else f"{flag} {value}"
            return (f"{asked} prints and trains nothing, once on every rank a launch script starts; run python -m "
                    f"trainer {asked} OVERRIDES without the script")
    return None


def abbreviated_help_refusal(command_line: argparse.Namespace, arguments: list[str]) -> str | None:
    """Where Hydra's parser took an argument for -h / --help that is neither, an abbreviation (--hel) or a group of
    short flags (-mh): the launch scripts answer -h and --help alone, and this one, answered here with exit code 0,
    let them start the job, every rank printing the trainer's help."""
    if not command_line.help or {"-h", "--help"} & set(arguments):
        return None
    return ("an abbreviated or grouped -h / --help (--hel, -mh) prints the trainer's help and trains nothing, once on "
            "every rank a launch script starts: give --help alone for the script's usage")


class WorldSizeGivenOnce(GivenOnce):
    """--world-size's action, which refuses a second one: the launch scripts give theirs first, and one among their
    overrides (--world-size 4, abbreviated --wor 4), which the trainer takes for an unknown flag, replaced their count
    of ranks unchecked."""

    def refuse_repeat(self, parser, value, option_string):
        parser.error(f"{option_string} {value}: --world-size is given once, the launch scripts' count of ranks; the "
                     "trainer takes no such flag")


def exit_on_argument_error(message: str) -> NoReturn:
    """argparse's refusal of the command line without its usage block, nine lines of Hydra's flags before it."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main(arguments: list[str]) -> int:
    # Hydra's own parser, as the trainer's command line is read: a sweep's -m after its overrides is a sweep there too.
    parser = get_args_parser()
    # The launch scripts' count of ranks.
    parser.add_argument("--world-size", type=positive_int, action=WorldSizeGivenOnce)
    parser.error = exit_on_argument_error
    # Its one call left, once --version has printed Hydra's version: the flag trains nothing, as PRINTING_FLAGS.
    parser.exit = lambda status=0, message=None: exit_on_argument_error(
        "--version prints and trains nothing, once on every rank a launch script starts")
    command_line = parser.parse_args(arguments)
    if refused := abbreviated_help_refusal(command_line, arguments):
        print(f"error: {refused}", file=sys.stderr)
        return 2
    if command_line.help:  # Hydra's parser only notes -h / --help, which the trainer answers itself: ended silently
        print(__doc__.strip())
        return 0
    refused = (other_config_refusal(command_line) or printing_flag_refusal(command_line)
               or pickled_config_refusal(command_line.experimental_rerun)
               or refused_in_one_line(lambda: refusal(command_line.overrides, command_line.multirun,  # Hydra's: exit 2
                                                      command_line.world_size or 1)))
    if refused is not None:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(lambda: main(sys.argv[1:])))
