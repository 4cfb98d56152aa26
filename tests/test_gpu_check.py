"""scripts/gpu_check.sh rehearsed on the CPU (REHEARSAL=1): every stage runs against its stand-in
(the extension built here, the CPU as the device, quick benchmark shapes, a compute-sanitizer that
checks nothing, a stand-in wheel for the peers), with budgets that cut the test stage and a
benchmark short, and the outputs are what a cut GPU run must leave: a summary naming every stage
with its status (why it was skipped, what its files hold), the junit report and failure list of the
cut pytest, each benchmark's rows logged as they were measured and agreeing with its JSON."""
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = ["peers", "build", "build_info", "tests", "sanitizer_memcheck", "sanitizer_racecheck",
          "sanitizer_synccheck", "bench_value_head", "bench_clamped_swiglu", "bench_chosen_logprob", "report"]
BENCHMARKS = ["bench_value_head", "bench_clamped_swiglu", "bench_chosen_logprob"]


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
    # The CPU op tests (minutes) cannot pass in 90 s, nor the quick clamped_swiglu benchmark (several
    # torch.compile graphs) in 25 s: both are cut. chosen_logprob's 10 s are less than a stage's
    # minimum: it is skipped.
    budgets = {"TOTAL_S": "300", "TESTS_S": "90", "SANITIZER_S": "120", "BENCH_VALUE_HEAD_S": "120",
               "BENCH_CLAMPED_SWIGLU_S": "25", "BENCH_CHOSEN_LOGPROB_S": "10", "CHOSEN_LOGPROB_FLOOR_S": "10",
               "GRACE_S": "10"}
    env = {**os.environ, **budgets, "REHEARSAL": "1", "PYTHON": sys.executable,
           "WHEELHOUSE": str(tmp_path / "wheelhouse"), "PEERS_DIR": str(peers)}
    run = subprocess.run(["bash", "scripts/gpu_check.sh", str(out)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["rehearsal"] == 1 and summary["run"]["device"] == "cpu"
    assert summary["run"]["seconds"] <= 300 + 30  # the deadline, and the summary written after it
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

    # The cut pytest wrote its junit report and its failure list, and the summary has its counts.
    assert stages["tests"]["status"] == "cut"
    suite = ET.parse(out / "junit.xml").getroot().find("testsuite")
    ran = [case for case in suite.findall("testcase") if case.get("name")]  # not the interrupted one's stub
    assert int(suite.get("tests")) == stages["tests"]["tests"] == len(ran) >= 1
    assert "KeyboardInterrupt" in (out / "tests.log").read_text()

    for tool in ("memcheck", "racecheck", "synccheck"):
        stage = stages[f"sanitizer_{tool}"]
        assert stage["status"] == "passed" and stage["sanitizer_errors"] == 0
        assert "value_head cases ran" in (out / f"sanitizer_{tool}.log").read_text()

    # Each benchmark's rows are logged as measured; a finished one's JSON holds the same rows.
    assert stages["bench_value_head"]["status"] == "passed"
    assert stages["bench_clamped_swiglu"]["status"] == "cut"
    assert stages["bench_chosen_logprob"]["status"] == "skipped"
    assert stages["bench_chosen_logprob"]["reason"] == "no time left: 10s for it"
    for name in BENCHMARKS:
        stage = stages[name]
        assert stage["json_written"] == (stage["status"] == "passed"), (name, stage)
        if stage["status"] == "skipped":
            continue
        logged = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
        assert len(logged) == stage["rows"]
        if stage["json_written"]:
            result = json.loads((out / f"{name}.json").read_text())
            assert [{k: v for k, v in row.items() if k != "table"} for row in logged if row["table"] == "results"] \
                == result["results"]
    assert stages["bench_value_head"]["rows"] == 4  # the quick shape: 2 dtypes, forward and forward+backward
    assert (stages["report"]["status"] == "passed") and (out / "REPORT.md").exists()
