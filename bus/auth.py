"""Roles and permissions on NATS (DESIGN.md, "Roles and permissions").

NATS is the security boundary: what a connection may publish and subscribe to decides
what it can do to toolbus. Four roles, each a NATS user:

- `actor`    toolbus's own processes: the only writer of events, the catalog, snapshots,
             artifacts and pending approvals.
- `client`   publishes requests, reads live events, a session's events (direct gets: no
             consumer is ever created on its behalf), the catalog and stored results; asks
             the session actor for a state. Nothing else.
- `approver` what `client` may, plus approval decisions on
             `toolbus.approval.<sid>.<call_id>.<its user name>` only, so the approval actor
             records who decided as NATS authenticated them.
- `admin`    operators: reads everything, inspects the store and trims it (purge,
             delete a message or a consumer), sends requests and decisions; cannot
             create or change a stream, write an event, the catalog or an approval,
             answer on an actor's inbox or acknowledge an actor's messages.

`actor` and `admin` live in the NATS account TOOLBUS, with the streams; `client` and
`approver` in the account CLIENTS, which reaches TOOLBUS only through the subjects it
imports (`accounts_config`). So no reply subject a client names can point inside
TOOLBUS: a publish acknowledgement or an actor's answer cannot be aimed at an event.

`toolbus up` writes the credentials once into `<data-dir>/auth/` (mode 0600, reused
after): `<role>.url` (a `nats://role:password@host:port` URL) and `<role>.token` (the
HTTP gateway's bearer token for the role). `permissions()` is also what `deploy/nats/`
holds, so the embedded server and a server run by hand enforce the same rules.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Final
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from bus.subjects import (
    APPROVAL_PREFIX,
    APPROVALS_BUCKET,
    ARTIFACTS_BUCKET,
    CATALOG_BUCKET,
        EVENTS_STREAM,
    EXECUTORS_BUCKET,
    LIVE_PREFIX,
    REQUESTS_PREFIX,
    STATE_PREFIX,
)
from schemas.errors import ConfigError

ROLES: Final = ("actor", "client", "approver", "admin")
# The roles that read through direct gets only (no consumers, no JetStream management).
READ_ONLY_ROLES: Final = frozenset({"client", "approver"})


def _read_stream(stream: str) -> list[str]:
    """Reading one stream's messages by direct get: no consumer, and nothing of the
    JetStream API that works only inside the account holding the stream."""
    api = "$JS.API"
    return [f"{api}.DIRECT.GET.{stream}", f"{api}.DIRECT.GET.{stream}.>"]


def permissions(role: str, user: str | None = None) -> dict[str, dict[str, list[str]]]:
    """The NATS permissions of `role` for the user `user` (default: the role's name)."""
    user = user or role
    if role == "actor":
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    if role == "admin":
        # The operator: reads everything, inspects and trims the store (purge, delete a
        # message or a consumer), sends requests and decisions; it cannot create or
        # change a stream (which could capture other subjects), restore one, publish on
        # an actor's inbox or acknowledge an actor's messages.
        api = "$JS.API"
        return {"publish": {"allow": [
            f"{api}.INFO", f"{api}.STREAM.INFO.*", f"{api}.STREAM.LIST",
            f"{api}.STREAM.NAMES", f"{api}.STREAM.MSG.GET.*", f"{api}.DIRECT.GET.>",
            f"{api}.STREAM.PURGE.*", f"{api}.STREAM.MSG.DELETE.*",
            f"{api}.CONSUMER.INFO.*.*", f"{api}.CONSUMER.LIST.*", f"{api}.CONSUMER.NAMES.*",
            f"{api}.CONSUMER.DELETE.*.*",
            f"{REQUESTS_PREFIX}.*", f"{STATE_PREFIX}.*", f"{APPROVAL_PREFIX}.*.*.{user}"]},
                "subscribe": {"allow": [">"]}}
    if role not in ("client", "approver"):
        raise ConfigError(f"unknown role {role!r}: choose from {', '.join(ROLES)}")
    reads = [*_read_stream(EVENTS_STREAM), *_read_stream(f"KV_{CATALOG_BUCKET}"),
             *_read_stream(f"KV_{EXECUTORS_BUCKET}"), *_read_stream(f"OBJ_{ARTIFACTS_BUCKET}")]
    # `toolbus.req.<sid>` only: the stream stores it under its partition, and a subject
    # of more tokens would be stored where no consumer reads.
    publish = [f"{REQUESTS_PREFIX}.*", f"{STATE_PREFIX}.*", *reads]
    if role == "approver":
        publish += [f"{APPROVAL_PREFIX}.*.*.{user}", *_read_stream(f"KV_{APPROVALS_BUCKET}")]
    # Replies only on its own inbox prefix: client and approver share an account, and an
    # approver's answers (pending approvals, their arguments) are not for a client.
    return {"publish": {"allow": publish},
            "subscribe": {"allow": [f"{inbox_prefix(user)}.>", f"{LIVE_PREFIX}.>"]}}


def inbox_prefix(user: str) -> str:
    """Where a user's replies arrive (`<prefix>.<unique>`): `_INBOX_<user>`. toolbus's
    connections use it; another NATS client connecting as `client` or `approver` must set
    it too (nats-py `inbox_prefix=`, the `nats` CLI's `--inbox-prefix`)."""
    return f"_INBOX_{user}"


@dataclass(frozen=True, slots=True)
class Credential:
    role: str
    password: str
    token: str  # the HTTP gateway's bearer token

    def url(self, host: str, port: int) -> str:
        return f"nats://{self.role}:{quote(self.password, safe='')}@{host}:{port}"


class Credentials:
    """The four roles' secrets in `<data_dir>/auth/`, created at the first start."""

    def __init__(self, data_dir: Path) -> None:
        self.dir = Path(data_dir) / "auth"
        self.roles: dict[str, Credential] = {}

    @classmethod
    def ensure(cls, data_dir: Path) -> Credentials:
        """Load the roles' secrets, generating the missing ones (files mode 0600 in a
        mode 0700 folder)."""
        creds = cls(data_dir)
        creds.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(creds.dir, 0o700)
        secrets_file = creds.dir / "secrets.json"
        stored: dict[str, dict[str, str]] = {}
        if secrets_file.exists():
            try:
                stored = json.loads(secrets_file.read_text())
                if not isinstance(stored, dict):
                    raise ValueError("not a JSON object")
            except (OSError, ValueError) as exc:
                raise ConfigError(f"{secrets_file} is unreadable ({exc}): delete the folder "
                                  f"{creds.dir} to issue new credentials") from exc
        changed = False
        for role in ROLES:
            entry = stored.get(role)
            if not isinstance(entry, dict) or not isinstance(entry.get("password"), str) \
                    or not isinstance(entry.get("token"), str) or not entry["password"] \
                    or not entry["token"]:
                entry = {"password": secrets.token_urlsafe(24),
                         "token": secrets.token_urlsafe(32)}
                stored[role] = entry
                changed = True
            creds.roles[role] = Credential(role, entry["password"], entry["token"])
        if changed:
            _write_private(secrets_file, json.dumps(stored, indent=2) + "\n")
        for role, cred in creds.roles.items():
            if role != "actor":  # the gateway has no actor token
                _write_private(creds.dir / f"{role}.token", cred.token + "\n")
        return creds

    def write_urls(self, host: str, port: int) -> None:
        """`<role>.url` for the server's current address (the port may change)."""
        for role, cred in self.roles.items():
            _write_private(self.dir / f"{role}.url", cred.url(host, port) + "\n")

    def url(self, role: str, host: str, port: int) -> str:
        return self.roles[role].url(host, port)

    def tokens(self) -> dict[str, str]:
        """The gateway's bearer tokens: token -> role (the `actor` role has none)."""
        return {c.token: c.role for c in self.roles.values() if c.role != "actor"}

    def server_config(self) -> str:
        """The `accounts` block of the embedded server's config: every role a user, no
        anonymous user."""
        return accounts_config({r: json.dumps(c.password) for r, c in self.roles.items()})


# Who lives in which NATS account. Streams, buckets and actors are in TOOLBUS; clients and
# approvers in CLIENTS, which sees only what TOOLBUS exports to it. Their publishes reach
# TOOLBUS through service imports, whose answers travel on private `_R_` subjects: a
# client's reply subject can never name an event, a catalog key or an actor's inbox, so
# neither a publish acknowledgement nor an actor's answer can be aimed at one.
TOOLBUS_ACCOUNT: Final = "TOOLBUS"
CLIENTS_ACCOUNT: Final = "CLIENTS"
_ACCOUNT_OF: Final = {"actor": TOOLBUS_ACCOUNT, "admin": TOOLBUS_ACCOUNT,
                      "client": CLIENTS_ACCOUNT, "approver": CLIENTS_ACCOUNT}


def _exports() -> list[dict[str, str]]:
    """What TOOLBUS offers CLIENTS: the subjects the read-only roles may publish (each a
    service; direct gets answer with a stream of messages) and the live events."""
    subjects = sorted({*permissions("client")["publish"]["allow"],
                       *permissions("approver", "*")["publish"]["allow"]})
    out = [{"service": s, **({"response_type": "stream"} if ".DIRECT.GET." in s else {})}
           for s in subjects]
    return [*out, {"stream": f"{LIVE_PREFIX}.>"}]


def accounts_config(passwords: dict[str, str]) -> str:
    """The `accounts` block for nats-server: `passwords` maps each role to its password
    as a config value (a JSON string, or a `$VARIABLE` reference)."""
    lines = ["accounts {"]
    for account in (TOOLBUS_ACCOUNT, CLIENTS_ACCOUNT):
        lines.append(f"  {account} {{")
        if account == TOOLBUS_ACCOUNT:
            lines.append("    jetstream: enabled")
        lines.append("    users: [")
        for role in ROLES:
            if _ACCOUNT_OF[role] != account:
                continue
            perms = json.dumps(permissions(role), indent=2).replace("\n", "\n        ")
            lines.append(f'      {{user: "{role}", password: {passwords[role]},')
            lines.append(f"        permissions: {perms}}}")
        lines.append("    ]")
        if account == TOOLBUS_ACCOUNT:
            lines.append("    exports: [")
            lines += [f"      {json.dumps(e)}" for e in _exports()]
        else:
            lines.append("    imports: [")
            for e in _exports():
                kind = "service" if "service" in e else "stream"
                lines.append("      " + json.dumps(
                    {kind: {"account": TOOLBUS_ACCOUNT, "subject": e[kind]}}))
        lines += ["    ]", "  }"]
    lines.append("}")
    return "\n".join(lines) + "\n"


def deploy_roles_conf() -> str:
    """`deploy/nats/roles.conf`: the same users and permissions for a server run by hand,
    each password from an environment variable of the server (`TOOLBUS_<ROLE>_PASSWORD`);
    a test keeps the file equal to this."""
    head = ["# The roles of bus/auth.py (DESIGN.md, \"Roles and permissions\"), for nats-server:",
            "# generated from bus/auth.py (accounts_config); a test checks they match. Each",
            "# password comes from the server's environment: see deploy/nats/README.md."]
    return "\n".join(head) + "\n" + accounts_config(
        {role: f"${password_variable(role)}" for role in ROLES})


def password_variable(role: str) -> str:
    return f"TOOLBUS_{role.upper()}_PASSWORD"


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable by its owner only, whatever the umask."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_role_url(data_dir: Path, role: str) -> str | None:
    """The URL `toolbus up` wrote for `role` in `data_dir`, None if there is none."""
    try:
        text = (Path(data_dir) / "auth" / f"{role}.url").read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read the {role} credentials in {data_dir}/auth: "
                          f"{exc.strerror}") from exc
    except UnicodeDecodeError:
        raise ConfigError(f"the {role} credentials in {data_dir}/auth/{role}.url are not "
                          "UTF-8 text: restore the file, or remove it and start `toolbus "
                          "up` again") from None
    return text or None


def redact(url: str) -> str:
    """`url` (or a comma-separated list of them) without passwords or tokens: fit for a
    log line, an error message or a banner."""
    return ",".join(_redact_one(u) for u in url.split(","))


def _redact_one(url: str) -> str:
    text = url.strip()
    # nats-py reads a URL without a scheme as nats:// (`client:PW@host:4222`), so must this;
    # text with spaces is a message, not a URL.
    bare = "://" not in text and not any(c.isspace() for c in text)
    try:
        parts = urlsplit(f"nats://{text}" if bare else text)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "<unparsable URL>"
    if parts.username is None and parts.password is None:
        return text
    user = unquote(parts.username or "")
    who = f"{user}:***@" if parts.password is not None else "***@"
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{who}{host}" + (f":{port}" if port is not None else "")
    out = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return out.removeprefix("nats://") if bare else out
