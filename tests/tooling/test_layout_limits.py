"""The limits that hold for the whole tree (docs/testing.md): no module of fused_rl_ops/ over 400
lines and no function there over 80 (its docstring aside), no file of tests/ over 600 lines, no
file of csrc/ over 400 lines, no #include between csrc's op folders (each includes common/ and
vocab_parallel/ only), no path of csrc/ named in the package nor of the Python trees in csrc/, and
no edit of `sys.path` in any of the checkout's Python (a module that must be importable is made so
by where it lives, not by a path added at run time), and every test in an area package of tests/."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULE_LINES, FUNCTION_LINES, TEST_FILE_LINES, CSRC_FILE_LINES = 400, 80, 600, 400
CSRC = ROOT / "csrc"
# The folders of csrc/ that are no op's, and the ones each may include besides itself.
SHARED_FOLDERS = {"common": set(), "vocab_parallel": {"common"}}
# Not the checkout's own sources: build outputs (the copy for another torch among them), venvs, results.
NOT_SOURCES = {"build", "wheelhouse", "bench_results", "gpu_results", "__pycache__"}


def python_files(under=ROOT):
    for path in sorted(under.rglob("*.py")):
        parts = path.relative_to(ROOT).parts[:-1]
        if not any(part in NOT_SOURCES or part.startswith(".") for part in parts):
            yield path


def line_count(path):
    return len(path.read_text().splitlines())


def function_lengths(path):
    """(qualified name, lines from its def to its end less its docstring's) of every function and
    method in path, nested ones too."""
    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = child.end_lineno - child.lineno + 1
                    first = child.body[0]
                    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                            and isinstance(first.value.value, str):
                        lines -= first.end_lineno - first.lineno + 1
                    yield name, lines
                yield from visit(child, name + ".")
            else:
                yield from visit(child, prefix)

    yield from visit(ast.parse(path.read_text()), "")


def test_no_package_module_over_the_limit():
    too_long = {str(path.relative_to(ROOT)): lines for path in python_files(ROOT / "fused_rl_ops")
                if (lines := line_count(path)) > MODULE_LINES}
    assert not too_long, f"modules over {MODULE_LINES} lines: {too_long}"


def test_no_package_function_over_the_limit():
    too_long = {f"{path.relative_to(ROOT)}:{name}": lines for path in python_files(ROOT / "fused_rl_ops")
                for name, lines in function_lengths(path) if lines > FUNCTION_LINES}
    assert not too_long, f"functions over {FUNCTION_LINES} lines, docstrings aside: {too_long}"


def test_no_test_file_over_the_limit():
    too_long = {str(path.relative_to(ROOT)): lines for path in python_files(ROOT / "tests")
                if (lines := line_count(path)) > TEST_FILE_LINES}
    assert not too_long, f"test files over {TEST_FILE_LINES} lines: {too_long}"


def test_every_test_sits_in_an_area_package():
    """Tests live in tests/<area>/, each folder a package, so that two areas' test_x.py are two
    modules (tests.<area>.test_x) and a subprocess imports either from the checkout's root."""
    tests = ROOT / "tests"
    flat = sorted(path.name for path in tests.glob("test_*.py"))
    assert not flat, f"test files outside an area folder of tests/: {flat}"
    not_packages = sorted({str(path.parent.relative_to(ROOT)) for path in python_files(tests)
                           if not (path.parent / "__init__.py").is_file()})
    assert not not_packages, f"folders of tests/ without __init__.py: {not_packages}"


def csrc_files():
    return sorted(path for path in CSRC.rglob("*") if path.is_file())


def test_no_csrc_file_over_the_limit():
    too_long = {str(path.relative_to(ROOT)): lines for path in csrc_files()
                if (lines := line_count(path)) > CSRC_FILE_LINES}
    assert not too_long, f"csrc files over {CSRC_FILE_LINES} lines: {too_long}"


def included_folders(path):
    """The csrc/ folders of the project headers that path includes ("folder/file.h")."""
    return {m[1] for m in re.finditer(r'^\s*#\s*include\s+"([\w.]+)/', path.read_text(), re.M)}


def test_op_folders_include_no_other_op_folder():
    """An op folder includes common/, vocab_parallel/ and itself; vocab_parallel/ common/ and itself;
    common/ itself: sibling ops share code through the engine, never each other."""
    crossing = []
    for path in csrc_files():
        if path.parent == CSRC:
            continue  # module.cpp: the schemas, from every op's options
        folder = path.parent.name
        allowed = {folder} | SHARED_FOLDERS.get(folder, set(SHARED_FOLDERS))
        crossing += [f"{path.relative_to(ROOT)} includes {other}/" for other in included_folders(path) - allowed]
    assert not crossing, "\n".join(crossing)


# A path of one tree named in the other goes stale when a file moves: the package names C++ things,
# and csrc/ Python ones, by op, struct or function instead (tests/ compile csrc/ and may name it).
PYTHON_PATH = re.compile(r"\bfused_rl_ops/|\btests/|\b\w+\.py\b")


def cpp_path(names):
    """csrc/, or one of its files by name (names; a toolkit's header is no file of ours)."""
    return re.compile(r"\bcsrc/|(?<![\w.])(?:" + "|".join(map(re.escape, sorted(names))) + r")(?!\w)")


def lines_matching(paths, pattern):
    return [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in paths
            for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]


def test_no_path_of_one_tree_in_the_other():
    named = lines_matching(python_files(ROOT / "fused_rl_ops"), cpp_path({path.name for path in csrc_files()}))
    named += lines_matching(csrc_files(), PYTHON_PATH)
    assert not named, "paths of the other tree:\n" + "\n".join(named)


# sys.path changed in place, assigned or added to, or site.addsitedir; in code or in a program
# handed to another interpreter as a string.
PATH_EDIT = re.compile(r"\bsys\s*\.\s*path\s*(\.\s*(insert|append|extend|remove|pop|clear)\s*\(|(\[[^\]]*\])?\s*\+?=(?!=))"
                       r"|\bsite\s*\.\s*addsitedir\s*\(")


def test_no_sys_path_edits():
    edits = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in python_files()
             for number, line in enumerate(path.read_text().splitlines(), 1) if PATH_EDIT.search(line)]
    assert not edits, "sys.path edits:\n" + "\n".join(edits)


