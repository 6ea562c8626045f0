"""Prompts for one target model: chat templates rendered and tokenized so that only the
template's markup can become control tokens. Shares no buffer with decoding, so other threads may
build prompts while a generation runs."""

from __future__ import annotations

from collections.abc import Sequence

from .chat import render_chat, tokenize_chat


class Prompts:
    """Rendering and tokenization over one target model (a LlamaModel or anything with the same
    vocabulary methods)."""

    def __init__(self, target) -> None:
        self.target = target

    def special_text(self, token: int) -> str:
        return self.target.detokenize([token], special=True) if token >= 0 else ""

    def render(self, messages: list[dict[str, str]]) -> str:
        return render_chat(
            messages,
            self.target.chat_template,
            bos_token=self.special_text(self.target.bos_token),
            eos_token=self.special_text(self.target.eos_token),
        )

    def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        target = self.target
        return tokenize_chat(
            messages,
            target.chat_template,
            lambda text, special: target.tokenize(text, add_special=False, parse_special=special),
            bos_token=self.special_text(target.bos_token),
            eos_token=self.special_text(target.eos_token),
            bos_id=target.bos_token if target.add_bos and target.bos_token >= 0 else None,
        )

    def tokenize_prompt(self, prompt: str | Sequence[int], *, chat: bool = False) -> list[int]:
        """Raw prompt ids. With ``chat`` (text the caller rendered itself, or a `--raw` prompt)
        control-token text such as ``<|im_start|>`` becomes the control token; without it, it
        stays text. Token ids pass through."""
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        bos = self.special_text(self.target.bos_token) if self.target.add_bos else ""
        # A template that writes the BOS text itself must not get a second BOS from the tokenizer.
        add_special = not (chat and bos and prompt.startswith(bos))
        return self.target.tokenize(prompt, add_special=add_special, parse_special=chat)
