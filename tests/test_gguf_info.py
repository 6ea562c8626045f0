import shutil

import pytest

from cactus_edge.errors import IncompatiblePairError, InvalidModelFileError, ModelNotFoundError
from cactus_edge.llama.gguf import check_pair_compatible, read_gguf

from .tiny_gguf import spm_vocab, write_tiny_llama


def test_reads_tiny_model_metadata(tiny_pair):
    info = read_gguf(tiny_pair[0], tokens=True)
    assert info.architecture == "llama"
    assert info.vocab_size == len(spm_vocab()[0]) == len(info.tokens)
    assert info.context_length == 512
    assert info.quantization == "ALL_F32" or info.quantization == "F32"
    assert info.chat_template and "im_start" in info.chat_template
    assert info.n_params > 100_000


def test_same_vocabulary_is_compatible(tiny_pair):
    check_pair_compatible(read_gguf(tiny_pair[0], tokens=True), read_gguf(tiny_pair[1], tokens=True))


def test_mismatched_vocabulary_names_first_differing_token(tiny_pair, tiny_mismatch):
    with pytest.raises(IncompatiblePairError, match=r"token \d+ differs: draft '.*', target '.*'"):
        check_pair_compatible(read_gguf(tiny_pair[0], tokens=True), read_gguf(tiny_mismatch, tokens=True))


def test_vocabulary_size_difference_is_incompatible(tmp_path, tiny_pair):
    small = write_tiny_llama(tmp_path / "small.gguf", seed=1, words=("alpha", "beta"))
    with pytest.raises(IncompatiblePairError, match="vocabulary sizes differ"):
        check_pair_compatible(read_gguf(tiny_pair[0], tokens=True), read_gguf(small, tokens=True))


def test_different_bos_is_incompatible(tmp_path, tiny_pair):
    other = write_tiny_llama(tmp_path / "other.gguf", seed=1)
    draft, target = read_gguf(tiny_pair[0], tokens=True), read_gguf(other, tokens=True)
    target.metadata["tokenizer.ggml.bos_token_id"] = 3
    with pytest.raises(IncompatiblePairError, match="BOS ids differ"):
        check_pair_compatible(draft, target)


def test_missing_and_non_gguf_and_truncated(tmp_path, tiny_pair):
    with pytest.raises(ModelNotFoundError):
        read_gguf(tmp_path / "absent.gguf")
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    with pytest.raises(InvalidModelFileError, match="not a GGUF"):
        read_gguf(text)
    data = tiny_pair[0].read_bytes()
    for keep in (len(data) - 1000, 2000, 30):
        truncated = tmp_path / f"truncated-{keep}.gguf"
        truncated.write_bytes(data[:keep])
        with pytest.raises(InvalidModelFileError, match="truncated"):
            read_gguf(truncated)
    intact = tmp_path / "intact.gguf"
    shutil.copy(tiny_pair[0], intact)
    read_gguf(intact)
