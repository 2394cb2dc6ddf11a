"""schemathesis against `ringattn serve`'s /openapi.json: no 5xx, every answer as documented.

    pip install --target /tmp/st schemathesis==4.32.5        # beside the venv, not in it
    PYTHONPATH=/tmp/st python scripts/tools/schemathesis_serve.py [--max-examples 10]

The tiny chat model of tests/serve_model.py, built offline in a temporary directory, served in
this process (the app and one rank's loop in threads, as the API tests do); schemathesis runs
its coverage, fuzzing and stateful phases over every route but /metrics with the checks
not_a_server_error, status_code_conformance, content_type_conformance and
response_schema_conformance. Its exit code is this script's.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_schema_conformance")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-examples", default="10", help="schemathesis -n")
    args = p.parse_args()
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
    from serve_model import InProcess, save_chat_model

    with tempfile.TemporaryDirectory() as tmp:
        directory = pathlib.Path(tmp) / "tiny"
        save_chat_model(directory)
        server = InProcess(directory)
        root = server.url.removesuffix("/v1")
        try:
            argv = [sys.executable, "-m", "schemathesis.cli", "run", f"{root}/openapi.json",
                    "--url", root, "-n", args.max_examples, "-c", CHECKS, "--exclude-path",
                    "/metrics", "--request-timeout", "120"]  # fmt: skip
            return subprocess.run(argv, env=dict(os.environ), check=False).returncode
        finally:
            server.close()


if __name__ == "__main__":
    raise SystemExit(main())
