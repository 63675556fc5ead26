"""Resuming: the settings a resume must keep or may change, the checkpoint it continues and whose run that is, the
parts it restores, and the metrics it keeps."""
import json
import math
import os
import re
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import compose_config, within_seconds
from trainer import build, checkpoint
from trainer.config import RESUME_MUST_MATCH, check_config, check_resumable, noting_what_does_nothing_here
from trainer.distributed import DistEnv
from trainer.records import open_metrics, steps_from_the_resume
from trainer.resume import (
    best_to_beat, check_same_training_set, checkpoint_to_resume, continued_run_id, is_own_checkpoint, known_entries,
    load_finite_model, load_optimizer_state, recorded_run_id, restore, resume_into, resumed_train_state,
    run_started_from, settle_best,
)

# A run's train state before its first step, as trainer.train starts it.
FRESH_STATE = {"epoch": 0, "epoch_step": 0, "step": 0, "best_unreadable": math.inf, "best_wer": math.inf,
               "elapsed_s": 0.0}


def test_resuming_needs_the_same_model_features_and_optimizer_but_not_the_same_backend(tmp_path):
    saved = OmegaConf.to_container(compose_config(["model.hidden=64", "optim=adamw"]), resolve=True)
    check_resumable(saved, compose_config(["model.hidden=64", "model.backend=reference", "model.batch_slice=4"]),
                    tmp_path / "last.pt")
    with pytest.raises(ValueError) as error:
        check_resumable(saved, compose_config(["model.hidden=32", "optim=sgd"]), tmp_path / "last.pt")
    assert str(error.value).startswith(f"cannot resume from {tmp_path / 'last.pt'}: it was written by a run with "
                                       "other settings (model.hidden=64 there, 32 here; ")
    assert "; optim.name='adamw' there, 'sgd' here;" in str(error.value)
    # The run's own overrides, which a resume given only run_name and train.resume leaves out, are in jobs.jsonl.
    assert str(error.value).endswith("here); a resume takes its settings from the command line, not the checkpoint: "
                                     "give the overrides its run was started with (its run directory's jobs.jsonl "
                                     "records each job's command)"), error.value
    # The optimizer's state would bring back the checkpoint's rate, while config.yaml said the new one was used.
    with pytest.raises(ValueError, match=r"settings \(optim.lr=0.001 there, 0.5 here\); a resume takes"):
        check_resumable(saved, compose_config(["model.hidden=64", "optim.lr=0.5"]), tmp_path / "last.pt")
    # The lookahead convolution is the unidirectional model's alone.
    check_resumable(saved, compose_config(["model.hidden=64", "model.lookahead=5"]), tmp_path / "last.pt")
    unidirectional = OmegaConf.to_container(compose_config(["model.hidden=64", "model.bidirectional=false"]),
                                            resolve=True)
    with pytest.raises(ValueError, match=r"settings \(model.lookahead=20 there, 5 here\); a resume takes"):
        check_resumable(unidirectional, compose_config(["model.hidden=64", "model.bidirectional=false",
                                                        "model.lookahead=5"]), tmp_path / "last.pt")
    # A bidirectional model's lookahead, unused there, is named where this run's unidirectional one would use it.
    with pytest.raises(ValueError, match=r"settings \(model.bidirectional=true there, false here; model.lookahead=20 "
                                         r"there, 5 here\); a resume takes"):
        check_resumable(saved, compose_config(["model.hidden=64", "model.bidirectional=false", "model.lookahead=5"]),
                        tmp_path / "last.pt")
    # Its sampler position counts global batches of its own size, order and utterances.
    with pytest.raises(ValueError, match="train.global_batch_size=16 there, 32 here; seed=1234 there, 7 here"):
        check_resumable(saved, compose_config(["model.hidden=64", "train.global_batch_size=32", "seed=7"]),
                        tmp_path / "last.pt")
    # Its utterances' paths, where it holds no digest of them (from before 2026-12-02); with one, which
    # check_same_training_set compares, the same corpus in another folder resumes (it was refused for its paths).
    moved = compose_config(["model.hidden=64", "data=manifest", "data.train_manifests=[/elsewhere/an4_train.jsonl]",
                            "data.eval_manifest=manifests/an4_test.jsonl"])
    with pytest.raises(ValueError, match=r"settings \(data.train_manifests=\['manifests/an4_train.jsonl'\] there, "
                                         r"\['/elsewhere/an4_train.jsonl'\] here\); a resume takes"):
        check_resumable(saved, moved, tmp_path / "last.pt")
    assert "data.train_manifests=['manifests/an4_train.jsonl'] there, ['/elsewhere/an4_train.jsonl'] here" in (
        check_resumable(saved, moved, tmp_path / "last.pt", holds_train_set=True))
    # A config of another program's, without the keys the trainer's holds: one line naming them (it was
    # omegaconf's ConfigAttributeError, "Missing key bidirectional", with a traceback).
    del saved["model"]["bidirectional"]
    with pytest.raises(ValueError,
                       match=r"settings \(model.bidirectional=\(not set\) there, true here\); a resume takes"):
        check_resumable(saved, compose_config(["model.hidden=64"]), tmp_path / "last.pt")
    # A group it lacks is named whole, as a key it lacks is.
    without_features = OmegaConf.to_container(compose_config(["model.hidden=64"]), resolve=True)
    del without_features["data"]["features"]
    with pytest.raises(ValueError, match=r"settings \(data.features=\(not set\) there, \{'kind': .*\} here\); a "):
        check_resumable(without_features, compose_config(["model.hidden=64"]), tmp_path / "last.pt")
    # A list where a group belongs: omegaconf's ConfigTypeError ("Index 'bidirectional' (str) is not an int"), with a
    # traceback, where its keys are simply not set.
    with pytest.raises(ValueError, match=r"settings \(model.depth=\(not set\) there, 5 here; .*; train.global_batch_"
                                         r"size=\(not set\) there, 16 here\); a resume takes"):
        check_resumable({**saved, "model": [1, 2], "train": [3]}, compose_config([]), tmp_path / "last.pt")


