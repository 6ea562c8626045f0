"""`cactus-edge models quantize`: real llama.cpp quantization of the tiny models into a temporary
models directory, the local registry it writes, and what is left behind when quantization fails."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from cactus_edge.catalog.quantize import QUANT_TYPES, check_quant_type, quantize
from cactus_edge.catalog.registry import (
    QuantizedSource,
    load_registry,
    local_registry_file,
    local_registry_text,
)
from cactus_edge.catalog.resolve import resolve_model_path
from cactus_edge.cli.main import main
from cactus_edge.engine.engine import Engine, GenerationConfig
from cactus_edge.errors import (
    BackendError,
    InvalidSettingError,
    LocalRegistryError,
    ModelNotFetchedError,
    NameTakenError,
)
from cactus_edge.files import write_text_atomically
from cactus_edge.llama import model as backend
from cactus_edge.llama.gguf import read_gguf
from cactus_edge.llama.model import LlamaModel

# What llama.cpp's quantizer makes of the tiny model's 21 tensors (rows of 64 or 128 values): the 5
# norm vectors stay F32; the weights take the type, or a fallback where a row is not a whole number
# of the type's blocks (K-quants need 256); output.weight gets llama.cpp's higher output type.
TENSOR_TYPES = {
    "q8_0": {"Q8_0": 16, "F32": 5},
    "q4_0": {"Q4_0": 15, "Q8_0": 1, "F32": 5},  # output.weight: Q6_K wanted, 64 % 256 -> Q8_0
    "q4_k_m": {"Q5_0": 13, "Q8_0": 3, "F32": 5},  # no K-quant fits 64-value rows
    "f16": {"F16": 16, "F32": 5},
}


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    folder = tmp_path / "models"
    monkeypatch.setenv("CACTUS_EDGE_MODELS", str(folder))
    return folder


@pytest.fixture
def tiny_registered(models_dir, tiny_pair):
    """The tiny pair registered locally as models tiny-draft, tiny-target and pair "tiny"."""
    models_dir.mkdir(parents=True, exist_ok=True)
    for name, path in zip(("tiny-draft", "tiny-target"), tiny_pair, strict=True):
        shutil.copy(path, models_dir / f"{name}.gguf")
    local_registry_file(models_dir).write_text(
        '[models.tiny-draft]\nfile = "tiny-draft.gguf"\n\n[models.tiny-target]\nfile = "tiny-target.gguf"\n\n'
        '[pairs.tiny]\ndraft = "tiny-draft"\ntarget = "tiny-target"\n'
    )
    return models_dir


def leftovers(folder) -> list[str]:
    """Files in the models directory other than the local registry."""
    return (
        sorted(p.name for p in folder.iterdir() if p.name != "local-registry.toml") if folder.exists() else []
    )


def greedy_tokens(path, n_tokens: int = 6) -> list[int]:
    with LlamaModel(path, n_ctx=128) as model:
        tokens = model.tokenize("the water is")
        out = []
        for _ in range(n_tokens):
            logits = model.decode(tokens[-1:] if out else tokens)[0]
            assert np.isfinite(logits).all()
            tokens.append(int(np.argmax(logits)))
            out.append(tokens[-1])
        return out


# --- the quantized files -----------------------------------------------------------------------------


@pytest.mark.parametrize("quant_type", sorted(TENSOR_TYPES))
def test_quantized_model_has_llamacpps_types_loads_and_generates(models_dir, tiny_pair, quant_type):
    source_digest = sha256(tiny_pair[1])
    result = quantize(tiny_pair[1], quant_type)
    (model,) = result.models
    assert model.name == f"tiny-target-{quant_type}" and not model.reused
    assert model.path == models_dir / f"tiny-target-{quant_type}.gguf"
    info = read_gguf(model.path)
    assert info.quantization == quant_type.upper() and dict(info.tensor_types) == TENSOR_TYPES[quant_type]
    assert (model.size, model.sha256) == (model.path.stat().st_size, sha256(model.path))
    assert len(greedy_tokens(model.path)) == 6
    assert sha256(tiny_pair[1]) == source_digest  # the source is only read
    assert leftovers(models_dir) == [model.path.name]


def test_q8_0_generates_what_the_f32_source_does(models_dir, tiny_pair):
    (model,) = quantize(tiny_pair[1], "q8_0").models
    assert greedy_tokens(model.path) == greedy_tokens(tiny_pair[1])


def test_quantization_is_deterministic_whatever_the_thread_count(models_dir, tiny_pair):
    one = quantize(tiny_pair[0], "q4_0", name="one", n_threads=1).models[0]
    two = quantize(tiny_pair[0], "q4_0", name="two", n_threads=2).models[0]
    assert one.sha256 == two.sha256 and one.path.read_bytes() == two.path.read_bytes()


def test_an_already_quantized_model_can_be_requantized(models_dir, tiny_pair):
    """llama.cpp refuses this unless allow_requantize is set (status 1)."""
    quantize(tiny_pair[1], "q8_0")
    (model,) = quantize("tiny-target-q8_0", "q4_0").models
    assert (model.origin, model.source_type, model.name) == (
        "tiny-target-q8_0",
        "Q8_0",
        "tiny-target-q8_0-q4_0",
    )
    assert read_gguf(model.path).quantization == "Q4_0" and len(greedy_tokens(model.path)) == 6


def test_every_offered_type_is_a_llamacpp_type_in_any_case():
    import llama_cpp

    for name in QUANT_TYPES:
        assert hasattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name.upper()}"), name
        assert check_quant_type(name.upper()) == name
    with pytest.raises(InvalidSettingError, match="unknown quantization type 'q3'; choose one of q4_0"):
        check_quant_type("q3")


def test_llamacpp_failures_are_backend_errors(tmp_path, tiny_pair):
    with pytest.raises(BackendError, match="could not quantize tiny-draft.gguf to Q8_0"):
        backend.quantize_gguf(tiny_pair[0], tmp_path / "no-such-dir" / "out.gguf", "q8_0")
    with pytest.raises(BackendError, match="no quantization type 'q9_9'"):
        backend.quantize_gguf(tiny_pair[0], tmp_path / "out.gguf", "q9_9")


# --- registration, verification, re-runs --------------------------------------------------------------


def test_result_is_registered_with_its_recipe(models_dir, tiny_pair):
    (model,) = quantize(tiny_pair[1], "q8_0").models
    spec = load_registry().model("tiny-target-q8_0")
    assert (spec.file, spec.size, spec.sha256) == (model.path.name, model.size, model.sha256)
    origin = str(tiny_pair[1].resolve())
    assert spec.source == QuantizedSource(origin, "q8_0", sha256(tiny_pair[1]))
    assert spec.description == (
        f"re-quantized to Q8_0 from {origin} (sha256 {sha256(tiny_pair[1])}) by llama.cpp's quantizer"
    )
    assert resolve_model_path("tiny-target-q8_0") == model.path


def test_verify_passes_then_catches_one_changed_byte(models_dir, tiny_pair):
    (model,) = quantize(tiny_pair[1], "q8_0").models
    runner = CliRunner()
    ok = runner.invoke(main, ["models", "verify", "tiny-target-q8_0"])
    assert ok.exit_code == 0 and ok.stdout == f"tiny-target-q8_0: ok ({model.path})\n"
    data = bytearray(model.path.read_bytes())
    data[-1] ^= 0xFF
    model.path.write_bytes(bytes(data))
    bad = runner.invoke(main, ["models", "verify"])  # no names: every model present
    assert bad.exit_code == 5 and "tiny-target-q8_0: sha256 " in bad.stdout
    assert bad.stderr.startswith("error: 1 model(s) failed verification: tiny-target-q8_0 (")
    assert f"{model.path.name}: sha256 " in bad.stderr and bad.stderr.count("\n") == 1


def test_a_rerun_reuses_the_result_and_force_remakes_it(models_dir, tiny_pair, monkeypatch):
    first = quantize(tiny_pair[1], "q8_0").models[0]
    calls = []
    real = backend.quantize_gguf
    monkeypatch.setattr(backend, "quantize_gguf", lambda *args: calls.append(args) or real(*args))
    again = quantize(tiny_pair[1], "q8_0").models[0]
    assert again.reused and again.sha256 == first.sha256 and calls == []
    forced = quantize(tiny_pair[1], "q8_0", force=True).models[0]
    assert not forced.reused and forced.sha256 == first.sha256 and len(calls) == 1


def test_a_damaged_or_missing_result_is_remade_without_force(models_dir, tiny_pair):
    first = quantize(tiny_pair[1], "q8_0").models[0]
    first.path.write_bytes(b"GGUF broken")
    assert not quantize(tiny_pair[1], "q8_0").models[0].reused
    first.path.unlink()
    assert quantize(tiny_pair[1], "q8_0").models[0].sha256 == first.sha256


def test_a_quantized_model_is_remade_not_fetched(models_dir, tiny_pair):
    (model,) = quantize(tiny_pair[1], "q8_0", name="tq").models
    model.path.unlink()
    remake = f"cactus-edge models quantize {tiny_pair[1].resolve()} --type q8_0 --name tq"
    result = CliRunner().invoke(main, ["models", "fetch", "tq"])
    assert result.exit_code == 5 and result.stderr.count("\n") == 1
    assert "made by `models quantize`, not downloaded" in result.stderr and remake in result.stderr
    with pytest.raises(ModelNotFetchedError, match=f"not made yet .*; run: {remake}"):
        resolve_model_path("tq")


# --- pairs ---------------------------------------------------------------------------------------------


def test_a_pair_becomes_a_quantized_pair_that_runs(tiny_registered):
    result = quantize("tiny", "q8_0")
    assert [m.name for m in result.models] == ["tiny-draft-q8_0", "tiny-target-q8_0"]
    pair = load_registry().pair("tiny-q8_0")
    assert (
        (pair.draft, pair.target)
        == ("tiny-draft-q8_0", "tiny-target-q8_0")
        == (
            result.pair.draft,
            result.pair.target,
        )
    )
    with Engine.from_pair("tiny-q8_0", n_ctx=256) as engine:
        out = engine.generate("the water is", GenerationConfig(method="sps", max_tokens=8, temperature=0))
        assert len(out.tokens) == 8
    cli = CliRunner().invoke(
        main, ["generate", "hi", "--pair", "tiny-q8_0", "--n-ctx", "256", "--max-tokens", "5", "--seed", "0"]
    )
    assert cli.exit_code == 0 and re.match(r"\[cactus\] [1-5] tokens", cli.stderr.splitlines()[1])


def test_cli_prints_one_line_per_model_then_the_pair(tiny_registered):
    runner = CliRunner()
    result = runner.invoke(main, ["models", "quantize", "tiny", "--type", "Q8_0", "--threads", "1"])
    assert result.exit_code == 0, result.output
    draft, target, pair = result.stdout.splitlines()
    digest = sha256(tiny_registered / "tiny-draft-q8_0.gguf")
    assert draft.startswith("tiny-draft (F32) -> tiny-draft-q8_0 (Q8_0): 191,616 bytes, sha256 " + digest)
    assert draft.endswith(f" s, {tiny_registered / 'tiny-draft-q8_0.gguf'}")
    assert target.startswith("tiny-target (F32) -> tiny-target-q8_0 (Q8_0): ")
    assert pair == "pair tiny-q8_0: tiny-draft-q8_0 -> tiny-target-q8_0 (use: --pair tiny-q8_0)"
    again = runner.invoke(main, ["models", "quantize", "tiny", "--type", "q8_0"])
    assert again.exit_code == 0 and again.stdout.count("reused, already made from these source bytes") == 2
    listed = runner.invoke(main, ["models", "list"])
    assert "tiny-q8_0          tiny-draft-q8_0 -> tiny-target-q8_0" in listed.stdout
    assert "tiny-target-q8_0               fetched  quantized" in listed.stdout


def test_an_unknown_type_is_a_usage_error_naming_the_choices(tiny_pair):
    result = CliRunner().invoke(main, ["models", "quantize", str(tiny_pair[0]), "--type", "q3"])
    assert result.exit_code == 2
    assert "Invalid value for '--type': 'q3' is not one of 'q4_0', 'q4_1'" in result.stderr


# --- failures leave nothing behind ----------------------------------------------------------------------


def half_then(error):
    def broken(src, dst, ftype_name, n_threads=None):
        with open(dst, "wb") as out:
            out.write(b"GGUF" + b"\0" * 1000)
        raise error

    return broken


def garbage(src, dst, ftype_name, n_threads=None):
    with open(dst, "wb") as out:
        out.write(b"not a model at all")


@pytest.mark.parametrize(
    ("fake", "error"),
    [
        (half_then(BackendError("disk full")), BackendError),
        (half_then(KeyboardInterrupt()), KeyboardInterrupt),
        (garbage, BackendError),
    ],
)
def test_a_failed_quantization_leaves_no_file_and_no_entry(
    models_dir, tiny_registered, monkeypatch, fake, error
):
    before = local_registry_file(models_dir).read_text()
    monkeypatch.setattr(backend, "quantize_gguf", fake)
    with pytest.raises(error):
        quantize("tiny-target", "q8_0")
    assert leftovers(models_dir) == ["tiny-draft.gguf", "tiny-target.gguf"]
    assert local_registry_file(models_dir).read_text() == before
    assert "tiny-target-q8_0" not in load_registry().models


@pytest.mark.parametrize(("fake", "code"), [(half_then(BackendError("disk full")), 6), (garbage, 6)])
def test_cli_reports_a_failed_quantization_in_one_line(models_dir, tiny_pair, monkeypatch, fake, code):
    monkeypatch.setattr(backend, "quantize_gguf", fake)
    result = CliRunner().invoke(main, ["models", "quantize", str(tiny_pair[0]), "--type", "q8_0"])
    assert result.exit_code == code and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert leftovers(models_dir) == []


# --- names ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["default", "qwen2.5-coder-0.5b-instruct", "smollm2-self"])
def test_packaged_names_are_refused_even_with_force(models_dir, tiny_pair, name):
    with pytest.raises(NameTakenError, match=f"'{name}' is already a packaged model or pair"):
        quantize(tiny_pair[0], "q8_0", name=name, force=True)
    assert leftovers(models_dir) == []


def test_a_local_registry_may_not_shadow_a_packaged_name(models_dir):
    models_dir.mkdir()
    local_registry_file(models_dir).write_text('[models.default]\nfile = "x.gguf"\n')
    with pytest.raises(LocalRegistryError, match="'default' already name packaged models or pairs"):
        load_registry()
    result = CliRunner().invoke(main, ["models", "list"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "may not replace" in result.stderr


@pytest.mark.parametrize("name", ["x.gguf", "a/b", ".hidden", "-x", ""])
def test_names_that_are_not_names_are_refused(models_dir, tiny_pair, name):
    with pytest.raises(InvalidSettingError, match="cannot be a model name"):
        quantize(tiny_pair[0], "q8_0", name=name)


def test_a_different_local_model_or_file_is_replaced_only_with_force(models_dir, tiny_pair):
    quantize(tiny_pair[0], "q8_0", name="mine")
    with pytest.raises(NameTakenError, match="'mine' is already a local model .* --force to replace it"):
        quantize(tiny_pair[1], "q8_0", name="mine")
    assert quantize(tiny_pair[1], "q8_0", name="mine", force=True).models[0].origin == str(tiny_pair[1])
    (models_dir / "someone-elses.gguf").write_bytes(b"GGUF keep me")
    with pytest.raises(NameTakenError, match="exists but is not a registered model"):
        quantize(tiny_pair[0], "q8_0", name="someone-elses")
    assert (models_dir / "someone-elses.gguf").read_bytes() == b"GGUF keep me"


def test_the_result_never_replaces_its_own_source(models_dir, tiny_pair):
    models_dir.mkdir()
    source = shutil.copy(tiny_pair[0], models_dir / "x.gguf")
    with pytest.raises(NameTakenError, match="would replace its own source"):
        quantize(source, "q8_0", name="x", force=True)
    assert sha256(source) == sha256(tiny_pair[0])


def test_a_pair_name_may_not_be_a_model_name(tiny_registered):
    with pytest.raises(NameTakenError, match="'tiny-draft-q8_0' is a model name"):
        quantize("tiny", "q8_0", name="tiny-draft-q8_0")
    assert leftovers(tiny_registered) == ["tiny-draft.gguf", "tiny-target.gguf"]


# --- the local registry file ---------------------------------------------------------------------------


def test_registering_keeps_every_other_entry(tiny_registered, tiny_pair):
    quantize(tiny_pair[0], "q8_0", name="first")
    quantize("tiny", "q4_0")
    registry = load_registry()
    for name in ("tiny-draft", "tiny-target", "first", "tiny-draft-q4_0", "tiny-target-q4_0"):
        assert name in registry.models
    assert {"tiny", "tiny-q4_0"} <= set(registry.pairs)


def test_toml_text_round_trips_awkward_strings():
    import tomllib

    awkward = 'quote " backslash \\ newline \n tab \t del \x7f unicode é ▁ \u2028'
    data = {
        "models": {"a.b": {"file": "x.gguf", "size": 3, "flag": True, "parts": ["p", awkward]}},
        "pairs": {
            "p": {"draft": "a.b", "target": "a.b", "description": awkward, "source": {"from": awkward}}
        },
    }
    assert tomllib.loads(local_registry_text(data)) == data


def test_a_failed_registry_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "local-registry.toml"
    path.write_text("old")

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_text_atomically(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["local-registry.toml"]


def test_quantize_and_the_cli_import_no_llama_cpp():
    code = (
        "import sys; sys.modules['llama_cpp'] = None\n"
        "import cactus_edge.catalog.quantize, cactus_edge.cli.main\n"
        "assert 'cactus_edge.llama.model' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
