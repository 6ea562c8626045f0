"""Architecture rules that keep concerns in one home."""

import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cactus_edge"


ROOT = PACKAGE.parent
# Front ends and the OpenAI layer sit above the engine: it must import none of them, in any form.
ABOVE_THE_ENGINE = ("cactus_edge.openai_api", "cactus_edge.server", "cactus_edge.cli", "cactus_edge.tui")
# The package's layers, bottom to top: a module imports only its own layer and the ones below it.
# The modules at the top of the package (errors, checks, files...) are the base every layer uses.
LAYERS = ("rules", "constraints", "llama", "catalog", "engine", "openai_api", "server", "tui", "cli")


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


def test_only_the_llama_layer_imports_llama_cpp():
    modules = _modules()
    importers = sorted(
        name for name, path in modules.items()
        if any(m == "llama_cpp" or m.startswith("llama_cpp.") for m in _imports(name, path))
    )  # fmt: skip
    assert importers and all(name.startswith("cactus_edge.llama.") for name in importers), importers


def test_the_engine_imports_nothing_above_it():
    """Neither the engine nor anything it imports, directly or not, reaches the OpenAI layer,
    the server, the CLI or the TUI."""
    modules = _modules()
    seen, todo = set(), ["cactus_edge.engine.engine"]
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
        "from cactus_edge.rules.acceptance import Cactus\n"
        "from cactus_edge.rules.sampling import process_logits\n"
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
        "import cactus_edge.engine.config, cactus_edge.engine.stats, cactus_edge.openai_api\n"
        "import cactus_edge.tui.app\n"
        "import cactus_edge.engine.drafters, cactus_edge.cli.bench, cactus_edge.cli.main\n"
        "import cactus_edge.server, cactus_edge.server.app, cactus_edge.server.runner\n"
        "heavy = ('llama_cpp', 'cactus_edge.engine.engine', 'cactus_edge.llama.model')\n"
        "loaded = [m for m in heavy if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _layer(name: str) -> int:
    """The rank of a module's layer: -1 for the base modules at the top of the package."""
    parts = name.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 2 or parts[1] in LAYERS else -1


def _reached(name: str, modules: dict[str, Path]) -> set[str]:
    """Every package module ``name`` imports, directly or through others (the package's
    ``__init__`` facade excluded: it names the public API lazily)."""
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in seen or current not in modules or current == "cactus_edge":
            continue
        seen.add(current)
        todo.extend(_imports(current, modules[current]))
    return seen - {name}


def test_each_layer_imports_only_the_layers_below_it():
    modules = _modules()
    breaches = []
    for name in sorted(modules):
        if name == "cactus_edge":
            continue
        above = sorted(m for m in _reached(name, modules) if _layer(m) > _layer(name))
        breaches += [f"{name} reaches {m}" for m in above]
    assert not breaches, "\n".join(breaches)


def test_every_module_belongs_to_a_layer_or_the_base():
    """A new folder is a new layer: it must be placed in LAYERS (and in docs/development.md)."""
    folders = {name.split(".")[1] for name in _modules() if name.count(".") >= 2}
    assert folders <= set(LAYERS), folders - set(LAYERS)


def test_the_layer_rule_catches_an_upward_import(tmp_path):
    """The check itself: a rules module that imported the engine would be reported."""
    modules = _modules()
    fake = tmp_path / "bad.py"
    fake.write_text("from ..engine.config import GenerationConfig\n")
    modules["cactus_edge.rules.bad"] = fake
    reached = _reached("cactus_edge.rules.bad", modules)
    assert any(_layer(m) > _layer("cactus_edge.rules.bad") for m in reached)


def test_engine_functions_stay_small():
    """No function over 60 lines in the engine's modules: the loop reads one step at a time."""
    import ast

    for path in (PACKAGE / "engine").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                length = node.end_lineno - node.lineno + 1
                assert length <= 60, f"{path.name}: {node.name} has {length} lines"