def test_a_one_layer_run_resumes_with_model_residual_changed_which_changes_nothing_there(tmp_path):
    """The first recurrent layer has no residual connection, so at model.depth=1 either setting is the same model."""
    one_layer = ["model.hidden=64", "model.depth=1"]
    saved = OmegaConf.to_container(compose_config(one_layer), resolve=True)
    assert check_resumable(saved, compose_config([*one_layer, "model.residual=true"]), tmp_path / "last.pt") == [
        "model.residual=false there, true here"]
    two_layers = ["model.hidden=64", "model.depth=2"]
    saved = OmegaConf.to_container(compose_config(two_layers), resolve=True)
    with pytest.raises(ValueError, match=r"settings \(model.residual=false there, true here\); a resume takes"):
        check_resumable(saved, compose_config([*two_layers, "model.residual=true"]), tmp_path / "last.pt")
    # From one layer to two, both refused.
    with pytest.raises(ValueError, match=r"settings \(model.depth=1 there, 2 here; model.residual=false there, true "
                                         r"here\); a resume takes"):
        check_resumable(OmegaConf.to_container(compose_config(one_layer), resolve=True),
                        compose_config([*two_layers, "model.residual=true"]), tmp_path / "last.pt")


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
    with pytest.raises(ValueError, match=rf"other settings \({re.escape(override.split('=')[0])}=.* there, .* "
                                         r"here\); a resume takes"):
        check_resumable(saved, compose_config([*base, override]), tmp_path / "last.pt")


def test_a_resume_names_the_settings_it_changes(tmp_path):
    saved = OmegaConf.to_container(compose_config(["model.hidden=64", "train.resume=null"]), resolve=True)
    # Nothing changed but the resume itself.
    assert check_resumable(saved, compose_config(["model.hidden=64", "train.resume=auto"]), tmp_path / "last.pt") == []
    # They were taken without a word (trainer.resume logs these), and config.yaml, written anew, holds only this job's.
    changed = check_resumable(saved, compose_config(["model.hidden=64", "train.resume=auto", "train.grad_clip_norm=5",
                                                     "data.augment.enabled=false", "train.max_steps=9"]),
                              tmp_path / "last.pt")
    assert changed == ["data.augment.enabled=true there, false here", "train.grad_clip_norm=400.0 there, 5 here",
                       "train.max_steps=null there, 9 here"]
    # A setting of the checkpoint's that this trainer no longer has is named too.
    assert check_resumable({**saved, "retired_setting": 3}, compose_config(["model.hidden=64"]),
                           tmp_path / "last.pt") == ["retired_setting=3 there, (not set) here"]


