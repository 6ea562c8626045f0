"""`cactus-edge models rm NAME`: a local model loses its file and its entry, a packaged one only its
file, an unknown name or a pair is refused, and a failure never leaves a file that no name reaches."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from cactus_edge.catalog import registry as registry_module
from cactus_edge.catalog.registry import (
    HubPin,
    load_registry,
    local_registry_file,
    read_local_registry,
    record_pin,
)
from cactus_edge.cli.main import main

COMMIT = "a" * 40
SHA = "b" * 64
HF_NAME = "hf:owner/repo/sub/small.gguf"
LOCAL = (
    '[models.tiny-draft]\nfile = "tiny-draft.gguf"\n\n[models.tiny-target]\nfile = "tiny-target.gguf"\n\n'
    '[pairs.tiny]\ndraft = "tiny-draft"\ntarget = "tiny-target"\n\n'
    '[pairs.tiny-coder]\ndraft = "tiny-draft"\ntarget = "qwen2.5-coder-1.5b-instruct"\n'
)


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    """An empty models folder of the test's own (CACTUS_EDGE_MODELS, as test_quantize's)."""
    folder = tmp_path / "models"
    folder.mkdir()
    monkeypatch.setenv("CACTUS_EDGE_MODELS", str(folder))
    return folder


@pytest.fixture
def local_models(models_dir):
    """Two local models (both fetched: their files are a few bytes, never loaded), the local pair
    "tiny" of both and the local pair "tiny-coder" of one and a packaged model."""
    for name in ("tiny-draft", "tiny-target"):
        (models_dir / f"{name}.gguf").write_bytes(b"GGUF" + name.encode())
    local_registry_file(models_dir).write_text(LOCAL)
    return models_dir


def rm(name: str):
    return CliRunner().invoke(main, ["models", "rm", name])


def listed_models() -> dict[str, str]:
    """Each model row of `models list`: name -> "fetched" or "-"."""
    output = CliRunner().invoke(main, ["models", "list"]).stdout
    table = output.split("models (size: on disk when fetched, else to download):\n")[1]
    rows = [line.split() for line in table.split("\n\n")[0].splitlines()]
    return {row[0]: row[1] for row in rows}


def listed_pairs() -> list[str]:
    output = CliRunner().invoke(main, ["models", "list"]).stdout
    return [line.split()[0] for line in output.split("pairs:\n")[1].split("\n\n")[0].splitlines()]


def test_a_local_model_loses_its_file_and_its_entry(local_models):
    assert listed_models()["tiny-target"] == "fetched"
    result = rm("tiny-target")
    assert result.exit_code == 0, result.output
    registry = local_registry_file(local_models)
    assert result.stdout == (
        f"deleted {local_models / 'tiny-target.gguf'}; removed the entry of tiny-target, and the pair "
        f"tiny that named it, from {registry}\n"
    )
    assert not (local_models / "tiny-target.gguf").exists()
    assert "tiny-target" not in listed_models() and "tiny" not in listed_pairs()
    # Everything else is kept, and the file still reads as a registry.
    assert listed_models()["tiny-draft"] == "fetched" and "tiny-coder" in listed_pairs()
    assert set(read_local_registry(registry)["models"]) == {"tiny-draft"}
    assert (local_models / "tiny-draft.gguf").exists()


def test_removing_a_model_removes_every_local_pair_that_names_it(local_models):
    result = rm("tiny-draft")
    assert result.exit_code == 0, result.output
    assert "and the pairs tiny, tiny-coder that named it," in result.stdout
    assert "pairs" not in read_local_registry(local_registry_file(local_models))
    assert load_registry().pairs.keys().isdisjoint({"tiny", "tiny-coder"})
    assert "qwen2.5-coder-1.5b-instruct" in load_registry().models  # a packaged member stays


def test_a_missing_file_is_said_and_the_entry_still_goes(local_models):
    (local_models / "tiny-target.gguf").unlink()
    assert listed_models()["tiny-target"] == "-"
    result = rm("tiny-target")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"nothing to delete: {local_models / 'tiny-target.gguf'} is not there; ")
    assert "tiny-target" not in listed_models()


def test_a_packaged_model_loses_its_file_and_keeps_its_entry(models_dir):
    spec = load_registry().model("qwen3-0.6b")
    spec.path(models_dir).write_bytes(b"GGUF")
    pin = HubPin("Qwen/Qwen3-0.6B-GGUF", "Qwen3-0.6B-Q8_0.gguf", "main", COMMIT, 4, SHA)
    record_pin(models_dir, "qwen3-0.6b", pin)
    assert listed_models()["qwen3-0.6b"] == "fetched"
    result = rm("qwen3-0.6b")
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        f"deleted {spec.path(models_dir)}; qwen3-0.6b is a packaged model: its registry entry stays "
        "(cactus-edge models fetch qwen3-0.6b gets it again)\n"
    )
    assert not spec.path(models_dir).exists()
    assert listed_models()["qwen3-0.6b"] == "-"
    # Its pin stays too: fetching it again brings the same bytes.
    assert read_local_registry(local_registry_file(models_dir))["pins"]["qwen3-0.6b"]["commit"] == COMMIT
    again = rm("qwen3-0.6b")
    assert again.exit_code == 0
    assert again.stdout.startswith(
        f"nothing to delete: {spec.path(models_dir)} is not there; qwen3-0.6b is a"
    )


def test_an_unknown_name_is_one_line_and_exit_2(local_models):
    result = rm("tiny-trget")
    assert result.exit_code == 2
    assert result.stderr == "error: unknown model 'tiny-trget'; did you mean tiny-target, tiny-draft?\n"
    assert result.stdout == ""
    unfetched = rm("hf:owner/repo/never.gguf")
    assert unfetched.exit_code == 2
    assert unfetched.stderr == (
        f"error: unknown model 'hf:owner/repo/never.gguf': neither fetched into {local_models} nor "
        "pinned\n"
    )
    assert (local_models / "tiny-target.gguf").exists()
    assert local_registry_file(local_models).read_text() == LOCAL


@pytest.mark.parametrize(
    "pair, commands",
    [
        ("tiny", "cactus-edge models rm tiny-draft; cactus-edge models rm tiny-target"),
        ("smollm2-self", "cactus-edge models rm smollm2-135m-instruct"),  # one model drafting for itself
    ],
)
def test_a_pair_is_refused_naming_its_models(local_models, pair, commands):
    result = rm(pair)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: '{pair}' is a pair (")
    assert result.stderr.endswith(f", not a model; remove its models one by one: {commands}\n")
    assert local_registry_file(local_models).read_text() == LOCAL
    assert (local_models / "tiny-draft.gguf").exists()


def test_an_hf_model_loses_its_file_its_pin_and_its_empty_folders(models_dir):
    folder = models_dir / "hf" / "owner" / "repo" / "main" / "sub"
    folder.mkdir(parents=True)
    (folder / "small.gguf").write_bytes(b"GGUF")
    record_pin(models_dir, HF_NAME, HubPin("owner/repo", "sub/small.gguf", "main", COMMIT, 4, SHA))
    result = rm(HF_NAME)
    assert result.exit_code == 0, result.output
    registry = local_registry_file(models_dir)
    assert result.stdout == f"deleted {folder / 'small.gguf'}; removed the pin of {HF_NAME} from {registry}\n"
    assert not (models_dir / "hf").exists()
    assert HF_NAME not in read_local_registry(registry).get("pins", {})


def test_a_failed_registry_write_leaves_the_model_registered_and_not_fetched(local_models, monkeypatch):
    """The file goes first: a failed rewrite leaves a registered model without its file (what `models
    list` shows as not fetched, and a second rm finishes), never a file no name reaches."""

    def full_disk(path, text):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(registry_module, "write_text_atomically", full_disk)
        result = rm("tiny-target")
    assert result.exit_code == 2
    registry = local_registry_file(local_models)
    assert result.stderr == (
        f"error: deleted {local_models / 'tiny-target.gguf'}, but could not remove 'tiny-target' from "
        f"{registry}: [Errno 28] No space left on device; run `cactus-edge models rm tiny-target` again\n"
    )
    assert registry.read_text() == LOCAL
    assert listed_models()["tiny-target"] == "-"
    assert rm("tiny-target").exit_code == 0
    assert "tiny-target" not in listed_models()


def test_a_file_that_cannot_be_deleted_changes_nothing(local_models):
    (local_models / "tiny-target.gguf").unlink()
    (local_models / "tiny-target.gguf").mkdir()  # unlink(2) refuses a directory
    result = rm("tiny-target")
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: cannot delete {local_models / 'tiny-target.gguf'}: ")
    assert result.stderr.endswith("; nothing was changed\n")
    assert local_registry_file(local_models).read_text() == LOCAL
