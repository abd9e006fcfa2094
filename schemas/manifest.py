"""The manifest: one YAML file declaring the tools a deployment serves.

    version: 1
    pools:                        # executor pools besides `default`
      sandbox: {description: isolated machines for code}
    tools:
      builtins: [echo, current_time]
      modules: [mypkg.tools]      # Python tool modules (the SDK)
      http:
        - name: tickets:create_ticket
          description: Open a support ticket.
          base_url: ${TICKETS_URL}
          allowed_methods: [POST]
      files: {root: ./workspace}
      code: {pool: sandbox}
      git: {repo: .}
      web_search: {provider: tavily}   # key from TAVILY_API_KEY unless api_key is set
    mcps: [...]                   # MCP servers (McpServerConfig)
    policy: {...}                 # who may run what (schemas/policy.py)
    agent_config:                 # the agent half, seed 000's section (AgentConfig)
      model: {provider: openai, model: gpt-4o-mini, api_key: ${OPENAI_API_KEY}}
      instructions: ...
      context: {reevaluation_tools: [{id: crm:authenticate_customer}]}
      policies: [{id: ..., when: ..., action: ..., tools: [...]}]

`${VAR}` is replaced by the environment variable VAR (an error naming it if it is unset),
`${VAR:-fallback}` falls back when it is unset or empty, `$${` is a literal `${`. Relative
paths are relative to the manifest's folder (`with_base_dir`). Every error names its key
path.

Pure: the caller passes the text and the environment in.
"""

from __future__ import annotations

import difflib
import itertools
import re
from collections.abc import Callable, Collection, Mapping
from typing import Annotated, Any, Literal

import jsonschema_rs
import pydantic
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    field_validator,
    model_validator,
)

from schemas.errors import ConfigError, InvalidIdError, ManifestError
from schemas.ids import check_namespace, split_tool_name
from schemas.policy import DEFAULT_AGENT, DEFAULT_SIDE_EFFECT_PATTERNS, Policy
from schemas.requests import json_values
from schemas.tools import DEFAULT_POOL
from schemas.validation import Validator

HttpMethod = Literal["GET", "HEAD", "OPTIONS", "POST", "PUT", "PATCH", "DELETE"]
BUILTIN_NAMES = ("echo", "current_time")



def usable_headers(value: dict[str, str]) -> dict[str, str]:
    """Header values as they can be sent: the spaces around each dropped, and one holding
    a line break or another control character refused, naming the header and not its
    value (it may be a secret, and a line break would start a header of its own)."""
    out = {}
    for name, text in value.items():
        if not name or any(not 0x21 <= ord(c) <= 0x7E or c in '"(),/:;<=>?@[\\]{}'
                           for c in name):
            raise ValueError(f"header name {name[:40]!r} is not a token")
        text = text.strip()
        if any((ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F for c in text):
            raise ValueError(f"header {name}: its value holds a line break or a control "
                             "character (its value is not shown)")
        out[name] = text
    return out


def usable_key(value: str | None) -> str | None:
    """An API key as it can go in an HTTP header: the spaces and line ends around it (a
    key read from a file) dropped, None for an empty one. A key holding anything else no
    header may carry is refused, without quoting it: sent, it would fail every request,
    and the HTTP library's error would quote it in full."""
    if value is None:
        return None
    key = value.strip()
    if any(not 0x21 <= ord(c) <= 0x7E for c in key):
        raise ValueError("the key holds a space, a line break, a control or a non-ASCII "
                         "character, which no HTTP header may carry (a file with CRLF "
                         "line ends?); its value is not shown")
    return key or None


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


PoolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,128}$")]


def _http_base_url(v: str | None, advice: str) -> str | None:
    """A `base_url`: an absolute http(s) URL, without credentials (`user:password@`),
    which would show wherever the URL does (refused before the URL is quoted)."""
    authority = re.split(r"[/?#]", (v or "").split("://", 1)[-1], maxsplit=1)[0]
    if "@" in authority:
        raise ValueError(f"base_url must not carry credentials (user:password@ before the "
                         f"host): they would show wherever the URL does; {advice}")
    if v is not None and not re.match(r"^https?://[^/?#]+", v):
        raise ValueError(f"base_url must be an absolute http(s) URL, got {v!r}")
    return v


