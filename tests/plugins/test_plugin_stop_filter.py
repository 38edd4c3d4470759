"""plugins/stop_filter.py through a real gateway and the openai SDK."""

from pathlib import Path

import pytest

from kilnproxy import KilnError

PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "stop_filter.py"
PROMPT = "The capital of France is"  # the mock answers " Paris is the capital of France and a city on the Seine."


async def test_stream_stops_cleanly_before_the_sequence(kilnproxy_harness):
    async with kilnproxy_harness(plugins=[PLUGIN], settings={"stop_filter": {"sequences": ["CAPITAL"]}}) as h:
        stream = await h.openai().completions.with_raw_response.create(
            model=h.model, prompt=PROMPT, max_tokens=12, stream=True, stream_options={"include_usage": True},
            extra_body={"mock": {"delay": 0.02}})
        chunks = [c async for c in stream.parse()]
        assert [c.choices[0].text for c in chunks if c.choices] == [" Paris", " is", " the", " "]
        assert [c.choices[0].finish_reason for c in chunks if c.choices] == [None, None, None, "stop"]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
        assert (await h.mock_wait(hangups=1))["hangups"] == 1  # the model server stopped generating
        row = await h.row(stream.headers["X-Neocloud-Generation-Id"])
        assert (row["status"], row["error_code"], row["finish_reason"], row["completion_tokens"]) == (
            200, None, "stop", 4)


async def test_chat_sequence_across_events(kilnproxy_harness):
    settings = {"stop_filter": {"sequences": ["the capital"]}}
    async with kilnproxy_harness(plugins=[PLUGIN], settings=settings) as h:
        stream = await h.openai().chat.completions.create(
            model=h.model, messages=[{"role": "user", "content": PROMPT}], max_tokens=12, stream=True)
        chunks = [c async for c in stream]
        # "the" reached the client before " capital" completed the sequence; the event that did is cut
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == " Paris is the"
        assert chunks[-1].choices[0].finish_reason == "stop"


async def test_case_sensitive(kilnproxy_harness):
    settings = {"stop_filter": {"sequences": ["PARIS", "Seine"], "case_sensitive": True}}
    async with kilnproxy_harness(plugins=[PLUGIN], settings=settings) as h:
        out = await h.openai().completions.create(model=h.model, prompt=PROMPT, max_tokens=12)
        assert out.choices[0].text == " Paris is the capital of France and a city on the "
        assert out.choices[0].finish_reason == "stop"
        assert out.usage.completion_tokens == 12


async def test_later_pieces_of_a_stopped_choice_are_dropped(kilnproxy_harness):
    # n=2 but the model server sends one choice: the filter waits for the second, dropping the rest of the first
    async with kilnproxy_harness(plugins=[PLUGIN], settings={"stop_filter": {"sequences": ["of"]}}) as h:
        stream = await h.openai().completions.with_raw_response.create(
            model=h.model, prompt=PROMPT, max_tokens=8, n=2, stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream.parse()]
        assert [c.choices[0].text for c in chunks if c.choices] == [" Paris", " is", " the", " capital", " "]
        assert chunks[-1].usage.completion_tokens == 8  # the model server's own count: it finished
        row = await h.row(stream.headers["X-Neocloud-Generation-Id"])
        assert row["finish_reason"] == "stop" and row["completion_tokens"] == 8


async def test_no_sequences_no_change(kilnproxy_harness):
    async with kilnproxy_harness(plugins=[PLUGIN]) as h:
        stream = await h.openai().completions.create(model=h.model, prompt=PROMPT, max_tokens=3, stream=True)
        assert "".join([c.choices[0].text async for c in stream]) == " Paris is the"


async def test_bad_sequences_stop_start_up(kilnproxy_harness):
    with pytest.raises(KilnError, match=r"plugin 'stop_filter': startup failed: ValueError: "
                                        r"\[plugins.settings.stop_filter\] sequences must be a list"):
        async with kilnproxy_harness(plugins=[PLUGIN], settings={"stop_filter": {"sequences": "END"}}):
            pass
