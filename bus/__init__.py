"""The only package that imports `nats`: connections, the embedded server, stream and
consumer declarations, event append/read, the catalog bucket, and error mapping."""

import sys

# nats-py imports aiohttp when it is installed (toolbus sends model calls with it), for
# a WebSocket transport toolbus does not use: 0.1 s more for every command to start, most
# of which never call a model. Hidden while nats loads, unless something has it already.
if "nats" not in sys.modules and "aiohttp" not in sys.modules:
    sys.modules["aiohttp"] = None  # type: ignore[assignment]
    try:
        import nats  # noqa: F401
    finally:
        del sys.modules["aiohttp"]
