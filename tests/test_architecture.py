"""The package's shape, as ARCHITECTURE.md draws it: imports flow one way, no cycle, every module
documented, and `pretrain --help` starts without torch."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "pretrain"

# Lower layers never import higher ones; modules of one layer may import each other (no cycle).
# The first matching prefix decides a module's layer.
LAYERS: list[tuple[str, ...]] = [
    ("pretrain.errors", "pretrain.files", "pretrain.log", "pretrain.mounts",
     "pretrain.file_lock", "pretrain.training.deepspeed_imports", "pretrain.storage", "pretrain.resolve",
     "pretrain.training"),
    ("pretrain.config",),
    ("pretrain.resolve.layout", "pretrain.arithmetic", "pretrain.resolve.topology", "pretrain.resolve.ds_config",
     "pretrain.compiled_ops", "pretrain.dist", "pretrain.hardware", "pretrain.data", "pretrain.resolve.world_fit",
     "pretrain.training.collective_log", "pretrain.k8s", "pretrain.resolve.fsdp2_rules",
     "pretrain.resolve.batch_ramp",
     "pretrain.resolve.run_checks", "pretrain.resolve.eval_tasks", "pretrain.families"),
    ("pretrain.resolve.run",),
    ("pretrain.model",),
    ("pretrain.checkpoint", "pretrain.training.sinks", "pretrain.training.profiler", "pretrain.training.curves",
     "pretrain.training.faults", "pretrain.plan", "pretrain.training.hang", "pretrain.training.hang_verdict",
     "pretrain.training.stragglers", "pretrain.training.muon"),
    ("pretrain.training.engine", "pretrain.training.fsdp2",
     "pretrain.training.pipeline_schedules", "pretrain.training.metrics", "pretrain.training.trainer", "pretrain.training.spikes",
     "pretrain.training.evaluators", "pretrain.training.loop_state",
     "pretrain.sweep", "pretrain.launchers", "pretrain.tune", "pretrain.ray_train", "pretrain.testing",
     "pretrain.evaluation"),
    ("pretrain.commands",),
    ("pretrain.cli", "pretrain.__main__"),
]


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `name` imports, at module top or inside functions."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target.startswith("pretrain") and target != name and target != "pretrain":
                found.add(target)
    return found


def _layer(name: str) -> int:
    for index, prefixes in enumerate(LAYERS):  # a package's face by its exact name
        if name in prefixes:
            return index
    for index, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{name} is in no layer of tests/test_architecture.py: add it there and "
                         "to ARCHITECTURE.md")


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_imports_flow_down_the_layers():
    upward = [f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
              for a, targets in _graph().items() if a != "pretrain" for b in sorted(targets)
              if _layer(b) > _layer(a)]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_architecture_md_names_every_module():
    text = (REPO / "ARCHITECTURE.md").read_text()
    listed = set(re.findall(r"`(pretrain/[\w/]+\.py)`", text))
    actual = {str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py")}
    assert not actual - listed, f"modules missing from ARCHITECTURE.md: {sorted(actual - listed)}"
    assert not listed - actual, f"ARCHITECTURE.md names modules that do not exist: {sorted(listed - actual)}"


def test_help_does_not_import_torch():
    """`pretrain --help` and every subcommand's --help only build parsers: no torch, no DeepSpeed."""
    code = ("import sys\nfrom pretrain.cli import build_parser\nbuild_parser()\n"
            "print(sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         check=True).stdout.strip()
    assert out == "[]", f"building the CLI parser imported {out}"


def test_no_reference_outside_the_repository():
    """The design the code follows is ARCHITECTURE.md: nothing cites notes that are not here."""
    pattern = re.compile(r"DESIGN\.md|STYLE\.md|\.\./shared|\b[Ii]ssue \d+\b")
    hits = []
    for path in [*PACKAGE.rglob("*.py"), *(REPO / "tests").glob("*.py"), *(REPO / "bench").glob("*"),
                 *(REPO / "launch").glob("*"), *(REPO / "slurm").glob("*"), REPO / "README.md",
                 REPO / "ARCHITECTURE.md", REPO / "BENCHMARKS.md",
                 *(REPO / "docs").glob("*.md")]:
        if path.is_file() and path != Path(__file__):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    hits.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_the_loops_helpers_take_the_loop_state_not_the_trainer():
    """A spike's rollback and the evaluations take the run's `LoopState`: they neither import
    the trainer nor name a parameter `trainer`, and reach into no private field of what they
    are given (an attribute starting with an underscore, other than their own `self._x`)."""
    helpers = {"pretrain.training.spikes": ("roll_back",),
               "pretrain.training.evaluators": ("ValidationLoss", "TaskEvaluator")}
    modules = _modules()
    for name, entries in helpers.items():
        path = modules[name]
        assert "pretrain.training.trainer" not in _imports(name, path, modules), name
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.arg):
                assert node.arg != "trainer", f"{name}: a parameter named trainer"
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__"):
                owner = node.value
                assert isinstance(owner, ast.Name) and owner.id == "self", \
                    f"{name}:{node.lineno}: reaches into .{node.attr}"
        defined = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        for entry in entries:
            node = defined[entry]
            func = node if isinstance(node, ast.FunctionDef) else next(
                n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
            args = [a for a in func.args.args if a.arg != "self"]
            assert ast.unparse(args[0].annotation) == "LoopState", (name, entry)
