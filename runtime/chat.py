"""`vq-gguf chat`: one-shot (--prompt) or interactive chat with any GGUF the patched llama.cpp loads."""
from __future__ import annotations

import sys

from .llama import Chat, Model, SamplerConfig


def run(model_path: str, *, prompt: str | None, system: str | None, sampler: SamplerConfig, max_tokens: int,
        n_ctx: int | None, threads: int | None, verbose: bool, rpc: list[str] | None = None) -> str:
    """Returns the last answer (for scripts); streams every answer to stdout."""
    with Model(model_path, n_ctx=n_ctx, n_threads=threads, verbose=verbose, rpc=rpc) as model:
        chat = Chat(model, system=system, sampler=sampler)
        if prompt is not None:
            return _answer(chat, prompt, max_tokens)
        print("chat with the model; an empty line or Ctrl-D quits", file=sys.stderr)
        answer = ""
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            answer = _answer(chat, line, max_tokens)
        return answer


def _answer(chat: Chat, text: str, max_tokens: int) -> str:
    pieces = []
    for piece in chat.send(text, max_tokens=max_tokens):
        pieces.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return "".join(pieces)
