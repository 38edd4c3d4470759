async def test_streamed_completion_through_openai_sdk(gw):
    client = gw.openai()
    stream = await client.completions.create(model=gw.model, prompt="The capital of France is", max_tokens=4,
                                             stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " Paris is the capital"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 4
    rows = await gw.rows()
    assert len(rows) == 1 and rows[0]["status"] == 200
