"""Rank functions for hybrid models (tests/test_hf_hybrid.py): recurrent mixers under CP.

Each family is built once per worker process from a tiny config with random weights (seed 0,
initializer range 0.2 so that every layer matters). The reference is one process running each
document of the batch on its own (the state starts from zero at every document start), its
token-loss sums over the whole batch's supervised count; transformers' own PyTorch path is used
for every mixer. The CP side is a deep copy, parallelized, fed by `shard_batch`; the loss and
gradients are summed over the group and rank 0 compares.
"""

from __future__ import annotations

import copy
import itertools

import torch
import torch.distributed as dist

import ringattn.hf

VOCAB = 100
DOCS = (13, 1, 22, 9)  # packed: a one-token document; lengths that no 2W divides
SEQ_LEN = sum(DOCS)
DENSE_LEN = 40


def config(arch: str):
    """A tiny config of `arch` with both its mixer and attention layers."""
    import transformers as tf

    common = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "initializer_range": 0.2,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    mamba2 = {"mamba_n_heads": 4, "mamba_d_head": 8, "mamba_d_state": 8, "mamba_n_groups": 2,
              "mamba_d_conv": 4, "mamba_chunk_size": 8, "mamba_expand": 1}  # fmt: skip
    gdn = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
           "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4}  # fmt: skip
    hybrid = ["linear_attention", "full_attention"]
    if arch == "qwen3_next":  # gated DeltaNet + gated attention + MoE
        return tf.Qwen3NextConfig(
            **common,
            **gdn,
            head_dim=8,
            num_hidden_layers=2,
            layer_types=hybrid,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
        )
    if arch == "qwen3_5_text":
        return tf.Qwen3_5TextConfig(
            **common, **gdn, head_dim=8, num_hidden_layers=2, layer_types=hybrid
        )
    if arch == "olmo_hybrid":
        return tf.OlmoHybridConfig(**common, **gdn, num_hidden_layers=2, layer_types=hybrid)
    if arch == "qwen3_5_moe_text":
        return tf.Qwen3_5MoeTextConfig(**common, **gdn, head_dim=8, num_hidden_layers=2,
                                       layer_types=hybrid, num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=16,
                                       shared_expert_intermediate_size=16)  # fmt: skip
    if arch == "qwen3_5_even":  # as many value heads as key heads
        return tf.Qwen3_5TextConfig(**common, **{**gdn, "linear_num_value_heads": 2}, head_dim=8,
                                    num_hidden_layers=2, layer_types=hybrid)  # fmt: skip
    if arch == "qwen3_5_wide":  # 4 key heads: head-parallel at W = 4 (and whole at W = 3)
        return tf.Qwen3_5TextConfig(**common, **{**gdn, "linear_num_key_heads": 4,
                                    "linear_num_value_heads": 8}, head_dim=8, num_hidden_layers=2,
                                    layer_types=hybrid)  # fmt: skip
    if arch == "nemotron_h_wide":  # 4 groups, biases: head-parallel at W = 4
        return tf.NemotronHConfig(**common, head_dim=8, num_hidden_layers=2,
                                  hybrid_override_pattern="M*", mamba_num_heads=8,
                                  mamba_head_dim=4, ssm_state_size=8, n_groups=4, conv_kernel=4,
                                  chunk_size=8, mamba_expand=1, use_bias=True,
                                  use_conv_bias=True)  # fmt: skip
    if arch == "nemotron_h":  # Mamba2 + attention + MLP blocks
        return tf.NemotronHConfig(
            **common,
            head_dim=8,
            num_hidden_layers=3,
            hybrid_override_pattern="M*-",
            mamba_num_heads=4,
            mamba_head_dim=8,
            ssm_state_size=8,
            n_groups=2,
            conv_kernel=4,
            chunk_size=8,
            mamba_expand=1,
        )
    if arch == "falcon_h1":  # Mamba2 beside attention in every layer
        return tf.FalconH1Config(
            **common, **mamba2, head_dim=8, num_hidden_layers=2, mamba_d_ssm=32
        )
    if arch == "granitemoehybrid":
        return tf.GraniteMoeHybridConfig(
            **common,
            **mamba2,
            num_hidden_layers=2,
            layer_types=["mamba", "attention"],
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=32,
        )
    if arch == "bamba":
        return tf.BambaConfig(**common, **mamba2, num_hidden_layers=2, attn_layer_indices=[1])
    if arch == "zamba2":
        return tf.Zamba2Config(
            **common,
            num_hidden_layers=3,
            n_mamba_heads=4,
            layers_block_type=["mamba", "hybrid", "mamba"],
            mamba_d_state=8,
            mamba_ngroups=2,
            mamba_d_conv=4,
            chunk_size=8,
            mamba_expand=1,
            attention_head_dim=8,
            num_mem_blocks=1,
            use_mem_rope=True,
        )
    if arch == "jamba":  # Mamba1 + attention + MoE
        return tf.JambaConfig(
            **common,
            num_hidden_layers=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
            num_experts_per_tok=2,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=1,
            mamba_dt_rank=4,
        )
    if arch == "lfm2":  # short convolutions + attention
        return tf.Lfm2Config(
            **common, num_hidden_layers=2, layer_types=["conv", "full_attention"], conv_L_cache=3
        )
    if arch == "minimax":  # lightning attention + attention + MoE
        return tf.MiniMaxConfig(
            **common,
            head_dim=8,
            num_hidden_layers=2,
            layer_types=hybrid,
            num_local_experts=4,
            num_experts_per_tok=2,
            block_size=8,
        )
    if arch == "zaya":  # CCA: causal convolutions on q/k (3 tokens back), v from the previous
        # token; a sliding and a full layer; MoE
        return tf.ZayaConfig(
            **common,
            head_dim=8,
            num_hidden_layers=2,
            layer_types=["hybrid_sliding", "hybrid"],
            sliding_window=6,
            num_experts=4,
            moe_intermediate_size=16,
            cca_time0=3,
            cca_time1=2,
        )
    if arch.startswith("deepseek_v4"):  # a sliding, a CSA and an HCA layer: windows of 2 and 4
        # tokens, the indexer keeps 2 entries of up to 11, a window of 4 (the pooled keys matter);
        # _aux: the router load-balancing loss in the loss too (integrations/hf/moe.py)
        return tf.DeepseekV4Config(
            output_router_logits=arch == "deepseek_v4_aux",
            router_aux_loss_coef=0.1,
            **{k: v for k, v in common.items() if k != "intermediate_size"},
            moe_intermediate_size=16,
            num_hidden_layers=3,
            head_dim=16,
            q_lora_rank=16,
            partial_rotary_factor=0.5,
            n_routed_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "compressed_sparse_attention",
                         "heavily_compressed_attention"],
            mlp_layer_types=["hash_moe", "moe", "moe"],
            compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            hc_mult=2,
            hc_sinkhorn_iters=3,
            sliding_window=4,
            o_groups=2,
            o_lora_rank=8,
            index_n_heads=2,
            index_head_dim=8,
            index_topk=2,
        )  # fmt: skip
    if arch == "llama_like":  # a plain decoder, for the refusal tests
        return tf.LlamaConfig(**common, num_hidden_layers=2)
    if arch == "mamba2":
        return tf.Mamba2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_heads=8,
            head_dim=8,
            state_size=8,
            n_groups=2,
            conv_kernel=4,
            chunk_size=8,
            expand=2,
            initializer_range=0.2,
        )
    if arch == "mamba":
        return tf.MambaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            state_size=8,
            conv_kernel=4,
            expand=2,
            time_step_rank=4,
            initializer_range=0.2,
        )
    if arch == "falcon_mamba":
        return tf.FalconMambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                    state_size=8, conv_kernel=4, expand=2, time_step_rank=4,
                                    initializer_range=0.2)  # fmt: skip
    raise ValueError(f"unknown test architecture {arch!r}")


