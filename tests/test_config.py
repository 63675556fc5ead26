"""The config: every experiment composes, the README lists each key, each bad value is refused naming its key; the
optimizer, its schedule and the model size built from it."""
import io
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from conftest import REPO_ROOT, compose_config
from prnn_kernels import relative_error
from trainer import build
from trainer.config import SET_MANIFESTS, check_config, known_config_keys, rank_settings
from trainer.override_errors import command_line_error_line, refused_by_hydra


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


@pytest.mark.parametrize("override, suggestion", [
    ("data.train_manifest=[a.jsonl]", "(did you mean data.train_manifests?)"),  # not eval_manifest or manifest_dir
    ("optim=adamw_cpu", "(did you mean optim=adamw_cpu_demo?)"),  # not adamw_an4_gpu or adamw
])
def test_a_misspelling_close_to_several_names_is_offered_the_closest(override, suggestion):
    """Every misspelling tried had one name close to it, so that one offering the least close of several passed."""
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as error:
        compose_config([override])
    assert suggestion in command_line_error_line(error.value)


def test_a_value_error_of_the_jobs_own_is_not_taken_for_hydras_refusal_of_the_command_line():
    """Hydra's defaults list refuses a group given no option (experiment=null) in a ValueError of its own; one raised
    anywhere else, taken for it, was reported as a config group's missing option, in one line with no traceback."""
    with pytest.raises(ValueError) as hydras:
        compose_config(["experiment=null"])
    assert refused_by_hydra(hydras.value)
    with pytest.raises(ValueError) as the_jobs:
        check_config(compose_config(["model.depth=0"]))
    assert not refused_by_hydra(the_jobs.value)


def test_an_override_hydra_cannot_merge_is_refused_with_its_reason():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as error:
        compose_config(["hydra.job.chdir=maybe"])
    # Hydra's line names the override, its cause's what is wrong with it: without it, the line gave no reason
    assert command_line_error_line(error.value) == ("Error merging override hydra.job.chdir=maybe; Value 'maybe' is "
                                                    "not a valid bool (type str)")


PICK = " (optim=NAME picks an optimizer with its settings)"


MOMENTUM = ("optim.momentum must be a number in (0, 1) (Nesterov momentum needs one; at 1 or more the "
            "momentum never decays)")


