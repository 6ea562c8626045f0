"""A conversation stays a prefix of itself: turn N's prompt, the assistant's reply and the
template's end-of-turn marker start turn N+1's prompt, so the prompt cache (which restores the
longest common token prefix) prefills only the new turn.

Checked through the engine's own path (:class:`Prompts`: ``render`` for the text,
``tokenize_chat`` for the ids) on every registered family's chat template, over a fake
vocabulary per family that is boundary-sensitive as BPE is (control tokens are single ids, a run of
newlines is one id), and on SmolLM2's real llama.cpp tokenizer for the ChatML templates. Where a
template does not keep the property, an xfail names why and a passing test pins how much of the
conversation the cache still holds (the tail from the first differing token is prefilled again).
"""

# Template sources: each tests/data/ file is the chat_template of a model's tokenizer_config.json as
# published; llama.cpp's models/templates/ folder holds the same text under the name in brackets.
# qwen2.5_chat_template.jinja: Qwen/Qwen2.5-7B-Instruct [Qwen-Qwen2.5-7B-Instruct.jinja]
# qwen3_chat_template.jinja: Qwen/Qwen3-0.6B [Qwen-Qwen3-0.6B.jinja]
# llama3.1_chat_template.jinja: meta-llama/Llama-3.1-8B-Instruct [meta-llama-Llama-3.1-8B-Instruct.jinja]
# llama3.2_chat_template.jinja: meta-llama/Llama-3.2-1B/3B-Instruct [meta-llama-Llama-3.2-3B-Instruct.jinja]
# gemma3_chat_template.jinja: google/gemma-3-4b-it, shared by Gemma 3's instruction-tuned models
# smollm2_chat_template.jinja: HuggingFaceTB/SmolLM2-135M-Instruct, as the registered GGUF stores it

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from cactus_edge.catalog.registry import load_registry
from cactus_edge.constraints import templates
from cactus_edge.constraints.templates import Prompts

from .test_templates import _fake_text_ids, fake_text_of

DATA = Path(__file__).parent / "data"


def template_file(name: str) -> str:
    return (DATA / f"{name}_chat_template.jinja").read_text("utf-8")


# Qwen3's template reads ``enable_thinking``, which the engine leaves undefined (thinking on). Setting
# it at the template's top level shows the template's other mode through the engine's own rendering.
QWEN3 = template_file("qwen3")
QWEN3_NO_THINKING = "{%- set enable_thinking = false %}" + QWEN3
EMPTY_THINK_BLOCK = "<think>\n\n</think>\n\n"

SYSTEM = "You answer in one sentence."
QUESTIONS = ("What is the capital of France?", "And the capital of Italy?", "Which of the two is larger?")
ANSWERS = ("The capital of France is Paris.", "The capital of Italy is Rome.")
THOUGHTS = ("The user asks for the capital of France.", "Now Italy.")
# Qwen3 thinking: what the model writes after the generation prompt, and a client sends back.
THINKING_REPLIES = tuple(
    f"<think>\n{thought}\n</think>\n\n{answer}" for thought, answer in zip(THOUGHTS, ANSWERS, strict=True)
)

CHATML_CONTROLS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
LLAMA3_CONTROLS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
GEMMA3_CONTROLS = ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>")


@dataclass(frozen=True)
class Family:
    """A chat template and what its vocabulary needs: control-token texts (single ids, cut out of
    text only with special parsing), user-defined ones (single ids always, as llama.cpp parses
    them: Qwen3's ``<think>``), the BOS text the template writes, the end-of-turn marker the model
    ends a reply with, and the replies the model writes."""

    name: str
    template: str
    controls: tuple[str, ...]
    end_of_turn: str
    bos: str | None = None
    user_defined: tuple[str, ...] = ()
    replies: tuple[str, ...] = ANSWERS


