"""What the GPU benchmarks record beside their timings, checked on any machine with small fakes for the GPU parts."""
import gc
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import types
import weakref

import pytest
import torch

from benchmarks import rnn_kernels, rnn_stack, scaling, support_table, train_step
from conftest import REPO_ROOT
from prnn_kernels.persistent import support
from trainer import build
from trainer.cli import RESULTS_FOLDER_VARIABLE


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
                "median_ms": 1.0, "gpu_ms": 1.0, "samples_per_s": 1.0, "peak_memory_gb": 0.25}

    alive_at_each_start = []  # asserted after the run: an assert in here never ran where main stopped calling it

    def reset_peak_memory_stats(device):
        alive_at_each_start.append(sum(model() is not None for model in models))

    monkeypatch.setattr(train_step, "measure", measure)
    one_process = types.SimpleNamespace(device=torch.device("cpu"))
    monkeypatch.setattr(train_step.distributed, "init", lambda device, *timeout, **setting: one_process)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset_peak_memory_stats)
    gc.disable()  # in a long run the models have moved to the generation the collector seldom visits
    try:
        train_step.main(["--models", "an4", "--backends", "persistent", "--batches", "1", "4", "--cuda-graphs"])
    finally:
        gc.enable()
    assert len(models) == 4
    # Earlier rows' models still alive as each row's peak memory starts: none, and a start for every row.
    assert alive_at_each_start == [0, 0, 0, 0]


RUN_AND_TOOL_FILES = ("metrics.jsonl", "jobs.jsonl", "skipped_train.jsonl", "skipped_test.jsonl", "skipped.jsonl")


def test_every_results_file_the_documents_name_is_there():
    """The figures' sources: each JSON the READMEs and HISTORY.md quote, as written there ({a,b} for either, a leading
    ... for the name before it), is in benchmarks/results/."""
    results = REPO_ROOT / "benchmarks" / "results"
    checked, missing = 0, []
    for document in ["README.md", "benchmarks/README.md", "benchmarks/HISTORY.md"]:
        for path in set(re.findall(r"[\w.{},*/-]+\.jsonl?\b", (REPO_ROOT / document).read_text())):
            folder, _, name = path.rpartition("/")
            # A run's and the tools' own files, and names standing for any file (ONE_GPU.json, M.jsonl,
            # NAME.skipped.jsonl, manifests/...): no results.
            if folder not in ("", "benchmarks/results") or name in RUN_AND_TOOL_FILES \
                    or re.fullmatch(r"[A-Z_]+(\.\w+)*\.jsonl?", name):
                continue
            parts = re.split(r"\{([^}]*)\}", name.replace("...", "*"))
            alternatives = [[part] if i % 2 == 0 else part.split(",") for i, part in enumerate(parts)]
            for choice in itertools.product(*alternatives):
                checked += 1
                if not any(results.glob("**/" + "".join(choice))):
                    missing.append(f"{document}: {''.join(choice)}")
    assert checked > 100 and missing == []


def headings(document) -> list:
    """A Markdown file's headings as (level, title), past its code blocks (a shell's # comments)."""
    text = re.sub(r"^```.*?^```", "", document.read_text(), flags=re.MULTILINE | re.DOTALL)
    return re.findall(r"^(#+) (.*)", text, re.MULTILINE)


def heading_anchors(document) -> list:
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation but - and _ dropped, spaces -."""
    return [re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-") for _, title in headings(document)]


def test_every_section_link_the_documents_give_leads_to_a_heading():
    """The README's sections were rewritten apart: a link, or a heading two sections share, must still lead to one
    heading, and the README's headings stay two levels below the title (## a topic, ### a task)."""
    documents = [REPO_ROOT / "README.md", *(REPO_ROOT / "benchmarks").glob("*.md"), *(REPO_ROOT / "launch").iterdir(),
                 *(REPO_ROOT / "tests").glob("*.py")]
    broken = []
    for document in documents:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", document.read_text()):
            anchors = heading_anchors(document.parent / target if target else document)
            if anchors.count(anchor) != 1:
                broken.append(f"{document.relative_to(REPO_ROOT)}: {target}#{anchor}")
    assert broken == []
    assert {level for level, _ in headings(REPO_ROOT / "README.md")} == {"#", "##", "###"}


