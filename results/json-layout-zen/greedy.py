"""One greedy plain reply per bundled structured prompt, with the layout given as argv[1] (a JSON
x-guidance object added to each schema; omit it for the tree's default layout), as JSON lines."""

import json
import sys

from cactus_edge import Engine, GenerationConfig
from cactus_edge.bench import load_structured

layout = json.loads(sys.argv[1]) if len(sys.argv) > 1 else None
engine = Engine.from_pair("default", n_ctx=4096)
for entry in load_structured():
    schema = {"x-guidance": layout, **entry["json_schema"]} if layout else entry["json_schema"]
    config = GenerationConfig(method="none", temperature=0.0, max_tokens=256, json_schema=schema, seed=0)
    result = engine.chat([{"role": "user", "content": entry["prompt"]}], config)
    try:
        json.loads(result.text)
        valid = True
    except ValueError:
        valid = False
    record = {"id": entry["id"], "n": len(result.tokens), "finish": result.finish_reason}
    print(json.dumps({**record, "valid": valid, "text": result.text}), flush=True)
