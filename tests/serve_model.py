"""A tiny chat model for the server tests, built offline in a test's tmp_path.

A byte-level BPE tokenizer trained with the `tokenizers` library on a few sentences, with ChatML
special tokens and a ChatML-style Jinja chat template, and a random 2-layer Llama whose
end-of-sequence token is `<|im_end|>`; both saved with save_pretrained (no downloads).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time

import torch

from ringattn.comm import resolve_group
from ringattn.serve.api.app import build_app, serve_in_thread
from ringattn.serve.config import ServeConfig, bind
from ringattn.serve.metrics import Metrics
from ringattn.serve.worker import limits, rank_loop

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a long context needs its attention shared across ranks",
    "hello world, how are you today? fine, thank you.",
    "ring attention passes keys and values around a ring of processes",
] * 4
CONTEXT = 192  # max_position_embeddings: prompt + completion tokens


def tokenizer():
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    return fast


def save_chat_model(directory, family: str = "llama") -> tuple[torch.nn.Module, object]:
    """The model (eval, float32) and tokenizer saved in `directory`; `family` "nemotron_h": a
    hybrid (Mamba2, attention and MLP blocks) instead of Llama."""
    import transformers

    tok = tokenizer()
    common = {"vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": CONTEXT, "eos_token_id": tok.eos_token_id,
              "bos_token_id": None, "pad_token_id": tok.pad_token_id}  # fmt: skip
    if family == "nemotron_h":
        config = transformers.NemotronHConfig(
            **common, head_dim=8, hybrid_override_pattern="M*-M", mamba_num_heads=4,
            mamba_head_dim=8, ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=8,
            mamba_expand=1, initializer_range=0.1,
        )  # fmt: skip
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, **common)
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return model.eval(), tok


class Server:
    """`ringattn serve` as a child process (its own session) on 127.0.0.1, any free port."""

    def __init__(self, directory, nproc: int, *extra: str, timeout_s: float = 300.0):
        argv = [sys.executable, "-m", "ringattn", "serve", "--hf", str(directory), "--nproc",
                str(nproc), "--port", "0", *extra]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     text=True, env=env, start_new_session=True)  # fmt: skip
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            found = [re.search(r"listening on (http://127\.0\.0\.1:\d+/v1)", x) for x in self.lines]
            found = [m for m in found if m]
            if found:
                self.url = found[0][1]
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("the server did not start:\n" + self.log())

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def log(self) -> str:
        return "".join(self.lines)

    def ranks(self) -> dict[int, dict]:
        """{rank: heartbeat record (pid, phase, served ...)} from the launch's run directory."""
        for pid in _descendants(self.proc.pid):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            except OSError:
                continue
            if b"RINGATTN_RUN_DIR" in env:
                run_dir = env[b"RINGATTN_RUN_DIR"].decode()
                break
        else:
            return {}
        records = {}
        for name in os.listdir(run_dir):
            if re.fullmatch(r"rank-\d+\.json", name):
                with open(os.path.join(run_dir, name)) as f:
                    record = json.load(f)
                records[record["rank"]] = record
        return records

    def wait(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout_s)
        self.reader.join(5)
        return code

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def _descendants(pid: int) -> list[int]:
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class CountingQueue(queue.Queue):
    """A job queue that counts what the HTTP layer admits (`puts`)."""

    def __init__(self):
        super().__init__()
        self.puts = 0

    def put(self, item, block=True, timeout=None):
        self.puts += 1
        super().put(item, block, timeout)