class HttpToolConfig(_Model):
    """The configurable HTTP tool of seed 002, under a name of the manifest's choosing."""

    name: str
    description: str = ""
    base_url: str | None = None
    allowed_methods: list[HttpMethod] = ["GET", "HEAD"]
    default_method: HttpMethod | None = None
    default_headers: Annotated[dict[str, str], pydantic.AfterValidator(usable_headers)] = {}
    default_query: dict[str, str | int | float | bool] = {}
    timeout_ms: Annotated[int, Field(gt=0, le=600_000)] = 10_000
    auto_approve: bool = False
    response_format: Literal["auto", "json", "text"] = "auto"
    max_response_chars: Annotated[int, Field(gt=0)] = 20_000
    # Hosts the tool may reach ("api.example.com", "*.example.com"); empty means any.
    allowed_hosts: list[str] = []
    # Link-local and cloud metadata addresses (169.254.0.0/16, fe80::/10, ...) are
    # refused unless this is true.
    allow_link_local: bool = False
    # Loopback, private, shared, multicast and other non-public addresses are refused
    # unless this is true, or the host is listed by its exact name in allowed_hosts.
    allow_private: bool = False
    # Body bytes read from the network at most; the rest is cut (`truncated: true`).
    max_response_bytes: Annotated[int, Field(gt=0)] = 1_048_576
    pool: PoolName = DEFAULT_POOL

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        try:
            split_tool_name(v)
        except InvalidIdError as exc:
            raise ValueError(str(exc)) from exc
        return v

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, v: str | None) -> str | None:
        return _http_base_url(v, "send them as default_headers (Authorization: ${VAR})")

    @field_validator("allowed_methods")
    @classmethod
    def _methods(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("allowed_methods is empty; list at least one method")
        return list(dict.fromkeys(v))

    @model_validator(mode="after")
    def _default_method(self) -> HttpToolConfig:
        if self.default_method is not None and self.default_method not in self.allowed_methods:
            raise ValueError(f"default_method {self.default_method} is not one of "
                             f"allowed_methods {self.allowed_methods}")
        return self


class FilesConfig(_Model):
    root: str
    max_read_chars: Annotated[int, Field(gt=0)] = 100_000
    pool: PoolName = DEFAULT_POOL


class CodeConfig(_Model):
    languages: list[Literal["python", "shell"]] = ["python"]
    timeout_ms: Annotated[int, Field(gt=0, le=3_600_000)] = 10_000
    cpu_seconds: Annotated[int, Field(gt=0)] = 10
    memory_mb: Annotated[int, Field(gt=16)] = 512
    max_output_bytes: Annotated[int, Field(gt=0)] = 32 * 1024
    pool: PoolName = DEFAULT_POOL
    # sandbox: bubblewrap, or the executor refuses to start; process: a plain subprocess
    # that sees the executor's files and network (only where that is acceptable).
    isolation: Literal["sandbox", "process"] = "sandbox"
    network: bool = False  # sandbox only: share the host's network (127.0.0.1 included)
    # sandbox only: per run. 16 keeps the memory bound at 16 x memory_mb (8 GB).
    max_processes: Annotated[int, Field(ge=4, le=4096)] = 16


class GitConfig(_Model):
    repo: str
    allow_write: bool = False  # also register built-in:git, which runs any subcommand
    # built-in:git_read runs git in the code tool's bubblewrap sandbox, seeing only the
    # repository (read-only) and the system's folders, without network; `process` runs
    # it as a plain subprocess of the executor (argument checks only).
    isolation: Literal["sandbox", "process"] = "sandbox"
    timeout_ms: Annotated[int, Field(gt=0)] = 30_000
    max_output_bytes: Annotated[int, Field(gt=0)] = 32 * 1024
    pool: PoolName = DEFAULT_POOL


class WebSearchConfig(_Model):
    provider: Literal["tavily"] = "tavily"
    # Else the provider's variable (TAVILY_API_KEY).
    api_key: Annotated[str | None, pydantic.AfterValidator(lambda v: usable_key(v))] = None
    base_url: str = "https://api.tavily.com"
    max_results: Annotated[int, Field(gt=0, le=20)] = 5
    timeout_ms: Annotated[int, Field(gt=0)] = 15_000
    pool: PoolName = DEFAULT_POOL


class ToolsSection(_Model):
    builtins: list[Literal["echo", "current_time"]] = ["echo", "current_time"]
    modules: list[str] = []
    http: list[HttpToolConfig] = []
    files: FilesConfig | None = None
    code: CodeConfig | None = None
    git: GitConfig | None = None
    web_search: WebSearchConfig | None = None
    # Tools with a schema and no implementation: the planner's model runs them (seed 001).
    latent: list[LatentToolConfig] = []

    @field_validator("http")
    @classmethod
    def _unique(cls, v: list[HttpToolConfig]) -> list[HttpToolConfig]:
        seen: set[str] = set()
        for item in v:
            if item.name in seen:
                raise ValueError(f"two http tools are named {item.name}")
            seen.add(item.name)
        return v


McpTransport = Literal["streamable-http", "sse", "stdio"]
_DEFAULT_PATHS = {"streamable-http": "/mcp", "sse": "/sse"}
_DEFAULT_MAX_TIMEOUT_MS = 600_000
# A stdio argument after one of these flags (or `--flag=value`) is not shown in errors.
_SECRET_FLAG = re.compile(r"^--?[\w-]*(key|token|secret|password|passwd|auth)[\w-]*$", re.I)


class McpServerConfig(_Model):
    """One MCP server (seed 000's `mcps` entries, plus seed 003's stdio and SSE)."""

    id: str  # the namespace of its tools
    transport: McpTransport = "streamable-http"
    # streamable-http / sse
    hostname: str | None = None  # with scheme, host only: http://cars-mcp
    port: Annotated[int, Field(ge=1, le=65535)] | None = None
    path: str | None = None  # default /mcp (/sse for SSE)
    api_key: Annotated[str | None, pydantic.AfterValidator(lambda v: usable_key(v))] = None
    headers: Annotated[dict[str, str], pydantic.AfterValidator(usable_headers)] = {}
    # stdio
    command: str | None = None
    args: list[str] = []
    # The server's environment: these over the SDK's defaults (HOME, LOGNAME, PATH, SHELL,
    # TERM, USER); nothing else of toolbus's is passed on. Secrets: `TOKEN: ${TOKEN}`.
    env: dict[str, str] = {}
    cwd: str | None = None
    # behaviour
    # A call fails `timeout` after this long without a progress notification; each one
    # pushes the deadline out again, never past max_timeout_ms (default: 10 minutes, or
    # timeout_ms if that is longer) from the call's start.
    timeout_ms: Annotated[int, Field(gt=0)] = 30_000
    max_timeout_ms: Annotated[int, Field(gt=0)] | None = None
    # Start-up (spawn or connect, handshake, tools/list) fails after this; also how long
    # a call waits for a reconnection. `connect_timeout_ms` is accepted too.
    connect_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    refresh_s: Annotated[float, Field(gt=0)] = 60.0  # periodic tools/list
    # An untrusted server's annotations are not believed by the policy: its "read-only"
    # tools still need approval, and count as risky.
    trusted: bool = True
    pool: PoolName = DEFAULT_POOL

    @model_validator(mode="before")
    @classmethod
    def _connect_timeout_ms(cls, data: Any) -> Any:
        # The older spelling, in milliseconds.
        if isinstance(data, dict) and "connect_timeout_ms" in data:
            data = dict(data)
            if "connect_timeout_s" in data:
                raise ValueError("give connect_timeout_s or connect_timeout_ms, not both")
            ms = data.pop("connect_timeout_ms")
            if isinstance(ms, bool) or not isinstance(ms, int | float | str):
                raise ValueError(f"connect_timeout_ms must be a number, got {ms!r}")
            try:
                data["connect_timeout_s"] = float(ms) / 1000
            except ValueError:
                raise ValueError(f"connect_timeout_ms must be a number, got {ms!r}") from None
        return data

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        try:
            check_namespace(v)
        except InvalidIdError as exc:
            raise ValueError(str(exc)) from exc
        return v

    @field_validator("hostname")
    @classmethod
    def _hostname(cls, v: str | None) -> str | None:
        if v is None:
            return v
        m = re.fullmatch(r"(https?)://([^/:?#@\s]+|\[[0-9a-fA-F:]+\])(.*)", v)
        if m is None:
            raise ValueError(f"hostname {v!r} must start with http:// or https:// and name a "
                             "host, e.g. http://cars-mcp")
        rest = m.group(3)
        if rest.rstrip("/"):
            what = ("a port (use the port key)" if rest.startswith(":") else
                    "a query" if rest.startswith("?") else "a path (use the path key)")
            raise ValueError(f"hostname {v!r} contains {what}; give the scheme and host only")
        return v.rstrip("/")

    @field_validator("path")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError(f"path {v!r} must start with /")
        return v

    @model_validator(mode="after")
    def _per_transport(self) -> McpServerConfig:
        if self.transport == "stdio":
            if not self.command:
                raise ValueError(f"mcps {self.id}: a stdio server needs command")
            wrong = [k for k in ("hostname", "port", "path", "api_key")
                     if getattr(self, k) is not None]
            if wrong or self.headers:
                raise ValueError(f"mcps {self.id}: {', '.join(wrong or ['headers'])} "
                                 "do not apply to a stdio server")
        else:
            if self.hostname is None or self.port is None:
                raise ValueError(f"mcps {self.id}: a {self.transport} server needs hostname "
                                 "and port")
            if self.command is not None or self.args or self.env or self.cwd is not None:
                raise ValueError(f"mcps {self.id}: command, args, env and cwd apply only to "
                                 "stdio servers")
        if self.max_timeout_ms is not None and self.max_timeout_ms < self.timeout_ms:
            raise ValueError(f"mcps {self.id}: max_timeout_ms {self.max_timeout_ms} is below "
                             f"timeout_ms {self.timeout_ms}")
        return self

    @property
    def timeout_s(self) -> float:
        return self.timeout_ms / 1000

    @property
    def max_timeout_s(self) -> float:
        """The most a call may take, however much progress it reports."""
        return max(self.timeout_ms, self.max_timeout_ms or _DEFAULT_MAX_TIMEOUT_MS) / 1000

    @property
    def url(self) -> str | None:
        if self.transport == "stdio":
            return None
        return f"{self.hostname}:{self.port}{self.path or _DEFAULT_PATHS[self.transport]}"

    @property
    def http_headers(self) -> dict[str, str]:
        out = dict(self.headers)
        if self.api_key:
            out["Authorization"] = f"Bearer {self.api_key}"
        return out

    def describe(self) -> str:
        """What is tried to reach it, for errors (never the key)."""
        if self.transport == "stdio":
            return f"stdio command {' '.join([self.command or '', *_shown_args(self.args)])}"
        url, query, _ = (self.url or "").partition("?")
        return f"{self.transport} {url}{'?...' if query else ''}"  # a query may hold a key


def _shown_args(args: list[str]) -> list[str]:
    """A stdio server's arguments with the values of key, token and password flags hidden."""
    shown: list[str] = []
    hide = False
    for a in args:
        flag, eq, _ = a.partition("=")
        if hide:
            shown.append("***")
        elif eq and _SECRET_FLAG.match(flag):
            shown.append(f"{flag}=***")
        else:
            shown.append(a)
        hide = not eq and bool(_SECRET_FLAG.match(a))
    return shown


class RiskConfig(_Model):
    block_at: Annotated[int, Field(ge=0, le=10)] | None = None
    approve_at: Annotated[int, Field(ge=0, le=10)] | None = None


class GrantConfig(_Model):
    tools: list[str]


class PolicyConfig(_Model):
    """schemas/policy.py explains each rule."""

    allow: list[str] = []
    deny: list[str] = []
    auto_approve: list[str] = []
    risk: RiskConfig = RiskConfig()
    approval_timeout_s: Annotated[float, Field(gt=0)] = 900.0
    agents: dict[str, GrantConfig] = {}
    # The agent a request that names none is, for `agents` grants.
    default_agent: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,128}$")] = DEFAULT_AGENT
    sessions: dict[str, GrantConfig] = {}
    side_effect_patterns: list[str] = list(DEFAULT_SIDE_EFFECT_PATTERNS)
    max_parallel: Annotated[int, Field(ge=1, le=64)] = 3
    max_calls_per_turn: Annotated[int, Field(ge=1, le=1024)] = 64

    def to_policy(self) -> Policy:
        return Policy(allow=tuple(self.allow), deny=tuple(self.deny),
                      auto_approve=tuple(self.auto_approve), block_at=self.risk.block_at,
                      approve_at=self.risk.approve_at,
                      approval_timeout_s=self.approval_timeout_s,
                      agents={k: tuple(v.tools) for k, v in self.agents.items()},
                      sessions={k: tuple(v.tools) for k, v in self.sessions.items()},
                      side_effect_patterns=tuple(self.side_effect_patterns),
                      max_parallel=self.max_parallel, default_agent=self.default_agent)


