"""Trainer pieces on their own: decoding and error rates, config composition, checkpoints, the step that skips NaNs."""
import argparse
import contextlib
import copy
import errno
import fcntl
import functools
import importlib
import json
import logging
import math
import os
import pickle
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from conftest import REPO_ROOT, without_root_privilege
from data.cli import shows_a_progress_bar
from data import files
from data.dataset import collate, Sample
from data.manifest import Utterance, write_manifest
from data.text import ALPHABET, encode
from prnn_kernels import relative_error
from trainer import build, checkpoint, cli, decode, inference, lm, run_directory
import trainer.__main__ as trainer_main
from trainer.__main__ import user_error_message
from trainer.decode import greedy_decode
from trainer.distributed import DistEnv
from trainer.environment import command_line, device_name, source_commit, versions
from trainer.metrics import ErrorCounts, edit_distance
from trainer.stop import (
    STOP_SIGNALS, StopSignals, StoppedBeforeTraining, ignore_in_data_workers, start_data_workers,
)
from trainer.config import (
    RESUME_MUST_MATCH, SET_MANIFESTS, check_config, check_resumable, known_config_keys, noting_what_does_nothing_here,
)
from trainer.resume import (
    check_same_training_set, checkpoint_to_resume, continued_run_id, is_own_checkpoint, known_entries,
    load_optimizer_state, recorded_run_id, restore, resumed_train_state, run_started_from,
)
from trainer.run_directory import MAX_FOLDER_NAME, hold_run_directory, job_folder
from trainer.train import (
    open_metrics, position_in_epochs, UNUSABLE, record_job, refuse_if_nothing_trained, skipped_step,
    steps_from_the_resume, train_loader, train_step, utterances_per_second,
)


# --- decoding and error rates -------------------------------------------------------------------------------------

def one_hot_log_probs(paths: list[str]) -> torch.Tensor:
    """(T, B, V) log-probs whose best path spells each string, '_' being the blank."""
    num_steps = max(len(path) for path in paths)
    log_probs = torch.full((num_steps, len(paths), len(ALPHABET)), -10.0)
    for b, path in enumerate(paths):
        for t, char in enumerate(path):
            log_probs[t, b, ALPHABET.index(char)] = 0.0
    return log_probs


def test_greedy_decode_collapses_repeats_and_removes_blanks():
    log_probs = one_hot_log_probs(["HHE_LL_LLO", "__NN_O___"])
    assert greedy_decode(log_probs, torch.tensor([10, 9])) == ["HELLO", "NO"]
    # Frames past a length are ignored even when they spell something.
    assert greedy_decode(log_probs, torch.tensor([3, 4])) == ["HE", "N"]
    assert greedy_decode(log_probs, torch.tensor([4, 5])) == ["HE", "N"]  # the next frames spell L and O
    assert greedy_decode(log_probs, torch.tensor([5, 6])) == ["HEL", "NO"]
    # Spaces the best path puts at the ends or, a blank between them, twice between words: the transcript has one.
    assert greedy_decode(one_hot_log_probs([" HI _ THERE "]), torch.tensor([13])) == ["HI THERE"]


def test_edit_distance_hand_worked():
    assert edit_distance("KITTEN", "SITTING") == 3
    assert edit_distance([], list("ABC")) == 3
    assert edit_distance(list("ABC"), []) == 3
    assert edit_distance("SAME", "SAME") == 0


def test_corpus_error_rates_are_ratios_of_sums():
    counts = ErrorCounts()
    # "TWO SIX EIGHT" -> "TWO SIX": one deletion of 3 words; "YES" -> "YES": none.
    assert counts.add("TWO SIX EIGHT", "TWO SIX") == (1, 6)
    assert counts.add("YES", "YES") == (0, 0)
    assert counts.wer == pytest.approx(100 * 1 / 4)
    assert counts.cer == pytest.approx(100 * 6 / (13 + 3))
    # Substitution plus insertion: "GO" -> "NO NO" is 1 substitution + 1 insertion over 1 word.
    other = ErrorCounts()
    other.add("GO", "NO NO")
    assert other.wer == pytest.approx(200.0)
    counts.unreadable = 2
    assert ErrorCounts.from_tensor(counts.as_tensor()) == counts


def test_counts_summed_over_ranks_stay_exact_past_float32s_integers():
    # The evaluation sums each rank's as_tensor() in one all-reduce: a test set of 2^24 characters and more (some 300
    # hours of speech) must come back to the character, as float32 would not (2^24 + 1 rounds to 2^24).
    ranks = [ErrorCounts(3, 10, 2**24 + 1, 2**24 + 3, 1), ErrorCounts(4, 2**24 + 1, 5, 7, 0)]
    summed = ErrorCounts.from_tensor(sum(counts.as_tensor() for counts in ranks))
    assert summed == ErrorCounts(7, 2**24 + 11, 2**24 + 6, 2**24 + 10, 1)


def test_error_rates_against_an_independent_edit_distance_over_random_texts():
    """Each utterance's errors are the edit distance by the recursive definition (memoised), and the corpus rates the
    summed errors over the summed reference words and characters, whatever the per-utterance ratios average to."""
    def distance(reference, hypothesis):
        @functools.cache
        def d(i, j):
            if not i or not j:
                return i + j
            return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (reference[i - 1] != hypothesis[j - 1]))
        return d(len(reference), len(hypothesis))

    rng = random.Random(0)
    words = ["A", "AB", "BA", "B'A", "ABBA"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 6))) for _ in range(200)]
    pairs = [*zip(texts[::2], texts[1::2]), ("A AB", ""), ("", "A AB"), ("ABBA", "ABBA")]
    counts = ErrorCounts()
    for reference, hypothesis in pairs:
        expected = (distance(tuple(reference.split()), tuple(hypothesis.split())), distance(reference, hypothesis))
        assert counts.add(reference, hypothesis) == expected, (reference, hypothesis)
    word_errors = [distance(tuple(r.split()), tuple(h.split())) for r, h in pairs]
    assert counts.wer == pytest.approx(100 * sum(word_errors) / sum(len(r.split()) for r, _ in pairs), rel=1e-12)
    ratios = [errors / len(r.split()) for errors, (r, _) in zip(word_errors, pairs) if r]
    assert counts.wer != pytest.approx(100 * sum(ratios) / len(ratios), rel=1e-3)  # the texts tell the two apart
    char_errors = sum(distance(r, h) for r, h in pairs)
    assert counts.cer == pytest.approx(100 * char_errors / sum(len(r) for r, _ in pairs), rel=1e-12)


def test_no_words_have_no_error_rate_rather_than_a_perfect_one():
    # A test set none of whose audio could be read once scored 0.00 % and was kept as the best checkpoint.
    assert math.isnan(ErrorCounts(unreadable=130).wer) and math.isnan(ErrorCounts().cer)
    assert not ErrorCounts(unreadable=130).beats(math.inf, math.inf)


def test_the_best_checkpoint_is_chosen_among_evaluations_that_read_the_most():
    # (word errors, words, char errors, chars, unreadable): WER 10 % over the whole set, 5 % over part of it.
    whole, part = ErrorCounts(2, 20, 3, 60, 0), ErrorCounts(1, 20, 1, 60, 4)
    assert whole.beats(math.inf, math.inf) and part.beats(math.inf, math.inf)
    assert whole.beats(part.unreadable, part.wer) and not part.beats(whole.unreadable, whole.wer)
    assert not whole.beats(0, 10.0) and whole.beats(0, 10.5)


# --- configuration --------------------------------------------------------------------------------------------------

def compose_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


@pytest.mark.parametrize("experiment", ["cpu_demo", "an4_gpu", "deep100"])
def test_every_experiment_composes_and_builds(experiment):
    cfg = compose_config([f"experiment={experiment}", "model.depth=2", "model.hidden=16"])
    features = build.features(cfg.data)
    model = build.model(cfg.model, features.num_features)
    assert len(model.layers) == 2
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    check_config(cfg)


def config_values(overrides: list[str]) -> dict:
    """{key: value} of every leaf of the composed config, interpolations as written."""
    def leaves(entries: dict, prefix: str) -> dict:
        return {leaf: value for key, entry in entries.items() for leaf, value in
                (leaves(entry, f"{prefix}{key}.") if isinstance(entry, dict) else {f"{prefix}{key}": entry}).items()}
    return leaves(OmegaConf.to_container(compose_config(overrides), resolve=False), "")


def override_value(key: str, text: str):
    """A value as `key=text` on the command line gives it, type included (20.0 is no 20, true no 1)."""
    value = OverridesParser.create().parse_override(f"{key}={text}").value()
    return type(value), value


def test_the_readme_lists_every_config_key_with_its_default_and_what_each_preset_sets():
    """The README had no list of the keys: data.augment.masks.*, optim.betas or data.an4_source were in no document."""
    readme = (REPO_ROOT / "README.md").read_text()
    rows = re.findall(r"^\| `([\w.]+)` \| `([^`]*)` \|", readme, re.MULTILINE)
    defaults = {**config_values(["optim=sgd"]), **config_values([])}  # optim.momentum is SGD's
    assert sorted(key for key, _ in rows) == sorted(known_config_keys())
    assert [key for key, text in rows if override_value(key, text) != (type(defaults[key]), defaults[key])] == []
    presets = dict(re.findall(r"^\| `((?:experiment|optim|data)=\w+)` \| (.*) \|$", readme, re.MULTILINE))
    experiments = {f"experiment={path.stem}" for path in (REPO_ROOT / "conf" / "experiment").glob("*.yaml")}
    assert experiments <= set(presets) and "optim=sgd" in presets and "data=manifest" in presets
    base = config_values([])
    for choice, sets in presets.items():
        values = config_values([choice])
        listed = {key: override_value(key, text) for key, text in re.findall(r"`([\w.]+)=([^`]*)`", sets)}
        changed = {key: (type(value), value) for key, value in values.items() if base.get(key, ...) != value}
        assert listed == changed, choice
        assert set(re.findall(r"no `([\w.]+)`", sets)) == set(base) - set(values), choice


def test_command_line_overrides_reach_the_model():
    cfg = compose_config(["model.depth=3", "model.hidden=8", "model.cell=lstm", "model.backend=reference",
                          "model.conv_channels=2"])
    recurrent = [m for m in build.model(cfg.model, 161).modules() if isinstance(m, torch.nn.RNNBase)]
    assert len(recurrent) == 3
    assert all(m.mode == "LSTM" and m.hidden_size == 8 and m.backend == "reference" for m in recurrent)
    deep = build.model(compose_config(["experiment=deep100", "model.hidden=8", "model.conv_channels=2"]).model, 161)
    recurrent = [m for m in deep.modules() if isinstance(m, torch.nn.RNNBase)]
    assert len(recurrent) == 100 and all(m.hidden_size == 8 for m in recurrent)
    sliced = build.model(compose_config(["model.depth=2", "model.hidden=8", "model.batch_slice=4"]).model, 161)
    assert [m.batch_slice for m in sliced.modules() if isinstance(m, torch.nn.RNNBase)] == [4, 4]


