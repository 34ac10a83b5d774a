"""The sharded layout of the test suite: `pytest --shard-servers N` starts N PostgreSQL servers
(tests/servers.py) before Django loads its settings, and spreads the 16 shards over the control
database and them (`SCHEDULER_SHARD_DATABASES`); the servers stop when the session ends.

Tests marked `physical` need shards on servers of their own: they run only in this layout, and
in the other they are deselected. `make test` runs the suite, then the tests marked `shards`
(those that hold in both layouts) and `physical` in this one.
"""

from __future__ import annotations

import contextlib
import os

import pytest

from scheduler_site import shardmap
from tests.servers import Server, postgres_servers

# The servers of this session, in the order of their aliases (shards_1, shards_2, …).
SERVERS: list[Server] = []
_stack = contextlib.ExitStack()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shard-servers",
        type=int,
        default=0,
        help="run with the shards spread over the control database and N servers of their own",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser, args) -> None:
    count = early_config.known_args_namespace.shard_servers
    if not count:
        return
    SERVERS.extend(_stack.enter_context(postgres_servers(count)))
    # The control database holds a share too when its URL is known (the embedded server's is
    # made by the settings).
    control = [os.environ["DATABASE_URL"]] if os.environ.get("DATABASE_URL") else []
    os.environ["SCHEDULER_SHARD_DATABASES"] = shardmap.spread(
        16, control + [s.url for s in SERVERS]
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("shard_servers"):
        return
    kept = [item for item in items if item.get_closest_marker("physical") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept


def pytest_unconfigure(config: pytest.Config) -> None:
    _stack.close()
