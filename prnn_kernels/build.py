"""Just-in-time build of the persistent RNN CUDA extension, cached per source hash and GPU architecture.

The extension is compiled by `torch.utils.cpp_extension.load` for the GPU's own architecture only (explicit -gencode,
e.g. sm_90a on Hopper: the arch-specific target, whose multicast bulk copies the kernels use) into
$TORCH_EXTENSIONS_DIR/prnn_kernels/<name> (build_root), where the name carries a hash of everything the build depends on
(the sources and headers in csrc/, the flags, torch's and CUDA's versions, the Python's extension suffix) and the
architecture. An edited kernel gets a fresh build; an unchanged one, once built, is imported straight from the cache:
torch's loader would run ninja again, which rebuilds everything (about a minute) whenever the sources' paths or times
differ from the last build's (a second checkout, a fresh copy), even though the name proves their contents the same. One
process builds while the others wait on a lock that the operating system releases if its holder dies: torch before 2.14
locks the build with a file whose mere existence blocks, and a rank killed mid-build left every later process of the
machine waiting on it forever.

    python -m prnn_kernels.build [--arch 90a] [--if-gpu] [--verbose]

builds ahead of time, and on Hopper and later compiles the fp32 layers' 3xTF32 products into Triton's cache
(prnn_kernels.products), so that the ranks of a job find both ready (run it once before an `mpirun`; the launch
scripts do, with --if-gpu so that a CPU job starts too, and a job where the extension cannot be built, which backend
auto runs on cuDNN). A build that cannot be done (no CUDA toolkit, a compiler error) ends in its reason, exit code 1.
"""
import argparse
import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import filelock
import torch

CSRC = Path(__file__).resolve().parent / "csrc"
# Two binding files touch ATen (the persistent layers', the products'); the kernels compile in parallel, one
# precision and pass per file.
SOURCES = ("binding.cpp", "products.cpp", "plan.cpp", "fp32_forward.cu", "fp32_backward.cu", "bf16_forward.cu",
           "bf16_backward.cu", "k_major_copy.cu", "sequence_gather.cu")
C_FLAGS = ("-O3",)
CUDA_FLAGS = ("-O3", "-std=c++17", "-lineinfo")
# How long a process waits for another one's build before it gives up and says so (a build takes one to two minutes).
BUILD_WAIT_S = 1800.0

log = logging.getLogger(__name__)


def build_hash() -> str:
    """Hash of everything a build depends on: every source and header in csrc/ (names and contents), the flags, the
    versions of torch and of the CUDA it was built with (a library built against one torch does not load in another),
    and the Python it is a module of."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cu", ".cuh", ".cpp", ".h"):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    # EXT_SUFFIX names the CPython and its ABI (cpython-312-x86_64-linux-gnu, a free-threaded build's "t"): the library
    # is a Python module of one interpreter.
    digest.update(repr((SOURCES, C_FLAGS, CUDA_FLAGS, torch.__version__, torch.version.cuda,
                        sysconfig.get_config_var("EXT_SUFFIX"))).encode())
    return digest.hexdigest()[:16]


def device_arch() -> str:
    """The architecture to build for the current CUDA device, as nvcc spells it: its compute capability,
    arch-specific ("a") from Hopper on, e.g. "90a"."""
    major, minor = torch.cuda.get_device_capability()
    return f"{major}{minor}a" if major >= 9 else f"{major}{minor}"


def cuda_home() -> Path | None:
    """The CUDA toolkit to build with, the first that has bin/nvcc and include/cuda_runtime.h: $CUDA_HOME, $CUDA_PATH
    (either, set but lacking them, is named in a warning), the one holding the nvcc on PATH, /usr/local/cuda."""
    def is_toolkit(folder: Path) -> bool:
        return (folder / "bin" / "nvcc").exists() and (folder / "include" / "cuda_runtime.h").exists()

    for variable in ("CUDA_HOME", "CUDA_PATH"):
        named = os.environ.get(variable)
        if named and is_toolkit(Path(named)):
            return Path(named)
        if named:  # the user's choice, passed over: say so, so that another toolkit is no surprise
            log.warning("prnn_kernels: %s=%s is no CUDA toolkit (it lacks bin/nvcc or include/cuda_runtime.h); "
                        "looking for another", variable, named)
    nvcc = shutil.which("nvcc")
    candidates = [Path(nvcc).resolve().parent.parent] if nvcc else []
    return next((folder for folder in [*candidates, Path("/usr/local/cuda")] if is_toolkit(folder)), None)


def build_root() -> Path:
    """Where torch's own extensions go: $TORCH_EXTENSIONS_DIR, else torch_extensions in the user's cache folder
    ($XDG_CACHE_HOME, else ~/.cache)."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    default = Path(cache) / "torch_extensions"
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or default) / "prnn_kernels"


