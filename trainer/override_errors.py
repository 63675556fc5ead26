"""Hydra's refusals of the command line in the trainer's one line and exit code 2, as its other user errors are, where
Hydra printed several lines and exited 1: a key that is not there (model.depht=3: Hydra advised +model.depht=3, which
the trainer then refuses), a config group's option that is not there (experiment=nope: Hydra added its config search
path), an override it cannot parse (+foo) and the other overrides it cannot apply. HYDRA_FULL_ERROR=1 gives Hydra's
full trace still.
"""
import difflib
import logging
import os
import sys
import traceback

import hydra._internal.hydra as hydra_internal
import hydra._internal.utils as hydra_utils
from hydra.errors import (ConfigCompositionException, MissingConfigException, OverrideParseException,
                          SearchPathException)
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from data.cli import is_stdouts_full_disk, stdout_failures_end_the_tool
from trainer.config import CONF_DIR, RUN_NAME_SETTING
from trainer.launch_ranks import rank_tag

COMMAND_LINE_ERRORS = (ConfigCompositionException, OverrideParseException, SearchPathException)


def report_command_line_errors_in_one_line() -> None:
    """Wraps Hydra's run_and_report, through which each of Hydra's steps (composing the config, the run or the sweep,
    --cfg) reports its error before exiting 1: a private function (hydra-core is held to 1.3), but the one place
    that sees these errors before Hydra prints them. Anything else it reports as before."""
    report = hydra_utils.run_and_report

    def run_and_report(step):
        def reported():
            # Hydra reported a BrokenPipeError as any error, a traceback: --cfg job | head -1
            with stdout_failures_end_the_tool():
                return refused_in_one_line(step)
        return report(reported)

    hydra_utils.run_and_report = run_and_report


class _InfoLines(logging.StreamHandler):
    """The handler of Hydra's --info lines on stdout: logging reported each line's BrokenPipeError, once stdout's reader
    had stopped (`--info | head -1`), and each line's full disk (`--info > file`), as "--- Logging error ---" and a
    traceback, where --help and --cfg end quietly or in one line. It lets those errors through, to
    stdout_failures_end_the_tool."""

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, BrokenPipeError) or (isinstance(error, OSError) and is_stdouts_full_disk(error)):
            raise  # the error emit() is handling
        super().handleError(record)