class PoolConfig(_Model):
    description: str = ""


# --- the agent half: `agent_config:` ------------------------------------------------------
#
# Seed 000's section, and toolbus's one place for everything the planner needs: the model,
# the instructions, the output schema, the limits, the reevaluation tools, the behaviour
# policies (not to be confused with the top-level `policy:`, which decides who may run
# which tool), named agents and think steps. It also takes seed 000's `mcps:` list.

# Tools the planner itself provides (seed 000's built-ins): not in any server's catalog.
PLANNER_TOOLS = ("built-in:reason", "built-in:emit_output")
AGENT_TOOL_NAMESPACE = "agent"  # `agent:<name>` runs the named agent as a tool
Token = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,128}$")]


def _tool_name(v: str) -> str:
    try:
        split_tool_name(v)
    except InvalidIdError as exc:
        raise ValueError(str(exc)) from exc
    return v


ToolName = Annotated[str, pydantic.AfterValidator(_tool_name)]


def _tool_glob(v: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.:*?-]{1,257}", v) or (":" not in v and v != "*"):
        raise ValueError(f"tool pattern {v!r}: write namespace:tool, with * and ? as "
                         "wildcards, e.g. cars:* or built-in:echo")
    return v


ToolGlob = Annotated[str, pydantic.AfterValidator(_tool_glob)]