_MODELS: dict[str, torch.nn.Module] = {}
# gated DeltaNet families run transformers' chunked delta rule in float64 (a copy of it whose
# casts to float32 say float64; its output is cast back to the model's float32): with the
# float32 one, the summed gradients of A_log and dt_bias, sums over tokens with much
# cancellation, differ from one process's by up to ~1e-4 of their largest entry for any
# rearrangement of the work (runs, padded documents), which the gates cannot tell from a defect
_FLOAT64_KERNEL = {"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid",
                   "qwen3_5_even", "qwen3_5_wide"}  # fmt: skip


def _float64_delta_rule(model: torch.nn.Module) -> None:
    """The modeling file's torch_chunk_gated_delta_rule, computing in float64 (test only)."""
    import inspect
    import sys

    module = sys.modules[type(model).__module__]
    name = "torch_chunk_gated_delta_rule"
    if getattr(getattr(module, name), "_ringattn_float64", False):
        return
    function = inspect.unwrap(getattr(module, name))
    source = inspect.getsource(function).replace("torch.float32", "torch.float64")
    source = "\n".join(line for line in source.splitlines() if not line.startswith("@"))
    namespace = dict(vars(module))
    exec(source, namespace)  # noqa: S102 - transformers' own source, one dtype changed
    namespace[name]._ringattn_float64 = True
    setattr(module, name, namespace[name])


