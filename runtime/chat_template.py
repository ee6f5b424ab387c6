"""A model's chat template (tokenizer.chat_template, Jinja) rendered as llama-server renders it
(common/chat.cpp of the pinned llama.cpp), so that `vq-gguf chat` and `vq-gguf serve` give a model the same
prompt: the variables messages, bos_token, eos_token, add_generation_prompt and enable_thinking, the functions
raise_exception and strftime_now, Hugging Face's whitespace rules (trim_blocks, lstrip_blocks), and a leading
BOS (trailing EOS) text dropped when the tokenizer adds that token itself.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """The template does not parse, or raised while rendering (its own raise_exception included)."""


def _raise(message: str):
    raise TemplateError(f"the chat template refused the conversation: {message}")


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def render(template: str, messages: Sequence[dict], *, bos_token: str, eos_token: str, add_bos: bool,
           add_eos: bool, add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages` ([{"role", "content"}]); tokenize it with the tokenizer's own specials."""
    try:
        text = _environment().from_string(template).render(
            messages=list(messages), bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt, enable_thinking=True)
    except jinja2.TemplateError as e:
        raise TemplateError(f"the model's chat template cannot be rendered: {e}") from e
    if add_bos and bos_token and text.startswith(bos_token):
        text = text[len(bos_token):]
    if add_eos and eos_token and text.endswith(eos_token):
        text = text[: -len(eos_token)]
    return text
