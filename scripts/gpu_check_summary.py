"""Keeps scripts/gpu_check.sh's OUTDIR/summary.json up to date: rewritten (whole, atomically, under
a lock: stages run in parallel) after every change, so a run cut at any point leaves a summary of
what ran, what was skipped and why.

    python scripts/gpu_check_summary.py OUTDIR run KEY=VALUE...          facts of the run
    python scripts/gpu_check_summary.py OUTDIR stage NAME KEY=VALUE...   a stage's status, exit, seconds, ...

VALUEs made of digits are stored as integers. A stage's entry also gets what its files in OUTDIR
say: the tests' counts from junit.xml, or, where pytest wrote none (killed in a test that services
no signal, or still running), from the result lines of its -v log (counts_from says which), and
the test it was in when it ended (unfinished); a benchmark's rows logged so far (NAME.jsonl) and
whether its whole JSON was written (NAME.json); a sanitizer's error count (its ERROR SUMMARY line)."""
import fcntl
import json
import os
import re
import sys
import xml.etree.ElementTree as ET


def parse(pairs):
    values = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        values[key] = int(value) if value.isdigit() else value
    return values


def junit_counts(path):
    """Counts of a pytest junit report ({} while there is none, or while it is half written)."""
    try:
        suite = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    return {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}


# pytest -v's line of a test: its node id, then its result once it has ended. Output written while
# the test runs (faulthandler's stacks of a test past its timeout, printed as pytest-timeout fails
# it) can come between the two: the result then starts a later line, "FAILED [ 75%]".
RESULTS = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
TEST_LINE = re.compile(r"^(\S+::\S+)(?: (%s)\b)?" % "|".join(RESULTS))
RESULT_LINE = re.compile(r"^(%s) +\[ *\d+%%\]" % "|".join(RESULTS))
LOG_COUNTS = {"tests": RESULTS, "failures": ("FAILED",), "errors": ("ERROR",), "skipped": ("SKIPPED", "XFAIL")}


def log_results(path):
    """The counts of the tests a pytest -v log says have ended, in junit's terms, and the test
    it started last without a result (None when there is none)."""
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}, None
    results, unfinished = [], None
    for line in lines:
        test, result = TEST_LINE.match(line), RESULT_LINE.match(line)
        if test:
            unfinished = None if test.group(2) else test.group(1)
            results += [test.group(2)] if test.group(2) else []
        elif result and unfinished:
            results.append(result.group(1))
            unfinished = None
    counts = {key: sum(result in kinds for result in results) for key, kinds in LOG_COUNTS.items()}
    return counts, unfinished


def stage_files(out, name):
    """What the stage's files in out say so far."""
    found = {}
    if name == "tests":
        counts = junit_counts(os.path.join(out, "junit.xml"))
        logged, unfinished = log_results(os.path.join(out, "tests.log"))
        found.update(counts or logged, counts_from="junit.xml" if counts else "tests.log")
        if unfinished:
            found["unfinished"] = unfinished
    if name.startswith("bench_"):
        rows = os.path.join(out, name + ".jsonl")
        if os.path.exists(rows):
            with open(rows) as f:
                found["rows"] = sum(1 for line in f if line.strip())
        found["json_written"] = os.path.exists(os.path.join(out, name + ".json"))
    if name.startswith("sanitizer_"):
        try:
            with open(os.path.join(out, name + ".log"), errors="replace") as f:
                summaries = re.findall(r"ERROR SUMMARY: (\d+) error", f.read())
        except OSError:
            summaries = []
        if summaries:
            found["sanitizer_errors"] = int(summaries[-1])
    return found


def update(out, kind, args):
    path = os.path.join(out, "summary.json")
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        summary = {"run": {}, "stages": {}}
        if os.path.exists(path):
            with open(path) as f:
                summary = json.load(f)
        if kind == "run":
            summary["run"].update(parse(args))
        else:
            name, values = args[0], parse(args[1:])
            stage = summary["stages"].setdefault(name, {})
            stage.update(values)
            stage.update(stage_files(out, name))
        with open(path + ".tmp", "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    update(sys.argv[1], sys.argv[2], sys.argv[3:])
