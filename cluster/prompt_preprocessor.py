"""Front-end prompt preparation: size bounds, chat templates and tokenizing, off the event loop
and off the engine thread.

Both servers hand prompts to the engine as ``{"prompt_token_ids", "prompt"}``, so the engine
thread never tokenizes (a large prompt there stalls every request's generation) and the event
loop never does (there it stalls even ``/health``). The work runs on one dedicated thread that
owns its own tokenizer copy (Hugging Face tokenizers are not thread-safe), after a size bound
that refuses, without tokenizing, any input that cannot fit ``max_model_len``.
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from cluster.chat_template import ChatTemplateError, render_chat_template
from cluster.input_processor import (
    MAX_CHARS_PER_TOKEN,
    InvalidRequestError,
    check_prompt_size,
)


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file holding the template, or the template itself."""
    if value is None:
        return None
    path = Path(value)
    try:
        if len(value) < 4096 and path.is_file():
            return path.read_text()
    except OSError as exc:
        raise ValueError(f"--chat-template: cannot read {value}: {exc.strerror}") from None
    if "{" not in value:
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a jinja template")
    return value


class PromptPreprocessor:
    def __init__(
        self,
        tokenizer,
        max_model_len: int,
        *,
        chat_template: str | None = None,
        trust_request_chat_template: bool = False,
    ):
        self.tokenizer = copy.deepcopy(tokenizer)  # this thread's own instance
        self.max_model_len = max_model_len
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self.trust_request_chat_template = trust_request_chat_template
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ------------------------------------------------------------- prompts
    async def prompt(self, prompt: Any, field: str = "prompt", truncating: bool = False) -> dict[str, Any]:
        """A completion prompt (text, token ids or ``{"prompt_token_ids"}``) as the engine's input.
        ``truncating``: the engine keeps only its tail (``truncate_prompt_tokens``), so a token
        list longer than ``max_model_len`` is not refused."""
        if isinstance(prompt, str):
            check_prompt_size(prompt, self.max_model_len, field)
            return await self._run(self._encode, prompt, field)
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
        if isinstance(ids, list) and not truncating:
            check_prompt_size(ids, self.max_model_len, field)
        return prompt

    def _encode(self, text: str, field: str) -> dict[str, Any]:
        ids = self.tokenizer.encode(text, add_special_tokens=True)
        if not ids:
            raise InvalidRequestError(f"{field} {text[:80]!r} tokenizes to no tokens", field)
        return {"prompt_token_ids": list(ids), "prompt": text}

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        kwargs: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """Render the conversation with the chat template and tokenize it."""
        kwargs = dict(kwargs or {})
        template = self.chat_template
        if "chat_template" in kwargs:
            if not self.trust_request_chat_template:
                raise InvalidRequestError(
                    "chat_template_kwargs.chat_template: this server does not accept chat templates in "
                    "requests (the operator can allow them with --trust-request-chat-template)",
                    "chat_template_kwargs",
                )
            template = kwargs.pop("chat_template")
            if not isinstance(template, str) or not template:
                raise InvalidRequestError(
                    "chat_template_kwargs.chat_template must be a non-empty string", "chat_template_kwargs"
                )
        if template is None:
            raise InvalidRequestError("the model's tokenizer has no chat template; use /v1/completions", "messages")
        size = sum(len(m.get("content") or "") for m in messages)
        if size > self.max_model_len * MAX_CHARS_PER_TOKEN:
            raise InvalidRequestError(
                f"messages hold {size} characters, more than max_model_len ({self.max_model_len} tokens) "
                f"can hold (at most {self.max_model_len * MAX_CHARS_PER_TOKEN} characters)",
                "messages",
            )
        return await self._run(self._render, template, messages, add_generation_prompt, continue_final_message, kwargs)

    def _render(self, template, messages, add_generation_prompt, continue_final_message, kwargs):
        try:
            text = render_chat_template(
                template,
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                special_tokens=self.tokenizer.special_tokens_map,
                kwargs=kwargs,
                max_chars=self.max_model_len * MAX_CHARS_PER_TOKEN,
            )
        except ChatTemplateError as exc:
            raise InvalidRequestError(str(exc), "messages") from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise InvalidRequestError("the chat template rendered an empty prompt", "messages")
        return {"prompt_token_ids": list(ids), "prompt": text}

    # ------------------------------------------------------- /tokenize etc.
    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        check_prompt_size(text, self.max_model_len)
        return await self._run(lambda: list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens)))

    async def detokenize(self, ids: list[int]) -> str:
        return await self._run(lambda: self.tokenizer.decode(ids))
