"""Mutation runs: does each test named for a feature fail when a line of that feature is broken?

Every `bench/mutants/*.yaml` is a list of mutants, each one line of production code broken on
purpose and the tests that must each fail because of it:

    - id: moe-capacity-floor           # unique, <topic>-<what>
      file: pretrain/model/moe.py      # relative to the repository root
      old: "exact text that occurs exactly once in the file"
      new: "the broken replacement"
      tests: ["tests/test_moe.py::test_name"]   # pytest node ids that must fail with it
      quick: true                      # the tests are in the quick tier (not slow)

For each mutant the tool copies the repository's files (git's tracked and untracked-not-ignored
ones, `.venv` and `.build` as symlinks) into a scratch directory, applies the mutant there (one
whose `old` does not occur exactly once is refused), and runs its tests with pytest in that copy
with PYTHONPATH set to the copy, so that the test process and every rank or subprocess it starts
import the mutated package, not the checkout's. A mutant is *caught* when each of its tests
fails (one failing case of a parametrized test is enough; an error collecting them, e.g. a
package that no longer imports, counts), *survived* when one of them passes, *error* when pytest
could not run them (a node id not found, a timeout, every case skipped).

    .venv/bin/python bench/mutants.py --list
    .venv/bin/python bench/mutants.py --check              # every entry valid, seconds
    .venv/bin/python bench/mutants.py --quick              # the quick-tier mutants
    .venv/bin/python bench/mutants.py --id moe-capacity-floor --json out.json
    .venv/bin/python bench/mutants.py --file pretrain/model/moe.py -k capacity
    .venv/bin/python bench/mutants.py --baseline --id ...  # the tests pass unmutated first

Exit status: 0 when every mutant run was caught (or `--check` found nothing wrong), 1 otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
MUTANTS = REPO / "bench" / "mutants"
FIELDS = ("id", "file", "old", "new", "tests", "quick")
SHARED = (".venv", ".build")  # linked, not copied, into every scratch copy


@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    quick: bool
    source: str  # the YAML file it came from, relative to the repository


@dataclasses.dataclass
class Outcome:
    id: str
    verdict: str  # caught | survived | error
    seconds: float
    detail: str  # the first failing test, or why it is an error


def load_mutants(directory: Path = MUTANTS) -> list[Mutant]:
    """Every entry of every YAML file under `directory`, in file then entry order; an entry
    missing a field, or with a field of the wrong type, raises ValueError naming it."""
    found = []
    for path in sorted(directory.glob("*.yaml")):
        entries = yaml.safe_load(path.read_text()) or []
        where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        if not isinstance(entries, list):
            raise ValueError(f"{where}: a YAML list of mutants expected")
        for n, entry in enumerate(entries):
            if not isinstance(entry, dict) or set(entry) != set(FIELDS):
                keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
                raise ValueError(f"{where} entry {n}: fields {list(FIELDS)} expected, got {keys}")
            tests = entry["tests"]
            if (not all(isinstance(entry[k], str) for k in ("id", "file", "old", "new"))
                    or not isinstance(tests, list) or not tests
                    or not all(isinstance(t, str) for t in tests)
                    or not isinstance(entry["quick"], bool)):
                raise ValueError(f"{where} entry {n} ({entry.get('id')}): id, file, old, new are "
                                 "strings, tests a non-empty list of node ids, quick a boolean")
            found.append(Mutant(entry["id"], entry["file"], entry["old"], entry["new"],
                                tuple(tests), entry["quick"], str(where)))
    return found


def select(mutants: list[Mutant], *, ids=(), files=(), quick=False, substring=None) -> list[Mutant]:
    """The mutants named by `ids` or breaking one of `files` (all when neither is given), then
    only the quick ones (`quick`) and those whose id contains `substring`."""
    named = [m for m in mutants if (not ids and not files) or m.id in ids or m.file in files]
    chosen = [m for m in named if (not quick or m.quick or m.id in ids)
              and (substring is None or substring in m.id)]
    unknown = set(ids) - {m.id for m in mutants}
    if unknown:
        raise SystemExit(f"no mutant with id {sorted(unknown)}")
    return chosen


def mutated(text: str, mutant: Mutant) -> str:
    """`text` with the mutant applied; ValueError unless its `old` occurs exactly once."""
    count = text.count(mutant.old)
    if count != 1:
        raise ValueError(f"{mutant.id}: `old` occurs {count} times in {mutant.file}, not once")
    if mutant.old == mutant.new:
        raise ValueError(f"{mutant.id}: `new` is `old`: nothing is broken")
    return text.replace(mutant.old, mutant.new)


def repository_files(repo: Path = REPO) -> list[str]:
    """The files a test run sees: git's tracked and untracked-not-ignored files that exist."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=repo, check=True, capture_output=True).stdout.decode()
    return sorted({name for name in out.split("\0") if name and (repo / name).is_file()})


