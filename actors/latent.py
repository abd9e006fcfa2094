"""Latent tools (seed 001): a tool declared with a schema and no implementation is run by
the model itself, in one structured model call whose answer must match the tool's
`_output` schema.

Consumes: `call.dispatched` for the latent tools (route `latent.<namespace>`), through an
executor (actors/executor.py) living in the planner's process, so the approval and
dispatch path is that of every tool and the executor's rules hold: `call.started`,
exactly one terminal event, in-progress acks while the model answers, the result checked
against `_output` once more.
Emits: through the executor, `call.succeeded` with the model's answer as the result and
`executor: latent`, or `call.failed` (`invalid_latent_output` after
`max_output_retries` + 1 answers that broke the schema; `model_error`, retryable when
the provider said so).
Idempotency: the executor's message ids (schemas/ids.py), per call and attempt. A model
call has no side effects, so a redelivered dispatch simply asks again; once the result is
stored, replay reads it from the log and never calls a model.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from actors.executor import Executor
from actors.llm import ModelClient, complete
from actors.llm.types import Message, ModelSettings
from actors.planner import parse_structured
from actors.tools import Resource, RunnableTool, ToolError
from bus.connection import Bus
from schemas.errors import ModelError
from schemas.tools import Annotations, ToolSpec
from schemas.validation import validator_for

LATENT_POOL: Final = "latent"
LATENT_EXECUTOR: Final = "latent"  # the `executor` of the calls' events
DEFAULT_MAX_OUTPUT_RETRIES: Final = 2


def latent_prompt(spec: ToolSpec) -> str:
    schema = msgspec.json.encode(spec.output).decode()
    return (f"You are the tool {spec.name}: {spec.description}\n"
            "You are given the call's arguments as JSON. Do what the tool does, and answer "
            f"with one JSON value that matches this JSON Schema, and nothing else: {schema}")


async def _model_client() -> AsyncIterator[ModelClient]:
    async with ModelClient() as client:
        yield client


# One client for the latent tools of an executor, opened with it: its connections are
# kept alive from one call to the next (a TLS handshake to the provider each call cost
# tens of milliseconds).
MODEL_CLIENT: Final = Resource(_model_client, "model client")


@dataclass(frozen=True, slots=True, eq=False)
class LatentTool:
    """A `RunnableTool` whose implementation is a structured model call."""

    spec: ToolSpec
    settings: ModelSettings
    max_output_retries: int = DEFAULT_MAX_OUTPUT_RETRIES
    injected: dict[str, Resource] = field(default_factory=lambda: {"client": MODEL_CLIENT})
    client: ModelClient | None = None  # when run without the executor's resources

    def check_arguments(self, arguments: dict[str, Any]) -> None:
        """Any arguments will do: the approval actor checked them against the schema."""

    async def run(self, arguments: dict[str, Any], resources: dict[Resource, Any] | None = None,
                  *, progress: Any = None) -> Any:
        assert self.spec.output is not None
        validator = validator_for(self.spec.output)
        client = (resources or {}).get(MODEL_CLIENT) or self.client
        messages = [Message(role="user", text=msgspec.json.encode(arguments).decode())]
        violations: list[str] = []
        for _ in range(self.max_output_retries + 1):
            try:
                reply = await complete(self.settings, system=latent_prompt(self.spec),
                                       messages=messages, tools=[],
                                       response_schema=self.spec.output, client=client)
            except ModelError as exc:
                raise ToolError(str(exc), error_type="model_error",
                                retryable=exc.retryable) from exc
            value, violations = parse_structured(reply.text, validator)
            if not violations:
                return value
            messages += [Message(role="assistant", text=reply.text),
                         Message(role="user", text="That answer does not match the schema: "
                                 f"{'; '.join(violations)}. Answer again.")]
        raise ToolError(f"{self.spec.name} (latent) answered {self.max_output_retries + 1} "
                        f"times without matching its output schema; last: "
                        f"{'; '.join(violations)}", error_type="invalid_latent_output")


class LatentExecutor(Executor):
    """The executor of the latent tools, in the planner's process (pool `latent`)."""

    def __init__(self, bus: Bus, specs: Iterable[ToolSpec], settings: ModelSettings, *,
                 max_output_retries: int = DEFAULT_MAX_OUTPUT_RETRIES,
                 instance: str = LATENT_EXECUTOR, ack_wait_s: float | None = None) -> None:
        tools: list[RunnableTool] = [LatentTool(s, settings, max_output_retries)
                                     for s in specs]
        options: dict[str, Any] = {} if ack_wait_s is None else {"ack_wait_s": ack_wait_s}
        super().__init__(bus, tools, instance=instance, pool=LATENT_POOL, **options)


def latent_spec(name: str, *, description: str, parameters: dict[str, Any],
                output: dict[str, Any]) -> ToolSpec:
    """The catalog entry of a latent tool: its schema, `_output`, pool `latent`."""
    # The model only answers: no side effects, safe to run again.
    return ToolSpec(name=name, source="latent", description=description,
                    parameters=parameters, output=output, pools=[LATENT_POOL],
                    annotations=Annotations(readOnlyHint=True, destructiveHint=False,
                                            idempotentHint=True,
                                            openWorldHint=False))


__all__ = ["LATENT_EXECUTOR", "LATENT_POOL", "LatentExecutor", "LatentTool", "latent_spec"]
