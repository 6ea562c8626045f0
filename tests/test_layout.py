"""Architecture rules that keep concerns in one home."""

import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cactus_edge"


ROOT = PACKAGE.parent
# Front ends and the OpenAI layer sit above the engine: it must import none of them, in any form.
ABOVE_THE_ENGINE = ("cactus_edge.openai_compat", "cactus_edge.openai_api", "cactus_edge.server",
                    "cactus_edge.cli", "cactus_edge.tui")  # fmt: skip


def _modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name: cactus_edge/** and tui/ (which
    installs as cactus_edge.tui)."""
    found = {}
    for folder, package in ((PACKAGE, "cactus_edge"), (ROOT / "tui", "cactus_edge.tui")):
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def _imports(name: str, path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (top level or inside a function), absolute."""
    import ast

    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            imported.add(base)
            imported.update(f"{base}.{alias.name}" for alias in node.names)  # `from . import x`
    return imported


def test_only_the_backend_imports_llama_cpp():
    modules = _modules()
    importers = sorted(
        name for name, path in modules.items()
        if any(m == "llama_cpp" or m.startswith("llama_cpp.") for m in _imports(name, path))
    )  # fmt: skip
    assert importers == ["cactus_edge.backend"]


def test_the_engine_imports_nothing_above_it():
    """Neither the engine nor anything it imports, directly or not, reaches the OpenAI layer,
    the server, the CLI or the TUI."""
    modules = _modules()
    seen, todo = set(), ["cactus_edge.engine"]
    while todo:
        name = todo.pop()
        if name in seen or name not in modules:
            continue
        seen.add(name)
        todo.extend(_imports(name, modules[name]))
    above = sorted(m for m in seen if m.startswith(ABOVE_THE_ENGINE))
    assert not above, f"the engine reaches {above}"


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
    """The TUI, the server, the CLI, the OpenAI-shaped layer, configs and statistics import no
    model library: an app can build requests and read results before (or without) loading one."""
    code = (
        "import sys\n"
        "import cactus_edge.config, cactus_edge.stats, cactus_edge.openai_api, cactus_edge.tui.app\n"
        "import cactus_edge.drafters, cactus_edge.bench, cactus_edge.cli\n"
        "import cactus_edge.server, cactus_edge.server.app, cactus_edge.server.runner\n"
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
