"""A worker's ``--tools`` module that serves existing framework tools, unchanged, as dex tools:
a LangChain ``@tool``, an OpenAI Agents SDK ``@function_tool`` and a Pydantic AI tool
function (``tests/test_framework_tools.py``). Each writes a ledger line when it runs."""

from __future__ import annotations

from agents import function_tool
from langchain_core.tools import tool as langchain_tool

from dex_tasks import ToolPolicy
from dex_tasks.integrations.framework_tools import from_framework_tools
from workers import ledger


@langchain_tool
def lc_lookup(order_id: str, verbose: bool = False) -> str:
    """Look up an order.

    Args:
        order_id: The order's id, as the shop
            prints it.
        verbose: Say more.
    """
    ledger.record("lc_lookup", order_id, 1)
    return f"order {order_id} shipped" + (" (by courier)" if verbose else "")


@function_tool
def oa_ship(order_id: str, express: bool = False) -> dict[str, object]:
    """Ship an order.

    Args:
        order_id: The order to ship.
        express: Next-day delivery.
    """
    ledger.record("oa_ship", order_id, 1)
    return {"shipped": order_id, "express": express}


async def pa_refund(charge_id: str, amount_cents: int) -> dict[str, object]:
    """Refund part of a charge.

    Args:
        charge_id: The charge.
        amount_cents: How much to refund, in cents.
    """
    ledger.record("pa_refund", charge_id, 1)
    return {"refunded": amount_cents, "charge": charge_id}


from_framework_tools([lc_lookup, oa_ship, pa_refund],
                     policies={"lc_lookup": "read", "oa_ship": "idempotent_write",
                               "pa_refund": ToolPolicy("non_idempotent_write",
                                                       requires_approval=False)})
