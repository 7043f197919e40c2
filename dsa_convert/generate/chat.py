"""`dsa run --chat`: the prompt as a chat turn, formatted with the GGUF's own chat template (tokenizer.chat_template),
rendered as llama-cpp-python renders it for a chat completion (Jinja2ChatFormatter: the template's bos / eos tokens,
the generation prompt added), so that a chat model answers the turn instead of continuing the text."""
from __future__ import annotations

from pathlib import Path

from ..errors import BadInputError

TEMPLATE_KEY = "tokenizer.chat_template"


def chat_messages(user: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def chat_prompt(llm, path: Path, messages: list[dict]) -> str:
    """The rendered prompt text (special tokens as text: tokenize it with special=True and no BOS of its own)."""
    template = (llm.metadata or {}).get(TEMPLATE_KEY)
    if not template:
        raise BadInputError(f"{Path(path).name} has no chat template ({TEMPLATE_KEY}); run it without --chat")
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    m = llm._model
    text = lambda tok: m.token_get_text(tok) if tok != -1 else ""  # noqa: E731
    fmt = Jinja2ChatFormatter(template=template, eos_token=text(m.token_eos()), bos_token=text(m.token_bos()),
                              add_generation_prompt=True)
    try:
        return fmt(messages=messages).prompt
    except Exception as e:      # a template that raises (e.g. it refuses a system turn) or does not render
        raise BadInputError(f"{Path(path).name}'s chat template failed on this prompt: {e}") from None
