"""The toolbus exception tree.

    ToolbusError
    ├── InvalidIdError            a session id, namespace or tool name is not NATS-token safe
    ├── InvalidRequestError       a request body cannot be accepted (JSON, types, size)
    ├── ConfigError               a setting or command-line option is unusable
    │   ├── ManifestError         a manifest file is invalid (names the key path)
    │   └── ToolConflictError     two sources register the same tool name
    ├── RpcError                  an actor answered a request with an error (has a `code`)
    ├── WorkerError               a worker process of `toolbus up --workers N` failed
    └── BusError                  anything that went wrong talking to NATS
        ├── ConnectError          the server could not be reached
        │   └── AuthError         it refused the credentials
        ├── PermissionDeniedError  NATS refused a publish or subscription for the role
        ├── ServerStartError      the embedded nats-server could not start
        │   └── PortInUseError    its port is taken
        ├── AppendError           an event could not be stored
        │   ├── ConcurrencyError  the session moved on since the writer last read it
        │   └── EventTooLargeError  an event is over the event size limit
        ├── ArtifactError         a large result could not be stored in or read from the
        │                         object store
        └── BusTimeoutError       a bounded wait on the bus ran out

A failing *tool* is never an exception on the bus: it is a `call.failed` event.
"""

from __future__ import annotations


class ToolbusError(Exception):
    """Root of every error toolbus raises on purpose."""


class InvalidIdError(ToolbusError, ValueError):
    def __init__(self, kind: str, value: object, rule: str) -> None:
        self.kind = kind
        self.value = value
        self.rule = rule
        super().__init__(f"invalid {kind} {value!r}: {rule}")


class InvalidRequestError(ToolbusError, ValueError):
    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        self.message = message
        super().__init__(f"{reason}: {message}")


class ConfigError(ToolbusError, ValueError):
    pass


class ManifestError(ConfigError):
    def __init__(self, path: str, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        listed = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"manifest {path} is invalid:\n{listed}")


class ToolConflictError(ConfigError):
    def __init__(self, name: str, registered_by: str, new_source: str) -> None:
        self.name = name
        self.registered_by = registered_by
        self.new_source = new_source
        super().__init__(
            f"tool {name} is already registered by {registered_by}; {new_source} cannot "
            f"register the same name. Rename one of them, or remove the old entry with "
            f"`toolbus tools remove {name}` if {registered_by} is gone for good"
        )


class WorkerError(ToolbusError):
    """A worker process could not start, or kept exiting. `code` is its exit code (None
    if it is still running, negative if a signal ended it)."""

    def __init__(self, worker: str, code: int | None, detail: str) -> None:
        self.worker = worker
        self.code = code
        self.detail = detail
        super().__init__(f"worker {worker} {detail}")


class BusError(ToolbusError):
    pass


class ConnectError(BusError):
    def __init__(self, url: str, detail: str) -> None:
        self.url = url
        self.detail = detail
        super().__init__(
            f"cannot reach NATS at {url}: {detail}. Start one with `toolbus up`, "
            "or point --nats / NATS_URL at a running server"
        )


class AuthError(ConnectError):
    """The server refused the connection's credentials (or their absence)."""

    def __init__(self, url: str, detail: str) -> None:
        self.url = url
        self.detail = detail
        BusError.__init__(
            self,
            f"NATS at {url} refused the connection: {detail}. `toolbus up` writes each "
            "role's URL, with its credentials, to <data-dir>/auth/<role>.url: give "
            "--data-dir (or $TOOLBUS_DATA_DIR), or --nats / $NATS_URL with credentials",
        )


class PermissionDeniedError(BusError):
    """NATS refused a publish or subscription for this connection's role."""


class ServerStartError(BusError):
    pass


class PortInUseError(ServerStartError):
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        super().__init__(
            f"port {port} on {host} is in use: pass --port to start the embedded server on "
            f"another port, or use the server already there with --nats nats://{host}:{port}"
        )


class AppendError(BusError):
    def __init__(self, subject: str, detail: str) -> None:
        self.subject = subject
        self.detail = detail
        super().__init__(f"could not append to {subject}: {detail}")


class ConcurrencyError(AppendError):
    """The expected last sequence of the session did not match: re-read and re-decide."""

    def __init__(self, subject: str, expected: int, detail: str) -> None:
        self.expected = expected
        super().__init__(subject, f"expected last session sequence {expected}; {detail}")


class EventTooLargeError(AppendError):
    """Not retryable: the same event is as large the next time."""

    def __init__(self, subject: str, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        super().__init__(subject, f"the event is {size} bytes; the limit is {limit}")


class ArtifactError(BusError):
    def __init__(self, key: str, detail: str) -> None:
        self.key = key
        self.detail = detail
        super().__init__(f"artifact {key}: {detail}")


class BusTimeoutError(BusError, TimeoutError):
    pass


class RpcError(ToolbusError):
    """An error answer to a request: `code` is stable (match on it), `message` is for
    people. Codes: `invalid` (the request is malformed), `not_found`, `conflict` (e.g.
    already decided), `too_large`, `unavailable` (the bus failed: try again),
    `internal`."""

    def __init__(self, code: str, message: str, **details: str | int | None) -> None:
        self.code = code
        self.message = message
        self.details = details  # more fields of the answer, e.g. who decided first
        super().__init__(message)
