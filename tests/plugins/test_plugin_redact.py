"""plugins/redact.py through a real gateway and the openai SDK."""

from pathlib import Path

import pytest

from kilnproxy import KilnError

PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "redact.py"
SECRETS = ("Mail jane.doe+ops@example.co.uk, key sk-proj-4f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c, "
           "AWS AKIAIOSFODNN7EXAMPLE, header Authorization: Bearer abcdefghijklmnop1234.")
SCRUBBED = ("Mail [REDACTED], key [REDACTED], AWS [REDACTED], header Authorization: Bearer [REDACTED].")


async def test_redacts_prompts_before_they_reach_the_model(kilnproxy_harness):
    async with kilnproxy_harness(plugins=[PLUGIN], settings={"redact": {"header": True}}) as h:
        answer = await h.openai().completions.with_raw_response.create(
            model=h.model, prompt=[SECRETS, "nothing to hide"], max_tokens=2)
        assert answer.headers["X-Redactions"] == "4"
        assert answer.parse().choices[0].text == " Paris is"
        [seen] = await h.mock_requests()
        assert seen["body"]["prompt"] == [SCRUBBED, "nothing to hide"]


async def test_redacts_chat_messages_and_text_parts(kilnproxy_harness):
    async with kilnproxy_harness(plugins=[PLUGIN]) as h:
        stream = await h.openai().chat.completions.create(model=h.model, max_tokens=2, stream=True, messages=[
            {"role": "system", "content": "Reply to ops@example.com"},
            {"role": "user", "content": [{"type": "text", "text": SECRETS}]},
        ])
        assert "".join([c.choices[0].delta.content or "" async for c in stream]) == " Paris is"
        [seen] = await h.mock_requests()
        assert seen["body"]["messages"] == [
            {"role": "system", "content": "Reply to [REDACTED]"},
            {"role": "user", "content": [{"type": "text", "text": SCRUBBED}]},
        ]


async def test_settings_choose_what_is_redacted(kilnproxy_harness):
    settings = {"redact": {"emails": False, "replacement": "***", "patterns": [r"\b\d{3}-\d{2}-\d{4}\b"]}}
    async with kilnproxy_harness(plugins=[PLUGIN], settings=settings) as h:
        answer = await h.openai().completions.with_raw_response.create(
            model=h.model, prompt="SSN 123-45-6789 of a@b.io, token ghp_0123456789abcdefghijABCDEFGHIJ012345",
            max_tokens=2)
        assert "X-Redactions" not in answer.headers
        [seen] = await h.mock_requests()
        assert seen["body"]["prompt"] == "SSN *** of a@b.io, token ***"


async def test_token_id_prompts_are_left_alone(kilnproxy_harness):
    async with kilnproxy_harness(plugins=[PLUGIN]) as h:
        await h.openai().completions.create(model=h.model, prompt=[1, 2, 3], max_tokens=2)
        [seen] = await h.mock_requests()
        assert seen["body"]["prompt"] == [1, 2, 3]


async def test_a_bad_pattern_stops_start_up(kilnproxy_harness):
    with pytest.raises(KilnError, match=r"plugin 'redact': startup failed: ValueError: \[plugins.settings.redact\] "
                                        r"patterns: '\(unclosed' is not a regular expression"):
        async with kilnproxy_harness(plugins=[PLUGIN], settings={"redact": {"patterns": ["(unclosed"]}}):
            pass
