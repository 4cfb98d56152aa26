"""Compile gate: every CUDA source compiles for sm_80, sm_90 and sm_100 with warnings as errors, no kernel
spills registers (read from ptxas's resource report), and every kernel is in namespace fused_rl_ops (the
filter of gpu_check.sh's racecheck and synccheck); the vector paths store vectors (the sm_90 SASS,
read with cuobjdump). Needs nvcc, not a GPU."""
import glob
import os
import re
import shutil
import subprocess

import pytest

from fused_rl_ops._cuda_home import find_cuda_home
from tests.helpers.background import background_compiles

CSRC = os.path.join(os.path.dirname(__file__), "..", "..", "csrc")
CU_FILES = sorted(glob.glob(os.path.join(CSRC, "*", "kernel.cu")))
# The architectures gated: A100's, H100 / H200's and B200's.
GATED_ARCHS = ("sm_80", "sm_90", "sm_100")

pytestmark = pytest.mark.stack_independent


def nvcc_path():
    home = find_cuda_home()
    return os.path.join(home, "bin", "nvcc") if home else None


def cuobjdump_path():
    """The toolkit's cuobjdump, the one on PATH, or the copy Triton ships (a toolkit without it)."""
    home = find_cuda_home()
    candidates = [os.path.join(home, "bin", "cuobjdump") if home else None, shutil.which("cuobjdump")]
    try:
        import triton
        candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    except ImportError:
        pass
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def compile_object(source, out, csrc=CSRC, arch="sm_90"):
    """nvcc -c of source for arch into out as the gate compiles it: (the CompletedProcess, whose stderr
    holds ptxas's report; out)."""
    return subprocess.run(
        [nvcc_path(), "-std=c++17", "-O3", "--fmad=false", f"-arch={arch}", "-Werror", "all-warnings", "-Xptxas", "-v",
         f"-I{csrc}", "-c", str(source), "-o", str(out)],
        capture_output=True, text=True,
    ), out


def op_of(source):
    return os.path.basename(os.path.dirname(source))


def gate_compile(out_dir, op, arch):
    """(key, compile, *args) of op's kernel.cu compiled for arch into out_dir, as a BackgroundCompiles queues it."""
    return (op, arch), compile_object, os.path.join(CSRC, op, "kernel.cu"), out_dir / f"{op}_{arch}.o", CSRC, arch


class GateObjects:
    """Each op's kernel.cu compiled for an architecture as the gate compiles it, once, in the
    background (tests.helpers.background)."""

    def __init__(self, out_dir, compiles):
        self.out_dir, self.compiles = out_dir, compiles

    def get(self, op, arch="sm_90"):
        """(nvcc's CompletedProcess, the object's path)."""
        return self.compiles.queue(*gate_compile(self.out_dir, op, arch)).result()


@pytest.fixture(scope="module")
def gate_objects(request, tmp_path_factory):
    """The module's first test queues the compiles of the gate's tests this session runs, in their order."""
    out_dir = tmp_path_factory.mktemp("cuda_compile")
    with background_compiles(request.session, "test_compiles_without_warnings_or_spills",
                             lambda params: gate_compile(out_dir, op_of(params["source"]), params["arch"])) as compiles:
        yield GateObjects(out_dir, compiles)


@pytest.mark.skipif(nvcc_path() is None, reason="no CUDA toolkit on this machine")
@pytest.mark.parametrize("arch", GATED_ARCHS)
@pytest.mark.parametrize("source", CU_FILES, ids=op_of)
def test_compiles_without_warnings_or_spills(source, arch, gate_objects):
    result, _ = gate_objects.get(op_of(source), arch)
    assert result.returncode == 0, result.stderr
    report = result.stderr
    kernels = re.findall(r"Compiling entry function '(\w+)'", report)
    assert kernels, "ptxas reported no kernels"
    # gpu_check.sh's racecheck and synccheck check the kernels whose mangled names hold the namespace.
    outside = [k for k in kernels if "fused_rl_ops" not in k]
    assert not outside, f"kernels outside namespace fused_rl_ops (gpu_check.sh's sanitizers skip them): {outside}"
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(spills) >= len(kernels)
    spilling = [k for k, (st, ld) in zip(kernels, spills) if int(st) or int(ld)]
    assert not spilling, f"kernels spill registers: {spilling}"


def test_every_kernel_source_is_gated():
    assert CU_FILES, "no CUDA sources found"


def global_accesses(compiled):
    """{kernel's mangled name: the set of its global load and store opcodes (LDG.E.128, STG.E.64,
    ...)} in the SASS of an object compiled (nvcc's CompletedProcess, the object's path)."""
    result, obj = compiled
    assert result.returncode == 0, result.stderr
    sass = subprocess.run([cuobjdump_path(), "-sass", str(obj)], capture_output=True, text=True, check=True).stdout
    return {name: set(re.findall(r"\b((?:LDG|STG)\.E[.\w]*)", body))
            for name, body in re.findall(r"Function : (\w+)(.*?)(?=Function : |\Z)", sass, re.S)}


def global_stores(compiled):
    """{kernel's mangled name: the set of its global-store opcodes (STG.E, STG.E.64, ...)} in the
    SASS of chosen_logprob's kernel.cu compiled."""
    return {name: {op for op in ops if op.startswith("STG")} for name, ops in global_accesses(compiled).items()}


