"""What the GPU benchmarks record beside their timings, checked on any machine with small fakes for the GPU parts."""
import gc
import itertools
import re
import types
import weakref

import torch

from benchmarks import train_step
from conftest import REPO_ROOT


def test_a_train_step_rows_peak_memory_leaves_out_the_rows_before_it(monkeypatch):
    """torch.cuda.make_graphed_callables leaves a graphed row's model in a reference cycle, which only the cyclic
    collector frees: the next row's peak counted its weights and gradients (the AN4 model's eager step at batch 4,
    0.97 GB after AN4 rows, 1.87 GB after the deep model's graphed row: train_step_b4_v20*_h100.json)."""
    models = []

    class Model:
        pass

    def measure(args, model_name, backend, cuda_graphs, batch_size, device):
        model = Model()
        model.forward = lambda: model  # the cycle make_graphed_callables makes
        models.append(weakref.ref(model))
        return {"model": model_name, "backend": backend, "cuda_graphs": cuda_graphs, "batch": batch_size,
                "median_ms": 1.0, "gpu_ms": 1.0, "samples_per_s": 1.0}

    def reset_peak_memory_stats(device):
        alive = sum(model() is not None for model in models)
        assert alive == 0, f"{alive} earlier rows' models are still alive as this row's peak memory starts"

    monkeypatch.setattr(train_step, "measure", measure)
    one_process = types.SimpleNamespace(device=torch.device("cpu"))
    monkeypatch.setattr(train_step.distributed, "init", lambda device: one_process)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset_peak_memory_stats)
    gc.disable()  # in a long run the models have moved to the generation the collector seldom visits
    try:
        train_step.main(["--models", "an4", "--backends", "persistent", "--batches", "1", "4", "--cuda-graphs"])
    finally:
        gc.enable()
    assert len(models) == 4


def test_every_results_file_the_documents_name_is_there():
    """The figures' sources: each JSON the READMEs and HISTORY.md quote, as written there ({a,b} for either, a leading
    ... for the name before it), is in benchmarks/results/."""
    results = REPO_ROOT / "benchmarks" / "results"
    checked, missing = 0, []
    for document in ["README.md", "benchmarks/README.md", "benchmarks/HISTORY.md"]:
        for path in set(re.findall(r"[\w.{},*/-]+\.jsonl?\b", (REPO_ROOT / document).read_text())):
            folder, _, name = path.rpartition("/")
            # A run's own files, and names standing for any file (ONE_GPU.json, M.jsonl, manifests/...): no results.
            if folder not in ("", "benchmarks/results") or name in ("metrics.jsonl", "jobs.jsonl") \
                    or re.fullmatch(r"[A-Z_]+\.jsonl?", name):
                continue
            parts = re.split(r"\{([^}]*)\}", name.replace("...", "*"))
            alternatives = [[part] if i % 2 == 0 else part.split(",") for i, part in enumerate(parts)]
            for choice in itertools.product(*alternatives):
                checked += 1
                if not any(results.glob("**/" + "".join(choice))):
                    missing.append(f"{document}: {''.join(choice)}")
    assert checked > 100 and missing == []
