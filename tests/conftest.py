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