# grad_rows' vector variants (kGradWidth = 4 columns a thread): the gradient dtype's mangled name and
# the one store each 4-pack takes (8 bytes of bf16 / fp16, 16 of fp32).
VECTOR_STORES = {"13__nv_bfloat16": "STG.E.64", "6__half": "STG.E.64", "f": "STG.E.128"}


def kernel_variants(accesses, pattern):
    """{the groups of pattern in a kernel's mangled name: that kernel's opcodes}, of the kernels it
    matches."""
    return {m.groups(): ops for name, ops in accesses.items() if (m := re.search(pattern, name))}


def grad_rows_vector_stores(stores):
    """{(logit map, gradient dtype): store opcodes} of grad_rows' vector variants."""
    return kernel_variants(stores, r"chosen_logprob_grad_rows_kernelINS_\d+(\w+?)IfEE(13__nv_bfloat16|6__half|f)Li4E")


needs_cuobjdump = pytest.mark.skipif(nvcc_path() is None or cuobjdump_path() is None,
                                     reason="no CUDA toolkit or cuobjdump on this machine")


@needs_cuobjdump
def test_grad_rows_vector_variants_store_vectors(gate_objects):
    """Each 4-pack of logit gradients goes out as one STG.E.64 (bf16, fp16) or STG.E.128 (fp32),
    never as four scalar stores."""
    found = grad_rows_vector_stores(global_stores(gate_objects.get("chosen_logprob")))
    assert sorted(found) == sorted((logit, dtype) for logit in ("PlainLogit", "SoftcappedLogit")
                                   for dtype in VECTOR_STORES), sorted(found)
    for (logit, dtype), ops in found.items():
        assert ops == {VECTOR_STORES[dtype]}, f"grad_rows<{logit}, {dtype}, 4> stores with {sorted(ops)}"


@needs_cuobjdump
def test_scalar_stores_of_a_pack_are_caught(tmp_path):
    """The check above fails on the store it replaced (the Pack stored as itself: one store per
    element)."""
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)
    kernel = csrc / "chosen_logprob" / "kernel.cuh"
    text = kernel.read_text()
    assert text.count("store_pack(d + k, out);") == 1
    kernel.write_text(text.replace("store_pack(d + k, out);", "*reinterpret_cast<Pack<G, kWidth>*>(d + k) = out;"))
    obj = tmp_path / "chosen_logprob.o"
    found = grad_rows_vector_stores(global_stores(compile_object(csrc / "chosen_logprob" / "kernel.cu", obj, csrc)))
    assert found and all(ops != {VECTOR_STORES[dtype]} for (_, dtype), ops in found.items()), found


def vocab_divergence_row_variants(accesses, width):
    """{(kernel, the rest of its template arguments): global accesses} of vocab_divergence's
    stats, mixture and grad row kernels with `width` columns per access."""
    return kernel_variants(accesses, rf"vocab_divergence_(stats|mixture|grad)_rows_kernelI(\w+?)Li{width}EE")


@needs_cuobjdump
def test_vocab_divergence_vector_variants_load_and_store_vectors(gate_objects):
    """vocab_divergence's row kernels with 4 columns per access read both models' logits with 16-byte
    loads (LDG.E.128), which their scalar variants never use, and grad_rows stores each 4-pack of
    gradients with one STG.E.64 (bf16, fp16) or STG.E.128 (fp32)."""
    accesses = global_accesses(gate_objects.get("vocab_divergence"))
    vector, scalar = (vocab_divergence_row_variants(accesses, width) for width in (4, 1))
    # Both maps of both models (4 pairs) for stats and mixture; times 3 kinds and 3 dtypes for grad.
    kernels = [kernel for kernel, _ in vector]
    assert (kernels.count("stats"), kernels.count("mixture"), kernels.count("grad")) == (4, 4, 36), sorted(vector)
    assert sorted(vector) == sorted(scalar)
    for (kernel, args), ops in vector.items():
        assert any(op.startswith("LDG.E.128") for op in ops), f"{kernel}_rows<{args}, 4> loads with {sorted(ops)}"
        assert not any(op.startswith("LDG.E.128") for op in scalar[kernel, args])
        if kernel == "grad":
            dtype = re.search(r"(13__nv_bfloat16|6__half|f)$", args).group(1)
            stores = {op for op in ops if op.startswith("STG")}
            assert stores == {VECTOR_STORES[dtype]}, f"grad_rows<{args}, 4> stores with {sorted(stores)}"


@needs_cuobjdump
def test_top_logprobs_vector_variants_load_vectors(gate_objects):
    """top_logprobs' row kernel (the stats and the top in one read) with 4 columns per access reads
    the logits with 16-byte loads, which its scalar variants never use."""
    accesses = global_accesses(gate_objects.get("top_logprobs"))
    vector, scalar = (kernel_variants(accesses, rf"top_logprobs_stats_top_ids_rows_kernelI(\w+?)Li{width}EE")
                      for width in (4, 1))
    assert len(vector) == 2 and sorted(vector) == sorted(scalar), sorted(vector)  # both logit maps
    for args, ops in vector.items():
        assert any(op.startswith("LDG.E.128") for op in ops), f"{args}: {sorted(ops)}"
        assert not any(op.startswith("LDG.E.128") for op in scalar[args])
