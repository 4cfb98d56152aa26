"""Finds the CUDA toolkit, one way for setup.py, scripts/*.sh and the tests. Stand-alone (setup.py
loads it before the package is built); run as a script it prints the toolkit's root, or nothing
with exit status 1 when there is none."""
import os
import shutil
import sys


def find_cuda_home():
    """The first of $CUDA_HOME, $CUDA_PATH, /usr/local/cuda and the folder above the real path of
    the nvcc on PATH that holds bin/nvcc and include/cuda_runtime.h, or None.

    The real path, not the folder above the nvcc found: a bare `nvcc` on PATH may be a wrapper script
    (/usr/local/bin/nvcc, say), whose folder above has no headers or libraries."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for root in candidates:
        if root and os.path.isfile(os.path.join(root, "bin", "nvcc")) and os.path.isfile(
            os.path.join(root, "include", "cuda_runtime.h")
        ):
            return root
    return None


if __name__ == "__main__":
    found = find_cuda_home()
    if found is None:
        sys.exit(1)
    print(found)
