"""Architecture rules that keep concerns in one home."""

import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cactus_edge"


def test_only_the_backend_imports_llama_cpp():
    importers = sorted(path.name for path in PACKAGE.glob("*.py") if "import llama_cpp" in path.read_text())
    assert importers == ["backend.py"]


def test_rules_and_sampling_load_without_llama_cpp():
    code = (
        "import sys; sys.modules['llama_cpp'] = None\n"
        "from cactus_edge.acceptance import Cactus\nfrom cactus_edge.sampling import process_logits\n"
        "from cactus_edge import SpeculativeSampling\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_engine_api_is_importable_from_the_package():
    from cactus_edge import Engine, GenerationConfig

    assert Engine.from_pair and GenerationConfig().method == "cactus"
