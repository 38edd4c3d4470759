"""A batch's lines run at batch priority (SPEC 14): on a capped upstream they leave its last free slot
(``batch_reserve``) to interactive requests, which the slot goes to while lines wait for it."""

import asyncio

from batch_inputs import GatedUpstream, ended, line, submitted


async def test_a_line_waits_while_the_reserved_slot_serves_an_interactive_request(harness, eventually):
    async with GatedUpstream() as upstream:
        def configure(config):  # 2 slots, batch_reserve 1 (its default): a batch line may hold one of them
            config["models"][0]["upstreams"] = [{"url": upstream.url, "max_in_flight": 2}]
            config["models"][0]["queue_timeout"] = 60
            config["batches"] = {"max_in_flight": 3}

        async with harness(configure=configure) as h:
            client = h.openai()
            _, batch = await submitted(client, [line(i) for i in range(3)])
            await upstream.arrivals(1)

            async def lines_in_flight() -> bool:  # the runner has sent all three: two wait for a slot
                async with h.session.get(f"{h.url}/metrics") as resp:
                    return "kilnproxy_batch_lines_in_flight 3.0" in (await resp.text()).splitlines()

            await eventually(lines_in_flight)
            interactive = asyncio.ensure_future(client.completions.create(**line(9)["body"]))
            await upstream.arrivals(2)
            assert [b["prompt"] for b in upstream.bodies] == ["p0", "p9"]  # the free slot went to it
            await upstream.allow(10)
            await interactive
            assert (await ended(client, batch.id)).status == "completed"