def test_a_refused_resume_names_each_value_as_an_override_gives_it_back(tmp_path):
    """The values a refusal names are the ones to resume with: it said None, which given back (data.max_duration=None)
    is Hydra's string 'None', refused by the config rules, where null was meant."""
    saved = OmegaConf.to_container(compose_config(["data.max_duration=null"]), resolve=True)
    with pytest.raises(ValueError,
                       match=r"settings \((data.max_duration=\S+) there, 20.0 here\); a resume takes") as error:
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
    # Resumed, a NaN moment turned every weight to NaN at the first step.
    not_finite = {0: {**saved["state"][0], "exp_avg_sq": torch.full((2, 3), math.nan)}}
    with pytest.raises(ValueError, match=r"^its state 'exp_avg_sq' of parameter 0 holds values that are not finite$"):
        checkpoint.check_optimizer_state({**saved, "state": {**saved["state"], **not_finite}}, optimizer)
    # The resume's own path checks too: torch's load_state_dict takes a float64 state, casting it.
    with pytest.raises(ValueError, match=r"its state 'exp_avg' of parameter 0 is a torch.float64 tensor"):
        load_optimizer_state(optimizer, edited)
    # State of a parameter the optimizer has none of: without its check, an AttributeError on None's shape.
    with pytest.raises(ValueError, match=r"its state 'exp_avg' of parameter 7 is a torch.float32 tensor of shape "
                                         r"\(2, 3\), not its parameter's \(none\)"):
        checkpoint.check_optimizer_state({**saved, "state": {**saved["state"], 7: saved["state"][0]}}, optimizer)
    with pytest.raises(ValueError, match="its state of parameter 0 is an int, not a mapping"):
        checkpoint.check_optimizer_state({**saved, "state": {0: 5}}, optimizer)
    with pytest.raises(ValueError, match="its state is a list, not a mapping of parameters to their state"):
        checkpoint.check_optimizer_state({**saved, "state": list(saved["state"].values())}, optimizer)
    # Adam's count of updates: a negative one turned every weight to NaN at the first step, which the run then called
    # diverged; a vector ended the first step in a traceback.
    # Infinity and True passed for counts where the finite and bool checks were left out, and every test passed.
    for step, described in ((torch.tensor(-1.0), "-1.0"), (torch.tensor(math.nan), "nan"), (-2, "-2"),
                            (torch.tensor(math.inf), "inf"), (True, "a bool"),
                            (torch.ones(2), r"a torch.float32 tensor of shape \(2,\)"), ("3", "a str"),
                            (10**400, f"{10**400}")):  # past a float's range: it ended in an OverflowError
        edited = {**saved, "state": {**saved["state"], 1: {**saved["state"][1], "step": step}}}
        with pytest.raises(ValueError, match=rf"^its state 'step' of parameter 1 is {described}, not a count of up"):
            checkpoint.check_optimizer_state(edited, optimizer)
    # As torch writes it, and as older versions did; 0 as a fused step skipped for its non-finite gradient leaves it.
    for step in (torch.tensor(3.0), 3, 3.0, torch.tensor(0.0)):
        checkpoint.check_optimizer_state({**saved, "state": {**saved["state"], 1: {**saved["state"][1], "step": step}}},
                                         optimizer)
    # A rate, beta or decay that is not a finite number from 0 up turned every weight to NaN at the first step (or
    # trained up the gradient), and the run was then said to have diverged, as if a lower optim.lr could help.
    # Betas of 3, a float's place in them, ended that step in a traceback.
    for name, value in (("lr", math.nan), ("betas", (math.nan, 0.999)), ("weight_decay", math.inf), ("lr", -1.0),
                        ("betas", 3), ("betas", (0.9, "0.999")), ("amsgrad", None)):
        edited = {**saved, "param_groups": [{**saved["param_groups"][0], name: value}]}
        with pytest.raises(ValueError, match=rf"^its param_groups' {name} is {re.escape(repr(value))}, not of the "
                                             rf"form of this run's {re.escape(repr(optimizer.param_groups[0][name]))} "
                                             r"\(finite numbers from 0 up\)$"):
            load_optimizer_state(optimizer, edited)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    current = schedule.state_dict()
    assert known_entries({**current, "optimizer": 1}, current) == current
    with pytest.raises(ValueError, match="its last_epoch is a float, not an int"):
        known_entries({**current, "last_epoch": 0.5}, current)
    for base_lrs in ([math.nan], ["x"], [-1.0], [0.1, 0.1]):
        with pytest.raises(ValueError, match=rf"^its base_lrs is {re.escape(repr(base_lrs))}, not of the form of this "
                                             r"run's \[0.001\] \(finite numbers from 0 up\)$"):
            known_entries({**current, "base_lrs": base_lrs}, current)


def test_a_resumed_optimizer_state_as_torch_writes_it_is_taken():
    """What the checks of an optimizer's state must let through: moments as large as float32 holds (their 2-norm
    overflows, their largest value does not), an empty parameter's (whose largest value torch refuses to find), and an
    entry that is no tensor (older torch's SGD saved momentum_buffer=None without momentum)."""
    network = torch.nn.Linear(3, 2)
    network.empty = torch.nn.Parameter(torch.empty(0))
    optimizer = torch.optim.AdamW(network.parameters(), fused=True)
    network(torch.randn(4, 3)).sum().backward()
    network.empty.grad = torch.empty(0)
    optimizer.step()
    saved = optimizer.state_dict()
    largest = torch.full((2, 3), torch.finfo(torch.float32).max)
    checkpoint.check_optimizer_state({**saved, "state": {**saved["state"], 0: {**saved["state"][0],
                                                                              "exp_avg_sq": largest}}}, optimizer)
    checkpoint.check_optimizer_state({**saved, "state": {**saved["state"], 0: {**saved["state"][0],
                                                                              "momentum_buffer": None}}}, optimizer)


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
    model = torch.nn.Linear(2, 3)
    loaders = {"model": lambda saved_model: load_finite_model(model, saved_model),
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
        # Resumed, a model edited to hold NaN skipped every step of its epoch, then was refused for want of a lower lr.
        ("model", {**good["model"], "bias": torch.tensor([0.0, math.nan, 0.0])},
         r"its weights hold values that are not finite, in bias\)$"),
        ("train_state", {"epoch": 2, "step": "9"},
         "no number from 0 up, or no count where one belongs, for step='9', best_wer=None"),
        ("train_state", {"epoch": 2.0, "step": -1, "best_wer": 1},
         "no count where one belongs, for epoch=2.0, step=-1"),
        # A hand-edited NaN best_wer: no WER beats it, so best.pt stayed as it was for the rest of the run.
        ("train_state", {"epoch": 2, "step": 9, "best_wer": math.nan}, r"for best_wer=nan\)$"),
        ("train_state", {"epoch": 2, "step": 9, "best_wer": -1.0}, r"for best_wer=-1.0\)$"),
        ("train_state", {"epoch": 2, "step": 9, "best_wer": 50.0, "elapsed_s": math.inf}, r"for elapsed_s=inf\)$"),
        ("train_state", {"epoch": 2, "step": 9, "best_wer": 50.0, "elapsed_s": math.nan}, r"for elapsed_s=nan\)$"),
        # Past a float's range: a traceback of OverflowError, where every other odd value is one line.
        ("train_state", {"epoch": 2, "step": 9, "best_wer": 10**400}, rf"for best_wer={10**400}\)$"),
        ("train_state", {"epoch": 2, "step": 9, "best_wer": torch.zeros(2)}, r"for best_wer=tensor\(\[0., 0.\]\)\)$"),
        # Past TensorBoard's int64 steps: the first step's record failed in "Value out of range: 2**63 + 1" alone.
        ("train_state", {"epoch": 2, "step": 2**63, "best_wer": 50.0}, rf"for step={2**63}\)$"),
        ("train_state", {"epoch": 2, "step": 2**63 - 1, "best_wer": 50.0}, rf"for step={2**63 - 1}\)$"),  # its next
        ("rng", [], "list index out of range"),
        # Python's generator refuses a word past its range in an OverflowError, which ended the resume in a traceback.
        ("rng", [{**good["rng"][0], "python": (3, (1,) * 624 + (10**30,), None)}], "too large to convert to C long"),
    ]
    for part, value, reason in cases:
        with pytest.raises(ValueError, match=rf"cannot resume from {re.escape(str(path))}: its {part} does not fit "
                                             rf"this run \(.*{reason}") as error:
            restore(path, {**good, part: value}, loaders)
        assert "\n" not in str(error.value)


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


