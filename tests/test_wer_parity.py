"""benchmarks.wer_parity end to end on CPU: two backends, two seeds each, side by side on a slice of AN4; then the same
command again, which continues the finished runs (they end at once) instead of training them anew."""
import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks.wer_parity import evaluations, summarize, visible_gpus
from conftest import MPIEXEC, REPO_ROOT, TINY, needs_mpiexec, write_slice


@pytest.mark.slow
def test_runs_each_backend_and_seed_then_continues_them(an4_train, tmp_path):
    manifest = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:16])
    overrides = ["data=manifest", f"data.train_manifests=[{manifest}]", f"data.eval_manifest={manifest}", *TINY,
                 "train.epochs=1"]
    command = [sys.executable, "-m", "benchmarks.wer_parity", "--backends", "reference", "cudnn", "--seeds", "1", "2",
               "--parallel", "2", "--runs-dir", str(tmp_path / "runs"), "--json", str(tmp_path / "wer.json"), "--",
               *overrides]

    # Two named GPUs, which these CPU runs never open: the runs take them in turn.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "3,5"}
    first = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    result = json.loads((tmp_path / "wer.json").read_text())
    assert [(run["backend"], run["seed"]) for run in result["runs"]] == [
        ("reference", 1), ("reference", 2), ("cudnn", 1), ("cudnn", 2)]
    assert [run["gpu"] for run in result["runs"]] == ["3", "5", "3", "5"] and result["config"]["gpus"] == ["3", "5"]
    for run in result["runs"]:
        assert run["returncode"] == 0 and run["epochs"] == 1, run
        assert 0 <= run["last_wer"] <= 100 and run["best_wer"] == run["last_wer"]
        assert "final test WER" in (tmp_path / "runs" / f"{run['run']}.out").read_text()
    reference, cudnn = result["summary"]
    assert reference["runs"] == cudnn["runs"] == 2
    assert math.isclose(cudnn["difference"], cudnn["mean_wer"] - reference["mean_wer"])
    assert (result["config"]["backends"], result["config"]["seeds"]) == (["reference", "cudnn"], [1, 2])

    again = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    continued = json.loads((tmp_path / "wer.json").read_text())
    # Finished runs end at once: the same evaluations, and the time they took to train, not this call's.
    for key in ("last_wer", "elapsed_s"):
        assert [run[key] for run in continued["runs"]] == [run[key] for run in result["runs"]]
    assert all(run["elapsed_s"] > 0 for run in continued["runs"])
    for run in continued["runs"]:
        assert "resumed from" in (tmp_path / "runs" / f"{run['run']}.out").read_text()


@pytest.mark.slow
@needs_mpiexec
def test_ranks_make_each_run_a_data_parallel_job(an4_train, tmp_path):
    """--ranks 2: the run is a two-rank job of launch/single_node.sh, here on CPUs (gloo)."""
    manifest = write_slice(tmp_path / "slice.jsonl", [u for u in an4_train if u.duration < 2.5][:16])
    overrides = ["data=manifest", f"data.train_manifests=[{manifest}]", f"data.eval_manifest={manifest}", *TINY,
                 "train.epochs=1"]
    command = [sys.executable, "-m", "benchmarks.wer_parity", "--backends", "reference", "--seeds", "1", "--ranks",
               "2", "--runs-dir", str(tmp_path / "runs"), "--json", str(tmp_path / "wer.json"), "--", *overrides]
    env = {**os.environ, "MPIRUN": MPIEXEC, "OMP_NUM_THREADS": "1"}
    finished = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    result = json.loads((tmp_path / "wer.json").read_text())
    (run,) = result["runs"]
    assert (run["ranks"], run["returncode"], run["epochs"], result["config"]["ranks"]) == (2, 0, 1, 2), run
    output = (tmp_path / "runs" / f"{run['run']}.out").read_text()
    assert "rank 1 of 2" in output and output.count("final test WER") == 1, output[-3000:]
    assert json.loads((tmp_path / "runs" / run["run"] / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1


def test_summary_compares_each_backend_with_the_first():
    rows = [{"backend": backend, "returncode": 0, "last_wer": wer}
            for backend, wer in [("cudnn", 10.0), ("cudnn", 12.0), ("persistent", 11.0), ("persistent", 15.0)]]
    rows.append({"backend": "persistent", "returncode": 1, "last_wer": 99.0})  # failed: left out
    cudnn, persistent = summarize(rows, ["cudnn", "persistent"])
    assert (cudnn["runs"], cudnn["mean_wer"]) == (2, 11.0) and "difference" not in cudnn
    assert (persistent["runs"], persistent["mean_wer"], persistent["difference"]) == (2, 13.0, 2.0)
    assert math.isclose(persistent["difference_stderr"], math.sqrt((2.0 + 8.0) / 2))


def test_evaluations_give_the_last_and_best(tmp_path):
    lines = [{"step": 1, "epoch": 0, "loss": 9.0}, {"epoch": 1, "eval_wer": 80.0, "eval_cer": 40.0, "elapsed_s": 5.0},
             {"epoch": 2, "eval_wer": 70.0, "eval_cer": 35.0, "elapsed_s": 9.5},
             {"epoch": 3, "eval_wer": 72.0, "eval_cer": 36.0, "elapsed_s": 14.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert evaluations(tmp_path) == {"epochs": 3, "last_wer": 72.0, "last_cer": 36.0, "best_wer": 70.0,
                                     "elapsed_s": 14.0}
    assert evaluations(tmp_path / "missing")["epochs"] == 0


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, GPU-8f1c,")
    assert visible_gpus() == ["2", "GPU-8f1c"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []
