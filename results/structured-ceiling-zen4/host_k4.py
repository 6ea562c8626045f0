"""Host work per step at a fixed k = 4 (the draft model), the first 3 structured prompts, 160
tokens, with and without their schemas; the --profile parts per step (ms), prefill left out."""

import json

from cactus_edge import Engine, GenerationConfig
from cactus_edge.bench import load_structured

engine = Engine.from_pair("default", n_ctx=4096)
for constrained in (True, False):
    parts: dict[str, float] = {}
    n_steps = 0
    for entry in load_structured()[:3]:
        settings = dict(n_draft=4, drafter="model", max_tokens=160, seed=0)
        if constrained:
            settings["json_schema"] = json.dumps(entry["json_schema"])
        engine.clear_caches()
        messages = [{"role": "user", "content": entry["prompt"]}]
        stats = engine.chat(messages, GenerationConfig(**settings)).stats
        n_steps += stats.n_verifier_calls - 1
        for part, ms in stats.profile_ms.items():
            parts[part] = parts.get(part, 0.0) + ms
    host = sum(ms for part, ms in parts.items() if "decode" not in part)
    label = "constrained" if constrained else "unconstrained"
    print(f"{label} steps={n_steps} host={host / n_steps:.2f} ms/step")
    for part, ms in parts.items():
        print(f"   {part:20s} {ms / n_steps:7.3f}")