def _info_log_config(level: int = logging.INFO) -> None:
    """Hydra's simple_stdout_log_config (hydra/core/utils.py), which --info alone calls, its handler _InfoLines."""
    root = logging.getLogger()
    root.setLevel(level)
    handler = _InfoLines(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.addHandler(handler)


def let_info_stdout_failures_through() -> None:
    """Hydra's --info prints through logging, not inside run_and_report: its lines' handler is _InfoLines, which lets
    stdout's failures through to stdout_failures_end_the_tool."""
    hydra_internal.simple_stdout_log_config = _info_log_config


def pickled_config_refusal(rerun_file: str | None) -> str | None:
    """Where the command line gives Hydra's --experimental-rerun FILE, one line refusing it: Hydra loads that config by
    unpickling FILE, and unpickling runs whatever call the file holds (a run folder's config.pickle, from anyone)."""
    if rerun_file is None:
        return None
    return (f"--experimental-rerun {rerun_file}: the trainer does not load pickled configs, whose loading can run any "
            f"code; continue a run with train.resume=auto under its {RUN_NAME_SETTING} and the overrides it was "
            "started with (its run directory's jobs.jsonl records each job's command)")


def refuse_a_pickled_config(arguments: list[str]) -> None:
    """Exits 2 in one line where the trainer's command line `arguments` ask for a pickled config
    (pickled_config_refusal), before Hydra reads it. Hydra's own parser reads them, as Hydra then does: an abbreviation
    (--experimental) is the flag too."""
    command_line, _ = hydra_utils.get_args_parser().parse_known_args(arguments)
    if refused := pickled_config_refusal(command_line.experimental_rerun):
        print_refusal(refused)
        sys.exit(2)


def refused_in_one_line(step):
    """step's result, or where Hydra refuses the command line in it, one line and exit code 2."""
    try:
        return step()
    except (*COMMAND_LINE_ERRORS, ValueError) as error:
        if not refused_by_hydra(error) or os.environ.get("HYDRA_FULL_ERROR") == "1":  # as Hydra reads it
            raise
        print_refusal(command_line_error_line(error))
        sys.exit(2)


def refused_by_hydra(error: Exception) -> bool:
    """Whether Hydra refused the command line: its own errors, or the ValueError its defaults list raises for a config
    group given no option's name (model=null, experiment=null), which Hydra printed as a traceback and exit code 1. A
    ValueError raised anywhere else (the job's own) is not the command line's."""
    if isinstance(error, COMMAND_LINE_ERRORS):
        return True
    *_, (frame, _) = traceback.walk_tb(error.__traceback__)
    return isinstance(error, ValueError) and frame.f_globals.get("__name__") == "hydra._internal.defaults_list"


def print_refusal(line: str) -> None:
    """The trainer's one line for what it refuses before training, on stderr, tagged with the rank where not rank 0."""
    print(f"{rank_tag()}error: {line}", file=sys.stderr)


def command_line_error_line(error: Exception) -> str:
    """One line naming what Hydra refused and what it takes instead, where it knows: the keys beside a key that is not
    there, a group's options; else Hydra's own lines, and its cause's first, joined."""
    cause = error.__cause__
    if isinstance(cause, ConfigAttributeError | ConfigKeyError) and isinstance(cause.parent_node, DictConfig):
        return unknown_key_line(cause.full_key, [str(key) for key in cause.parent_node])
    if isinstance(error, MissingConfigException) and error.options:  # none where the group itself is not there
        return missing_option_line(error.missing_cfg_file, error.options, str(error).splitlines()[0])
    if isinstance(error, OverrideParseException):
        return f"cannot parse the override {error.override}: {parser_complaint(str(error))}"
    if not isinstance(error, COMMAND_LINE_ERRORS):  # refused_by_hydra's ValueError, which names no override
        return (f"{str(error).rstrip('.')}: a config group ({', '.join(config_groups())}) takes the name of one of its "
                "options (experiment's default is none: leave it out)")
    lines = [line.strip().rstrip(".") for line in str(error).splitlines() if line.strip()]
    if cause is not None:
        lines.append(str(cause).splitlines()[0])
    return "; ".join(lines)


def parser_complaint(message: str) -> str:
    """The override parser's lines less the one naming the override, in one: a ^ on a line of its own, under the
    character the parser stopped at (one outside its grammar: a letter such as ü unquoted), becomes that character."""
    said = []
    for line in message.splitlines():
        column = line.find("^")
        if line.strip() == "^" and said and column < len(said[-1]):
            said[-1] += f" (at {said[-1][column]!r})"
        elif line.strip() and not line.startswith("Error parsing override"):
            said.append(line.rstrip())
    return "; ".join(said)


def unknown_key_line(key: str, beside: list[str]) -> str:
    """beside: the keys of the key's parent. A name at the top may be a config group's misspelt (experiments=...)."""
    parent, _, name = key.rpartition(".")
    groups = [] if parent else config_groups()
    if close := difflib.get_close_matches(name, beside + groups, n=1):
        return f"unknown config key {key} (did you mean {parent + '.' if parent else ''}{close[0]}?)"
    if not beside:
        return f"unknown config key {key}"
    return f"unknown config key {key}: {parent or 'the config'} has {', '.join(beside)}"


def config_groups() -> list[str]:
    return sorted(folder.name for folder in CONF_DIR.iterdir() if folder.is_dir())


def missing_option_line(missing: str, options: list[str], hydra_line: str) -> str:
    """hydra_line: Hydra's "In 'train': Could not find 'experiment/nope'", which names the file whose defaults list
    asked for it (the command line's is the primary config's)."""
    group, _, option = missing.rpartition("/")
    close = difflib.get_close_matches(option, options, n=1)
    guess = f" (did you mean {group}={close[0]}?)" if close else ""
    return f"{hydra_line}{guess}; the options of {group}: {', '.join(options)}"
