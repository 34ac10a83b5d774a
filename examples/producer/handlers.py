"""The worker side of the producer example: the handler of the runs `app.py` enqueues.

    CRONLEASE_URL=http://127.0.0.1:8000 CRONLEASE_TOKEN=… \
        python -m cronlease_client run examples.producer.handlers --queue shop
"""

from __future__ import annotations

from typing import Any

from cronlease_client import Context, NonRetryable, handler


@handler("shop.send-receipt")
def send_receipt(ctx: Context) -> dict[str, Any]:
    """Send the receipt of an order (here: say what would be sent)."""
    payload = ctx.payload or {}
    order, email = payload.get("order"), payload.get("email")
    if not isinstance(order, int) or not isinstance(email, str):
        raise NonRetryable("payload needs order (integer) and email (string)")
    # A real handler sends with `ctx.idempotency_key` ("order-<id>") as the mail provider's
    # deduplication key: a retried run then sends one mail, not two.
    return {"sent": order, "to": email, "key": ctx.idempotency_key}
