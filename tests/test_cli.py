"""The command line: exact output shapes, one-line errors and exit codes."""

import json

import pytest
from click.testing import CliRunner

from cactus_edge.cli.main import main
from cactus_edge.engine.stats import PROFILE_PARTS


@pytest.fixture
def runner():
    return CliRunner()


def pair_args(tiny_pair):
    return ["--draft", str(tiny_pair[0]), "--target", str(tiny_pair[1]), "--n-ctx", "256"]


def test_generate_streams_text_and_summarises_on_stderr(runner, tiny_pair):
    args = ["generate", "the water is", *pair_args(tiny_pair), "--raw", "--temperature", "0"]
    result = runner.invoke(main, [*args, "--max-tokens", "12", "--method", "sps"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()
    assert result.stderr.startswith("[models] draft tiny-draft.gguf -> target tiny-target.gguf · CPU\n")
    assert result.stderr.splitlines()[1].startswith("[sps] 12 tokens, ")
    assert "tokens/verifier call" in result.stderr and "finish: length" in result.stderr
    # That greedy speculation emits plain greedy's text is tested in test_engine, with a guard for
    # near-ties that llama.cpp's batch-shape rounding can flip; `auto` here picks shapes by timing.


def test_generate_json_schema(runner, tiny_pair):
    # A fixed draft length: under `auto` the lengths follow measured timings, so the text (and
    # whether an end-of-text token comes within 9 tokens) would change from run to run.
    args = ["generate", "hello", *pair_args(tiny_pair), "--json", "--max-tokens", "9", "--n-draft", "3"]
    args += ["--seed", "0"]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for key in (
        "text",
        "method",
        "finish_reason",
        "n_tokens",
        "n_verifier_calls",
        "acceptance_length",
        "tokens_per_second",
        "draft_ms",
        "verify_ms",
        "overhead_ms",
        "kl_mean",
    ):
        assert key in data
    # An end-of-text token within 9 is possible on some CPU (rounding moves samples): then "stop".
    assert data["method"] == "cactus" and data["finish_reason"] in ("length", "stop")
    assert (data["n_tokens"] == 9) == (data["finish_reason"] == "length") and data["n_tokens"] <= 9
    assert result.stderr == ""


def test_prompt_from_stdin(runner, tiny_pair):
    args = ["generate", "-", *pair_args(tiny_pair), "--raw", "--temperature", "0", "--max-tokens", "5"]
    args += ["--n-draft", "3"]  # the same batch shapes in both runs (auto would follow timings)
    from_stdin = runner.invoke(main, args, input="the code is")
    inline = runner.invoke(main, [*args[:1], "the code is", *args[2:]])
    assert from_stdin.exit_code == 0 and from_stdin.stdout == inline.stdout


@pytest.mark.parametrize(
    ("extra", "code", "message"),
    [
        (["--top-p", "1.5"], 2, "error: top_p must be in (0, 1]"),
        (["--delta", "-1"], 2, "error: delta must be a finite number >= 0"),
        (["--n-ctx", "99999"], 4, "error: n_ctx 99999 exceeds"),
    ],
)
def test_bad_settings_are_one_line_errors(runner, tiny_pair, extra, code, message):
    args = ["generate", "hi", "--draft", str(tiny_pair[0]), "--target", str(tiny_pair[1]), *extra]
    result = runner.invoke(main, args)
    assert result.exit_code == code
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("command", "extra", "flag"),
    [
        (["generate", "hi"], ["--threads", "0"], "--threads"),
        (["generate", "hi"], ["--n-ctx", "-1"], "--n-ctx"),
        (["generate", "hi"], ["--max-tokens", "0"], "--max-tokens"),
        (["generate", "hi"], ["--max-tokens", "-1"], "--max-tokens"),
        (["generate", "hi"], ["--seed", "-1"], "--seed"),
        (["generate", "hi"], ["--top-k", "-1"], "--top-k"),
        (["generate", "hi"], ["--n-gpu-layers", "-2"], "--n-gpu-layers"),
        (["chat"], ["--max-tokens", "0"], "--max-tokens"),
        (["serve"], ["--threads", "0"], "--threads"),
        (["bench"], ["--limit", "0"], "--limit"),
        (["bench"], ["--per-category", "0"], "--per-category"),
        (["eval", "humaneval"], ["--max-tokens", "0"], "--max-tokens"),
    ],
)
def test_integer_flags_out_of_range_are_refused_before_any_model_loads(
    runner, tiny_pair, monkeypatch, command, extra, flag
):
    from cactus_edge.engine import engine

    monkeypatch.setattr(engine.Engine, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    result = runner.invoke(main, [*command, *pair_args(tiny_pair), *extra])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{flag}'" in result.stderr, result.stderr


@pytest.mark.parametrize("extra", [["--json"], ["--profile"], ["--json", "--profile"]])
def test_compare_refuses_the_flags_it_would_ignore(runner, tiny_pair, monkeypatch, extra):
    from cactus_edge.engine import engine

    monkeypatch.setattr(engine.Engine, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    result = runner.invoke(main, ["generate", "hi", *pair_args(tiny_pair), "--compare", *extra])
    assert result.exit_code == 2
    assert "--compare prints its own two summaries" in result.stderr


def test_missing_and_mismatched_models(runner, tmp_path, tiny_pair, tiny_mismatch):
    result = runner.invoke(
        main, ["generate", "hi", "--draft", str(tmp_path / "x.gguf"), "--target", str(tiny_pair[1])]
    )
    assert result.exit_code == 2 and result.stderr.startswith("error: model file not found")
    result = runner.invoke(
        main,
        ["generate", "hi", "--draft", str(tiny_pair[0]), "--target", str(tiny_mismatch), "--n-ctx", "128"],
    )
    assert result.exit_code == 3 and "differs: draft" in result.stderr
    long_prompt = "hello " * 400
    result = runner.invoke(main, ["generate", long_prompt, *pair_args(tiny_pair), "--raw"])
    assert result.exit_code == 4 and result.stderr.startswith("error: the prompt has")


def test_models_inspect_prints_metadata(runner, tiny_pair):
    result = runner.invoke(main, ["models", "inspect", str(tiny_pair[0])])
    assert result.exit_code == 0
    lines = dict(line.split(None, 1) if " " in line else (line, "") for line in result.stdout.splitlines())
    assert lines["architecture"].strip() == "llama"
    assert "tokens" in result.stdout and "chat template   yes" in result.stdout
    junk = tiny_pair[0].parent / "junk.gguf"
    junk.write_text("nope")
    bad = runner.invoke(main, ["models", "inspect", str(junk)])
    assert bad.exit_code == 3 and bad.stderr == f"error: {junk}: not a GGUF file (bad magic bytes)\n"


def test_unknown_model_name(runner):
    result = runner.invoke(main, ["models", "fetch", "qwen-9000"])
    assert result.exit_code == 2 and result.stderr.startswith("error: unknown model or pair 'qwen-9000'")


def test_models_list_shows_pairs(runner, monkeypatch, tmp_path):
    monkeypatch.setenv("CACTUS_EDGE_MODELS", str(tmp_path))
    result = runner.invoke(main, ["models", "list"])
    assert result.exit_code == 0
    assert f"models directory: {tmp_path}" in result.stdout
    assert "default            qwen2.5-coder-0.5b-instruct -> qwen2.5-coder-1.5b-instruct" in result.stdout


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["bench"], ["eval", "humaneval"]])
def test_pair_and_explicit_models_are_refused_before_loading(runner, tiny_pair, command):
    result = runner.invoke(main, [*command, "--pair", "default", "--draft", str(tiny_pair[0])])
    assert result.exit_code == 2
    assert "use --pair, or --draft/--target, not both" in result.output


def test_an_internal_error_is_not_reported_as_bad_input(runner, tiny_pair, monkeypatch):
    from cactus_edge.engine.engine import Engine

    def broken(*args, **kwargs):
        raise TypeError("unsupported operand")

    monkeypatch.setattr(Engine, "stream", broken)
    result = runner.invoke(main, ["generate", "hi", *pair_args(tiny_pair)])
    assert result.exit_code == 1
    assert result.stderr.startswith("internal error: TypeError: unsupported operand")
    assert "bad input" not in result.stderr and result.stderr.count("\n") == 1


def test_summary_line_prints_no_negative_zero_and_no_kl_for_lossless_runs():
    from cactus_edge.engine.stats import GenerationStats, StepStats

    lossy = GenerationStats(method="cactus", lossy=True)
    lossy.record(StepStats(4, 4, 1.0, 1.0, 2.0, kl=-1e-18, n_decided=4))  # rounding below zero
    assert "KL 0.0000" in lossy.summary_line() and "-0.0000" not in lossy.summary_line()
    exact = GenerationStats(method="sps", lossy=False)
    exact.record(StepStats(4, 2, 1.0, 1.0, 2.0, kl=0.0, n_decided=3))
    assert "KL" not in exact.summary_line()
    plain = GenerationStats(method="none")
    plain.record(StepStats(0, 0, 0.0, 1.0, 1.0, drafter="none"))
    assert "KL" not in plain.summary_line() and "draft lengths" not in plain.summary_line()


def test_generate_prints_no_kl_for_a_lossless_method(runner, tiny_pair):
    result = runner.invoke(
        main, ["generate", "hi", *pair_args(tiny_pair), "--method", "sps", "--max-tokens", "8"]
    )
    assert result.exit_code == 0
    summary = result.stderr.strip().splitlines()[-1]
    assert summary.startswith("[sps] ") and "KL" not in summary


def test_generate_profile_accounts_for_every_millisecond_of_the_steps(runner, tiny_pair):
    args = ["generate", "the water is", *pair_args(tiny_pair), "--raw", "--max-tokens", "24"]
    result = runner.invoke(main, [*args, "--method", "cactus", "--n-draft", "3", "--profile", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    profile = data["profile_ms"]
    assert set(profile) == set(PROFILE_PARTS)
    # The parts are laps of one timer: together they are the steps' time, decodes included.
    assert sum(profile.values()) == pytest.approx(data["decode_ms"], rel=0.02, abs=0.5)
    assert profile["verify decode"] == pytest.approx(data["verify_ms"])
    assert profile["draft decode"] == pytest.approx(data["draft_ms"])
    assert min(profile["target processing"], profile["draft processing"], profile["kl"]) > 0
    table = result.stderr.splitlines()
    assert any(line.startswith("| target processing | ") for line in table)
    assert any(line.startswith("| **host total** | ") for line in table)


# --- constrained generation: --json-schema, --grammar, --regex ----------------------------------

# The tiny vocabulary spells any text (byte-fallback tokens): an enum and a boolean bound the reply
# to a few short objects, so even the random tiny model must finish one within the token budget.
COLOR_SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}
WORDS_REGEX = r"[a-z]{3,8}( [a-z]{3,8}){0,3}"
LITERAL_LARK = 'start: "the number of people is " /[a-z ]{1,10}/'


def constrained_json_run(runner, tiny_pair, *constraint) -> dict:
    """`generate --json` under a constraint on the tiny pair, fixed draft length and seed; its JSON."""
    args = ["generate", "pick one", *pair_args(tiny_pair), "--json", "--max-tokens", "128"]
    args += ["--method", "sps", "--n-draft", "3", "--seed", "0", *constraint]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("source", ["inline", "file"])
def test_generate_json_schema_replies_with_an_object_the_schema_accepts(runner, tiny_pair, tmp_path, source):
    value = json.dumps(COLOR_SCHEMA)
    if source == "file":
        (tmp_path / "schema.json").write_text(value)
        value = str(tmp_path / "schema.json")
    data = constrained_json_run(runner, tiny_pair, "--json-schema", value)
    assert data["finish_reason"] == "stop"
    reply = json.loads(data["text"])
    assert set(reply) == {"color", "ok"}
    assert reply["color"] in COLOR_SCHEMA["properties"]["color"]["enum"] and isinstance(reply["ok"], bool)
    # The keys are the grammar's to write: some are proposed as forced drafts, all accepted.
    assert 0 < data["n_forced"] <= data["n_accepted"]


def test_generate_regex_replies_with_a_full_match(runner, tiny_pair):
    import re

    data = constrained_json_run(runner, tiny_pair, "--regex", WORDS_REGEX)
    assert data["finish_reason"] == "stop" and re.fullmatch(WORDS_REGEX, data["text"]), data["text"]


def test_generate_grammar_file_and_the_forced_count_in_the_summary(runner, tiny_pair, tmp_path):
    import re

    (tmp_path / "literal.lark").write_text(LITERAL_LARK)
    args = ["generate", "pick one", *pair_args(tiny_pair), "--max-tokens", "40", "--method", "sps"]
    result = runner.invoke(
        main, [*args, "--n-draft", "3", "--seed", "0", "--grammar", str(tmp_path / "literal.lark")]
    )
    assert result.exit_code == 0, result.output
    text = result.stdout.removesuffix("\n")
    assert re.fullmatch(r"the number of people is [a-z ]{1,10}", text), text
    summary = result.stderr.splitlines()[-1]
    forced = re.search(r", (\d+) forced by the grammar, finish: ", summary)
    assert forced and int(forced.group(1)) > 0, summary  # the literal is forced after its first token


def test_the_summary_counts_forced_tokens_only_under_a_constraint():
    from cactus_edge.engine.stats import GenerationStats, StepStats

    stats = GenerationStats(method="sps")
    stats.record(StepStats(4, 3, 1.0, 1.0, 2.0, n_decided=4, n_forced=2))
    assert "forced" not in stats.summary_line()
    assert ", 2 forced by the grammar, finish: " in stats.summary_line(constrained=True)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--json-schema", '{"type": "object",', "json_schema is not valid JSON"),
        ("--json-schema", '{"type": "objectx"}', "invalid json_schema"),
        ("--json-schema", "missing.json", "no such file 'missing.json'"),
        ("--json-schema", "bad.json", "bad.json: json_schema is not valid JSON"),
        ("--json-schema", "list.json", "list.json: json_schema must be a JSON object"),
        ("--grammar", "bad.lark", "invalid grammar"),
        ("--grammar", "missing.lark", "does not exist"),
        ("--regex", "(unclosed", "invalid regex"),
    ],
)
def test_a_bad_constraint_is_refused_naming_its_option(
    runner, tiny_pair, tmp_path, monkeypatch, option, value, message
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.json").write_text('{"type": ')
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "bad.lark").write_text("start: undefined_rule")
    result = runner.invoke(main, ["generate", "hi", *pair_args(tiny_pair), option, value])
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and f"'{option}'" in errors[0] and message in errors[0], result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    "constraints",
    [["--json-schema", json.dumps(COLOR_SCHEMA), "--regex", "a+"], ["--regex", "a+", "--grammar", "g.lark"]],
)
def test_two_constraints_are_refused(runner, tiny_pair, tmp_path, monkeypatch, constraints):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "g.lark").write_text(LITERAL_LARK)
    result = runner.invoke(main, ["generate", "hi", *pair_args(tiny_pair), *constraints])
    assert result.exit_code == 2
    error = result.stderr.splitlines()[-1]
    assert error.startswith("Error: give at most one of --json-schema, --grammar and --regex, not ")
    assert all(option in error for option in constraints[::2])


