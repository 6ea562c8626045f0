"""The docs name only commands, flags, modules, files and server routes that exist, and link only
to files that exist.

Every `cactus-edge …` command line in README.md and docs/*.md (in fenced code blocks and in inline
code) is checked against the click command tree of `cactus_edge.cli.main.main`, without running it: each
subcommand (and sub-subcommand, such as `models fetch`) must exist, and each `--flag` must be an
option of the command it is given to. Commands whose subcommand is a placeholder (`…`, `<…>`) are
skipped explicitly. Relative links and images must point to existing files, and a `#fragment` to
a heading of the page it names. Modules, repository paths and `METHOD /route` mentions in those
docs and in results/**/README.md must name what the package, the tree and the server app have
(the rules: the comment before `CHECKED_DOCS`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import importlib
import importlib.util
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import click
import pytest

from cactus_edge.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```+|~~~+)(.*?)$(.*?)^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
# `cactus-edge` as a command: alone or at the end of a path (.venv/bin/cactus-edge), at the start of
# a line or after a shell prompt, a space, `(` or a backtick; never inside a word, a string or a
# package spec (`"cactus-edge[hf]"`, `model="cactus-edge"`).
COMMAND = re.compile(r"(?:^|(?<=[\s(`$]))(?:[\w.~-]*/)*cactus-edge(?=[\s`]|$)")
# Where a command line ends: a comment, a pipe or list operator, a redirection, a closing backtick
# or parenthesis.
COMMAND_END = re.compile(r"\s#|\s*(?:\|\||&&|[|;<>`)])")
PLACEHOLDER = re.compile(r"…|\.\.\.|^<.*>$")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console", "zsh", "text"}


@dataclass(frozen=True)
class Mention:
    """One `cactus-edge …` command as a doc writes it."""

    path: Path
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _commands_in(chunk: str) -> list[tuple[int, str]]:
    """(offset in chunk, command text) of each `cactus-edge …` command in a piece of shell text."""
    found = []
    for match in COMMAND.finditer(chunk):
        rest = chunk[match.end() :]
        end = COMMAND_END.search(rest)
        found.append((match.start(), "cactus-edge" + (rest[: end.start()] if end else rest)))
    return found


def mentions(path: Path) -> list[Mention]:
    """Every command line in one Markdown file: fenced shell blocks (continuation lines joined) and
    inline code spans outside fences."""
    text = path.read_text(encoding="utf-8")
    found: list[Mention] = []
    prose, last = [], 0
    for fence in FENCE.finditer(text):
        prose.append((last, text[last : fence.start()]))
        last = fence.end()
        if fence.group(2).strip().lower() not in SHELL_BLOCKS:
            continue
        body_start = fence.start(3)
        for line_match in re.finditer(r"(?:[^\n]*\\\n)*[^\n]*", fence.group(3)):
            line = line_match.group(0)
            if "cactus-edge" not in line:
                continue
            # Backslash-newline continues a shell line; a "$ " prompt starts one.
            joined = re.sub(r"\\\n\s*", " ", line)
            for offset, command in _commands_in(joined):
                where = _line_of(text, body_start + line_match.start()) + joined[:offset].count("\n")
                found.append(Mention(path, where, command))
    prose.append((last, text[last:]))
    for start, chunk in prose:
        for span in INLINE_CODE.finditer(chunk):
            code = " ".join(span.group(2).split())
            for _, command in _commands_in(code):
                found.append(Mention(path, _line_of(text, start + span.start()), command))
    return found


ALL_MENTIONS = [mention for path in DOCS for mention in mentions(path)]


def _tokens(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:  # an unbalanced quote in prose: words are enough to find flags
        return command.split()


def _options(command: click.Command, ctx: click.Context) -> dict[str, click.Option]:
    """Every spelling of every option of `command`, help options included."""
    names: dict[str, click.Option] = {}
    for param in command.get_params(ctx):
        if isinstance(param, click.Option):
            for name in (*param.opts, *param.secondary_opts):
                names[name] = param
    return names


def check_command(text: str) -> tuple[str, list[str]]:
    """(the subcommand path, problems) for one command line; a placeholder subcommand gives
    ("skipped", [])."""
    tokens = _tokens(text)
    assert tokens and tokens[0].endswith("cactus-edge"), text
    command: click.Command = main
    ctx = click.Context(main, info_name="cactus-edge", **main.context_settings)
    path, problems = ["cactus-edge"], []
    pending_value = False
    for token in tokens[1:]:
        if pending_value:
            pending_value = False
            continue
        if token.startswith("-") and token != "-" and not re.fullmatch(r"-\d+(\.\d+)?", token):
            name = token.split("=", 1)[0]
            option = _options(command, ctx).get(name)
            if option is None:
                problems.append(f"`{' '.join(path)}` has no option {name}")
                continue
            pending_value = "=" not in token and not option.is_flag and not option.count
            continue
        if isinstance(command, click.Group):
            if PLACEHOLDER.search(token):
                return "skipped", []
            sub = command.commands.get(token)
            if sub is None:
                problems.append(f"`{' '.join(path)}` has no subcommand {token!r}")
                return " ".join(path), problems
            ctx = click.Context(sub, info_name=token, parent=ctx, **sub.context_settings)
            command, path = sub, [*path, token]
        # else: a positional argument of a leaf command (a prompt, a name, a path)
    return " ".join(path), problems


def test_the_docs_name_commands():
    """The extractor finds the commands the docs are full of (it would pass vacuously if not)."""
    assert len(ALL_MENTIONS) >= 30, [m.text for m in ALL_MENTIONS]
    subcommands = {check_command(m.text)[0] for m in ALL_MENTIONS}
    for expected in ("cactus-edge generate", "cactus-edge bench", "cactus-edge models fetch"):
        assert expected in subcommands


@pytest.mark.parametrize("mention", ALL_MENTIONS, ids=[m.where for m in ALL_MENTIONS])
def test_documented_command_exists(mention: Mention):
    _, problems = check_command(mention.text)
    assert not problems, f"{mention.where}: {mention.text}\n" + "\n".join(problems)


def test_the_checker_catches_what_it_should():
    assert check_command('cactus-edge generate "hi" --n-draft auto --json') == ("cactus-edge generate", [])
    assert check_command("cactus-edge models fetch default --revision main")[1] == []
    assert check_command("cactus-edge generate - --raw --stop x < p.txt")[1] == []
    assert check_command("cactus-edge eval humaneval -h")[1] == []
    assert check_command("cactus-edge generate hi --no-such-flag")[1]
    assert check_command("cactus-edge chat --stop x")[1]  # a flag of generate, not of chat
    assert check_command("cactus-edge models frobnicate")[1]
    assert check_command("cactus-edge … --whatever") == ("skipped", [])
    assert check_command("cactus-edge <command> --whatever") == ("skipped", [])
    text = 'see `cactus-edge bench\n--profile` and `cactus-edge` and pip install "cactus-edge[hf]"'
    assert [command for _, command in _commands_in(" ".join(text.split()))] == [
        "cactus-edge bench --profile",
        "cactus-edge",
    ]


# --- links -------------------------------------------------------------------------------------


def _without_code(text: str) -> str:
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return INLINE_CODE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file: lower case, punctuation dropped, spaces to
    hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    result = set()
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


LINKS = [
    (path, _line_of(text, match.start()), match.group(1))
    for path in DOCS
    for text in [_without_code(path.read_text(encoding="utf-8"))]
    for match in LINK.finditer(text)
    if not re.match(r"[a-z][a-z0-9+.-]*:", match.group(1))  # http:, https:, mailto:
]


def test_the_docs_link_to_each_other():
    assert any(target.startswith("docs/") for path, _, target in LINKS if path.name == "README.md")


@pytest.mark.parametrize(
    "path, line, target", LINKS, ids=[f"{p.relative_to(ROOT)}:{n}:{t}" for p, n, t in LINKS]
)
def test_relative_link_resolves(path: Path, line: int, target: str):
    file_part, _, fragment = target.partition("#")
    destination = (path.parent / file_part).resolve() if file_part else path
    assert destination.exists(), f"{path.relative_to(ROOT)}:{line}: {target} does not exist"
    if fragment and destination.suffix == ".md":
        assert fragment in anchors(destination), (
            f"{path.relative_to(ROOT)}:{line}: no heading #{fragment} in {destination.name}"
        )


# --- modules, repository files and server routes ------------------------------------------------
#
# Every doc (README.md, docs/*.md, results/**/README.md) may name only what exists:
# - Python names in code spans and fenced blocks: `cactus_edge.x.y` (and `python -m cactus_edge.x`),
#   `import cactus_edge.x`, `from cactus_edge.x import a, b`: each module must be importable and
#   each name after it an attribute (a class, a function) or a submodule;
# - repository paths in inline code (and `cactus_edge/…` paths in fenced blocks too): a path whose
#   first component is one of the repository's top-level folders (`scripts/soak.py`, `tests/…`,
#   `docs/…`, `results/…`, `cactus_edge/…`) must exist from the repository root; a glob
#   (`cactus_edge/*.py`) must match something. A user's own paths (`my-model.gguf`, `~/.cache/…`,
#   `.venv/bin/python`, `bench-out/…`, URLs) are not repository paths: their first component is
#   not a top-level folder, or is hidden or git-ignored. Placeholders (`<script>`, `{n}`, `…`) are
#   skipped, and so is a path the doc places in git history rather than the tree: `REV:path`
#   (`git show 9640486:scripts/NAME.py`), or a missing path whose paragraph (table row) names the
#   commit it is at ("at commit 4fb0322", "in git at 9640486", "git worktree add … 9640486");
# - HTTP routes written with their method (`GET /v1/models`, `POST /v1/chat/completions`,
#   `HEAD /health`) anywhere in a doc: the server app must route that path, and answer that
#   method (OPTIONS: any routed path, for CORS preflights). The routes are read from
#   `cactus_edge.server.app.ServerApp` built with every on/off setting on (`--metrics`, `--debug`,
#   and any later one), not from a list kept here.

CHECKED_DOCS = [*DOCS, *sorted((ROOT / "results").glob("**/README.md"))]

PYTHON_NAME = re.compile(r"(?<![\w./-])cactus_edge(?:\.[A-Za-z_]\w*)+(?![\w/-])")
FROM_IMPORT = re.compile(
    r"(?<![\w.])from\s+(cactus_edge(?:\.[A-Za-z_]\w*)*)\s+import\s+(\([^)]*\)|[\w \t,]+(?:\\\n[\w \t,]*)*)"
)
PATH_TOKEN = re.compile(r"[^\s`'\"()\[\],;=|]+")
PLACEHOLDER_PATH = re.compile(r"[<>{}…]|\.\.\.")
COMMIT_REFERENCE = re.compile(r"\b(?:commits?|at|git show|worktree add \S+)\s+[0-9a-f]{7,40}\b")
HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
ROUTE = re.compile(rf"(?<![\w-])({'|'.join(HTTP_METHODS)})[ \t]+(/[^\s`'\"()<>,;|]*)")


def _repository_folders() -> set[str]:
    """The top-level folders that are the repository's own: not hidden, not git-ignored."""
    ignore = ROOT / ".gitignore"
    patterns = [
        line.strip().rstrip("/")
        for line in (ignore.read_text(encoding="utf-8").splitlines() if ignore.exists() else [])
        if line.strip() and not line.startswith(("#", "!"))
    ]
    return {
        entry.name
        for entry in ROOT.iterdir()
        if entry.is_dir()
        and not entry.name.startswith(".")
        and not any(fnmatch.fnmatch(entry.name, pattern) for pattern in patterns)
    }


