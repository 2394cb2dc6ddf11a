#!/usr/bin/env bash
# Idempotent set-up: a .venv with the pinned CPU torch and ringattn installed in editable mode.
#
#   bash scripts/setup.sh          # from the repository root or anywhere else
#
# Fast when already done: a stamp file records the hash of pyproject.toml that was installed.
set -euo pipefail

TORCH_PIN="torch==2.13.0"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
STAMP="$VENV/.ringattn-setup-stamp"

cd "$ROOT"

if [[ ! -x "$PY" ]]; then
    echo "[setup] creating virtual environment in .venv"
    python3 -m venv "$VENV"
fi

# The editable install must point at *this* checkout's src/ (a copied .venv may point elsewhere).
# Prints the torch version when all is well.
installed_here() {
    "$PY" - "$ROOT/src" <<'PY' 2>/dev/null
import importlib.util, os, sys
import torch  # a broken torch install means: set up again
spec = importlib.util.find_spec("ringattn")
assert spec is not None and os.path.realpath(spec.origin).startswith(os.path.realpath(sys.argv[1]))
print("torch", torch.__version__)
PY
}

# pip, quiet, minus the warnings about this machine's empty local index folders.
pip_install() {
    "$PY" -m pip install --quiet "$@" 2> >(grep -v "is ignored: it is neither a file nor a" >&2)
}

want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] && version="$(installed_here)"; then
    echo "[setup] already set up ($version)"
    exit 0
fi

if "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "[setup] torch present: $("$PY" -c 'import torch; print(torch.__version__)'), keeping it"
else
    # Torch goes in first, pinned, so that the package's loose `torch>=2.4` is already satisfied
    # and pip never resolves it to another (CUDA) build.
    echo "[setup] installing $TORCH_PIN (a few minutes on a fresh machine)"
    pip_install "$TORCH_PIN"
fi

# transformers goes in pinned, like torch, so that the hf extra's range resolves to a tested version
TRANSFORMERS_PIN="transformers==5.23.0"
# the serve extra (FastAPI + uvicorn, `ringattn serve`) pinned the same way; the official openai
# client is what the server's tests call it with (tests only, not a dependency of ringattn)
SERVE_PINS=("fastapi==0.163.2" "uvicorn==0.54.0")
OPENAI_PIN="openai==3.51.0"
echo "[setup] installing ringattn (editable) with dev, plot, hf and serve extras" \
    "($TRANSFORMERS_PIN ${SERVE_PINS[*]}; $OPENAI_PIN for tests)"
pip_install -e ".[dev,plot,hf,serve]" "$TRANSFORMERS_PIN" "${SERVE_PINS[@]}" "$OPENAI_PIN"

# Optional: llguidance, serve's grammars (the `structured` extra: response_format, tool_choice
# required or a named function); tests/test_serve_structured.py skips without it.
LLGUIDANCE_PIN="llguidance==1.9.1"
if ! "$PY" -c "import llguidance" >/dev/null 2>&1; then
    echo "[setup] installing $LLGUIDANCE_PIN (optional: serve's structured outputs)"
    pip_install "$LLGUIDANCE_PIN" || echo "[setup] $LLGUIDANCE_PIN did not install; structured outputs refuse and their tests skip"
fi

# Tests only: TRL's SFTTrainer and PEFT's LoRA, pinned, for the Trainer integration's equivalence
# tests (tests/test_hf_trainer*.py: ringattn.hf.with_context_parallel); not dependencies of ringattn.
TRAINER_TEST_PINS=("trl==1.16.0" "peft==0.21.2")
if ! "$PY" -c "import trl, peft" >/dev/null 2>&1; then
    echo "[setup] installing ${TRAINER_TEST_PINS[*]} (tests of ringattn.hf.Trainer)"
    pip_install "${TRAINER_TEST_PINS[@]}" "$TRANSFORMERS_PIN" \
        || echo "[setup] ${TRAINER_TEST_PINS[*]} did not install; the Trainer tests will skip"
fi

# Tests only: lm-evaluation-harness with its API models, pinned, for tests/test_serve_lm_eval.py
# (lm-eval scores `ringattn serve` as its own hf backend); not a dependency of ringattn. About two
# minutes on a fresh machine; its pytablewriter needs python-dateutil < 3 (pandas and matplotlib
# take 2.9). Its tasks there are local JSON files: nothing is downloaded at test time.
LM_EVAL_PIN="lm_eval[api]==0.4.13"
if ! "$PY" -c "import lm_eval, tenacity" >/dev/null 2>&1; then
    echo "[setup] installing $LM_EVAL_PIN (tests of ringattn serve's OpenAI API)"
    pip_install "$LM_EVAL_PIN" "$TRANSFORMERS_PIN" \
        || echo "[setup] $LM_EVAL_PIN did not install; tests/test_serve_lm_eval.py will skip"
fi

# Optional: TensorBoard, for `ringattn train --tensorboard` (torch.utils.tensorboard writes the
# event files; tests/test_cluster.py reads them back with tensorboard's EventAccumulator).
TENSORBOARD_PIN="tensorboard==2.21.0"
if ! "$PY" -c "import tensorboard" >/dev/null 2>&1; then
    echo "[setup] installing $TENSORBOARD_PIN (optional: ringattn train --tensorboard)"
    pip_install "$TENSORBOARD_PIN" || echo "[setup] $TENSORBOARD_PIN did not install; --tensorboard and its test will skip"
fi

# Optional: pyarrow, the .parquet reader of `train --hf --data DIR` (tests skip without it)
PYARROW_PIN="pyarrow==26.0.1"
if ! "$PY" -c "import pyarrow" >/dev/null 2>&1; then
    echo "[setup] installing $PYARROW_PIN (optional: .parquet corpora)"
    pip_install "$PYARROW_PIN" || echo "[setup] $PYARROW_PIN did not install; parquet tests skip"
fi

# Optional: Triton, whose CPU interpreter runs the fused merge kernel's tests
# (tests/test_merge_triton.py, skipped without it). The interpreter imports numpy, which ringattn
# must not need, so numpy goes to a side directory that only those tests put on PYTHONPATH.
TRITON_PIN="triton==3.9.0"
if ! "$PY" -c "import triton" >/dev/null 2>&1; then
    echo "[setup] installing $TRITON_PIN (optional: Triton merge tests)"
    pip_install "$TRITON_PIN" || echo "[setup] $TRITON_PIN did not install; its tests will skip"
fi
if ! "$PY" -c "import numpy" >/dev/null 2>&1 && [[ ! -d "$VENV/triton-interp/numpy" ]]; then
    pip_install --target "$VENV/triton-interp" numpy \
        || echo "[setup] numpy did not install: the Triton interpreter tests will skip"
fi

# Optional, as root with apt only: Slurm (slurm-wlm) and munge, for tests/test_slurm.py, which
# starts a one-node cluster of its own (slurmctld, slurmd, munged) and skips without them.
if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null 2>&1 && ! command -v slurmctld >/dev/null 2>&1; then
    echo "[setup] installing slurm-wlm and munge (optional: the Slurm recipe's test)"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -q slurm-wlm munge >/dev/null \
        || { apt-get update -q >/dev/null && apt-get install -y -q slurm-wlm munge >/dev/null; }; } \
        || echo "[setup] slurm-wlm and munge did not install; tests/test_slurm.py will skip"
fi

version="$(installed_here)" || {
    echo "[setup] ringattn is not importable from $ROOT/src after install" >&2
    exit 1
}
echo "$want" > "$STAMP"
echo "[setup] done ($version, ringattn from src/)"