@pytest.mark.parametrize("override, complaint", [
    ("train.grad_clip_norm=-1", "train.grad_clip_norm must be a positive number, not -1"),  # would flip the gradient
    # Past a float's range: a traceback of OverflowError.
    (f"optim.lr={10**400}", f"optim.lr must be a positive number, not {10**400}"),
    ("train.max_steps=0", "train.max_steps must be a positive integer or null, not 0"),
    ("train.global_batch_size=abc", "train.global_batch_size must be a positive integer, not 'abc'"),
    ("train.checkpoint_every_steps=true", "train.checkpoint_every_steps must be a positive integer or null, not True"),
    ("train.amp=fp16", "train.amp must be bf16 or none, not 'fp16'"),
    ("model.depth=2.5", "model.depth must be a positive integer, not 2.5"),
    ("seed=1.5", "seed must be an integer from 0 to 2**32 - 1, not 1.5"),
    ("seed=100000000000000", "seed must be an integer from 0 to 2**32 - 1, not 100000000000000"),
    ("data.train_manifests=a.jsonl",
     f"data.train_manifests must be a list of 1 to 5,000 manifest paths{SET_MANIFESTS}, not 'a.jsonl'"),
    ("data.train_manifests=[]", f"data.train_manifests must be a list of 1 to 5,000 manifest paths{SET_MANIFESTS}, "
                                "not []"),
    ("data=manifest data.train_manifests=[a.jsonl]",  # no eval_manifest: AN4's test set must not stand in for it
     f"data.eval_manifest must be a manifest's path{SET_MANIFESTS}, not None"),
    ("data.features.sample_rate=8000.0", "data.features.sample_rate must be an integer number of Hz from 1000 to "
                                         "384000, not 8000.0"),
    ("data.augment.masks.freq_mask=-5", "data.augment.masks.freq_mask must be a non-negative integer, not -5"),
    ("data.augment.masks.max_time_fraction=5", "data.augment.masks.max_time_fraction must be a number from 0 to 1, "
                                               "not 5"),
    ("model.conv_channels=-2", "model.conv_channels must be an integer from 1 to 1,048,576, not -2"),
    ("model.lookahead=2.5", "model.lookahead must be an integer from 0 to 1,048,576, not 2.5"),
    # A weight of more bytes than torch can count: the model built on the meta device to count them, a traceback.
    ("model.hidden=10000000000", "model.hidden must be an integer from 1 to 1,048,576, not 10000000000"),
    ("model.conv_channels=10000000000", "model.conv_channels must be an integer from 1 to 1,048,576, not "
                                        "10000000000"),
    ("model.bidirectional=false model.lookahead=4611686018427387904", "model.lookahead must be an integer from 0 to "
                                                                      "1,048,576, not 4611686018427387904"),
    *((f"{key}=1048577", f"{key} must be an integer from {least} to 1,048,576, not 1048577") for key, least in (
        ("model.hidden", 1), ("model.conv_channels", 1), ("model.lookahead", 0))),
    ("model.bidirectional=no", "model.bidirectional must be true or false, not 'no'"),  # a true string
    ("model.residual=3", "model.residual must be true or false, not 3"),
    ("model.cell=bogus", "model.cell must be one of relu, tanh, gru, lstm, not 'bogus'"),
    ("model.backend=fast", "model.backend must be one of auto, persistent, cudnn, reference, not 'fast'"),
    ("model.batch_slice=0", "model.batch_slice must be a positive integer or null, not 0"),
    ("train.progress_line_s=-1", "train.progress_line_s must be a non-negative number of seconds, not -1"),
    ("train.cuda_graphs=no", "train.cuda_graphs must be true or false, not 'no'"),
    # Refused by the run on any machine, once every rank had started: the launch scripts' check passed it.
    ("train.cuda_graphs=true", "train.cuda_graphs=true needs a CUDA device, this run is on cpu "
                               "(train.cuda_graphs=false runs it without them)"),
    ("model.backend=persistent", "model.backend=persistent: prnn_kernels.GRU: backend='persistent' cannot run: needs a "
                                 "CUDA GPU (compute capability 9.0, Hopper, or newer)"),
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
    # Three passed the check, and fused AdamW trained on the first two, the third ignored.
    ("optim.betas=[0.9,0.99,0.5]", "optim.betas must be two numbers in [0, 1) for optim.name=adamw, not "
                                   "[0.9, 0.99, 0.5]" + PICK),
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
    # Refused by distributed.init alone, the launch scripts' check and a sweep's let it through to the ranks' start.
    ("device=tpu", "device must be one of auto, cpu, cuda, not 'tpu'"),
    ("device=cuda:0", "device must be one of auto, cpu, cuda, not 'cuda:0'"),
    ("data.features.window_ms=1e9", "data.features.window_ms must be a number of milliseconds in (0, 1000], not "
                                    "1000000000.0"),  # a 64 GB window
    ("data.features.hop_ms=abc", "data.features.hop_ms must be a number of milliseconds in (0, 1000], not 'abc'"),
    ("data.features.n_mels=0", "data.features.n_mels must be a positive integer, not 0"),
    # Hydra refuses an unknown key on the command line, but takes one from an experiment file or a + override.
    ("+train.epoch=3", "unknown config key train.epoch: conf/train.yaml and conf/{model,data,optim}/ define no such "
                       "key (misspelt in an experiment file, or added by a + override?)"),
    ("+data.features.rate=8000", "unknown config key data.features.rate: conf/train.yaml and conf/{model,data,optim}/ "
                                 "define no such key (misspelt in an experiment file, or added by a + override?)"),
    # A known group of keys given a value in place of its keys: it was called a key no config file defines.
    ("train=null", "train must be a mapping of its keys (train.amp, train.checkpoint_every_steps, ...), not None"),
    ("data.features=null", "data.features must be a mapping of its keys (data.features.hop_ms, data.features.kind, "
                           "...), not None"),
    ("data.augment.masks=5", "data.augment.masks must be a mapping of its keys (data.augment.masks.freq_mask, "
                             "data.augment.masks.max_time_fraction, ...), not 5"),
    # And a key given a mapping in place of its value: its leaves were called keys no config file defines, misspelt.
    ("model.depth={layers:5}", "model.depth must be a value, not the mapping {'layers': 5}"),
    ("run_name={name:a}", "run_name must be a value, not the mapping {'name': 'a'}"),
    # Each rule's bound, just past it: mutating any bound (>= 1 into >= 0, < 1 into <= 1, dropping a check) passed.
    ("seed=-1", "seed must be an integer from 0 to 2**32 - 1, not -1"),
    ("seed=4294967296", "seed must be an integer from 0 to 2**32 - 1, not 4294967296"),
    *((f"{key}=0", f"{key} must be a positive integer{' or null' if nullable else ''}, not 0") for key, nullable in (
        ("train.epochs", False), ("train.global_batch_size", False), ("train.eval_batch_size", False),
        ("train.checkpoint_every_steps", True), ("train.graph_pad_frames", False), ("model.depth", False))),
    *((f"{key}=0", f"{key} must be an integer from 1 to 1,048,576, not 0") for key in (
        "model.hidden", "model.conv_channels")),
    ("model.lookahead=-1", "model.lookahead must be an integer from 0 to 1,048,576, not -1"),
    *((f"{key}=-1", f"{key} must be a non-negative integer, not -1") for key in (
        "train.num_workers", "optim.warmup_steps", "data.augment.masks.time_mask")),
    *((f"data.augment.masks.{key}=-1", f"data.augment.masks.{key} must be an integer from 0 to 100, not -1")
      for key in ("num_freq_masks", "num_time_masks")),
    # Each mask a module, built as the config is checked: 10**11 took all the memory for minutes, without a word.
    *((f"data.augment.masks.{key}=101", f"data.augment.masks.{key} must be an integer from 0 to 100, not 101")
      for key in ("num_freq_masks", "num_time_masks")),
    ("train.grad_clip_norm=0", "train.grad_clip_norm must be a positive number, not 0"),
    ("optim.lr=0", "optim.lr must be a positive number, not 0"),
    ("optim.lr=inf", "optim.lr must be a positive number, not inf"),
    ("optim.lr=true", "optim.lr must be a positive number, not True"),  # bool is an int subclass: 1
    ("optim.anneal=0", "optim.anneal must be a number in (0, 1], the factor the rate is multiplied by each epoch, "
                       "not 0"),
    ("optim.betas=[0.9,1.0]", "optim.betas must be two numbers in [0, 1) for optim.name=adamw, not [0.9, 1.0]" + PICK),
    ("optim=sgd optim.momentum=1", MOMENTUM + " for optim.name=sgd, not 1" + PICK),
    ("data.max_duration=0", "data.max_duration must be a positive number of seconds or null, not 0"),
    ("data.train_manifests=[a.jsonl,'']", "data.train_manifests must be a list of 1 to 5,000 manifest paths"
                                          f"{SET_MANIFESTS}, not ['a.jsonl', '']"),
    ("data.train_manifests=[a.jsonl,1]", "data.train_manifests must be a list of 1 to 5,000 manifest paths"
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
    ("data.train_manifests=[a.jsonl,' ']", "data.train_manifests must be a list of 1 to 5,000 manifest paths"
                                           f"{SET_MANIFESTS}, not ['a.jsonl', ' ']"),
    ("data.eval_manifest=' '", f"data.eval_manifest must be a manifest's path{SET_MANIFESTS}, not ' '"),
    ("train.resume=' '", "train.resume must be null, auto or a checkpoint's path, not ' '"),
    ("data.an4_source=' '", "data.an4_source must be null or AN4's folder (PRNN_AN4 sets its default), not ' '"),
    ("data.manifest_dir=' '", "data.manifest_dir must be a folder's path, not ' '"),
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
    "seed=0", "seed=4294967295", "optim.betas=[0,0.999]", "optim.anneal=1",
    # The demo's 40 mel bands need more FFT bins than a window at 1000 Hz has (check_config refuses them too).
    "data.features.sample_rate=1000 data.features.kind=spectrogram", "data.features.sample_rate=384000",
    "data.augment.masks.max_time_fraction=0", "data.augment.masks.max_time_fraction=1", "distributed.timeout_s=1e9",
    "data.features.window_ms=1000", "data.features.hop_ms=1000 data.features.window_ms=1000", "model.lookahead=0",
    "train.num_workers=0", "data.max_duration=null",  # null: no utterance left out for its length
    # A frequency mask as wide as the demo's 40 features: its widths are drawn below 40, so one always keeps a feature.
    "data.augment.enabled=true data.augment.masks.freq_mask=40",
    # Each rule's lower edge: with train.epochs' >= 1 made > 1, or weight decay's >= 0 made > 0, every test passed.
    *(f"{key}=1" for key in ("train.epochs", "train.global_batch_size", "train.eval_batch_size", "train.max_steps",
                             "train.checkpoint_every_steps", "train.graph_pad_frames", "model.batch_slice",
                             "model.depth", "model.hidden", "model.conv_channels", "data.features.n_mels")),
    *(f"{key}=0" for key in ("optim.warmup_steps", "optim.weight_decay", "train.progress_line_s",
                             "data.augment.masks.freq_mask", "data.augment.masks.time_mask",
                             "data.augment.masks.num_freq_masks", "data.augment.masks.num_time_masks")),
    "data.augment.enabled=true data.augment.masks.num_freq_masks=100 data.augment.masks.num_time_masks=100",
    "model.hidden=1048576", "model.conv_channels=1048576", "model.lookahead=1048576",
    "train.grad_clip_norm=1e-9", "optim.lr=1e-9", "optim.anneal=1e-9", "data.max_duration=1e-9",
    "distributed.timeout_s=1e-9", "optim=sgd optim.momentum=1e-9", "optim=sgd optim.momentum=0.999999"])
def test_a_config_value_at_the_end_of_its_range_is_taken(override):
    check_config(compose_config(["experiment=cpu_demo", *override.split()]))


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


def test_unknown_optimizer_names_the_key():
    cfg = compose_config(["optim.name=adagrad"])
    with pytest.raises(ValueError, match="optim.name"):
        build.optimizer(cfg.optim, [torch.nn.Parameter(torch.zeros(1))])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_optimizers_are_fused_and_step_as_torch_default_does(name, device):
    # Settings other than torch's defaults and the config's: a build that ignored optim.betas, optim.momentum or
    # AdamW's optim.weight_decay passed.
    chosen = ["optim.betas=[0.8,0.99]"] if name == "adamw" else ["optim.momentum=0.8"]
    cfg = compose_config([f"optim={name}", "optim.lr=1e-2", "optim.weight_decay=3e-2", *chosen])
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
        default = torch.optim.SGD(expected, lr=1e-2, momentum=0.8, nesterov=True, weight_decay=3e-2)
    else:
        default = torch.optim.AdamW(expected, lr=1e-2, betas=(0.8, 0.99), weight_decay=3e-2)
    for _ in range(3):
        for parameter, twin in zip(parameters, expected):
            parameter.grad = torch.randn(parameter.shape, generator=generator).to(device)
            twin.grad = parameter.grad.clone()
        fused.step()
        default.step()
    for parameter, twin, before in zip(parameters, expected, initial):
        assert relative_error(parameter.double(), before.double()) > 1e-3  # the steps moved it
        assert relative_error(parameter.double(), twin.double()) <= 1e-6


@pytest.mark.parametrize("amp, device, dtype", [("bf16", "cuda", torch.bfloat16), ("none", "cuda", torch.float32),
                                                ("bf16", "cpu", torch.float32), ("none", "cpu", torch.float32)])
def test_only_train_amp_bf16_on_a_gpu_computes_in_bf16(amp, device, dtype):
    """The README's train.amp: bf16 autocast on a GPU, or none; a CPU always runs fp32. Asked of a device that is
    named, not used, so a CPU checks the GPU's answers too."""
    device = torch.device(device)
    assert build.uses_amp(amp, device) == (dtype == torch.bfloat16)
    assert build.compute_dtype(amp, device) == dtype


@pytest.mark.parametrize("amp", ["bf16", "none"])
def test_a_forward_pass_on_a_cpu_runs_in_fp32_whatever_train_amp_says(amp):
    with build.autocast(amp, torch.device("cpu")):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


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


@pytest.mark.parametrize("optim, need", [("adamw", "11,460.7"), ("sgd", "8,595.5")])
def test_a_mistyped_huge_depth_is_refused_at_once(optim, need):
    """Counting the parameters of the whole stack, built on the meta device, took 4 ms a layer: 400 s here. Each
    parameter holds its fp32 weight and gradient and AdamW's two moments (16 bytes) or SGD's momentum (12): with
    AdamW's counted as SGD's, every test passed. A bidirectional model has no lookahead: naming model.lookahead among
    its sizes passed every test too."""
    cfg = compose_config(["experiment=cpu_demo", f"optim={optim}", "model.depth=100000", "model.hidden=800"])
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"^the model \(model.depth=100000 model.hidden=800 model.cell=gru "
                                         r"model.bidirectional=true model.conv_channels=\d+\) has 769.1B parameters, "
                                         rf"whose weights, gradients and {optim} state need {need} GiB, more than "):
        build.check_model_fits(cfg.model, cfg.optim.name, 40, torch.device("cpu"))
    assert time.monotonic() - started < 30