def _json_schema(v: dict[str, Any]) -> dict[str, Any]:
    try:
        jsonschema_rs.validator_for(v, offline=True)
    except (jsonschema_rs.ValidationError, ValueError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"not a valid JSON Schema: {first}") from exc
    try:
        Validator(v)  # refused as the planner would refuse it: too costly to check
    except ConfigError as exc:
        raise ValueError(str(exc)) from exc
    return v


JsonSchema = Annotated[dict[str, Any], pydantic.AfterValidator(_json_schema)]


def _jmespath(v: str) -> str:
    try:
        import jmespath  # the dependency is declared; a trimmed install skips the check
    except ImportError:
        return v
    try:
        jmespath.compile(v)
    except jmespath.exceptions.JMESPathError as exc:
        why = str(exc).splitlines()[0].removeprefix("Invalid jmespath expression: ")
        at = getattr(exc, "lex_position", None)
        raise ValueError(f"when_state {v!r} is not a JMESPath expression: "
                         f"{why.rstrip(': ')}{f' (at character {at})' if at is not None else ''}"
                         ) from exc
    except RecursionError:
        # JMESPath's parser recurses once per level of nesting.
        raise ValueError(f"when_state ({len(v)} characters) nests too deeply for a JMESPath "
                         "parser; write it with fewer nested brackets, parentheses or "
                         "negations") from None
    return v


