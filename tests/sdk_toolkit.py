"""A user's tool module, written the way the README shows: typed functions, a pydantic
model, a docstring, a shared resource. Loaded with `--tools tests/sdk_toolkit.py`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from actors.tools import ToolError, resource, tool, uses

EVENTS: list[str] = []  # what the resource saw: opened / closed (in-process tests read it)


class Address(BaseModel):
    street: str
    city: str
    zip: Annotated[str, Field(pattern=r"^\d{5}$")]


class Quote(BaseModel):
    city: str
    price: float
    express: bool


@resource
def rate_table() -> Iterator[dict[str, float]]:
    EVENTS.append("opened")
    yield {"Paris": 12.5, "Lyon": 9.0}
    EVENTS.append("closed")


@tool("shipping:quote", read_only=True, idempotent=True, timeout_ms=5_000)
async def quote(address: Address, speed: Literal["standard", "express"] = "standard",
                *, rates: dict[str, float] = uses(rate_table)) -> Quote:
    """Quote the price of shipping one parcel.

    Args:
        address: where the parcel goes.
        speed: express costs double.
    """
    if address.city not in rates:
        raise ToolError(f"we do not ship to {address.city}", error_type="no_service")
    price = rates[address.city] * (2 if speed == "express" else 1)
    return Quote(city=address.city, price=price, express=speed == "express")


@tool("shipping:label", requires_approval=True, risk_level="high", destructive=False)
def label(order_id: int, copies: int = 1) -> dict[str, object]:
    """Print shipping labels (a sync function: runs in a worker thread)."""
    return {"order_id": order_id, "copies": copies}


@tool("shipping:broken_promise", read_only=True)
async def broken_promise() -> Quote:
    """Claims to return a Quote, returns something else."""
    return {"city": 3}  # type: ignore[return-value]  # on purpose: output validation
