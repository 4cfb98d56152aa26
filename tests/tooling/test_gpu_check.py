"""scripts/gpu_check.sh rehearsed on the CPU (REHEARSAL=1): every stage runs against its stand-in
(a carried build made of the extension built here, the CPU as the device, quick benchmark shapes, a compute-sanitizer that
checks nothing, a stand-in wheel for the peers, a stand-in test file with a test past the per-test
timeout and a last one that hangs where no signal reaches it, as in a CUDA synchronisation), with
budgets that cut the test stage and the headline benchmark short. The outputs are what a cut GPU
run must leave: a summary naming every stage with its status (why it was skipped, what its files
hold), the counts and failures of the killed pytest and the stacks of the test it hung in, the
benchmarks in the op table's order with the headline first, each benchmark's rows logged as they
were measured and agreeing with its JSON. The stand-in tests make the cut certain and independent
of the machine's speed; which tests the real run selects is checked apart, and so are the carried
builds the rehearsal does not load, with no time left for the stages after the build."""
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from tests.helpers import op_table

pytestmark = pytest.mark.stack_independent

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = [stage for stage, *_ in op_table.benchmark_runs()]
STAGES = ["peers", "build", "build_info", "tests", "sanitizer_memcheck", "sanitizer_racecheck",
          "sanitizer_synccheck", *BENCHMARKS, "report"]
STAND_IN_TESTS = """
import signal
import time


def test_fails():
    assert 1 == 2


def test_passes():
    pass


def test_times_out():
    time.sleep(3600)


def test_hangs_where_no_signal_reaches_it():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGALRM})
    time.sleep(3600)
"""