def build(arch: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if arch not in _MODELS:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config(arch)).float()
        if arch in _FLOAT64_KERNEL:
            _float64_delta_rule(model)
        if arch.startswith("deepseek_v4"):  # what the initialisation leaves at zero: random too
            with torch.no_grad():
                for name, tensor in itertools.chain(
                    model.named_parameters(), model.named_buffers()
                ):
                    if name.endswith(("sinks", "position_bias")):
                        tensor.normal_(0.0, 0.5)
                    elif name.endswith("tid2eid"):  # the hash router's token -> experts table
                        tensor.copy_(torch.randint(0, 4, tensor.shape))
        _MODELS[arch] = model
    return _MODELS[arch]


def data(kind: str) -> dict[str, torch.Tensor]:
    """The full batch: `dense` one document, `packed` documents by position_ids restarting."""
    gen = torch.Generator().manual_seed(1)
    lengths = (DENSE_LEN,) if kind == "dense" else DOCS
    ids = torch.randint(3, VOCAB, (1, sum(lengths)), generator=gen)
    labels = ids.clone()
    bounds = [0, *itertools.accumulate(lengths)]
    labels[:, bounds[:-1]] = -100
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def _documents(batch: dict) -> list[slice]:
    pos = batch["position_ids"][0]
    starts = [0, *(torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1).tolist(), pos.numel()]
    return [slice(a, b) for a, b in itertools.pairwise(starts)]


_REFERENCES: dict[tuple, tuple[float, dict[str, torch.Tensor]]] = {}


def reference(arch: str, kind: str) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, each document alone: sum of token losses / the batch's supervised count."""
    key = (arch, kind)
    if key not in _REFERENCES:
        model = build(arch)
        batch = data(kind)
        count = int((batch["labels"] != -100).sum())
        model.zero_grad(set_to_none=True)
        total = 0.0
        for doc in _documents(batch):
            ids, labels = batch["input_ids"][:, doc], batch["labels"][:, doc]
            if ids.shape[1] < 2:
                continue  # nothing to predict, no token of it is supervised
            out = model(input_ids=ids, labels=labels, num_items_in_batch=count, use_cache=False)
            out.loss.backward()
            total += out.loss.item()
        grads = {
            name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for name, p in model.named_parameters()
        }
        _REFERENCES[key] = (total, grads)
    return _REFERENCES[key]


_PARALLEL: dict[tuple, torch.nn.Module] = {}


def parallel_model(arch: str, layout: str, strategy: str, scheme: str = "auto") -> torch.nn.Module:
    key = (arch, layout, strategy, scheme)
    if key not in _PARALLEL:
        model = copy.deepcopy(build(arch))
        _PARALLEL[key] = ringattn.hf.parallelize(
            model, layout=layout, strategy=strategy, mixer_scheme=scheme
        )
    return _PARALLEL[key]