def test_metrics_of_a_resumed_run_may_hold_lines_that_are_not_utf8(tmp_path):
    """A note added by hand in Latin-1 ended the resume, after its jobs.jsonl line, in "'utf-8' codec can't decode
    byte 0xe9", naming no file: such a line is no line of the trainer's (its lines are ASCII), so it goes as others
    do. In jobs.jsonl, it left the whole file unread: the run had no id, and a copy of its own checkpoint was refused
    as another run's."""
    path = tmp_path / "metrics.jsonl"
    steps = [json.dumps({"step": step, "epoch": 1, "loss": 1.0}).encode() + b"\n" for step in (1, 2, 3)]
    path.write_bytes(steps[0] + b"lr lowered, caf\xe9\n" + b'{"note": "caf\xe9"}\n' + steps[1] + steps[2])
    with open_metrics(path, {"epoch": 0, "step": 2}):
        pass
    assert path.read_bytes() == steps[0] + steps[1]
    (tmp_path / "jobs.jsonl").write_bytes(json.dumps({"run_id": "a", "from_step": 0}).encode() + b"\nlr lowered, "
                                          b"caf\xe9\n")
    assert recorded_run_id(tmp_path) == "a"


def test_a_resumed_runs_records_keep_their_lines_around_one_python_does_not_read(tmp_path):
    """A line nested past Python's recursion limit, or an integer of more than 4300 digits, in a run directory's
    metrics.jsonl or jobs.jsonl ended the resume in a RecursionError or ValueError traceback: it is no line of the
    trainer's."""
    unread = "[" * 100_000 + "\n" + "1" * 5000 + "\n"
    steps = [json.dumps({"step": step, "epoch": 1, "loss": 1.0}) + "\n" for step in (1, 2, 3)]
    path = tmp_path / "metrics.jsonl"
    path.write_text(steps[0] + unread + steps[1] + steps[2])
    with open_metrics(path, {"epoch": 0, "step": 2}):
        pass
    assert path.read_text() == steps[0] + steps[1]
    (tmp_path / "jobs.jsonl").write_text(json.dumps({"run_id": "a", "from_step": 0}) + "\n" + unread)
    assert recorded_run_id(tmp_path) == "a"


@pytest.mark.parametrize("note", ['"lr lowered by hand"', "[]", "null"])
def test_the_run_id_is_the_last_jobs_past_a_line_of_json_that_is_no_job(note, tmp_path):
    """A line added by hand after the last job's, JSON but no object, read as the last job's, gave the run no id: a
    copy of its own checkpoint was then refused as another run's over its checkpoints."""
    (tmp_path / "jobs.jsonl").write_text(json.dumps({"run_id": "a", "from_step": 0}) + "\n" + note + "\n")
    assert recorded_run_id(tmp_path) == "a"