def scratch_copy(dest: Path, repo: Path = REPO) -> None:
    """The repository's files copied under `dest`, its shared build folders linked."""
    for name in repository_files(repo):
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / name, target)
    for name in SHARED:
        if (repo / name).exists():
            (dest / name).symlink_to((repo / name).resolve())


def run_env(copy: Path) -> dict[str, str]:
    """The environment of a test run in `copy`: the copy first on every process's import path
    (ranks and subprocesses inherit it), no bytecode written (a mutant and its original can
    have the same size and mtime second)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1", DS_ACCELERATOR="cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", str((REPO / ".build" / "torch_extensions").resolve()))
    return env


def pytest_command(tests: tuple[str, ...]) -> list[str]:
    """pytest over the mutant's tests, every outcome listed (`-rA`) so each test is judged."""
    return [sys.executable, "-m", "pytest", "-q", "-rA", "-n", "0", "-p", "no:cacheprovider",
            *tests]


def outcomes_by_test(output: str, tests: tuple[str, ...]) -> dict[str, set[str]]:
    """{node id of the mutant: the outcomes (PASSED, FAILED, ERROR, SKIPPED) of its cases}
    from pytest's `-rA` summary lines."""
    found: dict[str, set[str]] = {test: set() for test in tests}
    for line in output.splitlines():
        word, _, rest = line.partition(" ")
        if word not in ("PASSED", "FAILED", "ERROR", "SKIPPED"):
            continue
        node = rest.split(" - ")[0].strip()
        for test in tests:
            if node == test or node.startswith(test + "["):
                found[test].add(word)
    return found


def verdict_of(returncode: int, output: str, tests: tuple[str, ...]) -> tuple[str, str]:
    """(verdict, detail) of a mutant's pytest run: caught when every one of its tests failed
    (a case of it failed or errored; or collecting failed: the package does not import),
    survived when one of them passed every case, error otherwise (not run, skipped, usage)."""
    lines = output.splitlines()
    if returncode == 2 and not any(line.startswith(("PASSED ", "FAILED ")) for line in lines):
        return "caught", ("collection failed: " + " | ".join(lines[-2:]))[:200]
    results = outcomes_by_test(output, tests)
    caught = [t for t, seen in results.items() if seen & {"FAILED", "ERROR"}]
    passed = [t for t, seen in results.items() if seen and seen <= {"PASSED"}]
    if returncode in (0, 1) and len(caught) == len(tests):
        return "caught", "; ".join(t.split("::")[-1] for t in caught)[:200]
    if passed:
        return "survived", ("passed: " + "; ".join(t.split("::")[-1] for t in passed))[:200]
    tail = " | ".join(lines[-3:])
    return "error", f"pytest exit {returncode}: {tail}"[:300]


def run_mutant(mutant: Mutant, *, timeout: float | None, keep: bool = False,
               repo: Path = REPO) -> Outcome:
    """Copy, mutate, run the mutant's tests: `verdict_of` their outcome (a timeout: error)."""
    start = time.monotonic()
    copy = Path(tempfile.mkdtemp(prefix=f"mutant-{mutant.id}-"))
    try:
        scratch_copy(copy, repo)
        path = copy / mutant.file
        try:
            path.write_text(mutated(path.read_text(), mutant))
        except (OSError, ValueError) as e:
            return Outcome(mutant.id, "error", time.monotonic() - start, str(e))
        try:
            proc = subprocess.run(pytest_command(mutant.tests), cwd=copy, env=run_env(copy),
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return Outcome(mutant.id, "error", time.monotonic() - start,
                           f"timed out after {timeout:.0f} s")
        verdict, detail = verdict_of(proc.returncode, proc.stdout + proc.stderr, mutant.tests)
        return Outcome(mutant.id, verdict, time.monotonic() - start, detail)
    finally:
        if keep:
            print(f"kept {copy}", file=sys.stderr)
        else:
            shutil.rmtree(copy, ignore_errors=True)


def run_baseline(mutants: list[Mutant], *, timeout: float | None, repo: Path = REPO) -> list[str]:
    """The selected mutants' tests run once in an unmutated scratch copy: the tests that did
    not pass (a mutant "caught" by a test that fails anyway proves nothing)."""
    tests = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
    copy = Path(tempfile.mkdtemp(prefix="mutant-baseline-"))
    try:
        scratch_copy(copy, repo)
        proc = subprocess.run(pytest_command(tests), cwd=copy, env=run_env(copy),
                              capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    results = outcomes_by_test(proc.stdout + proc.stderr, tests)
    return [t for t, seen in results.items() if seen != {"PASSED"}]


class _Collector:
    """A pytest plugin recording each collected item's node id and whether it is slow."""

    def __init__(self) -> None:
        self.items: dict[str, bool] = {}

    def pytest_collection_modifyitems(self, items) -> None:
        for item in items:
            self.items[item.nodeid] = item.get_closest_marker("slow") is not None


def collect(test_files: list[str], repo: Path = REPO) -> dict[str, bool]:
    """{node id: slow} of every test in `test_files`, collected (not run) in this process."""
    import pytest

    collector = _Collector()
    cwd, printed = os.getcwd(), io.StringIO()
    if str(repo) not in sys.path:  # tests import each other as `tests.<module>`, as under
        sys.path.insert(0, str(repo))  # `python -m pytest` from the repository's root
    os.chdir(repo)
    try:
        with contextlib.redirect_stdout(printed):
            code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *test_files],
                               plugins=[collector])
    finally:
        os.chdir(cwd)
    if code not in (0, 5):
        raise SystemExit(f"{printed.getvalue()[-3000:]}\ncollecting {test_files} failed "
                         f"(pytest exit {code})")
    return collector.items


