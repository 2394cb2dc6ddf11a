"""examples/clusters/kubernetes/: the manifests cannot run here (no cluster), so they are read.

- every container that runs `torchrun ... -m ringattn CMD ...` gives torchrun a command line its
  own parser accepts, and ringattn one that our CLI's parser accepts (after Kubernetes'
  `$(VAR)` substitution, with sample values);
- every `$(VAR)` in a command is set in the container's env or injected by the controller
  (LeaderWorkerSet's LWS_*);
- every environment variable set is read by torch (its Python sources name it), by ringattn
  (its sources name it), or feeds a `$(VAR)` of the command.
"""

from __future__ import annotations

import pathlib
import re

import pytest

yaml = pytest.importorskip("yaml")

ROOT = pathlib.Path(__file__).resolve().parents[1]
MANIFESTS = sorted((ROOT / "examples" / "clusters" / "kubernetes").glob("*.yaml"))
INJECTED = {"LWS_LEADER_ADDRESS": "ringattn-serve-0.ringattn-serve", "LWS_GROUP_SIZE": "2",
            "LWS_WORKER_INDEX": "1"}  # fmt: skip
"""What LeaderWorkerSet sets in every container, with sample values."""
SAMPLE = {"JOBSET_NAME": "ringattn-train"}
VAR = re.compile(r"\$\(([A-Z_][A-Z0-9_]*)\)")


def _containers(node: object) -> list[dict]:
    if isinstance(node, dict):
        found = list(node.get("containers", [])) if isinstance(node.get("containers"), list) else []
        return found + [c for v in node.values() for c in _containers(v)]
    if isinstance(node, list):
        return [c for v in node for c in _containers(v)]
    return []


def _named_in(name: str, folder: pathlib.Path) -> bool:
    return any(name in path.read_text(errors="ignore") for path in folder.rglob("*.py"))


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_every_ringattn_command_and_variable_is_one_we_accept(manifest):
    import torch
    from torch.distributed.run import get_args_parser

    from ringattn.cli.main import build_parser

    containers = [c for doc in yaml.safe_load_all(manifest.read_text()) if doc
                  for c in _containers(doc)]  # fmt: skip
    commands = [c for c in containers if c.get("command", [None])[0] == "torchrun"]
    assert commands, f"{manifest.name}: no torchrun command"
    torch_dir = pathlib.Path(torch.__file__).parent
    for container in commands:
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        argv = [*container["command"], *container.get("args", [])]
        used = {v for arg in argv for v in VAR.findall(arg)}
        unknown = used - set(env) - set(INJECTED)
        assert not unknown, f"{manifest.name}: $({', '.join(sorted(unknown))}) is never set"
        values = {**INJECTED, **SAMPLE, **{k: v for k, v in env.items() if v is not None}}
        argv = [VAR.sub(lambda m, v=values: v[m.group(1)], arg) for arg in argv]
        torchrun = get_args_parser().parse_args(argv[1:])
        assert torchrun.module and torchrun.training_script == "ringattn", argv
        try:
            build_parser().parse_args(torchrun.training_script_args)
        except SystemExit as err:
            pytest.fail(f"{manifest.name}: ringattn rejects {torchrun.training_script_args} "
                        f"(exit {err.code}; its message is above)")  # fmt: skip
        for name in set(env) - used:
            assert _named_in(name, ROOT / "src" / "ringattn") or _named_in(
                name, torch_dir / "distributed"
            ), f"{manifest.name}: {name} is read by neither torch.distributed nor ringattn"