REPOSITORY_FOLDERS = _repository_folders()


@dataclass(frozen=True)
class Name:
    """One module, repository path or server route a doc names."""

    path: Path
    line: int
    kind: str  # "python", "import", "path" or "route"
    text: str
    in_history: bool = False  # its paragraph places it at a commit

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _paragraph_at(text: str, offset: int) -> str:
    """The paragraph around ``offset`` (a table row alone when the line is one)."""
    line_start = text.rfind("\n", 0, offset) + 1
    line_end = text.find("\n", offset)
    line = text[line_start : None if line_end < 0 else line_end]
    if line.lstrip().startswith("|"):
        return line
    start = max(text.rfind("\n\n", 0, offset), 0)
    end = text.find("\n\n", offset)
    return text[start : None if end < 0 else end]


def _repository_path(token: str) -> str | None:
    """``token`` as a path from the repository root, or None when it is not a repository path."""
    token = token.rstrip(".:")
    token = re.sub(r"^\./", "", token)
    token = re.sub(r"(\.\w+):[\w.]+$", r"\1", token)  # module.py:function, file.py:line
    first, slash, _ = token.partition("/")
    if not slash or first not in REPOSITORY_FOLDERS or PLACEHOLDER_PATH.search(token):
        return None
    return token


def named_things(text: str) -> list[tuple[int, str, str, bool]]:
    """(offset, kind, text, in history) of every module, repository path and route in a Markdown
    text (see the comment above for what counts)."""
    found: list[tuple[int, str, str, bool]] = []

    def add_paths(start: int, code: str, only_package: bool) -> None:
        for token in PATH_TOKEN.finditer(code):
            path = _repository_path(token.group(0))
            if path is None or (only_package and not path.startswith("cactus_edge/")):
                continue
            offset = start + token.start()
            found.append((offset, "path", path, bool(COMMIT_REFERENCE.search(_paragraph_at(text, offset)))))

    def add_python(start: int, code: str) -> None:
        imported_from = set()  # where a `from` names its module: checked with the import
        for match in FROM_IMPORT.finditer(code):
            imported_from.add(match.start(1))
            names = re.sub(r"[()\\]", " ", match.group(2))
            for item in names.split(","):
                words = item.split()
                if words:
                    found.append((start + match.start(), "import", f"{match.group(1)}:{words[0]}", False))
        for match in PYTHON_NAME.finditer(code):
            if match.start() not in imported_from:
                found.append((start + match.start(), "python", match.group(0), False))

    prose, last = [], 0
    for fence in FENCE.finditer(text):
        prose.append((last, text[last : fence.start()]))
        last = fence.end()
        add_python(fence.start(3), fence.group(3))
        add_paths(fence.start(3), fence.group(3), only_package=True)
    prose.append((last, text[last:]))
    for start, chunk in prose:
        for span in INLINE_CODE.finditer(chunk):
            add_python(start + span.start(2), span.group(2))
            add_paths(start + span.start(2), span.group(2), only_package=False)
    for match in ROUTE.finditer(text):
        route = match.group(2).split("?", 1)[0].rstrip(".:")
        found.append((match.start(), "route", f"{match.group(1)} {route}", False))
    return found


