"""A sample MCP server (a car rental domain, as in seed 000), built with the `mcp` SDK.

    python -m services.sample_mcp --transport streamable-http --port 8765
    python -m services.sample_mcp --transport sse --port 8766
    python -m services.sample_mcp --transport stdio

Options: `--api-key KEY` requires `Authorization: Bearer KEY` (HTTP transports);
`--page-size N` splits `tools/list` into pages of N; `--log FILE` appends one line per
reservation (a side effect tests can count); `--extra-tools N` adds N trivial tools (to
exercise pagination). The examples and the tests use it; it is not part of the runtime.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ListToolsResult, ToolAnnotations
from pydantic import BaseModel, Field

from services.process import tcp_port

CARS = [
    {"id": "c1", "make": "Renault", "model": "Zoe", "price_per_day": 39.0, "seats": 5},
    {"id": "c2", "make": "Peugeot", "model": "308", "price_per_day": 52.0, "seats": 5},
    {"id": "c3", "make": "Citroen", "model": "Berlingo", "price_per_day": 61.0, "seats": 7},
    {"id": "c4", "make": "Tesla", "model": "Model 3", "price_per_day": 95.0, "seats": 5},
]


class Car(BaseModel):
    id: str
    make: str
    model: str
    price_per_day: float
    seats: int


class SearchResult(BaseModel):
    cars: list[Car]


class PagedServer(MCPServer):
    """An MCPServer whose tools/list answers in pages of `page_size` (the SDK's server
    sends one page; real servers with many tools do not)."""

    def __init__(self, *args: Any, page_size: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.page_size = page_size

    async def _handle_list_tools(self, ctx: Any, params: Any) -> ListToolsResult:
        tools = await self.list_tools()
        if not self.page_size:
            return ListToolsResult(tools=tools)
        start = int(params.cursor) if params is not None and params.cursor else 0
        end = start + self.page_size
        return ListToolsResult(tools=tools[start:end],
                               next_cursor=str(end) if end < len(tools) else None)


def build(*, page_size: int | None = None, log: Path | None = None,
          extra_tools: int = 0) -> MCPServer:
    server = PagedServer("cars", instructions="Search and reserve rental cars.",
                         page_size=page_size, log_level="WARNING")

    @server.tool(annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=True,
                                             open_world_hint=False))
    def search_cars(max_price: Annotated[float, Field(description="highest price per day")]
                    = 1000.0, min_seats: int = 1) -> SearchResult:
        """Find cars by price per day and number of seats."""
        return SearchResult(cars=[Car(**c) for c in CARS  # type: ignore[arg-type]
                                  if c["price_per_day"] <= max_price  # type: ignore[operator]
                                  and c["seats"] >= min_seats])  # type: ignore[operator]

    @server.tool(annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=True),
                 structured_output=False)
    def describe_car(car_id: str) -> str:
        """One line describing a car, as plain text (no structured content)."""
        car = next((c for c in CARS if c["id"] == car_id), None)
        if car is None:
            raise ToolError(f"no car {car_id}")
        return f"{car['make']} {car['model']}, {car['seats']} seats, {car['price_per_day']}/day"

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False,
                                             idempotent_hint=False))
    async def reserve_car(car_id: str, customer: str, hold_seconds: float = 0.0) -> dict[str, Any]:
        """Reserve a car for a customer. Not idempotent: each call makes a reservation."""
        if log is not None:
            with log.open("a") as f:
                f.write(json.dumps({"car_id": car_id, "customer": customer,
                                    "at": time.time()}) + "\n")
        await asyncio.sleep(hold_seconds)
        return {"reservation": f"r-{car_id}-{customer}", "car_id": car_id}

    @server.tool(annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=True))
    async def fleet_report(ctx: Context, steps: int = 3, step_seconds: float = 0.2) -> str:
        """A slow report that sends progress notifications while it works."""
        for i in range(steps):
            await ctx.report_progress(i, steps, f"step {i + 1} of {steps}")
            await asyncio.sleep(step_seconds)
        return f"fleet: {len(CARS)} cars"

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, idempotent_hint=True))
    async def add_model(ctx: Context, name: str) -> str:
        """Add a tool `quote_<name>` to this server and announce the new tool list."""
        def quote(days: int = 1) -> float:
            return 42.0 * days
        server.add_tool(quote, name=f"quote_{name}", description=f"Quote a {name} per day.")
        await ctx.notify_tools_changed()
        return f"added quote_{name}"

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, idempotent_hint=True))
    async def retire_model(ctx: Context, name: str) -> str:
        """Remove the tool `quote_<name>` and announce the new tool list."""
        server.remove_tool(f"quote_{name}")
        await ctx.notify_tools_changed()
        return f"removed quote_{name}"

    @server.tool(annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=True))
    def environment(names: list[str]) -> dict[str, str | None]:
        """The values of some environment variables of this server process."""
        return {n: os.environ.get(n) for n in names}

    for i in range(extra_tools):
        def extra(n: int = i) -> int:
            return n
        server.add_tool(extra, name=f"extra_{i:03d}", description=f"Extra tool {i}.")
    return server


async def wait_listening(port: int, proc: subprocess.Popen[bytes], *,
                         timeout: float = 20.0) -> None:
    """Until the server started as `proc` accepts connections on `port` (bounded); an
    early exit is an error, not a wait."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"sample MCP server exited ({proc.returncode})") from None
                await asyncio.sleep(0.05)
                continue
            writer.close()
            await writer.wait_closed()
            return


class _RequireBearer:
    """ASGI middleware: 401 unless `Authorization: Bearer <key>`."""

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization") != \
                self.expected:
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"missing or wrong bearer key"})
            return
        await self.app(scope, receive, send)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.sample_mcp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", choices=["streamable-http", "sse", "stdio"],
                   default="streamable-http")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=tcp_port, default=8765)
    p.add_argument("--api-key", default=None)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--extra-tools", type=int, default=0)
    p.add_argument("--log", type=Path, default=None)
    args = p.parse_args(argv)
    server = build(page_size=args.page_size, log=args.log, extra_tools=args.extra_tools)
    if args.transport == "stdio":
        server.run("stdio")
        return 0
    app: Any = (server.streamable_http_app(host=args.host) if args.transport == "streamable-http"
                else server.sse_app(host=args.host))
    if args.api_key:
        app = _RequireBearer(app, args.api_key)
    print(f"sample MCP server ({args.transport}) on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
