"""The house rules, checked on the source: the layers of docs/architecture.md hold.

- no import cycle between ringattn's modules (module-level imports; imports inside functions are
  lazy by design and do not run at import time);
- the core (the top-level modules, kernels/, strategies/) never imports an application package;
- `import ringattn` needs only torch: no optional dependency and no application is imported;
- no module over 400 lines.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "src" / "ringattn"
CORE_PACKAGES = ("comm", "kernels", "strategies")
APPLICATIONS = ("train", "bench", "cli", "integrations", "runtime", "testing", "inference",
                "planner", "hf")  # fmt: skip


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _top_level_imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """ringattn modules imported at module level (not inside functions)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ringattn"):
            names.add(node.module)
            for alias in node.names:  # `from ringattn.train import checkpoint`
                if f"{node.module}.{alias.name}" in modules:
                    names.add(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("ringattn"))
    return {n for n in names if n in modules}


def _is_core(name: str) -> bool:
    parts = name.split(".")
    if len(parts) == 2:
        return parts[1] not in APPLICATIONS and parts[1] not in ("__main__",)
    return len(parts) > 2 and parts[1] in CORE_PACKAGES


def test_no_import_cycle():
    modules = _modules()
    graph = {name: _top_level_imports(path, modules) - {name} for name, path in modules.items()}
    # a package's __init__ importing its own submodules is how packages work, not a cycle
    graph = {
        name: {d for d in deps if not (name + ".").startswith(d + ".")}
        for name, deps in graph.items()
    }
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep) :] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert len(graph) > 30  # the walk saw the package


def test_core_never_imports_an_application():
    modules = _modules()
    core = [name for name in modules if _is_core(name) and name != "ringattn"]
    assert {"ringattn.api", "ringattn.comm", "ringattn.strategies.ring"} <= set(core)
    for name in core:
        path = modules[name]
        for node in ast.walk(ast.parse(path.read_text())):  # lazy imports count here too
            module = getattr(node, "module", None) if isinstance(node, ast.ImportFrom) else None
            if module and module.startswith("ringattn."):
                assert _is_core(module) or module == "ringattn", f"{name} imports {module}"


def test_import_ringattn_needs_only_torch():
    code = (
        "import sys, ringattn\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('transformers', 'triton', 'matplotlib'))\n"
        "apps = sorted(m for m in sys.modules if m.startswith(('ringattn.train', 'ringattn.bench',"
        " 'ringattn.cli', 'ringattn.testing', 'ringattn.inference', 'ringattn.planner')))\n"
        "print(bad, apps)\n"
        "assert not bad and not apps, (bad, apps)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_module_over_400_lines():
    long = {
        str(path.relative_to(ROOT)): n
        for path in ROOT.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 400
    }
    assert not long, long