def test_the_faster_pair_hint_is_said_once_per_models_folder(tmp_path, monkeypatch):
    from cactus_edge.cli.options import HINT_MARKER, ModelChoice

    default = ModelChoice(None, None, None, n_ctx=512, threads=None, n_gpu_layers=0, verbose=False)
    monkeypatch.setenv("CACTUS_EDGE_MODELS", str(tmp_path / "models"))
    assert "models quantize default --type q4_0" in default.faster_pair_hint()
    assert (tmp_path / "models" / HINT_MARKER).exists()
    assert default.faster_pair_hint() == ""  # said once
    monkeypatch.setenv("CACTUS_EDGE_MODELS", str(tmp_path / "other"))
    assert default.faster_pair_hint() != ""  # another folder: once there too
    own = ModelChoice(None, None, "mine.gguf", n_ctx=512, threads=None, n_gpu_layers=0, verbose=False)
    assert own.faster_pair_hint() == ""  # only the default pair has a faster copy to make


def test_a_target_alone_drafts_by_prompt_lookup(runner, tiny_pair):
    """A user's own model with no draft runs: the default drafter falls back to prompt lookup (no
    draft model loaded), and says so; --drafter model is refused; --method none stays plain."""
    target = ["--target", str(tiny_pair[1]), "--n-ctx", "256", "--threads", "1"]
    prompt = "the water is the water is the water is"
    result = runner.invoke(main, ["generate", prompt, *target, "--raw", "--max-tokens", "16", "--json"])
    assert result.exit_code == 0, result.output
    assert "[models] no draft model: drafting by prompt lookup" in result.stderr
    stats = json.loads(result.stdout)
    assert stats["method"] == "cactus" and stats["n_tokens"] >= 1
    shown = runner.invoke(main, ["generate", prompt, *target, "--raw", "--max-tokens", "4"])
    assert "[models] target tiny-target.gguf, no draft model · CPU" in shown.stderr
    refused = runner.invoke(main, ["generate", "hi", *target, "--drafter", "model"])
    assert refused.exit_code == 2 and "--drafter model needs a draft model" in refused.output
    plain = runner.invoke(main, ["generate", "hi", *target, "--method", "none", "--max-tokens", "2"])
    assert plain.exit_code == 0 and "drafting by prompt lookup" not in plain.stderr