# Each benchmark's GPU parts faked, so that it runs two points on a CPU (refused shapes, steps of 1 ms) and prints its
# table: code to run in a child process whose stdout a test redirects, with the JSON key of those points and a line of
# the table.
FAKE_GPU = """
import sys, types, torch
torch.cuda.is_available = lambda: True
torch.cuda.get_device_name = lambda device=None: "fake GPU"
"""
FAKED_BENCHMARKS = {
    "rnn_kernels": (FAKE_GPU + """
from benchmarks import rnn_kernels as benchmark
torch.cuda.get_device_properties = lambda device: types.SimpleNamespace(multi_processor_count=1)
benchmark.versions = lambda device: {}
benchmark.measure = lambda cell, batch, hidden, precision, bidirectional: {
    "cell": cell, "batch": batch, "hidden": hidden, "precision": precision, "bidirectional": bidirectional,
    "persistent_supported": False, "persistent_reason": "fake refusal"}
sys.argv[1:] = ["--cells", "gru", "--batches", "1", "--hiddens", "128", "--precisions", "fp32", *sys.argv[1:]]
""", "rows", "persistent kernel refused gru B=1 H=128 fp32: fake refusal"),
    "rnn_stack": (FAKE_GPU + """
from benchmarks import rnn_stack as benchmark
benchmark.versions = lambda device: {}
benchmark.support = lambda *shape: types.SimpleNamespace(ok=False, reason="fake refusal")
sys.argv[1:] = ["--hiddens", "128", "256", "--dtypes", "float32", *sys.argv[1:]]
""", "results", "gru H = 256 float32: persistent kernel refused: fake refusal"),
    "train_step": (FAKE_GPU + """
from benchmarks import train_step as benchmark
benchmark.distributed.init = lambda device, *timeout, **setting: types.SimpleNamespace(device=torch.device("cpu"))
torch.cuda.init = torch.cuda.reset_peak_memory_stats = lambda *device: None
benchmark.measure = lambda args, model, backend, cuda_graphs, batch, device: {
    "model": model, "backend": backend, "cuda_graphs": cuda_graphs, "batch": batch, "median_ms": 1.0, "gpu_ms": 1.0,
    "samples_per_s": 1.0, "peak_memory_gb": 0.25}
sys.argv[1:] = ["--models", "an4", "--backends", "cudnn", "--batches", "1", "2", *sys.argv[1:]]
""", "rows", "an4     cudnn                   2       1.00    1.00        1.0     0.25"),  # with its peak memory
}


# The support table's query faked as refusing every shape; its JSON is written once, at the end.
FAKED_SUPPORT_TABLE = FAKE_GPU + """
from benchmarks import support_table as benchmark
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_properties = lambda device: types.SimpleNamespace(multi_processor_count=1, L2_cache_size=0)
benchmark.versions = lambda device: {}
benchmark.support = lambda *shape: types.SimpleNamespace(ok=False, reason="fake refusal")
sys.argv[1:] = ["--cells", "gru", "--precisions", "fp32", "--hiddens", "128", *sys.argv[1:]]
"""


@pytest.mark.parametrize("code", [*(FAKED_BENCHMARKS[name][0] for name in sorted(FAKED_BENCHMARKS)),
                                  FAKED_SUPPORT_TABLE], ids=[*sorted(FAKED_BENCHMARKS), "support_table"])