ALL_NAMES = [
    Name(path, _line_of(text, offset), kind, name, in_history)
    for path in CHECKED_DOCS
    for text in [path.read_text(encoding="utf-8")]
    for offset, kind, name, in_history in named_things(text)
]


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent that is not a package
        return False


def python_name_problem(dotted: str) -> str | None:
    """Why ``cactus_edge.a.b.C.d`` names nothing (None when it does): the longest importable
    module prefix, then attributes."""
    parts = dotted.split(".")
    n_module = 1
    while n_module < len(parts) and _is_module(".".join(parts[: n_module + 1])):
        n_module += 1
    module = ".".join(parts[:n_module])
    value = importlib.import_module(module)
    for depth, attribute in enumerate(parts[n_module:], start=n_module):
        if not hasattr(value, attribute):
            return f"{'.'.join(parts[:depth])} has no {attribute!r} (no such module or attribute)"
        value = getattr(value, attribute)
    return None


def import_problem(statement: str) -> str | None:
    """Why `from MODULE import NAME` (written "MODULE:NAME") fails, or None."""
    module, name = statement.split(":")
    if not _is_module(module):
        return f"no module {module}"
    if hasattr(importlib.import_module(module), name) or _is_module(f"{module}.{name}"):
        return None
    return f"{module} has no {name!r}"


