"""How the grammar's forced tokens fall in the structured replies: the default target's greedy
reply to each bundled structured prompt, walked token by token; a token is forced where the
grammar forces it (its fast-forward tokens, or the one token its mask allows), as the engine takes
them. Prints the forced share and the lengths of the forced runs between free tokens."""

import collections
import json

from cactus_edge import Engine, GenerationConfig
from cactus_edge.bench import load_structured
from cactus_edge.constraints import LogitShaper
from cactus_edge.grammar import CompiledGrammars, grammar_source, parse_json_schema

engine = Engine.from_pair("default", n_ctx=4096)
target = engine.target
grammars = CompiledGrammars(target.grammar_tokenizer, target.vocab_size)
runs: collections.Counter[int] = collections.Counter()
n_tokens = n_forced = 0
for entry in load_structured():
    source = grammar_source(parse_json_schema(entry["json_schema"]), None, None)
    config = GenerationConfig(max_tokens=256, temperature=0, json_schema=json.dumps(entry["json_schema"]))
    reply = engine.chat([{"role": "user", "content": entry["prompt"]}], config)
    tokens = target.tokenize(reply.text, add_special=False)
    shaper = LogitShaper([], new_matcher=lambda source=source: grammars.matcher(source))
    index = run = 0
    while index < len(tokens):
        forced = shaper.forced()
        n_taken = 0
        while (
            n_taken < len(forced)
            and index + n_taken < len(tokens)
            and tokens[index + n_taken] == forced[n_taken]
        ):
            n_taken += 1
        for token in tokens[index : index + (n_taken or 1)]:
            shaper.advance(token)
        if n_taken:
            run += n_taken
            n_forced += n_taken
        else:
            if run:
                runs[run] += 1
            run = 0
        index += n_taken or 1
        n_tokens += n_taken or 1
    if run:
        runs[run] += 1
share = f"{n_forced / n_tokens:.0%}"
print(f"tokens {n_tokens}, forced {n_forced} ({share}); forced runs by length: {dict(sorted(runs.items()))}")
