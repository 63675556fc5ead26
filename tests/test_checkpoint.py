"""Checkpoints: written whole or not at all, their random states, read safely and refused in one line naming what
is wrong, and models rebuilt from them."""
import errno
import json
import math
import os
import pickle
import random
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import (REPO_ROOT, compose_config, error_without_root_privilege, small_checkpoint,
                      without_root_privilege)
from data import files
from prnn_kernels import relative_error
from trainer import build, checkpoint
from trainer.config import MAX_TRAIN_MANIFESTS, SET_MANIFESTS, check_config, check_resumable
from trainer.resume import checkpoint_to_resume


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
    assert last.samefile(best)  # one file, not a copy of the large one: the 100-layer model's checkpoint is gigabytes
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
    with torch.no_grad():
        model["b"].weight[0, 0] = math.nan
    assert build.entries_not_finite(model) == "a.bias, b.weight, c.weight and 1 more"


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
    checkpoint.set_rng_state({**state, "cuda": every_gpu[:2]}, torch.device("cuda", 3))  # GPU 0's, not the last one's
    checkpoint.set_rng_state(state, torch.device("cpu"))  # a GPU run's checkpoint resumed on a CPU sets no GPU's
    assert calls == [("get", second), ("set", [1, 1], first), ("set", [1, 1], second), ("set", [0, 0], second),
                     ("set", [0, 0], torch.device("cuda", 3))]
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


def test_a_checkpoint_the_disk_has_no_space_for_is_one_line_giving_the_space_left(tmp_path, monkeypatch):
    """A full disk's or a quota's error: the line gave 'OSError: [Errno 28] No space left on device: 'PATH'', the file
    twice. The system's words, and the space left, which they do not say (a folder's refusal is its words alone)."""
    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.os, "replace", full)
    path = tmp_path / "c.pt"
    with pytest.raises(checkpoint.CheckpointWriteError) as error:
        checkpoint.save(path, {"model": {"w": torch.ones(3)}, "config": {}})
    assert re.fullmatch(rf"cannot write checkpoint {re.escape(str(path))} \(No space left on device; [\d.]+ MiB free "
                        r"on its file system(, and this process may write files of at most [\d,]+ bytes \(ulimit -f\))?"
                        r"\); c.pt there, if any, is as it was", str(error.value)), error.value


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