QWEN25 = Family("qwen2.5", template_file("qwen2.5"), CHATML_CONTROLS, "<|im_end|>")
QWEN3_THINKING = Family(
    "qwen3",
    QWEN3,
    CHATML_CONTROLS,
    "<|im_end|>",
    user_defined=("<think>", "</think>"),
    replies=THINKING_REPLIES,
)
QWEN3_NOT_THINKING = Family(
    "qwen3-no-thinking",
    QWEN3_NO_THINKING,
    CHATML_CONTROLS,
    "<|im_end|>",
    user_defined=("<think>", "</think>"),
)
LLAMA31 = Family(
    "llama3.1", template_file("llama3.1"), LLAMA3_CONTROLS, "<|eot_id|>", bos="<|begin_of_text|>"
)
LLAMA32 = Family(
    "llama3.2", template_file("llama3.2"), LLAMA3_CONTROLS, "<|eot_id|>", bos="<|begin_of_text|>"
)
GEMMA3 = Family("gemma3", template_file("gemma3"), GEMMA3_CONTROLS, "<end_of_turn>", bos="<bos>")
SMOLLM2 = Family("smollm2", template_file("smollm2"), CHATML_CONTROLS, "<|im_end|>")

KEEPING = [QWEN25, LLAMA31, LLAMA32, GEMMA3, SMOLLM2]
QWEN3_DROPS_THINKING = (
    "Qwen3's template drops past assistant turns' <think> blocks, so the reply the cache holds "
    "(think block and answer) is not what the next prompt renders (the answer alone)"
)
QWEN3_DROPS_EMPTY_BLOCK = (
    "with enable_thinking=false Qwen3's generation prompt ends with an empty think block that "
    "the next prompt's history does not repeat"
)
ALL_FAMILIES = [
    *KEEPING,
    pytest.param(QWEN3_THINKING, marks=pytest.mark.xfail(strict=True, reason=QWEN3_DROPS_THINKING)),
    pytest.param(QWEN3_NOT_THINKING, marks=pytest.mark.xfail(strict=True, reason=QWEN3_DROPS_EMPTY_BLOCK)),
]
# Registered model names by the family whose template they ship.
REGISTERED_FAMILIES = {
    "qwen2.5": QWEN25,
    "qwen3": QWEN3_THINKING,
    "llama-3.1": LLAMA31,
    "llama-3.2": LLAMA32,
    "gemma-3": GEMMA3,
    "smollm2": SMOLLM2,
}


def family_id(family) -> str:
    return family.name if isinstance(family, Family) else str(family)


# --- a fake vocabulary per family: special tokens of its own, text ids as test_templates.py's ----


class FakeVocabulary:
    """The vocabulary methods :class:`Prompts` uses, for one family's special tokens."""

    def __init__(self, family: Family) -> None:
        self.chat_template = family.template
        texts = [*family.controls, *family.user_defined]
        self.ids = {text: token for token, text in enumerate(texts, start=1)}
        self.controls, self.user_defined = set(family.controls), set(family.user_defined)
        self.add_bos = family.bos is not None
        self.bos_token = self.ids[family.bos] if family.bos else -1
        self.eos_token = self.ids[family.end_of_turn]

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        specials = self.user_defined | (self.controls if parse_special else set())
        ids = [self.bos_token] if add_special and self.add_bos else []
        pattern = (
            "(" + "|".join(re.escape(special) for special in sorted(specials, key=len, reverse=True)) + ")"
        )
        for fragment in re.split(pattern, text) if specials else [text]:
            if fragment in specials:
                ids.append(self.ids[fragment])
            else:
                ids += _fake_text_ids(fragment)
        return ids

    def detokenize(self, ids: list[int], special: bool = True) -> str:
        texts = {token: text for text, token in self.ids.items()}
        return "".join(texts[token] if token in texts else fake_text_of(token) for token in ids)


# --- conversations -------------------------------------------------------------------------------


