"""Building the extension. The CUDA sources still compile for Hopper (sm_90a) with nvcc, and the fp32 products with
Triton, so CI catches a kernel that no longer builds; a finished build loads in later processes without a rebuild; the
build lock never outlives its holder.

The compile needs no GPU: `python -m prnn_kernels.build --arch 90a` into a temporary directory (about a minute), which
imports the extension (registering the operators' CUDA kernels with the dispatcher) and compiles the products.
"""
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT
from prnn_kernels import build
from prnn_kernels import persistent  # noqa: F401  declares the operators the extension registers CUDA kernels for

LOAD_FROM_CACHE = """
import prnn_kernels.persistent
from prnn_kernels import build
print(build.load_extension("90a").__file__)
"""

HOLD_LOCK = """
import sys, time
from pathlib import Path
from prnn_kernels.build import build_lock
with build_lock(Path(sys.argv[1])):
    print("holding", flush=True)
    time.sleep(600)
"""


@pytest.mark.skipif(build.cuda_home() is None, reason="no CUDA toolkit (bin/nvcc and cuda_runtime.h): set CUDA_HOME")
def test_extension_and_products_compile_for_hopper(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = f"prnn_kernels_{build.build_hash()}_sm90a"
    directory = tmp_path / "prnn_kernels" / name
    directory.mkdir(parents=True)
    # The lock file of a torch build killed midway: torch before 2.14 waits for as long as it exists.
    (directory / "lock").touch()
    build.main(["--arch", "90a"])
    output = capsys.readouterr().out
    assert f"built {name} from {directory}" in output, output
    assert "compiled the fp32 layers' 3xTF32 products for sm_90 into Triton's cache" in output, output
    module = build.load_extension("90a", verbose=False)  # the build above, from load_extension's cache
    assert {"support", "launch_plans", "load_product", "product"} <= set(dir(module))
    for operator in ("persistent_forward", "persistent_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"prnn_kernels::{operator}", "CUDA")

    # Another process imports the finished build as it is. The library now looks older than its objects, so running
    # ninja there (as torch's loader would) would link it again.
    library = directory / f"{name}.so"
    os.utime(library, (946684800, 946684800))
    result = subprocess.run([sys.executable, "-c", LOAD_FROM_CACHE], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == str(library)
    assert library.stat().st_mtime == 946684800


def test_a_wait_for_the_build_lock_names_the_lock_and_the_lock_dies_with_its_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "holding\n"
        with pytest.raises(RuntimeError, match=f"waited 1 s for another process building .* in {tmp_path} "
                                               f"\\(it holds {tmp_path / 'build.lock'}\\)"):
            with build.build_lock(tmp_path, timeout_s=1):
                pass
    finally:
        holder.kill()
        holder.wait()
    with build.build_lock(tmp_path, timeout_s=60):  # a killed holder leaves nothing behind that blocks
        pass


def test_a_ctrl_c_in_the_build_ends_it_in_one_line(tmp_path):
    """`python -m prnn_kernels.build` (the launch scripts' build step) ends on a terminal's Ctrl-C as the tools do, in
    one line and exit code 130, not in a traceback from inside the build: here as it waits for another process's
    build (a minute of nvcc on a GPU node, where a Ctrl-C is likeliest)."""
    directory = tmp_path / "prnn_kernels" / f"prnn_kernels_{build.build_hash()}_sm90a"
    directory.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(directory)], stdout=subprocess.PIPE, text=True)
    builder = None
    try:
        assert holder.stdout.readline() == "holding\n"
        builder = subprocess.Popen([sys.executable, "-m", "prnn_kernels.build", "--arch", "90a"], cwd=REPO_ROOT,
                                   env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)},
                                   stderr=subprocess.PIPE, text=True, start_new_session=True)
        waiting = builder.stderr.readline()
        assert waiting.startswith("prnn_kernels: waiting for another process building"), waiting
        os.killpg(builder.pid, signal.SIGINT)  # as a terminal's Ctrl-C, to the whole foreground group
        stderr = builder.communicate(timeout=60)[1]
    finally:
        holder.kill()
        holder.wait()
        if builder is not None and builder.poll() is None:
            builder.kill()
    assert (builder.returncode, stderr) == (130, "interrupted by Ctrl-C\n"), stderr


def test_the_readme_names_every_flag_of_the_build(capsys):
    """README's Building ahead of time gives every flag python -m prnn_kernels.build takes: --verbose was in no
    document."""
    with pytest.raises(SystemExit):
        build.main(["--help"])
    usage = capsys.readouterr().out.split("\n\n")[0]
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("### Building ahead of time\n")[1].split("\n### ")[0]
    assert set(re.findall(r"--[\w-]+", usage)) - {"--help"} - set(re.findall(r"--[\w-]+", section)) == set()


