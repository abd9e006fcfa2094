"""Tool specs as stored in the `toolbus_catalog` bucket."""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec

DEFAULT_TIMEOUT_MS: Final = 30_000
DEFAULT_POOL: Final = "default"

RiskLevel = Literal["low", "medium", "high"]


class Annotations(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    readOnlyHint: bool = False  # MCP spelling, kept verbatim
    destructiveHint: bool = True  # MCP default: assume destructive
    idempotentHint: bool = False
    openWorldHint: bool = True


class ToolSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )
    output: dict[str, Any] | None = None
    annotations: Annotations = Annotations()
    risk_level: RiskLevel = "low"
    timeout_ms: int = DEFAULT_TIMEOUT_MS
    requires_approval: bool = False
    source: str = "local"
    pool: str = DEFAULT_POOL

    @property
    def namespace(self) -> str:
        return self.name.split(":", 1)[0]

    @property
    def rerunnable(self) -> bool:
        """Safe to run again after an interruption: read-only or idempotent."""
        return self.annotations.readOnlyHint or self.annotations.idempotentHint

    @property
    def route(self) -> str:
        """The subject suffix of `call.dispatched` that the right executors consume."""
        return f"{self.pool}.{self.namespace}"


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(ToolSpec)


def encode_spec(spec: ToolSpec) -> bytes:
    return _encoder.encode(spec)


def decode_spec(data: bytes) -> ToolSpec:
    return _decoder.decode(data)