def test_a_target_alone_gives_chat_and_serve_a_lookup_config(tiny_pair):
    from cactus_edge.cli.options import ModelChoice
    from cactus_edge.engine.config import GenerationConfig

    alone = ModelChoice(None, None, str(tiny_pair[1]), n_ctx=256, threads=1, n_gpu_layers=0, verbose=False)
    assert not alone.has_draft() and alone.fit(GenerationConfig()).drafter == "lookup"
    with alone.load("cactus", "lookup") as engine:
        assert engine.draft is None
        config = alone.fit(GenerationConfig(max_tokens=4, seed=0))
        assert engine.generate("the water is", config).stats.n_tokens >= 1
    both = ModelChoice(None, str(tiny_pair[0]), str(tiny_pair[1]), 256, 1, 0, False)
    assert both.has_draft() and both.fit(GenerationConfig()).drafter == GenerationConfig().drafter


def test_models_list_gives_each_models_size_on_disk_and_presence(runner, monkeypatch, tmp_path):
    monkeypatch.setenv("CACTUS_EDGE_MODELS", str(tmp_path))
    (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"x" * 3_000_000)  # "fetched", 3 MB
    out = runner.invoke(main, ["models", "list"]).stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  ")}
    row = rows["smollm2-135m-instruct"]
    assert row[1] == "fetched" and row[4:6] == ["3", "MB"]  # its size on disk, not the registry's
    draft = rows["qwen2.5-coder-0.5b-instruct"]
    assert draft[1] == "-" and draft[4:6] == ["491", "MB"]  # to download
    assert "3 MB of registered models on disk" in out
