"""The `toolbus` command's parser and subcommands (entered through `services.cli`)."""

from __future__ import annotations

import sys

# A Ctrl-C while these load (the first fraction of a second) ends the command with one
# line and the usual status, not a traceback of whichever import it interrupted.
try:
    import argparse
    import asyncio
    import contextlib
    import logging
    import os
    import threading
    import time
    import uuid
    from collections.abc import Sequence
    from datetime import UTC, datetime
    from pathlib import Path
    from typing import TYPE_CHECKING, Any, Final

    import msgspec

    # Only what `toolbus replay` and the parser need is imported at the top: the other
    # commands import their modules inside, so a short command starts fast.
    from bus.auth import read_role_url
    from bus.connection import Bus, as_bus_error, connect
    from bus.eventlog import EventLog, StoredEvent, decode_stored
    from bus.subjects import DEFAULT_PARTITIONS, approval_subject
    from schemas.defaults import EXECUTOR_ACK_WAIT_S, MAX_IN_FLIGHT
    from schemas.errors import (
        BusTimeoutError,
        ConnectError,
        ConnectionLostError,
        InvalidIdError,
        PermissionDeniedError,
        RpcError,
        ToolbusError,
        quoted,
    )
    from schemas.events import (
        RequestRejected,
        TurnCancelled,
        TurnCompleted,
        TurnFailed,
        encode_event,
        summarize,
    )
    from schemas.ids import (
        check_agent_name,
        check_session_id,
        check_tool_name,
        is_token,
        turn_id_for,
    )
    from schemas.requests import MAX_MESSAGE_BYTES, escape_controls, strip_controls
    from schemas.state import SessionState, encode_state, fold
    from services.config import (
        ActorSettings,
        default_data_dir,
        default_workers,
        load_manifest,
        nats_url_for,
    )
    from services.process import (
        EXIT_BUS,
        EXIT_CALL_FAILED,
        EXIT_OK,
        EXIT_USAGE,
        Diagnostics,
        fill_std_fds,
        interrupted,
        say,
        started,
        tcp_port,
        terminable,
    )
    from services.process import run as _run
except KeyboardInterrupt:
    sys.stderr.write("toolbus: interrupted while starting\n")
    raise SystemExit(130) from None

if TYPE_CHECKING:
    from schemas.tools import ToolSpec

_json = msgspec.json.Encoder()


def _add_nats(p: argparse.ArgumentParser, *, data_dir: bool = True) -> None:
    p.add_argument("--nats", default=None, metavar="URL",
                   help="NATS server URL, with the role's credentials (default: $NATS_URL, "
                        "then the URL `toolbus up` wrote in DATA_DIR/auth/ for this "
                        "command's role, then nats://127.0.0.1:4222)")
    if data_dir:
        p.add_argument("--data-dir", type=Path, default=None,
                       help="where `toolbus up` keeps its data and credentials (default: "
                            "$TOOLBUS_DATA_DIR, then the user data dir)")


def _add_fsync(p: argparse.ArgumentParser, default: str | None = "batch") -> None:
    p.add_argument("--fsync", choices=["batch", "always"], default=default,
                   help="embedded server: 'batch' (default) fsyncs periodically, so a stored "
                        "event survives a crash of the process but not of the machine; "
                        "'always' fsyncs every event before acknowledging it (slower)")


def _add_actor_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=tcp_port, default=None, metavar="PORT",
                   help="serve Prometheus metrics on GET http://HOST:PORT/metrics, without a "
                        "token (default: off; --http-port serves /metrics too, with one)")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="the address --metrics-port listens on (default 127.0.0.1)")
    p.add_argument("--manifest", type=Path, default=None, metavar="FILE",
                   help="YAML manifest declaring the tools to serve (see deploy/examples/)")
    p.add_argument("--tools", action="append", default=[], metavar="MODULE",
                   help="load tools from a module name or .py file (repeatable)")
    p.add_argument("--pool", default=None, help="executor pool name (default: default)")
    p.add_argument("--instance", default=None,
                   help="executor instance name (default: host-pid-pool; with several "
                        "pools, NAME-pool; the MCP connector beside them, NAME-mcp)")
    p.add_argument("--ack-wait", type=_positive_float, default=EXECUTOR_ACK_WAIT_S,
                   metavar="SECONDS",
                   help="seconds without an ack or in-progress beat before a call held by "
                        "an executor is redelivered: how fast a dead executor is noticed "
                        f"(default {EXECUTOR_ACK_WAIT_S:g})")
    p.add_argument("--max-in-flight", type=_positive_int, default=MAX_IN_FLIGHT,
                   help=f"calls one executor process runs at once (default {MAX_IN_FLIGHT})")
    p.add_argument("--replicas", type=_positive_int, default=None, metavar="N",
                   help="copies of each stream and bucket, rescaling existing ones in place "
                        "(default: 3 on a NATS cluster, 1 on a single server; existing "
                        "streams keep theirs)")
    p.add_argument("--partitions", type=_positive_int, default=None, metavar="N",
                   help="partitions sessions are spread over, shared by the session-actor "
                        "and planner processes; fixed when the store is first made "
                        f"(default {DEFAULT_PARTITIONS}; then the store's)")


def _positive_int(text: str) -> int:
    value = int(text)  # a ValueError becomes argparse's "invalid int value"
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive whole number")
    return value


# Seconds a flag may give (a week): `inf`, or 1e300, would overflow the event loop's
# clock or JetStream's nanoseconds instead of meaning "forever".
MAX_SECONDS_FLAG = 7 * 24 * 3600


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    if not value <= MAX_SECONDS_FLAG:
        raise argparse.ArgumentTypeError(f"{text} is more than {MAX_SECONDS_FLAG} seconds "
                                         "(a week)")
    return value


