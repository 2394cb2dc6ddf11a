"""The house rules, checked on the source: the layers of docs/architecture.md hold.

- no import cycle between ringattn's modules, counting imports inside functions too;
- a ringattn module is imported inside a function only if importing it imports an optional
  dependency (the serve worker's FastAPI app): lazy imports are for optional extras, never a way
  to dodge a cycle; `import ringattn` and the CLI import no optional package at module level;
- integrations/ never imports inference/, serve/, train/ or cli/;
- the core (the top-level modules, kernels/, strategies/) never imports an application package;
- `inference/`, `planner/` and `models/` never import `train/`; `models/` imports no application
  but `runtime/`;
- `import ringattn` needs only torch: no optional dependency and no application is imported;
- no module over 400 lines, no folder over 14 modules, no test file over 500 lines;
- in library code every tensor factory names its device.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "src" / "ringattn"
CORE_PACKAGES = ("comm", "kernels", "strategies")
APPLICATIONS = ("train", "bench", "cli", "integrations", "runtime", "testing", "inference",
                "models", "planner", "hf", "evals")  # fmt: skip


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """ringattn modules imported anywhere in the module (at module level or inside functions)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
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
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
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


@pytest.mark.slow
def test_import_ringattn_needs_only_torch():
    code = (
        "import sys, ringattn\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('transformers', 'triton', 'matplotlib'))\n"
        "apps = sorted(m for m in sys.modules if m.startswith(('ringattn.train', 'ringattn.bench',"
        " 'ringattn.cli', 'ringattn.testing', 'ringattn.inference', 'ringattn.planner',"
        " 'ringattn.evals')))\n"
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


# pyproject.toml's [project] dependencies: everything else outside the standard library is an
# optional extra (transformers, fastapi, pydantic, matplotlib, tensorboard, pyarrow, triton...)
REQUIRED = ("torch", "numpy", "typing_extensions")


def _split_imports(tree: ast.AST) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(line, module) of every import statement: those that run when the module is imported
    (module level, class bodies, try/if blocks) and those inside a function body."""
    top: list[tuple[int, str]] = []
    lazy: list[tuple[int, str]] = []

    def names(node: ast.AST) -> list[tuple[int, str]]:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found = [(node.lineno, node.module)]
            # `from ringattn.serve import worker` imports the module ringattn.serve.worker
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
            return found
        if isinstance(node, ast.Import):
            return [(node.lineno, a.name) for a in node.names]
        return []

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            (lazy if inside else top).extend(names(child))
            walk(child, inside)

    walk(tree, False)
    return top, lazy


def _optional(module: str) -> bool:
    root = module.split(".")[0]
    return root not in sys.stdlib_module_names and root not in REQUIRED and root != "ringattn"


def _needs_an_extra() -> dict[str, set[str]]:
    """For each ringattn module, the optional packages that importing it imports: its own
    module-level imports and those of the ringattn modules it imports at module level."""
    modules = _modules()
    own, deps = {}, {}
    for name, path in modules.items():
        top, _ = _split_imports(ast.parse(path.read_text()))
        own[name] = {m.split(".")[0] for _, m in top if _optional(m)}
        deps[name] = {m for _, m in top if m in modules and m != name}
        parts = name.split(".")  # importing a.b.c runs a/__init__ and a/b/__init__ first
        deps[name] |= {".".join(parts[:i]) for i in range(1, len(parts))} & set(modules)
    closure: dict[str, set[str]] = {}

    def visit(name: str, seen: set[str]) -> set[str]:
        if name not in closure:
            seen.add(name)
            found = set(own[name])
            for dep in deps[name] - seen:
                found |= visit(dep, seen)
            closure[name] = found
        return closure[name]

    for name in modules:
        visit(name, set())
    return closure


@pytest.mark.slow
def test_lazy_imports_are_for_optional_dependencies_only():
    """A ringattn module is imported inside a function only when importing it needs an optional
    extra (e.g. the serve worker, whose FastAPI app needs pydantic): never to dodge a cycle."""
    needs = _needs_an_extra()
    assert needs["ringattn.serve.api.schema"] == {"pydantic"}  # the walk sees third-party imports
    lazy = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in ROOT.rglob("*.py")
        for line, module in _split_imports(ast.parse(path.read_text()))[1]
        if (module == "ringattn" or module.startswith("ringattn."))
        and module in needs
        and not needs[module]
    ]
    assert not lazy, "\n".join(lazy)


def test_commands_start_without_optional_extras():
    """`import ringattn` and the CLI import no optional package at module level: a bare `pip
    install ringattn` runs every command that needs no extra (tests/test_bare_install.py runs
    them in a fresh environment); the commands that need one say so (runtime/extras.py)."""
    needs = _needs_an_extra()
    for entry in ("ringattn", "ringattn.cli.main", "ringattn.__main__"):
        assert not needs[entry], f"importing {entry} imports the optional {sorted(needs[entry])}"
    assert needs["ringattn.hf"] == {"transformers"}  # says which extra, on import


def test_integrations_never_import_the_applications():
    """integrations/ adapts transformers and torch to the core; inference/, serve/, train/ and
    the CLI build on it, never the reverse (the HF decoding engine lives in inference/hf/)."""
    modules = _modules()
    apps = ("ringattn.inference", "ringattn.serve", "ringattn.train", "ringattn.cli")
    for name, path in modules.items():
        if name.startswith("ringattn.integrations"):
            bad = sorted(d for d in _imports(path, modules) if d.startswith(apps))
            assert not bad, f"{name} imports {bad}"


def test_applications_stand_side_by_side():
    """inference/, planner/ and models/ never import train/; models/ imports the core and
    runtime/ only (the trainer, inference and the planner all build on it)."""
    modules = _modules()
    for name, path in modules.items():
        room = name.split(".")[1] if "." in name else ""
        deps = _imports(path, modules)
        if room in ("inference", "planner", "models"):
            bad = sorted(d for d in deps if d.startswith("ringattn.train"))
            assert not bad, f"{name} imports {bad}"
        if room in ("inference", "integrations", "models", "hf"):  # evals/ builds on them
            bad = sorted(d for d in deps if d.startswith("ringattn.evals"))
            assert not bad, f"{name} imports {bad}"
        if room == "models":
            bad = sorted(
                d
                for d in deps
                if not (
                    _is_core(d)
                    or d == "ringattn"
                    or d.startswith(("ringattn.models", "ringattn.runtime", "ringattn.comm"))
                )
            )
            assert not bad, f"{name} imports {bad}"


def test_no_folder_over_14_modules():
    crowded = {
        str(folder.relative_to(ROOT.parent)): n
        for folder in [ROOT, *(p for p in ROOT.rglob("*") if p.is_dir())]
        if (n := len(list(folder.glob("*.py")))) > 14
    }
    assert not crowded, crowded


def test_no_test_file_over_500_lines():
    tests = pathlib.Path(__file__).resolve().parent
    long = {p.name: n for p in tests.glob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "randn", "rand",
             "randint", "randperm", "eye", "as_tensor", "empty_strided")  # fmt: skip


def _factory_calls_without_device(tree: ast.AST) -> list[int]:
    """Lines of torch.<factory>(...) calls that do not pass device= (the *_like and new_*
    forms inherit a tensor's device and are fine)."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        func = node.func
        if not (isinstance(func.value, ast.Name) and func.value.id == "torch"):
            continue
        if func.attr in FACTORIES and not any(k.arg == "device" for k in node.keywords):
            lines.append(node.lineno)
    return lines


def test_every_tensor_factory_names_its_device():
    """Library code creates every tensor on an explicit device (`device="cpu"` on purpose is
    fine): a factory without one lands on the CPU next to CUDA inputs, a crash that only a GPU
    shows. The testing/ helpers are included; the tests themselves are not library code."""
    missing = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in ROOT.rglob("*.py")
        for line in _factory_calls_without_device(ast.parse(path.read_text()))
    ]
    assert not missing, "tensor factories without device=:\n" + "\n".join(missing)