def test_a_resumed_runs_records_that_are_no_files_are_not_read(tmp_path, caplog):
    """A run directory copied from elsewhere (tar keeps pipes and links) may hold a pipe, or a link to a device or a
    pipe, in place of metrics.jsonl or jobs.jsonl: read whole as a resume read them, a link to /dev/zero took all the
    memory and a pipe waited for a writer for ever. Neither holds a record of the run."""
    metrics, run_dir = tmp_path / "metrics.jsonl", tmp_path / "run"
    os.mkfifo(metrics)
    run_dir.mkdir()
    os.mkfifo(tmp_path / "pipe")
    (run_dir / "jobs.jsonl").symlink_to(tmp_path / "pipe")  # which the run directory's check refuses before this
    with within_seconds(10):
        with open_metrics(metrics, {"epoch": 0, "step": 2}) as file:
            file.write(json.dumps({"step": 3, "epoch": 1, "loss": 1.0}) + "\n")
        assert recorded_run_id(run_dir) is None
    assert metrics.is_file() and metrics.read_text() == json.dumps({"step": 3, "epoch": 1, "loss": 1.0}) + "\n"
    assert f"{metrics} is not a file (a pipe, a device): it holds none of the run's lines; a file replaces it" in (
        caplog.text)


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
                                         r"continue it with train.resume=PATH, or give this run another run_name "
                                         r"\(RUN_NAME in the launch scripts\)$"):
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
    # A last.pt linked to a disk not mounted: auto passed it over for best.pt, an older checkpoint, said to be "written
    # at the same step", and the run's records since were dropped. Refused, naming the link, as train.resume=PATH is.
    last = run_dir / "checkpoints" / "last.pt"
    last.unlink()
    last.symlink_to(tmp_path / "unmounted" / "last.pt")
    for resume in ("auto", str(last)):
        with pytest.raises(FileNotFoundError, match=rf"^checkpoint {re.escape(str(last))} is a symbolic link to "
                                                    rf"{re.escape(str(tmp_path / 'unmounted' / 'last.pt'))}, which "
                                                    "does not exist"):
            checkpoint_to_resume(resume, run_dir)


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
                                             r"give this run another run_name \(RUN_NAME in the launch scripts\)$"):
            continued_run_id(saved, outside, run_dir)
    # A run from before run ids, whose jobs.jsonl records none: a checkpoint that holds none is no more known as its
    # own (the two missing ids are no match).
    (run_dir / "jobs.jsonl").write_text(json.dumps({"from_step": 0}) + "\n")
    with pytest.raises(ValueError, match="is not one of its checkpoints"):
        continued_run_id({}, outside, run_dir)


