"""``/metrics`` counts the Batch API's lines by outcome and shows the batch queue's depth."""

from batch_inputs import ended, line, submitted


async def metric_lines(gw) -> list[str]:
    async with gw.session.get(f"{gw.url}/metrics") as resp:
        assert resp.status == 200
        return (await resp.text()).splitlines()


async def test_batch_lines_are_counted_by_outcome(gw):
    client = gw.openai()
    _, batch = await submitted(client, [line(0), line(1), line(2, model="no-such-model")])
    await ended(client, batch.id)
    found = await metric_lines(gw)
    assert 'kilnproxy_batch_lines_total{outcome="completed"} 2.0' in found
    assert 'kilnproxy_batch_lines_total{outcome="failed"} 1.0' in found
    assert 'kilnproxy_batch_lines_total{outcome="retried"} 0.0' in found
    assert "kilnproxy_batch_queue_depth 0.0" in found and "kilnproxy_batch_lines_in_flight 0.0" in found


async def test_the_batch_queue_depth_is_the_lines_waiting(harness, eventually):
    from batch_inputs import GatedUpstream

    async with GatedUpstream() as upstream:
        def configure(config):
            config["models"][0]["upstreams"] = [upstream.url]
            config["batches"] = {"max_in_flight": 1}

        async with harness(configure=configure) as h:
            _, batch = await submitted(h.openai(), [line(i) for i in range(5)])
            await upstream.arrivals(1)

            async def waiting():
                found = await metric_lines(h)
                return "kilnproxy_batch_queue_depth 4.0" in found and "kilnproxy_batch_lines_in_flight 1.0" in found

            await eventually(waiting)
            await upstream.allow(5)
            await ended(h.openai(), batch.id)
