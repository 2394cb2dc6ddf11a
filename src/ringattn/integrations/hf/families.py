"""The model families ringattn.hf makes exact: an allow-list, in one place, proven by tests.

`parallelize` (and KV-cache decoding) accepts a text model only when its `config.model_type` is in
`EXACT`: each of those families was built tiny with random weights and trained one step at CP 2
against one process (zigzag, packed documents, loss and gradients within the gates): see
tests/test_hf_families.py, which runs every entry, and scripts/tools/family_survey.py, which surveys
every causal-LM family transformers registers (results/family_survey.json: 189 families with
transformers 5.23). A family not listed is refused by name, whatever its code looks like: one that
transformers adds next month stays refused until someone checks it and adds it here.
`REFUSED` says why the known ones are not listed. Vision-language models are listed in vision.py
(their text decoders' families need not be listed here: vision.py's own tests cover them).

Families with recurrent or convolutional mixers (hybrids) are exact through mixers/, each mixer
class by name; their tests are tests/test_hf_hybrid.py. DeepSeek-V4's compressed attention layers
run the same way, the attention module itself on the whole sequence (mixers/whole_attention.py).

A few listed families are exact only in a configuration that can change after `parallelize` (the
training flag): `install_guards` puts a forward pre-hook on the model that refuses the others by
name, before every forward and so before any communication, on every rank (all ranks run the
same model in the same mode). PhiMoE: its sparsemixer router, in training, draws the experts by
Gumbel sampling among those whose logit is within 2 * router_jitter_noise (relative) of the best
(plus a random Heun mask for the gradient), and input_jitter_noise scales its input by random
factors: a shard draws other numbers than one process, so no step would equal it. With
router_jitter_noise = 0 only the best expert survives the threshold (then the second best), so
the draws cannot change the choice, and in eval the router takes the top 2 without drawing: both
exact (tests/test_hf_phimoe.py).
"""

from __future__ import annotations

# model_type (the causal LM's own config.model_type: Emu3's is emu3_text_model) -> what was
# checked (docs/families.md shows the table)
_SURVEYED = "transformers' own classes, CP 2 zigzag, packed documents"
_HYBRID = "recurrent mixers exact (mixers/hooks.py); CP 2-4, three layouts, packed documents"
_WHOLE = (
    "compressed attention layers run on the whole sequence (mixers/whole_attention.py); CP 2-4, "
    "three layouts, packed documents"
)
EXACT: dict[str, str] = {
    name: _SURVEYED
    for name in (
        "afmoe", "apertus", "arcee", "aria_text", "axk1", "beam", "bert", "bert-generation",
        "biogpt", "bitnet", "cohere", "cohere2", "cohere2_moe", "cohere_compass_text", "ctrl",
        "cwm", "dbrx", "deepseek_v2", "deepseek_v3", "diffllama", "dots1", "electra",
        "emu3_text_model", "ernie", "ernie4_5", "ernie4_5_moe", "exaone4", "exaone_moe",
        "flex_olmo", "flint", "fuyu", "gemma", "gemma2", "gemma3_text", "gemma3n_text",
        "gemma4_text", "gemma4_unified_text", "glm", "glm4", "glm4_moe", "glm4_moe_lite", "gpt2",
        "gpt_bigcode", "gpt_neox", "gpt_oss", "granite", "granite_swa", "granitemoe",
        "granitemoe_swa", "granitemoeshared", "helium", "hrm_text", "hunyuan_v1_dense",
        "hunyuan_v1_moe", "hy_v3", "hyperclovax", "internlm3", "iquestcoder", "jais2", "jetmoe",
        "kolibri1", "laguna", "llama", "longcat_flash", "mellum", "mimo_v2_flash", "minicpm3",
        "minimax_m2", "minimax_m3_vl_text", "ministral", "ministral3", "mistral", "mixtral",
        "mllama_text_model", "modernbert-decoder", "nanochat", "olmo", "olmo2", "olmo3", "olmoe",
        "opt", "persimmon", "phi", "phi3", "phimoe", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
        "roc_bert", "seed_oss", "smollm3", "solar_open", "starcoder2", "vaultgemma", "youtu",
    )
} | {
    name: _HYBRID
    for name in (
        "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "nemotron_h",
        "falcon_h1", "granitemoehybrid", "bamba", "zamba2", "mamba2", "jamba", "mamba",
        "falcon_mamba", "lfm2", "minimax", "zaya", "kimi_linear", "zamba",
    )
} | {"deepseek_v4": _WHOLE}  # fmt: skip