def test_a_checkpoint_folder_made_read_only_after_a_save_is_one_error_with_the_system_s_reason(tmp_path):
    """checkpoints/ made read-only as the run goes on: the line gave '(PermissionError: [Errno 13] Permission denied:
    'PATH'; 72823.4 MiB free on its file system)', the file twice and a space left that is not the cause."""
    path = tmp_path / "last.pt"
    checkpoint.save(path, {"model": {"w": torch.zeros(3)}, "config": {}})
    tmp_path.chmod(0o555)
    script = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from trainer import checkpoint\n"
        "try:\n"
        f"    checkpoint.save(Path({str(path)!r}), {{'model': {{'w': torch.ones(3)}}, 'config': {{}}}})\n"
        "except ValueError as error:\n"  # what the trainer reports in one line, exit code 2
        "    sys.exit(str(error))\n"
    )
    result = subprocess.run(without_root_privilege([sys.executable, "-c", script]), cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    tmp_path.chmod(0o755)
    assert result.returncode == 1, result.stderr
    assert result.stderr == f"cannot write checkpoint {path} (Permission denied); last.pt there, if any, is as it was\n"
    assert torch.equal(checkpoint.load(path)["model"]["w"], torch.zeros(3))


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
        if name == "evil.pt":  # the sentence saying what it found, without the name of torch's unpickler before it
            assert re.search(r"\(UnpicklingError: Unsupported global: [^()]*\)$", str(error.value)), str(error.value)
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
    # Cut short, it was refused in torch's 400 characters of miniz's words and advice.
    with pytest.raises(ValueError, match=r"^cannot load checkpoint .*half.pt: it is cut short \(a copy, transfer or "
                                         r"save interrupted\): its zip archive lacks the directory of its entries, "
                                         r"which torch.save writes at its end$"):
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
    # 16 levels are taken, 17 are not: with the limit compared by >= or one level off, only 100 were refused.
    deep = {}
    for _ in range(checkpoint.MAX_CONFIG_DEPTH):
        deep = {"a": deep}
    torch.save({"model": {}, "config": deep}, tmp_path / "deep.pt")
    assert checkpoint.load(tmp_path / "deep.pt")["config"] == deep
    torch.save({"model": {}, "config": {"a": deep}}, tmp_path / "deep.pt")
    with pytest.raises(ValueError, match=r"deep.pt .*: its config(\.a){17} nests deeper than 16 levels"):
        checkpoint.load(tmp_path / "deep.pt")
    # 10,000 entries are taken (the config, its list and 9,998 strings), 10,001 are not.
    torch.save({"model": {}, "config": {"data": ["x"] * (checkpoint.MAX_CONFIG_ENTRIES - 2)}}, tmp_path / "many.pt")
    assert len(checkpoint.load(tmp_path / "many.pt")["config"]["data"]) == checkpoint.MAX_CONFIG_ENTRIES - 2
    torch.save({"model": {}, "config": {"data": ["x"] * (checkpoint.MAX_CONFIG_ENTRIES - 1)}}, tmp_path / "many.pt")
    with pytest.raises(ValueError, match=r"many.pt .*: its config holds more than 10,000 entries, which"):
        checkpoint.load(tmp_path / "many.pt")
    # Nor what OmegaConf holds no type of: a resume said it without the file, a key of None over three lines.
    torch.save({"model": {}, "config": {"data": {"kind": torch.zeros(2)}}}, tmp_path / "tensor_config.pt")
    with pytest.raises(ValueError, match=r"tensor_config.pt .*: its config.data.kind holds what OmegaConf refuses "
                                         r"\(Value 'Tensor' is not a supported primitive type\), which"):
        checkpoint.load(tmp_path / "tensor_config.pt")
    torch.save({"model": {}, "config": {None: 1}}, tmp_path / "none_key.pt")
    with pytest.raises(ValueError, match=r"none_key.pt .*: its config has the key None, a NoneType, which [^\n]*$"):
        checkpoint.load(tmp_path / "none_key.pt")
    # OmegaConf takes a key of a number, which a resume sorted among the names in a TypeError's traceback.
    torch.save({"model": {}, "config": {"data": {"features": {"kind": "mel", 5: 1}}}}, tmp_path / "int_key.pt")
    with pytest.raises(ValueError, match=r"int_key.pt .*: its config.data.features has the key 5, an int, which the "
                                         r"trainer's resolved config never holds$"):
        checkpoint.load(tmp_path / "int_key.pt")
    # torch.save stores its zip's entries as they are; compressed ones could unpack to any size.
    with zipfile.ZipFile(tmp_path / "weights.pt") as original, zipfile.ZipFile(
            tmp_path / "deflated.pt", "w", zipfile.ZIP_DEFLATED) as deflated:
        for entry in original.infolist():
            deflated.writestr(entry.filename, original.read(entry))
    with pytest.raises(ValueError, match="deflated.pt: it holds compressed entries, which torch.save never writes$"):
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


def test_the_most_training_manifests_a_run_takes_load_back_from_its_checkpoint(tmp_path):
    """A checkpoint's config of more than MAX_CONFIG_ENTRIES is refused, one entry a training manifest: a run of
    10,000 manifests was taken, and wrote checkpoints that its resume and trainer.evaluate refused."""
    cfg = compose_config(["model.depth=1", "model.hidden=16", "model.conv_channels=2", "data=manifest",
                          "data.eval_manifest=/corpus/test.jsonl"])
    cfg.data.train_manifests = [f"/corpus/{index:05d}.jsonl" for index in range(10_000)]
    with pytest.raises(ValueError) as error:
        check_config(cfg)
    assert str(error.value).startswith("data.train_manifests must be a list of 1 to 5,000 manifest paths"
                                       f"{SET_MANIFESTS}, not [")
    cfg.data.train_manifests = cfg.data.train_manifests[:MAX_TRAIN_MANIFESTS]
    check_config(cfg)
    network = build.model(cfg.model, build.features(cfg.data).num_features)
    config = OmegaConf.to_container(cfg, resolve=True)
    checkpoint.save(tmp_path / "last.pt", {"model": network.state_dict(), "config": config})
    assert len(checkpoint.load(tmp_path / "last.pt")["config"]["data"]["train_manifests"]) == MAX_TRAIN_MANIFESTS


def test_a_checkpoint_whose_lists_recur_many_times_over_is_read_or_refused_at_once(tmp_path):
    """A pickle stores a list once however often it recurs: in a kilobyte, lists that each hold the next ten times
    over are 10**16 entries to walk, and a list inside itself never ends. Outside the config each is looked at once
    (looked at each time, the walk never ended, and every test passed); a config, which OmegaConf copies entry by
    entry, of more than MAX_CONFIG_ENTRIES is refused (10**8 took hours). In a process of its own, so that a walk
    that does not end fails the test rather than hangs it."""
    recurring = "x"
    for _ in range(checkpoint.MAX_CONFIG_DEPTH):
        recurring = [recurring] * 10
    looped = []
    looped.append(looped)
    torch.save({"model": {}, "config": {}, "train_state": {"recurring": recurring, "looped": looped}},
               tmp_path / "state.pt")
    torch.save({"model": {}, "config": {"data": recurring[0][0][0][0][0][0][0][0]}}, tmp_path / "config.pt")
    script = ("import sys\nfrom trainer import checkpoint\nfor path in sys.argv[1:]:\n    try:\n"
              "        checkpoint.load(path)\n        print('loaded')\n    except ValueError as error:\n"
              "        print(error)\n")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "state.pt"), str(tmp_path / "config.pt")],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.stdout.splitlines() == [
        "loaded", f"{tmp_path / 'config.pt'} is not a checkpoint written by python -m trainer: its config holds more "
                  "than 10,000 entries, which the trainer's resolved config never holds"], result.stderr


