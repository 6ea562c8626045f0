"""What the scripts of this folder share (imported from beside them: they run as
`.venv/bin/python results/structured-ceiling-zen4/<script>`, which puts this folder on the path)."""

import json

from cactus_edge import GenerationConfig
from cactus_edge.bench import load_structured


def log_decodes(model) -> list[tuple[int, int, float]]:
    """Wrap ``model.decode`` so every call appends (tokens in the batch, logits rows, ms inside
    llama_decode) to the returned list."""
    decodes: list[tuple[int, int, float]] = []
    decode = model.decode

    def logged(tokens, output_rows=None, **kwargs):
        result = decode(tokens, output_rows=output_rows, **kwargs)
        n_rows = len(list(output_rows)) if output_rows is not None else len(tokens)
        decodes.append((len(tokens), n_rows, model.last_decode_ms))
        return result

    model.decode = logged
    return decodes


def k4_replies(engine, constrained: bool):
    """The stats of each of the first 3 structured prompts at a fixed k = 4 (the draft model,
    160 tokens, seed 0), from empty caches, constrained to its schema or not."""
    for entry in load_structured()[:3]:
        settings = dict(n_draft=4, drafter="model", max_tokens=160, seed=0)
        if constrained:
            settings["json_schema"] = json.dumps(entry["json_schema"])
        engine.clear_caches()
        yield engine.chat([{"role": "user", "content": entry["prompt"]}], GenerationConfig(**settings)).stats