def test_the_checks_find_what_they_look_for(tmp_path):
    """The checks themselves: a long function with a long docstring is measured without it, nested
    functions are measured too, and each form of a sys.path edit is found (none in a comparison)."""
    body = "\n".join(f"    x{i} = {i}" for i in range(5))
    source = f'def f():\n    """one\n    two\n    three"""\n{body}\n    def g():\n        return 1\n    return g\n'
    (tmp_path / "m.py").write_text(source)
    assert dict(function_lengths(tmp_path / "m.py")) == {"f": 12 - 3, "f.g": 2}
    # Written with stand-ins (PATH, SITE), so that this file holds no edit itself.
    edits = ["PATH.insert(0, here)", "PATH.append(here)", "PATH = [here]", "PATH += [here]", "PATH[:0] = [here]",
             'program = "import sys; PATH.insert(0, {here!r})"', "SITE.addsitedir(here)"]
    reads = ["print(PATH)", "if PATH == old:", "PATH_hooks", "paths = list(PATH)"]

    def code(line):
        return line.replace("PATH", "sys.path").replace("SITE", "site")

    assert all(PATH_EDIT.search(code(line)) for line in edits)
    assert not any(PATH_EDIT.search(code(line)) for line in reads)
    # Paths of the other tree: a C++ file or csrc/ in Python, a Python file or folder in C++.
    cpp = cpp_path({"math.h", "kernel.cu"})
    assert all(cpp.search(line) for line in ["(csrc/x/y.h)", "see math.h", "chosen_logprob/kernel.cu's launchers"])
    assert not any(cpp.search(line) for line in ["include/cuda_runtime.h", "vec_math.h", "Math.hpp", "the kernel"])
    assert all(PYTHON_PATH.search(line) for line in ["fused_rl_ops/x.py", "(_options.py)", "tests/kernels_on_cpu/"])
    assert not any(PYTHON_PATH.search(line) for line in ["fused_rl_ops.chosen_logprob", "LogitMap", "py_func"])