def test_the_trainers_help_says_what_it_does_and_lists_the_choices():
    result = subprocess.run([sys.executable, "-m", "trainer", "--help"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.startswith("python -m trainer [key=value ...]: trains the "
                                                               "DeepSpeech2 model"), result.stdout[:500]
    assert "experiment: an4_gpu, cpu_demo, deep100" in result.stdout and "cell: gru" in result.stdout


def test_an_installed_copy_of_the_distribution_finds_its_configs(tmp_path):
    """`pip install .` (not editable): the trainer, run from any folder, reads conf/ from the installed copy."""
    source, installed, work = tmp_path / "source", tmp_path / "installed", tmp_path / "work"
    source.mkdir()
    for name in ["pyproject.toml", "README.md"]:
        shutil.copy(REPO_ROOT / name, source)
    for folder in ["trainer", "data", "models", "prnn_kernels", "conf"]:
        shutil.copytree(REPO_ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(installed),
                    str(source)], check=True, timeout=300)
    work.mkdir()
    result = subprocess.run([sys.executable, "-m", "trainer", "experiment=cpu_demo", "--cfg", "job"], cwd=work,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(installed)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "hidden: 256" in result.stdout  # the experiment's model, composed from the installed conf/


def test_unknown_config_key_is_refused():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="model.depht"):
        compose_config(["model.depht=3"])


PICK = " (optim=NAME picks an optimizer with its settings)"
MOMENTUM = ("optim.momentum must be a number in (0, 1) (Nesterov momentum needs one; at 1 or more the "
            "momentum never decays)")


@pytest.mark.parametrize("override, complaint", [
    ("train.grad_clip_norm=-1", "train.grad_clip_norm must be a positive number, not -1"),  # would flip the gradient
    ("train.max_steps=0", "train.max_steps must be a positive integer or null, not 0"),
    ("train.global_batch_size=abc", "train.global_batch_size must be a positive integer, not 'abc'"),
    ("train.checkpoint_every_steps=true", "train.checkpoint_every_steps must be a positive integer or null, not True"),
    ("train.amp=fp16", "train.amp must be bf16 or none, not 'fp16'"),
    ("model.depth=2.5", "model.depth must be a positive integer, not 2.5"),
    ("seed=1.5", "seed must be an integer from 0 to 2**32 - 1, not 1.5"),
    ("seed=100000000000000", "seed must be an integer from 0 to 2**32 - 1, not 100000000000000"),
    ("data.train_manifests=a.jsonl",
     f"data.train_manifests must be a list of one or more manifest paths{SET_MANIFESTS}, not 'a.jsonl'"),
    ("data.train_manifests=[]", f"data.train_manifests must be a list of one or more manifest paths{SET_MANIFESTS}, "
                                "not []"),
    ("data=manifest data.train_manifests=[a.jsonl]",  # no eval_manifest: AN4's test set must not stand in for it
     f"data.eval_manifest must be a manifest's path{SET_MANIFESTS}, not None"),
    ("data.features.sample_rate=8000.0", "data.features.sample_rate must be an integer number of Hz from 1000 to "
                                         "384000, not 8000.0"),
    ("data.augment.masks.freq_mask=-5", "data.augment.masks.freq_mask must be a non-negative integer, not -5"),
    ("data.augment.masks.max_time_fraction=5", "data.augment.masks.max_time_fraction must be a number from 0 to 1, "
                                               "not 5"),
    ("model.conv_channels=-2", "model.conv_channels must be a positive integer, not -2"),
    ("model.lookahead=2.5", "model.lookahead must be a non-negative integer, not 2.5"),
    ("model.bidirectional=no", "model.bidirectional must be true or false, not 'no'"),  # a true string
    ("model.residual=3", "model.residual must be true or false, not 3"),
    ("model.cell=bogus", "model.cell must be one of relu, tanh, gru, lstm, not 'bogus'"),
    ("model.backend=fast", "model.backend must be one of auto, persistent, cudnn, reference, not 'fast'"),
    ("model.batch_slice=0", "model.batch_slice must be a positive integer or null, not 0"),
    ("train.progress_line_s=-1", "train.progress_line_s must be a non-negative number of seconds, not -1"),
    ("train.cuda_graphs=no", "train.cuda_graphs must be true or false, not 'no'"),
    ("data.augment.enabled=off", "data.augment.enabled must be true or false, not 'off'"),
    ("optim.lr=nan", "optim.lr must be a positive number, not nan"),
    ("distributed.timeout_s=-5", "distributed.timeout_s must be a positive number of seconds up to 1e+09, not -5"),
    # "Never time out": under MPI, 1e10 s failed the rendezvous at once, 9e9 and 1e11 hung it, 1e300 was a traceback.
    ("distributed.timeout_s=1e10", "distributed.timeout_s must be a positive number of seconds up to 1e+09, not "
                                   "10000000000.0"),
    ("train.epochs=${model.cell}", "train.epochs must be a positive integer, not 'gru'"),  # interpolations resolved
    ("train.resume=true", "train.resume must be null, auto or a checkpoint's path, not True"),
    ("data.max_duration=abc", "data.max_duration must be a positive number of seconds or null, not 'abc'"),
    ("optim.betas=[0.9]", "optim.betas must be two numbers in [0, 1) for optim.name=adamw, not [0.9]" + PICK),
    ("optim.betas=null", "optim.betas must be two numbers in [0, 1) for optim.name=adamw, not None" + PICK),
    ("optim.weight_decay=-1", "optim.weight_decay must be a non-negative number, not -1"),
    ("optim=sgd optim.momentum=-0.9", MOMENTUM + " for optim.name=sgd, not -0.9" + PICK),
    ("optim=sgd optim.momentum=0", MOMENTUM + " for optim.name=sgd, not 0" + PICK),
    # At 1.5 the CPU demo's loss (1 layer of 16) went from 1e3 at step 19 to 8e6 at step 40.
    ("optim=sgd optim.momentum=1.5", MOMENTUM + " for optim.name=sgd, not 1.5" + PICK),
    ("optim.name=sgd", MOMENTUM + " for optim.name=sgd, not None" + PICK),
    ("optim.name=adagrad", "optim.name must be one of adamw, sgd, as optim=NAME picks it with its settings, not "
                           "'adagrad'"),
    # Known keys, since the other optimizer's file has them, but the chosen one would never read them.
    ("+optim.momentum=0.5", "optim.momentum is sgd's setting, which optim.name=adamw does not read" + PICK),
    ("optim=sgd +optim.betas=[0.5,0.6]", "optim.betas is adamw's setting, which optim.name=sgd does not read" + PICK),
    ("optim.anneal=1.1", "optim.anneal must be a number in (0, 1], the factor the rate is multiplied by each epoch, "
                         "not 1.1"),  # deepspeech.pytorch's divisor: the rate would grow every epoch
    ("data.an4_source=''", "data.an4_source must be null or AN4's folder (PRNN_AN4 sets its default), not ''"),
    ("data.an4_source=123", "data.an4_source must be null or AN4's folder (PRNN_AN4 sets its default), not 123"),
    ("data.manifest_dir=null", "data.manifest_dir must be a folder's path, not None"),
    ("data.features.kind=mfcc", "data.features.kind must be one of spectrogram, mel, not 'mfcc'"),
    ("data.features.window_ms=1e9", "data.features.window_ms must be a number of milliseconds in (0, 1000], not "
                                    "1000000000.0"),  # a 64 GB window
    ("data.features.hop_ms=abc", "data.features.hop_ms must be a number of milliseconds in (0, 1000], not 'abc'"),
    ("data.features.n_mels=0", "data.features.n_mels must be a positive integer, not 0"),
    # Hydra refuses an unknown key on the command line, but takes one from an experiment file or a + override.
    ("+train.epoch=3", "unknown config key train.epoch: conf/train.yaml and conf/{model,data,optim}/ define no such "
                       "key (misspelt in an experiment file, or added by a + override?)"),
    ("+data.features.rate=8000", "unknown config key data.features.rate: conf/train.yaml and conf/{model,data,optim}/ "
                                 "define no such key (misspelt in an experiment file, or added by a + override?)"),
    # Each rule's bound, just past it: mutating any bound (>= 1 into >= 0, < 1 into <= 1, dropping a check) passed.
    ("seed=-1", "seed must be an integer from 0 to 2**32 - 1, not -1"),
    ("seed=4294967296", "seed must be an integer from 0 to 2**32 - 1, not 4294967296"),
    *((f"{key}=0", f"{key} must be a positive integer{' or null' if nullable else ''}, not 0") for key, nullable in (
        ("train.epochs", False), ("train.global_batch_size", False), ("train.eval_batch_size", False),
        ("train.checkpoint_every_steps", True), ("train.graph_pad_frames", False), ("model.depth", False),
        ("model.hidden", False), ("model.conv_channels", False))),
    *((f"{key}=-1", f"{key} must be a non-negative integer, not -1") for key in (
        "train.num_workers", "model.lookahead", "optim.warmup_steps", "data.augment.masks.time_mask",
        "data.augment.masks.num_freq_masks", "data.augment.masks.num_time_masks")),
    ("train.grad_clip_norm=0", "train.grad_clip_norm must be a positive number, not 0"),
    ("optim.lr=0", "optim.lr must be a positive number, not 0"),
    ("optim.lr=inf", "optim.lr must be a positive number, not inf"),
    ("optim.lr=true", "optim.lr must be a positive number, not True"),  # bool is an int subclass: 1
    ("optim.anneal=0", "optim.anneal must be a number in (0, 1], the factor the rate is multiplied by each epoch, "
                       "not 0"),
    ("optim.betas=[0.9,1.0]", "optim.betas must be two numbers in [0, 1) for optim.name=adamw, not [0.9, 1.0]" + PICK),
    ("optim=sgd optim.momentum=1", MOMENTUM + " for optim.name=sgd, not 1" + PICK),
    ("data.max_duration=0", "data.max_duration must be a positive number of seconds or null, not 0"),
    ("data.train_manifests=[a.jsonl,'']", "data.train_manifests must be a list of one or more manifest paths"
                                          f"{SET_MANIFESTS}, not ['a.jsonl', '']"),
    ("data.train_manifests=[a.jsonl,1]", "data.train_manifests must be a list of one or more manifest paths"
                                         f"{SET_MANIFESTS}, not ['a.jsonl', 1]"),
    ("data.eval_manifest=''", f"data.eval_manifest must be a manifest's path{SET_MANIFESTS}, not ''"),
    ("data.features.sample_rate=999", "data.features.sample_rate must be an integer number of Hz from 1000 to "
                                      "384000, not 999"),
    ("data.features.sample_rate=384001", "data.features.sample_rate must be an integer number of Hz from 1000 to "
                                         "384000, not 384001"),
    ("data.features.hop_ms=0", "data.features.hop_ms must be a number of milliseconds in (0, 1000], not 0"),
    ("data.augment.masks.max_time_fraction=-0.5", "data.augment.masks.max_time_fraction must be a number from 0 to "
                                                  "1, not -0.5"),
    ("train.resume=''", "train.resume must be null, auto or a checkpoint's path, not ''"),
    ("distributed.timeout_s=0", "distributed.timeout_s must be a positive number of seconds up to 1e+09, not 0"),
    *((f"{key}=no", f"{key} must be true or false, not 'no'") for key in (
        "data.sortagrad", "data.features.normalize", "train.sync_batch_norm", "train.progress_bar",
        "distributed.share_gpus")),
])
def test_a_bad_config_value_is_refused_naming_its_key(override, complaint):
    check_config(compose_config(["experiment=cpu_demo"]))  # the defaults pass
    with pytest.raises(ValueError) as error:
        check_config(compose_config(["experiment=cpu_demo", *override.split()]))
    assert str(error.value) == complaint


@pytest.mark.parametrize("override, complaint", [
    ("data.train_manifests=[a.jsonl,' ']", "data.train_manifests must be a list of one or more manifest paths"
                                           f"{SET_MANIFESTS}, not ['a.jsonl', ' ']"),
    ("data.eval_manifest=' '", f"data.eval_manifest must be a manifest's path{SET_MANIFESTS}, not ' '"),
    ("train.resume=' '", "train.resume must be null, auto or a checkpoint's path, not ' '"),
])
def test_a_path_of_only_whitespace_is_refused_naming_its_key(override, complaint):
    """A quoted shell variable that is unset but for a space: "manifest   does not exist", the path unseen."""
    with pytest.raises(ValueError) as error:
        check_config(compose_config(["experiment=cpu_demo", override]))
    assert str(error.value) == complaint


def test_an_empty_prnn_an4_is_refused_naming_it(monkeypatch):
    """PRNN_AN4= (a script's unset variable) said only that data.an4_source, a key the user never set, was ''."""
    monkeypatch.setenv("PRNN_AN4", "")
    with pytest.raises(ValueError) as error:
        check_config(compose_config(["experiment=cpu_demo"]))
    assert str(error.value) == "data.an4_source must be null or AN4's folder (PRNN_AN4 sets its default), not ''"


@pytest.mark.parametrize("override", [
    "seed=0", "seed=4294967295", "optim.betas=[0,0.999]", "optim.anneal=1", "data.features.sample_rate=1000",
    "data.features.sample_rate=384000", "data.augment.masks.max_time_fraction=0",
    "data.augment.masks.max_time_fraction=1", "distributed.timeout_s=1e9", "data.features.window_ms=1000",
    "model.lookahead=0", "train.num_workers=0"])
def test_a_config_value_at_the_end_of_its_range_is_taken(override):
    check_config(compose_config(["experiment=cpu_demo", override]))


@pytest.mark.parametrize("experiment", ["cpu_demo", "an4_gpu", "deep100"])
def test_an_experiments_optimizer_settings_give_way_to_another_optimizer(experiment):
    """The experiments tune AdamW: optim=sgd with one trains on SGD's own settings, not AdamW's rate and schedule."""
    sgd = compose_config(["optim=sgd"]).optim
    assert compose_config([f"experiment={experiment}", "optim=sgd"]).optim == sgd
    adamw = compose_config([f"experiment={experiment}"]).optim
    assert adamw.name == "adamw" and adamw != compose_config([]).optim  # its own settings over AdamW's defaults


def test_interpolations_in_the_model_and_feature_groups_are_resolved():
    cfg = compose_config(["model.depth=1", "model.hidden=${model.conv_channels}", "data.features.kind=mel",
                          "data.features.n_mels=${model.conv_channels}"])
    model = build.model(cfg.model, build.features(cfg.data).num_features)
    assert model.layers[0].rnn.hidden_size == cfg.model.conv_channels == 32
    assert build.features(cfg.data).num_features == 32


def test_resuming_needs_the_same_model_features_and_optimizer_but_not_the_same_backend(tmp_path):
    saved = OmegaConf.to_container(compose_config(["model.hidden=64", "optim=adamw"]), resolve=True)
    check_resumable(saved, compose_config(["model.hidden=64", "model.backend=reference", "model.batch_slice=4"]),
                    tmp_path / "last.pt")
    with pytest.raises(ValueError) as error:
        check_resumable(saved, compose_config(["model.hidden=32", "optim=sgd"]), tmp_path / "last.pt")
    assert str(error.value).startswith(f"cannot resume from {tmp_path / 'last.pt'}: it was written by a run with "
                                       "other settings (model.hidden=64 there, 32 here; ")
    assert "; optim.name='adamw' there, 'sgd' here;" in str(error.value)
    # The optimizer's state would bring back the checkpoint's rate, while config.yaml said the new one was used.
    with pytest.raises(ValueError, match=r"settings \(optim.lr=0.001 there, 0.5 here\)$"):
        check_resumable(saved, compose_config(["model.hidden=64", "optim.lr=0.5"]), tmp_path / "last.pt")
    # The lookahead convolution is the unidirectional model's alone.
    check_resumable(saved, compose_config(["model.hidden=64", "model.lookahead=5"]), tmp_path / "last.pt")
    unidirectional = OmegaConf.to_container(compose_config(["model.hidden=64", "model.bidirectional=false"]),
                                            resolve=True)
    with pytest.raises(ValueError, match=r"settings \(model.lookahead=20 there, 5 here\)$"):
        check_resumable(unidirectional, compose_config(["model.hidden=64", "model.bidirectional=false",
                                                        "model.lookahead=5"]), tmp_path / "last.pt")
    # Its sampler position counts global batches of its own size, order and utterances.
    with pytest.raises(ValueError, match="train.global_batch_size=16 there, 32 here; seed=1234 there, 7 here"):
        check_resumable(saved, compose_config(["model.hidden=64", "train.global_batch_size=32", "seed=7"]),
                        tmp_path / "last.pt")
    # Its utterances' paths, where it holds no digest of them (from before 2026-12-02); with one, which
    # check_same_training_set compares, the same corpus in another folder resumes (it was refused for its paths).
    moved = compose_config(["model.hidden=64", "data=manifest", "data.train_manifests=[/elsewhere/an4_train.jsonl]",
                            "data.eval_manifest=manifests/an4_test.jsonl"])
    with pytest.raises(ValueError, match=r"settings \(data.train_manifests=\['manifests/an4_train.jsonl'\] there, "
                                         r"\['/elsewhere/an4_train.jsonl'\] here\)$"):
        check_resumable(saved, moved, tmp_path / "last.pt")
    assert "data.train_manifests=['manifests/an4_train.jsonl'] there, ['/elsewhere/an4_train.jsonl'] here" in (
        check_resumable(saved, moved, tmp_path / "last.pt", holds_train_set=True))
    # A config of another program's, without the keys the trainer's holds: one line naming them (it was
    # omegaconf's ConfigAttributeError, "Missing key bidirectional", with a traceback).
    del saved["model"]["bidirectional"]
    with pytest.raises(ValueError, match=r"settings \(model.bidirectional=\(not set\) there, true here\)$"):
        check_resumable(saved, compose_config(["model.hidden=64"]), tmp_path / "last.pt")


# One change of each setting a resume must keep (RESUME_MUST_MATCH), from a unidirectional model, whose
# model.lookahead counts: the weights would load under several of them (model.residual, data.features.normalize,
# data.max_duration), and a run would train on without a word.
CHANGE_OF_EACH_KEPT_SETTING = {
    "model.depth": "model.depth=4", "model.hidden": "model.hidden=32", "model.cell": "model.cell=lstm",
    "model.bidirectional": "model.bidirectional=true", "model.lookahead": "model.lookahead=5",
    "model.residual": "model.residual=true", "model.conv_channels": "model.conv_channels=16",
    "data.features": "data.features.normalize=false", "optim": "optim.weight_decay=0.5",
    "train.global_batch_size": "train.global_batch_size=32", "seed": "seed=7", "data.sortagrad": "data.sortagrad=false",
    "data.train_manifests": "data.train_manifests=[/elsewhere/an4_train.jsonl]",
    "data.max_duration": "data.max_duration=10",
}


def test_each_setting_a_resume_must_keep_has_its_change_below():
    assert set(RESUME_MUST_MATCH) == set(CHANGE_OF_EACH_KEPT_SETTING)


@pytest.mark.parametrize("key", CHANGE_OF_EACH_KEPT_SETTING)
def test_a_resume_refuses_a_change_of_each_setting_it_must_keep(key, tmp_path):
    base = ["model.hidden=64", "model.bidirectional=false"]
    saved = OmegaConf.to_container(compose_config(base), resolve=True)
    override = CHANGE_OF_EACH_KEPT_SETTING[key]
    with pytest.raises(ValueError, match=rf"other settings \({re.escape(override.split('=')[0])}=.* there, .* here\)$"):
        check_resumable(saved, compose_config([*base, override]), tmp_path / "last.pt")


def test_a_resume_names_the_settings_it_changes(tmp_path):
    saved = OmegaConf.to_container(compose_config(["model.hidden=64", "train.resume=null"]), resolve=True)
    # Nothing changed but the resume itself.
    assert check_resumable(saved, compose_config(["model.hidden=64", "train.resume=auto"]), tmp_path / "last.pt") == []
    # They were taken without a word (trainer.train logs these), and config.yaml, written anew, holds only this job's.
    changed = check_resumable(saved, compose_config(["model.hidden=64", "train.resume=auto", "train.grad_clip_norm=5",
                                                     "data.augment.enabled=false", "train.max_steps=9"]),
                              tmp_path / "last.pt")
    assert changed == ["data.augment.enabled=true there, false here", "train.grad_clip_norm=400.0 there, 5 here",
                       "train.max_steps=null there, 9 here"]


def test_a_refused_resume_names_each_value_as_an_override_gives_it_back(tmp_path):
    """The values a refusal names are the ones to resume with: it said None, which given back (data.max_duration=None)
    is Hydra's string 'None', refused by the config rules, where null was meant."""
    saved = OmegaConf.to_container(compose_config(["data.max_duration=null"]), resolve=True)
    with pytest.raises(ValueError, match=r"settings \((data.max_duration=\S+) there, 20.0 here\)$") as error:
        check_resumable(saved, compose_config([]), tmp_path / "last.pt")
    given_back = compose_config([re.search(r"\((\S+) there", str(error.value))[1]])
    check_config(given_back)
    assert check_resumable(saved, given_back, tmp_path / "last.pt") == []


def test_a_resume_on_a_cpu_says_that_a_changed_train_amp_changes_nothing_there(tmp_path):
    """A CPU computes in fp32 whatever train.amp says: the log said bf16 was taken, as though the run now used it."""
    saved = OmegaConf.to_container(compose_config(["train.amp=none"]), resolve=True)
    changed = check_resumable(saved, compose_config(["train.amp=bf16", "train.max_steps=9"]), tmp_path / "last.pt")
    assert noting_what_does_nothing_here(changed, torch.device("cpu")) == [
        "train.amp='none' there, 'bf16' here (nothing changes on cpu, which computes in fp32)",
        "train.max_steps=null there, 9 here"]
    assert noting_what_does_nothing_here(changed, torch.device("cuda", 0)) == changed  # bf16 autocast from here on


def test_an_epoch_line_names_the_steps_trained_since_a_resume():
    assert steps_from_the_resume(0, 4) == ""
    assert steps_from_the_resume(1, 4) == " (steps 2-4, from the resume)"
    assert steps_from_the_resume(3, 4) == " (step 4, from the resume)"  # it said "steps 4-4"
    assert steps_from_the_resume(4, 4) == " (its steps trained before the resume)"  # stopped during its evaluation


def test_a_runs_position_is_told_in_epochs_counted_from_1():
    assert position_in_epochs({"epoch": 1, "epoch_step": 2}) == "step 2 of epoch 2"
    assert position_in_epochs({"epoch": 2, "epoch_step": 0}) == "the end of epoch 2"
    # A signal between the start of training and its first step saves a checkpoint at step 0 ("the end of epoch 0").
    assert position_in_epochs({"epoch": 0, "epoch_step": 0}) == "the start of epoch 1"


def test_a_training_rate_below_one_utterance_a_second_keeps_its_digits():
    """The 100-layer preset on a CPU trains 2 utterances in 84 s a step: its progress line said 0.0 utterances/s."""
    assert utterances_per_second(2, 84.0) == "0.024"
    assert utterances_per_second(8, 10.0) == "0.8"
    assert utterances_per_second(64, 5.0) == "12.8"
    assert utterances_per_second(0, 5.0) == "0"


def test_a_progress_bar_shows_on_a_terminal_that_has_a_width_only(tmp_path):
    """tqdm draws nothing on a terminal of 0 columns (one no one gave a size), as it draws nothing worth reading in a
    file: both get log lines instead."""
    controller, terminal = os.openpty()
    try:
        with open(terminal, "w", closefd=False) as stream, open(tmp_path / "log", "w") as file:
            assert not shows_a_progress_bar(stream) and not shows_a_progress_bar(file)
            fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
            assert shows_a_progress_bar(stream)
    finally:
        os.close(terminal)
        os.close(controller)


def test_beam_width_zero_is_refused_rather_than_taken_as_the_default():
    arguments = argparse.Namespace(beam=0, lm=None, lm_weight=None, word_bonus=None)
    with pytest.raises(ValueError, match="beam width must be at least 1"):
        decode.from_arguments(arguments)


def test_a_language_model_refuses_an_empty_manifest_path(tmp_path, capsys):
    # --manifest "$M" with M unset was read as the current folder: "error: manifest . is a folder, not a file".
    with pytest.raises(SystemExit) as refused:
        lm.main(["--manifest", "", "--out", str(tmp_path / "m.arpa")])
    assert refused.value.code == 2
    assert capsys.readouterr().err.endswith("error: argument --manifest: an empty path (an unset shell variable?)\n")


def test_a_language_model_leaves_out_transcripts_the_model_cannot_spell(tmp_path, capsys):
    # None of the audio is here, as where a model is built from transcripts alone: each missing file is its own.
    (tmp_path / "m.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": "yes no"}\n'
                                      '{"audio_filepath": "b.wav", "duration": 1.0, "text": "café ok"}\n'
                                      '{"audio_filepath": "c.wav", "duration": 1.0, "text": "maybe"}\n')
    assert lm.main(["--manifest", str(tmp_path / "m.jsonl"), "--order", "1", "--out", str(tmp_path / "m.arpa")]) == 0
    out = capsys.readouterr().out
    assert "counting the 1-grams of 2 transcripts" in out  # before the work, which takes a minute at 100k
    assert "a 1-gram model of 2 transcripts; 1 empty or unspellable left out" in out
    words = lm.NGramLM.from_arpa_text((tmp_path / "m.arpa").read_text()).tables
    assert ("YES",) in words and ("MAYBE",) in words and ("OK",) not in words and ("CAFÉ",) not in words