def conversation(family: Family, system: bool, replies: tuple[str, ...] | None = None) -> list[dict]:
    """System prompt (if any), then question, reply, question, reply, question."""
    messages = [{"role": "system", "content": SYSTEM}] if system else []
    for index, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        if index < len(QUESTIONS) - 1:
            messages.append({"role": "assistant", "content": (replies or family.replies)[index]})
    return messages


def turns(messages: list[dict]) -> list[tuple[list[dict], str, list[dict]]]:
    """(turn N's messages, the reply to them, turn N+1's messages) for each reply."""
    ends = [index + 1 for index, message in enumerate(messages) if message["role"] == "user"]
    return [
        (messages[:end], messages[end]["content"], messages[: ends[n + 1]]) for n, end in enumerate(ends[:-1])
    ]


def shared(first, second) -> int:
    """The length of the common prefix of two strings or id lists."""
    return len(os.path.commonprefix([first, second]))


class _FrozenDatetime(datetime):
    today_is = datetime(2025, 3, 14, 12, 0)

    @classmethod
    def now(cls, tz=None):
        return cls.today_is


@pytest.fixture(autouse=True)
def frozen_today(monkeypatch):
    """Llama 3.2 writes today's date (``strftime_now``): a test run must not cross midnight."""
    monkeypatch.setattr(templates, "datetime", _FrozenDatetime)
    monkeypatch.setattr(_FrozenDatetime, "today_is", datetime(2025, 3, 14, 12, 0))
    return _FrozenDatetime


def prompts_for(family: Family) -> tuple[Prompts, FakeVocabulary]:
    vocabulary = FakeVocabulary(family)
    return Prompts(vocabulary), vocabulary


# --- every family ----------------------------------------------------------------------------------


def test_every_registered_model_belongs_to_a_checked_family(tmp_path):
    """A newly registered family needs its template here (models_dir: no local registry)."""
    names = load_registry(models_dir=tmp_path).models
    unchecked = [name for name in names if not any(name.startswith(prefix) for prefix in REGISTERED_FAMILIES)]
    assert unchecked == []


@pytest.mark.parametrize("system", [True, False], ids=["system", "no-system"])
@pytest.mark.parametrize("family", ALL_FAMILIES, ids=family_id)
def test_a_turn_and_its_reply_start_the_next_turn_as_text(family, system):
    prompts, _ = prompts_for(family)
    for before, reply, after in turns(conversation(family, system)):
        sent = prompts.render(before) + reply + family.end_of_turn
        assert prompts.render(after).startswith(sent)


@pytest.mark.parametrize("system", [True, False], ids=["system", "no-system"])
@pytest.mark.parametrize("family", ALL_FAMILIES, ids=family_id)
def test_a_turn_and_its_reply_start_the_next_turn_as_ids(family, system):
    prompts, vocabulary = prompts_for(family)
    for before, reply, after in turns(conversation(family, system)):
        cached = (
            prompts.tokenize_chat(before)
            + vocabulary.tokenize(reply, parse_special=False)
            + vocabulary.tokenize(family.end_of_turn, parse_special=True)
        )
        assert prompts.tokenize_chat(after)[: len(cached)] == cached


def test_the_ids_would_notice_a_cut_inside_a_newline_run():
    """Guards the test above: the fake vocabulary is boundary-sensitive, as BPE is."""
    vocabulary = FakeVocabulary(QWEN25)
    assert vocabulary.tokenize("a\n") + vocabulary.tokenize("\nb") != vocabulary.tokenize("a\n\nb")


# --- Qwen3: what the cache still holds -----------------------------------------------------------


