"""Tiny llama-architecture GGUF models written with the `gguf` package: random weights, an SPM
vocabulary of a few hundred tokens with byte fallback, so backend and engine tests run real
llama.cpp in seconds with no download."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, TokenType

from cactus_edge.files import temporary_next_to

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS_TEXT = (
    "the of and to a in is it you that he was for on are with as I his they be at one have this "
    "from or had by hot word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would like so "
    "these her long make thing see him two has look more day could go come did number sound no "
    "most people my over know water than call first who may down side been now find def return "
    "print import class self if else for while in range list dict None True False = ( ) : , . "
    "hello world code python sort quick fast speculative draft target token cactus edge"
)
BASE_WORDS = tuple(_WORDS_TEXT.split())


def spm_vocab(words=BASE_WORDS) -> tuple[list[str], list[float], list[int]]:
    """Control tokens, 256 byte-fallback tokens, then characters and whole words with ▁."""
    tokens = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, TokenType.CONTROL, TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    pieces: list[str] = []
    for char in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789":
        pieces += [char, "▁" + char]
    pieces += ["▁"]
    for word in words:
        for piece in ("▁" + word, word):
            if piece not in pieces and len(piece) > 1:
                pieces.append(piece)
    tokens += pieces
    types += [TokenType.NORMAL] * len(pieces)
    # SPM merges by score: longer pieces first, so words come out whole.
    scores = [0.0] * (5 + 256) + [float(len(p)) for p in pieces]
    return tokens, scores, [int(t) for t in types]


def write_tiny_llama(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    base_seed: int | None = None,
    noise: float = 0.0,
    words=BASE_WORDS,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_ff: int = 128,
    n_ctx_train: int = 512,
    logit_scale: float = 0.5,
    chat_template: str | None = CHATML_TEMPLATE,
    embedding_rows: int | None = None,
    nan_output_row: int | None = None,
) -> Path:
    """Write a tiny llama GGUF; returns its path.

    With ``base_seed`` the weights are those of the ``base_seed`` model plus ``noise`` × fresh
    Gaussian noise (drawn from ``seed``): a target close to its draft, so drafts are often accepted.
    ``embedding_rows`` (≥ the vocabulary) draws the embedding and output matrices with that many
    rows and keeps the first ones, so models whose vocabularies differ only at the end share the
    weights of every shared token. ``nan_output_row`` poisons one output row: that token's logit
    is NaN at every position (a broken model file).
    """
    path = Path(path)
    tokens, scores, types = spm_vocab(words)
    n_vocab = len(tokens)
    base = np.random.default_rng(seed if base_seed is None else base_seed)
    fresh = np.random.default_rng(seed)

    def weight(*shape: int, std: float) -> np.ndarray:
        values = base.standard_normal(shape) * std
        if base_seed is not None and noise:
            values = values + fresh.standard_normal(shape) * std * noise
        return values.astype(np.float32)

    writer = GGUFWriter(str(path), "llama")
    writer.add_name(path.stem)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_vocab_size(n_vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(4)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if chat_template:
        writer.add_chat_template(chat_template)

    projection = 1.0 / np.sqrt(n_embd)
    rows = max(embedding_rows or n_vocab, n_vocab)
    writer.add_tensor("token_embd.weight", weight(rows, n_embd, std=1.0)[:n_vocab].copy())
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    output = weight(rows, n_embd, std=logit_scale)[:n_vocab].copy()
    if nan_output_row is not None:
        output[nan_output_row] = np.nan
    writer.add_tensor("output.weight", output)
    for layer in range(n_layer):
        prefix = f"blk.{layer}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{prefix}.{name}.weight", weight(n_embd, n_embd, std=projection))
        writer.add_tensor(f"{prefix}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"{prefix}.ffn_gate.weight", weight(n_ff, n_embd, std=projection))
        writer.add_tensor(f"{prefix}.ffn_up.weight", weight(n_ff, n_embd, std=projection))
        writer.add_tensor(f"{prefix}.ffn_down.weight", weight(n_embd, n_ff, std=1 / np.sqrt(n_ff)))

    with temporary_next_to(path) as temporary:
        writer.path = temporary
        writer.write_header_to_file(temporary)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(temporary, path)
    return path