class InProcess:
    """The HTTP layer and one rank's loop in this process (threads): `url`, `jobs`, `close()`.

    The same build_app / rank_loop as `ringattn serve --nproc 1`, without a process start;
    `cfg`: the engine's ServeConfig (pool, chunks); `app`: build_app's keywords (max_queue),
    and max_body_bytes for its limits."""

    def __init__(self, directory, api_key: str | None = None, name: str = "tiny",
                 cfg: ServeConfig | None = None, **app):  # fmt: skip
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        self.model = model.eval()
        tok = transformers.AutoTokenizer.from_pretrained(directory)
        self.jobs = CountingQueue()
        sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        self.metrics = Metrics(self.jobs.qsize)
        longest = None if cfg is None else cfg.max_model_len
        self.limits = limits(self.model, tok, app.pop("max_body_bytes", None), longest)
        built = build_app(name, tok, self.limits, self.jobs, api_key, metrics=self.metrics, **app)
        self.server, http = serve_in_thread(built, sock)
        args = (self.model, tok, resolve_group(None), "zigzag", self.jobs, http)
        kwargs = {"metrics": self.metrics, "cfg": cfg}
        self.loop = threading.Thread(target=rank_loop, args=args, kwargs=kwargs, daemon=True)
        self.loop.start()

    def close(self) -> None:
        self.server.should_exit = True
        self.loop.join(30)
        assert not self.loop.is_alive(), "the rank loop did not stop after the HTTP thread"


@contextlib.contextmanager
def served_tiny(tmp_path_factory):
    """The tiny chat model saved to a fresh directory and served in process: yields (server,
    an `openai` client of it, the model, its tokenizer, the directory); closed after."""
    import openai

    directory = tmp_path_factory.mktemp("chat") / "tiny"
    model, tok = save_chat_model(directory)
    server = InProcess(directory)
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    try:
        yield server, client, model, tok, directory
    finally:
        server.close()


class PlannedJob:
    """A request as the scheduler sees it, for plan tests without a server (2 new tokens)."""

    cancelled, arrived = False, 0.0

    def __init__(self, ids: list[int], new: int = 2):
        from ringattn.serve.protocol import Request

        self.request = Request(ids, new)


def run_plans(scheduler, vocab: int, most: int | None = None) -> list[dict]:
    """Plan and "run" steps (logits of zeros: token 0) until every request has ended (or
    `most` steps); the plans."""
    plans = []
    while scheduler.running or scheduler.waiting or not scheduler.jobs.empty():
        if most is not None and len(plans) == most:
            break
        plan = scheduler.plan()
        if plan["op"] == "step":
            plans.append(plan)
            n = len(plan["decode"])
            decoded = torch.zeros(n, vocab, device="cpu") if n else None
            scheduler.after(decoded, [torch.zeros(vocab, device="cpu") for _ in plan["chunks"]])
    return plans


TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools><|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] or '' }}{% for c in m.get('tool_calls') or [] %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)  # the Hermes / Qwen convention: tools in the system turn, calls in <tool_call> blocks
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}}  # fmt: skip


def save_tool_model(directory) -> tuple[torch.nn.Module, object]:
    """A tiny Llama that answers every chat with one Hermes tool call, saved in `directory`.

    Every layer's output projections are zero, so the logits of a row depend on its own token
    only (embedding -> final norm -> head): a bigram model. The head maps the chat template's
    last token to `<tool_call>`, that to CALL (one added token), then `</tool_call>`, then
    `<|im_end|>`: greedy decoding writes exactly `<tool_call>CALL</tool_call>` and stops."""
    import transformers

    tok = tokenizer()
    tok.add_tokens(["<tool_call>", CALL, "</tool_call>"])  # not special: they stay in the text
    tok.chat_template = TOOLS_TEMPLATE
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=1024,
        eos_token_id=tok.eos_token_id, bos_token_id=None, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    last = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                   add_generation_prompt=True, return_dict=False)[-1]  # fmt: skip
    chain = [last, *tok.convert_tokens_to_ids(["<tool_call>", CALL, "</tool_call>"]),
             tok.eos_token_id]  # fmt: skip
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        normed = model.model.norm(model.model.embed_tokens.weight)  # (vocab, hidden)
        head = torch.zeros_like(model.lm_head.weight)
        for a, b in itertools.pairwise(chain):
            head[b] += 20 * normed[a] / normed[a].square().sum()
        model.lm_head.weight.copy_(head)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return model, tok