def test_a_unidirectional_model_too_large_is_refused_naming_its_lookahead():
    """A unidirectional model's lookahead convolution holds weights of its own: its refusal names it."""
    cfg = compose_config(["experiment=cpu_demo", "model.depth=100000", "model.hidden=800", "model.bidirectional=false"])
    with pytest.raises(ValueError, match=rf"model.bidirectional=false model.conv_channels=\d+ "
                                         rf"model.lookahead={cfg.model.lookahead}\) has "):
        build.check_model_fits(cfg.model, cfg.optim.name, 40, torch.device("cpu"))


def test_a_refusal_names_what_a_rank_has_and_what_its_ranks_share(monkeypatch):
    """One rank has the whole device and is told so without a share; four each have a quarter of it."""
    monkeypatch.setattr(build, "device_memory", lambda device: 8 * 2**30)
    cfg = compose_config(["experiment=cpu_demo", "model.depth=100000", "model.hidden=800"])
    with pytest.raises(ValueError, match=r"more than the 8.0 GiB cpu has for it$"):
        build.check_model_fits(cfg.model, cfg.optim.name, 40, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"more than the 2.0 GiB cpu has for it \(8.0 GiB shared by 4 ranks\)$"):
        build.check_model_fits(cfg.model, cfg.optim.name, 40, torch.device("cpu"), ranks_on_device=4)