@functools.lru_cache(maxsize=None)
def load_extension(arch: str | None = None, verbose: bool = False):
    """Builds (or loads from the cache under build_root()) the extension for `arch` (default: the current GPU's)."""
    arch = arch or device_arch()
    name = f"prnn_kernels_{build_hash()}_sm{arch}"
    directory = build_root() / name
    built = directory / "built"  # written once the library is complete, never before
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not built.exists():
            with build_lock(directory):
                if not built.exists():  # else another process built it while this one waited
                    module = _build(name, directory, arch, verbose)
                    built.write_text(f"{name}.so\n")
                    return module
    except OSError as error:  # a RuntimeError, as for any other build that cannot be done: "auto" runs cuDNN
        raise RuntimeError(f"prnn_kernels: cannot build the CUDA extension in {directory}: "
                           f"{error.strerror or error}; set TORCH_EXTENSIONS_DIR to a folder this process can write"
                           ) from error
    return _import_built(name, directory)


@contextlib.contextmanager
def build_lock(directory: Path, timeout_s: float = BUILD_WAIT_S):
    """Held by the one process that builds in `directory`. The operating system releases it when its holder exits,
    however it exits; a process that waits longer than `timeout_s` raises, naming the lock."""
    lock = filelock.FileLock(directory / "build.lock")
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        log.warning("prnn_kernels: waiting for another process building the CUDA extension in %s", directory)
        try:
            lock.acquire(timeout=timeout_s)
        except filelock.Timeout:
            raise RuntimeError(
                f"prnn_kernels: waited {timeout_s:.0f} s for another process building the CUDA extension in "
                f"{directory} (it holds {lock.lock_file}); if no build is running there, that process is stuck: end it"
            ) from None
    try:
        yield
    finally:
        lock.release()


def _build(name: str, directory: Path, arch: str, verbose: bool):
    from torch.utils import cpp_extension

    home = cuda_home()
    if home is None:
        raise RuntimeError("prnn_kernels: no CUDA toolkit found (bin/nvcc and include/cuda_runtime.h); set CUDA_HOME")
    known = nvcc_architectures(home)
    if known and arch.rstrip("a") not in known:  # else nvcc fails only after the build has started
        raise RuntimeError(f"prnn_kernels: the nvcc of {home} cannot build for sm_{arch}; it knows "
                           f"{', '.join(sorted(known, key=int))}")
    # torch guesses the toolkit from the nvcc on PATH, which can be a wrapper script outside it.
    cpp_extension.CUDA_HOME = str(home)
    # torch's own lock for this directory: under build_lock no other process is inside torch's loader here, so a lock
    # file left there is stale (torch before 2.14 waits as long as one exists) or unused (from 2.14 it is a lock the
    # operating system holds, none now).
    (directory / "lock").unlink(missing_ok=True)
    try:
        return cpp_extension.load(
            name=name,
            sources=[str(CSRC / source) for source in SOURCES],
            extra_cflags=list(C_FLAGS),
            extra_cuda_cflags=[*CUDA_FLAGS, f"-gencode=arch=compute_{arch},code=sm_{arch}"],
            build_directory=str(directory),
            verbose=verbose,
        )
    except ImportError as error:  # built, but its library does not load: nvcc, compiler and ninja did their part
        raise RuntimeError(
            f"prnn_kernels: the persistent RNN CUDA extension built for sm_{arch} in {directory} does not load: "
            f"{first_build_error(error)}. Build it with a CUDA toolkit (CUDA_HOME) of the CUDA that torch was built "
            f"with, {torch.version.cuda}."
        ) from error
    except (RuntimeError, OSError) as error:
        raise RuntimeError(
            f"prnn_kernels: could not build the persistent RNN CUDA extension for sm_{arch} in {directory}: "
            f"{first_build_error(error)}. It needs nvcc (set CUDA_HOME), a C++ compiler (CXX) and ninja; run "
            "`python -m prnn_kernels.build --verbose` to see the compiler output."
        ) from error


