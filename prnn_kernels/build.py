"""Just-in-time build of the persistent RNN CUDA extension, cached per source hash and GPU architecture.

The extension is compiled by `torch.utils.cpp_extension.load` for the GPU's own architecture only (explicit
-gencode, e.g. sm_90a on Hopper: the arch-specific target, whose multicast bulk copies the kernels use) into
$TORCH_EXTENSIONS_DIR/prnn_kernels/<name>, where the name carries the hash of every file in csrc/ and the
architecture: an edited kernel gets a fresh build, an unchanged one loads from the cache, and torch's build lock makes
concurrent ranks wait for one build instead of racing.

    python -m prnn_kernels.build [--arch 90a] [--if-gpu] [--verbose]

builds ahead of time, and on Hopper and later compiles the fp32 layers' 3xTF32 products into Triton's cache
(prnn_kernels.products), so that the ranks of a job find both ready (run it once before an `mpirun`; the launch
scripts do, with --if-gpu so that a CPU job starts too).
"""
import argparse
import functools
import hashlib
import os
import shutil
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
# Two binding files touch ATen (the persistent layers', the products'); the kernels compile in parallel, one
# precision and pass per file.
SOURCES = ("binding.cpp", "products.cpp", "plan.cpp", "fp32_forward.cu", "fp32_backward.cu", "bf16_forward.cu",
           "bf16_backward.cu", "k_major_copy.cu", "sequence_gather.cu")
CUDA_FLAGS = ("-O3", "-std=c++17", "-lineinfo")


def source_hash() -> str:
    """Hash of every source and header in csrc/ (names and contents)."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cu", ".cuh", ".cpp", ".h"):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def device_arch(device=None) -> str:
    """The architecture to build for a CUDA device, as nvcc spells it: its compute capability, arch-specific ("a")
    from Hopper on, e.g. "90a"."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}a" if major >= 9 else f"{major}{minor}"


def cuda_home() -> Path | None:
    """The CUDA toolkit to build with: $CUDA_HOME or $CUDA_PATH, else the one holding the nvcc on PATH, else
    /usr/local/cuda; only a directory with bin/nvcc and include/cuda_runtime.h counts."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent)
    candidates.append("/usr/local/cuda")
    for candidate in candidates:
        if candidate and (Path(candidate) / "bin" / "nvcc").exists():
            if (Path(candidate) / "include" / "cuda_runtime.h").exists():
                return Path(candidate)
    return None


def build_root() -> Path:
    default = Path.home() / ".cache" / "torch_extensions"
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR", default)) / "prnn_kernels"


@functools.lru_cache(maxsize=None)
def load_extension(arch: str | None = None, root: str | None = None, verbose: bool = False):
    """Builds (or loads from the cache) the extension for `arch` (default: the current GPU's) under `root`."""
    from torch.utils import cpp_extension

    home = cuda_home()
    if home is None:
        raise RuntimeError("prnn_kernels: no CUDA toolkit found (bin/nvcc and include/cuda_runtime.h); set CUDA_HOME")
    # torch guesses the toolkit from the nvcc on PATH, which can be a wrapper script outside it.
    cpp_extension.CUDA_HOME = str(home)
    arch = arch or device_arch()
    name = f"prnn_kernels_{source_hash()}_sm{arch}"
    directory = Path(root) if root else build_root()
    directory = directory / name
    directory.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(
            name=name,
            sources=[str(CSRC / source) for source in SOURCES],
            extra_cflags=["-O3"],
            extra_cuda_cflags=[*CUDA_FLAGS, f"-gencode=arch=compute_{arch},code=sm_{arch}"],
            build_directory=str(directory),
            verbose=verbose,
        )
    except (RuntimeError, OSError) as error:
        raise RuntimeError(
            f"prnn_kernels: could not build the persistent RNN CUDA extension for sm_{arch} in {directory}: {error}. "
            "It needs nvcc (set CUDA_HOME) and ninja; run `python -m prnn_kernels.build --verbose` to see the "
            "compiler output."
        ) from error


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", help="architecture as nvcc spells it, e.g. 90a (default: the current GPU's)")
    parser.add_argument("--if-gpu", action="store_true", help="with no --arch and no GPU visible, build nothing")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands and output")
    args = parser.parse_args(argv)
    if args.arch is None and not torch.cuda.is_available():
        if args.if_gpu:
            print("prnn_kernels.build: no CUDA GPU visible, nothing to build")
            return
        parser.error("no CUDA GPU is visible here: name the architecture to build for with --arch (e.g. 90a)")
    arch = args.arch or device_arch()
    module = load_extension(arch, verbose=args.verbose)
    print(f"built {module.__name__} from {module.__file__}")
    capability = int(arch.rstrip("a"))
    if capability >= 90:
        from prnn_kernels.products import compile_products

        try:
            compile_products(capability)
        except (ImportError, RuntimeError) as error:
            print(f"the fp32 layers' GEMMs will run on cuBLAS, not as 3xTF32 products: {error}")
        else:
            print(f"compiled the fp32 layers' 3xTF32 products for sm_{capability} into Triton's cache")


if __name__ == "__main__":
    main()