def test_a_benchmark_ends_saying_where_it_wrote_its_json(tmp_path, code):
    """rnn_kernels and support_table wrote their JSON without a word, where the other benchmarks end with its path.
    The JSON names the device its figures were measured on: a result without it cannot be set in the README's tables
    beside another GPU's."""
    path = tmp_path / "out.json"
    result = subprocess.run([sys.executable, "-c", code + "sys.exit(benchmark.main())", "--json", str(path)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    devices = values_of("device", json.loads(path.read_text()))
    assert len(devices) == 1 and isinstance(devices[0], str) and devices[0], devices
    assert result.stdout.endswith(f"\nwrote {path}\n"), result.stdout[-2000:]


@pytest.mark.parametrize("name", [*sorted(FAKED_BENCHMARKS), "support_table"])
def test_a_benchmark_without_json_writes_a_new_file_named_after_it(tmp_path, name):
    """Without --json these printed their table and wrote no JSON: a long GPU measurement run as the READMEs give it
    was lost to a scrolled-away terminal."""
    code = FAKED_BENCHMARKS[name][0] if name in FAKED_BENCHMARKS else FAKED_SUPPORT_TABLE
    result = subprocess.run([sys.executable, "-c", code + "sys.exit(benchmark.main())"], cwd=REPO_ROOT,
                            env={**os.environ, RESULTS_FOLDER_VARIABLE: str(tmp_path)}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    written = list(tmp_path.iterdir())
    named = [re.fullmatch(rf"{name}-\d{{8}}-\d{{6}}\.json", path.name) is not None for path in written]
    assert named == [True], written
    assert len(values_of("device", json.loads(written[0].read_text()))) == 1
    assert result.stdout.endswith(f"\nwrote {written[0]}\n"), result.stdout[-2000:]


@pytest.mark.parametrize("name", sorted(FAKED_BENCHMARKS))
def test_a_json_to_dev_stdout_under_a_redirection_is_written_once_after_the_table(tmp_path, name):
    """--json /dev/stdout > out.txt opened the file again after each point and wrote the JSON from its start: over the
    lines printed before it, and with the lines printed after it landing inside it. Then rnn_stack's and train_step's
    "wrote /dev/stdout" followed the JSON on stdout (now on stderr), which a reader of the JSON had to cut off."""
    code, points, table_line = FAKED_BENCHMARKS[name]
    with open(tmp_path / "out.txt", "w") as stdout:
        result = subprocess.run([sys.executable, "-c", code + "benchmark.main()", "--json", "/dev/stdout"],
                                cwd=REPO_ROOT, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    printed = (tmp_path / "out.txt").read_text()
    table, _, written = printed.partition("\n{\n")  # the JSON's first line; the rows' own lines are one line each
    document, end = json.JSONDecoder().raw_decode("{\n" + written)
    assert table_line in table and len(document[points]) == 2, printed
    assert ("{\n" + written)[end:] == "\n", printed


def test_a_json_file_holds_every_point_measured_before_the_run_is_cut_short(tmp_path):
    """A real file is rewritten after each point, a run cut short keeping what it measured; with the last point's
    JSON written, this one ends before its table."""
    code, _, _ = FAKED_BENCHMARKS["train_step"]
    cut_short = code + "benchmark.print_table = lambda *table: sys.exit('cut short')\nbenchmark.main()"
    result = subprocess.run([sys.executable, "-c", cut_short, "--json", str(tmp_path / "out.json")], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "cut short" in result.stderr, result.stderr[-2000:]
    assert [row["batch"] for row in json.loads((tmp_path / "out.json").read_text())["rows"]] == [1, 2]


@pytest.mark.parametrize("name", sorted(FAKED_BENCHMARKS))
def test_a_ctrl_c_ends_in_one_line_with_the_points_before_it_kept(tmp_path, name):
    """A Ctrl-C ended the benchmarks in a traceback of some thirty lines through torch; now in one line, exit 130, as
    the trainer's tools end, the JSON holding every point measured before it."""
    code, points, _ = FAKED_BENCHMARKS[name]
    # The second point gets a real SIGINT, as a terminal's Ctrl-C would send, from what each point calls once.
    per_point = "support" if name == "rnn_stack" else "measure"
    interrupted = code + f"""
import os, signal
calls = []
def until_ctrl_c(*point, each_point=benchmark.{per_point}):
    calls.append(point)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGINT)
    return each_point(*point)
benchmark.{per_point} = until_ctrl_c
"""
    result = subprocess.run([sys.executable, "-c", interrupted + "sys.exit(benchmark.run_tool(benchmark.main))",
                             "--json", str(tmp_path / "out.json")], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=300)
    assert (result.returncode, result.stderr) == (130, "interrupted by Ctrl-C\n"), result.stderr[-2000:]
    assert len(json.loads((tmp_path / "out.json").read_text())[points]) == 1


@pytest.mark.parametrize("name", sorted(FAKED_BENCHMARKS))
def test_the_json_names_the_commit_the_run_started_on(tmp_path, name):
    """rnn_kernels and train_step asked git for the commit each time they wrote their JSON: a checkout edited, or
    switched to another branch, during a run of hours was named as the code that had been measured."""
    code, _, _ = FAKED_BENCHMARKS[name]
    per_point = "support" if name == "rnn_stack" else "measure"
    edited_during_the_run = code + f"""
checkout = {{"commit": "started"}}
benchmark.versions = lambda device: dict(checkout)
def edit_then_measure(*point, each_point=benchmark.{per_point}):
    checkout["commit"] = "edited"
    return each_point(*point)
benchmark.{per_point} = edit_then_measure
benchmark.main()
"""
    result = subprocess.run([sys.executable, "-c", edited_during_the_run, "--json", str(tmp_path / "out.json")],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert values_of("commit", json.loads((tmp_path / "out.json").read_text())) == ["started"]


def test_the_scaling_json_names_the_commit_the_run_started_on(tmp_path, monkeypatch):
    """benchmarks.scaling asked git for the commit after its compute timings, minutes into a deep model's run."""
    checkout = {"commit": "started"}
    monkeypatch.setattr(scaling, "versions", lambda device: dict(checkout))
    timed = scaling.time_ms

    def edit_then_time(*args, **kwargs):
        checkout["commit"] = "edited"
        return timed(*args, **kwargs)

    monkeypatch.setattr(scaling, "time_ms", edit_then_time)
    scaling.main(["--model", "cpu_demo", "--device", "cpu", "--steps", "1", "--warmup", "0", "--frames", "50",
                  "--compute-batches", "1", "--global-batch", "1", "--json", str(tmp_path / "out.json")])
    assert values_of("commit", json.loads((tmp_path / "out.json").read_text())) == ["started"]


def values_of(key: str, document) -> list:
    """Every value of `key` in the objects of a JSON document, at any depth."""
    if isinstance(document, list):
        return [value for item in document for value in values_of(key, item)]
    if not isinstance(document, dict):
        return []
    return ([document[key]] if key in document else []) + values_of(key, list(document.values()))


def test_a_ctrl_c_ends_scaling_in_one_line(tmp_path):
    """benchmarks.scaling ended a Ctrl-C in a traceback through the training step; it writes its JSON at the end, so
    there is nothing to keep."""
    command = [sys.executable, "-m", "benchmarks.scaling", "--model", "cpu_demo", "--device", "cpu", "--global-batch",
               "2", "--frames", "50", "--steps", "100000", "--warmup", "0", "--compute-batches", "1", "--json",
               str(tmp_path / "scaling.json")]
    first_line, code, stderr = ctrl_c_after_the_first_line(command, wait_s=1)  # into the steps
    assert first_line.startswith("measuring the cpu_demo model")
    assert (code, stderr) == (130, "interrupted by Ctrl-C on rank 0\n"), stderr[-2000:]
    assert not (tmp_path / "scaling.json").exists()


def ctrl_c_after_the_first_line(command: list[str], wait_s: float = 0, env=None) -> tuple[str, int, str]:
    """(the first line of stdout, the exit code, stderr) of `command` pressed Ctrl-C (SIGINT) `wait_s` after it printed
    that line."""
    job = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first_line = job.stdout.readline()
        time.sleep(wait_s)
        job.send_signal(signal.SIGINT)
        _, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    return first_line, job.returncode, stderr


def test_the_support_table_writes_counts_as_runs_from_one_up():
    assert [support_table.counts(batches) for batches in ([], [1, 2, 3], [2, 3], [1, 3])] == ["-", "3", "2,3", "1,3"]


@pytest.mark.cuda
def test_the_support_table_gives_what_the_support_query_answers(tmp_path, capsys):
    assert support_table.main(["--cells", "relu", "lstm", "--hiddens", "256", "2048", "8192", "--max-batch", "8",
                               "--json", str(tmp_path / "t.json")]) == 0
    written = json.loads((tmp_path / "t.json").read_text())
    assert written["device"] == torch.cuda.get_device_name() and written["max_batch"] == 8
    rows = written["rows"]
    assert [row["hidden"] for row in rows] == [256, 2048, 8192]
    for row in rows:
        for cell in ("relu", "lstm"):
            for name, dtype in support_table.PRECISIONS.items():
                shape = row[f"{cell}_{name}"]
                answers = [support(cell, row["hidden"], batch, dtype, "cuda").ok for batch in range(1, 9)]
                assert shape["batches"] == [batch for batch, ok in zip(range(1, 9), answers) if ok], (row, cell)
                assert set(shape["together"]) <= set(shape["batches"])
                assert (shape["reason"] is None) == answers[0]
    assert rows[0]["relu_fp32"]["batches"] == list(range(1, 9))  # a small layer runs at every count
    assert rows[2]["lstm_fp32"] == {"batches": [], "together": [], "reason": support("lstm", 8192, 1, torch.float32,
                                                                                      "cuda").reason}
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].split() == ["H", "relu", "fp32", "relu", "bf16", "lstm", "fp32", "lstm", "bf16"]
    assert printed[2].startswith("  256 ") and printed[2].split()[1:3] == ["8", "(8)"]


@pytest.mark.cuda
def test_the_support_table_writes_its_json_alone_on_stdout_for_dev_stdout(tmp_path):
    """`--json /dev/stdout > file` was refused (the open would have truncated the file and lost the table printed
    before the JSON); `--json -` took its place, where every benchmark refuses "-"."""
    command = [sys.executable, "-m", "benchmarks.support_table", "--cells", "relu", "--precisions", "bf16",
               "--hiddens", "256", "8192", "--max-batch", "2", "--json"]
    # The file form first: it builds the extension if need be, whose messages would land between the table's lines.
    to_file = subprocess.run([*command, str(tmp_path / "table.json")], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=600)
    assert to_file.returncode == 0 and "256 " in to_file.stdout, to_file.stderr[-2000:]
    table, said = to_file.stdout.rsplit("wrote ", 1)
    assert said == f"{tmp_path / 'table.json'}\n"
    written = json.loads((tmp_path / "table.json").read_text())
    redirected = tmp_path / "redirected.json"
    for path in ("/dev/stdout", str(redirected)):  # the file stdout is redirected to is stdout too
        with redirected.open("w") as stdout:
            to_stdout = subprocess.run([*command, path], cwd=REPO_ROOT, stdout=stdout, stderr=subprocess.PIPE,
                                       text=True, timeout=600)
        assert to_stdout.returncode == 0 and to_stdout.stderr == f"{table}wrote {path}\n", to_stdout.stderr[-2000:]
        assert json.loads(redirected.read_text())["rows"] == written["rows"]


# The support table with the GPU's parts faked: hidden sizes run at 1 and 2 utterances, each query taking
# FAKE_QUERY_S, so that a signal can come during the queries.
FAKED_SUPPORT_TABLE = FAKE_GPU + """
import os, time
from benchmarks import support_table as benchmark
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_properties = lambda device: types.SimpleNamespace(multi_processor_count=1, L2_cache_size=1 << 20)
benchmark.versions = lambda device: {}
benchmark.support = lambda *shape: time.sleep(float(os.environ.get("FAKE_QUERY_S", "0"))) or types.SimpleNamespace(
    ok=shape[2] <= 2, reason="fake refusal")
benchmark.directions_run_together = lambda *shape: False
sys.argv[1:] = ["--cells", "gru", "--precisions", "fp32", "--max-batch", "4", *sys.argv[1:]]
sys.exit(benchmark.run_tool(benchmark.main))
"""
MANY_HIDDENS = [str(hidden) for hidden in range(128, 6273, 128)]


def test_the_support_table_writes_the_json_alone_where_it_is_stdout(tmp_path):
    """--json /dev/stdout > out.json was refused as where the table goes; now the table goes to stderr."""
    with open(tmp_path / "out.json", "w") as stdout:
        result = subprocess.run([sys.executable, "-c", FAKED_SUPPORT_TABLE, "--hiddens", "128", "256", "--json",
                                 "/dev/stdout"], cwd=REPO_ROOT, stdout=stdout, stderr=subprocess.PIPE, text=True,
                                timeout=300)
    assert result.returncode == 0 and "  256         2 (-)" in result.stderr, result.stderr[-2000:]
    written = json.loads((tmp_path / "out.json").read_text())
    assert [row["gru_fp32"]["batches"] for row in written["rows"]] == [[1, 2], [1, 2]]
    assert {"device", "sms", "l2_bytes", "max_batch", "command"} <= set(written)


def test_the_support_tables_json_names_the_commit_its_queries_started_on(tmp_path):
    """The support table asked git for the commit as it wrote its JSON, after every query."""
    edited_during_the_run = FAKED_SUPPORT_TABLE.replace("sys.exit(", """
checkout = {"commit": "started"}
benchmark.versions = lambda device: dict(checkout)
def edit_then_query(*shape, each_shape=benchmark.support):
    checkout["commit"] = "edited"
    return each_shape(*shape)
benchmark.support = edit_then_query
sys.exit(""")
    result = subprocess.run([sys.executable, "-c", edited_during_the_run, "--hiddens", "128", "--json",
                             str(tmp_path / "out.json")], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((tmp_path / "out.json").read_text())["commit"] == "started"


def test_the_support_table_a_full_disk_leaves_the_json_before_it_as_it_was(tmp_path):
    """The JSON was written in place: a file size limit (ulimit -f), as a disk filling up, left it cut short, and the
    run ended in OSError's traceback."""
    import resource

    before = '{"rows": "an earlier table"}\n'
    (tmp_path / "table.json").write_text(before)
    limit = 2000  # bytes: less than the table's JSON
    result = subprocess.run(
        [sys.executable, "-c", FAKED_SUPPORT_TABLE, "--hiddens", *MANY_HIDDENS, "--json", str(tmp_path / "table.json")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY)))
    assert (result.returncode, result.stderr) == (2, f"error: cannot write {tmp_path}/table.json: File too large\n"), (
        result.stderr[-2000:])
    assert (tmp_path / "table.json").read_text() == before


def test_the_support_table_ends_a_reader_that_stops_early_and_a_ctrl_c_in_one_line(tmp_path):
    """`| head` ended in a BrokenPipeError's traceback, and a Ctrl-C in a KeyboardInterrupt's."""
    command = shlex.join([sys.executable, "-c", FAKED_SUPPORT_TABLE, "--hiddens", *MANY_HIDDENS])
    piped = subprocess.run(["bash", "-c", f"{command} | true; exit ${{PIPESTATUS[0]}}"], cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=300)
    assert (piped.returncode, piped.stderr) == (1, ""), piped.stderr[-2000:]
    first_line, code, stderr = ctrl_c_after_the_first_line([sys.executable, "-c", FAKED_SUPPORT_TABLE, "--hiddens",
                                                            *MANY_HIDDENS], env={**os.environ, "FAKE_QUERY_S": "0.01"})
    assert "the most utterances" in first_line
    assert (code, stderr) == (130, "interrupted by Ctrl-C\n"), stderr[-2000:]


def train_step_row(model, backend, batch, median_ms, cuda_graphs=False):
    """A timed row as benchmarks.train_step.measure builds it (its GPU time a third below its median)."""
    row = {"model": model, "backend": backend, "cuda_graphs": cuda_graphs, "batch": batch,
           **scaling.summary([median_ms]), "gpu_ms": median_ms * 2 / 3, "parameters": 1000, "peak_memory_gb": 0.5,
           "samples_per_s": batch / median_ms * 1e3}
    if backend == "persistent":
        row["persistent"] = {"supported": True, "reason": "", "directions_in_one_launch": True}
    return row


def test_the_benchmarks_model_starts_from_their_seed_whatever_ran_before():
    """train_step compares its backends from the same initial weights, and scaling's ranks start as one model: both take
    them from model_optimizer_schedule's seed, which no test ran (train_step measures on a GPU alone)."""
    cfg = scaling.compose_config("cpu_demo", "reference", None, "none")
    num_features = build.features(cfg.data).num_features
    cpu = torch.device("cpu")
    first, _, _ = scaling.model_optimizer_schedule(cfg, num_features, 7, cpu)
    torch.rand(10)  # the global generator moved on, as an earlier row's measure moves it
    again, optimizer, schedule = scaling.model_optimizer_schedule(cfg, num_features, 7, cpu)
    other, _, _ = scaling.model_optimizer_schedule(cfg, num_features, 8, cpu)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values()))
    assert not all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), other.state_dict().values()))
    assert optimizer.param_groups[0]["params"] == list(again.parameters()) and schedule.optimizer is optimizer