MEMINFO = "MemTotal:       16000000 kB\nMemFree:          500000 kB\n{available}SwapTotal:       4000000 kB\n" \
          "SwapFree:        1000000 kB\n"


def test_a_cpu_has_its_available_memory_and_free_swap_not_its_total(monkeypatch):
    """What Linux gives before its out-of-memory killer: MemTotal counts memory that other processes hold."""
    meminfo = MEMINFO.format(available="MemAvailable:    3000000 kB\n")
    monkeypatch.setattr(build, "open", lambda path: io.StringIO(meminfo), raising=False)
    assert build.device_memory(torch.device("cpu")) == 1024 * (3000000 + 1000000)


def unreadable(path):
    raise PermissionError(f"[Errno 13] Permission denied: {path!r}")


@pytest.mark.parametrize("opened", [unreadable, lambda path: io.StringIO(MEMINFO.format(available=""))],
                         ids=["unreadable", "without MemAvailable"])
def test_a_cpu_without_a_meminfo_to_read_has_its_physical_memory(monkeypatch, opened):
    """Linux before 3.14 gives no MemAvailable; a sandbox may give no /proc."""
    monkeypatch.setattr(build, "open", opened, raising=False)
    assert build.device_memory(torch.device("cpu")) == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@pytest.mark.parametrize("count, decimals, reads", [
    (1_306_000, 1, "1.3M"), (1_306_000, 2, "1.31M"), (999_940_000, 1, "999.9M"), (10**9, 1, "1.0B"),
    (769_116_600_000, 1, "769.1B"), (1_234_567_000_000, 1, "1,234.6B")])