@pytest.mark.parametrize("arch", ["9.0", "sm_90a", "90", "80a", "100f", "090a", ""])
def test_an_arch_the_kernels_cannot_be_built_for_is_refused_by_name(arch, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build.main(["--arch", arch])
    assert exit_info.value.code == 2
    assert f"argument --arch: {arch!r} is not an arch-specific target from Hopper on" in capsys.readouterr().err


@pytest.mark.skipif(build.cuda_home() is None, reason="needs a CUDA toolkit (nvcc)")
def test_an_arch_the_toolkit_does_not_know_is_refused_before_the_build(tmp_path):
    known = build.nvcc_architectures(build.cuda_home())
    assert "90" in known
    with pytest.raises(RuntimeError, match=r"cannot build for sm_95a; it knows .*\b90\b"):
        build._build("prnn_kernels_x_sm95a", tmp_path, "95a", verbose=False)
    assert not any(tmp_path.iterdir())  # refused before nvcc ran


def test_the_build_targets_the_arch_specific_variant_from_hopper_on(monkeypatch):
    """The kernels' register reallocation and multicast bulk copies exist only in sm_90a and later arch-specific
    targets; plain sm_90 does not compile them. The capability is the GPU's answer, played here."""
    for capability, arch in [((9, 0), "90a"), ((10, 0), "100a"), ((12, 0), "120a"), ((8, 9), "89"), ((8, 0), "80")]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, capability=capability: capability)
        assert build.device_arch() == arch


def test_the_cache_key_names_the_python_the_extension_is_a_module_of(monkeypatch):
    key = build.build_hash()
    real = build.sysconfig.get_config_var
    monkeypatch.setattr(build.sysconfig, "get_config_var",
                        lambda name: ".cpython-313t-x86_64-linux-gnu.so" if name == "EXT_SUFFIX" else real(name))
    assert build.build_hash() != key


@pytest.mark.parametrize("edited", ["fp32_forward.cu", "binding.cpp", "sync.cuh", "persistent_rnn.h"])
def test_the_cache_key_changes_with_any_source_or_header_and_with_the_flags(edited, tmp_path, monkeypatch):
    """An edited kernel, or one of the headers the kernels include, gets a fresh build: a key that missed it loaded
    the old library from the cache, and the edit silently did nothing. A copy of csrc/ is edited, not the sources."""
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    monkeypatch.setattr(build, "CSRC", csrc)
    key = build.build_hash()
    assert build.build_hash() == key  # the same sources, the same key
    with (csrc / edited).open("a") as source:
        source.write("\n// edited\n")
    edited_key = build.build_hash()
    assert edited_key != key, f"an edit of {edited} kept the cache key"
    changed_keys = set()
    # A source left out of the build is still in csrc/, so its contents alone kept the key.
    for module, attribute, value in [(build, "CUDA_FLAGS", (*build.CUDA_FLAGS, "-G")), (build, "C_FLAGS", ("-O0",)),
                                     (build, "SOURCES", build.SOURCES[:-1]), (torch, "__version__", "2.99.0"),
                                     (torch.version, "cuda", "99.0")]:
        monkeypatch.setattr(module, attribute, value)
        changed_keys.add(build.build_hash())
    assert edited_key not in changed_keys and len(changed_keys) == 5, "a flag, a source or a version kept the cache key"


def test_the_cache_key_changes_with_text_moved_from_one_source_into_the_next(tmp_path, monkeypatch):
    """The sources' names go into the key, not their contents alone, whose concatenation text moved from the end of
    one file to the start of the next (in sorted order) leaves as it was."""
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    monkeypatch.setattr(build, "CSRC", csrc)
    key = build.build_hash()
    first, second = csrc / "bf16_backward.cu", csrc / "bf16_forward.cu"
    text = first.read_bytes()
    first.write_bytes(text[:-1])
    second.write_bytes(text[-1:] + second.read_bytes())
    assert build.build_hash() != key


