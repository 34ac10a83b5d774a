"""The HTTP ceiling: the worker API's lease and results calls answered by PostgreSQL alone.

    python -m bench.workers.http_ceiling --url URL --port PORT [--workers 2]

What REST+SDK would cost if the web tier did nothing per run: uvicorn processes (httptools,
uvloop, TCP_NODELAY, as `manage.py web` serves) whose `POST /api/v1/leases` and
`POST /api/v1/results` hand the request's body to PostgreSQL as one text parameter and send
back the text PostgreSQL answers. PostgreSQL reads the results from the JSON, applies them and
claims with the raw SQL ceiling's statements (bench/workers/raw_worker.py: one lane, no
fairness, no limits, the same rows written), and builds the answer's JSON, the leases in the
product's shape, so the real SDK worker (bench/workers/sdk_worker.py) runs against it unchanged. No authentication, no validation, no
Django: a floor under any web tier written in Python, not a design. Each statement commits
itself (autocommit), results first, as the product applies them before the claim.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

import orjson
import psycopg
import uvicorn
from uvicorn.supervisors import Multiprocess

from bench.workers.raw_worker import CLAIMED, DONE, END_ATTEMPTS, INSERT_ATTEMPTS

INSTANT = """to_char({} AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')"""

# The results of a lease or results call, applied; their answer items. Run ids are the runs'
# numbers as text (the SDK hands them back as it got them).
RESULTS = f"""
WITH i AS (
    SELECT ("runId")::bigint AS id, "fencingToken" AS token
    FROM jsonb_to_recordset(coalesce(%(body)s::jsonb -> 'results', '[]'))
         AS i("runId" text, "fencingToken" bigint)
){DONE}{END_ATTEMPTS}
SELECT coalesce(json_agg(json_build_object('runId', id::text, 'status', 200,
                                           'state', 'succeeded')), '[]')::text
FROM done
"""

LEASED = CLAIMED.format(
    returning=", r.due_at, r.lease_expires_at, r.idempotency_key, r.max_attempts"
)
LEASE = f"""{LEASED}{INSERT_ATTEMPTS}
SELECT coalesce(json_agg(json_build_object(
    'runId', id::text, 'job', %(job)s::text, 'attempt', attempt, 'idempotencyKey', idempotency_key,
    'fencingToken', fencing_token, 'leaseExpiresAt', {INSTANT.format("lease_expires_at")},
    'payload', NULL, 'queue', %(queue)s::text, 'priority', 'normal', 'maxAttempts', max_attempts,
    'dueAt', {INSTANT.format("due_at")}, 'dryRun', false)), '[]')::text, count(*)
FROM leased
"""

HEADERS = [(b"content-type", b"application/json")]


class Ceiling:
    """One uvicorn process's connections (one per request in flight) and the bench's lane."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.idle: list[psycopg.AsyncConnection] = []
        self.lane: dict[str, Any] | None = None

    async def connection(self) -> psycopg.AsyncConnection:
        if self.idle:
            return self.idle.pop()
        conn = await psycopg.AsyncConnection.connect(
            self.url, autocommit=True, application_name="bench:http-ceiling"
        )
        await conn.execute("SET jit = off")
        if self.lane is None:
            from bench.common import JOB, QUEUE

            cursor = await conn.execute(
                "SELECT team_id, priority FROM jobs_jobdefinition WHERE name = %s", [JOB]
            )
            team, priority = await cursor.fetchone()
            self.lane = {"team": team, "queue": QUEUE, "priority": priority, "job": JOB}
        return conn

    async def answer(self, path: str, body: str, receive: Any) -> bytes:
        # The bench ends every session between measurements (to count their commits): after a
        # connection fails, the idle ones are dropped too and the call is made on a new one.
        try:
            return await self._answer(path, body, receive)
        except psycopg.OperationalError:
            dropped, self.idle = self.idle, []
            for conn in dropped:
                await conn.close()
            return await self._answer(path, body, receive)

    async def _answer(self, path: str, body: str, receive: Any) -> bytes:
        conn = await self.connection()
        try:
            cursor = await conn.execute(RESULTS, {"body": body}, prepare=True)
            (results,) = await cursor.fetchone()
            if path == "/api/v1/results":
                answer = b'{"results":' + results.encode() + b"}"
            else:
                answer = await self._lease(conn, body, results, receive)
        except BaseException:
            await conn.close()
            raise
        self.idle.append(conn)
        return answer

    async def _lease(
        self, conn: psycopg.AsyncConnection, body: str, results: str, receive: Any
    ) -> bytes:
        # The lease's three parameters are read here (a parse of the body: ~0.3 µs a result
        # item), so that the claim's LIMIT is a parameter the plan knows.
        asked = orjson.loads(body)
        params = {**self.lane, "n": asked["max"], "worker": asked["workerId"]}
        deadline = time.monotonic() + min(5.0, float(asked.get("waitSeconds", 0)))
        # A long poll stops when its worker hangs up (uvicorn's `http.disconnect`): the bench
        # stops each measurement's workers, and a poll left running would lease the next
        # measurement's first runs to nobody.
        gone: asyncio.Future | None = None
        try:
            while True:
                cursor = await conn.execute(LEASE, params, prepare=True)
                leases, count = await cursor.fetchone()
                if count or time.monotonic() >= deadline:
                    break
                gone = gone or asyncio.ensure_future(receive())
                await asyncio.sleep(0.02)
                if gone.done():
                    break
        finally:
            if gone is not None:
                gone.cancel()
        return b'{"results":' + results.encode() + b',"leases":' + leases.encode() + b"}"


ceiling = Ceiling(os.environ.get("BENCH_CEILING_URL", ""))


async def app(scope: dict, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    path = scope["path"]
    if scope["method"] == "GET":
        status, payload = (
            (200, b'{"status":"ok"}') if path in ("/readyz", "/healthz") else (404, b"{}")
        )
    elif path in ("/api/v1/leases", "/api/v1/results"):
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        status, payload = 200, await ceiling.answer(path, b"".join(chunks).decode(), receive)
    else:
        status, payload = 404, b"{}"
    await send({"type": "http.response.start", "status": status, "headers": HEADERS})
    await send({"type": "http.response.body", "body": payload})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    os.environ["BENCH_CEILING_URL"] = args.url
    from apps.ops.management.commands.web import listening_socket

    config = uvicorn.Config(
        "bench.workers.http_ceiling:app",
        host="127.0.0.1",
        port=args.port,
        workers=args.workers,
        lifespan="off",
        log_level="warning",
        access_log=False,
    )
    Multiprocess(config, sockets=[listening_socket(config)]).run()


if __name__ == "__main__":
    main()
