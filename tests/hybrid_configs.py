"""Tiny configs of every hybrid family for tests/workers_hf_hybrid.py: each with its mixer and
attention layers, widths small enough for many cases per test."""

from __future__ import annotations

VOCAB = 100


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
    if arch == "zamba":  # Mamba1 in 2 heads; a shared attention block on [hidden, embeddings]
        return tf.ZambaConfig(
            **common,
            num_hidden_layers=4,  # two hybrid layers: the block is shared (tied) between them
            layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
            n_mamba_heads=2,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=4,
            attention_head_dim=8,
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
    if arch == "kimi_linear":  # KDA + NoPE MLA attention + MoE
        return tf.KimiLinearConfig(
            **{k: v for k, v in common.items() if k != "num_key_value_heads"},
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse"],
            num_key_value_heads=4,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=8,
            linear_head_dim=8,
            linear_num_heads=4,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
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