def test_the_evaluation_to_beat_is_the_one_best_pt_records_not_the_resumed_checkpoints(tmp_path, caplog):
    """A resume from an earlier checkpoint or a copy took its figures (or none): an epoch worse than best.pt's
    replaced it."""
    run_dir, earlier = tmp_path / "run", tmp_path / "copy.pt"
    state = dict(FRESH_STATE)

    def saved(step, best_wer, test_set="A"):
        return {**{part: {} for part in checkpoint.TRAINING_PARTS}, "test_set": test_set,
                "train_state": {**state, "epoch": step // 2, "step": step, "best_unreadable": 0, "best_wer": best_wer}}

    none = {"best_unreadable": math.inf, "best_wer": math.inf}
    earlier.write_bytes(b"")  # what it holds is `saved`'s
    assert best_to_beat(run_dir, earlier, saved(2, 80.0), state, "A") == (none, None, False)  # no best.pt: its own run
    best = run_dir / "checkpoints" / "best.pt"
    checkpoint.save(best, saved(8, 30.0))
    assert best_to_beat(run_dir, earlier, saved(2, 80.0), state, "A") == ({"best_unreadable": 0, "best_wer": 30.0},
                                                                          None, False)
    with caplog.at_level("INFO", logger="trainer.resume"):
        assert best_to_beat(run_dir, earlier, saved(2, 80.0), state, "B") == (none, best.with_name("best-A.pt"), False)
    assert (f"the test set is not the one {best} was evaluated on (A there, B here), and WERs over other test sets do "
            "not compare: the first evaluation here replaces best.pt") in caplog.text
    # Back on B, where B's best.pt was kept: its evaluation is the one to beat.
    checkpoint.save(best.with_name("best-B.pt"), saved(6, 40.0, test_set="B"))
    assert best_to_beat(run_dir, earlier, saved(2, 80.0), state, "B") == ({"best_unreadable": 0, "best_wer": 40.0},
                                                                          best.with_name("best-A.pt"), True)
    # Edited: "../A" would name a file in another folder, "Ä" one no fingerprint's hex digest names.
    for edited in ("../A", "8 utterances, sha256 \u00c41"):
        checkpoint.save(best, saved(8, 30.0, test_set=edited))
        with pytest.raises(ValueError, match=rf"^cannot resume from {re.escape(str(best))}: its test_set "
                                             rf"{re.escape(repr(edited))} is no test set's fingerprint \(the run's "
                                             r"best.pt, whose evaluation"):
            best_to_beat(run_dir, earlier, saved(2, 80.0), state, "B")
    checkpoint.save(best, saved(8, 30.0))
    best.write_bytes(b"damaged")
    with pytest.raises(ValueError, match=rf"^cannot load checkpoint {re.escape(str(best))}: .* \(the run's best.pt, "
                                         r"whose evaluation a resumed run must beat to replace it: move it away to "
                                         r"resume without it\)$"):
        best_to_beat(run_dir, earlier, saved(2, 80.0), state, "A")
    # Linked to a disk not mounted: taken for no best.pt, it was replaced by the first evaluation, however worse.
    best.unlink()
    best.symlink_to(tmp_path / "unmounted" / "best.pt")
    with pytest.raises(ValueError, match=rf"^checkpoint {re.escape(str(best))} is a symbolic link to .*unmounted/"
                                         r"best.pt, which does not exist \(the run's best.pt, whose evaluation a "
                                         r"resumed run must beat"):
        best_to_beat(run_dir, earlier, saved(2, 80.0), state, "A")


def test_without_best_pt_the_one_kept_for_this_test_set_is_the_one_to_beat_and_best_pt_again(tmp_path, caplog):
    """best.pt deleted by hand while the run was on another test set, whose best.pt it was: none was to beat back on
    this one, so its first evaluation, however worse, became best.pt, and the next resume removed the kept best-A.pt
    as an alias of it, losing the best model on this test set."""
    run_dir, resumed = tmp_path / "run", tmp_path / "last.pt"
    state = dict(FRESH_STATE)
    kept = {**{part: {} for part in checkpoint.TRAINING_PARTS}, "test_set": "8 utterances, sha256 A",
            "train_state": {**state, "epoch": 1, "step": 2, "best_unreadable": 0, "best_wer": 10.0}}
    later = {**kept, "test_set": "8 utterances, sha256 B", "train_state": {**kept["train_state"], "step": 4}}
    resumed.write_bytes(b"")  # what it holds is `later`'s
    best = run_dir / "checkpoints" / "best.pt"
    checkpoint.save(best.with_name("best-A.pt"), kept)
    with caplog.at_level("INFO", logger="trainer.resume"):
        found = best_to_beat(run_dir, resumed, later, state, "8 utterances, sha256 A")
        assert found == ({"best_unreadable": 0, "best_wer": 10.0}, None, True)
        settle_best(run_dir, found, "8 utterances, sha256 A")
    assert f"no {best}: the evaluation to beat is that of best-A.pt, the best on this test set" in caplog.text
    assert f"{best.with_name('best-A.pt')}, the best on this test set, is {best} again" in caplog.text
    assert sorted(path.name for path in best.parent.iterdir()) == ["best.pt"]
    assert torch.load(best, weights_only=True)["train_state"]["best_wer"] == 10.0


def test_a_kept_best_that_scores_better_than_best_pt_on_its_test_set_is_best_pt_again(tmp_path, caplog):
    """A run directory left by the resume before 37d5cee: best.pt deleted by hand on another test set, the first
    evaluation back on this one, however worse, became best.pt beside the better best-A.pt kept for it. The next resume
    took best.pt's evaluation as the one to beat and removed best-A.pt as an alias of it, losing the best model."""
    run_dir, resumed = tmp_path / "run", tmp_path / "last.pt"
    state = dict(FRESH_STATE)

    def best_on_a(step, best_unreadable, best_wer):
        return {**{part: {} for part in checkpoint.TRAINING_PARTS}, "test_set": "8 utterances, sha256 A",
                "train_state": {**state, "epoch": step // 2, "step": step, "best_unreadable": best_unreadable,
                                "best_wer": best_wer}}

    resumed.write_bytes(b"")  # what it holds is best_on_a(8, ...)'s
    best = run_dir / "checkpoints" / "best.pt"
    for kept, worse in ((best_on_a(2, 0, 10.0), best_on_a(6, 0, 50.0)),  # a lower WER
                        (best_on_a(2, 1, 90.0), best_on_a(6, 2, 20.0))):  # more of the test set decoded
        checkpoint.save(best.with_name("best-A.pt"), kept)
        checkpoint.save(best, worse)
        caplog.clear()
        with caplog.at_level("INFO", logger="trainer.resume"):
            found = best_to_beat(run_dir, resumed, best_on_a(8, 0, 50.0), state, "8 utterances, sha256 A")
            assert found.figures == {key: kept["train_state"][key] for key in ("best_unreadable", "best_wer")}
            settle_best(run_dir, found, "8 utterances, sha256 A")
        assert (f"{best.with_name('best-A.pt')} scores better on this test set than {best} ") in caplog.text
        assert f"{best.with_name('best-A.pt')}, the best on this test set, is {best} again" in caplog.text
        assert sorted(path.name for path in best.parent.iterdir()) == ["best.pt"]
        assert torch.load(best, weights_only=True)["train_state"]["step"] == 2
    # The other way round, best-A.pt worse or as good (most often the model best.pt was kept as, which a tie replaced
    # with the kept copy, said to score better): best.pt stays the best and the stale name goes, as before.
    for kept in (best_on_a(6, 0, 50.0), best_on_a(6, 0, 10.0)):
        checkpoint.save(best, best_on_a(2, 0, 10.0))
        checkpoint.save(best.with_name("best-A.pt"), kept)
        found = best_to_beat(run_dir, resumed, best_on_a(8, 0, 50.0), state, "8 utterances, sha256 A")
        assert found == ({"best_unreadable": 0, "best_wer": 10.0}, None, False)
        settle_best(run_dir, found, "8 utterances, sha256 A")
        assert sorted(path.name for path in best.parent.iterdir()) == ["best.pt"]
        assert torch.load(best, weights_only=True)["train_state"]["step"] == 2


def test_a_best_pt_that_records_no_test_set_is_kept_aside_rather_than_beaten_on_this_one(tmp_path, caplog):
    """One from before checkpoints recorded their test set was taken as this test set's: its WER, perhaps over another
    set, was the one to beat, so an evaluation here might never replace it, and the best model here was lost."""
    run_dir, resumed = tmp_path / "run", tmp_path / "last.pt"
    state = dict(FRESH_STATE)
    old_best = {**{part: {} for part in checkpoint.TRAINING_PARTS},
                "train_state": {**state, "epoch": 4, "step": 8, "best_unreadable": 0, "best_wer": 5.0}}
    resumed.write_bytes(b"")  # what it holds is old_best's
    best = run_dir / "checkpoints" / "best.pt"
    checkpoint.save(best, old_best)
    with caplog.at_level("INFO", logger="trainer.resume"):
        found = best_to_beat(run_dir, resumed, old_best, state, "8 utterances, sha256 A")
        none = {"best_unreadable": math.inf, "best_wer": math.inf}
        assert found == (none, best.with_name("best-unknown-test-set.pt"), False)
        settle_best(run_dir, found, "8 utterances, sha256 A")
    assert (f"{best} records no test set (written before checkpoints recorded theirs, 2026-12-02), and WERs over other "
            "test sets do not compare: the first evaluation here replaces best.pt") in caplog.text
    assert f"{best}, the best on its test set, kept as {found.kept_as}" in caplog.text
    assert torch.load(found.kept_as, weights_only=True)["train_state"]["best_wer"] == 5.0
    with caplog.at_level("INFO", logger="trainer.resume"):  # a job killed once it kept best.pt, resumed again
        assert best_to_beat(run_dir, resumed, old_best, state, "8 utterances, sha256 A") == found
    checkpoint.save(found.kept_as, old_best)  # a copy, where the file system has no hard links
    assert best_to_beat(run_dir, resumed, old_best, state, "8 utterances, sha256 A") == found


def test_a_second_best_pt_that_records_no_test_set_is_refused_rather_than_kept_over_the_first(tmp_path):
    """best-unknown-test-set.pt was replaced by the next best.pt without a test set (one put back by hand), silently:
    the first was lost."""
    run_dir, resumed = tmp_path / "run", tmp_path / "last.pt"
    state = dict(FRESH_STATE)

    def old_best(step):
        return {**{part: {} for part in checkpoint.TRAINING_PARTS},
                "train_state": {**state, "epoch": step // 2, "step": step, "best_unreadable": 0, "best_wer": 5.0}}

    resumed.write_bytes(b"")  # what it holds is old_best(20)'s
    best = run_dir / "checkpoints" / "best.pt"
    checkpoint.save(best.with_name("best-unknown-test-set.pt"), old_best(8))
    checkpoint.save(best, old_best(20))
    # Of one size and time, as two files written within a clock tick: only their bytes tell them apart.
    os.utime(best.with_name("best-unknown-test-set.pt"), ns=(best.stat().st_mtime_ns, best.stat().st_mtime_ns))
    with pytest.raises(ValueError, match=rf"^cannot resume: {re.escape(str(best))} is to be kept as "
                                         r"best-unknown-test-set.pt, which already holds another checkpoint that "
                                         r"keeping it would overwrite: move one of them away$"):
        best_to_beat(run_dir, resumed, old_best(20), state, "8 utterances, sha256 A")
    assert torch.load(best.with_name("best-unknown-test-set.pt"), weights_only=True)["train_state"]["step"] == 8


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
    # A run started afresh records no start either: one from before run ids is no start of it, though neither names one.
    assert run_started_from(start, saved(None, 3), run_dir) is None


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
    # How to continue that run instead, as a launch-script user sets its name too.
    assert (f"{new_run} {tmp_path / 'fresh'}, its metrics.jsonl from the checkpoint's next step on and its best.pt "
            "from its own evaluations (train.resume=auto under that run's run_name (RUN_NAME in the launch scripts) "
            "continues it in its own directory)\n") in caplog.text


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


def test_a_resume_goes_on_with_its_runs_records_and_start_where_the_checkpoint_is_the_runs_own(tmp_path, caplog):
    """Where a job takes its run up decides whether metrics.jsonl and jobs.jsonl go on and which start the run's
    checkpoints record. Only slow end-to-end tests checked it, and no test failed where a run's own last.pt from before
    run ids started its records afresh (its metrics.jsonl emptied), or where a run started from another run's
    checkpoint recorded its own last step as its start (the same command run again, as a requeued job runs it, was then
    refused)."""
    cfg = compose_config(["experiment=cpu_demo"])
    env = DistEnv(rank=0, world_size=1, device=torch.device("cpu"))

    def saved(path, **record):
        checkpoint.save(path, {"model": {}, "optimizer": {}, "scheduler": {}, "sampler": {"epoch": 0, "position": 3},
                               "config": OmegaConf.to_container(cfg, resolve=True),
                               "train_state": {**FRESH_STATE, "epoch_step": 3, "step": 3},
                               "rng": [checkpoint.rng_state(env.device)], **record})
        return path

    def start(path, run_dir, config=cfg, state=None):
        return resume_into(path, dict(FRESH_STATE) if state is None else state, config, run_dir, env, "train set",
                           "test set", {})

    own = tmp_path / "run" / "checkpoints" / "last.pt"
    before_run_ids = start(saved(own), own.parent.parent)
    assert (before_run_ids.run_id, before_run_ids.continues, before_run_ids.started_from) == (None, True, None)
    parent = {"run_id": "parent", "step": 3}
    fine_tuned = start(saved(own, run_id="ft", started_from=parent), own.parent.parent)
    assert (fine_tuned.run_id, fine_tuned.continues, fine_tuned.started_from) == ("ft", True, parent)
    other = start(saved(tmp_path / "parent.pt", run_id="parent"), tmp_path / "new")
    assert (other.run_id, other.continues, other.started_from) == (None, False, parent)
    # The same command run again, once that run wrote its own checkpoints: it continues from them (run_started_from).
    new_last = saved(tmp_path / "new" / "checkpoints" / "last.pt", run_id="new", started_from=parent)
    again = start(tmp_path / "parent.pt", tmp_path / "new")
    assert (again.checkpoint, again.run_id, again.continues, again.started_from) == (new_last, "new", True, parent)
    # A run id the trainer never writes, in an edited file: a tensor ended the job in a traceback as it took the run
    # up, a list went on into jobs.jsonl and the run's next checkpoints.
    for run_id, kind in ((torch.zeros(2), "a Tensor"), ([1], "a list"), (OrderedDict(), "an OrderedDict")):
        with pytest.raises(ValueError, match=rf"^{re.escape(str(own))} is not a checkpoint written by python -m "
                                             rf"trainer: its run_id is {kind}, not a run's id \(a string\)$"):
            start(saved(own, run_id=run_id), own.parent.parent)
    # A sampler elsewhere in its epochs than its training state, as the trainer never saves them: the epoch's batches
    # before it were trained again (or those after it skipped) as the step count went on from the training state's.
    with pytest.raises(ValueError, match=rf"^cannot resume from {re.escape(str(own))}: its sampler \(epoch 0, position "
                                         r"0\) is not where its train_state stands \(epoch 0, epoch_step 3\)$"):
        start(saved(own, sampler={"epoch": 0, "position": 0}), own.parent.parent)
    # The manifests changed since: its sampler position names batches of another training set.
    with pytest.raises(ValueError, match=r"it was written for another training set \(another train set; train set"):
        start(saved(own, train_set="another train set"), own.parent.parent)
    # Refused by restore, not ended in a traceback by what the run's start records of it.
    with pytest.raises(ValueError, match=r"its train_state does not fit this run"):
        start(saved(own, run_id="ft", train_state=[3]), own.parent.parent)
    # The corpus moved to another folder: its digest, where the checkpoint holds one, says whether it is the same; the
    # manifests' paths must match where it holds none.
    moved = compose_config(["experiment=cpu_demo", "data.train_manifests=[/elsewhere/an4_train.jsonl]"])
    with caplog.at_level("INFO", logger="trainer.resume"):
        start(saved(own, train_set="train set"), own.parent.parent, moved)
    assert (f"settings other than those {own} was written under, taken from here on: data.train_manifests="
            "['manifests/an4_train.jsonl'] there, ['/elsewhere/an4_train.jsonl'] here") in caplog.text
    with pytest.raises(ValueError, match=r"other settings \(data.train_manifests=\['manifests/an4_train.jsonl'\] "):
        start(saved(own), own.parent.parent, moved)
    # The evaluation to beat is best.pt's (best_to_beat), not that of the checkpoint resumed from, which has none.
    best_state = {**FRESH_STATE, "epoch_step": 3, "step": 3, "best_unreadable": 1, "best_wer": 20.0}
    saved(own.with_name("best.pt"), train_state=best_state, test_set="test set")
    state = dict(FRESH_STATE)
    start(saved(own), own.parent.parent, state=state)
    assert (state["best_unreadable"], state["best_wer"]) == (1, 20.0)


def test_each_rank_resumes_its_own_rng_stream_and_a_rank_past_those_that_saved_one_the_last_ones(tmp_path):
    """The checkpoint holds one RNG state per rank that wrote it. Only a two-rank MPI test held it, and no test that
    runs without mpiexec failed where every rank resumed rank 0's stream."""
    cfg = compose_config(["experiment=cpu_demo"])
    streams = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        streams.append(checkpoint.rng_state(torch.device("cpu")))
    path = tmp_path / "run" / "checkpoints" / "last.pt"
    checkpoint.save(path, {"model": {}, "optimizer": {}, "scheduler": {}, "sampler": {"epoch": 0, "position": 3},
                           "config": OmegaConf.to_container(cfg, resolve=True),
                           "train_state": {**FRESH_STATE, "epoch_step": 3, "step": 3}, "rng": streams})
    before = checkpoint.rng_state(torch.device("cpu"))
    try:
        for rank, world_size, stream in ((1, 2, 1), (2, 3, 1), (0, 2, 0)):
            env = DistEnv(rank=rank, world_size=world_size, device=torch.device("cpu"))
            resume_into(path, dict(FRESH_STATE), cfg, path.parent.parent, env, "train set", "test set", {})
            resumed = torch.rand(4)
            torch.set_rng_state(streams[stream]["torch"])
            assert torch.equal(resumed, torch.rand(4)), (rank, world_size)
    finally:
        checkpoint.set_rng_state(before, torch.device("cpu"))