class LatentToolConfig(_Model):
    """A latent tool (seed 001): declared with its parameters and `output_schema`, and no
    implementation. The planner's process runs it as one structured model call whose
    answer must match `output_schema` (actors/latent.py), so it is offered, approved and
    dispatched as any tool, and stored with the executor `latent`."""

    name: ToolName
    description: str = ""
    parameters: JsonSchema = {"type": "object", "properties": {}}
    output_schema: JsonSchema


class ModelConfig(_Model):
    """Which LLM the planner calls, and how."""

    provider: Literal["openai", "openai-responses", "anthropic", "gemini"]
    model: Annotated[str, Field(min_length=1)]
    base_url: str | None = None  # any server speaking the provider's API
    # Only ever from a variable (`${OPENAI_API_KEY}`): parse_manifest refuses a key
    # written in the file. Empty (`${KEY:-}`) means none, for local servers.
    api_key: str | None = Field(default=None, repr=False)
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    max_tokens: Annotated[int, Field(gt=0)] | None = None  # per reply
    timeout_s: Annotated[float, Field(gt=0, le=3600)] = 60.0  # per model call
    max_retries: Annotated[int, Field(ge=0, le=20)] = 4  # retryable provider errors

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, v: str | None) -> str | None:
        v = _http_base_url(v, "and they would go as Basic auth in place of the key: "
                              "give the key as api_key: ${VAR}")
        if v and re.search(r"[?#]", v):
            # The API's path goes after it (a query would end up before the path), and a
            # key given as `?key=` would show wherever the URL does.
            raise ValueError("base_url must not have a query (?...) or fragment (#...): "
                             "the API's path is added after it; give the key as "
                             "api_key: ${VAR}")
        return v.rstrip("/") if v else v

    @field_validator("api_key")
    @classmethod
    def _no_empty_key(cls, v: str | None) -> str | None:
        return usable_key(v)


class LimitsConfig(_Model):
    max_iterations: Annotated[int, Field(ge=1, le=1000)] = 25  # model calls in one turn
    max_reevaluations: Annotated[int, Field(ge=0, le=100)] = 3  # per turn
    max_tokens_per_turn: Annotated[int, Field(gt=0)] | None = None
    # A call rejected for its arguments goes back to the model this many times.
    max_argument_retries: Annotated[int, Field(ge=0, le=20)] = 2
    # Calls of agents (`agent:<name>`) one turn may make in a session a client started;
    # half as many (at least one) at each level of agents calling agents below it, so a
    # model talked into calling agents that call agents runs a bounded tree of turns.
    max_agent_calls: Annotated[int, Field(ge=0, le=1024)] = 8


class ToolRef(_Model):
    id: ToolName


# A view or a recall page is stored in an event: 20,000 characters stay under the event
# limit even when every one is escaped in JSON (6 bytes).
MAX_COMPRESSION_BUDGET = 20_000


class ToolCompression(_Model):
    budget: Annotated[int, Field(ge=200, le=MAX_COMPRESSION_BUDGET)] | None = None
    preview_items: Annotated[int, Field(ge=0, le=50)] | None = None


class CompressionConfig(_Model):
    """Tool result compression (seed 003): a result whose text is longer than `budget`
    characters reaches the model as a structured preview under a key `_tool_result_N`
    (`built-in:recall` reads the rest); `tools` sets either per tool."""

    budget: Annotated[int, Field(ge=200, le=MAX_COMPRESSION_BUDGET)] = 800
    preview_items: Annotated[int, Field(ge=0, le=50)] = 3
    # A page of `built-in:recall`: asked for, so larger than a preview.
    recall_budget: Annotated[int, Field(ge=200, le=MAX_COMPRESSION_BUDGET)] = 4000
    tools: dict[ToolName, ToolCompression] = {}

    def for_tool(self, tool: str) -> tuple[int, int]:
        """(budget, preview items) for the results of `tool`."""
        own = self.tools.get(tool)
        if own is None:
            return self.budget, self.preview_items
        return (own.budget if own.budget is not None else self.budget,
                own.preview_items if own.preview_items is not None else self.preview_items)


# What the model reads of a session's earlier turns, in characters (about 50,000 tokens):
# within every current model's context window, with room for the turn itself.
DEFAULT_MAX_HISTORY_CHARS = 200_000


class ContextConfig(_Model):
    # After a successful call of one of these, the turn's policies are decided again.
    reevaluation_tools: list[ToolRef] = []
    compression: CompressionConfig = CompressionConfig()
    # The earlier turns and injected tool events a model call carries, at most (null: all
    # of them); the oldest are left out first (actors/planner.py, `_Window`).
    max_history_chars: Annotated[int, Field(ge=1000)] | None = DEFAULT_MAX_HISTORY_CHARS


class ThinkStep(_Model):
    """A typed inference (`built-in:reason`); its output lands in the step outputs."""

    id: Token
    instruction: Annotated[str, Field(min_length=1)]
    output_schema: JsonSchema


