"""Expert parallelism with CP: `parallelize(..., expert_group=...)` splits each MoE layer's experts
over the group and sends every token to its experts' rank; loss and gradients equal one process's.

Tiny Mixtral, Qwen3-MoE and gpt-oss (4 experts, top-2, router loss coefficient 0.5: the router
term is part of the loss compared). Gates: loss relative 1e-5, gradients 1e-4 of each tensor's
largest entry, the expert tensors compared whole (each rank's slice put in place).
Layouts: ep = cp = 2 on 2 ranks; dp 2 x cp 2 with ep 2 (folded onto cp) and ep 4 (the whole world).
A router that sends every token to experts 0 and 1 (all on rank 0) stays exact and does not hang.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4


def _cases(arch: str) -> list[tuple[str, str, str]]:
    kinds = ["dense"] if arch == "gpt_oss" else ["dense", "packed"]  # gpt-oss masks ignore docs
    return [("zigzag", "ring", k) for k in kinds] + [("striped", "allgather", k) for k in kinds]


def _check(rows, cases, ep, what):
    assert [row[0] for row in rows] == cases
    failures = []
    for case, loss_error, grad_error, name, held in rows:
        assert held == pytest.approx(1 / ep), f"{case}: rank 0 holds {held} of the expert weights"
        if not loss_error <= LOSS_RTOL:
            failures.append(f"{case}: loss relative error {loss_error:.3g}")
        if not grad_error <= GRAD_RTOL:
            failures.append(f"{case}: gradient {name} error {grad_error:.3g} of its max entry")
    assert not failures, f"{what}:\n" + "\n".join(failures)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_ep2_cp2_matches_one_process(pools, arch):
    cases = _cases(arch)
    rows = pools(2).run(
        "workers_hf_experts:compare", arch=arch, cases=cases, dp=1, ep=2, timeout=600
    )[0]
    _check(rows, cases, 2, f"{arch}, ep = cp = 2")


@pytest.mark.parametrize("ep", [2, 4])
def test_dp2_cp2_matches_one_process(pools, ep):
    cases = [("zigzag", "ring", "packed"), ("striped", "allgather", "dense")]
    rows = pools(4).run(
        "workers_hf_experts:compare", arch="qwen3_moe", cases=cases, dp=2, ep=ep, timeout=600
    )[0]
    _check(rows, cases, ep, f"dp 2 x cp 2, ep {ep}")


def test_every_token_to_one_rank_is_exact(pools):
    cases = [("zigzag", "ring", "dense")]
    rows = pools(2).run(
        "workers_hf_experts:compare", arch="mixtral", cases=cases, dp=1, ep=2, skewed=True
    )[0]
    _check(rows, cases, 2, "every token routed to rank 0's experts")


def test_indivisible_expert_count_raises_on_every_rank(pools):
    pools(3).run_expect_error(
        "workers_hf_experts:indivisible", match="not divisible", exc_type=ValueError
    )


@pytest.mark.parametrize(("arch", "layout"), [("mixtral", "zigzag"), ("qwen3_moe", "striped")])
def test_generate_equals_model_generate(pools, arch, layout):
    """Greedy decoding over the sharded KV cache with ep 2: each step's tokens dispatched too."""
    for got, want in pools(2).run("workers_hf_experts:generate_equal", arch=arch, layout=layout):
        assert got == want


