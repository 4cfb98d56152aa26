"""`pip install` of the package as a user types it, into a fresh venv that has this environment's
torch: pip's default isolated build (which cannot see that torch) fails at install time with the
message saying what to do, and the command it gives, `pip install --no-build-isolation`, installs a
package whose ops run.

torch reaches the fresh venv as installed here (a .pth file naming this environment's
site-packages): installing it again would take minutes and GBs, and the step under test is the
install of the package. The source is a clean copy of this checkout (no build outputs). No global
pip constraint applies, as on a user's machine."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BUILD_OUTPUTS = shutil.ignore_patterns("build", ".venv*", ".git", "__pycache__", "*.so", "*.egg-info", "_build_info.py",
                                       ".pytest_cache", "bench_results", "gpu_results", "wheelhouse", ".copied_files")


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """(the fresh venv's python, the clean source, the environment pip runs in)."""
    tmp = tmp_path_factory.mktemp("install")
    source = tmp / "fused_rl_ops_source"
    shutil.copytree(ROOT, source, ignore=BUILD_OUTPUTS)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    site_with_torch = Path(torch.__file__).parents[1]
    Path(purelib, "torch_of_the_test_environment.pth").write_text(f"{site_with_torch}\n")
    (tmp / "no-constraints.txt").write_text("")
    env = {**os.environ, "PIP_CONSTRAINT": str(tmp / "no-constraints.txt"), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    return python, source, env


def pip_install(user, *args):
    python, source, env = user
    return subprocess.run([python, "-m", "pip", "install", *args, source], capture_output=True, text=True, env=env,
                          cwd=source.parent)


def test_isolated_build_fails_at_install_time_saying_what_to_do(user):
    result = pip_install(user)
    assert result.returncode != 0
    assert "fused_rl_ops: torch is not importable in this build environment" in result.stderr
    assert "pip install --no-build-isolation" in result.stderr
    python, _, env = user
    shown = subprocess.run([python, "-m", "pip", "show", "fused_rl_ops"], capture_output=True, text=True, env=env)
    assert shown.returncode != 0  # nothing installed


@pytest.mark.skipif(os.environ.get("FUSED_RL_OPS_TEST_INSTALL") != "1",
                    reason="builds the package once more (2-4 minutes): set FUSED_RL_OPS_TEST_INSTALL=1 (CI's verl "
                           "stack leg does)")
def test_install_without_build_isolation_runs_the_ops(user):
    """The CPU kernels (FUSED_RL_OPS_CPU_ONLY=1, as CI's verl leg builds); imported away from the
    checkout: chosen_logprob against float64 log_softmax."""
    python, source, env = user
    result = pip_install((python, source, {**env, "FUSED_RL_OPS_CPU_ONLY": "1"}), "--no-build-isolation")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    code = """
import torch, fused_rl_ops
hidden, weight = torch.randn(5, 16), torch.randn(40, 16)
labels = torch.tensor([3, 0, 39, -100, 17])
logprob = fused_rl_ops.chosen_logprob(hidden, weight, labels)
expected = torch.log_softmax(hidden.double() @ weight.double().T, -1).gather(1, labels.clamp(min=0)[:, None])[:, 0]
expected[3] = 0
print(fused_rl_ops.__file__, float((logprob.double() - expected).abs().max()))
"""
    run = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, cwd=source.parent, check=True)
    location, error = run.stdout.split()
    assert Path(location).is_relative_to(python.parents[1])  # the venv's, not the checkout's
    assert float(error) < 1e-5
    facts = subprocess.run([python, "-m", "fused_rl_ops"], capture_output=True, text=True, env=env,
                           cwd=source.parent, check=True).stdout
    assert f"built against torch {torch.__version__}, CUDA - (CPU kernels only)" in facts
