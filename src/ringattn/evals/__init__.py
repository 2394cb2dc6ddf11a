"""Does the long context work? Retrieval evaluations of a model over a CP group (`ringattn eval`).

    haystack.py  filler text made offline (generated or from --haystack files), as token ids
    tasks.py     the RULER-style prompts: niah, multikey, multivalue, vartrack; each a pure
                 function of (tokenizer, task, length, depth, seed), exactly `length` tokens
    grid.py      answer a grid of (length, depth) prompts greedily through ringattn.hf.generate:
                 context-parallel prefill, the sharded KV cache
    report.py    niah.json, the length x depth table, the heatmap (niah.png)
    worker.py    `ringattn eval niah`: the flags' checks, the ranks, rank 0's outputs

An application beside inference/ and train/: it uses the HF engine (ringattn.hf) and
integrations/hf/source.py; train/ may import it (`train --hf --eval-niah-every`), integrations/
and inference/ never do. transformers is imported only where a model or tokenizer is loaded.
"""