@pytest.mark.parametrize("system", [True, False], ids=["system", "no-system"])
def test_qwen3_thinking_keeps_the_prompt_and_prefills_the_answer_again(system):
    """Turn N's prompt stays a prefix of turn N+1's: the first differing token is the reply's
    first; from there the next turn prefills the answer (without its think block) again."""
    prompts, vocabulary = prompts_for(QWEN3_THINKING)
    for (before, reply, after), answer in zip(
        turns(conversation(QWEN3_THINKING, system)), ANSWERS, strict=True
    ):
        text_before, text_after = prompts.render(before), prompts.render(after)
        assert shared(text_before + reply, text_after) == len(text_before)
        assert text_after[len(text_before) :].startswith(answer + "<|im_end|>\n<|im_start|>user\n")
        ids_before, ids_after = prompts.tokenize_chat(before), prompts.tokenize_chat(after)
        cached = ids_before + vocabulary.tokenize(reply)
        assert shared(cached, ids_after) == len(ids_before)
        assert ids_after[len(ids_before) :][: len(vocabulary.tokenize(answer))] == vocabulary.tokenize(answer)


@pytest.mark.parametrize("system", [True, False], ids=["system", "no-system"])
def test_qwen3_not_thinking_loses_the_empty_think_block_and_the_answer(system):
    """The generation prompt ends with ``<think>\\n\\n</think>\\n\\n`` (4 tokens in Qwen3's
    vocabulary, as in the fake one); the next turn's history has the answer right after
    ``<|im_start|>assistant\\n``: the cache keeps turn N's prompt up to the empty block."""
    prompts, vocabulary = prompts_for(QWEN3_NOT_THINKING)
    for (before, reply, after), answer in zip(
        turns(conversation(QWEN3_NOT_THINKING, system)), ANSWERS, strict=True
    ):
        text_before, text_after = prompts.render(before), prompts.render(after)
        assert text_before.endswith("<|im_start|>assistant\n" + EMPTY_THINK_BLOCK)
        assert shared(text_before + reply, text_after) == len(text_before) - len(EMPTY_THINK_BLOCK)
        ids_before = prompts.tokenize_chat(before)
        assert len(vocabulary.tokenize(EMPTY_THINK_BLOCK)) == 4
        assert (
            shared(ids_before + vocabulary.tokenize(reply), prompts.tokenize_chat(after))
            == len(ids_before) - 4
        )
        assert text_after[len(text_before) - len(EMPTY_THINK_BLOCK) :].startswith(answer + "<|im_end|>")


def test_qwen3_renders_past_replies_the_same_with_or_without_their_think_blocks():
    """Stripping think blocks from replies before sending them back changes nothing: the template
    drops them anyway, and the cache still holds each reply as generated."""
    prompts, _ = prompts_for(QWEN3_THINKING)
    with_block = conversation(QWEN3_THINKING, True)
    without_block = conversation(QWEN3_THINKING, True, replies=ANSWERS)
    assert prompts.render(with_block) == prompts.render(without_block)


# --- Llama 3.2: today's date ---------------------------------------------------------------------


def test_llama32_writes_todays_date_and_llama31_a_fixed_one(frozen_today):
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    assert "Today Date: 14 Mar 2025\n" in prompts_for(LLAMA32)[0].render(messages)
    assert "Today Date: 26 Jul 2024\n" in prompts_for(LLAMA31)[0].render(messages)


def _render_across_midnight(frozen_today, monkeypatch) -> list[tuple[str, str, str]]:
    prompts, _ = prompts_for(LLAMA32)
    rendered = []
    for before, reply, after in turns(conversation(LLAMA32, True)):
        monkeypatch.setattr(frozen_today, "today_is", datetime(2025, 3, 14, 23, 59))
        text_before = prompts.render(before)
        monkeypatch.setattr(frozen_today, "today_is", datetime(2025, 3, 15, 0, 1))
        rendered.append((text_before, reply, prompts.render(after)))
    return rendered


@pytest.mark.xfail(
    strict=True, reason="Llama 3.2's system header holds today's date, which changes at midnight"
)
def test_llama32_a_conversation_crossing_midnight_stays_a_prefix(frozen_today, monkeypatch):
    for text_before, reply, text_after in _render_across_midnight(frozen_today, monkeypatch):
        assert text_after.startswith(text_before + reply + LLAMA32.end_of_turn)


