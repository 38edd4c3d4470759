import pytest

from kilnproxy.testing import Harness


@pytest.fixture
async def gw(tmp_path):
    """A gateway in front of the mock upstream, with the test config of kilnproxy.testing."""
    async with Harness(tmp_path) as h:
        yield h


@pytest.fixture
def harness(tmp_path):
    """Build a Harness with options: ``async with harness(overrides=...) as h``."""
    return lambda **kwargs: Harness(tmp_path, **kwargs)
