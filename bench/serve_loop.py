"""Serve the production app under uvicorn with a chosen event loop, for an A/B of the loop.

    python -m bench.serve_loop asyncio|uvloop [gateway options...]

`python -m gateway` lets uvicorn pick (uvloop when installed); this pins it, so that a load
run (`bench/ws_load.py --url ...`) can compare the two on the same machine. It is plain
uvicorn, not the gateway's draining server with its connection limit: compare its two loops
with each other, not with `--launch` runs.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import uvicorn

from engine.hub import resolve_model
from gateway.app import create_app, transport_options
from gateway.settings import load_settings


def main(argv: list[str]) -> None:
    loop, rest = argv[0], argv[1:]
    if loop not in ("asyncio", "uvloop"):
        raise SystemExit("usage: python -m bench.serve_loop asyncio|uvloop [gateway options]")
    settings, _ = load_settings(rest)
    settings = replace(settings, model=str(resolve_model(settings.model, Path(settings.data_dir) / "models")))
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, loop=loop, log_level="warning",
                **transport_options(settings))  # type: ignore[arg-type]


if __name__ == "__main__":
    main(sys.argv[1:])
