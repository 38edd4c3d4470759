"""``[batches]`` and ``[models.pricing] batch_discount``: their defaults, and one-line errors."""

import pytest

from kilnproxy.config import parse_config
from kilnproxy.errors import ConfigError

MODEL = {"id": "m", "upstreams": ["http://127.0.0.1:9/v1"]}


def test_the_defaults():
    config = parse_config({"models": [MODEL]})
    assert (config.batches.max_in_flight, config.batches.max_file_bytes) == (4, 100 * 1024 * 1024)
    assert config.models[0].pricing.batch_discount == 1.0
    assert config.models[0].pricing.for_batch is config.models[0].pricing  # no discount: the same prices


def test_a_discount_prices_each_rate():
    config = parse_config({"models": [{**MODEL, "pricing": {"prompt": 1.0, "completion": 3.0, "cached_prompt": 0.5,
                                                            "batch_discount": 0.5}}]})
    batch = config.models[0].pricing.for_batch
    assert (batch.prompt, batch.completion, batch.cached_prompt) == (0.5, 1.5, 0.25)
    assert batch.cost(1_000_000, 1_000_000, 0) == 2.0


@pytest.mark.parametrize("raw, message", [
    ({"batches": {"max_in_flight": 0}}, "<t>: batches.max_in_flight: must be greater than 0, got 0"),
    ({"batches": {"max_in_flight": 1.5}}, "<t>: batches.max_in_flight: must be an integer, got float 1.5"),
    ({"batches": {"max_file_bytes": -1}}, "<t>: batches.max_file_bytes: must be greater than 0, got -1"),
    ({"batches": {"max_lines": 3}}, "<t>: batches.max_lines: unknown key"),
    ({"models": [{**MODEL, "pricing": {"batch_discount": 1.5}}]},
     "<t>: models[0] (m).pricing.batch_discount: must be from 0 to 1 (the factor of a batch line's prices), got 1.5"),
])
def test_a_bad_value_is_one_line_naming_the_key(raw, message):
    with pytest.raises(ConfigError) as refused:
        parse_config({"models": [MODEL], **raw}, source="<t>")
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