def cp_loss_and_grads(arch: str, kind: str, layout: str, strategy: str, scheme: str = "auto"):
    model = parallel_model(arch, layout, strategy, scheme)
    model.zero_grad(set_to_none=True)
    batch = ringattn.hf.shard_batch(data(kind), layout=layout)
    out = model(**batch)
    out.loss.backward()
    params = list(model.named_parameters())
    flat = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for _, p in params]
        + [out.loss.detach().reshape(1)]
    )
    dist.all_reduce(flat)
    grads, offset = {}, 0
    for name, p in params:
        grads[name] = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return float(flat[-1]), grads


def schemes(
    rank: int, world_size: int, *, arch: str, layout: str = "zigzag", scheme: str = "auto"
) -> dict:
    """How each mixer of `arch` runs at this world size (mixers.schemes)."""
    from ringattn.integrations.hf.mixers import schemes as mixer_schemes

    return mixer_schemes(parallel_model(arch, layout, "ring", scheme))


def compare_cases(
    rank: int, world_size: int, *, arch: str, cases, scheme: str = "auto", piece: int = 0
) -> list | None:
    """Rows (case, loss relative error, worst gradient error / its tensor's max |entry|, name).
    `piece` > 0: the state scheme cuts runs into pieces of that many tokens at least (runs.py's
    MIN_PIECE), so that the tiny test sequences are cut too."""
    from ringattn.integrations.hf.mixers import runs as runs_module

    rows, saved = [], runs_module.MIN_PIECE
    for layout, strategy, kind in cases:
        runs_module.MIN_PIECE = piece or saved
        try:
            loss, grads = cp_loss_and_grads(arch, kind, layout, strategy, scheme)
        finally:
            runs_module.MIN_PIECE = saved
        if rank != 0:
            continue
        ref_loss, ref_grads = reference(arch, kind)
        worst, worst_name = 0.0, ""
        for name, ref in ref_grads.items():
            scale = ref.abs().max().item()
            ratio = (grads[name] - ref).abs().max().item() / max(scale, 1e-30)
            if not ratio <= worst:  # NaN counts as worst
                worst, worst_name = ratio, name
        rows.append(
            ((layout, strategy, kind), abs(loss - ref_loss) / abs(ref_loss), worst, worst_name)
        )
    return rows if rank == 0 else None