def _train_options(tmp_path) -> dict:
    import workers_hf_moe

    workers_hf_moe.save_config(tmp_path / "mixtral")
    (tmp_path / "docs").mkdir()
    for i in range(8):
        (tmp_path / "docs" / f"{i}.txt").write_text(f"document {i} " + "abcdefgh"[i:] * (2 + i))
    return {"hf": str(tmp_path / "mixtral"), "data": f"text:{tmp_path / 'docs'}", "seq_len": 29,
            "warmup": 1, "quiet": True, "batch_size": 1}  # fmt: skip


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.slow
def test_train_ep2_equals_one_process_and_exports_the_whole_model(pools, tmp_path, dp):
    """`train --hf --ep 2` on dp x cp 2 (SGD: weights exact by construction, workers_train.build)
    logs one process's losses and aux losses to 1e-5; `--export` of its final checkpoint (each
    rank wrote its expert slice; with dp 2 FSDP2 shards it again over the 2 ranks holding the
    same experts) is the whole model, equal to one process's trained weights. With dp 1 the
    ep run recomputes each layer in backward (its dispatch included)."""
    import torch

    from ringattn.train.config import TrainConfig
    from ringattn.train.hf.run import export

    options = {**_train_options(tmp_path), "steps": 2, "lr": 2.0, "optimizer": "sgd",
               "checkpoint_every": 0}  # fmt: skip
    want = pools(1).run(
        "workers_hf_experts:train",
        {**options, "batch_size": dp, "out_dir": str(tmp_path / "one")},
        timeout=600,
    )[0]
    got = pools(2 * dp).run(
        "workers_hf_experts:train",
        {
            **options,
            "dp": dp,
            "cp": 2,
            "ep": 2,
            "out_dir": str(tmp_path / "ep2"),
            "activation_checkpointing": dp == 1,
        },
        timeout=600,
    )[0]
    torch.testing.assert_close(
        torch.tensor(got["history"], dtype=torch.float64),
        torch.tensor(want["history"], dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )
    from transformers import AutoModelForCausalLM

    cfg = TrainConfig(hf=options["hf"], data=options["data"], export=str(tmp_path / "export"))
    exported = AutoModelForCausalLM.from_pretrained(export(cfg, got["checkpoint"], cfg.export))
    params = dict(exported.named_parameters())
    assert params["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4  # every expert
    for name, value in want["params"].items():
        torch.testing.assert_close(
            params[name.removeprefix("model.")].detach(), value, rtol=1e-5, atol=1e-6, msg=name
        )


@pytest.mark.slow
def test_checkpoints_reshard_between_ep2_and_ep1(pools, tmp_path):
    """Saved at ep 2 and resumed at ep 1, or the reverse, with AdamW (its moments are resharded
    too): steps 3 and 4 log the losses of a run that kept ep 1 throughout, to 1e-5."""
    import shutil

    import torch

    options = {**_train_options(tmp_path), "steps": 4, "lr": 0.05, "cp": 2,
               "checkpoint_every": 1}  # fmt: skip

    def run(out_dir: str, **more) -> list:
        result = pools(2).run(
            "workers_hf_experts:train",
            {**options, "out_dir": str(tmp_path / out_dir), **more},
            timeout=600,
        )
        return result[0]["history"]

    run("ep1", stop_at=2)
    shutil.copytree(tmp_path / "ep1", tmp_path / "ep1-to-ep2")
    want = run("ep1")  # steps 3 and 4, ep 1 throughout
    assert len(want) == 2
    run("ep2", stop_at=2, ep=2)
    for got in (run("ep1-to-ep2", ep=2), run("ep2")):  # ep 1 -> 2, ep 2 -> 1
        torch.testing.assert_close(
            torch.tensor(got, dtype=torch.float64),
            torch.tensor(want, dtype=torch.float64),
            rtol=1e-5,
            atol=0,
        )


def test_ep_degree_rules_name_the_values():
    """torchtitan's rule (ep a multiple of cp dividing dp x cp), --hf, and the expert count."""
    import transformers as tf

    from ringattn.integrations.hf.experts import check_ep
    from ringattn.runtime.mesh import check_expert_degree
    from ringattn.train.config import TrainConfig, validate

    for ep, dp, cp in [(1, 3, 2), (2, 2, 2), (4, 2, 2), (2, 1, 2)]:
        check_expert_degree(ep, dp, cp)
    with pytest.raises(ValueError, match=r"--ep 2 must be a multiple of cp=4 .* valid: \[4\]"):
        check_expert_degree(2, 1, 4)
    with pytest.raises(ValueError, match=r"divide dp x cp = 2 x 2 = 4 .* valid: \[2, 4\]"):
        check_expert_degree(8, 2, 2)
    with pytest.raises(ValueError, match="add --hf DIR"):
        validate(TrainConfig(ep=2, cp=2), 2)
    with pytest.raises(ValueError, match="--ep 2 with --compile"):
        validate(TrainConfig(ep=2, cp=2, compile=True, hf="x"), 2)
    check_ep(2, tf.MixtralConfig(num_local_experts=4))
    with pytest.raises(ValueError, match="--ep 3 does not divide the model's 4 experts"):
        check_ep(3, tf.MixtralConfig(num_local_experts=4))
    with pytest.raises(ValueError, match="no MoE experts"):
        check_ep(2, tf.LlamaConfig())


@pytest.mark.slow
def test_generate_cli_ep2_streams_model_generate(tmp_path, capfd):
    """`ringattn generate --hf DIR --nproc 2 --ep 2` on a tiny Mixtral: model.generate's ids."""
    import torch
    from transformers import AutoModelForCausalLM

    import workers_hf_moe
    from ringattn.cli.main import main

    model = AutoModelForCausalLM.from_config(workers_hf_moe._config("mixtral")).float().eval()
    model.config.eos_token_id = None
    model.save_pretrained(tmp_path / "mixtral")
    prompt = "a prompt of 21 bytes."
    ids = torch.tensor([[b % model.config.vocab_size for b in prompt.encode()]])
    want = model.generate(ids, do_sample=False, max_new_tokens=6, min_new_tokens=6)[0, 21:]
    argv = ["generate", "--hf", str(tmp_path / "mixtral"), "--prompt", prompt, "--nproc", "2",
            "--ep", "2", "--max-new-tokens", "6"]  # fmt: skip
    assert main(argv) == 0
    out, err = capfd.readouterr()
    got = [int(t) for t in out.strip().splitlines()[-1].split(":")[1].split()]
    assert got == want.tolist() and "experts over ep 2" in err, err
    with pytest.raises(SystemExit) as info:
        main([*argv[:-4], "--ep", "3"])
    assert info.value.code == 2 and "--ep 3 must divide --nproc 2" in capfd.readouterr().err


@pytest.mark.slow
def test_serve_ep2_answers_as_model_generate(tmp_path):
    """`ringattn serve --nproc 2 --ep 2` on a tiny Mixtral chat model: two concurrent greedy
    requests (one batch) answer what transformers' model.generate gives each alone."""
    import threading

    import torch
    import transformers

    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    import serve_model
    import workers_hf_moe

    tok = serve_model.tokenizer()
    config = workers_hf_moe._config("mixtral")
    config.update({"vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
                   "pad_token_id": tok.pad_token_id, "max_position_embeddings": 192})  # fmt: skip
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(tmp_path / "moe")
    tok.save_pretrained(tmp_path / "moe")
    server = serve_model.Server(tmp_path / "moe", 2, "--model-name", "moe", "--ep", "2")
    try:
        client = openai.OpenAI(base_url=server.url, api_key="-", max_retries=0, timeout=120)
        prompts, answers = ["hello world", "the lazy dog"], {}

        def ask(prompt: str) -> None:
            reply = client.chat.completions.create(
                model="moe", messages=[{"role": "user", "content": prompt}], max_tokens=8,
                temperature=0,
            )  # fmt: skip
            answers[prompt] = reply.choices[0].message.content

        threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    finally:
        server.stop()
    assert all(answers.get(p) for p in prompts), answers  # 8 tokens each, none empty
    for prompt in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                      add_generation_prompt=True, return_dict=False)  # fmt: skip
        out = model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=8,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        )  # fmt: skip
        assert answers[prompt] == tok.decode(out[0, len(ids) :], skip_special_tokens=True)


def test_split_experts_under_ddp_are_refused(pools):
    """torch DDP around a model whose experts are split (by hand: the Trainer refuses it in its
    constructor, test_hf_trainer.py) takes every rank's weights for copies: its first forward
    raises on every rank, before any step. DDP told to ignore the expert weights runs (rank 1
    keeps its experts: the caller then owns their gradients)."""
    pools(2).run_expect_error(
        "workers_hf_experts:under_ddp", ignore_experts=False, exc_type=ValueError,
        match=r"holds experts \[\d, \d\) of 4 \(parallelize\(expert_group=...\) over 2 ranks\) "
              r"but runs inside torch DDP.*ringattn train --hf DIR --ep E",
    )  # fmt: skip
    assert pools(2).run("workers_hf_experts:under_ddp", ignore_experts=True) == [True, True]