def test_a_train_step_speedup_is_cudnns_time_over_the_rows_at_its_own_model_and_batch(capsys):
    """speedup_over_cudnn divides cuDNN's median step by the row's, cuDNN's of the same model and batch: no test ran
    it with a row to compare (the fakes ran cuDNN alone), so a ratio inverted, or cuDNN's row of another batch or
    model taken, gave the README's speed-ups unseen; nor did the table's columns have values told apart."""
    rows = [train_step_row("an4", "cudnn", 1, 10.0), train_step_row("an4", "persistent", 1, 4.0),
            train_step_row("an4", "persistent", 1, 2.0, cuda_graphs=True),
            train_step_row("an4", "cudnn", 4, 20.0), train_step_row("an4", "persistent", 4, 16.0),
            train_step_row("an4", "persistent", 8, 5.0),  # no cuDNN row at batch 8: no speed-up
            train_step_row("deep", "cudnn", 1, 40.0), train_step_row("deep", "persistent", 1, 10.0),
            {"model": "deep", "backend": "persistent", "cuda_graphs": False, "batch": 4,
             "persistent": {"supported": False, "reason": "too large", "directions_in_one_launch": False}}]
    train_step.add_speedups(rows)
    assert [row.get("speedup_over_cudnn") for row in rows] == [None, 2.5, 5.0, None, 1.25, None, None, 4.0, None]
    layer = {"depth": 5, "bidirectional": True, "cell": "gru", "hidden": 800}
    train_step.print_table(rows, {"an4": layer, "deep": {**layer, "depth": 7, "hidden": 1152}})
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["an4: 5 x bi-GRU 800", "deep: 7 x bi-GRU 1152"]
    assert lines[2].split() == ["model", "backend", "batch", "median", "ms", "GPU", "ms", "samples/s", "peak", "GB",
                                "speed-up"]
    assert [line.split() for line in lines[4:]] == [
        ["an4", "cudnn", "1", "10.00", "6.67", "100.0", "0.50"],
        ["an4", "persistent", "1", "4.00", "2.67", "250.0", "0.50", "2.50x"],
        ["an4", "persistent", "+", "graphs", "1", "2.00", "1.33", "500.0", "0.50", "5.00x"],
        ["an4", "cudnn", "4", "20.00", "13.33", "200.0", "0.50"],
        ["an4", "persistent", "4", "16.00", "10.67", "250.0", "0.50", "1.25x"],
        ["an4", "persistent", "8", "5.00", "3.33", "1600.0", "0.50"],
        ["deep", "cudnn", "1", "40.00", "26.67", "25.0", "0.50"],
        ["deep", "persistent", "1", "10.00", "6.67", "100.0", "0.50", "4.00x"],
        ["deep", "persistent", "4", "refused:", "too", "large"]]