class AgentPolicy(_Model):
    """One behaviour rule of seed 000: when it applies, what to do, with which tools."""

    id: Token
    when: str | None = None  # natural language, judged by the model
    when_state: Annotated[str, pydantic.AfterValidator(_jmespath)] | None = None
    action: Annotated[str, Field(min_length=1)]
    tools: list[ToolName] = []
    reevaluate_after: list[ToolName] = []
    think: ThinkStep | None = None

    @field_validator("reevaluate_after", mode="before")
    @classmethod
    def _ids(cls, v: Any) -> Any:
        # Also seed 000's global form, `- id: crm:authenticate_customer`.
        if isinstance(v, list):
            return [x["id"] if isinstance(x, dict) and set(x) == {"id"} else x for x in v]
        return v

    @model_validator(mode="after")
    def _one_condition(self) -> AgentPolicy:
        if self.when is not None and self.when_state is not None:
            raise ValueError(f"policy {self.id}: give when (natural language) or when_state "
                             "(JMESPath over the session state), not both")
        return self


class AgentDef(_Model):
    """A named agent, offered to the others as the tool `agent:<name>`."""

    instructions: Annotated[str, Field(min_length=1)]
    model: ModelConfig | None = None  # default: agent_config.model
    tools: list[ToolGlob] = []
    output_schema: JsonSchema | None = None
    compression: CompressionConfig | None = None  # default: agent_config.context's
    mode: Literal["native", "composed"] | None = None  # default: agent_config.mode


class AgentConfig(_Model):
    mcps: list[McpServerConfig] = []  # seed 000's place; merged into Manifest.mcps
    model: ModelConfig | None = None
    instructions: str = ""
    output_schema: JsonSchema | None = None  # the final answer (`built-in:emit_output`)
    # native: the provider's tool calling; composed: seed 001's one composed schema.
    mode: Literal["native", "composed"] = "native"
    limits: LimitsConfig = LimitsConfig()
    context: ContextConfig = ContextConfig()
    policies: list[AgentPolicy] = []
    think: list[ThinkStep] = []  # run at the start of each turn
    agents: dict[Token, AgentDef] = {}

    @field_validator("mcps")
    @classmethod
    def _unique_ids(cls, v: list[McpServerConfig]) -> list[McpServerConfig]:
        return _unique_server_ids(v)

    @model_validator(mode="after")
    def _consistent(self) -> AgentConfig:
        seen: dict[str, str] = {}
        for where, ident in [(f"policies[{i}].id", p.id) for i, p in enumerate(self.policies)]:
            if ident in seen:
                raise ValueError(f"{where}: policy id {ident} is also {seen[ident]}")
            seen[ident] = where
        steps = [(f"think[{i}].id", t.id) for i, t in enumerate(self.think)]
        steps += [(f"policies[{i}].think.id", p.think.id)
                  for i, p in enumerate(self.policies) if p.think is not None]
        seen = {}
        for where, ident in steps:  # one namespace: the step outputs
            if ident in seen:
                raise ValueError(f"{where}: think step id {ident} is also {seen[ident]}")
            seen[ident] = where
        for name, agent in self.agents.items():
            if agent.model is None and self.model is None:
                raise ValueError(f"agents.{name}: no model; set agents.{name}.model or "
                                 "agent_config.model")
        for where, tool in self.tool_refs():
            ns, name = split_tool_name(tool)
            if ns == AGENT_TOOL_NAMESPACE and name not in self.agents:
                raise ValueError(f"{where}: {tool} names no agent; agents: "
                                 f"{', '.join(sorted(self.agents)) or '(none)'}")
        return self

    def tool_refs(self) -> list[tuple[str, str]]:
        """Every tool id the section names, with its key path."""
        refs = [(f"agent_config.context.reevaluation_tools[{i}].id", r.id)
                for i, r in enumerate(self.context.reevaluation_tools)]
        for i, p in enumerate(self.policies):
            refs += [(f"agent_config.policies[{i}].tools[{j}]", t) for j, t in enumerate(p.tools)]
            refs += [(f"agent_config.policies[{i}].reevaluate_after[{j}]", t)
                     for j, t in enumerate(p.reevaluate_after)]
        return refs


_LISTED = 20  # tool names an error lists at most


def unknown_tool_refs(manifest: Manifest, served: Mapping[str, Collection[str]], *,
                      complete: bool) -> list[str]:
    """What the agent section names that the tools served here do not provide, a line each.

    `served` maps each namespace this process serves whole (an MCP server it connected,
    the local tools when it runs every pool) to its tool names. A namespace it does not
    serve is an error only when `complete` (it serves every declared server and pool), as
    `toolbus up` does; otherwise another process may serve it.
    """
    agent = manifest.agent_config
    problems: list[str] = []
    servers = {m.id for m in manifest.mcps}
    for where, tool in agent.tool_refs():
        ns, _ = split_tool_name(tool)
        if tool in PLANNER_TOOLS or ns == AGENT_TOOL_NAMESPACE:
            continue
        if ns in served:
            if tool not in served[ns]:
                what = f"MCP server {ns}" if ns in servers else f"namespace {ns}"
                names = sorted(served[ns])
                # On the tool part: the shared namespace would make any two names alike.
                close = difflib.get_close_matches(tool.partition(":")[2],
                                                  [n.partition(":")[2] for n in names], n=1)
                listed = ", ".join(names[:_LISTED]) or "nothing"
                if len(names) > _LISTED:
                    listed += f" and {len(names) - _LISTED} more"
                problems.append(f"{where}: {tool} is not a tool of {what}"
                                f"{f' (did you mean {ns}:{close[0]}?)' if close else ''}, which "
                                f"has {listed}")
        elif complete:
            problems.append(f"{where}: {tool}: no declared MCP server or tool has the "
                            f"namespace {ns} (MCP servers: "
                            f"{', '.join(sorted(servers)) or 'none'}; tool namespaces: "
                            f"{', '.join(sorted(set(served) - servers)) or 'none'})")
    return problems