def _shift_tokens(module, args, kwargs):
    """A mutation: the mixer's input rows rolled by one token on each rank (every token's state
    entering from the wrong token), run before parallelize's own pre-hook."""
    if args:
        return (args[0].roll(1, dims=1), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": kwargs["hidden_states"].roll(1, dims=1)}


def mutated_errors(rank: int, world_size: int, *, arch: str) -> list | None:
    """compare_cases with the mutation on every mixer: the tests must see it."""
    from ringattn.integrations.hf.mixers import MIXERS

    model = copy.deepcopy(build(arch))
    ringattn.hf.parallelize(model, layout="zigzag")
    for module in model.modules():
        if type(module).__name__ in MIXERS:
            module.register_forward_pre_hook(_shift_tokens, with_kwargs=True, prepend=True)
    _PARALLEL[(arch, "zigzag", "mutated", "auto")] = model  # compare_cases finds it here
    return compare_cases(rank, world_size, arch=arch, cases=[("zigzag", "mutated", "packed")])


def mutated_state_errors(rank: int, world_size: int, *, arch: str, what: str) -> list | None:
    """compare_cases with the state scheme given a wrong entering state (zero: each run starts
    as if it began its document) or a zero convolution halo: the tests must see each."""
    from ringattn.integrations.hf.mixers import runs, state

    saved = runs.halos, state.entering_states
    if what == "entering_state":

        def wrong(transition, final, ex, apply):
            return saved[1](transition, final, ex, apply) * 0

        state.entering_states = wrong
    else:

        def wrong_halo(x, valid, width, ex):
            return saved[0](x, valid, width, ex) * 0

        state.halos = wrong_halo
    try:
        model = copy.deepcopy(build(arch))
        _PARALLEL[(arch, "zigzag", "mutated", "state")] = ringattn.hf.parallelize(
            model, layout="zigzag", mixer_scheme="state"
        )
        cases = [("zigzag", "mutated", "packed")]
        return compare_cases(rank, world_size, arch=arch, cases=cases, scheme="state")
    finally:
        state.halos, state.entering_states = saved


class UserConv(torch.nn.Module):
    """A user's module that mixes tokens (a causal depthwise convolution): ringattn cannot know."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1]


def refuse(rank: int, world_size: int, *, what: str) -> None:
    """Raise what ringattn raises for `what` (run through run_expect_error)."""
    if what == "user_module":
        model = copy.deepcopy(build("llama_like"))
        model.model.layers[1].mlp = UserConv(32)
        ringattn.hf.parallelize(model)
    elif what == "conv_leaf":
        model = copy.deepcopy(build("llama_like"))
        model.model.layers[0].mlp.extra = torch.nn.Conv1d(4, 4, 3)
        ringattn.hf.parallelize(model)
    elif what == "dropout_deepseek_v4":  # its first compressed layer's dropout, in training
        model = copy.deepcopy(build("deepseek_v4"))
        model.model.layers[1].self_attn.attention_dropout = 0.1
        ringattn.hf.parallelize(model).train()
        model(**ringattn.hf.shard_batch(data("packed")))
    elif what.startswith("generate"):
        arch = {"generate_zamba2": "zamba2", "generate_zaya": "zaya",
                "generate_deepseek_v4": "deepseek_v4"}.get(what, "minimax")  # fmt: skip
        model = build(arch)
        ringattn.hf.generate(model, torch.tensor([[5, 6, 7, 8, 9]]), 4)
    else:
        raise AssertionError(what)


def generate_case(rank: int, world_size: int, *, arch: str, prompts: list, new: int) -> dict:
    """ringattn.hf.generate of a ragged batch (prefill packed, states carried into decoding),
    a follow-up turn through a Session, and the server's packed steps, against transformers'
    own greedy generate of each prompt on this process."""
    from ringattn.inference.hf.engine import KVEngine

    model = build(arch)
    model.generation_config.eos_token_id = None  # exactly `new` tokens on both sides
    model.generation_config.pad_token_id = 0
    prompts = [torch.tensor(p)[None] for p in prompts]
    with torch.no_grad():
        want = [model.generate(p, max_new_tokens=new, do_sample=False) for p in prompts]
        got = ringattn.hf.generate(model, prompts, new)
        session = ringattn.hf.Session(model)
        first = session.generate(prompts[0], new)
        second = session.generate(prompts[1], new)
        whole = torch.cat([prompts[0], first[:, -new:], prompts[1]], dim=1)
        want_turn = model.generate(whole, max_new_tokens=new, do_sample=False)
        # the server's steps: a prompt in two chunks beside a decoding sequence
        engine = KVEngine(model, layout="zigzag")
        a, b = prompts[0][0], prompts[1][0]
        with engine.holding():
            sa, sb = engine.open(), engine.open()
            _, (la,) = engine.step([], [(sa, a)])
            _, (lb,) = engine.step([], [(sb, b[:3])])
            decoded, (lb,) = engine.step([(sa, int(la.argmax()))], [(sb, b[3:])])
            steps = [int(la.argmax()), int(decoded[0].argmax()), int(lb.argmax())]
    return {
        "got": [g.tolist() for g in got],
        "want": [w.tolist() for w in want],
        "turn": second[0, -new:].tolist(),  # the session returns the turn and its answer
        "want_turn": want_turn[0, -new:].tolist(),
        "steps": steps,
        "want_steps": [
            want[0][0, a.numel()].item(),
            want[0][0, a.numel() + 1].item(),
            want[1][0, b.numel()].item(),
        ],
    }