def test_a_unigram_language_model_is_written_as_kenlm_reads_it(tmp_path):
    # KenLM refuses a model without <s>, and any model of order 1 ("assumes at least a bigram model"): --order 1
    # wrote one it refused on both counts.
    (tmp_path / "m.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": "yes no"}\n')
    assert lm.main(["--manifest", str(tmp_path / "m.jsonl"), "--order", "1", "--out", str(tmp_path / "m.arpa")]) == 0
    text = (tmp_path / "m.arpa").read_text()
    assert text.startswith("\\data\\\nngram 1=5\nngram 2=0\n\n") and "\n-99.000000000\t<s>\n" in text, text
    assert text.endswith("\n\\2-grams:\n\n\\end\\\n"), text
    model = lm.NGramLM.from_arpa(tmp_path / "m.arpa")
    # YES, NO and </s> each seen once of 3: Ney's discount 0.9 (its cap), whatever the history, and the 3 x 0.9 / 3
    # taken spread over the three and <unk>
    assert model.order == 1 and 10 ** model.log10_prob(("YES",), "NO") == pytest.approx(0.1 / 3 + 0.9 / 4, abs=1e-8)


def test_a_word_never_seen_in_training_is_less_likely_than_every_word_seen():
    # All the mass the unigrams' discount took went to <unk>: 0.54 here against NO's 0.02, and on AN4's transcripts
    # <unk> outscored 62 of its 99 words, so the beam search took a string it could not spell for most words.
    model = lm.NGramLM.from_arpa_text(lm.build_arpa([["YES", "NO", "YES", "YES"]], 1))
    unknown = model.log10_prob((), "NEVER")
    assert all(model.log10_prob((), word) > unknown for word in ("YES", "NO", "</s>")), model.tables


def test_a_language_model_of_an_order_past_the_longest_transcript_is_that_transcripts_order(tmp_path, capsys):
    # "<s> YES NO YES </s>" holds no n-gram longer than 5: a 6-gram section of none read as a model cut short.
    (tmp_path / "m.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": "yes no yes"}\n')
    assert lm.main(["--manifest", str(tmp_path / "m.jsonl"), "--order", "6", "--out", str(tmp_path / "m.arpa")]) == 0
    assert "a 5-gram model of 1 transcript (--order 6: none is longer than 3 words)" in capsys.readouterr().out
    model = lm.NGramLM.from_arpa(tmp_path / "m.arpa")
    five = lm.NGramLM.from_arpa_text(lm.build_arpa([["YES", "NO", "YES"]], 5))
    assert model.order == 5 and model.tables == five.tables
    assert lm.build_arpa([["YES"]], 10**9) == lm.build_arpa([["YES"]], 3)  # at once, not a count over every order


def test_a_language_model_counts_an_audio_files_transcript_once(tmp_path, monkeypatch, capsys):
    # A manifest given twice (as it is, as ./m.jsonl, through a link) counted its transcripts twice: every n-gram's
    # count doubled, and the discounts and backoff weights with them. Training keeps an audio file listed again once.
    for name in ("a.wav", "b.wav"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "m.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": "yes no"}\n'
                                      '{"audio_filepath": "b.wav", "duration": 1.0, "text": "no no"}\n')
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "b_link.wav").symlink_to(tmp_path / "b.wav")
    (tmp_path / "elsewhere" / "b.jsonl").write_text('{"audio_filepath": "b_link.wav", "duration": 1.0, '
                                                    '"text": "no no"}\n')
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "m.jsonl")
    monkeypatch.chdir(tmp_path)
    assert lm.main(["--manifest", "m.jsonl", "--order", "2", "--out", "once.arpa"]) == 0
    capsys.readouterr()
    assert lm.main(["--manifest", "m.jsonl", "./m.jsonl", "link.jsonl", "elsewhere/b.jsonl", "--order", "2",
                    "--out", "repeated.arpa"]) == 0
    printed = capsys.readouterr()
    assert (tmp_path / "repeated.arpa").read_text() == (tmp_path / "once.arpa").read_text()
    first = tmp_path / "a.wav"
    assert printed.err == f"skipping 5 transcripts whose audio file is listed before (the first: {first})\n"
    assert printed.out.endswith("a 2-gram model of 2 transcripts; 5 whose audio file is listed before left out\n")