def _unique_server_ids(v: list[McpServerConfig]) -> list[McpServerConfig]:
    seen: set[str] = set()
    for m in v:
        if m.id in seen:
            raise ValueError(f"two MCP servers have the id {m.id}")
        seen.add(m.id)
    return v


class Manifest(_Model):
    version: Literal[1] = 1
    pools: dict[str, PoolConfig] = {}
    tools: ToolsSection = ToolsSection()
    # Every MCP server, once validated: these, then those of agent_config.mcps.
    mcps: list[McpServerConfig] = []
    policy: PolicyConfig = PolicyConfig()
    agent_config: AgentConfig = AgentConfig()

    @field_validator("mcps")
    @classmethod
    def _unique_ids(cls, v: list[McpServerConfig]) -> list[McpServerConfig]:
        return _unique_server_ids(v)

    @model_validator(mode="after")
    def _pools_declared(self) -> Manifest:
        for name in self.pools:
            check_namespace(name)
        declared = {DEFAULT_POOL, *self.pools}
        t = self.tools
        used = [(f"tools.http[{i}].pool", h.pool) for i, h in enumerate(t.http)]
        used += [(f"tools.{k}.pool", getattr(t, k).pool)
                 for k in ("files", "code", "git", "web_search") if getattr(t, k) is not None]
        used += [(f"mcps[{i}].pool", m.pool) for i, m in enumerate(self.mcps)]
        used += [(f"agent_config.mcps[{i}].pool", m.pool)
                 for i, m in enumerate(self.agent_config.mcps)]
        for where, pool in used:
            if pool not in declared:
                raise ValueError(f"{where}: pool {pool!r} is not declared under pools "
                                 f"(declared: {', '.join(sorted(declared))})")
        if t.latent and self.agent_config.model is None:
            raise ValueError("tools.latent: a latent tool is run by the planner's model; set "
                             "agent_config.model")
        default = self.policy.default_agent
        if default in self.agent_config.agents:
            raise ValueError(
                f"agent_config.agents.{default}: {default!r} is the agent of every request "
                "that names none (policy.default_agent), whose turns would then take this "
                "agent's instructions, model and tools; name the agent otherwise, or set "
                "those in agent_config itself")
        return self

    # Defined after the other validators, so it wraps them: they see both lists as written
    # (and name agent_config.mcps[i] in errors); everything after sees one list.
    @model_validator(mode="wrap")
    @classmethod
    def _all_servers(cls, data: Any, handler: ModelWrapValidatorHandler[Manifest]) -> Manifest:
        manifest = handler(data)
        extra = manifest.agent_config.mcps
        if not extra or isinstance(data, Manifest):
            return manifest  # none, or an instance, merged when it was built
        top = {m.id: i for i, m in enumerate(manifest.mcps)}
        for i, m in enumerate(extra):
            if m.id in top:
                raise ValueError(f"agent_config.mcps[{i}].id: MCP server {m.id} is also "
                                 f"declared under mcps[{top[m.id]}]; declare it once")
        return manifest.model_copy(update={"mcps": [*manifest.mcps, *extra]})

    def pools_used(self) -> list[str]:
        t = self.tools
        pools = {DEFAULT_POOL} | {h.pool for h in t.http}
        pools |= {getattr(t, k).pool for k in ("files", "code", "git", "web_search")
                  if getattr(t, k) is not None}
        return sorted(pools | {m.pool for m in self.mcps})


# --- loading -----------------------------------------------------------------------------

