"""scripts/gpu_check.sh rehearsed on the CPU (REHEARSAL=1): every stage runs against its stand-in
(the extension built here, the CPU as the device, quick benchmark shapes, a compute-sanitizer that
checks nothing, a stand-in wheel for the peers, a stand-in test file whose last test waits until it
is interrupted), with budgets that cut the test stage and a benchmark short. The outputs are what a
cut GPU run must leave: a summary naming every stage with its status (why it was skipped, what its
files hold), the junit report and failure list of the cut pytest, each benchmark's rows logged as
they were measured and agreeing with its JSON. The stand-in tests make the cut certain and
independent of the machine's speed; which tests the real run selects is checked apart."""
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = ["peers", "build", "build_info", "tests", "sanitizer_memcheck", "sanitizer_racecheck",
          "sanitizer_synccheck", "bench_value_head", "bench_clamped_swiglu", "bench_chosen_logprob", "report"]
BENCHMARKS = ["bench_value_head", "bench_clamped_swiglu", "bench_chosen_logprob"]
STAND_IN_TESTS = """
import time


def test_fails():
    assert 1 == 2


def test_passes():
    pass


def test_waits_until_interrupted():
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


def test_rehearsal_leaves_every_result_of_a_cut_run(tmp_path):
    out, peers = tmp_path / "out", tmp_path / "peers"
    peer = stand_in_wheel(tmp_path / "wheelhouse")
    (tmp_path / "stand_in").mkdir()
    (tmp_path / "stand_in" / "test_stand_in.py").write_text(STAND_IN_TESTS)
    # The stand-in tests never end, nor can the quick clamped_swiglu benchmark (torch's import and
    # several torch.compile graphs) in 3 s on any machine: both are cut. chosen_logprob's 1 s is less
    # than a stage's minimum (2 s here): skipped.
    budgets = {"TOTAL_S": "400", "TESTS_S": "40", "SANITIZER_S": "200", "BENCH_VALUE_HEAD_S": "200",
               "BENCH_CLAMPED_SWIGLU_S": "3", "BENCH_CHOSEN_LOGPROB_S": "1", "CHOSEN_LOGPROB_FLOOR_S": "1",
               "MIN_STAGE_S": "2", "GRACE_S": "10", "TEST_TIMEOUT_S": "3600"}
    env = {**os.environ, **budgets, "REHEARSAL": "1", "PYTHON": sys.executable,
           "WHEELHOUSE": str(tmp_path / "wheelhouse"), "PEERS_DIR": str(peers),
           "TEST_SELECTION": str(tmp_path / "stand_in" / "test_stand_in.py")}
    run = subprocess.run(["bash", "scripts/gpu_check.sh", str(out)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["rehearsal"] == 1 and summary["run"]["device"] == "cpu"
    assert summary["run"]["seconds"] <= 400 + 30  # the deadline, and the summary written after it
    stages = summary["stages"]
    assert sorted(stages) == sorted(STAGES)
    for name, stage in stages.items():
        assert stage["status"] in ("passed", "cut", "skipped"), (name, stage)
        assert (stage["status"] == "skipped") == ("reason" in stage), (name, stage)
        if stage["status"] != "skipped":
            assert stage["seconds"] <= stage["limit_s"] + 10 + 5 and (out / f"{name}.log").exists(), (name, stage)

    assert stages["peers"]["status"] == "passed" and (peers / f"{peer}.py").exists()
    assert stages["build"]["reason"].startswith("rehearsal")
    assert stages["build_info"]["status"] == "passed"

    # The cut pytest wrote its junit report (the two finished tests) and its failure list.
    assert stages["tests"]["status"] == "cut"
    suite = ET.parse(out / "junit.xml").getroot().find("testsuite")
    finished = {case.get("name"): case for case in suite.findall("testcase") if case.get("name")}
    assert sorted(finished) == ["test_fails", "test_passes"]
    assert finished["test_fails"].find("failure") is not None and finished["test_passes"].find("failure") is None
    assert (stages["tests"]["tests"], stages["tests"]["failures"]) == (2, 1)
    log = (out / "tests.log").read_text()
    assert "FAILED" in log and "test_stand_in.py::test_fails" in log and "KeyboardInterrupt" in log

    for tool in ("memcheck", "racecheck", "synccheck"):
        stage = stages[f"sanitizer_{tool}"]
        assert stage["status"] == "passed" and stage["sanitizer_errors"] == 0
        assert "value_head cases ran" in (out / f"sanitizer_{tool}.log").read_text()

    # Each benchmark's rows are logged as measured; a finished one's JSON holds the same rows.
    assert stages["bench_value_head"]["status"] == "passed"
    assert stages["bench_clamped_swiglu"]["status"] == "cut"
    assert stages["bench_chosen_logprob"]["status"] == "skipped"
    assert stages["bench_chosen_logprob"]["reason"] == "no time left: 1s for it"
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
        for path in sorted((ROOT / "tests").glob("test_*.py")):
            for name in re.findall(r'reason="needs a GPU"\)\n(?:@.*\n)*def (test_\w+)', path.read_text()):
                found.add(f"tests/{path.name}::{name}")
        return found

    selected, others = collect("-m", "per_device"), collect("-m", "not per_device")
    gpu_tests = needing_a_gpu()
    assert gpu_tests and gpu_tests <= selected and len(selected) > 100
    assert all(takes_the_device(test) for test in selected - gpu_tests)
    assert not any(takes_the_device(test) for test in others) and len(others) > 100