def test_llama32_after_midnight_the_cache_keeps_only_the_header_before_the_date(frozen_today, monkeypatch):
    header = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    header += "Cutting Knowledge Date: December 2023\nToday Date: 1"
    for text_before, reply, text_after in _render_across_midnight(frozen_today, monkeypatch):
        assert shared(text_before + reply, text_after) == len(header)


# --- trimming templates ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", [LLAMA31, LLAMA32, GEMMA3], ids=family_id)
def test_trimming_templates_cut_the_prefix_at_a_replys_trailing_whitespace(family):
    """Llama 3.x and Gemma 3 ``trim`` every content: a reply that ends in whitespace before its
    end-of-turn token comes back without it, and the cache keeps the reply up to the whitespace."""
    prompts, _ = prompts_for(family)
    replies = tuple(answer + "\n" for answer in ANSWERS)
    for before, reply, after in turns(conversation(family, True, replies=replies)):
        assert (
            shared(prompts.render(before) + reply, prompts.render(after))
            == len(prompts.render(before) + reply) - 1
        )


@pytest.mark.parametrize("family", [QWEN25, SMOLLM2], ids=family_id)
def test_chatml_templates_keep_a_replys_whitespace(family):
    prompts, _ = prompts_for(family)
    replies = tuple(answer + "\n" for answer in ANSWERS)
    for before, reply, after in turns(conversation(family, True, replies=replies)):
        assert prompts.render(after).startswith(prompts.render(before) + reply + family.end_of_turn)


# --- SmolLM2: llama.cpp's tokenizer on a real BPE vocabulary -----------------------------------------


class Retemplated:
    """A loaded model with another chat template: Prompts reads only these attributes."""

    def __init__(self, model, template: str) -> None:
        self.model, self.chat_template = model, template
        self.bos_token, self.eos_token, self.add_bos = model.bos_token, model.eos_token, model.add_bos

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        return self.model.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: list[int], special: bool = True) -> str:
        return self.model.detokenize(ids, special=special)


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    from cactus_edge.llama.model import LlamaModel

    with LlamaModel(smollm2_path, n_ctx=512) as model:
        yield model


@pytest.mark.slow
def test_the_smollm2_template_file_is_the_registered_ggufs(smollm2):
    assert smollm2.chat_template == SMOLLM2.template


@pytest.mark.slow
@pytest.mark.parametrize("system", [True, False], ids=["system", "no-system"])
@pytest.mark.parametrize("family", [SMOLLM2, QWEN25], ids=family_id)
def test_smollm2_a_turn_and_its_reply_start_the_next_turn_as_ids(smollm2, family, system):
    """ChatML templates over SmolLM2's BPE vocabulary (which has ``<|im_start|>`` and
    ``<|im_end|>``): the ids llama.cpp gives each stretch agree at every cut."""
    prompts = Prompts(Retemplated(smollm2, family.template))
    end_of_turn = smollm2.tokenize(family.end_of_turn, add_special=False, parse_special=True)
    assert len(end_of_turn) == 1
    for before, reply, after in turns(conversation(family, system)):
        cached = prompts.tokenize_chat(before) + smollm2.tokenize(reply, add_special=False) + end_of_turn
        assert prompts.tokenize_chat(after)[: len(cached)] == cached


@pytest.mark.slow
def test_smollm2_vocabulary_qwen3_thinking_keeps_the_prompt_before_the_reply(smollm2):
    prompts = Prompts(Retemplated(smollm2, QWEN3))
    for before, reply, after in turns(conversation(QWEN3_THINKING, True)):
        ids_before = prompts.tokenize_chat(before)
        cached = ids_before + smollm2.tokenize(reply, add_special=False)
        assert shared(cached, prompts.tokenize_chat(after)) == len(ids_before)