_NOT_INTERFACE = "its attention does not go through transformers' AttentionInterface"
_POSITIONS = "it computes positions inside the model from the shard (learned positions)"
_INDEXER = "its sparse-attention indexer reads a dense mask ringattn does not build"
REFUSED: dict[str, str] = {
    **{name: _NOT_INTERFACE for name in (
        "big_bird", "bloom", "codegen", "cpmant", "falcon", "gpt_neo", "gpt_neox_japanese", "gptj",
        "megatron-bert", "mpt", "mvp", "openai-gpt", "prophetnet", "rembert", "roformer", "rwkv",
        "trocr", "xglm", "xlm", "xlnet",
    )},
    **{name: _POSITIONS for name in (
        "bart", "mbart", "marian", "pegasus", "blenderbot", "blenderbot-small", "plbart",
        "whisper", "bigbird_pegasus", "roberta", "camembert", "xlm-roberta", "xlm-roberta-xl",
        "roberta-prelayernorm", "data2vec-text")},
    **{name: _INDEXER for name in ("deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2")},
    "llama4_text": "chunked attention (attention_chunk_size)",
    "inkling_text": "an additive position bias in attention",
    "inkling2_text": "an additive position bias in attention",
    "doge": "a dense 4-D attention mask",
    "nemotron": "its attention does not pass the batch's document bounds on",
    "stablelm": "its attention does not pass the batch's document bounds on",
    "recurrent_gemma": "its RG-LRU recurrence has no context-parallel path in ringattn",
    "lfm3": "its sequence mixers have not been checked against one process yet",
    "bailing_hybrid": "its linear-attention layers have no context-parallel path in ringattn",
    "rwkv7": "its recurrence has no context-parallel path in ringattn",
    "xlstm": "its recurrence has no context-parallel path in ringattn",
}  # fmt: skip


#: the allow-list as a sorted tuple: the public, documented view (`ringattn.hf.SUPPORTED_FAMILIES`)
SUPPORTED_FAMILIES: tuple[str, ...] = tuple(sorted(EXACT))


def check_family(model: object) -> None:
    """ValueError unless the text model's `config.model_type` is on the allow-list."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type in EXACT:
        return
    name = type(model).__name__
    reason = REFUSED.get(model_type)
    if reason is not None:
        raise ValueError(
            f"{name} (config.model_type={model_type!r}) is refused by ringattn.hf: {reason}, so "
            f"a sharded sequence would not give the single-device loss. Train it with cp 1"
        )
    raise ValueError(
        f"{name} (config.model_type={model_type!r}) is not on ringattn.hf's list of model "
        f"families checked against one process, so ringattn refuses it rather than risk a "
        f"silently wrong loss. `ringattn check --hf DIR` runs your model's architecture tiny "
        f"at cp 1 and cp 2-4 and shows what ringattn does with it; to ask for the family, file "
        f"an issue with that output. Listed: {len(EXACT)} families (docs/families.md)"
    )


GUARD_ATTR = "ringattn_family_guard"


def _random_routers(model: object) -> list[object]:
    """PhiMoE's router and MoE blocks (by their jitter attributes) that would draw at random."""
    return [
        m for m in model.modules()
        if getattr(m, "router_jitter_noise", 0) > 0 or getattr(m, "input_jitter_noise", 0) > 0
    ]  # fmt: skip


def install_guards(model: object) -> None:
    """A forward pre-hook refusing a listed family's non-exact mode (module docstring); once."""
    if getattr(model.config, "model_type", None) != "phimoe" or hasattr(model, GUARD_ATTR):
        return

    def refuse_random_routing(module, args, kwargs):
        # the modules of the model that runs (a deep copy's own), each forward
        training = [m for m in _random_routers(module) if m.training]
        if training:
            jitter = {
                name: getattr(training[0], name)
                for name in ("router_jitter_noise", "input_jitter_noise")
                if getattr(training[0], name, 0) > 0
            }
            raise ValueError(
                f"{type(module).__name__} (config.model_type='phimoe') in training routes "
                f"tokens at random ({', '.join(f'config.{k}={v}' for k, v in jitter.items())}: "
                f"sparsemixer samples experts, input jitter scales inputs), so a sharded "
                f"sequence cannot give the single-device loss. Set config.router_jitter_noise = "
                f"0 and config.input_jitter_noise = 0 before building the model (deterministic "
                f"top-2 routing, exact), call model.eval(), or train with cp 1"
            )

    handle = model.register_forward_pre_hook(refuse_random_routing, with_kwargs=True)
    setattr(model, GUARD_ATTR, handle)
