import json, sys
from cactus_edge import Engine, GenerationConfig
from cactus_edge.bench import load_structured
engine = Engine.from_pair("default", n_ctx=4096)
for e in load_structured():
    cfg = GenerationConfig(method="none", temperature=0.0, max_tokens=256, json_schema=e["json_schema"], seed=0)
    r = engine.chat([{"role": "user", "content": e["prompt"]}], cfg)
    ok = True
    try: json.loads(r.text)
    except Exception: ok = False
    print(json.dumps({"id": e["id"], "n": len(r.tokens), "finish": r.finish_reason, "valid": ok, "text": r.text}), flush=True)
