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


def test_configs_stats_and_front_ends_load_without_llama_cpp():
    """The TUI, the OpenAI-shaped layer, configs and statistics import no model library: an app
    can build requests and read results before (or without) loading one."""
    code = (
        "import sys\n"
        "import cactus_edge.config, cactus_edge.stats, cactus_edge.openai_compat, cactus_edge.tui.app\n"
        "import cactus_edge.drafters, cactus_edge.bench\n"
        "heavy = ('llama_cpp', 'cactus_edge.engine', 'cactus_edge.backend')\n"
        "loaded = [m for m in heavy if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_engine_functions_and_classes_stay_small():
    """The structure the next contributor can change: no engine function over 60 lines, no class
    over 150."""
    import ast

    for name in ("engine.py", "drafters.py"):
        tree = ast.parse((PACKAGE / name).read_text())
        for node in ast.walk(tree):
            length = node.end_lineno - node.lineno + 1 if hasattr(node, "end_lineno") else 0
            if isinstance(node, ast.FunctionDef):
                assert length <= 60, f"{name}: {node.name} has {length} lines"
            elif isinstance(node, ast.ClassDef):
                assert length <= 150, f"{name}: class {node.name} has {length} lines"
