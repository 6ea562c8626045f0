"""Host work per step at a fixed k = 4 (the draft model), the first 3 structured prompts, 160
tokens, with and without their schemas; the --profile parts per step (ms), prefill left out."""

from common import k4_replies

from cactus_edge import Engine

engine = Engine.from_pair("default", n_ctx=4096)
for constrained in (True, False):
    parts: dict[str, float] = {}
    n_steps = 0
    for stats in k4_replies(engine, constrained):
        n_steps += stats.n_verifier_calls - 1
        for part, ms in stats.profile_ms.items():
            parts[part] = parts.get(part, 0.0) + ms
    host = sum(ms for part, ms in parts.items() if "decode" not in part)
    label = "constrained" if constrained else "unconstrained"
    print(f"{label} steps={n_steps} host={host / n_steps:.2f} ms/step")
    for part, ms in parts.items():
        print(f"   {part:20s} {ms / n_steps:7.3f}")