def path_problem(path: str) -> str | None:
    if any(char in path for char in "*?["):
        return None if any(ROOT.glob(path)) else f"nothing matches {path}"
    return None if (ROOT / path).exists() else f"{path} does not exist in the repository"


@functools.cache
def _server_app():
    """The app with every on/off setting on, so that routes behind a flag are served too."""
    from cactus_edge.server.app import ServerApp
    from cactus_edge.server.settings import ServerSettings

    switches = {field.name: True for field in dataclasses.fields(ServerSettings) if field.default is False}
    return ServerApp(settings=ServerSettings(**switches))


def route_problem(mention: str) -> str | None:
    """Why the app would answer `METHOD /path` with 404 or 405 (the lookup its handler uses), or None."""
    from cactus_edge.server.app import _methods

    method, path = mention.split(" ", 1)
    route = _server_app()._route(path)
    if route is None:
        return f"the server has no route {path}"
    allowed = _methods(route[0]).split(", ")
    if method != "OPTIONS" and method not in allowed:
        return f"{path} takes {', '.join(allowed)}, not {method}"
    return None


def name_problem(name: Name) -> str | None:
    if name.kind == "python":
        return python_name_problem(name.text)
    if name.kind == "import":
        return import_problem(name.text)
    if name.kind == "route":
        return route_problem(name.text)
    problem = path_problem(name.text)
    return None if name.in_history else problem