def test_the_build_cache_is_where_torch_puts_its_extensions(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert build.build_root() == tmp_path / "cache" / "torch_extensions" / "prnn_kernels"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    assert build.build_root() == tmp_path / "extensions" / "prnn_kernels"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert build.build_root() == tmp_path / ".cache" / "torch_extensions" / "prnn_kernels"


def test_a_cached_extension_that_does_not_load_says_to_remove_it(tmp_path):
    (tmp_path / "prnn_kernels_x_sm90a.so").write_bytes(b"\x7fELF too short")
    for name in ("prnn_kernels_x_sm90a", "prnn_kernels_missing_sm90a"):
        with pytest.raises(RuntimeError, match=f"does not load .*; remove {tmp_path} to build it again"):
            build._import_built(name, tmp_path)


def test_a_cuda_home_that_is_no_toolkit_is_named_when_passed_over(tmp_path, monkeypatch, caplog):
    # An nvcc without the toolkit's headers beside it (a wrapper script, as /usr/local/bin/nvcc): no toolkit either.
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").touch(mode=0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert build.cuda_home() != tmp_path
    assert f"CUDA_HOME={tmp_path} is no CUDA toolkit" in caplog.text


def test_the_toolkit_is_cuda_home_then_cuda_path_then_the_nvcc_on_path(tmp_path, monkeypatch):
    # Whatever else the machine has (/usr/local/cuda here): a toolkit the user named, or put first on PATH, is used.
    def toolkit(name: str) -> Path:
        folder = tmp_path / name
        (folder / "bin").mkdir(parents=True)
        (folder / "include").mkdir()
        (folder / "bin" / "nvcc").touch(mode=0o755)
        (folder / "include" / "cuda_runtime.h").touch()
        return folder

    on_path, cuda_path, cuda_home = toolkit("on_path"), toolkit("cuda_path"), toolkit("cuda_home")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvcc: the default place, where it holds a toolkit
    usual = Path("/usr/local/cuda")
    has_toolkit = (usual / "bin" / "nvcc").exists() and (usual / "include" / "cuda_runtime.h").exists()
    assert build.cuda_home() == (usual if has_toolkit else None)
    monkeypatch.setenv("PATH", f"{on_path / 'bin'}{os.pathsep}{path}")
    assert build.cuda_home() == on_path
    monkeypatch.setenv("CUDA_PATH", str(cuda_path))
    assert build.cuda_home() == cuda_path
    monkeypatch.setenv("CUDA_HOME", str(cuda_home))
    assert build.cuda_home() == cuda_home


@pytest.fixture
def broken_toolkit(tmp_path, monkeypatch):
    """CUDA_HOME names a toolkit whose nvcc knows sm_90 and sm_100 but fails every compile, and whose include/ lacks
    the cuda.h that the C++ sources include; the build cache is in tmp_path."""
    from torch.utils import cpp_extension

    toolkit = tmp_path / "toolkit"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "include").mkdir()
    (toolkit / "include" / "cuda_runtime.h").touch()
    nvcc = toolkit / "bin" / "nvcc"
    nvcc.write_text('#!/bin/sh\n[ "$1" = --list-gpu-arch ] && printf "compute_90\\ncompute_100\\n" && exit 0\n'
                    'echo "rnn.cu(7): error: identifier undefined"; exit 1\n')
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", cpp_extension.CUDA_HOME)  # the build points it at the toolkit


def test_a_failed_build_is_one_line_naming_its_first_error(broken_toolkit):
    """torch's error holds the build's whole output (33 lines here, every command and compiler message), which auto's
    fallback warning and the persistent backend's refusal repeated."""
    with pytest.raises(RuntimeError) as failure:
        # An arch-specific target, as the kernels' builds are, which the toolkit lists without its "a" (compute_90).
        build.load_extension.__wrapped__("90a")
    message = str(failure.value)
    assert len(message.splitlines()) == 1 and len(message) < 800, message
    assert "error" in message.split("for sm_90a in ")[1] and "build --verbose` to see the compiler output" in message


def test_the_architectures_the_toolkit_knows_are_read_from_its_nvcc(broken_toolkit):
    assert build.nvcc_architectures(build.cuda_home()) == {"90", "100"}  # Blackwell's three digits too


def test_a_build_without_its_cpp_compiler_names_the_missing_compiler(broken_toolkit, tmp_path, monkeypatch):
    """The shell's "not found" names no error, so the one line was the first compile's command, cut off before it
    said what failed, and then named nvcc and ninja as what the build needs."""
    missing = tmp_path / "no-such-compiler" / "c++"
    monkeypatch.setenv("CXX", str(missing))
    with pytest.raises(RuntimeError) as failure:
        build.load_extension.__wrapped__("90")
    message = str(failure.value)
    assert len(message.splitlines()) == 1, message
    assert f"{missing}: not found. It needs nvcc (set CUDA_HOME), a C++ compiler (CXX) and ninja" in message, message