def first_build_error(error: Exception) -> str:
    """A failed build's error in one line: the first line of its output that names an error, nvcc's fatal one, or a
    program the shell or nvcc did not find (a compiler missing: "/bin/sh: 1: c++: not found", or a CC that nvcc runs
    as its host compiler: "/opt/gcc-13/bin/gcc: No such file or directory"), else its first line. torch puts the whole
    output in it (every command and compiler message), which `auto`'s one warning and the persistent backend's refusal
    would repeat; the verbose build shows it."""
    lines = str(error).splitlines() or [repr(error)]
    named = [line.strip() for line in lines[1:]
             if re.search(r"\berror\b|^nvcc fatal\b|^/bin/sh: .*not found$|: No such file or directory$", line.strip(),
                          re.IGNORECASE)]
    return (named[0] if named else lines[0])[:300]


def nvcc_architectures(home: Path) -> set[str]:
    """The compute capabilities the toolkit's nvcc builds for ("90", "100", ...); empty if it cannot say."""
    try:
        listing = subprocess.run([str(home / "bin" / "nvcc"), "--list-gpu-arch"], capture_output=True, text=True,
                                 timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    return set(re.findall(r"compute_(\d+)", listing))


def _import_built(name: str, directory: Path):
    """Imports the library a finished build left in `directory` (what torch's loader does after its build step)."""
    library = directory / f"{name}.so"
    spec = importlib.util.spec_from_file_location(name, library)
    try:
        module = importlib.util.module_from_spec(spec)  # loads the library: a missing or damaged one fails here
        spec.loader.exec_module(module)
    except (ImportError, OSError) as error:
        raise RuntimeError(
            f"prnn_kernels: the cached CUDA extension {library} does not load ({error}); remove {directory} to build "
            "it again"
        ) from error
    return module


def hopper_or_later_arch(text: str) -> str:
    """--arch: an arch-specific target from Hopper on (90a, 100a), which the kernels' register reallocation
    (setmaxnreg) and multicast bulk copies need."""
    match = re.fullmatch(r"([1-9]\d{1,2})a", text)
    if match is None or int(match[1]) < 90:
        raise argparse.ArgumentTypeError(f"{text!r} is not an arch-specific target from Hopper on, such as 90a")
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m prnn_kernels.build", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=hopper_or_later_arch,
                        help="architecture as nvcc spells it, e.g. 90a (default: the current GPU's)")
    parser.add_argument("--if-gpu", action="store_true",
                        help="with no --arch and no GPU visible that runs the kernels, build nothing; a build that "
                             "fails is reported and exits 0, so that a job on backend auto starts (on cuDNN)")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands and output")
    args = parser.parse_args(argv)
    arch, reason = args.arch, None
    if arch is None:
        if not torch.cuda.is_available():
            reason = "no CUDA GPU is visible here"
        else:
            try:
                arch = hopper_or_later_arch(device_arch())
            except argparse.ArgumentTypeError:
                reason = f"this GPU (sm_{device_arch()}) is older than Hopper, which the persistent kernels need"
        if reason is not None:
            if args.if_gpu:
                print(f"prnn_kernels.build: {reason}, nothing to build")
                return
            parser.error(f"{reason}: name the architecture to build for with --arch (e.g. 90a)")
    try:
        module = load_extension(arch, verbose=args.verbose)
    except RuntimeError as error:
        if args.if_gpu:  # the launch scripts' call: backend auto runs on cuDNN without the extension
            print(f"{error}\nthe recurrent layers will run on cuDNN under backend auto; backend "
                  "persistent will refuse to run", file=sys.stderr)
            return
        sys.exit(str(error))
    print(f"built {module.__name__} from {module.__file__}")
    from prnn_kernels.products import compile_products

    capability = int(arch.rstrip("a"))
    try:
        compile_products(capability)
    except Exception as error:  # Triton's own errors (a compilation, its cache) are no RuntimeError
        print(f"the fp32 layers' GEMMs will run on cuBLAS, not as 3xTF32 products: {error}")
    else:
        print(f"compiled the fp32 layers' 3xTF32 products for sm_{capability} into Triton's cache")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the tools' line and exit code (data.cli's, which prnn_kernels does not import)
        print("interrupted by Ctrl-C", file=sys.stderr)
        sys.exit(130)