_positive_int.__name__ = "int"  # argparse names the type in its error messages
_positive_float.__name__ = "float"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toolbus", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="embedded NATS + every actor, in the foreground")
    _add_nats(p, data_dir=False)
    p.add_argument("--no-auth", action="store_true",
                   help="LOCAL EXPERIMENTS ONLY: the embedded server accepts anyone on its "
                        "port, who can then forge results and approvals and run any tool")
    p.add_argument("--port", type=tcp_port, default=4222,
                   help="embedded server port (default 4222)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="embedded server data folder (default: the user data dir)")
    p.add_argument("--http-port", type=tcp_port, default=None, metavar="PORT",
                   help="serve the HTTP gateway on 127.0.0.1:PORT (default: off)")
    p.add_argument("--workers", type=int, default=default_workers(), metavar="N",
                   help="processes: this one runs the session and approval actors, N-1 "
                        "workers run the executors and MCP connectors (default: one per "
                        f"usable core, here {default_workers()}; 1 runs everything in one "
                        "process)")
    _add_fsync(p)
    _add_actor_options(p)

    p = sub.add_parser("actor", help="run one actor kind alone, to scale it out")
    p.add_argument("kind", choices=["session", "approval", "executor", "mcp", "planner", "worker"],
                   help="worker: the executors of every pool and every MCP connector, what "
                        "each worker process of `toolbus up --workers N` runs")
    # Set by `toolbus up --workers N`: this process stops when that one dies.
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--only", action="append", default=[], metavar="ID",
                   help="mcp: serve only this MCP server of the manifest (repeatable)")
    _add_nats(p)
    _add_actor_options(p)

    p = sub.add_parser("chat", help="talk to the agent: its answer streams, its tool calls "
                                    "show as they happen")
    p.add_argument("message", nargs="?", default=None,
                   help="one turn; without it, a line per turn until end of input")
    p.add_argument("--session", default=None, help="session id (default: a new one)")
    p.add_argument("--agent", default=None,
                   help="who is talking: a named agent of agent_config.agents (its "
                        "instructions, model and tools) and the policy's grants of that "
                        "name (default: the policy's default_agent)")
    p.add_argument("--timeout", type=_positive_float, default=300.0,
                   help="seconds to wait for each answer (default 300)")
    _add_nats(p)

    p = sub.add_parser("call", help="call one tool and print its result")
    p.add_argument("tool", help="namespace:tool, e.g. built-in:echo")
    p.add_argument("arguments", nargs="?", default="{}", help="arguments as a JSON object")
    p.add_argument("--session", default=None, help="session id (default: a new one)")
    p.add_argument("--request-id", default=None, help="idempotency key of the request")
    p.add_argument("--timeout", type=_positive_float, default=60.0,
                   help="seconds to wait (default 60)")
    p.add_argument("--reasoning", default=None, help="_reasoningForCall: why this call")
    p.add_argument("--output-path", default=None, metavar="PATH",
                   help="_outputPath: store the result at this dotted path of the session state")
    p.add_argument("--delegate", default=None, metavar="POOL",
                   help="_delegate: run the call in this executor pool")
    p.add_argument("--instance", default=None,
                   help="_instance: run the call on this executor instance")
    p.add_argument("--agent", default=None, metavar="NAME",
                   help="who asks: the policy's grants of this agent apply (default: the "
                        "policy's default_agent)")
    p.add_argument("--full", action="store_true",
                   help="print a result too large for an event in full (from the object "
                        "store), not its reference")
    _add_nats(p)

    p = sub.add_parser("inject", help="hand a session data as if a tool had fetched it (a "
                                      "tool event); the model sees it from its next turn")
    p.add_argument("session")
    p.add_argument("tool_id", help="a namespace:name label, e.g. injected:bank_statement "
                                   "(need not be a real tool)")
    p.add_argument("--result", required=True, metavar="JSON",
                   help="what the tool returned, as JSON; - reads it from stdin")
    p.add_argument("--arguments", default="{}", metavar="JSON",
                   help="what it was called with, a JSON object (default {})")
    p.add_argument("--key", default=None,
                   help="idempotency key: the same key again stores nothing new (default: "
                        "a new one, printed, to retry with)")
    p.add_argument("--trigger", action="store_true",
                   help="trigger_processing: start a turn of the agent now, cancelling the "
                        "turn in flight (needs agent_config.model)")
    p.add_argument("--timeout", type=_positive_float, default=30.0,
                   help="seconds to wait for it to be stored (default 30)")
    _add_nats(p)

    p = sub.add_parser("replay", help="a session's timeline and rebuilt state; runs no tool")
    p.add_argument("session")
    p.add_argument("--json", action="store_true", help="one event per line, then the state")
    p.add_argument("--until", type=_positive_int, default=None, metavar="SEQ",
                   help="stop after this sequence of the events stream (the `seq` the "
                        "timeline prints; not a count of the session's events)")
    p.add_argument("--full", action="store_true",
                   help="resolve results stored as references (object store) in the state")
    p.add_argument("--follow", "-f", action="store_true",
                   help="after the timeline, print each event as it is stored, until "
                        "Ctrl-C (no state: `toolbus state` gives the live one)")
    _add_nats(p)

    p = sub.add_parser("state", help="the session actor's live state of a session, as JSON")
    p.add_argument("session")
    p.add_argument("--full", action="store_true",
                   help="resolve results stored as references (object store)")
    _add_nats(p)

    p = sub.add_parser(
        "tools", help="the tool catalog: list | show NAME | export --format F | remove NAME")
    p.add_argument("action", nargs="?", choices=["list", "show", "export", "remove"],
                   default="list")
    p.add_argument("name", nargs="?", default=None)
    p.add_argument("--format", choices=["openai", "anthropic", "gemini", "mcp", "composed"],
                   default=None, help="export format (default openai)")
    p.add_argument("--output-schema", type=Path, default=None, metavar="FILE",
                   help="composed: JSON Schema file of the final output")
    p.add_argument("--names", action="store_true",
                   help="export: also print the provider-name -> tool-name map")
    p.add_argument("--force", action="store_true",
                   help="remove: even while a live executor serves the tool")
    _add_nats(p)

    p = sub.add_parser("executors", help="live executor instances, their pools and tools")
    _add_nats(p)

    p = sub.add_parser("approvals", help="calls waiting for a human decision")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    _add_nats(p)

    p = sub.add_parser("approve", help="approve a call waiting for a human")
    p.add_argument("call_id")
    p.add_argument("--session", default=None, help="needed when the call id is ambiguous")
    p.add_argument("--note", default=None, help="why, for the record")
    p.add_argument("--by", default=None, help="who decides (default: $USER)")
    _add_nats(p)

    p = sub.add_parser("deny", help="deny a call waiting for a human")
    p.add_argument("call_id")
    p.add_argument("--reason", required=True, help="why; the model reads it")
    p.add_argument("--session", default=None, help="needed when the call id is ambiguous")
    p.add_argument("--by", default=None, help="who decides (default: $USER)")
    _add_nats(p)

    p = sub.add_parser("cancel", help="stop a running turn: its calls not yet running are "
                                      "cancelled, those running finish")
    p.add_argument("turn_id", help="the turn, as `toolbus replay` or the request's answer "
                                   "names it")
    p.add_argument("--session", required=True)
    p.add_argument("--reason", default=None, help="why; stored with the cancellation")
    p.add_argument("--timeout", type=_positive_float, default=30.0,
                   help="seconds to wait for the turn to end (default 30)")
    _add_nats(p)

    p = sub.add_parser("top", help="one deployment's metrics, live: sessions, calls/s, "
                                   "p50/p99 by tool, lag per pool")
    p.add_argument("--url", action="append", default=[], metavar="URL",
                   help="a Prometheus endpoint: the gateway's /metrics or a --metrics-port "
                        "(repeatable, merged; default http://127.0.0.1:8787/metrics)")
    p.add_argument("--token-file", type=Path, default=None, metavar="FILE",
                   help="the bearer token to send (default: DATA_DIR/auth/client.token, if "
                        "it exists)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="where `toolbus up` keeps its credentials (default: "
                        "$TOOLBUS_DATA_DIR, then the user data dir)")
    p.add_argument("--interval", type=_positive_float, default=2.0, metavar="SECONDS",
                   help="seconds between refreshes (default 2)")
    p.add_argument("--once", action="store_true",
                   help="print one snapshot (rates over one interval) and exit")

    p = sub.add_parser("bench", help="benchmarks beside their floor, measured in the same run")
    p.add_argument("what", choices=["calls", "validation", "mcp", "replay", "agent",
                                    "compress"])
    p.add_argument("--n", type=_positive_int, default=None,
                   help="calls (agent: turns; compress: calls and injections; validation: "
                        "checks) per phase (default 2000; validation 20000)")
    p.add_argument("--concurrency", type=_positive_int, default=None,
                   help="calls, mcp: calls in flight (default 32; mcp at most 16)")
    p.add_argument("--workers", type=_positive_int, default=None, metavar="N",
                   help="calls, mcp, agent, compress: start the measured `toolbus up` with "
                        "--workers N (default: its own default, one process per core)")
    p.add_argument("--turns", type=_positive_int, default=None,
                   help="calls: turns of the one long session (default 1000); agent: turns "
                        "of each of its 5 long sessions (default 100)")
    p.add_argument("--session-actors", type=_positive_int, default=None, metavar="N",
                   help="calls: session-actor processes sharing the partitions (default 1: "
                        "the one of the measured `toolbus up`; more are started here, also "
                        "with --nats)")
    p.add_argument("--events", type=_positive_int, default=None,
                   help="replay: events in the session to replay (default 10000)")
    p.add_argument("--json", action="store_true", help="print one JSON report")
    _add_fsync(p, default=None)
    # No --data-dir: each benchmark starts its own server, or measures the one --nats names.
    _add_nats(p, data_dir=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    closed = fill_std_fds()
    if not isinstance(sys.stderr, Diagnostics):
        sys.stderr = Diagnostics(sys.stderr)
    args = build_parser().parse_args(argv)
    if args.command in ("up", "actor") and not isinstance(sys.stdout, Diagnostics):
        # A server's stdout carries its start-up banner only: a reader gone (`| head -1`)
        # must not stop it (a BrokenPipeError ended `toolbus up` quietly, with status 0).
        sys.stdout = Diagnostics(sys.stdout)
    if "stdout" in closed and args.command not in ("up", "actor"):
        # Refused before anything is done: failing at the first write, as `cat` does,
        # would come after the call ran or the turn was paid for.
        print("toolbus: standard output is closed (`>&-`): what this command prints "
              "would be lost; send it somewhere (`> /dev/null` to discard it)",
              file=sys.stderr)
        return EXIT_USAGE
    unused = _unused_arguments(args)
    if unused is not None:  # refused, not silently dropped
        print(f"toolbus {args.command}: {unused}", file=sys.stderr)
        return EXIT_USAGE
    # A server's log has times and sources; a command's warnings (its connection lost
    # and back) are lines like its other messages, unless -v asks for the details.
    daemon = args.command in ("up", "actor") or args.verbose
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s" if daemon
        else "toolbus: %(message)s",
    )
    if args.command == "top":  # reads HTTP endpoints, not NATS
        from services.top import TopError, read_token, top
        try:
            token = read_token(args.token_file, args.data_dir or default_data_dir())
        except TopError as exc:
            print(f"toolbus top: {exc}", file=sys.stderr)
            return exc.code
        try:
            return top(args.url or ["http://127.0.0.1:8787/metrics"], token=token,
                       interval_s=args.interval, once=args.once)
        except KeyboardInterrupt:
            return 130
        except BrokenPipeError:
            return _reader_gone()
        except OSError as exc:  # a full disk: as for every other command
            return _output_lost(exc)
    if args.command == "bench":
        # A flag the benchmark would ignore is refused, not silently dropped.
        given = [flag for flag, dest in _BENCH_FLAGS if getattr(args, dest) is not None
                 and flag not in _BENCH_USES[args.what]]
        if given:
            users = {flag: [w for w, uses in _BENCH_USES.items() if flag in uses]
                     for flag in given}
            print(f"toolbus bench {args.what}: not used here: {', '.join(given)} ("
                  + "; ".join(f"{flag} is for " + ", ".join(f"`bench {w}`" for w in ws)
                              for flag, ws in users.items()) + ")", file=sys.stderr)
            return EXIT_USAGE
        started_here = [flag for flag, dest in (("--fsync", "fsync"), ("--workers", "workers"))
                        if getattr(args, dest) is not None]
        if args.nats is not None and started_here:
            # Those shape the server and `toolbus up` a benchmark starts; with --nats it
            # measures the running ones as they are.
            print(f"toolbus bench {args.what}: not used with --nats: "
                  f"{', '.join(started_here)} (the benchmark measures the server --nats "
                  "names as it runs; they are for the server and `toolbus up` it starts "
                  "without --nats)", file=sys.stderr)
            return EXIT_USAGE
    if args.command == "bench" and args.what == "agent" and args.turns == 1:
        print("toolbus bench agent: --turns 1 has no history to compare: give 2 or more "
              "(the last turns of a session are timed against its first)", file=sys.stderr)
        return EXIT_USAGE
    env_url = os.environ.get("NATS_URL")  # read before an actor's command drops it
    try:
        # `up` runs its own server unless told of one (`--nats` or $NATS_URL).
        external = getattr(args, "nats", None) or env_url
        url = nats_url_for(_role(args), getattr(args, "nats", None),
                           getattr(args, "data_dir", None))
        if _role(args) == "actor":
            # Read once: the actor's credentials are not for the tools and MCP servers
            # this process starts, which inherit its environment.
            os.environ.pop("NATS_URL", None)
        if args.command in ("up", "actor"):
            try:
                from services import runtime  # noqa: F401  # loaded here, under the guard
            except Exception:
                if not interrupted():
                    raise
                print("toolbus: interrupted while starting", file=sys.stderr)
                return 130
        started()
        match args.command:
            case "up":
                from services.runtime import up
                data_dir = args.data_dir or default_data_dir()
                return up(nats_url=url if external else None, data_dir=data_dir,
                          port=args.port, settings=_actor_settings(args), fsync=args.fsync,
                          workers=args.workers, auth=not args.no_auth,
                          metrics_port=args.metrics_port, metrics_host=args.metrics_host)
            case "actor":
                from services.runtime import run_actor
                return run_actor(url, args.kind, _actor_settings(args),
                                 parent_pid=args.parent_pid, metrics_port=args.metrics_port,
                                 metrics_host=args.metrics_host)
            case "chat":  # SIGTERM (`timeout`, a CI job's end) cancels its turn as Ctrl-C does
                return _run(terminable(_chat(url, args), grace_s=_CHAT_GRACE_S))
            case "call":
                return _run(_call(url, args))
            case "inject":
                return _run(_inject(url, args))
            case "replay":
                return _run(_replay(url, args))
            case "state":
                return _run(_state(url, args))
            case "tools":
                return _run(_tools(url, args))
            case "executors":
                return _run(_executors(url))
            case "approvals":
                return _run(_approvals(url, args))
            case "approve" | "deny":
                return _run(_decide(url, args))
            case "cancel":
                return _run(_cancel(url, args))
            case "bench" if args.what == "validation":
                from services.bench import bench_validation
                return bench_validation(n=args.n or 20_000, json_out=args.json)
            case "bench":
                # Cancelled by SIGTERM as by Ctrl-C: the servers and toolbus a benchmark
                # started are stopped, and its temporary folders removed.
                return _run(terminable(_bench(args), grace_s=_BENCH_GRACE_S))
    except ToolbusError as exc:
        print(f"toolbus: {exc}", file=sys.stderr)
        named = getattr(args, "data_dir", None)
        if isinstance(exc, ConnectError) and named is not None and args.command != "up" \
                and not getattr(args, "nats", None) and not os.environ.get("NATS_URL") \
                and read_role_url(named, _role(args)) is None:
            # The server tried was the default one because this data dir named none.
            print(f"toolbus: the data dir {named} holds no {_role(args)} credentials: "
                  "`toolbus up` has not run with it (a typo?); give the --data-dir of the "
                  "running `toolbus up`, or --nats URL", file=sys.stderr)
        url_from = "--nats" if getattr(args, "nats", None) else \
            "NATS_URL" if env_url else None
        if isinstance(exc, PermissionDeniedError) and url_from and _role(args) != "client":
            # The URL given is another role's: say which one this command takes.
            print(f"toolbus: `toolbus {args.command}` takes the {_role(args)} role (or "
                  f"admin): leave {url_from} out and give the --data-dir of the `toolbus up` "
                  f"(it reads <data-dir>/auth/{_role(args)}.url), or {url_from} with that "
                  "role's URL", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ValueError) else EXIT_BUS
    except UnicodeEncodeError:
        # An argument made of bytes that are not UTF-8 (a shell's $'\xff'), on its way out.
        print("toolbus: an argument is not valid UTF-8 text (it holds bytes that could not "
              "be decoded): give it as UTF-8", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        if not _interrupt_said:  # chat said how its turn ended
            say("toolbus: interrupted")
        return 130
    except BrokenPipeError:
        return _reader_gone()
    except OSError as exc:  # writing the output failed (a full disk, a closed terminal)
        mapped = as_bus_error(exc)  # or a NATS timeout no command turned into ours
        if mapped is not None:
            print(f"toolbus: {mapped}", file=sys.stderr)
            return EXIT_BUS
        return _output_lost(exc)
    except Exception as exc:
        mapped = as_bus_error(exc)  # a NATS error no command turned into one of ours
        if mapped is None:
            raise
        print(f"toolbus: {mapped}", file=sys.stderr)
        return EXIT_BUS
    return EXIT_USAGE


def _stdout_to_devnull() -> None:
    """Keep Python from failing again when it flushes stdout at exit."""
    with contextlib.suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _reader_gone() -> int:
    """The reader went away (`| head`): stop quietly."""
    _stdout_to_devnull()
    return EXIT_OK


def _output_lost(exc: OSError) -> int:
    _stdout_to_devnull()
    print(f"toolbus: cannot write the output: {exc.strerror or exc}", file=sys.stderr)
    return EXIT_CALL_FAILED


# The flags of `toolbus bench` (none given is None) and which benchmarks use each; those
# that start their own server and `toolbus up` take no --nats.
_BENCH_FLAGS = (("--n", "n"), ("--concurrency", "concurrency"), ("--workers", "workers"),
                ("--turns", "turns"), ("--session-actors", "session_actors"),
                ("--events", "events"), ("--fsync", "fsync"), ("--nats", "nats"))
_BENCH_USES: dict[str, frozenset[str]] = {
    "calls": frozenset({"--n", "--concurrency", "--workers", "--turns", "--session-actors",
                        "--fsync", "--nats"}),
    "validation": frozenset({"--n"}),
    "mcp": frozenset({"--n", "--concurrency", "--workers", "--fsync"}),
    "replay": frozenset({"--events", "--fsync", "--nats"}),
    "agent": frozenset({"--n", "--turns", "--workers", "--fsync"}),
    "compress": frozenset({"--n", "--workers", "--fsync"}),
}


def _unused_arguments(args: argparse.Namespace) -> str | None:
    """What a command was given and would not use, said; None if nothing."""
    if args.command == "tools" and args.action in ("list", "export") and \
            args.name is not None:
        return f"`tools {args.action}` takes no NAME (got {args.name!r})"
    if args.command == "tools":
        given = [flag for flag, on, used in (
            ("--format", args.format is not None, args.action == "export"),
            ("--names", args.names, args.action == "export" and args.format != "composed"),
            ("--output-schema", args.output_schema is not None,
             args.action == "export" and args.format == "composed"),
            ("--force", args.force, args.action == "remove")) if on and not used]
        if given:
            what = f"tools {args.action}" + (f" --format {args.format}"
                                             if args.format is not None else "")
            return (f"`{what}` takes no {', '.join(given)} (--format is for `tools export`, "
                    "--names for an export to a provider's format, --output-schema for "
                    "`tools export --format composed`, --force for `tools remove`)")
    if args.command == "actor" and args.kind not in ("executor", "worker"):
        given = [flag for flag, on in (("--tools", args.tools),
                                       ("--pool", args.pool is not None)) if on]
        if given:
            return (f"`actor {args.kind}` takes no {', '.join(given)}: tool modules and "
                    "their pool are for `actor executor` and `actor worker` (and `up`)")
    if args.command == "actor" and args.kind not in ("mcp", "worker") and args.only:
        return "--only names MCP servers: it is for `toolbus actor mcp` (or worker)"
    return None


# The role each command connects as (bus/auth.py); the rest are clients.
_ROLES = {"up": "actor", "actor": "actor", "approvals": "approver", "approve": "approver",
          "deny": "approver"}


def _role(args: argparse.Namespace) -> str:
    if args.command == "tools" and args.action == "remove":
        return "actor"  # only toolbus's own processes write the catalog
    return _ROLES.get(args.command, "client")


def _actor_settings(args: argparse.Namespace) -> ActorSettings:
    """The settings of `up` and `actor`; the manifest is read here, once per process."""
    manifest = load_manifest(args.manifest) if args.manifest is not None else None
    return ActorSettings(tools=tuple(args.tools), manifest=manifest,
                         manifest_path=args.manifest, pool=args.pool or "default",
                         only=tuple(getattr(args, "only", ())),
                         http_port=getattr(args, "http_port", None),
                         instance=args.instance,
                         ack_wait_s=args.ack_wait, max_in_flight=args.max_in_flight,
                         replicas=args.replicas, partitions=args.partitions)


def _terminal_json(data: bytes | str) -> str:
    """JSON for stdout: the same value, with what could drive the terminal (C1 controls)
    or reorder what it shows (bidirectional overrides) escaped, as JSON escapes C0."""
    return escape_controls(data.decode() if isinstance(data, bytes) else data)


def _printable(text: object) -> str:
    """Model or tool text for the terminal without control characters (C0 but tab and
    newline, DEL, C1) nor invisible format ones (bidirectional overrides): a
    prompt-injected model must not drive the terminal with escape sequences, nor hide or
    reorder what it shows."""
    return str(strip_controls(str(text)))


async def _bench(args: argparse.Namespace) -> int:
    from services import bench

    fsync = args.fsync or "batch"
    match args.what:
        case "mcp":
            return await bench.bench_mcp(n=args.n or 2000,
                                         concurrency=min(args.concurrency or 16, 16),
                                         fsync=fsync, json_out=args.json,
                                         workers=args.workers)
        case "replay":
            return await bench.bench_replay(args.nats, events=args.events or 10_000,
                                            fsync=fsync, json_out=args.json)
        case "agent":
            return await bench.bench_agent(n=args.n or 2000, turns=args.turns or 100,
                                           fsync=fsync, json_out=args.json,
                                           workers=args.workers)
        case "compress":
            return await bench.bench_compress(n=args.n or 2000, fsync=fsync,
                                              json_out=args.json, workers=args.workers)
    return await bench.bench_calls(args.nats, n=args.n or 2000,
                                   concurrency=args.concurrency or 32,
                                   turns=args.turns or 1000, fsync=fsync,
                                   json_out=args.json, workers=args.workers,
                                   session_actors=args.session_actors or 1)


def _is_utf8(text: str) -> bool:
    """False for text read from bytes that are not UTF-8 (their surrogate escapes)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _unsendable(text: str) -> str | None:
    """Why a chat message cannot be sent ("MESSAGE is ..."), or None: said before it is, as
    NATS would refuse one over its payload limit with no word of what was too large."""
    if not _is_utf8(text):
        return "not valid UTF-8 text"
    if not text.strip():
        return "empty: say something (or give no MESSAGE, to chat a line at a time)"
    size = len(text.encode())
    return _too_large(size) if size > MAX_MESSAGE_BYTES else None


def _too_large(size: int) -> str:
    return (f"{size} bytes; the limit is {MAX_MESSAGE_BYTES}: send a large input by "
            "reference (a path or URL), or hand it over with `toolbus inject`")


class _StdinLines:
    """Lines of stdin, read from its descriptor on a daemon thread: Ctrl-C at the prompt
    ends the command at once, where a thread of the loop's executor, still blocked in the
    read, kept the process waiting for another line. Unbuffered by Python (a daemon
    thread inside a buffered read aborts the interpreter at exit), and as bytes: a line
    that is not UTF-8 comes as surrogate escapes, for the caller to refuse, whatever the
    locale's decoding would have done with it and with what was buffered around it. A
    line longer than `limit` is not held: its bytes are counted and dropped as they come,
    and its size stands for it (`toolbus chat < /dev/zero`)."""

    def __init__(self, fd: int = 0, *, limit: int = 2 * MAX_MESSAGE_BYTES) -> None:
        self._fd = fd
        self._limit = limit
        self._buf = b""
        self._eof = False

    def held(self) -> int:
        return len(self._buf)

    def _next(self) -> str | int | None:
        dropped = 0
        while b"\n" not in self._buf and not self._eof:
            try:
                chunk = os.read(self._fd, 65536)
            except OSError:  # closed
                chunk = b""
            self._eof = not chunk
            if len(self._buf) + len(chunk) > self._limit and b"\n" not in chunk:
                dropped += len(self._buf) + len(chunk)
                self._buf = b""
            else:
                self._buf += chunk
        if not self._buf and not dropped:
            return None
        line, sep, self._buf = self._buf.partition(b"\n")
        if dropped:
            return dropped + len(line)
        return (line + sep).decode("utf-8", "surrogateescape")

    async def next(self) -> str | int | None:
        """The next line, the size in bytes of one over the limit, None at the end."""
        loop = asyncio.get_running_loop()
        got: asyncio.Future[str | int | None] = loop.create_future()

        def settle(line: str | int | None) -> None:
            if not got.done():
                got.set_result(line)

        def read() -> None:
            line = self._next()
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                loop.call_soon_threadsafe(settle, line)

        threading.Thread(target=read, name="toolbus-chat-stdin", daemon=True).start()
        return await got


def _live_event(msg: Any) -> tuple[str, str, dict[str, Any]] | None:
    """A message of `toolbus.live.<sid>.<kind>` as (sid, kind, its JSON object), or None
    for one that is not."""
    parts = msg.subject.split(".", 3)
    if len(parts) < 4:
        return None
    try:
        body = msgspec.json.decode(msg.data)
    except msgspec.DecodeError:
        return None
    return (parts[2], parts[3], body) if isinstance(body, dict) else None


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # replaced, or closed
        return False


async def _chat(url: str, args: argparse.Namespace) -> int:
    """One turn per message: the model's text as it streams, each tool call and its end
    as it happens (on stderr), then the answer."""
    from bus.client import ToolbusClient
    from bus.tasks import apart, retrieve
    from schemas.ids import child_session_id
    from schemas.manifest import AGENT_TOOL_NAMESPACE

    session = check_session_id(args.session) if args.session is not None else \
        f"chat-{uuid.uuid4().hex[:12]}"
    if args.agent is not None:
        check_agent_name(args.agent)
    if args.message is not None and (problem := _unsendable(args.message)) is not None:
        print(f"toolbus: MESSAGE is {problem}", file=sys.stderr)
        return EXIT_USAGE
    bus = await connect(url, name="toolbus-chat")
    client = ToolbusClient(bus)
    streamed = [False]
    # On a terminal the text streams as the model writes it; piped or redirected, stdout
    # gets the answer alone (a stream retried after it broke, or the text a model writes
    # beside its tool calls, is not the answer).
    streaming = _is_terminal(sys.stdout)
    tools: dict[str, str] = {}  # call id -> tool, to name a call when it ends
    # The turn this command waits for: another client's turn in the session is not shown
    # as this one's (its text would be printed as this answer).
    current: list[str | None] = [None]

    # The sessions of the agents this turn calls (`agent:<name>`), watched for the calls
    # that wait for a human there: else the turn waits on them without a word.
    children: dict[str, Any] = {}

    async def watch_child(parent: str, call_id: str, tool: str) -> None:
        if not tool.startswith(f"{AGENT_TOOL_NAMESPACE}:") or len(children) >= 64:
            return
        with contextlib.suppress(InvalidIdError):
            child = check_session_id(child_session_id(parent, call_id, tool.split(":", 1)[1]))
            if child not in children:
                children[child] = await bus.nc.subscribe(f"toolbus.live.{child}.>",
                                                         cb=on_child)

    async def on_child(msg: Any) -> None:
        event = _live_event(msg)
        if event is None:
            return
        child, kind, body = event
        if kind.startswith("approval.requested"):
            print(f"  .. {_printable(body.get('tool'))} (agent session {child}) waits for a "
                  f"human: toolbus approve {_printable(body.get('call_id'))} --session "
                  f"{child}", file=sys.stderr, flush=True)
        elif kind == "call.requested" and body.get("actor") == "planner":
            await watch_child(child, str(body.get("call_id")), str(body.get("tool")))

    # One planner turn of a session runs at a time: a turn requested behind another
    # says what it waits for, instead of nothing until that one ends.
    behind: list[asyncio.Task[None] | None] = [None]

    async def say_what_it_waits_for(turn_id: str) -> None:
        await asyncio.sleep(_QUEUED_NOTICE_S)
        state = await client.live_state(session)
        mine = state.turns.get(turn_id)
        if mine is None or mine.status != "running" or mine.model_requested:
            return
        ahead = [t for t in state.turns.values() if t.status == "running" and
                 t.message is not None and t.seq < mine.seq]
        if ahead and current[0] == turn_id:
            first = ahead[0].turn_id
            print(f"  .. waiting for turn {first} of this session to end (one turn at a "
                  f"time; toolbus cancel {first} --session {session} stops it)",
                  file=sys.stderr, flush=True)

    async def on_live(msg: Any) -> None:
        event = _live_event(msg)
        if event is None:
            return
        _, kind, body = event
        if "turn_id" in body and body["turn_id"] != current[0] and \
                not kind.startswith("tool_event.injected"):
            return
        if kind == "turn.requested" and behind[0] is None:
            noticing = asyncio.create_task(say_what_it_waits_for(str(body["turn_id"])))
            noticing.add_done_callback(retrieve)
            behind[0] = noticing
        elif kind == "model.requested" and behind[0] is not None:
            behind[0].cancel()
        if kind == "model.delta" and body.get("reset"):
            print("\n  (the model's stream broke: asking again)", file=sys.stderr, flush=True)
        elif kind == "model.delta" and streaming:
            sys.stdout.write(_printable(body.get("text", "")))
            sys.stdout.flush()
            streamed[0] = True
        elif kind == "call.requested" and body.get("actor") == "planner":
            if len(tools) < 10_000:
                tools[str(body.get("call_id"))] = str(body.get("tool"))
            # As `toolbus approvals` shows them: what would reorder or hide text escaped,
            # not dropped, and a cut said (this line is where a human reads a call that
            # then waits for `toolbus approve`; a silent cut hid what it did past it).
            args_text = _terminal_json(msgspec.json.encode(body.get("arguments")))
            hidden = len(args_text) - _CHAT_ARGUMENTS_SHOWN
            if hidden > 0:
                args_text = (f"{args_text[:_CHAT_ARGUMENTS_SHOWN]}… ({hidden} more "
                             f"characters: `toolbus replay {session}` shows them)")
            print(f"\n  -> {_printable(body.get('tool'))} {_printable(args_text)}",
                  file=sys.stderr, flush=True)
            await watch_child(session, str(body.get("call_id")), str(body.get("tool")))
        elif kind in ("call.succeeded", "call.failed", "call.rejected"):
            what = "ok" if kind == "call.succeeded" else \
                f"{kind.split('.')[1]}: {str(body.get('message', ''))[:200]}"
            call = str(body.get("call_id"))
            print(f"  <- {_printable(tools.pop(call, call))} {_printable(what)}",
                  file=sys.stderr, flush=True)
        elif kind.startswith("approval.requested"):
            print(f"  .. {_printable(body.get('tool'))} waits for a human: toolbus approve "
                  f"{_printable(body.get('call_id'))} --session {session}", file=sys.stderr,
                  flush=True)
        elif kind == "result.compressed":
            how = (f"stored as {body.get('key')}" if body.get("key") else
                   "transformed" if body.get("transform") else
                   "too large to read")  # `[NOT READ | ...]`: its size and first characters
            print(f"  .. {_printable(body.get('call_id'))}: {body.get('chars')} characters, "
                  f"{_printable(how)}; the model reads {len(str(body.get('view', '')))}",
                  file=sys.stderr, flush=True)
        elif kind.startswith("tool_event.injected"):
            print(f"  ++ tool event {_printable(body.get('tool_id'))} injected "
                  f"({_printable(body.get('event_id'))})", file=sys.stderr, flush=True)
        elif kind == "turn.cancelled":
            print(f"  xx turn {_printable(body.get('turn_id'))} cancelled: "
                  f"{_printable(str(body.get('message', ''))[:200])}", file=sys.stderr,
                  flush=True)

    code = EXIT_OK
    try:
        sub = await bus.nc.subscribe(f"toolbus.live.{session}.>", cb=on_live)
        print(f"session: {session}", file=sys.stderr)
        messages = [args.message] if args.message is not None else None
        stdin = _StdinLines()
        while True:
            if messages is not None:
                if not messages:
                    break
                text = messages.pop(0)  # checked before connecting
            else:
                line = await stdin.next()
                if line is None:
                    break
                if isinstance(line, int):
                    print(f"toolbus: skipped a line that is {_too_large(line)}",
                          file=sys.stderr)
                    code = EXIT_USAGE
                    continue
                text = line.strip()
                if not text:
                    continue
                problem = _unsendable(text)
                if problem is not None:
                    print(f"toolbus: skipped a line that is {problem}", file=sys.stderr)
                    code = EXIT_USAGE
                    continue
            if _stdout_reader_gone():
                # `| head -1`: nobody reads this turn's answer; not asked for (each line
                # after the reader left was a model turn paid for and thrown away).
                raise BrokenPipeError
            streamed[0] = False
            request_id = uuid.uuid4().hex
            current[0] = turn_id_for(request_id)
            try:
                # Apart: an interrupt landing in the same turn of the loop as the
                # request's acknowledgement was lost inside nats-py's `asyncio.wait_for`
                # (Python 3.11 drops that cancellation), and chat waited for the whole
                # turn. Here it always comes.
                end = await apart(client.ask(session, text, agent=args.agent,
                                             timeout=args.timeout, request_id=request_id))
            except asyncio.CancelledError:
                # Ctrl-C (or SIGTERM) during the turn: it is the session's, and would go
                # on unseen, holding the session's next turns back. Stopped, as a chat's
                # Ctrl-C stops the answer, or else named.
                await _stop_turn(client, session, turn_id_for(request_id))
                raise
            except ConnectionLostError as exc:
                # Nothing can be sent to stop its turn: said, and chat ends.
                print(f"\ntoolbus: {exc}", file=sys.stderr, flush=True)
                code = EXIT_BUS
                break
            except BusTimeoutError as exc:
                # Its turn is cancelled, as at Ctrl-C: left running, it would hold the
                # session's next messages back (one turn at a time) for as long as it
                # takes. Interactive, the next line is a turn of its own.
                print(f"\ntoolbus: {exc}".split("; it goes on:")[0], file=sys.stderr,
                      flush=True)
                await _stop_turn(client, session, turn_id_for(request_id),
                                 why=f"no answer within --timeout {args.timeout:g} s")
                code = EXIT_BUS
                continue
            finally:
                if behind[0] is not None:
                    behind[0].cancel()
                    behind[0] = None
            if isinstance(end, TurnCompleted):
                if not streamed[0] and end.text:
                    sys.stdout.write(_printable(end.text))
                sys.stdout.write("\n")
                sys.stdout.flush()
            elif isinstance(end, TurnFailed):
                print(f"\ntoolbus: the turn failed ({end.reason}): {_printable(end.message)}",
                      file=sys.stderr)
                code = EXIT_CALL_FAILED
            elif isinstance(end, TurnCancelled):
                print(f"\ntoolbus: the turn was cancelled ({end.reason}): "
                      f"{_printable(end.message)}", file=sys.stderr)
                code = EXIT_CALL_FAILED
            else:
                print(f"toolbus: the message was refused ({end.reason}): "
                      f"{_printable(end.message)}", file=sys.stderr)
                code = EXIT_CALL_FAILED
        await sub.unsubscribe()
    finally:
        for child_sub in children.values():
            with contextlib.suppress(Exception):
                await child_sub.unsubscribe()
        await client.close()
        await bus.close()
    return code


async def _stop_turn(client: Any, session: str, turn_id: str, *,
                     why: str = "interrupted") -> None:
    """Cancel the turn `toolbus chat` was interrupted in, or gave up waiting for
    (bounded), and say how it ended; else how to stop it. Said where it can be: with
    stderr a closed pipe (`2>&1 | head`), the turn is cancelled all the same."""
    global _interrupt_said
    _interrupt_said = True
    how = f"toolbus cancel {turn_id} --session {session}"
    interrupted = why == "interrupted"
    say(f"{chr(10) if interrupted else ''}toolbus: {why}: cancelling turn {turn_id} "
        f"({'again' if interrupted else 'Ctrl-C'} to stop waiting)")
    try:
        end = await client.cancel(session, turn_id, reason="toolbus chat was interrupted"
                                  if interrupted else f"toolbus chat: {why}",
                                  timeout=_STOP_TURN_S)
    except asyncio.CancelledError:  # interrupted again: left running, and said how to stop
        say(f"toolbus: turn {turn_id} may still be running (unless the cancel sent was "
            f"stored); stop it with: {how}")
        raise
    except Exception as exc:
        say(f"toolbus: turn {turn_id} may still be running ({exc}); stop it with: {how}")
        return
    if isinstance(end, TurnCancelled):
        say(f"toolbus: {why}: turn {turn_id} cancelled")
    elif isinstance(end, RequestRejected):
        # Not known yet (its request still on its way), or already over.
        say(f"toolbus: {why}: turn {turn_id} not cancelled "
            f"({_printable(end.message)}); if it runs: {how}")
    else:
        say(f"toolbus: {why}: turn {turn_id} had ended")


_STOP_TURN_S = 5.0
_CHAT_ARGUMENTS_SHOWN = 200  # characters of a call's arguments chat shows
# A turn whose model is not asked within this long may be waiting behind another.
_QUEUED_NOTICE_S = 1.0
_interrupt_said = False  # chat said what became of the turn it was interrupted in
# After SIGTERM, chat's cleanup (cancelling its turn, then closing its connection) takes
# at most about 8 s; past this, it is stuck, and exits all the same, saying where.
_CHAT_GRACE_S = 12.0
# A benchmark stops the servers and `toolbus up` it started, one after another, each
# bounded (up's own stop gives running calls 10 s): a minute or two at worst.
_BENCH_GRACE_S = 120.0


async def _cancel(url: str, args: argparse.Namespace) -> int:
    """`toolbus cancel TURN --session SID`: 0 once the turn is cancelled; 1 when there was
    nothing to cancel (an unknown turn, one that ended first), saying how it ended."""
    from bus.client import ToolbusClient

    session = check_session_id(args.session)
    if not is_token(args.turn_id):
        print(f"toolbus: invalid turn id {quoted(args.turn_id)}: `toolbus replay {session}` "
              "names the session's turns", file=sys.stderr)
        return EXIT_USAGE
    if args.reason is not None and not args.reason.strip():
        print("toolbus: --reason must say why (or leave it out)", file=sys.stderr)
        return EXIT_USAGE
    bus = await connect(url, name="toolbus-cancel")
    client = ToolbusClient(bus)
    try:
        head, _ = await client.log.read_head(session)
        if not head:
            # Sent anyway, the request would make the session (a typo) to store its refusal.
            print(f"toolbus: nothing cancelled: session {session} has no events (is its id "
                  "right? `toolbus replay SID` lists a session's turns)", file=sys.stderr)
            return EXIT_CALL_FAILED
        end = await client.cancel(session, args.turn_id, reason=args.reason,
                                  timeout=args.timeout)
    finally:
        await client.close()
        await bus.close()
    if isinstance(end, TurnCancelled):
        print(f"turn {args.turn_id} cancelled: {_printable(end.message)}", file=sys.stderr)
        return EXIT_OK
    what = (f"refused: {_printable(end.message)}" if isinstance(end, RequestRejected) else
            f"the turn ended first ({type(end).__struct_config__.tag})")
    print(f"toolbus: nothing cancelled: {what}", file=sys.stderr)
    return EXIT_CALL_FAILED


async def _call(url: str, args: argparse.Namespace) -> int:
    from bus.artifacts import ArtifactStore
    from bus.client import ToolbusClient
    from schemas.requests import MAX_REQUEST_ID_CHARS, json_error

    try:
        arguments: Any = msgspec.json.decode(args.arguments)
    except msgspec.DecodeError as exc:
        print(f"toolbus: ARGUMENTS is not valid JSON: {json_error(exc, args.arguments)}",
              file=sys.stderr)
        return EXIT_USAGE
    session = check_session_id(args.session) if args.session is not None else \
        f"cli-{uuid.uuid4().hex[:12]}"
    if args.request_id is not None and len(args.request_id) > MAX_REQUEST_ID_CHARS:
        # Before connecting: a usage error, server or not.
        print(f"toolbus: --request-id is longer than {MAX_REQUEST_ID_CHARS} characters "
              f"({len(args.request_id)})", file=sys.stderr)
        return EXIT_USAGE
    bus = await connect(url, name="toolbus-call")
    try:
        print(f"session: {session}", file=sys.stderr)
        call: dict[str, Any] = {"tool": args.tool, "arguments": arguments}
        for key, value in (("_reasoningForCall", args.reasoning),
                           ("_outputPath", args.output_path), ("_delegate", args.delegate),
                           ("_instance", args.instance)):
            if value is not None:
                call[key] = value
        end = await ToolbusClient(bus).call(
            session, [call],
            request_id=args.request_id, agent=args.agent, timeout=args.timeout)
        outcome = end.outcomes[0] if not isinstance(end, RequestRejected) and end.outcomes \
            else None
        ref = outcome.result_ref if outcome is not None else None
        if isinstance(end, TurnCompleted) and outcome is not None and \
                outcome.status == "succeeded" and ref is not None:
            if args.full:
                sys.stdout.flush()
                await ArtifactStore(bus).read_into(ref, sys.stdout.buffer)
                sys.stdout.buffer.write(b"\n")
                print(f"toolbus: the result ({ref.size} bytes) was read from the object "
                      f"store ({ref.key})", file=sys.stderr)
            else:
                sys.stdout.write(_terminal_json(_json.encode(
                    {"$ref": ref.key, "size": ref.size, "sha256": ref.sha256})) + "\n")
                print(f"toolbus: the result is {ref.size} bytes, stored as {ref.key} "
                      "(too large for an event); --full prints it", file=sys.stderr)
            return EXIT_OK
    finally:
        await bus.close()
    if isinstance(end, RequestRejected):
        print(f"toolbus: request rejected ({end.reason}): {_printable(end.message)}",
              file=sys.stderr)
        return EXIT_CALL_FAILED
    if isinstance(end, TurnCompleted) and outcome is not None and outcome.status == "succeeded":
        sys.stdout.write(_terminal_json(_json.encode(outcome.result)) + "\n")
        return EXIT_OK
    if outcome is not None and outcome.error is not None:
        # The text of a tool, an MCP server or an approver's reason: no escape sequence
        # reaches the caller's terminal from it.
        print(f"toolbus: {_printable(args.tool)} {outcome.status} "
              f"({_printable(outcome.error.error_type)}): {_printable(outcome.error.message)}",
              file=sys.stderr)
    elif isinstance(end, TurnFailed):
        print(f"toolbus: turn failed ({end.reason}): {_printable(end.message)}",
              file=sys.stderr)
    elif isinstance(end, TurnCancelled):  # its call had not run (waiting for a human)
        print(f"toolbus: {_printable(args.tool)} did not run: the turn was cancelled "
              f"({end.reason}): {_printable(end.message)}", file=sys.stderr)
    else:
        print(f"toolbus: {_printable(args.tool)} did not succeed ({type(end).__name__})",
              file=sys.stderr)
    return EXIT_CALL_FAILED


async def _inject(url: str, args: argparse.Namespace) -> int:
    from bus.client import ToolbusClient
    from schemas.errors import InvalidRequestError
    from schemas.requests import DEFAULT_MAX_REQUEST_BYTES, json_error, parse_tool_event

    sid = check_session_id(args.session)
    # Bounded: a tool event over the limit is refused below, whatever its length.
    raw = sys.stdin.buffer.read(DEFAULT_MAX_REQUEST_BYTES + 1) if args.result == "-" \
        else args.result.encode()
    if len(raw) > DEFAULT_MAX_REQUEST_BYTES:
        print(f"toolbus: --result is over {DEFAULT_MAX_REQUEST_BYTES} bytes, the limit of a "
              "tool event: store it elsewhere and inject a reference to it",
              file=sys.stderr)
        return EXIT_USAGE
    values: dict[str, Any] = {}
    for flag, text in (("--result", raw), ("--arguments", args.arguments.encode())):
        try:
            values[flag] = msgspec.json.decode(text)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            where = " (read from stdin)" if flag == "--result" and args.result == "-" else ""
            print(f"toolbus: {flag}{where} is not valid JSON: {json_error(exc, text)}",
                  file=sys.stderr)
            return EXIT_USAGE
    key = args.key if args.key is not None else uuid.uuid4().hex
    body = {"tool_id": args.tool_id, "arguments": values["--arguments"],
            "result": values["--result"], "idempotency_key": key,
            "trigger_processing": args.trigger}
    # Checked before connecting: what is wrong with it is a usage error, server or not.
    tool_event = parse_tool_event(_json.encode(body))
    if args.key is None:  # only for a tool event that can be sent
        print(f"key: {key} (to retry without injecting twice: --key {key})", file=sys.stderr)
    bus = await connect(url, name="toolbus-inject")
    client = ToolbusClient(bus)
    try:
        got = await client.inject(sid, tool_event.tool_id, tool_event.result,
                                  arguments=tool_event.arguments,
                                  idempotency_key=tool_event.idempotency_key,
                                  trigger_processing=tool_event.trigger_processing,
                                  timeout=args.timeout)
    except InvalidRequestError as exc:  # the session actor refused it
        print(f"toolbus: tool event refused ({exc.reason}): {exc.message}", file=sys.stderr)
        return EXIT_CALL_FAILED
    finally:
        await client.close()
        await bus.close()
    what = "new" if got.created else "already injected with this key: nothing new stored"
    turn = f", turn {got.turn_id}" if got.turn_id else ""
    sys.stdout.write(f"{got.event_id} seq {got.seq}{turn} ({what})\n")
    return EXIT_OK


async def _replay(url: str, args: argparse.Namespace) -> int:
    sid = check_session_id(args.session)
    if args.follow and (args.until is not None or args.full):
        print("toolbus: replay --follow reads on past the log's end and prints no state: "
              f"it takes no {'--until' if args.until is not None else '--full'}",
              file=sys.stderr)
        return EXIT_USAGE
    if args.follow:
        return await _follow(url, sid, as_json=args.json)
    bus = await connect(url, name="toolbus-replay")
    try:
        stored = await EventLog(bus).read_session(sid, until=args.until)
        state = fold(sid, ((s.seq, s.event) for s in stored))
        await _references(bus, state, full=args.full)
    finally:
        await bus.close()
    out = sys.stdout
    if not stored:
        upto = "" if args.until is None else (
            f" up to seq {args.until} (a sequence of the whole stream: `toolbus replay "
            f"{sid}` shows its events' own)")
        print(f"toolbus: session {sid} has no events{upto}", file=sys.stderr)
    if args.json:  # the (empty) state still printed, and the same status
        for s in stored:
            out.write(_json_line(s))
        out.write(_terminal_json(f'{{"state":{encode_state(state).decode()}}}') + "\n")
        return EXIT_OK if stored else EXIT_CALL_FAILED
    if not stored:
        return EXIT_CALL_FAILED
    out.write(f"session {sid}: {len(stored)} event(s)\n")
    out.write(_TIMELINE_HEAD)
    for s in stored:
        out.write(_timeline_line(s))
    out.write("\nstate:\n")
    out.write(_printable(msgspec.json.format(encode_state(state).decode(), indent=2)) + "\n")
    return EXIT_OK


_TIMELINE_HEAD: Final = f"{'seq':>8}  {'time (UTC)':<26}  {'actor':<9} {'type':<18} summary\n"


def _timeline_line(s: StoredEvent) -> str:
    if s.event is None:
        return f"{s.seq:>8}  {'?':<26}  {'?':<9} {'(unreadable)':<18} {_printable(s.error)}\n"
    ev = s.event
    when = datetime.fromtimestamp(ev.at, UTC).isoformat(timespec="microseconds")[:26]
    tag = type(ev).__struct_config__.tag
    # Model and tool text: printed without what could drive the terminal.
    return f"{s.seq:>8}  {when:<26}  {ev.actor:<9} {tag!s:<18} {_printable(summarize(ev))}\n"


def _json_line(s: StoredEvent) -> str:
    if s.event is not None:
        event = encode_event(s.event)
    else:  # as stored when it is JSON (a type this version does not know), else as text
        try:
            event = _json.encode(msgspec.json.decode(s.data))
        except (msgspec.DecodeError, RecursionError):
            event = _json.encode({"unreadable": s.data.decode("utf-8", "replace")})
    return _terminal_json(f'{{"seq":{s.seq},"subject":{_json.encode(s.subject).decode()},'
                          f'"event":{event.decode()}}}') + "\n"


async def _follow(url: str, sid: str, *, as_json: bool) -> int:
    """`replay --follow`: the session's events from its first, then each one as it is
    stored, until interrupted; a line each, flushed (a pipe reader sees it at once)."""
    from bus.feed import SessionFeed

    bus = await connect(url, name="toolbus-replay")
    out = sys.stdout
    try:
        if not as_json:
            print(f"session {sid}: following its events (Ctrl-C to stop)", file=sys.stderr)
            out.write(_TIMELINE_HEAD)
            out.flush()
        async with SessionFeed(bus, sid, quiet_s=_FOLLOW_QUIET_S) as feed:
            async for item in feed.items():
                if item is None and _stdout_reader_gone():
                    # `| head -1` on a quiet session: nothing is written to fail.
                    raise BrokenPipeError
                if item is None or item.seq is None:
                    continue  # quiet, or a text delta: only what is stored is replayed
                stored = decode_stored(item.seq, item.subject, item.data)
                out.write(_json_line(stored) if as_json else _timeline_line(stored))
                out.flush()
    finally:
        await bus.close()
    return EXIT_OK


# How often `replay --follow` of a quiet session looks whether its reader is still there.
_FOLLOW_QUIET_S = 1.0


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll says so without a
    write: a quiet follow writes nothing that would fail)."""
    import select

    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError):
        return False


async def _references(bus: Bus, state: SessionState, *, full: bool) -> None:
    """With `full`, put each result stored as a reference into the state; say either way
    what was done, on stderr."""
    refs = sum(1 for c in state.calls.values() if c.result_ref is not None)
    if not refs:
        return
    if not full:
        print(f"toolbus: {refs} result(s) are stored as references to the object store "
              "(result_ref); --full resolves them", file=sys.stderr)
        return
    from bus.client import ToolbusClient

    await ToolbusClient(bus).resolve_references(state)
    print(f"toolbus: resolved {refs} result(s) from the object store", file=sys.stderr)


async def _state(url: str, args: argparse.Namespace) -> int:
    from bus.client import ToolbusClient

    check_session_id(args.session)
    bus = await connect(url, name="toolbus-state")
    try:
        client = ToolbusClient(bus)
        try:
            state = await client.live_state(args.session)
        except RpcError as exc:
            if exc.code != "too_large":
                raise
            # Too large for one reply: the same reducer over the log gives the same state.
            print("toolbus: the live state is too large for one reply; folded here from "
                  "the log with the same reducer instead",
                  file=sys.stderr)
            state = await client.fold_session(args.session)
        await _references(bus, state, full=args.full)
    finally:
        await bus.close()
    if state.last_seq == 0:
        print(f"toolbus: session {args.session} has no events (yet)", file=sys.stderr)
    sys.stdout.write(_terminal_json(encode_state(state)) + "\n")
    return EXIT_OK


async def _tools(url: str, args: argparse.Namespace) -> int:
    from bus.catalog import Catalog
    from schemas.tools import to_tool_schema

    if args.action in ("show", "remove") and not args.name:
        print(f"toolbus: tools {args.action} needs a NAME, e.g. built-in:echo", file=sys.stderr)
        return EXIT_USAGE
    bus = await connect(url, name="toolbus-tools")
    try:
        catalog = Catalog(bus)
        if args.action == "remove":
            name = check_tool_name(args.name)
            serving = [i for i in await catalog.load_executors() if name in i.tools]
            if serving and not args.force:
                who = ", ".join(f"{i.instance} (pool {i.pool}, pid {i.pid} on {i.host})"
                                for i in serving)
                print(f"toolbus: {name} is served by live executor(s) {who}; removing it "
                      "would only hide it until they register it again: stop them first, "
                      "or pass --force", file=sys.stderr)
                return EXIT_CALL_FAILED
            removed = await catalog.remove(name)
            print(f"removed {args.name}" if removed else f"no tool named {args.name}",
                  file=sys.stderr)
            return EXIT_OK if removed else EXIT_CALL_FAILED
        specs = await catalog.load()
    finally:
        await bus.close()
    if args.action == "show":
        spec = next((s for s in specs if s.name == args.name), None)
        if spec is None:
            print(f"toolbus: no tool named {args.name!r}; `toolbus tools` lists them",
                  file=sys.stderr)
            return EXIT_CALL_FAILED
        _print_json(to_tool_schema(spec))
        return EXIT_OK
    if args.action == "export":
        return _export(specs, args)
    if not specs:
        print("no tools registered: start an executor (`toolbus up`)", file=sys.stderr)
        return EXIT_OK
    width = max(len(s.name) for s in specs)
    for s in specs:
        a = s.annotations
        flags = ",".join(f for f, on in (("read-only", a.readOnlyHint),
                                          ("destructive", a.destructiveHint and not a.readOnlyHint),
                                          ("idempotent", a.idempotentHint),
                                          ("open-world", a.openWorldHint),
                                          ("approval", s.requires_approval)) if on) or "-"
        sys.stdout.write(f"{s.name:<{width}}  {flags:<40} risk={s.risk_level:<6} "
                         f"source={s.source} pools={','.join(s.pools)}\n")
    return EXIT_OK


def _export(specs: list[ToolSpec], args: argparse.Namespace) -> int:
    from schemas.providers import compose_schema, export
    from schemas.validation import Validator

    fmt = args.format or "openai"
    if fmt == "composed":
        output = None
        if args.output_schema is not None:
            try:
                output = msgspec.json.decode(args.output_schema.read_bytes())
                if not isinstance(output, dict):
                    raise ValueError("a JSON Schema is an object")
                Validator(output)  # checked as a manifest's output_schema is
                Validator(compose_schema(specs, output))  # and where it ends up ($refs)
            except (OSError, ValueError, RecursionError) as exc:  # DecodeError, ConfigError
                print(f"toolbus: --output-schema {args.output_schema}: "
                      f"{getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
                return EXIT_USAGE
        _print_json(compose_schema(specs, output))
        return EXIT_OK
    doc, names = export(specs, fmt)
    if args.names:
        doc = {"tools": doc, "names": {names.encode(s.name): s.name for s in specs}}
    _print_json(doc)
    return EXIT_OK


def _print_json(value: Any) -> None:
    sys.stdout.write(_terminal_json(msgspec.json.format(_json.encode(value), indent=2))
                     + "\n")


async def _executors(url: str) -> int:
    from bus.catalog import Catalog

    bus = await connect(url, name="toolbus-executors")
    try:
        infos = await Catalog(bus).load_executors()
    finally:
        await bus.close()
    if not infos:
        print("no live executors", file=sys.stderr)
        return EXIT_OK
    for i in infos:
        # Names an executor registered: shown inert, whatever they hold.
        sys.stdout.write(_printable(f"{i.instance}  pool={i.pool}  host={i.host} "
                                    f"pid={i.pid}  tools={','.join(i.tools)}") + "\n")
    return EXIT_OK


# Characters of a pending call's arguments `toolbus approvals` prints before cutting them.
_APPROVAL_ARGUMENTS_SHOWN = 2000


async def _approvals(url: str, args: argparse.Namespace) -> int:
    from bus.approvals import ApprovalStore

    bus = await connect(url, name="toolbus-approvals")
    try:
        pending = await ApprovalStore(bus).load()
    finally:
        await bus.close()
    now = time.time()
    if args.json:
        for p in pending:
            sys.stdout.write(_terminal_json(_json.encode(p)) + "\n")
        return EXIT_OK
    if not pending:
        print("no calls are waiting for approval", file=sys.stderr)
        return EXIT_OK
    for p in pending:
        # The model wrote the arguments: the characters that would reorder or hide what
        # the approver reads shown as their escapes (JSON escapes C0 only), not dropped:
        # what is approved is what runs. Whole, up to a bound: a cut the approver cannot
        # see hides what a padded call does past it.
        args_text = _terminal_json(_json.encode(p.arguments))
        if len(args_text) > _APPROVAL_ARGUMENTS_SHOWN:
            args_text = (f"{args_text[:_APPROVAL_ARGUMENTS_SHOWN]}… "
                         f"({len(args_text) - _APPROVAL_ARGUMENTS_SHOWN} more characters not "
                         "shown: toolbus approvals --json shows them)")
        sys.stdout.write(_printable(
            f"{p.call_id}  session={p.session_id}  {p.tool}  risk={p.risk}  "
            f"age={now - p.requested_at:.0f}s  expires_in={p.expires_at - now:.0f}s\n"
            f"    arguments: {args_text}\n    why: {p.reason} [rule {p.rule}]\n"))
    return EXIT_OK


async def _decide(url: str, args: argparse.Namespace) -> int:
    from bus.approvals import ApprovalStore

    by = args.by or os.environ.get("USER") or "cli"
    body: dict[str, Any] = {"decision": "approve" if args.command == "approve" else "deny",
                            "by": by}
    if args.command == "approve" and args.note:
        body["note"] = args.note
    if args.command == "deny":
        if not args.reason.strip():
            print("toolbus: --reason must say why (the model reads it)", file=sys.stderr)
            return EXIT_USAGE
        body["reason"] = args.reason
    if not is_token(args.call_id):
        print(f"toolbus: invalid call id {quoted(args.call_id)}: `toolbus approvals` lists the "
              "ids of the calls waiting", file=sys.stderr)
        return EXIT_USAGE
    # The approval actor's own bounds (schemas: decide_human), said before connecting.
    if len(by) > 128 or len(body.get("note") or "") > 4000 or \
            len(body.get("reason") or "") > 4000:
        print("toolbus: --by is at most 128 characters; --note and --reason at most 4000",
              file=sys.stderr)
        return EXIT_USAGE
    if args.session is not None:
        check_session_id(args.session)  # before connecting: a usage error, server or not
    bus = await connect(url, name="toolbus-decide")
    try:
        session = args.session
        if session is None:
            matches = [p for p in await ApprovalStore(bus).load() if p.call_id == args.call_id]
            if not matches:
                print(f"toolbus: no pending approval for call {args.call_id}; `toolbus "
                      "approvals` lists them (give --session for one that just expired)",
                      file=sys.stderr)
                return EXIT_CALL_FAILED
            if len(matches) > 1:
                print(f"toolbus: call id {args.call_id} is pending in several sessions "
                      f"({', '.join(p.session_id for p in matches)}); add --session",
                      file=sys.stderr)
                return EXIT_USAGE
            session = matches[0].session_id
        reply = await bus.request(approval_subject(check_session_id(session), args.call_id,
                                                   bus.principal),
                                  _json.encode(body), timeout=10,
                                  who="an approval actor (`toolbus up`)")
    finally:
        await bus.close()
    answer = msgspec.json.decode(reply)
    if answer.get("ok"):
        print(f"{args.call_id}: {answer.get('decision')}", file=sys.stderr)
        return EXIT_OK
    print(f"toolbus: {_printable(answer.get('error'))}", file=sys.stderr)
    return EXIT_CALL_FAILED

