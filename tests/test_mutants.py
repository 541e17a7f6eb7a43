"""bench/mutants.py: every mutant entry is valid, and a mutant runs end to end in a scratch copy
whose package every subprocess imports."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import collected_here

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mutants_tool", REPO / "bench" / "mutants.py")
tool = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("mutants_tool", tool)  # its dataclasses look their module up
_spec.loader.exec_module(tool)

# Breaks `import pretrain` in every process but pytest's own: only a test whose subprocess
# imports the scratch copy's package can catch it.
_VERSION = '__version__ = "0.1.0"'
SUBPROCESS_IMPORT = tool.Mutant(
    id="tool-subprocess-import", file="pretrain/__init__.py", old=_VERSION,
    new=_VERSION + '\nimport sys\nif "pytest" not in sys.modules:\n'
                   '    raise ImportError("mutated in the scratch copy")',
    tests=("tests/test_architecture.py::test_help_does_not_import_torch",), quick=True,
    source="tests/test_mutants.py")


def test_every_mutant_entry_is_valid(monkeypatch, capsys):
    """Ids unique, files there, each `old` once, each node id collected, quick ones not slow:
    `bench/mutants.py --check`, against the tests this session collected when it collected every
    named test file whole (the suite, the quick tier), else collecting them in a new process."""
    files = {t.split("::")[0] for m in tool.load_mutants() for t in m.tests}
    here = collected_here(sorted(f for f in files if (REPO / f).is_file()))
    if here is None:
        run = subprocess.run([sys.executable, str(REPO / "bench" / "mutants.py"), "--check"],
                             cwd=REPO, capture_output=True, text=True, timeout=600)
        code, out = run.returncode, run.stdout + run.stderr
    else:
        monkeypatch.setattr(tool, "collect", lambda test_files, repo=REPO: {
            node: slow for node, slow in here.items() if node.split("::")[0] in test_files})
        code = tool.main(["--check"])
        out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    assert "0 problems" in out


def test_a_mutant_that_breaks_the_package_in_subprocesses_is_caught():
    outcome = tool.run_mutant(SUBPROCESS_IMPORT, timeout=300)
    assert outcome.verdict == "caught", outcome
    assert "test_help_does_not_import_torch" in outcome.detail


def test_a_mutant_no_test_notices_survives():
    """The same test and copy as above with a harmless change: it passes there, so the catch
    above is the mutant's."""
    harmless = tool.Mutant(
        id="tool-harmless", file="pretrain/__init__.py", old=_VERSION,
        new=_VERSION + "  # a comment changes nothing", tests=SUBPROCESS_IMPORT.tests,
        quick=True, source="tests/test_mutants.py")
    assert tool.run_mutant(harmless, timeout=300).verdict == "survived"


def test_the_verdict_needs_every_named_test_to_fail():
    a, b = "tests/t.py::test_a", "tests/t.py::test_b"
    both = f"FAILED {a}[1] - AssertionError\nPASSED {a}[2]\nFAILED {b} - boom\n"
    assert tool.verdict_of(1, both, (a, b))[0] == "caught"  # one failing case is enough
    one = f"FAILED {a} - AssertionError\nPASSED {b}\n"
    assert tool.verdict_of(1, one, (a, b)) == ("survived", "passed: test_b")
    assert tool.verdict_of(0, f"PASSED {a}\n", (a,))[0] == "survived"
    assert tool.verdict_of(2, "ERROR collecting tests/t.py\nImportError: x\n", (a,))[0] == "caught"
    assert tool.verdict_of(4, "ERROR: not found: tests/t.py::test_c\n", (a,))[0] == "error"
    assert tool.verdict_of(0, f"SKIPPED [1] {a}: no GPU\n", (a,))[0] == "error"


def test_a_mutant_whose_old_text_is_not_there_exactly_once_is_refused():
    once = tool.Mutant(id="m", file="f.py", old="a = 1", new="a = 2", tests=("t",), quick=True,
                       source="x")
    assert tool.mutated("a = 1\nb = 2\n", once) == "a = 2\nb = 2\n"
    with pytest.raises(ValueError, match="occurs 2 times"):
        tool.mutated("a = 1\na = 1\n", once)
    with pytest.raises(ValueError, match="occurs 0 times"):
        tool.mutated("b = 1\n", once)


def test_entries_with_a_missing_field_are_refused(tmp_path):
    (tmp_path / "x.yaml").write_text("- id: a\n  file: f.py\n  old: x\n  new: y\n  tests: [t]\n")
    with pytest.raises(ValueError, match="fields"):
        tool.load_mutants(tmp_path)


def test_the_scratch_copy_has_the_tracked_files_and_links_the_environment(tmp_path):
    tool.scratch_copy(tmp_path / "copy")
    assert (tmp_path / "copy" / "pretrain" / "__init__.py").read_text() == \
        (REPO / "pretrain" / "__init__.py").read_text()
    assert (tmp_path / "copy" / ".venv").is_symlink()
    assert not any((tmp_path / "copy").rglob("__pycache__"))