def test_a_tools_output_may_be_a_stream(tmp_path):
    # /dev/stdout into a pipe: written beside and renamed, it ended in "cannot write /dev/stdout" after the work.
    (tmp_path / "m.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": "yes no"}\n')
    result = subprocess.run([sys.executable, "-m", "trainer.lm", "--manifest", str(tmp_path / "m.jsonl"), "--out",
                             "/dev/stdout"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "\\data\\\nngram 1=5\n" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("mode", ["w", "a"])
def test_a_tools_output_to_dev_stdout_under_a_redirection_keeps_the_files_lines(tmp_path, mode):
    # `--out /dev/stdout >> log.txt`: written beside the file and renamed over it, the lines >> had appended to were
    # lost, and so were the tool's own lines on stdout, before and after.
    (tmp_path / "m.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": "yes no"}\n')
    log = tmp_path / "log.txt"
    log.write_text("an earlier line\n")
    with open(log, mode) as stdout:
        result = subprocess.run([sys.executable, "-m", "trainer.lm", "--manifest", str(tmp_path / "m.jsonl"),
                                 "--out", "/dev/stdout"], cwd=REPO_ROOT, stdout=stdout, stderr=subprocess.PIPE,
                                text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    earlier = "an earlier line\n" if mode == "a" else ""
    written = log.read_text()
    assert written.startswith(f"{earlier}counting the 3-grams of 1 transcript\n\\data\\\nngram 1=5\n"), written
    assert written.endswith("\\end\\\nwrote /dev/stdout: a 3-gram model of 1 transcript\n"), written


def test_a_language_model_of_no_words_is_one_clear_error(tmp_path, capsys):
    (tmp_path / "blank.jsonl").write_text('{"audio_filepath": "a.wav", "duration": 1.0, "text": " "}\n')
    assert lm.main(["--manifest", str(tmp_path / "blank.jsonl"), "--out", str(tmp_path / "x.arpa")]) == 2
    assert "no words to count: the transcripts of" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        lm.main(["--manifest", str(tmp_path / "blank.jsonl"), "--out", str(tmp_path / "no" / "x.arpa")])
    assert refused.value.code == 2 and f"argument --out: no folder {tmp_path / 'no'}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        lm.main(["--manifest", str(tmp_path / "blank.jsonl"), "--order", "0", "--out", str(tmp_path / "x.arpa")])
    assert refused.value.code == 2 and "argument --order: must be at least 1, not 0" in capsys.readouterr().err


def test_an_output_file_that_could_not_be_written_is_refused_before_the_work(tmp_path, monkeypatch):
    assert cli.output_file(str(tmp_path / "x.arpa")) == str(tmp_path / "x.arpa")
    with pytest.raises(argparse.ArgumentTypeError, match=f"{tmp_path} is a folder; name a file in it"):
        cli.output_file(str(tmp_path))
    too_long = tmp_path / ("x" * 300)  # a traceback out of argparse, which takes only its own errors from a type
    with pytest.raises(argparse.ArgumentTypeError, match=f"{too_long} cannot be written: File name too long$"):
        cli.output_file(str(too_long))
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # what a folder not the user's answers
    with pytest.raises(argparse.ArgumentTypeError, match="x.arpa cannot be written"):
        cli.output_file(str(tmp_path / "x.arpa"))


def test_unknown_optimizer_names_the_key():
    cfg = compose_config(["optim.name=adagrad"])
    with pytest.raises(ValueError, match="optim.name"):
        build.optimizer(cfg.optim, [torch.nn.Parameter(torch.zeros(1))])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_optimizers_are_fused_and_step_as_torch_default_does(name, device):
    cfg = compose_config([f"optim={name}", "optim.lr=1e-2", "optim.weight_decay=1e-2"])
    generator = torch.Generator().manual_seed(0)
    shapes = [(800, 161), (3, 3), (2400,)]
    parameters = [torch.nn.Parameter(torch.randn(shape, generator=generator).to(device)) for shape in shapes]
    fused = build.optimizer(cfg.optim, parameters)
    assert fused.defaults["fused"]
    initial = [parameter.detach().clone() for parameter in parameters]
    expected = [torch.nn.Parameter(parameter.detach().clone()) for parameter in parameters]
    # Torch's default (foreach kernels) with the settings as the config and the README give them, not as the fused
    # optimizer took them.
    if name == "sgd":
        default = torch.optim.SGD(expected, lr=1e-2, momentum=cfg.optim.momentum, nesterov=True, weight_decay=1e-2)
    else:
        default = torch.optim.AdamW(expected, lr=1e-2, betas=tuple(cfg.optim.betas), weight_decay=1e-2)
    for _ in range(3):
        for parameter, twin in zip(parameters, expected):
            parameter.grad = torch.randn(parameter.shape, generator=generator).to(device)
            twin.grad = parameter.grad.clone()
        fused.step()
        default.step()
    for parameter, twin, before in zip(parameters, expected, initial):
        assert relative_error(parameter.double(), before.double()) > 1e-3  # the steps moved it
        assert relative_error(parameter.double(), twin.double()) <= 1e-6


def test_lr_schedule_warms_up_then_anneals_per_epoch():
    cfg = compose_config(["optim=adamw", "optim.lr=1.0", "optim.warmup_steps=4", "optim.anneal=0.5"])
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = build.optimizer(cfg.optim, [parameter])
    schedule = build.lr_schedule(cfg.optim, optimizer, steps_per_epoch=10)
    rates = []
    for _ in range(25):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert rates[9] == pytest.approx(1.0) and rates[10] == pytest.approx(0.5) and rates[20] == pytest.approx(0.25)


# --- checkpoints ----------------------------------------------------------------------------------------------------

def test_checkpoint_round_trip_keeps_tensors_and_plain_data(tmp_path):
    state = {"model": {"w": torch.randn(3)}, "config": {"seed": 1}, "train_state": {"epoch": 2, "best_wer": math.inf},
             "rng": [checkpoint.rng_state(torch.device("cpu"))]}
    checkpoint.save(tmp_path / "c.pt", state)
    loaded = checkpoint.load(tmp_path / "c.pt")
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert loaded["train_state"] == state["train_state"]
    assert torch.equal(loaded["rng"][0]["torch"], state["rng"][0]["torch"])
    assert loaded["rng"][0]["python"] == state["rng"][0]["python"]
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed into place


def test_the_random_state_comes_back_whole_from_the_json_text_the_ranks_gather(tmp_path):
    # The ranks gather their states as JSON text, not as pickles, which would run what they hold; the checkpoint still
    # holds ByteTensors and Python's tuples, and resuming from it draws the same numbers.
    random.gauss(0, 1)  # leaves the next Gaussian in Python's state: a float, which must come back to the last bit
    state = {**checkpoint.rng_state(torch.device("cpu")), "cuda": torch.arange(16, dtype=torch.uint8)}
    gathered = checkpoint.rng_state_from_json(json.loads(json.dumps(checkpoint.rng_state_as_json(state))))
    checkpoint.save(tmp_path / "c.pt", {"model": {}, "config": {}, "rng": [gathered]})
    loaded = checkpoint.load(tmp_path / "c.pt")["rng"][0]
    assert list(loaded) == list(state)
    assert type(loaded["python"]) is tuple and loaded["python"] == state["python"]
    for name in ("torch", "cuda"):
        assert loaded[name].dtype == torch.uint8 and torch.equal(loaded[name], state[name])
    drawn = torch.rand(3).tolist(), random.random(), random.gauss(0, 1)
    checkpoint.set_rng_state(loaded, torch.device("cpu"))
    assert (torch.rand(3).tolist(), random.random(), random.gauss(0, 1)) == drawn


def test_a_checkpoint_saved_as_well_under_another_name_keeps_it_when_either_is_saved_again(tmp_path):
    # save_same links last.pt to best.pt; a crash between the link and its rename leaves a temporary beside last.pt
    # linked to best.pt, which the next save of last.pt must not write into, changing best.pt with it.
    best, last = tmp_path / "best.pt", tmp_path / "last.pt"
    checkpoint.save(best, {"model": {"w": torch.zeros(3)}, "config": {}})
    checkpoint.save_same(best, last)
    os.link(best, files.temporary_beside(last))
    checkpoint.save(last, {"model": {"w": torch.ones(3)}, "config": {}})
    assert torch.equal(torch.load(best, weights_only=True)["model"]["w"], torch.zeros(3))
    assert torch.equal(torch.load(last, weights_only=True)["model"]["w"], torch.ones(3))
    checkpoint.save_same(last, best)
    checkpoint.save(last, {"model": {"w": torch.full((3,), 2.0)}, "config": {}})
    assert torch.equal(torch.load(best, weights_only=True)["model"]["w"], torch.ones(3))
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_checkpoint_saved_as_well_is_copied_where_the_file_system_has_no_hard_links(tmp_path, monkeypatch):
    def no_hard_links(*args):
        raise OSError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(os, "link", no_hard_links)
    best, last = tmp_path / "best.pt", tmp_path / "last.pt"
    checkpoint.save(best, {"model": {"w": torch.arange(3.0)}, "config": {}})
    checkpoint.save_same(best, last)
    assert last.read_bytes() == best.read_bytes() and not last.samefile(best)
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_entries_not_finite_names_each_nan_or_infinity_and_no_large_finite_value(dtype, device):
    model = torch.nn.ModuleDict({name: torch.nn.Linear(300, 200).to(device, dtype) for name in ("a", "b", "c")})
    model.register_buffer("empty", torch.empty(0, 5, dtype=dtype, device=device))
    with torch.no_grad():
        for layer in model.values():  # as large as the dtype holds, of both signs: a sum or a 2-norm overflows
            layer.weight.fill_(torch.finfo(dtype).max)
            layer.weight[::2] *= -1
    assert build.entries_not_finite(model) == ""
    with torch.no_grad():
        model["a"].bias[-1] = math.nan
        model["c"].weight[150, 299] = -math.inf
        model["c"].bias[0] = math.inf
    assert build.entries_not_finite(model) == "a.bias, c.weight, c.bias"


def test_entries_not_finite_allocates_no_copy_of_the_weights():
    # isfinite(tensor).all() made a copy of each tensor and four boolean ones on a CPU: 3-9 s for deep100's model.
    model = torch.nn.Linear(2048, 1024)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiled:
        build.entries_not_finite(model)
    assert max(event.cpu_memory_usage for event in profiled.events()) < 1024


def test_a_checkpoint_holds_the_random_state_of_its_own_gpu_only(monkeypatch):
    # With every visible GPU's state, a job resumed where fewer GPUs are visible failed (IndexError).
    calls = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: calls.append(("get", device)) or
                        torch.full((2,), device.index, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda state, device: calls.append(("set", state.tolist(), device)))
    first, second = torch.device("cuda", 0), torch.device("cuda", 1)
    state = checkpoint.rng_state(second)
    checkpoint.set_rng_state(state, first)  # resumed on a host with one GPU
    every_gpu = [torch.full((2,), index, dtype=torch.uint8) for index in range(4)]  # a checkpoint before the change
    checkpoint.set_rng_state({**state, "cuda": every_gpu}, second)
    checkpoint.set_rng_state({**state, "cuda": every_gpu[:1]}, second)
    assert calls == [("get", second), ("set", [1, 1], first), ("set", [1, 1], second), ("set", [0, 0], second)]
    assert "cuda" not in checkpoint.rng_state(torch.device("cpu"))


@pytest.mark.cuda
def test_the_gpu_random_state_comes_back():
    device = torch.device("cuda", 0)
    state = checkpoint.rng_state(device)
    drawn = torch.rand(4, device=device)
    checkpoint.set_rng_state(state, device)
    assert torch.equal(torch.rand(4, device=device), drawn)
    checkpoint.set_rng_state({**state, "cuda": [state["cuda"]] * 9}, device)  # from a host with 9 GPUs
    assert torch.equal(torch.rand(4, device=device), drawn)


def test_a_checkpoint_write_that_fails_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    checkpoint.save(tmp_path / "c.pt", {"model": {"w": torch.zeros(3)}, "config": {}})

    def crash(*args):
        raise OSError("the job was killed mid-write")

    monkeypatch.setattr(checkpoint.os, "replace", crash)
    with pytest.raises(checkpoint.CheckpointWriteError, match="the job was killed mid-write"):
        checkpoint.save(tmp_path / "c.pt", {"model": {"w": torch.ones(3)}, "config": {}})
    assert torch.equal(checkpoint.load(tmp_path / "c.pt")["model"]["w"], torch.zeros(3))
    assert [path.name for path in tmp_path.iterdir()] == ["c.pt"]  # the full-size temporary file removed


def test_a_run_directory_is_free_once_its_job_is_killed_though_its_children_live_on(tmp_path):
    """Data-loading workers are forked with the lock's file open: an flock, which they shared, stayed held until they
    noticed their parent had died, and a job restarted at once was refused, naming a dead process."""
    script = ("import os, sys, time\n"
              "from pathlib import Path\n"
              "from trainer.run_directory import hold_run_directory\n"
              "with hold_run_directory(Path(sys.argv[1]), is_main=True):\n"
              "    if os.fork() == 0:\n"
              "        time.sleep(120)\n"
              "        os._exit(0)\n"
              "    print('held', flush=True)\n"
              "    time.sleep(120)\n")
    job = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        assert job.stdout.readline() == "held\n"
        with pytest.raises(ValueError, match=rf"{tmp_path} is in use by another job \(pid {job.pid} on "):
            with hold_run_directory(tmp_path, is_main=True):
                pass
        job.kill()  # the job alone: its forked child holds the lock's file still
        job.wait()
        with hold_run_directory(tmp_path, is_main=True):
            pass
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()


@pytest.mark.parametrize("folder, written", [("checkpoints", "its checkpoints"),
                                             ("tensorboard", "its TensorBoard events")])
def test_a_run_folder_that_is_a_symbolic_link_to_nothing_is_refused_before_training(folder, written, tmp_path):
    """Linked to a scratch disk that is not mounted: the first checkpoint failed after an epoch's work, saying 'File
    exists', and TensorBoard's writer in a traceback."""
    (tmp_path / folder).symlink_to(tmp_path / "unmounted")
    with pytest.raises(ValueError) as error:
        with hold_run_directory(tmp_path, is_main=True):
            pass
    assert str(error.value) == (f"{tmp_path / folder} is a symbolic link to {tmp_path / 'unmounted'}, which does not "
                                f"exist: the run writes {written} there")


@pytest.mark.parametrize("link", ["runs", "runs/name"])
def test_a_run_directory_under_a_symbolic_link_to_nothing_names_the_link_and_its_target(link, tmp_path, capsys):
    """runs/ (or the run's own folder) linked to a scratch disk that is not mounted: mkdir said only 'File exists'."""
    (tmp_path / link).parent.mkdir(exist_ok=True)
    (tmp_path / link).symlink_to(tmp_path / "unmounted")
    with pytest.raises(SystemExit) as exit_info:
        run_directory.make_or_exit(str(tmp_path / "runs" / "name"))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (f"error: cannot make the run directory {tmp_path / 'runs' / 'name'}: "
                                       f"{tmp_path / link} is a symbolic link to {tmp_path / 'unmounted'}, which does "
                                       "not exist\n")


def test_a_run_directory_that_exists_but_cannot_be_written_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """Hydra's log file failed first, in a traceback of 32 lines and exit code 1. The tests run as root, whom
    permissions do not stop, so the system's answer is played: a read-only file system gives the same."""
    run_directory.make_or_exit(str(tmp_path))
    monkeypatch.setattr(run_directory.os, "access", lambda path, mode: False)
    with pytest.raises(SystemExit) as exit_info:
        run_directory.make_or_exit(str(tmp_path))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"error: cannot write in the run directory {tmp_path}\n"


def test_a_tool_interrupted_by_ctrl_c_says_so_in_one_line(capsys):
    def interrupted():
        raise KeyboardInterrupt

    assert cli.run_tool(interrupted) == 130
    assert capsys.readouterr().err == "interrupted by Ctrl-C\n"
    assert cli.run_tool(lambda: 3) == 3


# Runs a tool as `python -m` does, sending it a real Ctrl-C as its first import of the module named in argv[1] begins.
CTRL_C_WHILE_IMPORTING = """
import builtins, os, runpy, signal, sys
tool, interrupted_at = sys.argv[1:3]
real_import = builtins.__import__
def importing(name, *args, **kwargs):
    if name == interrupted_at:
        builtins.__import__ = real_import
        os.kill(os.getpid(), signal.SIGINT)
    return real_import(name, *args, **kwargs)
builtins.__import__ = importing
sys.argv = [tool, "--help"]
runpy.run_module(tool, run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("tool, interrupted_at", [
    ("trainer.evaluate", "torch"), ("trainer.transcribe", "torch"), ("trainer.lm", "data.manifest"),
    ("benchmarks.rnn_kernels", "torch"), ("benchmarks.rnn_stack", "torch"), ("benchmarks.train_step", "torch"),
    ("benchmarks.scaling", "torch"), ("benchmarks.wer_parity", "yaml"), ("data.prepare", "tqdm"),
])
def test_a_tool_interrupted_by_ctrl_c_while_it_imports_says_so_in_one_line(tool, interrupted_at):
    """A Ctrl-C in the seconds a tool imports torch, before run_tool takes it, printed a traceback from inside them
    (benchmarks.scaling, benchmarks.wer_parity and data.prepare still did, until they shared data.cli)."""
    result = subprocess.run([sys.executable, "-c", CTRL_C_WHILE_IMPORTING, tool, interrupted_at], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert (result.returncode, result.stdout, result.stderr) == (130, "", "interrupted by Ctrl-C\n"), result.stderr


@pytest.mark.parametrize("tool, interrupted_at", [
    ("trainer.evaluate", "torch"), ("trainer.lm", "data.manifest"), ("benchmarks.scaling", "torch"),
    ("benchmarks.wer_parity", "yaml"), ("data.prepare", "tqdm"),
])
def test_a_tool_started_with_ctrl_c_ignored_runs_on_through_one(tool, interrupted_at):
    """A non-interactive shell starts `tool &` with SIGINT ignored, so that a Ctrl-C for the foreground job (the
    terminal's, to the whole process group) leaves it running: the tools took SIGINT over and ended on it."""
    result = subprocess.run([sys.executable, "-c", CTRL_C_WHILE_IMPORTING, tool, interrupted_at], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    assert result.stdout.startswith("usage:"), result.stdout


def test_an_output_file_is_written_whole_and_never_over_an_input(tmp_path):
    target, manifest = tmp_path / "out.tsv", tmp_path / "m.jsonl"
    manifest.write_text("kept\n")
    with pytest.raises(ValueError, match="is also an input of this command"):
        cli.check_not_an_input(str(manifest), [str(tmp_path / "." / "m.jsonl")])
    cli.check_not_an_input(None, [str(manifest)])
    (tmp_path / "link.tsv").symlink_to(tmp_path / "nowhere" / "x.tsv")  # a dangling link: its folder does not exist
    with pytest.raises(argparse.ArgumentTypeError, match=f"no folder {tmp_path / 'nowhere'}"):
        cli.output_file(str(tmp_path / "link.tsv"))
    cli.write_output(str(target), "table\n")
    assert target.read_text() == "table\n" and sorted(path.name for path in tmp_path.iterdir()) == [
        "link.tsv", "m.jsonl", "out.tsv"]


def test_a_ctrl_c_during_a_checkpoint_write_stays_a_ctrl_c(tmp_path, monkeypatch):
    """torch's writer turns an exception in its write callback into a RuntimeError: a second Ctrl-C during a write
    read as a failed disk write (exit 2, and a sweep went on to its next job)."""
    class InterruptedFile:
        def __init__(self, file):
            self.file, self.writes = file, 0

        def write(self, data):
            self.writes += 1
            if self.writes > 2:
                raise KeyboardInterrupt
            return self.file.write(data)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    monkeypatch.setattr(files, "open", lambda path, mode: InterruptedFile(open(path, mode)), raising=False)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path / "last.pt", {"model": {"w": torch.zeros(10**5)}, "config": {}})
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_the_disk_cannot_hold_is_one_error_naming_it_and_leaves_no_temporary_file(tmp_path):
    """A full disk, played by a file size limit (RLIMIT_FSIZE: Python ignores SIGXFSZ, so the write fails): the
    previous checkpoint stays whole, the part-written temporary file is removed, and the error names the file."""
    path = tmp_path / "last.pt"
    checkpoint.save(path, {"model": {"w": torch.zeros(3)}, "config": {}})
    script = (
        "import resource, sys, torch\n"
        "from pathlib import Path\n"
        "from trainer import checkpoint\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        "try:\n"
        f"    checkpoint.save(Path({str(path)!r}), {{'model': {{'w': torch.ones(10**6)}}, 'config': {{}}}})\n"
        "except ValueError as error:\n"  # what the trainer reports in one line, exit code 2
        "    sys.exit(str(error))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and result.stderr.startswith(f"cannot write checkpoint {path} ("), result.stderr
    assert result.stderr.rstrip().endswith("; last.pt there, if any, is as it was"), result.stderr
    # torch's reason ("unexpected pos ...") does not say it, and the disk has space: the limit is named.
    assert "free on its file system, and this process may write files of at most 100,000 bytes (ulimit -f))" in \
        result.stderr, result.stderr
    assert torch.equal(checkpoint.load(path)["model"]["w"], torch.zeros(3))
    assert [file.name for file in tmp_path.iterdir()] == ["last.pt"]


class Payload:
    """Something a malicious checkpoint could carry: unpickling it would run __reduce__."""

    def __reduce__(self):
        return (print, ("this must never run",))


def test_checkpoint_with_code_is_refused(tmp_path, capsys):
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "extra": Payload()}, path)
    (tmp_path / "noise.pt").write_bytes(bytes(range(7, 107)))
    for name in ("evil.pt", "noise.pt"):
        with pytest.raises(ValueError, match=name) as error:
            checkpoint.load(tmp_path / name)
        # One line, and not torch's advice to load it with weights_only=False.
        assert "\n" not in str(error.value) and "weights_only" not in str(error.value), str(error.value)
    assert "this must never run" not in capsys.readouterr().out


def test_a_pickle_not_written_by_torch_save_is_refused_in_one_line_without_torchs_warning(tmp_path, recwarn):
    with open(tmp_path / "pickled.pt", "wb") as file:
        pickle.dump(Payload(), file, protocol=4)
    with pytest.raises(ValueError, match="cannot load checkpoint .*pickled.pt: not a complete checkpoint"):
        checkpoint.load(tmp_path / "pickled.pt")
    assert [str(warning.message) for warning in recwarn] == []


def test_an_empty_checkpoint_is_refused_saying_it_is_empty(tmp_path):
    """A copy or transfer that wrote nothing (a full disk, a `touch`): torch's EOFError has no message, so the line
    ended "(EOFError: )", naming no reason."""
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(ValueError) as error:
        checkpoint.load(tmp_path / "empty.pt", checkpoint.TRAINING_PARTS)
    assert str(error.value) == f"cannot load checkpoint {tmp_path / 'empty.pt'}: it is empty (0 bytes)"


def test_a_file_that_is_not_a_trainer_checkpoint_names_what_it_lacks(tmp_path):
    torch.save(torch.ones(3), tmp_path / "tensor.pt")
    torch.save({"model": {}, "config": {}}, tmp_path / "weights.pt")
    (tmp_path / "half.pt").write_bytes((tmp_path / "weights.pt").read_bytes()[:100])
    with pytest.raises(ValueError, match="tensor.pt is not a checkpoint written by python -m trainer: it has no "
                                         "model, config$"):
        checkpoint.load(tmp_path / "tensor.pt")
    assert checkpoint.load(tmp_path / "weights.pt") == {"model": {}, "config": {}}
    with pytest.raises(ValueError, match="weights.pt .* it has no optimizer, scheduler, sampler, train_state, rng$"):
        checkpoint.load(tmp_path / "weights.pt", checkpoint.TRAINING_PARTS)
    with pytest.raises(ValueError, match="cannot load checkpoint .*half.pt: not a complete checkpoint"):
        checkpoint.load(tmp_path / "half.pt")
    # Nor a missing value, which OmegaConf raises on when it is read, nor nesting past any config's.
    torch.save({"model": {}, "config": {"model": {"backend": "???"}}}, tmp_path / "missing.pt")
    with pytest.raises(ValueError, match=r"missing.pt .*: its config.model.backend holds a missing value \(\?\?\?\)"):
        checkpoint.load(tmp_path / "missing.pt")
    deep = {}
    for _ in range(100):
        deep = {"a": deep}
    torch.save({"model": {}, "config": deep}, tmp_path / "deep.pt")
    with pytest.raises(ValueError, match=r"deep.pt .*: its config(\.a)+ nests deeper than 16 levels"):
        checkpoint.load(tmp_path / "deep.pt")
    # Nor what OmegaConf holds no type of: a resume said it without the file, a key of None over three lines.
    torch.save({"model": {}, "config": {"data": {"kind": torch.zeros(2)}}}, tmp_path / "tensor_config.pt")
    with pytest.raises(ValueError, match=r"tensor_config.pt .*: its config.data.kind holds what OmegaConf refuses "
                                         r"\(Value 'Tensor' is not a supported primitive type\), which"):
        checkpoint.load(tmp_path / "tensor_config.pt")
    torch.save({"model": {}, "config": {None: 1}}, tmp_path / "none_key.pt")
    with pytest.raises(ValueError, match=r"none_key.pt .*: its config holds what OmegaConf refuses \(Incompatible key "
                                         r"type 'NoneType'\), which [^\n]*$"):
        checkpoint.load(tmp_path / "none_key.pt")
    # torch.save stores its zip's entries as they are; compressed ones could unpack to any size.
    with zipfile.ZipFile(tmp_path / "weights.pt") as original, zipfile.ZipFile(
            tmp_path / "deflated.pt", "w", zipfile.ZIP_DEFLATED) as deflated:
        for entry in original.infolist():
            deflated.writestr(entry.filename, original.read(entry))
    with pytest.raises(ValueError, match="deflated.pt: .*it holds compressed entries, which torch.save never writes"):
        checkpoint.load(tmp_path / "deflated.pt")
    damaged = bytearray((tmp_path / "weights.pt").read_bytes())  # its central directory's last entry overwritten
    last_entry = damaged.rindex(b"PK\x01\x02")
    damaged[last_entry:last_entry + 4] = b"XXXX"
    (tmp_path / "damaged.pt").write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match="cannot load checkpoint .*damaged.pt: not a complete checkpoint"):
        checkpoint.load(tmp_path / "damaged.pt")
    torch.save({"model": {}, "config": 'data: {kind: "\\u0024{oc.env:HOME}"}'}, tmp_path / "yaml.pt")
    with pytest.raises(ValueError, match=r"yaml.pt is not a checkpoint .*: its config is a str, not a mapping$"):
        checkpoint.load(tmp_path / "yaml.pt")


def test_a_checkpoint_whose_bytes_changed_after_it_was_written_is_refused_naming_the_entry(tmp_path):
    """torch.load does not check the CRC-32 that torch.save writes for each zip entry: a checkpoint with bytes of a
    weight changed on disk loaded, and a resume trained on from the wrong weights until they diverged."""
    torch.save({"model": {"w": torch.arange(1000.0)}, "config": {}}, tmp_path / "last.pt")
    damaged = bytearray((tmp_path / "last.pt").read_bytes())
    weights = damaged.index(torch.arange(1000.0).numpy().tobytes())
    damaged[weights + 100:weights + 104] = b"\xff\xff\xff\xff"
    (tmp_path / "last.pt").write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=r"cannot load checkpoint .*last.pt: .*its entry last/data/0 does not match "
                                         r"its CRC-32 checksum"):
        checkpoint.load(tmp_path / "last.pt")


def test_a_checkpoint_whose_config_holds_dollar_braces_is_read_as_text(tmp_path, monkeypatch):
    """A corpus in a folder named with "${" (given on the command line as "\\${") trained, but its checkpoints were
    refused by trainer.evaluate and by a resume as holding an interpolation. Stored strings are text: "${...}" in one
    resolves nothing, so a checkpoint from elsewhere still reads no environment variable."""
    overrides = ["model.depth=1", "model.hidden=16", "model.conv_channels=2", "data.features.kind=mel",
                 "data.features.n_mels=40", "data=manifest", r"data.train_manifests=['/corpus/a\${b}/train.jsonl']",
                 r"data.eval_manifest='/corpus/a\${b}/test.jsonl'"]
    path = small_checkpoint(tmp_path / "braces.pt", *overrides[5:])
    assert build.from_checkpoint(path, torch.device("cpu"))[2].data.eval_manifest == "/corpus/a${b}/test.jsonl"
    saved = checkpoint.load(path)
    assert check_resumable(saved["config"], compose_config(overrides), path) == []
    monkeypatch.setenv("PRNN_SECRET", "read")
    data = {**saved["config"]["data"], "eval_manifest": "${oc.env:PRNN_SECRET}\\${x}",
            "train_manifests": ("${oc.env:PRNN_SECRET}",)}  # a tuple, which OmegaConf makes a list
    torch.save({**saved, "config": {**saved["config"], "data": data}}, tmp_path / "edited.pt")
    cfg = build.from_checkpoint(tmp_path / "edited.pt", torch.device("cpu"))[2]
    assert cfg.data.eval_manifest == "${oc.env:PRNN_SECRET}\\${x}"
    assert list(cfg.data.train_manifests) == ["${oc.env:PRNN_SECRET}"]


def test_a_resumed_optimizer_or_schedule_must_fit_its_parameters():
    """A fused optimizer step writes each parameter's size into its state whatever that state's own: a smaller one
    corrupted memory (a segfault), an expanded one took gigabytes. A schedule copies any key onto itself."""
    network = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(network.parameters(), fused=True)
    network(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    checkpoint.check_optimizer_state(saved, optimizer)
    for broken, described in ((torch.zeros(1), "shape (1,)"), (torch.zeros(1).expand(2, 3), "shape (2, 3)"),
                              (torch.zeros(2, 3, dtype=torch.float64), "torch.float64")):
        edited = {**saved, "state": {**saved["state"], 0: {**saved["state"][0], "exp_avg": broken}}}
        with pytest.raises(ValueError, match=rf"its state 'exp_avg' of parameter 0 is a .*{re.escape(described)}"):
            checkpoint.check_optimizer_state(edited, optimizer)
    with pytest.raises(ValueError, match="its state of parameter 0 is an int, not a mapping"):
        checkpoint.check_optimizer_state({**saved, "state": {0: 5}}, optimizer)
    with pytest.raises(ValueError, match="its state is a list, not a mapping of parameters to their state"):
        checkpoint.check_optimizer_state({**saved, "state": list(saved["state"].values())}, optimizer)
    # Adam's count of updates: a negative one turned every weight to NaN at the first step, which the run then called
    # diverged; a vector ended the first step in a traceback.
    for step, described in ((torch.tensor(-1.0), "-1.0"), (torch.tensor(math.nan), "nan"), (-2, "-2"),
                            (torch.ones(2), r"a torch.float32 tensor of shape \(2,\)"), ("3", "a str")):
        edited = {**saved, "state": {**saved["state"], 1: {**saved["state"][1], "step": step}}}
        with pytest.raises(ValueError, match=rf"^its state 'step' of parameter 1 is {described}, not a count of up"):
            checkpoint.check_optimizer_state(edited, optimizer)
    for step in (torch.tensor(3.0), 3, 3.0):  # as torch writes it, and as older versions did
        checkpoint.check_optimizer_state({**saved, "state": {**saved["state"], 1: {**saved["state"][1], "step": step}}},
                                         optimizer)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    current = schedule.state_dict()
    assert known_entries({**current, "optimizer": 1}, current) == current
    with pytest.raises(ValueError, match="its last_epoch is a float, not an int"):
        known_entries({**current, "last_epoch": 0.5}, current)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_an_optimizer_state_from_before_fused_optimizers_resumes_fused(name):
    """Checkpoints from before 2026-11-27 hold fused=None: loaded as saved, the step took torch's unfused path, which
    refuses the found_inf that train_step passes (AssertionError on the first step)."""
    cfg = OmegaConf.create({"name": name, "lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.0, "momentum": 0.9})
    network = torch.nn.Linear(3, 2)
    optimizer = build.optimizer(cfg, network.parameters())
    network(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    saved["param_groups"] = [{**group, "fused": None} for group in saved["param_groups"]]
    resumed = build.optimizer(cfg, network.parameters())
    load_optimizer_state(resumed, saved)
    assert [group["fused"] for group in resumed.param_groups] == [True]
    assert resumed.param_groups[0]["lr"] == 1e-3
    resumed.found_inf = torch.zeros(())  # as train_step passes it
    resumed.step()


def test_an_epoch_whose_steps_were_all_skipped_trained_nothing():
    """Counted by the steps that trained, not the utterances: where one rank of two reads no audio, every step is
    skipped (an empty shard) though half the utterances loaded were usable."""
    skipped = Counter({UNUSABLE: 8, skipped_step("empty shard (all its audio unreadable)"): 4})
    with pytest.raises(ValueError, match=r"^epoch 3 trained nothing: each of its 4 steps was skipped \(8 utterances "
                                         r"unreadable or too long, 4 steps skipped: empty shard .*every rank must be"):
        refuse_if_nothing_trained(2, 4, 0, skipped)
    with pytest.raises(ValueError, match=r"^epoch 1 trained nothing: each of its 1 step was skipped \(1 step skipped: "
                                         r"non-finite loss or gradient\); a lower optim.lr or "
                                         r"train.grad_clip_norm may keep the model finite, and model.residual=true a "
                                         r"deep stack's gradients$"):
        refuse_if_nothing_trained(0, 1, 0, Counter({skipped_step("non-finite loss or gradient"): 1}))
    # Each count words its noun for that count, one or more.
    with pytest.raises(ValueError, match=r"^epoch 2 trained nothing: each of its 3 steps was skipped \(1 utterance "
                                         r"unreadable or too long, 3 steps skipped: non-finite loss or gradient\); "
                                         r"a manifest's .*; a lower optim.lr or train.grad_clip_norm "
                                         r"may keep the model finite, and model.residual=true a deep stack's "
                                         r"gradients$"):
        refuse_if_nothing_trained(1, 3, 0, Counter({UNUSABLE: 1, skipped_step("non-finite loss or gradient"): 3}))
    refuse_if_nothing_trained(2, 4, 1, skipped)  # one step trained
    # Inside an epoch of a run that trained before, steps skipped for losses that were not finite are skipped steps
    # like any other (one batch's overflow), not a reason to refuse the checkpoint; skipped for their audio, they are.
    refuse_if_nothing_trained(1, 1, 0, Counter({skipped_step("non-finite loss or gradient"): 1}), overflows_pass=True)
    with pytest.raises(ValueError, match=r"^epoch 3 trained nothing: each of its 4 steps was skipped"):
        refuse_if_nothing_trained(2, 4, 0, skipped, overflows_pass=True)
    refuse_if_nothing_trained(2, 0, 0, Counter())  # none run yet (resumed at the epoch's end)


def test_a_checkpoint_of_another_training_set_is_refused():
    here = "948 utterances, sha256 0123456789abcdef"
    check_same_training_set({"train_set": here}, here, Path("last.pt"))
    check_same_training_set({}, here, Path("last.pt"))  # written before checkpoints held one
    with pytest.raises(ValueError, match=r"cannot resume from last.pt: it was written for another training set "
                                         r"\(947 utterances, sha256 fedcba9876543210; 948 utterances, sha256 "
                                         r"0123456789abcdef here\): a manifest changed since"):
        check_same_training_set({"train_set": "947 utterances, sha256 fedcba9876543210"}, here, Path("last.pt"))


def test_a_checkpoint_part_that_does_not_fit_names_the_file_and_the_part(tmp_path):
    path = tmp_path / "last.pt"
    state = {"epoch": 0, "step": 0, "best_wer": math.inf, "elapsed_s": 0.0}
    loaders = {"model": torch.nn.Linear(2, 3).load_state_dict,
               "train_state": lambda saved_state: state.update(resumed_train_state(state, saved_state)),
               "rng": lambda states: checkpoint.set_rng_state(states[0], torch.device("cpu"))}
    good = {"model": torch.nn.Linear(2, 3).state_dict(), "train_state": {"epoch": 2, "step": 9, "best_wer": 50.0},
            "rng": [checkpoint.rng_state(torch.device("cpu"))]}
    restore(path, good, loaders)
    assert state == {"epoch": 2, "step": 9, "best_wer": 50.0, "elapsed_s": 0.0, "best_unreadable": 0}
    none_evaluated = {"epoch": 0, "step": 0, "best_wer": math.inf}
    assert resumed_train_state({**state, "best_wer": math.inf}, none_evaluated)["best_wer"] == math.inf
    cases = [
        ("model", torch.nn.Linear(2, 4).state_dict(), "size mismatch for weight"),
        ("train_state", {"epoch": 2, "step": "9"},
         "no number from 0 up, or no count where one belongs, for step='9', best_wer=None"),
        ("train_state", {"epoch": 2.0, "step": -1, "best_wer": 1},
         "no count where one belongs, for epoch=2.0, step=-1"),
        # A hand-edited NaN best_wer: no WER beats it, so best.pt stayed as it was for the rest of the run.
        ("train_state", {"epoch": 2, "step": 9, "best_wer": math.nan}, r"for best_wer=nan\)$"),
        ("train_state", {"epoch": 2, "step": 9, "best_wer": -1.0}, r"for best_wer=-1.0\)$"),
        ("train_state", {"epoch": 2, "step": 9, "best_wer": 50.0, "elapsed_s": math.inf}, r"for elapsed_s=inf\)$"),
        ("train_state", {"epoch": 2, "step": 9, "best_wer": 50.0, "elapsed_s": math.nan}, r"for elapsed_s=nan\)$"),
        ("rng", [], "list index out of range"),
    ]
    for part, value, reason in cases:
        with pytest.raises(ValueError, match=rf"cannot resume from {re.escape(str(path))}: its {part} does not fit "
                                             rf"this run \(.*{reason}") as error:
            restore(path, {**good, part: value}, loaders)
        assert "\n" not in str(error.value)


def small_checkpoint(path, *overrides: str):
    """A checkpoint of a small untrained model (what from_checkpoint reads), under `overrides`."""
    cfg = compose_config(["model.depth=1", "model.hidden=16", "model.conv_channels=2", "data.features.kind=mel",
                          "data.features.n_mels=40", *overrides])
    network = build.model(cfg.model, build.features(cfg.data).num_features)
    checkpoint.save(path, {"model": network.state_dict(), "config": OmegaConf.to_container(cfg, resolve=True)})
    return path


def test_a_stored_config_that_claims_another_model_than_its_weights_allocates_nothing(tmp_path):
    path = small_checkpoint(tmp_path / "small.pt")
    saved = torch.load(path, weights_only=True)
    for key, value, complaint in (("depth", 10**8, r"its config gives model.depth=100000000, its weights 1 layer\)"),
                                  ("hidden", 40000, "size mismatch")):  # 19 GB of weights, were they made
        edited = {**saved, "config": {**saved["config"], "model": {**saved["config"]["model"], key: value}}}
        torch.save(edited, tmp_path / "edited.pt")
        with pytest.raises(ValueError, match=complaint):
            build.from_checkpoint(tmp_path / "edited.pt", torch.device("cpu"))


def test_a_checkpoint_of_the_persistent_backend_evaluates_anywhere(tmp_path):
    """Rebuilt on auto: the kernels where they run, torch.nn on this CPU; the same weights either way."""
    path = small_checkpoint(tmp_path / "persistent.pt", "model.backend=persistent")
    model, features, cfg = build.from_checkpoint(path, torch.device("cpu"))
    assert cfg.model.backend == "auto" and model.recurrent_backend(4, torch.float32, "cpu") == "cudnn"
    log_probs, _ = model(torch.randn(2, 30, features.num_features), torch.tensor([30, 20]))
    assert torch.isfinite(log_probs).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_a_checkpoint_whose_weights_were_stored_in_another_precision_runs_as_trained(tmp_path, dtype):
    # Its weights were given to the model as they were stored: float32 features then met half-precision weights in
    # "Input type (torch.FloatTensor) and weight type (torch.HalfTensor) should be the same", a traceback.
    path = small_checkpoint(tmp_path / "small.pt")
    saved = torch.load(path, weights_only=True)
    torch.save({**saved, "model": {key: value.to(dtype) if value.is_floating_point() else value
                                   for key, value in saved["model"].items()}}, tmp_path / "cast.pt")
    features = torch.randn(2, 30, 40)
    outputs = [build.from_checkpoint(checkpoint_path, torch.device("cpu"))[0](features, torch.tensor([30, 20]))[0]
               for checkpoint_path in (path, tmp_path / "cast.pt")]
    assert outputs[1].dtype == torch.float32 and relative_error(outputs[1], outputs[0]) < 0.05


def test_a_checkpoint_of_another_model_is_one_line_naming_the_file(tmp_path):
    good = checkpoint.load(small_checkpoint(tmp_path / "good.pt"))
    wider = checkpoint.load(small_checkpoint(tmp_path / "wider.pt", "model.hidden=32"))
    cases = {
        "empty": {"model": {}, "config": {}},
        "unknown_key": {**good, "config": {**good["config"], "model": {**good["config"]["model"], "dropout": 0.1}}},
        "tensor_model": {**good, "model": torch.ones(3)},
        "other_shapes": {**good, "model": wider["model"]},
    }
    for name, saved in cases.items():
        checkpoint.save(tmp_path / f"{name}.pt", saved)
        with pytest.raises(ValueError) as error:
            build.from_checkpoint(tmp_path / f"{name}.pt", torch.device("cpu"))
        message = str(error.value)
        assert message.startswith(f"{tmp_path / name}.pt: not a checkpoint of this trainer's model (") and \
            "\n" not in message and len(message) < 300 + len(str(tmp_path)) + 60, (name, message)
        if name == "other_shapes":  # which tensor does not fit, not torch's heading alone
            assert "size mismatch for layers.0.rnn.weight_ih_l0" in message, message


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's, on nested tensors and on validating sparse ones
def test_a_checkpoint_holding_a_tensor_no_model_can_use_is_one_line_naming_the_file_and_its_key(tmp_path):
    """Tensors the safe loader takes, but which trainer.evaluate met in a page of torch's dispatcher (sparse), an
    error naming neither the file nor the key (meta), or one naming no key (nested)."""
    good = checkpoint.load(small_checkpoint(tmp_path / "good.pt"))
    weight = good["model"]["layers.0.rnn.weight_ih_l0"]
    for kind, odd in (("torch.sparse_coo (not dense)", weight.to_sparse()), ("torch.sparse_csr (not dense)",
                      weight.to_sparse_csr()), ("meta (shape alone, no values)", weight.to("meta")),
                      ("nested", torch.nested.nested_tensor([weight, weight]))):
        path = tmp_path / "odd.pt"
        torch.save({**good, "model": {**good["model"], "layers.0.rnn.weight_ih_l0": odd}}, path)
        for read in (checkpoint.load, lambda path: build.from_checkpoint(path, torch.device("cpu"))):
            with pytest.raises(ValueError) as error:
                read(path)
            assert str(error.value) == (f"{path} is not a checkpoint written by python -m trainer: its "
                                        f"model.layers.0.rnn.weight_ih_l0 is a {kind} tensor, where the trainer "
                                        "writes dense tensors with values")
    # Anywhere in it: a resume hands the optimizer's state, a list's entries among them, to torch as well.
    training = {**good, "optimizer": {"state": {0: {"exp_avg": weight.to_sparse()}}, "param_groups": []},
                "rng": [{"torch": torch.zeros(3, dtype=torch.uint8).to("meta")}]}
    torch.save(training, tmp_path / "training.pt")
    with pytest.raises(ValueError, match=r"its (optimizer.state.0.exp_avg|rng.0.torch) is a"):
        checkpoint.load(tmp_path / "training.pt")


def test_transcribe_reads_audio_at_the_models_rate_and_skips_what_it_cannot_use(tmp_path, monkeypatch, capsys):
    from trainer import transcribe

    path = small_checkpoint(tmp_path / "8k.pt", "data.features.sample_rate=8000")
    good, huge = tmp_path / "good.wav", tmp_path / "huge.wav"
    soundfile.write(good, 0.1 * np.random.default_rng(0).standard_normal(16000), 16000, subtype="FLOAT")
    soundfile.write(huge, np.full(16000, 3e38), 16000, subtype="FLOAT")  # float32, whose squares overflow
    rates = []
    load_audio = transcribe.load_audio
    monkeypatch.setattr(transcribe, "load_audio", lambda file, rate: rates.append(rate) or load_audio(file, rate))
    assert transcribe.main(["--checkpoint", str(path), "--device", "cpu", str(good), str(huge)]) == 1
    assert rates == [8000, 8000]
    out, err = capsys.readouterr()
    assert out.startswith(f"{good}\t"), out
    assert f"{huge}\terror: its features are not finite (its largest sample is " in err, err  # the path once


def test_transcribe_prints_a_file_name_that_is_not_utf8_as_its_own_bytes(tmp_path):
    # Where stdout's UTF-8 is strict (a locale such as en_US.UTF-8, or PYTHONIOENCODING), b"\xff.wav" ended
    # python -m trainer.transcribe in a UnicodeEncodeError traceback.
    path = small_checkpoint(tmp_path / "small.pt")
    audio = bytes(tmp_path) + b"/\xff.wav"
    soundfile.write(audio, 0.1 * np.random.default_rng(0).standard_normal(16000), 16000)
    result = subprocess.run([sys.executable, "-m", "trainer.transcribe", "--checkpoint", str(path), "--device", "cpu",
                             audio], cwd=REPO_ROOT, capture_output=True, timeout=300,
                            env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert result.returncode == 0 and result.stdout.startswith(audio + b"\t"), result.stdout + result.stderr


def test_the_tools_print_a_path_that_is_not_utf8_with_its_bytes_escaped_as_data_prepare_does(tmp_path):
    # trainer.lm and trainer.transcribe printed b"\xff" as stderr's "\udcff", which names no byte, where data.prepare
    # prints "\xff"; and trainer.lm's last line, under strict UTF-8 (PYTHONIOENCODING), was a UnicodeEncodeError.
    corpus = bytes(tmp_path) + b"/corpus\xff"
    os.mkdir(corpus)
    with open(corpus + b"/m.jsonl", "w", encoding="utf-8") as manifest:
        manifest.write('{"audio_filepath": "a.wav", "duration": 1.0, "text": "A"}\n' * 2)
    shown = f"{tmp_path}/corpus\\xff".encode()
    strict = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    result = subprocess.run([sys.executable, "-m", "trainer.lm", "--manifest", corpus + b"/m.jsonl", "--out",
                             corpus + b"/lm.arpa"], cwd=REPO_ROOT, capture_output=True, timeout=120, env=strict)
    assert result.returncode == 0, result.stderr
    assert f"(the first: {shown.decode()}/a.wav)".encode() in result.stderr, result.stderr
    assert result.stdout.endswith(b"wrote " + shown + b"/lm.arpa: a 3-gram model of 1 transcript; 1 whose audio "
                                  b"file is listed before left out\n"), result.stdout
    result = subprocess.run([sys.executable, "-m", "trainer.transcribe", "--checkpoint",
                             str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu", corpus + b"/absent.wav"],
                            cwd=REPO_ROOT, capture_output=True, timeout=300, env=strict)
    assert result.returncode == 1 and result.stderr.endswith(shown + b"/absent.wav\terror: no such audio file\n"), \
        result.stderr


def test_evaluate_writes_a_file_name_that_is_not_utf8_into_its_table_as_its_own_bytes(tmp_path, capsys):
    # A manifest in a folder named with b"\xff" names its audio through it; --out was refused in a line of the codec's
    # ("error: 'utf-8' codec can't encode character '\udcff' ..."), and the table not written.
    from trainer import evaluate
    corpus = Path(os.fsdecode(bytes(tmp_path) + b"/corpus\xff"))
    corpus.mkdir()
    soundfile.write(os.fsencode(corpus / "a.wav"), 0.1 * np.random.default_rng(0).standard_normal(16000), 16000)
    with open(corpus / "m.jsonl", "w", encoding="utf-8") as manifest:
        manifest.write('{"audio_filepath": "a.wav", "duration": 1.0, "text": "A"}\n')
    out = tmp_path / "table.tsv"
    assert evaluate.main(["--checkpoint", str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu",
                          "--manifest", str(corpus / "m.jsonl"), "--out", str(out)]) == 0, capsys.readouterr().err
    assert out.read_bytes().splitlines()[1].startswith(os.fsencode(corpus / "a.wav") + b"\t")


def test_evaluate_counts_audio_too_short_for_its_transcript_under_that_reason_not_as_unreadable(tmp_path, capsys):
    """A readable file whose manifest duration hides that its audio is too short for its transcript is found out when
    loaded: the summary called it unreadable, while the warning above it said why."""
    from trainer import evaluate
    noise = 0.1 * np.random.default_rng(0).standard_normal(16000)
    soundfile.write(tmp_path / "a.wav", noise, 16000)
    soundfile.write(tmp_path / "short.wav", noise[:1], 16000)  # one sample: one output frame
    (tmp_path / "corrupt.flac").write_bytes(b"not audio at all" * 64)
    utterances = [("a.wav", "A"), ("short.wav", "NO"), ("corrupt.flac", "GO")]
    (tmp_path / "m.jsonl").write_text("".join(f'{{"audio_filepath": "{name}", "duration": 1.0, "text": "{text}"}}\n'
                                              for name, text in utterances))
    assert evaluate.main(["--checkpoint", str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu",
                          "--manifest", str(tmp_path / "m.jsonl")]) == 0
    assert "; left out: 1 utterance (unreadable), 1 utterance (too long for stride))" in capsys.readouterr().out


def test_missing_checkpoint_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        checkpoint.load(tmp_path / "nope.pt")


def test_a_pipe_given_as_a_checkpoint_is_said_to_be_no_file_not_missing(tmp_path):
    # python -m trainer.transcribe --checkpoint <(ssh host cat best.pt) said "checkpoint not found: /dev/fd/63".
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)  # no writer: opening it would wait for one
    with pytest.raises(ValueError, match=f"^checkpoint {re.escape(str(pipe))} is not a file \\(a pipe"):
        checkpoint.load(pipe)


def test_a_checkpoint_that_cannot_be_read_is_said_so_not_called_damaged(tmp_path):
    # One it may not read was "not a complete checkpoint that torch.save wrote (PermissionError: ...)"; a name past the
    # file system's 255 bytes was a bare OSError, which python -m trainer's train.resume ended in a traceback.
    too_long = tmp_path / ("x" * 300)
    for load in (checkpoint.load, lambda path: checkpoint_to_resume(str(path), tmp_path / "run")):
        with pytest.raises(ValueError, match=f"^cannot read checkpoint {re.escape(str(too_long))}: File name too long"):
            load(too_long)
    locked = small_checkpoint(tmp_path / "locked.pt")
    locked.chmod(0)
    script = ("import sys\nfrom trainer import checkpoint\ntry:\n    checkpoint.load(sys.argv[1])\n"
              "except ValueError as error:\n    print(error)\n")
    result = subprocess.run(without_root_privilege([sys.executable, "-c", script, str(locked)]), cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.stdout == f"cannot read checkpoint {locked}: Permission denied\n", result.stdout + result.stderr


@pytest.mark.parametrize("tool", ["evaluate", "transcribe"])
def test_the_model_tools_refuse_a_model_that_is_not_finite_in_one_line(tool, tmp_path, capsys):
    main = importlib.import_module(f"trainer.{tool}").main
    audio = tmp_path / "a.wav"
    soundfile.write(audio, 0.1 * np.random.default_rng(0).standard_normal(16000), 16000, subtype="FLOAT")
    write_manifest(tmp_path / "m.jsonl", [Utterance(str(audio), 1.0, "A", "a")])
    inputs = [str(audio)] if tool == "transcribe" else ["--manifest", str(tmp_path / "m.jsonl")]
    saved = checkpoint.load(small_checkpoint(tmp_path / "small.pt"))
    saved["model"]["classifier.weight"][0, 0] = math.nan
    checkpoint.save(tmp_path / "nan.pt", saved)
    assert main(["--checkpoint", str(tmp_path / "nan.pt"), "--device", "cpu", *inputs]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'nan.pt'}: its model holds values that are not finite, "
                                       "in classifier.weight\n")
    # Finite weights whose output is not (the batch norm's running variance negative: the square root of it NaN).
    saved = checkpoint.load(small_checkpoint(tmp_path / "small.pt"))
    variance = next(name for name in saved["model"] if name.endswith("running_var"))
    saved["model"][variance].fill_(-1.0)
    checkpoint.save(tmp_path / "negative.pt", saved)
    assert main(["--checkpoint", str(tmp_path / "negative.pt"), "--device", "cpu", *inputs]) == 2
    error = capsys.readouterr().err.rsplit("\r", 1)[-1]  # after evaluate's progress bar
    assert error.startswith(f"error: {tmp_path / 'negative.pt'}: log_probs hold NaN") and error.count("\n") == 1, error


def test_a_gpu_the_machine_lacks_is_refused_counting_those_it_has(monkeypatch):
    # A machine with one GPU (faked: the tools' check asks torch how many) answered "has 1 CUDA GPU(s)".
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(argparse.ArgumentTypeError, match=r"^'cuda:1': this machine has 1 CUDA GPU$"):
        inference.device_argument("cuda:1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(argparse.ArgumentTypeError, match=r"^'cuda:2': this machine has 2 CUDA GPUs$"):
        inference.device_argument("cuda:2")


def test_evaluate_refuses_a_pipe_that_a_checkpoint_names_as_its_test_set(tmp_path):
    """A checkpoint whose stored data.eval_manifest is a named pipe: opening it waited for a writer, for ever (run in
    a process of its own here, so that the wait fails the test rather than hangs it)."""
    pipe = tmp_path / "fifo"
    os.mkfifo(pipe)
    path = small_checkpoint(tmp_path / "small.pt", f"data.eval_manifest={pipe}")
    result = subprocess.run([sys.executable, "-m", "trainer.evaluate", "--checkpoint", str(path), "--device", "cpu"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (2, f"error: the run's data.eval_manifest {pipe} is not a file (a "
                                                     "pipe, a device, a folder): give --manifest\n")


@pytest.mark.parametrize("tool", ["evaluate", "transcribe"])
def test_the_model_tools_refuse_a_missing_checkpoint_or_an_unknown_device_in_one_line(tool, tmp_path, capsys):
    main = importlib.import_module(f"trainer.{tool}").main
    extra = ["a.flac"] if tool == "transcribe" else []
    assert main(["--checkpoint", str(tmp_path / "nope.pt"), *extra]) == 2
    assert capsys.readouterr().err == f"error: checkpoint not found: {tmp_path / 'nope.pt'}\n"
    path = small_checkpoint(tmp_path / "small.pt")
    devices = [("tpu9", "argument --device: 'tpu9' is not a device: cpu, cuda or cuda:N"),
               ("meta", "argument --device: 'meta': the model runs on cpu, cuda or cuda:N")]
    if not torch.cuda.is_available():
        devices.append(("cuda", "argument --device: 'cuda': no CUDA GPU is visible here"))
    for device, complaint in devices:
        with pytest.raises(SystemExit) as stopped:
            main(["--checkpoint", str(path), "--device", device, *extra])
        assert stopped.value.code == 2 and capsys.readouterr().err.endswith(f"error: {complaint}\n")
    # A language model's weights without one would be ignored: the greedy decoder takes no weights.
    assert main(["--checkpoint", str(path), "--device", "cpu", "--lm-weight", "7", *extra]) == 2
    assert capsys.readouterr().err == ("error: --lm-weight and --word-bonus weigh a language model's score: give --lm "
                                       "too\n")


@pytest.mark.parametrize("tool", ["evaluate", "transcribe"])
def test_the_model_tools_refuse_their_arguments_before_reading_the_checkpoint(tool, tmp_path, capsys):
    # A checkpoint that cannot be read: each argument error must come before it is found (after loading the checkpoint
    # and the language model, which a user waits for, these errors came only where both could be read).
    main = importlib.import_module(f"trainer.{tool}").main
    unreadable = tmp_path / "unreadable.pt"
    unreadable.write_text("not a checkpoint\n")
    common = ["--checkpoint", str(unreadable), "--device", "cpu"]
    inputs = [str(tmp_path / "a.wav")] if tool == "transcribe" else ["--manifest", str(tmp_path / "m.jsonl")]
    assert main([*common, "--word-bonus", "1", *inputs]) == 2
    assert capsys.readouterr().err == ("error: --lm-weight and --word-bonus weigh a language model's score: give --lm "
                                       "too\n")
    if tool == "evaluate":
        for output in (unreadable, tmp_path / "words.arpa", tmp_path / "m.jsonl"):
            assert main([*common, "--lm", str(tmp_path / "words.arpa"), *inputs, "--out", str(output)]) == 2
            assert capsys.readouterr().err == f"error: {output} is also an input of this command: writing it would " \
                                              "destroy it\n"
        assert unreadable.read_text() == "not a checkpoint\n"


# --- the training step ----------------------------------------------------------------------------------------------

def tiny_setup(nan_in_features: bool, optimizer_name: str = "adamw"):
    torch.manual_seed(0)
    cfg = compose_config(["model.depth=1", "model.hidden=16", "model.conv_channels=2", "model.backend=reference",
                          "data.features.kind=mel", "data.features.n_mels=20", "train.amp=none",
                          f"optim={optimizer_name}"])
    model = build.model(cfg.model, 20)
    optimizer = build.optimizer(cfg.optim, model.parameters())
    schedule = build.lr_schedule(cfg.optim, optimizer, steps_per_epoch=10)
    features = torch.randn(2, 60, 20)
    if nan_in_features:
        features[1, 10, 3] = math.nan
    batch = collate([Sample(features[0], torch.tensor(encode("YES")), 0),
                     Sample(features[1], torch.tensor(encode("NO")), 1)])
    return cfg, model, optimizer, schedule, batch


def test_train_step_updates_weights():
    cfg, model, optimizer, schedule, batch = tiny_setup(nan_in_features=False)
    before = [p.detach().clone() for p in model.parameters()]
    step = train_step(model, batch, optimizer, schedule, cfg, DistEnv(0, 1, torch.device("cpu")))
    assert step.outcome == "ok" and math.isfinite(step.loss) and step.loss > 0
    assert (step.utterances, step.unusable) == (2, 0)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert schedule.last_epoch == 1  # the schedule steps with the weights
    assert step.stop_requests == {}
    # A stop signal received before the step (during the one before it) stops the run at that step's end: this one
    # trains nothing, and the result says which signal reached how many ranks. It trained, one step past the signal.
    before = [p.detach().clone() for p in model.parameters()]
    step = train_step(model, batch, optimizer, schedule, cfg, DistEnv(0, 1, torch.device("cpu")), signal.SIGUSR1)
    assert step.outcome == "stopped" and step.stop_requests == {signal.SIGUSR1: 1} and schedule.last_epoch == 1
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_stop_signals_end_the_run_before_listening_then_the_first_is_kept_and_a_second_ctrl_c_interrupts():
    handlers = {number: signal.getsignal(number) for number in STOP_SIGNALS}
    with StopSignals() as stop:
        for number in (signal.SIGTERM, signal.SIGUSR1):  # before training: nothing to save, out at once
            with pytest.raises(StoppedBeforeTraining, match=f"{number.name} received before training began"):
                os.kill(os.getpid(), number)
                time.sleep(1)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        stop.listen()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # Python runs a handler between bytecodes, soon after the signal
        assert stop.received == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        assert stop.received == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert {number: signal.getsignal(number) for number in STOP_SIGNALS} == handlers


# The trainer's signal handling from its start, run where SIGINT was ignored since the process started.
STOP_SIGNALS_WITH_CTRL_C_IGNORED = """
import os, signal, time
from trainer.stop import StopSignals, keep_early_stop_signal

def signalled(number):
    os.kill(os.getpid(), number)
    time.sleep(0.01)  # Python runs a handler between bytecodes, soon after the signal

keep_early_stop_signal()
signalled(signal.SIGINT)  # as the trainer imports
with StopSignals() as stop:
    signalled(signal.SIGINT)  # before training
    stop.listen()
    signalled(signal.SIGINT)
    print(stop.received)
    signalled(signal.SIGTERM)
    print(stop.received.name)
print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)
"""


def test_a_trainer_started_with_ctrl_c_ignored_trains_on_through_one_and_stops_on_sigterm():
    """A script's `python -m trainer ... &` starts with SIGINT ignored: a Ctrl-C for the foreground job (`tail -f` on
    the log, to the terminal's whole process group) stopped the training in the background, where a scheduler's
    SIGTERM must still stop it."""
    result = subprocess.run([sys.executable, "-c", STOP_SIGNALS_WITH_CTRL_C_IGNORED], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["None", "SIGTERM", "True"]


SIGNAL_AS_TQDM_MAKES_ITS_LOCK = """
import logging, multiprocessing, os, signal
from tqdm.contrib.logging import logging_redirect_tqdm
from trainer.stop import StopSignals, StoppedBeforeTraining

make_lock = multiprocessing.RLock

def make_lock_as_a_signal_comes():  # tqdm makes its write lock with this, as the first log line goes through it
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:  # where a signal raises
        os.kill(os.getpid(), signal.SIGTERM)
    return make_lock()

multiprocessing.RLock = make_lock_as_a_signal_comes
logging.basicConfig()
try:
    with StopSignals(), logging_redirect_tqdm():
        logging.getLogger("trainer").warning("preparing the manifests")
        os.kill(os.getpid(), signal.SIGTERM)
except StoppedBeforeTraining as stopped:
    print(stopped)
"""


def test_a_stop_signal_as_the_first_log_line_makes_tqdms_lock_is_not_lost():
    """A signal raising inside tqdm's first making of its write lock left tqdm without one: its cleanup failed
    (AttributeError), which the log handler printed as "--- Logging error ---" with two tracebacks, and the signal
    was lost. It failed a multi-rank test now and then, the SIGTERM coming as the ranks logged their first lines."""
    ran = subprocess.run([sys.executable, "-c", SIGNAL_AS_TQDM_MAKES_ITS_LOCK], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert ran.returncode == 0 and "Traceback" not in ran.stderr and "Logging error" not in ran.stderr, ran.stderr
    assert ran.stdout.splitlines() == ["SIGTERM received before training began"], ran.stdout


def signalled_as_it_starts(worker_id: int) -> None:
    """A worker_init_fn: the job's SIGTERM reaches the worker before ignore_in_data_workers has run."""
    os.kill(os.getpid(), signal.SIGTERM)
    ignore_in_data_workers(worker_id)


def test_a_stop_signal_that_reaches_a_data_worker_as_it_starts_leaves_it_working():
    loader = DataLoader(range(8), batch_size=2, num_workers=2, worker_init_fn=signalled_as_it_starts)
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid"):  # a plain start: torch's handler ends it
        list(loader)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert [batch.tolist() for batch in start_data_workers(loader)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask  # this process takes its signals as before
    loader.multiprocessing_context = "forkserver"  # Python 3.14's default on Linux: workers not forked from here
    assert [batch.tolist() for batch in start_data_workers(loader)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_a_data_worker_says_nothing_of_a_handover_the_training_process_broke_off():
    """A stop signal while a batch is awaited breaks off the fetch of its tensors' file descriptors from the worker,
    whose handover thread (multiprocessing's resource sharer) printed the broken connection's traceback through
    sys.excepthook before the worker was killed: seen once in CI as a stray "Traceback" in a SIGTERM'd run's log."""
    code = ("import sys\nfrom trainer.stop import ignore_in_data_workers\nignore_in_data_workers(0)\n"
            "for error in (EOFError(), ConnectionResetError(104, 'reset'), ValueError('a real error')):\n"
            "    sys.excepthook(type(error), error, None)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stderr == "ValueError: a real error\n", result.stderr


BATCHES_FROM_A_WORKER_STUCK_AT_THE_THIRD = """
import itertools, os, signal, sys, threading, time
from torch.utils.data import DataLoader
from trainer.stop import ignore_in_data_workers, start_data_workers

class StuckAtTheThirdBatch:  # as on a file system that stopped answering
    def __len__(self):
        return 8

    def __getitem__(self, index):
        if index >= 4:
            time.sleep(3600)
        return index

device, ending = sys.argv[1:]
loader = DataLoader(StuckAtTheThirdBatch(), batch_size=2, num_workers=1, pin_memory=device == "cuda",
                    worker_init_fn=ignore_in_data_workers)
batches = start_data_workers(loader)
for batch in itertools.islice(batches, 2):
    print(batch.tolist())
if ending == "a second Ctrl-C":  # as the third batch is waited on
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        next(batches)
    except KeyboardInterrupt:
        print("interrupted")
else:  # as a training loop's break at train.max_steps or on a stop signal lets the batches go
    batches.close()
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("ending", ["a second Ctrl-C", "no more batches wanted"])
def test_batches_that_end_early_leave_no_stuck_data_worker_to_wait_for(device, ending):
    """Torch's shutdown of its workers sends SIGTERM, which they ignore, and Python's exit then waited for a stuck one
    for ever: after a run's "interrupted by Ctrl-C", or its stop at train.max_steps. On a GPU the batches pass through
    torch's pin-memory thread (pin_memory=True), as in training."""
    job = subprocess.Popen([sys.executable, "-c", BATCHES_FROM_A_WORKER_STUCK_AT_THE_THIRD, device, ending],
                           cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        output = job.communicate(timeout=60)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    interrupted = ["interrupted"] if ending == "a second Ctrl-C" else []
    assert job.returncode == 0 and output.splitlines() == ["[0, 1]", "[2, 3]", *interrupted], output


def test_an_utterance_ctc_cannot_align_costs_its_loss_not_the_step():
    cfg, model, optimizer, schedule, _ = tiny_setup(nan_in_features=False, optimizer_name="sgd")
    features = torch.randn(2, 60, 20)
    # 60 frames give 30 outputs, too few for 40 characters: that utterance's CTC loss is infinite.
    batch = collate([Sample(features[0], torch.tensor(encode("YES")), 0),
                     Sample(features[1], torch.tensor(encode("A" * 40)), 1)])
    step = train_step(model, batch, optimizer, schedule, cfg, DistEnv(0, 1, torch.device("cpu")))
    assert step.outcome == "ok" and math.isfinite(step.loss) and step.loss > 0


@pytest.mark.parametrize("clip", [1e-3, 1e6])
def test_train_step_takes_the_mean_ctc_loss_and_clips_its_gradient(clip):
    """The step against one computed here from torch alone: the loss per utterance, its gradient clipped by norm (a
    bound well under the gradient's, or far over it, where the gradient's scale shows), then Nesterov SGD, whose
    update scales with the gradient."""
    cfg, model, optimizer, schedule, batch = tiny_setup(nan_in_features=False, optimizer_name="sgd")
    cfg.train.grad_clip_norm = clip
    twin = copy.deepcopy(model)
    step = train_step(model, batch, optimizer, schedule, cfg, DistEnv(0, 1, torch.device("cpu")))

    log_probs, out_lengths = twin(batch.features, batch.feature_lengths)
    loss = F.ctc_loss(log_probs, batch.targets, out_lengths, batch.target_lengths, reduction="sum") / 2
    assert step.outcome == "ok" and step.loss == pytest.approx(loss.item(), rel=1e-6)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), clip)
    assert 1e-3 < norm < 1e6
    torch.optim.SGD(twin.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum, nesterov=True,
                    weight_decay=cfg.optim.weight_decay).step()
    for name, expected in twin.state_dict().items():
        assert relative_error(model.state_dict()[name].double(), expected.double()) <= 1e-5, name


@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
def test_a_skipped_step_leaves_no_trace(optimizer_name):
    """A NaN batch is skipped inside the queued optimizer step (found_inf): weights, batch-norm statistics, optimizer
    state and schedule after [bad batch, good batch] are exactly those after the good batch alone."""
    cpu = DistEnv(0, 1, torch.device("cpu"))
    cfg, model, optimizer, schedule, good = tiny_setup(nan_in_features=False, optimizer_name=optimizer_name)
    assert train_step(model, good, optimizer, schedule, cfg, cpu)[0] == "ok"

    cfg, skipping_model, skipping_optimizer, skipping_schedule, bad = tiny_setup(True, optimizer_name)
    before = [t.detach().clone() for t in skipping_model.state_dict().values()]
    outcome, loss, *_ = train_step(skipping_model, bad, skipping_optimizer, skipping_schedule, cfg, cpu)
    assert outcome == "non-finite loss or gradient" and math.isnan(loss)
    assert all(torch.equal(b, t) for b, t in zip(before, skipping_model.state_dict().values()))
    assert all(p.grad is None for p in skipping_model.parameters())
    assert train_step(skipping_model, good, skipping_optimizer, skipping_schedule, cfg, cpu)[0] == "ok"

    for expected, got in zip(model.state_dict().values(), skipping_model.state_dict().values()):
        assert torch.equal(expected, got)
    assert skipping_schedule.state_dict() == schedule.state_dict()
    expected_state, got_state = optimizer.state_dict()["state"], skipping_optimizer.state_dict()["state"]
    assert expected_state.keys() == got_state.keys()
    for index, moments in expected_state.items():
        assert moments.keys() == got_state[index].keys()
        assert all(torch.equal(value, got_state[index][name]) for name, value in moments.items())


# --- evaluation -----------------------------------------------------------------------------------------------------

def evaluate_manifest(utterances, tmp_path, **options):
    """(counts, rows) of a tiny untrained model over a manifest of `utterances` (Utterance arguments), `options` to
    evaluate."""
    from data.dataset import SpeechDataset
    from data.manifest import Utterance, write_manifest
    from data.sampler import eval_shard
    from trainer.evaluate import evaluate

    write_manifest(tmp_path / "m.jsonl", [Utterance(*arguments) for arguments in utterances])
    cfg = compose_config(["model.depth=1", "model.hidden=8", "model.conv_channels=2", "data.features.kind=mel",
                          "data.features.n_mels=40"])
    features = build.features(cfg.data)
    model = build.model(cfg.model, features.num_features)
    dataset = SpeechDataset([tmp_path / "m.jsonl"], features, None, model.time_stride)
    return evaluate(model, dataset, eval_shard(dataset.durations, 0, 1, 4), torch.device("cpu"), **options)


def test_evaluation_counts_audio_too_short_for_its_transcript_apart_from_unreadable_audio(tmp_path):
    soundfile.write(tmp_path / "short.wav", np.full(1, 0.1, np.float32), 16000)  # its manifest says 2 s
    counts, rows = evaluate_manifest([(str(tmp_path / "short.wav"), 2.0, "TWO", "x"),
                                      (str(tmp_path / "gone.flac"), 2.0, "SIX", "x")], tmp_path)
    assert (len(rows), counts.unreadable, counts.too_long_for_stride, counts.not_decoded) == (0, 1, 1, 2)
    # best.pt's choice goes by both, as before they were told apart: a checkpoint's best_unreadable counted both
    assert not counts.beats(1, math.inf) and ErrorCounts(words=1, too_long_for_stride=1).beats(2, math.inf)


def test_evaluation_compares_against_the_normalised_transcript(an4_source, tmp_path):
    audio = next((an4_source / "wav" / "an4test_clstk").rglob("*.flac"))
    counts, rows = evaluate_manifest([(str(audio), 2.0, "  two   six eight ", "x")], tmp_path)
    assert rows[0]["reference"] == "TWO SIX EIGHT" and counts.words == 3 and counts.unreadable == 0


def test_evaluation_without_a_bar_logs_its_progress_as_often_as_asked(an4_source, tmp_path, caplog):
    """A batch job's log, where a large test set ran for minutes without a word."""
    caplog.set_level(logging.INFO)
    audio = sorted((an4_source / "wav" / "an4test_clstk").rglob("*.flac"))[:5]
    five = [(str(path), 2.0, "TWO", "x") for path in audio]  # batches of 4: two
    evaluate_manifest(five, tmp_path, progress_line_s=0)
    assert [record.getMessage() for record in caplog.records if "evaluating" in record.getMessage()] == [
        "evaluating: batch 1 of 2", "evaluating: batch 2 of 2"]
    caplog.clear()
    evaluate_manifest(five, tmp_path, progress_line_s=3600)
    evaluate_manifest(five, tmp_path, progress_bar=True, progress_line_s=0)  # the bar says it; stderr not captured
    assert "evaluating" not in caplog.text


def test_evaluation_counts_the_utterances_it_could_not_read(an4_source, tmp_path, caplog):
    audio = next((an4_source / "wav" / "an4test_clstk").rglob("*.flac"))
    counts, rows = evaluate_manifest([(str(audio), 2.0, "TWO", "x"), (str(tmp_path / "gone.flac"), 2.0, "SIX", "x")],
                                     tmp_path)
    assert (len(rows), counts.words, counts.unreadable) == (1, 1, 1)
    assert "gone.flac: no such audio file" in caplog.text


def test_evaluation_leaves_the_model_in_its_mode_and_an_earlier_table_when_nothing_decodes(an4_source, tmp_path,
                                                                                           capsys):
    from data.dataset import SpeechDataset
    from data.manifest import Utterance, write_manifest
    from trainer.evaluate import evaluate, main

    path = small_checkpoint(tmp_path / "small.pt")
    model, features, _ = build.from_checkpoint(path, torch.device("cpu"))
    audio = next((an4_source / "wav" / "an4test_clstk").rglob("*.flac"))
    write_manifest(tmp_path / "one.jsonl", [Utterance(str(audio), 2.0, "TWO", "x")])
    dataset = SpeechDataset([tmp_path / "one.jsonl"], features, None, model.time_stride)
    for training in (False, True):
        model.train(training)
        evaluate(model, dataset, [[0]], torch.device("cpu"))
        assert model.training is training

    write_manifest(tmp_path / "gone.jsonl", [Utterance(str(tmp_path / "gone.flac"), 1.0, "TWO", "x")])
    table = tmp_path / "errors.tsv"
    table.write_text("an earlier run's table\n")
    assert main(["--checkpoint", str(path), "--manifest", str(tmp_path / "gone.jsonl"), "--out", str(table)]) == 1
    assert "none of the 1 utterance of" in capsys.readouterr().err
    assert table.read_text() == "an earlier run's table\n"


def test_evaluate_refuses_to_write_its_table_over_the_language_model_it_reads(tmp_path, capsys):
    from trainer.evaluate import main

    audio = tmp_path / "a.wav"
    soundfile.write(audio, 0.1 * np.random.default_rng(0).standard_normal(16000), 16000, subtype="FLOAT")
    write_manifest(tmp_path / "m.jsonl", [Utterance(str(audio), 1.0, "YES", "a")])
    model = tmp_path / "words.arpa"
    model.write_text(lm.build_arpa([["YES"]], 2))
    arguments = ["--checkpoint", str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu",
                 "--manifest", str(tmp_path / "m.jsonl"), "--lm", str(model)]
    assert main([*arguments, "--out", str(model)]) == 2
    assert capsys.readouterr().err == f"error: {model} is also an input of this command: writing it would destroy it\n"
    assert model.read_text() == lm.build_arpa([["YES"]], 2)


@pytest.mark.parametrize("tool, argument", [("lm", "--manifest"), ("evaluate", "--manifest"), ("evaluate", "--lm"),
                                            ("evaluate", "--checkpoint"), ("transcribe", "--checkpoint")])
def test_the_tools_refuse_an_input_they_cannot_open_in_one_line(tool, argument, tmp_path, capsys):
    # An OSError other than a missing file (no permission, which root is never refused; a name past the file system's
    # 255 bytes) ended in a traceback.
    main = importlib.import_module(f"trainer.{tool}").main
    manifest, model = str(tmp_path / "m.jsonl"), str(small_checkpoint(tmp_path / "small.pt"))
    write_manifest(manifest, [Utterance(str(tmp_path / "a.wav"), 1.0, "YES", "a")])
    arguments = {"lm": ["--manifest", manifest, "--out", str(tmp_path / "words.arpa")],
                 "evaluate": ["--checkpoint", model, "--device", "cpu", "--manifest", manifest],
                 "transcribe": ["--checkpoint", model, "--device", "cpu", str(tmp_path / "a.wav")]}[tool]
    unopenable = str(tmp_path / ("x" * 300))
    if argument in arguments:
        arguments[arguments.index(argument) + 1] = unopenable
    else:
        arguments += [argument, unopenable]
    assert main(arguments) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and unopenable in error and error.count("\n") == 1, error


@pytest.mark.parametrize("argument", ["--lm", "--manifest"])
def test_evaluate_refuses_an_empty_path_it_would_take_as_none_given(argument, tmp_path, capsys):
    # --lm "$LM" with LM unset decoded without a language model (its --lm-weight ignored), and --manifest "" the run's
    # data.eval_manifest, exit code 0 both.
    from trainer.evaluate import main

    audio = tmp_path / "a.wav"
    soundfile.write(audio, 0.1 * np.random.default_rng(0).standard_normal(16000), 16000, subtype="FLOAT")
    write_manifest(tmp_path / "m.jsonl", [Utterance(str(audio), 1.0, "YES", "a")])
    arguments = {"--checkpoint": str(small_checkpoint(tmp_path / "small.pt", f"data.eval_manifest={tmp_path}/m.jsonl")),
                 "--device": "cpu", "--manifest": str(tmp_path / "m.jsonl"), "--lm-weight": "2", argument: ""}
    with pytest.raises(SystemExit) as refused:
        main([part for pair in arguments.items() for part in pair])
    assert refused.value.code == 2
    assert capsys.readouterr().err.endswith(f"error: argument {argument}: an empty path (an unset shell variable?)\n")


def test_evaluate_reads_its_manifest_before_the_language_model(tmp_path, capsys):
    # A language model can take minutes to read: a mistyped --manifest was told only after it had been read.
    from trainer.evaluate import main

    unreadable = tmp_path / "words.arpa"
    unreadable.write_text("not a language model\n")
    assert main(["--checkpoint", str(small_checkpoint(tmp_path / "small.pt")), "--device", "cpu", "--lm",
                 str(unreadable), "--manifest", str(tmp_path / "typo.jsonl")]) == 2
    assert capsys.readouterr().err == f"error: manifest {tmp_path / 'typo.jsonl'} does not exist\n"


@pytest.mark.parametrize("device, cuda_graphs, pinned", [("cuda", False, True), ("cuda", True, False),
                                                          ("cpu", False, False)])
def test_training_batches_are_pinned_on_a_gpu_unless_graphs_are_captured(device, cuda_graphs, pinned):
    # A pinned allocation on the loader's thread while the main thread captures a graph invalidates the capture
    # (seen at batch 32 on AN4).
    cfg = compose_config([f"train.cuda_graphs={str(cuda_graphs).lower()}"])
    env = DistEnv(rank=0, world_size=1, device=torch.device(device))
    assert train_loader([], [[0]], cfg, env, epoch=0).pin_memory is pinned


def test_metrics_of_a_resumed_run_keep_what_its_checkpoint_covers(tmp_path):
    path = tmp_path / "metrics.jsonl"
    steps = [{"step": step, "epoch": (step - 1) // 4, "loss": 1.0 / step} for step in range(1, 11)]
    evaluations = [{"epoch": 1, "eval_wer": 90.0}, {"epoch": 2, "eval_wer": 80.0}]
    lines = steps[:4] + evaluations[:1] + steps[4:8] + evaluations[1:] + steps[8:]
    # Lines added or edited by hand and a line killed mid-write are no lines of the trainer's.
    written = ("".join(json.dumps(line) + "\n" for line in lines[:3]) + '{"note": "lr lowered"}\n'
               + '{"step": "6b", "loss": 0.1}\n{"epoch": null}\n'
               + "".join(json.dumps(line) + "\n" for line in lines[3:]) + '{"step": 11, "ep')
    path.write_text(written)
    # A checkpoint from inside the second epoch, at step 6: one evaluation, six losses.
    with open_metrics(path, {"epoch": 1, "step": 6}) as metrics:
        metrics.write(json.dumps({"step": 7, "epoch": 1, "loss": 0.5}) + "\n")
        assert path.read_text().endswith('"loss": 0.5}\n')  # on disk at once, for tail -f and a job killed next
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert kept == steps[:4] + evaluations[:1] + steps[4:6] + [{"step": 7, "epoch": 1, "loss": 0.5}]

    path.write_text(written)
    with open_metrics(path, None):  # a fresh run
        pass
    assert path.read_text() == ""


WHOLE_FILE_WRITERS = {
    "manifest": lambda path: write_manifest(path, [Utterance("/a.flac", 1.0, "NEW", "spk1")]),
    "tool output": lambda path: cli.write_output(str(path), "new\n"),
    "metrics.jsonl": lambda path: open_metrics(path, {"epoch": 0, "step": 0}).close(),
    "checkpoint": lambda path: checkpoint.save(path, {"model": {}, "config": {}}),
}


@pytest.mark.parametrize("writer", WHOLE_FILE_WRITERS)
def test_each_writer_puts_its_file_on_disk_before_the_rename_and_leaves_nothing_when_interrupted(tmp_path, monkeypatch,
                                                                                                 writer):
    """A Ctrl-C at the flush to disk (data.files.write_whole) leaves the earlier file and nothing beside it; a writer
    that renamed without flushing left, after a power loss, an empty file where the earlier one was."""
    path = tmp_path / "file"
    path.write_text("earlier\n")

    def ctrl_c(fd):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "fsync", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        WHOLE_FILE_WRITERS[writer](path)
    assert path.read_text() == "earlier\n" and [file.name for file in tmp_path.iterdir()] == ["file"]


def test_metrics_the_disk_cannot_hold_stay_as_they_were_and_the_error_is_one_line(tmp_path):
    """A resumed run rewrites metrics.jsonl with the lines its checkpoint covers; a full disk, played by a file size
    limit (the write fails with EFBIG), leaves the file as it was and no temporary file, and the error names it."""
    path = tmp_path / "metrics.jsonl"
    written = "".join(json.dumps({"step": step, "epoch": 0, "loss": 1.0}) + "\n" for step in range(1, 41))
    path.write_text(written)
    script = (
        "import resource\n"
        "from pathlib import Path\n"
        "from trainer.__main__ import user_error_message\n"
        "from trainer.train import open_metrics\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (100, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        "try:\n"
        f"    open_metrics(Path({str(path)!r}), {{'epoch': 0, 'step': 30}})\n"
        "except OSError as error:\n"
        f"    print(user_error_message(error, Path({str(tmp_path)!r})))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.startswith(f"cannot write {path}: File too large; "), result.stderr
    assert f" MiB free in {tmp_path}; checkpoints are written whole or not at all" in result.stdout
    assert path.read_text() == written and [file.name for file in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_tensorboard_events_the_disk_cannot_hold_are_one_error_in_the_main_thread_and_no_thread_traceback(tmp_path):
    script = (
        "import resource\n"
        "from trainer.train import tensorboard_writer\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (300, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        f"writer = tensorboard_writer({str(tmp_path)!r}, None)\n"
        "try:\n"
        "    for step in range(1000):\n"
        "        writer.add_scalar('loss', 1.0, step)\n"
        "        writer.flush()\n"
        "except OSError as error:\n"
        "    print(error.errno)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout == f"{errno.EFBIG}\n" and result.stderr == "", result.stderr


def test_only_what_the_user_fixes_is_a_one_line_error():
    assert user_error_message(ValueError("model.depth must be a positive integer"), Path("r")) == (
        "model.depth must be a positive integer")
    assert user_error_message(OSError(errno.EDQUOT, "Disk quota exceeded", "r/config.yaml"), Path("r")).startswith(
        "cannot write r/config.yaml: Disk quota exceeded")
    # A file named in the config that cannot be opened (a manifest: no permission, a name too long) got a traceback.
    assert user_error_message(PermissionError(errno.EACCES, "Permission denied", "m.jsonl"), Path("r")) == (
        "cannot open m.jsonl: Permission denied")
    with pytest.raises(OSError) as too_long:
        open("x" * 300)
    assert user_error_message(too_long.value, Path("r")) == f"cannot open {'x' * 300}: File name too long"
    # An interpolation that does not resolve (a typo in an override or an experiment file) was three lines.
    with pytest.raises(ValueError) as unresolved:
        OmegaConf.select(OmegaConf.create({"model": {"hidden": "${nope}"}}), "model.hidden")
    assert user_error_message(unresolved.value, Path("r")) == "model.hidden: Interpolation key 'nope' not found"
    assert user_error_message(OSError(errno.EIO, "Input/output error"), Path("r")) is None  # a fault: its traceback
    assert user_error_message(RuntimeError("CUDA error"), Path("r")) is None


def test_starting_afresh_or_from_another_runs_checkpoint_over_a_runs_checkpoints_is_refused(tmp_path, caplog):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')  # a job that died before its checkpoint
    assert checkpoint_to_resume(None, run_dir) is None
    with caplog.at_level("INFO", logger="trainer.resume"):
        assert checkpoint_to_resume("auto", run_dir) is None
    assert "no " + str(run_dir / "checkpoints" / "last.pt") + " yet, starting afresh" in caplog.text

    elsewhere = tmp_path / "other" / "checkpoints" / "last.pt"
    with pytest.raises(FileNotFoundError, match=f"checkpoint not found: {re.escape(str(elsewhere))}"):
        checkpoint_to_resume(str(elsewhere), run_dir)
    elsewhere.parent.mkdir(parents=True)
    elsewhere.write_bytes(b"")
    assert checkpoint_to_resume(str(elsewhere), run_dir) == elsewhere  # into a run directory of no checkpoints

    (run_dir / "checkpoints" / "step3.pt").write_bytes(b"")  # a copy the user saved: auto cannot take it
    with pytest.raises(ValueError, match=r"\(step3.pt in checkpoints/\), which starting afresh would overwrite: "
                                         r"continue it with train.resume=PATH, or give"):
        checkpoint_to_resume("auto", run_dir)
    (run_dir / "checkpoints" / "step3.pt").unlink()
    (run_dir / "checkpoints" / "best.pt").write_bytes(b"")  # a first last.pt whose save did not finish
    with pytest.raises(ValueError, match=rf"{re.escape(str(run_dir))} already holds a run \(best.pt in "
                                         r"checkpoints/\), which starting afresh would overwrite"):
        checkpoint_to_resume(None, run_dir)
    caplog.clear()
    with caplog.at_level("INFO", logger="trainer.resume"):
        assert checkpoint_to_resume("auto", run_dir) == run_dir / "checkpoints" / "best.pt"
    assert "no " + str(run_dir / "checkpoints" / "last.pt") + ", continuing from " in caplog.text
    (run_dir / "checkpoints" / "last.pt").write_bytes(b"")
    assert checkpoint_to_resume("auto", run_dir) == run_dir / "checkpoints" / "last.pt"
    best = run_dir / "checkpoints" / "best.pt"
    assert checkpoint_to_resume(str(best), run_dir) == best
    with pytest.raises(ValueError, match=r"\(best.pt, last.pt in checkpoints/\)"):
        checkpoint_to_resume(None, run_dir)
    assert checkpoint_to_resume(str(elsewhere), run_dir) == elsewhere  # continued_run_id decides, once it is read


def test_a_checkpoint_from_outside_resumed_over_a_runs_checkpoints_must_be_one_of_that_runs(tmp_path):
    run_dir, outside = tmp_path / "run", tmp_path / "copy" / "step3.pt"
    continued_run_id({"run_id": "b"}, outside, run_dir)  # no checkpoints there: a new run starts from it
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.pt").write_bytes(b"")
    (run_dir / "jobs.jsonl").write_text(json.dumps({"run_id": "a", "from_step": 0}) + "\n")
    continued_run_id({"run_id": "a"}, outside, run_dir)  # a copy of one of its own
    continued_run_id({"run_id": "b"}, run_dir / "checkpoints" / "last.pt", run_dir)  # its own file: whatever it holds
    # The command that started the run from `outside`, run again, was told only to take another run_name: a new run
    # from `outside` again.
    for saved in ({"run_id": "b"}, {}):  # another run's, or one from before run ids: it cannot tell
        with pytest.raises(ValueError, match=rf"{re.escape(str(run_dir))} already holds a run \(last.pt in "
                                             rf"checkpoints/\), and {re.escape(str(outside))} is not one of its "
                                             r"checkpoints .* would overwrite them; continue the run there with "
                                             r"train.resume=auto \(the same command run again, a requeued job\), or "
                                             r"give this run another run_name$"):
            continued_run_id(saved, outside, run_dir)


def test_a_resume_from_the_checkpoint_a_run_started_from_continues_that_run_and_from_any_other_is_left_to_refuse(
        tmp_path, caplog):
    """The command that started a run from another run's checkpoint, run again (a requeued job), was refused once the
    run directory held the run's own checkpoints: it continues from the last of them, where they record that start."""
    run_dir, start = tmp_path / "run", tmp_path / "parent" / "last.pt"
    parts = {part: {} for part in checkpoint.TRAINING_PARTS}

    def saved(run_id, step, started_from=None):
        return {**parts, "train_state": {"step": step}, "run_id": run_id, "started_from": started_from}

    assert run_started_from(start, saved("parent", 3), run_dir) is None  # no checkpoints there: a new run starts
    checkpoint.save(run_dir / "checkpoints" / "best.pt", saved("ft", 4, {"run_id": "parent", "step": 3}))
    (run_dir / "jobs.jsonl").write_text(json.dumps({"run_id": "ft", "from_step": 3}) + "\n")
    with caplog.at_level("INFO", logger="trainer.resume"):
        own, own_saved = run_started_from(start, saved("parent", 3), run_dir)
    assert own == run_dir / "checkpoints" / "best.pt" and own_saved["train_state"] == {"step": 4}  # no last.pt yet
    assert (f"train.resume={start} is the checkpoint this run directory's run started from (run parent at step 3): "
            f"the same command run again continues that run from {own}, as train.resume=auto would") in caplog.text
    checkpoint.save(run_dir / "checkpoints" / "last.pt", saved("ft", 5, {"run_id": "parent", "step": 3}))
    assert run_started_from(start, saved("parent", 3), run_dir)[0] == run_dir / "checkpoints" / "last.pt"
    # The run it names has gone on, another run's at that step, one from before run ids, or the run's own: not its
    # start, and continued_run_id decides as before.
    for other in (saved("parent", 4), saved("other", 3), saved(None, 3), saved("ft", 3)):
        assert run_started_from(start, other, run_dir) is None
    assert run_started_from(run_dir / "checkpoints" / "best.pt", saved("parent", 3), run_dir) is None
    checkpoint.save(run_dir / "checkpoints" / "last.pt", saved("ft", 5))  # from before runs recorded their start
    assert run_started_from(start, saved("parent", 3), run_dir) is None


def test_only_a_resume_that_starts_a_new_run_says_it_is_another_runs_checkpoint(tmp_path, caplog):
    """A copy of the run's own checkpoint continues its metrics.jsonl, and one another run's checkpoints refuse starts
    nothing: the log said of both that this run wrote its metrics.jsonl from the checkpoint's next step on."""
    run_dir, outside = tmp_path / "run", tmp_path / "copy" / "step3.pt"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.pt").write_bytes(b"")
    (run_dir / "jobs.jsonl").write_text(json.dumps({"run_id": "a", "from_step": 0}) + "\n")
    outside.parent.mkdir()
    outside.write_bytes(b"")
    new_run = "another run directory's checkpoint: this run writes to"
    with caplog.at_level("INFO", logger="trainer.resume"):
        assert checkpoint_to_resume(str(outside), run_dir) == outside  # which run's, continued_run_id says once read
        assert continued_run_id({"run_id": "a"}, outside, run_dir) == "a"
        with pytest.raises(ValueError, match="is not one of its checkpoints"):
            continued_run_id({"run_id": "b"}, outside, run_dir)
        assert new_run not in caplog.text
        assert continued_run_id({"run_id": "b"}, outside, tmp_path / "fresh") is None
    assert caplog.text.count(new_run) == 1


def test_a_runs_own_checkpoints_in_a_folder_linked_to_another_disk_are_its_own(tmp_path, caplog):
    """checkpoints/ a link to a larger disk: its checkpoints were taken for another run's, so a resume chose best.pt
    afresh (the first evaluation after it replaced the best one) and one from before run ids was refused."""
    run_dir, disk = tmp_path / "run", tmp_path / "disk" / "run"
    disk.mkdir(parents=True)
    run_dir.mkdir()
    (run_dir / "checkpoints").symlink_to(disk)
    (disk / "last.pt").write_bytes(b"")
    (run_dir / "jobs.jsonl").write_text(json.dumps({"run_id": "a", "from_step": 0}) + "\n")
    for path in (run_dir / "checkpoints" / "last.pt", disk / "last.pt"):
        assert is_own_checkpoint(path, run_dir)
        continued_run_id({}, path, run_dir)  # from before run ids: its own file, whatever it holds
        with caplog.at_level("INFO", logger="trainer.resume"):
            checkpoint_to_resume(str(path), run_dir)
        assert "another run directory's checkpoint" not in caplog.text
    (tmp_path / "copy.pt").write_bytes(b"")
    assert not is_own_checkpoint(tmp_path / "copy.pt", run_dir)


def test_results_record_the_commit_and_the_command_as_typed(tmp_path):
    commit = source_commit()
    assert re.fullmatch(r"[0-9a-f]{12}(\+changes)?", commit), commit
    assert versions(torch.device("cpu"))["commit"] == commit
    assert source_commit(tmp_path) is None  # no git checkout there
    # An installed copy inside a checkout (pip install . into its .venv) is not that checkout's code: it gave the
    # checkout's commit.
    checkout, installed = tmp_path / "checkout", tmp_path / "checkout" / ".venv" / "site-packages"
    (installed / "trainer").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "trainer" / "environment.py", installed / "trainer")
    (checkout / ".gitignore").write_text(".venv/\n")
    for command in (["init", "-q"], ["add", ".gitignore"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit",
                                                              "-qm", "first"]):
        subprocess.run(["git", "-C", str(checkout), *command], check=True, capture_output=True)
    assert source_commit(installed) is None
    code = "from trainer.environment import command_line; print(command_line())"
    printed = subprocess.run([sys.executable, "-c", code, "two words"], cwd=REPO_ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
    assert printed == f"python -c '{code}' 'two words'"


def test_each_job_of_a_run_adds_where_it_ran_and_a_fresh_run_starts_anew(tmp_path, caplog):
    path = tmp_path / "jobs.jsonl"
    env = DistEnv(rank=0, world_size=1, device=torch.device("cpu"))
    path.write_text('{"from_step": 0, "device": "an earlier run"}\n')
    with caplog.at_level("INFO", logger="trainer.train"):
        record_job(path, "run-a", 0, env, resumed=False)
        record_job(path, "run-a", 40, env, resumed=True)
    jobs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(job["run_id"], job["from_step"], job["world_size"]) for job in jobs] == [("run-a", 0, 1), ("run-a", 40, 1)]
    assert recorded_run_id(tmp_path) == "run-a" and recorded_run_id(tmp_path / "elsewhere") is None
    assert all(job["device"].startswith("CPU") and job["torch"] == torch.__version__ for job in jobs), jobs
    assert all(job["command"] == command_line() for job in jobs), jobs
    assert "this job: from step 40, world size 1, rank 0 on CPU" in caplog.text


def test_a_job_after_one_that_left_half_a_line_in_jobs_jsonl_records_itself_and_the_run_id_whole(tmp_path):
    # The next job's line was glued to the torn one: the run's id was then read as None, and that job was lost.
    path = tmp_path / "jobs.jsonl"
    env = DistEnv(rank=0, world_size=1, device=torch.device("cpu"))
    record_job(path, "run-a", 0, env, resumed=False)
    with open(path, "a") as jobs:
        jobs.write('{"run_id": "run-a", "from_st')
    assert recorded_run_id(tmp_path) == "run-a"
    record_job(path, "run-a", 40, env, resumed=True)
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[-1])["from_step"] == 40, lines
    assert recorded_run_id(tmp_path) == "run-a"


def test_a_cpu_rank_names_its_thread_count_in_words_that_agree():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # a rank of two on a 2-core machine: it read "(1 threads per rank)"
        assert device_name(torch.device("cpu")).endswith(" (1 thread per rank)")
        torch.set_num_threads(2)
        assert device_name(torch.device("cpu")).endswith(" (2 threads per rank)")
    finally:
        torch.set_num_threads(threads)


def test_evaluate_help_says_what_the_tool_does(capsys):
    from trainer.evaluate import main
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    description = capsys.readouterr().out.split("\n\n")[1]
    # It read "Evaluation: corpus WER/CER, and `python -m trainer.evaluate` for a saved checkpoint."
    assert "decodes a manifest with a saved checkpoint and prints" in " ".join(description.split()), description


def test_a_sweep_exits_2_where_every_failure_was_a_user_error_else_1(monkeypatch, capsys):
    monkeypatch.setattr(trainer_main, "_failed_sweep_jobs", [])
    assert trainer_main.sweep_exit_code() == 0
    trainer_main._failed_sweep_jobs.append(("sweep job 0 (runs/a): bad value", 2))
    assert trainer_main.sweep_exit_code() == 2
    trainer_main._failed_sweep_jobs.append(("sweep job 3 (runs/b): RuntimeError: x (its traceback is above)", 1))
    assert trainer_main.sweep_exit_code() == 1
    assert "failed: sweep job 3 (runs/b): RuntimeError" in capsys.readouterr().err


def test_a_sweep_job_folder_is_one_folder_of_a_legal_length_named_by_its_overrides():
    assert job_folder("data.eval_manifest=m/a.jsonl,model.cell=gru") == "data.eval_manifest=m_a.jsonl,model.cell=gru"
    long = ",".join(f"data.train_manifests=[/corpus/{index:03d}.jsonl]" for index in range(20))
    name = job_folder(long)
    assert "/" not in name and len(name.encode()) == MAX_FOLDER_NAME and name.startswith("data.train_manifests=[")
    assert job_folder(long) == name and job_folder(long.replace("019", "020")) != name  # stable, and apart
    # Long paths give way to digests before the name is cut, so the keys a sweep varies stay in it.
    paths = "data.eval_manifest=/tmp/" + "x" * 150 + "/test.jsonl,data.train_manifests=[/tmp/" + "x" * 150 + "/a.jsonl]"
    name = job_folder(f"{paths},model.backend=reference,model.cell=gru")
    assert name.startswith("data.eval_manifest=#") and name.endswith(",model.backend=reference,model.cell=gru"), name
    assert len(name.encode()) <= MAX_FOLDER_NAME and job_folder(f"{paths.replace('a.jsonl', 'b.jsonl')},model.cell=gru"
                                                                ) != job_folder(f"{paths},model.cell=gru")


def test_run_names_hydra_parses_as_numbers_are_names_too():
    from trainer.run_directory import check_run_name

    for name in (1.5, 2024, "2024-06-01", "exp.v2", "a b"):
        check_run_name(OmegaConf.create({"run_name": name}))  # returns: runs/1.5 is one folder of runs/
    for name in (None, True, "", "..", "a/b"):
        with pytest.raises(SystemExit):
            check_run_name(OmegaConf.create({"run_name": name}))


def test_checking_a_jobs_config_leaves_the_callers_config_as_it_was():
    """The check deleted the hydra node from the config it was given, which its caller may read after it."""
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=cpu_demo"], return_hydra_config=True)
    before = OmegaConf.to_yaml(cfg)
    run_directory.check_job_config(cfg)
    assert OmegaConf.to_yaml(cfg) == before


def test_a_model_that_fits_the_device_alone_is_refused_where_ranks_share_it():
    """Each rank holds its own weights, gradients and optimizer state: ranks on one CPU (or sharing a GPU,
    distributed.share_gpus) each passed the check against the whole device, and together ran it out of memory."""
    cfg = compose_config(["experiment=cpu_demo"])
    num_features = build.features(cfg.data).num_features
    with torch.device("meta"):
        num_parameters = sum(p.numel() for p in build.model(cfg.model, num_features).parameters())
    needed = num_parameters * build.STATE_BYTES_PER_PARAMETER[cfg.optim.name]
    cpu = torch.device("cpu")
    too_many = 2 * (build.device_memory(cpu) // needed) + 2  # twice over: the memory available moves between reads
    build.check_model_fits(cfg.model, cfg.optim.name, num_features, cpu, ranks_on_device=too_many // 4)
    with pytest.raises(ValueError, match=rf"GiB cpu has for it \(.* GiB shared by {too_many} ranks\)"):
        build.check_model_fits(cfg.model, cfg.optim.name, num_features, cpu, ranks_on_device=too_many)


@pytest.mark.parametrize("overrides", [[], ["model.bidirectional=false", "model.cell=lstm"],
                                       ["model.residual=true", "model.cell=relu", "model.hidden=33"]])
@pytest.mark.parametrize("depth", [1, 2, 7])
def test_the_parameter_count_is_the_built_models(overrides, depth):
    cfg = compose_config(["experiment=cpu_demo", f"model.depth={depth}", *overrides])
    built = build.model(cfg.model, 40)
    assert build.num_parameters(cfg.model, 40) == sum(parameter.numel() for parameter in built.parameters())


def test_a_mistyped_huge_depth_is_refused_at_once():
    """Counting the parameters of the whole stack, built on the meta device, took 4 ms a layer: 400 s here."""
    cfg = compose_config(["experiment=cpu_demo", "model.depth=100000", "model.hidden=800"])
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"^the model \(model.depth=100000 model.hidden=800 model.cell=gru "
                                         r"model.bidirectional=true .*\) has 769,116.6M parameters"):
        build.check_model_fits(cfg.model, cfg.optim.name, 40, torch.device("cpu"))
    assert time.monotonic() - started < 30
