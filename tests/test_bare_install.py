"""A bare `pip install ringattn` (no extras) runs every command that needs none.

A fresh virtual environment gets torch (see below), then this package **without extras**
(torch, numpy and typing_extensions only: no transformers, FastAPI, pydantic, matplotlib,
tensorboard, pyarrow). In it:
- `ringattn --help` and `--version` through the installed console script;
- `demo`, `train` (our decoder), `plan`, `layout`, `check`, `attention-demo` and `bench`, small,
  exit 0;
- every command or flag that needs an extra stops with one line naming the extra and the install
  command, exit code 2, no traceback;
- `import ringattn.hf` raises an ImportError naming `ringattn[hf]`.

The commands run in one Python process of that environment (`bare_driver.py`), which calls the
CLI's `main` once per command: one torch import instead of one per command.

torch and the rest of ringattn's base requirements are linked into the fresh environment from
this one, as installed distributions (package folders and their dist-info): the README has users
install torch first, and a pip install of torch unpacks 800 MB (22 s of this module's 80). Then
pip installs ringattn with `--no-index`, so it must find every requirement already satisfied:
a requirement missing from the base list fails the install instead of being fetched.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXTRA_PACKAGES = ("transformers", "fastapi", "uvicorn", "pydantic", "matplotlib", "tensorboard",
                  "pyarrow")  # fmt: skip


def _pip(python: pathlib.Path, *args: str) -> None:
    """This environment's pip installing into `python`'s (pip's --python: the bare one has none)."""
    result = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                             "--quiet", *args],
                            check=False, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert result.returncode == 0, f"pip install {' '.join(args)} failed:\n{result.stderr[-3000:]}"


def _base_closure(package: str) -> list[importlib.metadata.Distribution]:
    """The installed distributions `package` needs without extras, itself excluded: its base
    requirements and theirs, as this environment resolved them."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = list(importlib.metadata.distribution(package).requires or [])
    while todo:
        req = Requirement(todo.pop())
        key = re.sub(r"[-_.]+", "-", req.name).lower()
        if key in found or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        found[key] = importlib.metadata.distribution(req.name)
        todo.extend(found[key].requires or [])
    return list(found.values())


def _link_installed(dists: list[importlib.metadata.Distribution], site: pathlib.Path) -> None:
    """Symlink each distribution's top-level entries (packages, modules, dist-info) into `site`."""
    for dist in dists:
        for top in {pathlib.Path(f).parts[0] for f in dist.files or []}:
            if top in ("..", "__pycache__"):
                continue
            (site / top).symlink_to(pathlib.Path(dist.locate_file(top)).resolve())


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> pathlib.Path:
    """The bin/ folder of a fresh venv holding torch and ringattn without extras."""
    base = tmp_path_factory.mktemp("bare")
    venv = [sys.executable, "-m", "venv", "--without-pip", str(base / "venv")]
    subprocess.run(venv, check=True, timeout=300)
    python = base / "venv" / "bin" / "python"
    (site,) = (base / "venv" / "lib").glob("python*/site-packages")
    _link_installed(_base_closure("ringattn"), site)
    # a copy of the sources: pip builds in the tree it is given, and must not write into ours
    source = base / "source"
    skip = shutil.ignore_patterns("*.egg-info", "__pycache__")
    shutil.copytree(ROOT / "src", source / "src", ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    # the setuptools torch brought builds it: an isolated build env would install setuptools
    # again (6 s of 9); what gets installed, and so what the test checks, is the same
    _pip(python, "--no-build-isolation", "--no-index", str(source))
    return python.parent


@pytest.mark.slow
def test_the_bare_environment_has_no_extra(bare):
    code = (
        "import importlib.util, json\n"
        f"print(json.dumps([m for m in {EXTRA_PACKAGES!r} if importlib.util.find_spec(m)]))"
    )
    out = subprocess.run([str(bare / "python"), "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout  # fmt: skip
    assert json.loads(out) == []


@pytest.mark.parametrize("flag, expected", [("--help", "attention-demo"), ("--version", "0.1.0")])
@pytest.mark.slow
def test_console_script(bare, tmp_path, flag, expected):
    result = subprocess.run([str(bare / "ringattn"), flag], check=False,
                            capture_output=True, text=True, cwd=tmp_path, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout


@pytest.mark.slow
def test_import_ringattn_hf_names_the_extra(bare, tmp_path):
    result = subprocess.run([str(bare / "python"), "-c", "import ringattn.hf"], check=False,
                            capture_output=True, text=True, cwd=tmp_path, timeout=300)  # fmt: skip
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        "ImportError: ringattn.hf needs transformers, which is in the hf extra: "
        "pip install 'ringattn[hf]'"
    )


@pytest.fixture(scope="module")
def commands(bare, tmp_path_factory) -> dict[str, dict]:
    """Every case of bare_driver.py, run once: {name: {"code", "out", "err", "files"}}."""
    work = tmp_path_factory.mktemp("bare_run")
    result_path = work / "results.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)  # the bare environment's ringattn, not this checkout's
    result = subprocess.run(
        [str(bare / "python"), str(ROOT / "tests" / "bare_driver.py"), str(result_path)],
        check=False, capture_output=True, text=True, cwd=work, env=env, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result_path.read_text())


RUNS = ("layout", "plan", "check", "attention-demo", "bench", "demo", "train")


@pytest.mark.parametrize("name", RUNS)
@pytest.mark.slow
def test_commands_without_extras_run(commands, name):
    case = commands[name]
    assert case["code"] == 0, case
    assert "Traceback" not in case["err"], case["err"]
    for path, exists in case["files"].items():  # what the command writes
        assert exists, f"{name} did not write {path}"
    if name == "plan":  # --json: one object on stdout
        assert json.loads(case["out"])["plans"], case["out"][:500]


REFUSALS = {
    "serve": "ringattn serve needs the serve extra: pip install 'ringattn[serve]'",
    "generate --hf": "ringattn generate --hf needs the hf extra: pip install 'ringattn[hf]'",
    "train --hf": "ringattn train --hf needs the hf extra: pip install 'ringattn[hf]'",
    "train --tensorboard": (
        "ringattn train --tensorboard needs the tensorboard extra: "
        "pip install 'ringattn[tensorboard]'"
    ),
    "bench --plot": "ringattn bench --plot needs the plot extra: pip install 'ringattn[plot]'",
    "eval niah": "ringattn eval needs the hf extra: pip install 'ringattn[hf]'",
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
@pytest.mark.slow
def test_commands_needing_an_extra_say_which(commands, name):
    case = commands[name]
    assert case["code"] == 2, case
    lines = case["err"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(REFUSALS[name] + " (missing: "), case["err"]
    assert case["out"] == ""