def test_the_docs_name_modules_paths_and_routes():
    """The extractor finds what the docs are full of (it would pass vacuously if not)."""
    kinds = {kind: [n.text for n in ALL_NAMES if n.kind == kind] for kind in ("python", "path", "route")}
    assert len(kinds["path"]) >= 30, kinds["path"]
    assert "GET /v1/models" in kinds["route"] and "POST /v1/chat/completions" in kinds["route"]
    assert any(text.startswith("cactus_edge.") for text in kinds["python"])
    assert any(n.kind == "import" for n in ALL_NAMES)
    assert {"cactus_edge", "docs", "results", "scripts", "tests"} <= REPOSITORY_FOLDERS


@pytest.mark.parametrize("name", ALL_NAMES, ids=[f"{n.where}:{n.text}" for n in ALL_NAMES])
def test_named_module_path_or_route_exists(name: Name):
    problem = name_problem(name)
    assert problem is None, f"{name.where}: `{name.text}`: {problem}"


def test_the_name_checker_catches_what_it_should():
    def problems(markdown: str) -> list[str]:
        return [
            f"{text}: {problem}"
            for _, kind, text, in_history in named_things(markdown)
            if (problem := name_problem(Name(ROOT / "x.md", 1, kind, text, in_history))) is not None
        ]

    caught = [
        "see `cactus_edge/quality.py`",
        "`scripts/no_such_script.py --flag`",
        "`python -m cactus_edge.evaluate`",
        "```python\nfrom cactus_edge.bench import make_variants\n```",
        '```bash\npython -c "from cactus_edge.cli.bench import make_variants, no_such_name"\n```',
        "```python\nimport cactus_edge.no_such_module\n```",
        "`cactus_edge.server.ServerSettings.no_such_field`",
        "```bash\n.venv/bin/python cactus_edge/no_such_module.py\n```",
        "`docs/no-such-page.md`",
        "`tests/no_such_dir/*.py`",
        "`GET /v1/no-such-route`",
        "`DELETE /health`",
        "a probe: POST /v1/models",
    ]
    for markdown in caught:
        assert len(problems(markdown)) == 1, (markdown, problems(markdown))
    fine = [
        "`--target my-model.gguf`, `~/.cache/cactus-edge/costs/`, `.venv/bin/python scripts/soak.py`",
        "`bench-out/humaneval.jsonl`, `https://example.com/docs/x.md`, `hf:Qwen/Qwen3-8B-GGUF/x.gguf`",
        "`./scripts/setup`, `cactus_edge/*.py`, `cactus_edge/cli/main.py:main`, `results/<folder>/`",
        "`git show 9640486:scripts/NAME.py`, `cactus_edge/llama/`, `models/registry.toml`",
        "`scripts/gone.py` (in git at 9640486, not in the tree)",
        "| `x/` | `scripts/gone.py --flag` at commit 4fb0322 |",
        "```python\nfrom cactus_edge import Engine, GenerationConfig\nfrom cactus_edge.cli import bench\n```",
        "`python -m cactus_edge.llama.remote`, `cactus_edge.server.ServerSettings`",
        "`GET /v1/models`, `HEAD /health`, `POST /v1/chat/completions`, `GET /metrics`, "
        "`GET /debug/caches`, `GET /v1/models/cactus-edge`, `OPTIONS /v1/completions`",
    ]
    for markdown in fine:
        assert problems(markdown) == [], (markdown, problems(markdown))
    # a missing path is excused by a commit in its own table row, not by one in another row
    table = "| a | `scripts/gone.py` |\n| b | at commit 4fb0322 |"
    assert problems(table) == ["scripts/gone.py: scripts/gone.py does not exist in the repository"]
