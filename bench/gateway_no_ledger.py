"""M6 only: the gateway with its usage ledger replaced by one that stores nothing.

Everything else is the real gateway (same config, plugins, request path); the
row is still built and the org charged, but ``submit`` returns a future that
is already resolved, so no SQLite write and no wait for a commit. The
difference to the full gateway is the price of usage accounting.

    python bench/gateway_no_ledger.py --config bench.toml
"""

import argparse
import asyncio

from kilnproxy.config import load_config
from kilnproxy.proxy.gateway import GATEWAY
from kilnproxy.store.sqlite.ledger import SQLiteLedger
from kilnproxy.web import server
from kilnproxy.web.app import create_app


class NullLedger:
    available, refuses_requests = True, False
    pool = file_users = None
    commits = refused = refused_unrecorded = 0

    def __init__(self) -> None:
        self.journaled: dict = {}
        self.not_committed: list = []

    def journal_when(self, alone) -> None:
        pass

    def keeps_refused_rows(self) -> bool:
        return True

    async def org_spent(self, org):
        return None

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def submit(self, row, tag=None) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    async def spent_by_org(self) -> dict:
        return {}

    async def get(self, generation_id):
        return None

    def queue_depth(self) -> int:
        return 0

    def stats(self) -> dict:
        return {"queue_depth": 0, "commits": 0, "rows_committed": 0, "commit_failures": 0,
                "last_commit_seconds": 0.0}


async def serve(path: str) -> None:
    config = load_config(path)
    schema = SQLiteLedger(config.db_path)  # the table exists, as the inspector's reader expects
    await schema.open()
    await schema.close()
    app = create_app(config)
    app[GATEWAY].ledger = NullLedger()
    running = await server.start_app(app, config.server.host, config.server.port)
    try:
        await server.wait_for_signal()
    finally:
        await running.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    args = parser.parse_args()
    server.run(lambda: serve(args.config))


if __name__ == "__main__":
    main()
