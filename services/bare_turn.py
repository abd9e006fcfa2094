"""The processes of the bare agent turn `toolbus bench agent` measures as its floor
(bus/baseline.py): the hops of a one-tool turn and its two model round trips, nothing else.

    python -m services.bare_turn actor --model URL --bodies FILE [--events]
    python -m services.bare_turn worker [--events]

`NATS_URL` names the server (its password stays out of argv), `SAMPLE_LLM_KEY` the model
server's key. `--bodies` is a JSON list of the two request bodies to send, in order, as the
planner sent them. With `--events`, the bare event-model turn: the same turn with the
events and deliveries toolbus's event model makes. Each prints `ready` once it consumes,
and runs until terminated. Not part of the runtime.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import msgspec

from services.process import run as run_loop


async def _serve(role: str, model: str | None, bodies: list[bytes], events: bool) -> int:
    from actors.llm import ModelClient
    from bus.baseline import serve_bare, serve_bare_events
    from bus.connection import connect

    bus = await connect(os.environ["NATS_URL"], name=f"toolbus-bench-bare-{role}")
    http: ModelClient | None = None
    try:
        ask = None
        if role == "actor":
            assert model is not None and len(bodies) == 2
            headers = {"content-type": "application/json",
                       "authorization": f"Bearer {os.environ.get('SAMPLE_LLM_KEY', '')}",
                       "accept": "text/event-stream", "cache-control": "no-store"}
            http = ModelClient()
            session = http.session

            async def ask_model(i: int) -> None:
                async with session.post(model, data=bodies[i], headers=headers) as r:
                    content = await r.read()
                if r.status != 200 or not content.endswith(b"data: [DONE]\n\n"):
                    raise RuntimeError(f"the model server answered {r.status}")

            ask = ask_model
        serve = serve_bare_events if events else serve_bare
        await serve(bus, role, lambda: print("ready", flush=True), ask)
    finally:
        if http is not None:
            await http.aclose()
        await bus.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.bare_turn",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=("actor", "worker"))
    parser.add_argument("--model", help="the model server's chat completions URL (actor)")
    parser.add_argument("--bodies", help="a JSON list of the two request bodies (actor)")
    parser.add_argument("--events", action="store_true",
                        help="the bare event-model turn (every event the turn stores)")
    args = parser.parse_args(argv)
    if args.role == "actor" and not (args.model and args.bodies):
        parser.error("the actor needs --model and --bodies")
    if "NATS_URL" not in os.environ:
        parser.error("set NATS_URL to the server's URL")
    bodies: list[bytes] = []
    if args.bodies:
        try:
            found = msgspec.json.decode(Path(args.bodies).read_bytes())
        except (OSError, msgspec.DecodeError) as exc:
            parser.error(f"--bodies {args.bodies}: {exc}")
        if not isinstance(found, list) or len(found) != 2:
            parser.error(f"--bodies {args.bodies}: not a JSON list of two request bodies")
        bodies = [msgspec.json.encode(b) for b in found]
    try:
        return run_loop(_serve(args.role, args.model, bodies, args.events))
    except Exception as exc:  # a helper of the benchmark: one line, which it shows
        print(f"bare_turn {args.role}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