_VAR = re.compile(r"\$\$\{|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _loc(parts: tuple[Any, ...] | list[Any]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def resolve_vars(node: Any, env: Mapping[str, str], where: list[Any],
                 problems: list[str], used: dict[str, str] | None = None) -> Any:
    """Replace `${VAR}` references in every string of a parsed YAML tree; `used` gets
    each variable read and its value."""
    if isinstance(node, dict):
        return {k: resolve_vars(v, env, [*where, k], problems, used)
                for k, v in node.items()}
    if isinstance(node, list):
        return [resolve_vars(v, env, [*where, i], problems, used)
                for i, v in enumerate(node)]
    if not isinstance(node, str) or "$" not in node:
        return node

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$${":
            return "${"
        name, fallback = m.group(1), m.group(2)
        value = env.get(name)
        if value is None or (value == "" and fallback is not None):
            if fallback is not None:
                return fallback
            # A key takes no default written in the file (`literal_secrets`): none at all.
            instead = f"${{{name}:-}} for a server that takes no key" \
                if where and where[-1] == "api_key" else f"${{{name}:-default}}"
            problems.append(f"{_loc(where)}: ${{{name}}} is not set in the environment; "
                            f"export {name}=... or write {instead}")
            return ""
        if used is not None:
            used[name] = value
        return value

    return _VAR.sub(sub, node)


def _unquoted(message: str, used: Mapping[str, str]) -> str:
    """`message` with every value read from the environment put back as the `${VAR}` it
    came from: a validator that quotes what it refused would show a secret (a password
    in a URL) to whoever reads the error. Values of under 4 characters are left: no
    secret, and common enough to mangle the message."""
    for name, value in sorted(used.items(), key=lambda kv: -len(kv[1])):
        if len(value) >= 4:
            message = message.replace(value, f"${{{name}}}")
    return message


# Secrets of the agent section come only from the environment: `${VAR}`, or `${VAR:-}`
# for none. A key written in the file would end up in version control and in backups.
_SECRET_REF = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*(:-)?\}")
_SECRET_KEYS = (("agent_config", "model", "api_key"),
                ("agent_config", "agents", "*", "model", "api_key"),
                ("agent_config", "mcps", "[]", "api_key"))


def literal_secrets(raw: Any) -> list[str]:
    """Where the unresolved YAML tree holds a key written out instead of `${VAR}`."""
    problems: list[str] = []

    def walk(node: Any, rest: tuple[str, ...], where: list[Any]) -> None:
        if not rest:
            if isinstance(node, str) and not _SECRET_REF.fullmatch(node.strip()):
                problems.append(f"{_loc(where)}: a key written in the manifest is refused; "
                                "put it in an environment variable and write ${VAR_NAME} "
                                "(e.g. ${OPENAI_API_KEY})")
            return
        key, more = rest[0], rest[1:]
        if key == "[]" and isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, more, [*where, i])
        elif key == "*" and isinstance(node, dict):
            for k, item in node.items():
                walk(item, more, [*where, k])
        elif isinstance(node, dict) and key in node:
            walk(node[key], more, [*where, key])

    for path in _SECRET_KEYS:
        walk(raw, path, [])
    return problems


def with_base_dir(manifest: Manifest, join: Callable[[str], str]) -> Manifest:
    """The manifest with its relative paths made absolute by `join` (the caller knows the
    manifest's folder; this module does no I/O)."""
    t = manifest.tools
    changes: dict[str, Any] = {}
    for key, attr in (("files", "root"), ("git", "repo")):
        section = getattr(t, key)
        if section is not None:
            changes[key] = section.model_copy(update={attr: join(getattr(section, attr))})
    mcps = [m.model_copy(update={"cwd": join(m.cwd)}) if m.cwd is not None else m
            for m in manifest.mcps]
    return manifest.model_copy(update={"tools": t.model_copy(update=changes), "mcps": mcps})


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key written twice in one mapping is an error: the
    plain loader keeps the last and drops the first without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base`: what it brings may be overridden, as YAML says
            key = self.construct_object(key_node, deep=deep)
            try:
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping", node.start_mark,
                        f"found the key {key!r} a second time (the first would be ignored)",
                        key_node.start_mark)
                seen.add(key)
            except TypeError:
                pass  # an unhashable key: the safe loader names it
        return super().construct_mapping(node, deep=deep)


MAX_MANIFEST_VALUES = 200_000  # values of a manifest with its aliases expanded, at most


def _expanded_over(value: Any, limit: int) -> bool:
    """Whether `value`, walked as a tree (an alias once per use), has over `limit` values;
    stops counting there."""
    return any(True for _ in itertools.islice(json_values(value), limit, limit + 1))


def parse_manifest(text: str, *, env: Mapping[str, str], path: str = "manifest") -> Manifest:
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no Python objects
    except yaml.YAMLError as exc:
        raise ManifestError(path, [f"not valid YAML: {exc}"]) from exc
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ManifestError(path, [f"(top level): expected a mapping, got {type(raw).__name__}"])
    if _expanded_over(raw, MAX_MANIFEST_VALUES):
        # YAML aliases share one value: a few lines of anchors can stand for billions.
        raise ManifestError(path, [f"(top level): the manifest expands to over "
                                   f"{MAX_MANIFEST_VALUES:,} values (YAML anchors and "
                                   "aliases nested in each other?)"])
    problems = literal_secrets(raw)
    used: dict[str, str] = {}
    resolved = resolve_vars(raw, env, [], problems, used)
    if problems:
        raise ManifestError(path, problems)
    try:
        manifest = Manifest.model_validate(resolved)
    except pydantic.ValidationError as exc:
        # Not chained: pydantic's own error quotes every value it refused.
        raise ManifestError(path, [_unquoted(f"{_loc(e['loc'])}: {e['msg']}", used)
                                   for e in exc.errors()]) from None
    return manifest