def test_a_checkpoint_whose_bytes_changed_after_it_was_written_is_refused_naming_the_entry(tmp_path):
    """torch.load does not check the CRC-32 that torch.save writes for each zip entry: a checkpoint with bytes of a
    weight changed on disk loaded, and a resume trained on from the wrong weights until they diverged."""
    torch.save({"model": {"w": torch.arange(1000.0)}, "config": {}}, tmp_path / "last.pt")
    damaged = bytearray((tmp_path / "last.pt").read_bytes())
    weights = damaged.index(torch.arange(1000.0).numpy().tobytes())
    damaged[weights + 100:weights + 104] = b"\xff\xff\xff\xff"
    (tmp_path / "last.pt").write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=r"cannot load checkpoint .*last.pt: its entry last/data/0 does not match "
                                         r"its CRC-32 checksum: its bytes changed after torch.save wrote them$"):
        checkpoint.load(tmp_path / "last.pt")


def test_a_checkpoint_read_for_its_record_alone_checks_its_plain_data_not_its_weights(tmp_path):
    """A resume reads the run's best.pt for its WER and test set alone: its weights (gigabytes in a deep model, read
    on every rank) are mapped, not read, and their checksums go unchecked with them; its plain data's are checked."""
    weights = torch.arange(1000.0)
    torch.save({"model": {"w": weights}, "config": {}, "train_state": {"best_wer": 12.5}}, tmp_path / "best.pt")
    saved = bytearray((tmp_path / "best.pt").read_bytes())
    at = saved.index(weights.numpy().tobytes()) + 100
    damaged_weights = saved[:at] + b"\xff\xff\xff\xff" + saved[at + 4:]
    (tmp_path / "best.pt").write_bytes(damaged_weights)
    assert checkpoint.load(tmp_path / "best.pt", record_only=True)["train_state"] == {"best_wer": 12.5}
    with pytest.raises(ValueError, match="its entry best/data/0 does not match its CRC-32 checksum"):
        checkpoint.load(tmp_path / "best.pt")
    at = saved.index(b"best_wer")
    (tmp_path / "best.pt").write_bytes(saved[:at] + b"BEST" + saved[at + 4:])
    with pytest.raises(ValueError, match="its entry best/data.pkl does not match its CRC-32 checksum"):
        checkpoint.load(tmp_path / "best.pt", record_only=True)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="finds the mapping through /proc")
