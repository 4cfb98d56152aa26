"""The CUDA kernels run on the CPU under sanitizers: the cases per op (Python) and the drivers (C++)."""