def rnn_kernels_row(precision, bidirectional, **times_us):
    """A supported GRU row of benchmarks.rnn_kernels.measure at B = 4, H = 1024, before add_rates: each time per step
    `times_us` names, the others 1 us."""
    row = {"cell": "gru", "batch": 4, "hidden": 1024, "precision": precision, "bidirectional": bidirectional,
           "num_steps": rnn_kernels.NUM_STEPS, "persistent_supported": True, "persistent_reason": ""}
    runs = ["persistent", *rnn_kernels.cudnn_keys(precision)]
    for run, direction, graphed in itertools.product(runs, ("fwd", "fwdbwd"), ("", "_graphed")):
        row[f"{run}_{direction}{graphed}_us"] = times_us.get(f"{run}_{direction}{graphed}_us", 1.0)
    return row


def test_rnn_kernels_times_per_step_tflops_and_speedups_over_the_reference(capsys):
    """The arithmetic of benchmarks.rnn_kernels, which ran on a GPU alone and no test checked: a millisecond call over
    256 steps in us per step, 2 T B G H (I + H) FLOPs a direction forward and three times that with the backward, and
    the speed-ups over the precision's reference (cuDNN fp32 for fp32, fp16 for bf16), not over the run beside it."""
    assert rnn_kernels.per_step_us(25.6) == pytest.approx(100.0)
    forward = 2 * 256 * 4 * (3 * 1024) * (1024 + 1024)  # GRU: three gates
    assert rnn_kernels.flops(256, 4, 3 * 1024, 1024, 1024, backward=False) == forward
    assert rnn_kernels.flops(256, 4, 3 * 1024, 1024, 1024, backward=True) == 3 * forward
    fp32 = rnn_kernels_row("fp32", False, persistent_fwd_us=100.0, persistent_fwdbwd_us=400.0,
                           persistent_fwd_graphed_us=50.0, persistent_fwdbwd_graphed_us=200.0,
                           cudnn_fp32_fwd_us=300.0, cudnn_fp32_fwdbwd_us=600.0, cudnn_fp32_fwd_graphed_us=250.0,
                           cudnn_fp32_fwdbwd_graphed_us=500.0, cudnn_tf32_fwd_us=30.0, cudnn_tf32_fwdbwd_us=40.0)
    rnn_kernels.add_rates(fp32)
    # 12.9 GFLOP in 256 steps of 100 us (25.6 ms) forward; three times as much in four times as long.
    assert fp32["persistent_fwd_tflops"] == pytest.approx(forward / 25.6e-3 / 1e12)
    assert fp32["persistent_fwdbwd_tflops"] == pytest.approx(3 * forward / 102.4e-3 / 1e12)
    assert (fp32["speedup_fwd_over_cudnn_fp32"], fp32["speedup_fwdbwd_over_cudnn_fp32"],
            fp32["speedup_fwd_graphed_over_cudnn_fp32"], fp32["speedup_fwdbwd_graphed_over_cudnn_fp32"]) == (
        3.0, 1.5, 5.0, 2.5)
    bf16 = rnn_kernels_row("bf16", True, persistent_fwd_us=100.0, cudnn_fp16_fwd_us=200.0, cudnn_bf16_fwd_us=700.0)
    rnn_kernels.add_rates(bf16)
    assert bf16["persistent_fwd_tflops"] == pytest.approx(2 * forward / 25.6e-3 / 1e12)  # both directions' work
    assert bf16["speedup_fwd_over_cudnn_fp16"] == 2.0 and "speedup_fwd_over_cudnn_bf16" not in bf16
    fp32["kernel_only_fwd_us"], fp32["matmul_loop_fwd_us"] = 80.0, 20.0
    rnn_kernels.print_table([fp32])
    lines = capsys.readouterr().out.splitlines()
    tflops = [f"{fp32[f'persistent_{direction}_tflops']:.2f}" for direction in ("fwd", "fwdbwd")]
    assert [line.split() for line in lines[3:5]] == [
        ["gru", "1", "fp32", "4", "1024", "fwd", "|", "100.00", "50.00", "80.00", tflops[0], "|", "300.00", "250.00",
         "30.00", "20.00", "|", "3.0x", "5.0x"],
        ["gru", "1", "fp32", "4", "1024", "fwdbwd", "|", "400.00", "200.00", tflops[1], "|", "600.00", "500.00",
         "40.00", "|", "1.5x", "2.5x"]]