def test_a_checkpoint_read_for_its_record_alone_maps_its_weights_rather_than_reading_them(tmp_path):
    """With torch.load's mmap off, the weights were read whole and every test passed: only the process's mappings
    tell a mapped file from one read."""
    torch.save({"model": {"w": torch.arange(1000.0)}, "config": {}, "train_state": {"best_wer": 12.5}},
               tmp_path / "best.pt")
    saved = checkpoint.load(tmp_path / "best.pt", record_only=True)
    assert str(tmp_path / "best.pt") in Path("/proc/self/maps").read_text()
    assert saved["train_state"] == {"best_wer": 12.5}


def test_a_checkpoint_in_torchs_format_from_before_its_zip_archives_is_read_for_its_record_too(tmp_path):
    """torch.save's format before torch 1.6 cannot be mapped: read for its record alone (a resume reading the run's
    best.pt), it is read whole, as torch.load reads it, rather than refused."""
    torch.save({"model": {"w": torch.arange(3.0)}, "config": {}, "train_state": {"best_wer": 12.5}},
               tmp_path / "best.pt", _use_new_zipfile_serialization=False)
    assert checkpoint.load(tmp_path / "best.pt", record_only=True)["train_state"] == {"best_wer": 12.5}


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


def test_a_stored_config_that_claims_another_model_than_its_weights_allocates_nothing(tmp_path):
    """Each refused in a process that may map 4 GiB at most: the claimed model's 19 GB of weights, were they made,
    fail there (where this machine's memory would have let them pass slowly), and so does building 10**8 layers."""
    path = small_checkpoint(tmp_path / "small.pt")
    saved = torch.load(path, weights_only=True)
    for key, value, complaint in (("depth", 10**8, "its config gives model.depth=100000000, its weights 1 layer)"),
                                  ("hidden", 40000, "size mismatch")):
        edited = {**saved, "config": {**saved["config"], "model": {**saved["config"]["model"], key: value}}}
        torch.save(edited, tmp_path / "edited.pt")
        script = (
            "import resource, sys, torch\n"
            "from trainer import build\n"
            "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))\n"
            "try:\n"
            f"    build.from_checkpoint({str(tmp_path / 'edited.pt')!r}, torch.device('cpu'))\n"
            "except ValueError as error:\n"
            "    sys.exit(str(error))\n"
        )
        result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 1 and complaint in result.stderr, result.stderr[-2000:]


def test_a_checkpoint_is_rebuilt_for_inference_on_the_features_it_was_trained_on(tmp_path):
    path = small_checkpoint(tmp_path / "small.pt", "data.features.normalize=false", "data.features.sample_rate=8000",
                            "data.features.n_mels=32")
    model, features, _ = build.from_checkpoint(path, torch.device("cpu"))
    # In training mode, batch norm would scale each utterance by its own statistics, not those training gathered.
    assert not model.training
    assert (features.kind, features.sample_rate, features.num_features, features.normalize) == ("mel", 8000, 32, False)


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
    # The rounding to bf16 moves these log-probs 1e-4 at most; 0.05 passed a model with a layer left at random
    # weights about half the time (two untrained models' differ by 0.06-0.1: near-uniform over 29 characters).
    assert outputs[1].dtype == torch.float32 and relative_error(outputs[1], outputs[0]) < 1e-3


