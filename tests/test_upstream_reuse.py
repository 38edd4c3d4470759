"""A kept-alive upstream connection the server closes as it is reused (llama.cpp closes its connection
right after each streamed answer, without a ``Connection: close``): the POST is sent again on another
connection, so the client never sees a 502 for it."""

import asyncio

import orjson

from kilnproxy.testing import completion_body

ANSWER = orjson.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                       "choices": [{"index": 0, "text": " Paris", "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})


class HangsUpOnReuse:
    """An HTTP/1.1 server that answers the first request of each connection (keeping it alive) and
    closes the connection, unanswered, when a second request arrives on it."""

    def __init__(self) -> None:
        self.connections = 0
        self.hung_up = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        answered = False
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                if answered:
                    self.hung_up += 1
                    return
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nKeep-Alive: timeout=5\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER))
                await writer.drain()
                answered = True
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def test_a_post_on_a_connection_the_server_hangs_up_is_sent_again(harness):
    upstream = HangsUpOnReuse()
    server = await asyncio.start_server(upstream.serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    try:
        async with harness(configure=lambda c: c["models"][0].update(upstreams=[url])) as h:
            for _ in range(3):
                async with h.post("/v1/completions", completion_body()) as resp:
                    assert resp.status == 200, await resp.text()
            assert upstream.hung_up == 2  # the second and third each met a connection being closed
            assert upstream.connections == 3
            assert [r["status"] for r in await h.rows()] == [200, 200, 200]
            assert all(u.failures == 0 for u in h.gw.routes[h.model].upstreams)  # not counted against it
    finally:
        server.close()
        await server.wait_closed()