def test_a_parameter_count_reads_in_millions_or_billions(count, decimals, reads):
    assert build.millions_or_billions(count, decimals) == reads


# Another value for each key a rank may hold apart from the others (RANKS_MAY_DIFFER), as a rank on another node
# started a second later would.
ANOTHER_RANKS_VALUE = {
    "run_name": "run_name=started-a-second-later", "data.an4_source": "data.an4_source=/node2/an4",
    "data.manifest_dir": "data.manifest_dir=/node2/manifests",
    "data.train_manifests": "data.train_manifests=[/node2/train.jsonl]",
    "data.eval_manifest": "data.eval_manifest=/node2/test.jsonl", "train.num_workers": "train.num_workers=0",
    "train.progress_bar": "train.progress_bar=false", "train.progress_line_s": "train.progress_line_s=5",
}


@pytest.mark.parametrize("key", ANOTHER_RANKS_VALUE)
def test_the_settings_ranks_compare_leave_out_what_a_rank_may_hold_apart(key):
    """Only a 2-rank test covered it, and it passed with run_name compared: its ranks' default run_name (the start
    time) fell in the same second. A rank whose run_name, corpus folder or workers differ must still be taken."""
    rank_0 = rank_settings(compose_config(["run_name=first"]))
    assert rank_settings(compose_config(["run_name=first", ANOTHER_RANKS_VALUE[key]])) == rank_0
    another_seed = rank_settings(compose_config(["run_name=first", ANOTHER_RANKS_VALUE[key], "seed=99"]))
    assert {name for name, value in another_seed.items() if value != rank_0[name]} == {"seed"}
