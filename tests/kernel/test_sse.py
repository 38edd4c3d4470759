"""The byte-level SSE parser: any line length, CR/LF/CRLF, events split anywhere."""

import pytest

from kilnproxy.sse import COMMENT, DATA, SSEParser

STREAM = (b'data: {"a":1}\r\n\r\n: ping\n\ndata: {"b":\ndata: 2}\n\nevent: x\nid: 3\nretry: 9\n'
          b'data:{"c":3}\r\rdata: [DONE]\n\n')
EXPECTED = [(DATA, b'{"a":1}'), (COMMENT, b": ping"), (DATA, b'{"b":\n2}'), (DATA, b'{"c":3}'),
            (DATA, b"[DONE]")]


def feed_all(pieces):
    parser = SSEParser()
    out = []
    for piece in pieces:
        out.extend(parser.feed(piece))
    out.extend(parser.close())
    return out


def test_whole_stream_at_once():
    assert feed_all([STREAM]) == EXPECTED


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 16])
def test_split_at_every_possible_place(size):
    pieces = [STREAM[i:i + size] for i in range(0, len(STREAM), size)]
    assert feed_all(pieces) == EXPECTED


def test_crlf_split_between_reads_is_one_line_end():
    assert feed_all([b"data: 1\r", b"\n\r", b"\ndata: 2\r\n\r\n"]) == [(DATA, b"1"), (DATA, b"2")]


def test_a_line_of_many_megabytes_in_small_reads():
    payload = b"y" * (8 * 1024 * 1024)
    frame = b"data: " + payload + b"\n\n"
    pieces = [frame[i:i + 65536] for i in range(0, len(frame), 65536)]
    assert feed_all(pieces) == [(DATA, payload)]


def test_last_event_without_blank_line_still_counts():
    assert feed_all([b"data: tail"]) == [(DATA, b"tail")]


def test_blank_lines_alone_dispatch_nothing():
    assert feed_all([b"\n\n\r\n\n"]) == []