def test_rnn_stack_fits_each_stacks_fixed_and_per_layer_cost_and_gives_cudnns_over_the_persistent_one(capsys):
    """The arithmetic of benchmarks.rnn_stack, which ran on a GPU alone and no test checked: the least-squares line
    through (depth, time), its slope the "per added layer" cost and its value at depth 0 the "fixed" one, each depth's
    time per layer, and the per-layer ratio cuDNN / persistent (the README's "x faster per layer")."""
    # Through (1, 3), (2, 5), (4, 10): mean depth 7/3, mean time 6; slope 11 / (14/3) = 33/14; 6 - 33/14 x 7/3 = 0.5.
    fixed, per_layer = rnn_stack.line_fit([1, 2, 4], [3.0, 5.0, 10.0])
    assert (fixed, per_layer) == (pytest.approx(0.5), pytest.approx(33 / 14))
    scales = {"fwd_ms": 1.0, "fwd_bwd_ms": 3.0, "fwd_graphed_ms": 0.5, "fwd_bwd_graphed_ms": 2.0}
    lines = {("persistent", "fp32"): (1.0, 2.0), ("cudnn", "fp32"): (2.0, 6.0), ("cudnn", "tf32"): (0.5, 4.0)}
    rows = [{"backend": backend, "precision": precision, "depth": depth,
             **{name: scale * (fixed + per_layer * depth) for name, scale in scales.items()}}
            for depth in (1, 2, 4) for (backend, precision), (fixed, per_layer) in lines.items()]
    summary = rnn_stack.summarise(rows)
    assert [(entry["backend"], entry["precision"]) for entry in summary] == list(lines)
    for entry, (fixed, per_layer) in zip(summary, lines.values()):
        for name, scale in scales.items():
            assert entry[f"{name}_fixed"] == pytest.approx(scale * fixed)
            assert entry[f"{name}_per_layer"] == pytest.approx(scale * per_layer)
    rnn_stack.print_table("gru", 800, 4, rows, summary, [1, 2, 4])
    printed = capsys.readouterr().out.splitlines()
    # Each depth's time, then that time per layer; the slope, then the line at depth 0.
    assert printed[3].split() == ["persistent", "fp32", "fwd", "3.00", "(", "3.00)", "5.00", "(", "2.50)", "9.00", "(",
                                  "2.25)", "2.00", "1.00"]
    assert printed[-2:] == [
        "per added layer, cuDNN fp32 / persistent fp32: fwd 3.00x, fwd+bwd 3.00x, fwd graphed 3.00x, "
        "fwd+bwd graphed 3.00x",
        "per added layer, cuDNN tf32 / persistent fp32: fwd 2.00x, fwd+bwd 2.00x, fwd graphed 2.00x, "
        "fwd+bwd graphed 2.00x"]


