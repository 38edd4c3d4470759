"""Usage.from_upstream: an upstream's usage object read as counts, odd fields as 0, counts above 2**53 - 1
as 2**53 - 1 (docs/reference.md: usage chunk with cost, the usage table). Read in line on every stream's usage event: each odd kind pinned here."""

from __future__ import annotations

import pytest

from kilnproxy.usage import MAX_TOKENS, Usage


def counts(usage: Usage) -> tuple:
    return usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens, usage.total_tokens


@pytest.mark.parametrize("raw, expected", [
    ({"prompt_tokens": 5, "completion_tokens": 64, "total_tokens": 69}, (5, 64, 0, 69)),
    ({"prompt_tokens": 5, "completion_tokens": 64}, (5, 64, 0, 69)),  # no total: their sum
    ({"prompt_tokens": 5, "completion_tokens": 64, "total_tokens": 70}, (5, 64, 0, 70)),  # as reported
    ({"prompt_tokens": 5, "completion_tokens": 64, "total_tokens": 0}, (5, 64, 0, 0)),
    ({"prompt_tokens": 9, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 4}}, (9, 1, 4, 10)),
    ({"prompt_tokens": 9, "prompt_tokens_details": None}, (9, 0, 0, 9)),
    ({"prompt_tokens": 9, "prompt_tokens_details": [4]}, (9, 0, 0, 9)),
    ({"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": "4"}}, (9, 0, 0, 9)),
    ({"prompt_tokens": True, "completion_tokens": 2.0, "total_tokens": False}, (0, 0, 0, 0)),
    ({"prompt_tokens": -3, "completion_tokens": "7", "total_tokens": -1}, (0, 0, 0, 0)),
    ({"prompt_tokens": MAX_TOKENS + 1, "completion_tokens": MAX_TOKENS, "total_tokens": MAX_TOKENS + 1},
     (MAX_TOKENS, MAX_TOKENS, 0, MAX_TOKENS)),  # capped, not odd
    ({"prompt_tokens": 2**70, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 2**64}},
     (MAX_TOKENS, 1, MAX_TOKENS, MAX_TOKENS)),  # no total: their sum, capped too
    ({}, (0, 0, 0, 0)),
])
def test_odd_fields_count_as_zero(raw: dict, expected: tuple) -> None:
    assert counts(Usage.from_upstream(raw)) == expected