def test_a_build_whose_host_compiler_is_missing_names_it():
    """nvcc given a CC that does not exist (torch passes it as -ccbin) names no error and no shell: the one line was
    the first command of torch's output, cut off before it said what failed. The output of such a build, shortened."""
    output = RuntimeError(
        "Error building extension 'prnn_kernels_fb72fe2309720899_sm90a': [1/7] /usr/local/cuda/bin/nvcc -MD -MF "
        "fp32_backward.cuda.o.d -ccbin /opt/gcc-13/bin/gcc -DTORCH_EXTENSION_NAME=prnn_kernels_fb72fe2309720899_sm90a"
        " -c fp32_backward.cu -o fp32_backward.cuda.o\nFAILED: fp32_backward.cuda.o \n/usr/local/cuda/bin/nvcc -MD -MF "
        "fp32_backward.cuda.o.d -ccbin /opt/gcc-13/bin/gcc -c fp32_backward.cu -o fp32_backward.cuda.o\n"
        "/opt/gcc-13/bin/gcc: No such file or directory\n"
        "nvcc fatal   : Failed to preprocess host compiler properties.\nninja: build stopped: subcommand failed.\n")
    assert build.first_build_error(output) == "/opt/gcc-13/bin/gcc: No such file or directory"
    only_nvcc_says = RuntimeError(str(output).replace("/opt/gcc-13/bin/gcc: No such file or directory\n", ""))
    assert build.first_build_error(only_nvcc_says) == "nvcc fatal   : Failed to preprocess host compiler properties."


def test_a_build_error_of_a_thousand_characters_is_cut_short():
    # A template's instantiation names every argument in nvcc's error line; auto's one warning would repeat it all.
    error = RuntimeError(f"Error building extension 'x'\nfp32_forward.cu(12): error: no instance of {'T' * 1000}\n")
    assert build.first_build_error(error) == f"fp32_forward.cu(12): error: no instance of {'T' * 1000}"[:300]


