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

`${VAR}` is replaced by the environment variable VAR (an error naming it if it is unset),
`${VAR:-fallback}` falls back when it is unset or empty, `$${` is a literal `${`. Relative
paths are relative to the manifest's folder (`with_base_dir`). Every error names its key
path.

Pure: the caller passes the text and the environment in.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.errors import InvalidIdError, ManifestError
from schemas.ids import check_namespace, split_tool_name
from schemas.tools import DEFAULT_POOL

HttpMethod = Literal["GET", "HEAD", "OPTIONS", "POST", "PUT", "PATCH", "DELETE"]
BUILTIN_NAMES = ("echo", "current_time")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


PoolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,128}$")]


class HttpToolConfig(_Model):
    """The configurable HTTP tool of seed 002, under a name of the manifest's choosing."""

    name: str
    description: str = ""
    base_url: str | None = None
    allowed_methods: list[HttpMethod] = ["GET", "HEAD"]
    default_method: HttpMethod | None = None
    default_headers: dict[str, str] = {}
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
        if v is not None and not re.match(r"^https?://[^/?#]+", v):
            raise ValueError(f"base_url must be an absolute http(s) URL, got {v!r}")
        return v

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


class GitConfig(_Model):
    repo: str
    allow_write: bool = False  # also register built-in:git, which runs any subcommand
    timeout_ms: Annotated[int, Field(gt=0)] = 30_000
    max_output_bytes: Annotated[int, Field(gt=0)] = 32 * 1024
    pool: PoolName = DEFAULT_POOL


class WebSearchConfig(_Model):
    provider: Literal["tavily"] = "tavily"
    api_key: str | None = None  # else the provider's variable (TAVILY_API_KEY)
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

    @field_validator("http")
    @classmethod
    def _unique(cls, v: list[HttpToolConfig]) -> list[HttpToolConfig]:
        seen: set[str] = set()
        for item in v:
            if item.name in seen:
                raise ValueError(f"two http tools are named {item.name}")
            seen.add(item.name)
        return v


class PoolConfig(_Model):
    description: str = ""


class Manifest(_Model):
    version: Literal[1] = 1
    pools: dict[str, PoolConfig] = {}
    tools: ToolsSection = ToolsSection()

    @model_validator(mode="after")
    def _pools_declared(self) -> Manifest:
        for name in self.pools:
            check_namespace(name)
        declared = {DEFAULT_POOL, *self.pools}
        t = self.tools
        used = [(f"tools.http[{i}].pool", h.pool) for i, h in enumerate(t.http)]
        used += [(f"tools.{k}.pool", getattr(t, k).pool)
                 for k in ("files", "code", "git", "web_search") if getattr(t, k) is not None]
        for where, pool in used:
            if pool not in declared:
                raise ValueError(f"{where}: pool {pool!r} is not declared under pools "
                                 f"(declared: {', '.join(sorted(declared))})")
        return self

    def pools_used(self) -> list[str]:
        t = self.tools
        pools = {DEFAULT_POOL} | {h.pool for h in t.http}
        pools |= {getattr(t, k).pool for k in ("files", "code", "git", "web_search")
                  if getattr(t, k) is not None}
        return sorted(pools)


# --- loading -----------------------------------------------------------------------------

_VAR = re.compile(r"\$\$\{|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _loc(parts: tuple[Any, ...] | list[Any]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def resolve_vars(node: Any, env: Mapping[str, str], where: list[Any],
                 problems: list[str]) -> Any:
    """Replace `${VAR}` references in every string of a parsed YAML tree."""
    if isinstance(node, dict):
        return {k: resolve_vars(v, env, [*where, k], problems) for k, v in node.items()}
    if isinstance(node, list):
        return [resolve_vars(v, env, [*where, i], problems) for i, v in enumerate(node)]
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
            problems.append(f"{_loc(where)}: ${{{name}}} is not set in the environment; "
                            f"export {name}=... or write ${{{name}:-default}}")
            return ""
        return value

    return _VAR.sub(sub, node)


def with_base_dir(manifest: Manifest, join: Callable[[str], str]) -> Manifest:
    """The manifest with its relative paths made absolute by `join` (the caller knows the
    manifest's folder; this module does no I/O)."""
    t = manifest.tools
    changes: dict[str, Any] = {}
    for key, attr in (("files", "root"), ("git", "repo")):
        section = getattr(t, key)
        if section is not None:
            changes[key] = section.model_copy(update={attr: join(getattr(section, attr))})
    if not changes:
        return manifest
    return manifest.model_copy(update={"tools": t.model_copy(update=changes)})


def parse_manifest(text: str, *, env: Mapping[str, str], path: str = "manifest") -> Manifest:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ManifestError(path, [f"not valid YAML: {exc}"]) from exc
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ManifestError(path, [f"(top level): expected a mapping, got {type(raw).__name__}"])
    problems: list[str] = []
    resolved = resolve_vars(raw, env, [], problems)
    if problems:
        raise ManifestError(path, problems)
    try:
        manifest = Manifest.model_validate(resolved)
    except pydantic.ValidationError as exc:
        raise ManifestError(path, [f"{_loc(e['loc'])}: {e['msg']}"
                                   for e in exc.errors()]) from exc
    return manifest
