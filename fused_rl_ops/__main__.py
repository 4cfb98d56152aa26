"""`python -m fused_rl_ops`: what this installation was built with and which kernels it has."""
import torch

from . import _build_info
from ._library import cpu_isa


def kernel_table() -> list:
    """(op, has CPU kernel, has CUDA kernel) for every fused_rl_ops operator."""
    names = sorted(op for op in torch._C._dispatch_get_all_op_names() if op.startswith("fused_rl_ops::"))
    return [(name.split("::")[1], *(torch._C._dispatch_has_kernel_for_dispatch_key(name, key) for key in ("CPU", "CUDA")))
            for name in names]


def main():
    print(f"fused_rl_ops {_build_info.VERSION}")
    print(f"built against torch {_build_info.TORCH}, CUDA {_build_info.CUDA or '- (CPU kernels only)'}")
    print(f"CUDA architectures: {_build_info.CUDA_ARCHS or '-'}")
    print(f"CPU row kernels: built for {', '.join(_build_info.ROW_KERNEL_ISAS)}, running {cpu_isa()}")
    print(f"running with torch {torch.__version__}, CUDA device: "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
    rows = kernel_table()
    width = max(len(name) for name, _, _ in rows)
    print(f"\n{'op'.ljust(width)}  CPU  CUDA")
    for name, cpu, cuda in rows:
        print(f"{name.ljust(width)}  {'yes' if cpu else 'no ':3}  {'yes' if cuda else 'no'}")


if __name__ == "__main__":
    main()