def test_a_build_whose_library_does_not_load_is_a_reason_not_a_crash(broken_toolkit, monkeypatch):
    """torch's loader raises ImportError where the finished library does not load (built against a toolkit whose CUDA
    runtime this machine lacks); it escaped the support query, so backend auto ended the run instead of using cuDNN.
    The loader is played here, as building for real takes minutes."""
    from torch.utils import cpp_extension

    def load_that_fails_to_import(**arguments):
        raise ImportError("libcudart.so.13: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(cpp_extension, "load", load_that_fails_to_import)
    with pytest.raises(RuntimeError) as failure:
        build.load_extension.__wrapped__("90")
    message = str(failure.value)
    # Not "could not build ... It needs nvcc, a C++ compiler and ninja": all three did their part.
    assert message.endswith(" does not load: libcudart.so.13: cannot open shared object file: No such file or "
                            "directory. Build it with a CUDA toolkit (CUDA_HOME) of the CUDA that torch was built "
                            f"with, {torch.version.cuda}."), message


def test_a_build_without_a_toolkit_ends_in_its_reason_and_under_if_gpu_lets_the_job_start(tmp_path, monkeypatch,
                                                                                             capsys):
    """A traceback ended `python -m prnn_kernels.build`, and with it the launch scripts (set -e), on a Hopper machine
    without nvcc, where backend auto would have trained on cuDNN."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(build, "cuda_home", lambda: None)
    monkeypatch.setattr(build, "load_extension", build.load_extension.__wrapped__)  # not the compile test's module
    with pytest.raises(SystemExit) as exit_info:
        build.main(["--arch", "90a"])
    assert exit_info.value.code == "prnn_kernels: no CUDA toolkit found (bin/nvcc and include/cuda_runtime.h); set " \
                                   "CUDA_HOME"  # printed alone to stderr by Python, exit code 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(build, "device_arch", lambda: "90a")
    build.main(["--if-gpu"])  # returns: exit code 0
    assert capsys.readouterr().err.splitlines()[-2:] == [
        "prnn_kernels: no CUDA toolkit found (bin/nvcc and include/cuda_runtime.h); set CUDA_HOME",
        "the recurrent layers will run on cuDNN under backend auto; backend persistent will refuse to run"]


def test_a_build_cache_that_cannot_be_written_is_a_reason_not_a_crash(tmp_path, monkeypatch):
    """An OSError escaped the support query, so backend auto ended the run instead of falling back on cuDNN."""
    not_a_folder = tmp_path / "extensions"
    not_a_folder.write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(not_a_folder))
    with pytest.raises(RuntimeError, match=f"cannot build the CUDA extension in {not_a_folder}/prnn_kernels/.*: Not a "
                                           "directory; set TORCH_EXTENSIONS_DIR to a folder this process can write"):
        build.load_extension.__wrapped__("90a")  # not the compile test's module, which load_extension's cache holds


def test_if_gpu_on_a_machine_without_a_gpu_the_kernels_run_on_builds_nothing_and_lets_the_job_start(monkeypatch,
                                                                                                  capsys):
    """The launch scripts run `python -m prnn_kernels.build --if-gpu` before every job, CPU jobs too: an exit there
    (set -e) would keep a CPU job, or one on a GPU older than Hopper, from starting."""
    monkeypatch.setattr(build, "load_extension", lambda *arguments, **options: pytest.fail("a build was tried"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    build.main(["--if-gpu"])  # returns: exit code 0
    assert capsys.readouterr().out == "prnn_kernels.build: no CUDA GPU is visible here, nothing to build\n"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(build, "device_arch", lambda: "80")
    build.main(["--if-gpu"])
    assert capsys.readouterr().out == ("prnn_kernels.build: this GPU (sm_80) is older than Hopper, which the "
                                       "persistent kernels need, nothing to build\n")
    with pytest.raises(SystemExit) as exit_info:  # without --if-gpu: a usage error naming --arch
        build.main([])
    assert exit_info.value.code == 2 and "name the architecture to build for with --arch" in capsys.readouterr().err


def test_a_build_another_process_finished_while_this_one_waited_is_imported_not_built_again(tmp_path, monkeypatch):
    """The ranks of a job on one machine wait on the build lock for the first one's build; each must then import that
    build, not build it again (a minute each, in the folder the others are importing from). A build for another
    architecture is not that one: its library holds code for its own architecture only."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))

    @contextlib.contextmanager
    def lock_released_after_another_build(directory):
        (directory / "built").write_text("done\n")  # what the other process wrote before releasing the lock
        yield

    monkeypatch.setattr(build, "build_lock", lock_released_after_another_build)
    monkeypatch.setattr(build, "_build", lambda *arguments: pytest.fail("built again"))
    monkeypatch.setattr(build, "_import_built", lambda name, directory: ("imported", name, directory))
    imported, name, directory = build.load_extension.__wrapped__("90a")
    assert imported == "imported" and directory == build.build_root() / name
    # A name without the architecture would give a Blackwell machine sharing a home folder with a Hopper one the
    # Hopper build, whose kernels do not run there.
    assert [build.load_extension.__wrapped__(arch)[1] for arch in ("90a", "100a")] == [
        f"prnn_kernels_{build.build_hash()}_sm90a", f"prnn_kernels_{build.build_hash()}_sm100a"]


def test_a_finished_build_is_imported_by_later_processes_not_built_again(tmp_path, monkeypatch):
    """A build marks its folder finished; without the mark every later process would build again through torch's
    loader (a minute each where the sources' paths or times differ from the last build's). The compiler is played
    here, as building for real takes minutes; each call of the unwrapped load_extension is what a new process does."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_build", lambda name, directory, arch, verbose: "built")
    monkeypatch.setattr(build, "_import_built", lambda name, directory: "imported")
    assert [build.load_extension.__wrapped__("90a") for _ in range(2)] == ["built", "imported"]


def test_the_build_compiles_the_products_for_its_arch_and_leaves_them_to_cublas_where_triton_fails(monkeypatch,
                                                                                                    capsys):
    """The products are compiled for the architecture built for (sm_100 for 100a), and a Triton that cannot compile
    them, whose errors are no RuntimeError, is one line, not a traceback that ends the launch scripts. The extension's
    build and Triton are played here, as compiling for real takes minutes."""
    from prnn_kernels import products

    class CompilationError(Exception):  # as Triton's own
        pass

    def triton_that_fails(capability):
        raise CompilationError(f"at 1:0: no TMA for sm_{capability}")

    monkeypatch.setattr(build, "load_extension", lambda arch, verbose: types.SimpleNamespace(
        __name__=f"prnn_kernels_x_sm{arch}", __file__=f"/cache/prnn_kernels_x_sm{arch}.so"))
    compiled = []
    monkeypatch.setattr(products, "compile_products", compiled.append)
    build.main(["--arch", "100a"])
    assert compiled == [100]
    assert capsys.readouterr().out.splitlines()[-1] == ("compiled the fp32 layers' 3xTF32 products for sm_100 into "
                                                        "Triton's cache")
    monkeypatch.setattr(products, "compile_products", triton_that_fails)
    build.main(["--arch", "100a"])  # returns: exit code 0
    assert capsys.readouterr().out.splitlines()[-1] == ("the fp32 layers' GEMMs will run on cuBLAS, not as 3xTF32 "
                                                        "products: at 1:0: no TMA for sm_100")