def test_a_checkpoint_of_another_model_is_one_line_naming_the_file(tmp_path):
    good = checkpoint.load(small_checkpoint(tmp_path / "good.pt"))
    wider = checkpoint.load(small_checkpoint(tmp_path / "wider.pt", "model.hidden=32"))
    first_weight, *others = good["model"]
    # Loaded with strict=False, a state dict lacking a weight failed in torch's words (a RuntimeError on the meta
    # device, naming neither), and one holding an extra weight loaded: every test passed.
    missing_weight = {key: good["model"][key] for key in others}
    extra_weight = {**good["model"], "extra.weight": torch.ones(2)}
    cases = {
        "empty": {"model": {}, "config": {}},
        "unknown_key": {**good, "config": {**good["config"], "model": {**good["config"]["model"], "dropout": 0.1}}},
        # A reason past 300 characters is cut short: uncut, the test passed, as no other reason here was that long.
        "long_key": {**good, "config": {**good["config"], "model": {**good["config"]["model"], "x" * 400: 1}}},
        "tensor_model": {**good, "model": torch.ones(3)},
        "other_shapes": {**good, "model": wider["model"]},
        "missing_weight": {**good, "model": missing_weight},
        "extra_weight": {**good, "model": extra_weight},
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
        if name == "long_key":
            assert message.endswith("...)"), message
        if name in ("missing_weight", "extra_weight"):
            assert (f'Missing key(s) in state_dict: "{first_weight}"' if name == "missing_weight" else
                    'Unexpected key(s) in state_dict: "extra.weight"') in message, message


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
    # Anywhere in it: a resume hands the optimizer's state, its lists' and tuples' entries among them, to torch as well.
    # One part at a time: in one checkpoint, a walk that skipped the lists (or the dicts, or the tuples) named the other
    # part and passed.
    for part, named in (({"optimizer": {"state": {0: {"exp_avg": weight.to_sparse()}}, "param_groups": []}},
                         "optimizer.state.0.exp_avg is a torch.sparse_coo (not dense)"),
                        ({"optimizer": {"state": {}, "param_groups": [{"betas": (weight.to("meta"), 0.999)}]}},
                         "optimizer.param_groups.0.betas.0 is a meta (shape alone, no values)"),
                        ({"rng": [{"torch": torch.zeros(3, dtype=torch.uint8).to("meta")}]},
                         "rng.0.torch is a meta (shape alone, no values)")):
        torch.save({**good, **part}, tmp_path / "training.pt")
        with pytest.raises(ValueError, match=f"its {re.escape(named)} tensor"):
            checkpoint.load(tmp_path / "training.pt")


def test_missing_checkpoint_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"^checkpoint not found: {tmp_path / 'nope.pt'}$"):
        checkpoint.load(tmp_path / "nope.pt")


def test_a_pipe_given_as_a_checkpoint_is_said_to_be_no_file_not_missing(tmp_path):
    # python -m trainer.transcribe --checkpoint <(ssh host cat best.pt) said "checkpoint not found: /dev/fd/63".
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)  # no writer: opening it would wait for one
    with pytest.raises(ValueError, match=f"^checkpoint {re.escape(str(pipe))} is not a file \\(a pipe"):
        checkpoint.load(pipe)
    # A folder is said to be one: only a slow test of the whole trainer said so.
    with pytest.raises(ValueError, match=f"^checkpoint {re.escape(str(tmp_path))} is a folder; name a .pt file in it$"):
        checkpoint.load(tmp_path)


def test_a_checkpoint_that_cannot_be_read_is_said_so_not_called_damaged(tmp_path):
    # One it may not read was "not a complete checkpoint that torch.save wrote (PermissionError: ...)"; a name past the
    # file system's 255 bytes was a bare OSError, which python -m trainer's train.resume ended in a traceback.
    too_long = tmp_path / ("x" * 300)
    for load in (checkpoint.load, lambda path: checkpoint_to_resume(str(path), tmp_path / "run")):
        with pytest.raises(ValueError, match=f"^cannot read checkpoint {re.escape(str(too_long))}: File name too long"):
            load(too_long)
    locked = small_checkpoint(tmp_path / "locked.pt")
    locked.chmod(0)
    assert (error_without_root_privilege("trainer.checkpoint.load", "ValueError", locked)
            == f"cannot read checkpoint {locked}: Permission denied")