def stand_in_wheel(wheelhouse: Path) -> str:
    """A pure-Python wheel of one module, as pip installs it (METADATA, WHEEL, RECORD)."""
    name = "gpu_check_stand_in_peer"
    wheelhouse.mkdir()
    dist_info = f"{name}-1.0.dist-info"
    files = {f"{name}.py": "VALUE = 1\n",
             f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist_info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{dist_info}/RECORD"])
    with zipfile.ZipFile(wheelhouse / f"{name}-1.0-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)
    return name


def in_place_build(checkout: Path) -> list:
    return [*checkout.glob("fused_rl_ops/_C*.so"), checkout / "fused_rl_ops" / "_build_info.py"]


def carried_build(folder: Path) -> Path:
    """What scripts/build_for_gpu.sh leaves to bring along, made of the extension built here: the
    extension and its build info in folder/fused_rl_ops/, the digest of the sources in folder/SOURCES."""
    (folder / "fused_rl_ops").mkdir(parents=True)
    for built in in_place_build(ROOT):
        shutil.copy(built, folder / "fused_rl_ops")
    (folder / "SOURCES").write_text(subprocess.run(["bash", "scripts/sources_digest.sh"], cwd=ROOT,
                                                   capture_output=True, text=True, check=True).stdout)
    return folder


def test_rehearsal_leaves_every_result_of_a_cut_run(tmp_path):
    out, peers = tmp_path / "out", tmp_path / "peers"
    carried = carried_build(tmp_path / "carried")
    peer = stand_in_wheel(tmp_path / "wheelhouse")
    (tmp_path / "stand_in").mkdir()
    (tmp_path / "stand_in" / "test_stand_in.py").write_text(STAND_IN_TESTS)
    # The last stand-in test never ends, nor can the quick chosen_logprob benchmark (torch's import,
    # the peers' and torch.compile graphs) in 3 s on any machine: both are cut. value_head's
    # benchmark runs whole; every other one gets 1 s, less than a stage's minimum (2 s here): skipped.
    # The tests stage's 120 s cover pytest's start on a loaded machine (60 s did not at load 23).
    budgets = {"TOTAL_S": "400", "TESTS_S": "120", "SANITIZER_S": "200", "MIN_STAGE_S": "2", "GRACE_S": "10",
               "TEST_TIMEOUT_S": "5", **{f"{stage.upper()}_S": "1" for stage in BENCHMARKS},
               "BENCH_CHOSEN_LOGPROB_S": "3", "BENCH_VALUE_HEAD_S": "200"}
    env = {**os.environ, **budgets, "REHEARSAL": "1", "PYTHON": sys.executable, "CARRIED_BUILD": str(carried),
           "WHEELHOUSE": str(tmp_path / "wheelhouse"), "PEERS_DIR": str(peers),
           "TEST_SELECTION": str(tmp_path / "stand_in" / "test_stand_in.py")}
    run = subprocess.run(["bash", "scripts/gpu_check.sh", str(out)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["rehearsal"] == 1 and summary["run"]["device"] == "cpu"
    assert summary["run"]["per_test_timeout"] == 5
    assert summary["run"]["seconds"] <= 400 + 30  # the deadline, and the summary written after it
    stages = summary["stages"]
    assert sorted(stages) == sorted(STAGES)
    for name, stage in stages.items():
        log = out / f"{name}.log"
        assert stage["status"] in ("passed", "cut", "skipped"), (name, stage, log.exists() and log.read_text()[-3000:])
        assert (stage["status"] == "skipped") == ("reason" in stage), (name, stage)
        if stage["status"] != "skipped":
            assert stage["seconds"] <= stage["limit_s"] + 10 + 5 and (out / f"{name}.log").exists(), (name, stage)

    assert stages["peers"]["status"] == "passed" and (peers / f"{peer}.py").exists()
    # The carried build was loaded (the same files as the extension built here: none copied).
    assert stages["build"]["reason"].startswith(f"carried build loaded from {carried}/: torch {torch.__version__},")
    assert stages["build_info"]["status"] == "passed"

    # The test past its timeout failed, and the run went on; the hung one ignored the cut's SIGINT,
    # so pytest was killed without a junit report: the counts come from its log, which names the
    # test it hung in and holds that test's stack (faulthandler).
    tests = stages["tests"]
    assert tests["status"] == "cut" and tests["exit"] == 137 and not (out / "junit.xml").exists()
    assert (tests["tests"], tests["failures"], tests["counts_from"]) == (3, 2, "tests.log"), \
        (out / "tests.log").read_text()[-3000:]
    assert tests["unfinished"].endswith("test_stand_in.py::test_hangs_where_no_signal_reaches_it")
    log = (out / "tests.log").read_text()
    # The timed-out test's result can follow the stacks pytest-timeout prints as it fails it.
    assert "test_stand_in.py::test_fails FAILED" in log
    assert re.search(r"test_stand_in\.py::test_times_out (.|\n)*?FAILED", log)
    # faulthandler's stacks of the hung test, 10 s after its timeout; none of the failed one's.
    assert re.search(r"Timeout \(0:00:15\)!(.|\n)*in test_hangs_where_no_signal_reaches_it", log)
    assert log.count("Timeout (0:00:15)!") == 1

    for tool in ("memcheck", "racecheck", "synccheck"):
        stage = stages[f"sanitizer_{tool}"]
        assert stage["status"] == "passed" and stage["sanitizer_errors"] == 0
        assert "value_head cases ran" in (out / f"sanitizer_{tool}.log").read_text()

    # The benchmarks in the op table's order, the headline first; each one's rows are logged as
    # measured, and a finished one's JSON holds the same rows.
    assert [name for name in stages if name.startswith("bench_")] == BENCHMARKS
    assert BENCHMARKS[0] == "bench_chosen_logprob" and stages["bench_chosen_logprob"]["status"] == "cut"
    assert stages["bench_value_head"]["status"] == "passed"
    for name in set(BENCHMARKS) - {"bench_chosen_logprob", "bench_value_head"}:
        assert stages[name]["reason"] == "no time left: 1s for it", name
    for name in BENCHMARKS:
        stage = stages[name]
        assert stage["json_written"] == (stage["status"] == "passed"), (name, stage)
        if stage["status"] == "skipped":
            continue
        rows_file = out / f"{name}.jsonl"  # made once the benchmark has imported torch: a cut may come first
        logged = [json.loads(line) for line in rows_file.read_text().splitlines()] if rows_file.exists() else []
        assert len(logged) == stage.get("rows", 0)
        if stage["json_written"]:
            result = json.loads((out / f"{name}.json").read_text())
            assert [{k: v for k, v in row.items() if k != "table"} for row in logged if row["table"] == "results"] \
                == result["results"]
    assert stages["bench_value_head"]["rows"] == 4  # the quick shape: 2 dtypes, forward and forward+backward
    assert (stages["report"]["status"] == "passed") and (out / "REPORT.md").exists()


def test_the_gpu_run_selects_the_tests_that_take_a_device():
    """gpu_check.sh's selection, -m per_device: every test taking the device fixture (here with its
    cpu parameter only) and the test that needs a GPU; none of the others."""
    def collect(*args):
        listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                 *args, "tests"], cwd=ROOT, capture_output=True, text=True,
                                env={**os.environ, "FUSED_RL_OPS_TEST_DEVICES": "cpu"}, check=True).stdout
        return {line for line in listed.splitlines() if "::" in line}

    def takes_the_device(test):  # the device parameter is one of the id's parts: [cpu], [float32-cpu], ...
        return "cpu" in test.partition("[")[2].rstrip("]").split("-")

    def needing_a_gpu():  # the tests whose sources skip them without a GPU
        found = set()
        for path in sorted((ROOT / "tests").rglob("test_*.py")):
            for name in re.findall(r'reason="needs a GPU"\)\n(?:@.*\n)*def (test_\w+)', path.read_text()):
                found.add(f"{path.relative_to(ROOT)}::{name}")
        return found

    selected, others = collect("-m", "per_device"), collect("-m", "not per_device")
    gpu_tests = needing_a_gpu()
    assert gpu_tests and gpu_tests <= selected and len(selected) > 100
    assert all(takes_the_device(test) for test in selected - gpu_tests)
    assert not any(takes_the_device(test) for test in others) and len(others) > 100


def test_a_result_printed_after_a_tests_stacks_counts_for_it(tmp_path):
    """faulthandler's stacks of a test past its timeout, printed while pytest-timeout fails it, can
    come between the test's node id and its result: the result still counts for that test."""
    log = tmp_path / "tests.log"
    log.write_text("t.py::test_a PASSED [ 33%]\n"
                   "t.py::test_b Timeout (0:00:05)!\nThread 0x1 (most recent call first):\n  File \"t.py\", line 3\n"
                   "FAILED [ 66%]\n"
                   "t.py::test_c Timeout (0:00:05)!\nThread 0x1 (most recent call first):\n")
    summary = runpy.run_path(str(ROOT / "scripts" / "gpu_check_summary.py"), run_name="gpu_check_summary")
    counts, unfinished = summary["log_results"](str(log))
    assert (counts["tests"], counts["failures"], unfinished) == (2, 1, "t.py::test_c")


def fingerprints(folder: Path) -> dict:
    """Each file of folder: its inode, modification time and bytes (all three the same: not rewritten)."""
    return {path.name: (path.stat().st_ino, path.stat().st_mtime_ns, path.read_bytes())
            for path in folder.iterdir() if path.is_file()}


def rehearse_the_build(tmp_path, carried: Path, loads=False) -> dict:
    """The rehearsal with no time for the stages after the build (TOTAL_S 1), in a copy of the checkout
    with the extension built here: the build stage's entry in the summary; a carried build that does
    not load leaves the copy's package as it was."""
    checkout = tmp_path / "checkout"
    subprocess.run([sys.executable, "scripts/copy_checkout.py", str(checkout)], cwd=ROOT, check=True)
    for built in in_place_build(ROOT):
        shutil.copy(built, checkout / "fused_rl_ops")
    before = fingerprints(checkout / "fused_rl_ops")
    env = {**os.environ, "REHEARSAL": "1", "PYTHON": sys.executable, "TOTAL_S": "1", "CARRIED_BUILD": str(carried),
           "WHEELHOUSE": str(tmp_path / "no_wheels"), "PEERS_DIR": str(tmp_path / "peers")}
    run = subprocess.run(["bash", "scripts/gpu_check.sh", str(tmp_path / "out")], cwd=checkout, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    after = fingerprints(checkout / "fused_rl_ops")
    if loads:  # what the carried build holds is in place, the rest left as it was
        carried_files = fingerprints(carried / "fused_rl_ops")
        assert all(after[name][2] == carried_files[name][2] for name in carried_files)
        after = {name: mark for name, mark in after.items() if name not in carried_files}
        before = {name: mark for name, mark in before.items() if name not in carried_files}
    assert after == before
    stages = json.loads((tmp_path / "out" / "summary.json").read_text())["stages"]
    assert stages["build_info"]["reason"].startswith("no time left")
    assert stages["tests"]["reason"] == "no time was left to import the extension (build_info)"
    build = stages["build"]
    assert build["status"] == "skipped" and build["carried_build_s"] >= 0
    return build


def test_rehearsal_uses_no_carried_build_made_from_other_sources(tmp_path):
    carried = carried_build(tmp_path / "carried")
    (carried / "SOURCES").write_text("0" * 64 + "\n")
    assert rehearse_the_build(tmp_path, carried)["reason"].startswith(
        "rehearsal: the carried build was made from other sources than this checkout's (csrc/, setup.py); "
        "uses the extension built here")


def test_rehearsal_uses_no_carried_build_for_another_torch(tmp_path):
    carried = carried_build(tmp_path / "carried")
    info = carried / "fused_rl_ops" / "_build_info.py"
    info.write_text(info.read_text().replace(f"TORCH = '{torch.__version__}'", "TORCH = '2.0.0'"))
    assert rehearse_the_build(tmp_path, carried)["reason"].startswith(
        f"rehearsal: the carried build is for torch 2.0.0, here torch {torch.__version__}; uses the extension built here")


def test_a_carried_build_that_does_not_load_leaves_the_extension_built_here(tmp_path):
    """Put in place (the import's error names the file), then the files it replaced put back: the
    same inode and time, so renamed back rather than copied."""
    carried = carried_build(tmp_path / "carried")
    for extension in (carried / "fused_rl_ops").glob("_C*.so"):
        extension.write_bytes(b"not an extension")
    reason = rehearse_the_build(tmp_path, carried)["reason"]
    assert reason.startswith("rehearsal: the carried build does not load: ImportError: "
                             f"{tmp_path / 'checkout' / 'fused_rl_ops'}/_C"), reason


def test_a_carried_build_for_two_pythons_loads(tmp_path):
    """build_for_gpu.sh run with two Pythons leaves an extension for each beside one build info."""
    carried = carried_build(tmp_path / "carried")
    built_here = next((carried / "fused_rl_ops").glob("_C*.so"))
    shutil.copy(built_here, carried / "fused_rl_ops" / "_C.cpython-399-x86_64-linux-gnu.so")
    reason = rehearse_the_build(tmp_path, carried, loads=True)["reason"]
    assert reason.startswith(f"carried build loaded from {carried}/: torch {torch.__version__},"), reason
