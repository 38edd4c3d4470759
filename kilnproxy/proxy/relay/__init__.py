"""The relays: a streamed answer, from the upstream's bytes to the client's, a chunk at a time.

The completions' stream (plain ``data:`` events), ``EventRelay`` and its parts:

* ``plain_relay``: ``EventRelay``, the chunk: where a chunk's whole events are cut and which path takes
  them; ``ModelNames``, what it is told of the model it renames;
* ``plain_decider``: which events go out as they came (renamed), decided from their bytes, and which
  are parsed;
* ``plain_scanner``: ``PlainRun``, the same decision for a whole run of events at once;
* ``plain_transforms``: the path when ``transform_event`` plugins are loaded;
* ``plain_bookkeeping``: what the stream reported (usage, finish reasons), the error events that end
  it, and its tail; ``usage_chunk``: the usage chunk it writes before ``[DONE]``;
* ``tapped_stream``: the relay and response of a stream the inspector captures (``Tap``);

the framed streams (Responses, Messages), and what both relays use:

* ``framed_relay``: ``FramedRelay``, the streams that keep their ``event:`` framing;
* ``event_plugins``: a ``transform_event`` plugin bound once per stream;
* ``event_json``: the JSON orjson refuses (a lone surrogate escape) read and written;
* ``errors``: the error events a started stream ends with (``StreamPluginError``);
* ``anthropic_errors``: the gateway's errors in Anthropic's form;
* ``sse_response``: ``SSEResponse``, the client's streamed response.

Below the request's path (setup.cfg: the ``proxy_layers`` contract): may import only
``request_record`` and ``request_observers`` of proxy/, besides the kernel and ``plugins``; knows
nothing of the upstreams (``upstream``) or the tenancy. Used by the writers (``stream_writer``,
``framed_writer``) and the endpoints.
"""
