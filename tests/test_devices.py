"""--n-gpu-layers auto: every layer on the GPU when llama.cpp can offload to one, the CPU otherwise;
the device named in the models line. llama.cpp's answers are faked both ways; the real CPU build
answers too."""

import llama_cpp
import pytest
from click.testing import CliRunner

from cactus_edge.cli.main import main
from cactus_edge.engine.engine import Engine
from cactus_edge.errors import InvalidSettingError
from cactus_edge.llama import devices
from cactus_edge.llama.devices import device_label, resolve_gpu_layers

from .conftest import TEST_THREADS


def fake_build(monkeypatch, *, offload: bool, rpc: bool, gpus: list[str]):
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: offload)
    monkeypatch.setattr(llama_cpp, "llama_supports_rpc", lambda: rpc)
    monkeypatch.setattr(devices, "_local_gpu_names", lambda: list(gpus))


def test_auto_offloads_every_layer_on_a_gpu_build(monkeypatch):
    fake_build(monkeypatch, offload=True, rpc=False, gpus=["Metal (Apple M2 Max)"])
    assert resolve_gpu_layers("auto") == -1
    assert device_label(-1) == "GPU Metal (Apple M2 Max)"
    assert device_label(20) == "GPU Metal (Apple M2 Max), 20 layers"
    assert device_label(0) == "CPU"  # 0 keeps the CPU whatever the build


def test_auto_keeps_the_cpu_on_a_cpu_build(monkeypatch):
    fake_build(monkeypatch, offload=False, rpc=False, gpus=[])
    assert resolve_gpu_layers("auto") == 0
    assert device_label(-1) == "CPU"


def test_an_rpc_only_build_is_not_a_gpu(monkeypatch):
    """llama.cpp says it can offload when it has the RPC backend alone: a local GPU must exist."""
    fake_build(monkeypatch, offload=True, rpc=True, gpus=[])
    assert resolve_gpu_layers("auto") == 0
    fake_build(monkeypatch, offload=True, rpc=True, gpus=["CUDA0 (NVIDIA RTX 4090)"])
    assert resolve_gpu_layers("auto") == -1


def test_numbers_are_kept_and_nonsense_is_refused():
    assert resolve_gpu_layers(0) == 0 and resolve_gpu_layers(12) == 12 and resolve_gpu_layers(-1) == -1
    for bad in (-2, "many", True, 1.5):
        with pytest.raises(InvalidSettingError, match="n_gpu_layers"):
            resolve_gpu_layers(bad)


def test_this_cpu_build_resolves_auto_to_the_cpu():
    """The real llama.cpp build of the suite (CPU, with RPC): no local GPU, so no layer offloaded."""
    assert resolve_gpu_layers("auto") == 0 and device_label(-1) == "CPU"


def test_loading_resolves_auto_for_both_models(tiny_pair, monkeypatch):
    fake_build(monkeypatch, offload=True, rpc=False, gpus=["Metal (Apple M2)"])
    with Engine.load(str(tiny_pair[0]), str(tiny_pair[1]), n_ctx=256, n_threads=TEST_THREADS) as engine:
        assert engine.target.n_gpu_layers == -1 and engine.draft.n_gpu_layers == -1
        assert engine.description.endswith(" · GPU Metal (Apple M2)")
    with Engine.load(None, str(tiny_pair[1]), n_ctx=256, n_threads=TEST_THREADS, n_gpu_layers=0) as engine:
        assert engine.target.n_gpu_layers == 0
        assert engine.description.endswith("no draft model · CPU")


def test_the_cli_defaults_to_auto_and_refuses_below_minus_one(tiny_pair):
    runner = CliRunner()
    pair = ["--draft", str(tiny_pair[0]), "--target", str(tiny_pair[1]), "--threads", str(TEST_THREADS)]
    args = ["generate", "hi", *pair, "--n-ctx", "256", "--max-tokens", "2", "--method", "sps"]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "[models] draft tiny-draft.gguf -> target tiny-target.gguf · CPU" in result.stderr
    refused = runner.invoke(main, [*args, "--n-gpu-layers", "-2"])
    assert refused.exit_code == 2 and "below -1" in refused.output
    assert "auto" in runner.invoke(main, ["generate", "--help"]).output
