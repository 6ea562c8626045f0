"""The docs name only commands and flags that exist, and link only to files that exist.

Every `cactus-edge …` command line in README.md and docs/*.md (in fenced code blocks and in inline
code) is checked against the click command tree of `cactus_edge.cli.main.main`, without running it: each
subcommand (and sub-subcommand, such as `models fetch`) must exist, and each `--flag` must be an
option of the command it is given to. Commands whose subcommand is a placeholder (`…`, `<…>`) are
skipped explicitly. Relative links and images must point to existing files, and a `#fragment` to
a heading of the page it names.
"""

from __future__ import annotations

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
