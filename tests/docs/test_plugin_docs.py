"""The examples of docs/plugins.md work as written."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "plugins.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", DOC, re.S)


@pytest.mark.parametrize("n", range(len(BLOCKS)))
def test_every_python_example_compiles(n):
    compile(BLOCKS[n], f"docs/plugins.md python block {n}", "exec")


async def test_the_plugin_in_ten_lines(harness, tmp_path):
    ten_lines = BLOCKS[0]
    assert len(ten_lines.strip().splitlines()) <= 13  # ten lines of code, a comment and two blank lines
    (tmp_path / "house_style.py").write_text(ten_lines)
    async with harness(plugins=[tmp_path / "house_style.py"]) as h:
        client = h.openai()
        out = await client.completions.create(model=h.model, prompt="Hi", max_tokens=1000)
        assert out.usage.completion_tokens == 256
        stream = await client.completions.create(model=h.model, prompt="Yours, Sincerely,", max_tokens=5,
                                                 stream=True, extra_body={"mock": {"echo": True}})
        chunks = [c async for c in stream]
        assert [(c.choices[0].text, c.choices[0].finish_reason) for c in chunks] == [
            ("Yours, Sincerely, Paris", "stop")]


async def test_the_testing_example(kilnproxy_harness):
    [example] = [b for b in BLOCKS if "async def test_redacts" in b]
    namespace = {}
    exec(compile(example, "docs/plugins.md", "exec"), namespace)
    await namespace["test_redacts"](lambda **options: kilnproxy_harness(base_dir=REPO, **options))


async def test_the_recorded_stream_example(kilnproxy_harness):
    [example] = [b for b in BLOCKS if "async def test_shout_on_llama_cpp" in b]
    assert len(example.strip().splitlines()) < 15
    namespace = {}
    exec(compile(example, "docs/plugins.md", "exec"), namespace)
    await namespace["test_shout_on_llama_cpp"](kilnproxy_harness)
