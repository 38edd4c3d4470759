"""plugins/usage_jsonl.py through a real gateway and the openai SDK."""

from pathlib import Path

import openai
import orjson
import pytest

from kilnproxy import KilnError

PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "usage_jsonl.py"


def lines(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


async def test_every_usage_row_becomes_a_line(kilnproxy_harness, tmp_path):
    out = tmp_path / "logs" / "usage.jsonl"
    async with kilnproxy_harness(plugins=[PLUGIN], settings={"usage_jsonl": {"path": str(out)}}) as h:
        client = h.openai()
        await client.completions.create(model=h.model, prompt="Hi", max_tokens=2)
        stream = await client.chat.completions.create(model=h.model, messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=3, stream=True)
        [c async for c in stream]
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="no-such-model", prompt="Hi")
        await h.usage_recorded()
        rows = await h.rows()
        assert lines(out) == rows  # every column, in commit order, while the gateway runs
        assert [(r["endpoint"], r["status"], r["completion_tokens"]) for r in rows] == [
            ("completions", 200, 2), ("chat/completions", 200, 3), ("completions", 404, 0)]
    assert len(lines(out)) == 3  # closed at shutdown, nothing lost or doubled


async def test_appends_and_resolves_relative_to_the_config(kilnproxy_harness, tmp_path):
    (tmp_path / "usage.jsonl").write_bytes(b'{"earlier": true}\n')
    async with kilnproxy_harness(plugins=[PLUGIN], settings={"usage_jsonl": {"path": "usage.jsonl"}},
                                 base_dir=tmp_path) as h:
        await h.openai().completions.create(model=h.model, prompt="Hi", max_tokens=2)
    got = lines(tmp_path / "usage.jsonl")
    assert got[0] == {"earlier": True} and got[1]["status"] == 200 and len(got) == 2


async def test_path_is_required(kilnproxy_harness):
    with pytest.raises(KilnError, match=r"plugin 'usage_jsonl': startup failed: ValueError: "
                                        r"\[plugins.settings.usage_jsonl\] path is required"):
        async with kilnproxy_harness(plugins=[PLUGIN]):
            pass
