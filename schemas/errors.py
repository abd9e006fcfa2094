"""The toolbus exception tree.

    ToolbusError
    ├── InvalidIdError            a session id, namespace or tool name is not NATS-token safe
    ├── InvalidRequestError       a request body cannot be accepted (JSON, types, size)
    ├── ConfigError               a setting or command-line option is unusable
    │   ├── ManifestError         a manifest file is invalid (names the key path)
    │   └── ToolConflictError     two sources register the same tool name
    ├── RpcError                  an actor answered a request with an error (has a `code`)
    ├── WorkerError               a worker process of `toolbus up --workers N` failed
    ├── ModelError                an LLM provider call failed (has `kind`, `status`,
    │                             `retryable`; quotes the provider's message, never a key)
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
        super().__init__(f"invalid {kind} {quoted(value)}: {rule}")


def quoted(value: object, limit: int = 200) -> str:
    """`value` as an error message quotes it: its repr, cut past `limit` characters (an
    id of 100,000 characters is not printed back whole)."""
    from schemas.events import clip  # the one cut of free text, events' too

    return clip(repr(value), limit)


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


class ModelError(ToolbusError):
    """A call to an LLM provider failed. `kind` is stable (match on it): `auth` (401/403:
    fix the key), `bad_request` (400 and other 4xx: the request is wrong as sent),
    `rate_limited` (429 after the retries ran out), `unavailable` (connection errors, 408,
    409, 5xx after the retries ran out), `partial_stream` (the stream broke after some
    text was already delivered: `partial` is True and the call was not retried, because
    the deltas already published belong to a reply that will never complete). The call
    has no side effects, so a `retryable` one may be made again whole. `message` is the
    provider's own, clipped and with anything key-like removed."""

    _ADVICE = {
        "auth": "check the API key the manifest gives this model (its ${VAR})",
        "bad_request": "the provider refused the request as sent: fix the model settings "
                       "or the conversation",
        "rate_limited": "try again later, or lower the request rate",
        "unavailable": "try again later",
        "partial_stream": "the call may be made again whole; the text already delivered "
                          "belongs to no reply",
    }

    def __init__(self, kind: str, message: str, *, provider: str, status: int | None = None,
                 retryable: bool = False, attempts: int = 1,
                 retry_after_s: float | None = None) -> None:
        self.kind = kind
        self.message = message
        self.provider = provider
        self.status = status
        self.retryable = retryable
        self.attempts = attempts
        self.retry_after_s = retry_after_s  # the server's wait hint, for the retry loop
        answered = f"answered {status}" if status is not None else "failed"
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        super().__init__(f"{provider} {answered} ({kind}){tries}: {message.rstrip('.')}. "
                         f"{self._ADVICE.get(kind, 'see the message')}")

    @property
    def partial(self) -> bool:
        return self.kind == "partial_stream"

    def after(self, attempts: int, note: str = "") -> ModelError:
        """The same failure, told as the last of `attempts` (with a note on why no more)."""
        message = f"{self.message}; {note}" if note else self.message
        return ModelError(self.kind, message, provider=self.provider, status=self.status,
                          retryable=self.retryable, attempts=attempts,
                          retry_after_s=self.retry_after_s)


class BusError(ToolbusError):
    pass


class ConnectError(BusError):
    def __init__(self, url: str, detail: str, *,
                 hint: str = "Start one with `toolbus up`, or point --nats / NATS_URL at "
                             "a running server") -> None:
        self.url = url
        self.detail = detail
        super().__init__(f"cannot reach NATS at {url}: {detail}. {hint}")


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


class ConnectionLostError(BusTimeoutError):
    """The connection to NATS was lost while waiting and did not come back in time: what
    was waited for goes on without the waiter (nothing can be sent to stop it)."""


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