def matching(node: str, collected: dict[str, bool]) -> list[str]:
    """The collected ids a node id names: itself, or its parametrized cases."""
    return [n for n in collected if n == node or n.startswith(node + "[")]


def check(mutants: list[Mutant], repo: Path = REPO) -> list[str]:
    """Every problem of the entries: duplicate ids, a file that is not there, an `old` not
    occurring exactly once, a node id that collects nothing, a quick entry naming a slow test."""
    problems = []
    seen: dict[str, str] = {}
    for m in mutants:
        if m.id in seen:
            problems.append(f"{m.id}: id also used in {seen[m.id]}")
        seen[m.id] = m.source
        path = repo / m.file
        if not path.is_file():
            problems.append(f"{m.id}: no file {m.file}")
            continue
        try:
            mutated(path.read_text(), m)
        except ValueError as e:
            problems.append(str(e))
    files = sorted({t.split("::")[0] for m in mutants for t in m.tests})
    absent = [f for f in files if not (repo / f).is_file()]
    problems += [f"no test file {f}" for f in absent]
    collected = collect([f for f in files if f not in absent], repo) if files else {}
    for m in mutants:
        for test in m.tests:
            if test.split("::")[0] in absent:
                continue
            nodes = matching(test, collected)
            if not nodes:
                problems.append(f"{m.id}: test {test} is not collected")
            elif m.quick and any(collected[n] for n in nodes):
                problems.append(f"{m.id}: quick, but {test} is marked slow")
    return problems


def table(outcomes: list[Outcome]) -> str:
    width = max([len(o.id) for o in outcomes] + [6])
    lines = [f"{'mutant':<{width}}  verdict   seconds  detail"]
    lines += [f"{o.id:<{width}}  {o.verdict:<8}  {o.seconds:7.1f}  {o.detail}" for o in outcomes]
    counts = {v: sum(o.verdict == v for o in outcomes) for v in ("caught", "survived", "error")}
    total = sum(o.seconds for o in outcomes)
    lines.append(f"{len(outcomes)} mutants: {counts['caught']} caught, {counts['survived']} "
                 f"survived, {counts['error']} error, {total:.0f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--id", action="append", default=[], help="run this mutant (repeatable)")
    parser.add_argument("--file", action="append", default=[],
                        help="the mutants of this production file (repeatable)")
    parser.add_argument("--quick", action="store_true",
                        help="only the quick-tier mutants (and those named by --id)")
    parser.add_argument("-k", dest="substring", help="only mutants whose id contains this")
    parser.add_argument("--list", action="store_true", help="print the selected mutants, run none")
    parser.add_argument("--check", action="store_true",
                        help="validate the selected entries (files, `old`, node ids), run none")
    parser.add_argument("--json", type=Path, help="write the outcomes here as JSON")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds one mutant's tests may take (default 900)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copies")
    parser.add_argument("--baseline", action="store_true",
                        help="first run the selected mutants' tests unmutated: each must pass")
    args = parser.parse_args(argv)

    mutants = select(load_mutants(), ids=args.id, files=args.file, quick=args.quick,
                     substring=args.substring)
    if args.list:
        for m in mutants:
            tier = "quick" if m.quick else "slow"
            print(f"{m.id:<40} {tier:<5} {m.file}  ->  {', '.join(m.tests)}")
        return 0
    if args.check:
        problems = check(mutants)
        for problem in problems:
            print(problem)
        print(f"{len(mutants)} mutants checked: {len(problems)} problems")
        return 1 if problems else 0

    if args.baseline:
        failing = run_baseline(mutants, timeout=args.timeout)
        print(f"baseline: {len(failing)} of the tests fail unmutated" +
              "".join(f"\n  {t}" for t in failing), file=sys.stderr, flush=True)
        if failing:
            return 1
    outcomes = []
    for m in mutants:
        outcome = run_mutant(m, timeout=args.timeout, keep=args.keep)
        print(f"{outcome.id}: {outcome.verdict} ({outcome.seconds:.1f} s) {outcome.detail}",
              file=sys.stderr, flush=True)
        outcomes.append(outcome)
    print(table(outcomes))
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(o) for o in outcomes], indent=1))
    return 0 if all(o.verdict == "caught" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
