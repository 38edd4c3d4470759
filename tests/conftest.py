import pytest

from kilnproxy.testing import Harness

# tests/e2e needs a real model server: `make e2e` runs it (`pytest tests/e2e`), `make test` does not.
collect_ignore = ["e2e"]


@pytest.fixture
async def gw(tmp_path):
    """A gateway in front of the mock upstream, with the test config of kilnproxy.testing."""
    async with Harness(tmp_path) as h:
        yield h


@pytest.fixture
def harness(tmp_path):
    """Build a Harness with options: ``async with harness(overrides=...) as h``."""
    return lambda **kwargs: Harness(tmp_path, **kwargs)


@pytest.fixture
def eventually():
    """``await eventually(predicate)``: wait, a few ms at a time and 20 s at most, until it is true.

    For state the gateway reaches after the client has already seen the end (a handler
    cancelled by a hang-up finishes on its own); fails with the predicate's last value.
    """
    import asyncio
    import inspect

    async def wait(predicate, timeout: float = 20.0):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
            if value or loop.time() > deadline:
                assert value, f"still false after {timeout} s: {predicate}"
                return value
            await asyncio.sleep(0.005)

    return wait