def test_rnn_kernels_times_are_the_median_of_the_timed_calls_after_the_warm_up(monkeypatch):
    """median_ms, which benchmarks.rnn_stack times with too: the median of REPEATS calls' CUDA-event times, the WARMUP
    calls before them left out. A mean would move with one slow call, a warm-up counted with the first call's
    set-up."""
    clock, durations = [0.0], iter([1000.0] * rnn_kernels.WARMUP + [*range(1, rnn_kernels.REPEATS), 100.0])

    class Event:  # a CUDA event on a clock that each call moves on by its duration
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.at = clock[0]

        def elapsed_time(self, end):
            return end.at - self.at

    def call():
        clock[0] += next(durations)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert rnn_kernels.median_ms(call) == (rnn_kernels.REPEATS + 1) // 2  # 1 .. 14 and 100: 8
    assert next(durations, None) is None


def test_rnn_kernels_splits_the_kernels_time_into_a_prologue_and_a_cost_per_step():
    """kernel_only_fwd_marginal_us and _prologue_us from the kernel's times at 256 and 64 steps: 200 us and 10 us a
    step take 2.76 ms and 0.84 ms."""
    assert (rnn_kernels.NUM_STEPS, rnn_kernels.SHORT_STEPS) == (256, 64)
    assert rnn_kernels.kernel_only_split(2.76, 0.84) == {"kernel_only_fwd_marginal_us": pytest.approx(10.0),
                                                          "kernel_only_fwd_prologue_us": pytest.approx(200.0)}


def test_a_train_step_rows_gpu_time_is_its_kernels_time_per_call(monkeypatch):
    """gpu_ms_per_call, the table's "GPU ms" (how much of a step the GPU was busy), ran on a GPU alone: the
    profiler's CUDA time over all the calls, per call, in ms; its CPU events' time is the host's, not the GPU's."""
    calls = []

    class Profile:  # torch.profiler.profile, recording 3 ms of kernels a call and the host's time beside them
        def __init__(self, activities):
            assert activities == [torch.profiler.ProfilerActivity.CUDA]

        def __enter__(self):
            return self

        def __exit__(self, *exception):
            return False

        def key_averages(self):
            return [types.SimpleNamespace(device_type=torch.autograd.DeviceType.CUDA, device_time_total=1000.0 * n)
                    for n in (1, 2)] * len(calls) + [
                types.SimpleNamespace(device_type=torch.autograd.DeviceType.CPU, device_time_total=5e6)]

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert train_step.gpu_ms_per_call(lambda: calls.append(None), 4) == pytest.approx(3.0)
    assert len(calls) == 4
