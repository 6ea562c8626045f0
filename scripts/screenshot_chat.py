#!/usr/bin/env python3
"""Render docs/chat.svg: the chat on a real pair, one exchange, acceptance view on (80×30).

.venv/bin/python scripts/screenshot_chat.py --pair default
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from script_args import engine_from_args, script_parser

from cactus_edge.engine.engine import GenerationConfig
from cactus_edge.tui import CactusChatApp


async def render(args, prompt: str, out: Path) -> None:
    app = CactusChatApp(lambda: engine_from_args(args), GenerationConfig(max_tokens=160, seed=0))
    async with app.run_test(size=(80, 30)) as pilot:
        while app.engine is None or not app.screen.query("#prompt"):
            await pilot.pause(0.1)
        app.screen.query_one("#prompt").value = prompt
        await pilot.press("enter")
        start = time.monotonic()
        while app.generating and time.monotonic() - start < 120:
            await pilot.pause(0.2)
        await pilot.pause(0.5)
        out.parent.mkdir(parents=True, exist_ok=True)
        app.save_screenshot(str(out))
        app.engine.close()


def main() -> None:
    parser = script_parser(__doc__, n_ctx=4096)  # --pair (default: 'default') or --draft/--target
    parser.add_argument("--prompt", default="Write a Python function that reverses the words in a sentence.")
    parser.add_argument("--out", type=Path, default=Path("docs/chat.svg"))
    args = parser.parse_args()
    asyncio.run(render(args, args.prompt, args.out))


if __name__ == "__main__":
    main()
