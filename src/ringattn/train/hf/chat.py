"""Chat SFT: one conversation -> its tokens under the model's chat template, and which of them are
the assistant's (the only ones supervised).

    messages    [system, user, assistant, user, assistant]
    text        apply_chat_template(messages)           the whole conversation, rendered once
    span i      apply_chat_template(messages[:i], add_generation_prompt=True)  -> where the
                assistant's turn i starts (after its header; for i = 0, the empty
                conversation's generation prompt: a default system prompt or date the
                template injects is header too, never supervised);
                apply_chat_template(messages[:i + 1])   -> where it ends (trailing whitespace
                dropped, the end-of-turn token kept)
    tokens      tokenizer(text, return_offsets_mapping=True): a token is supervised when it
                starts inside an assistant span

    <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n
    .............................................................######################.

This works with any template that renders a conversation's first turns as a prefix of the whole
(ChatML, Llama 3, Mistral, Gemma ...), with or without `{% generation %}` markers; a template
that rewrites earlier turns (one that drops past reasoning, say) is refused with a ValueError
naming the conversation. The labels are shifted later, on the packed sequence (shard_batch), so
the assistant's first token is predicted from the header and the end-of-turn token from the
last word.
"""

from __future__ import annotations

__all__ = ["check_chat_tokenizer", "render"]


def check_chat_tokenizer(tokenizer: object, where: str) -> None:
    """ValueError unless the tokenizer has a chat template and character offsets (a fast one)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"--data chat: the tokenizer in {where} has no chat_template; add one to its "
            f"tokenizer_config.json (or chat_template.jinja), or train on text:PATH"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"--data chat: the tokenizer in {where} is not a fast tokenizer "
            f"({type(tokenizer).__name__}); a tokenizer.json is needed for character offsets"
        )


def _check_messages(messages: object, number: int) -> list[dict]:
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
        for m in messages
    )  # fmt: skip
    if not ok:
        raise ValueError(
            f"conversation {number}: 'messages' must be a non-empty list of "
            f'{{"role": ..., "content": ...}}, got {str(messages)[:120]!r}'
        )
    return messages


def _spans(tokenizer: object, messages: list[dict], text: str, number: int) -> list[range]:
    """Character ranges of the assistant turns in `text` (end-of-turn included)."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = _header(tokenizer, messages, i, number)
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (text.startswith(upto) and upto.startswith(head)):
            raise ValueError(
                f"conversation {number}: the chat template does not render its first {i + 1} "
                f"messages as a prefix of the whole conversation, so the assistant's tokens "
                f"cannot be found; use a template that keeps earlier turns as they are"
            )
        spans.append(range(len(head), len(upto.rstrip())))
    return spans


def _header(tokenizer: object, messages: list[dict], i: int, number: int) -> str:
    """The text before assistant turn i's content: what the template renders for the turns
    before it with a generation prompt. For a conversation that opens with the assistant that is
    the empty conversation's generation prompt, which holds whatever the template puts first (a
    default system prompt, today's date) and the assistant's header; a template that cannot
    render an empty conversation is probed instead: the common prefix of the first turn
    rendered with two different contents ends where the content starts."""
    try:
        return tokenizer.apply_chat_template(messages[:i], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
    except Exception:  # jinja's errors vary (messages[0] of an empty list)
        if i:
            raise
    probes = [tokenizer.apply_chat_template([{**messages[0], "content": c}], tokenize=False)
              for c in ("A", "B")]  # fmt: skip
    common = 0
    while common < min(map(len, probes)) and probes[0][common] == probes[1][common]:
        common += 1
    if not probes[0][common:].startswith("A"):
        raise ValueError(
            f"conversation {number} opens with the assistant, and the chat template renders "
            f"neither an empty conversation nor that turn's content where it can be found; "
            f"start the conversation with a system or user message"
        )
    return probes[0][:common]


def render(tokenizer: object, messages: object, number: int = 0) -> tuple[list[int], list[bool]]:
    """(token ids, supervised) of one conversation: supervised marks the assistant's tokens."""
    messages = _check_messages(messages, number)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = _spans(tokenizer, messages, text, number)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    supervised = [any(start in span for span in spans) and end > start
                  for start, end in encoded["offset_mapping"]]  # fmt: skip
    return encoded["input_ids"], supervised
