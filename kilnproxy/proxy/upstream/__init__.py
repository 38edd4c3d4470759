"""The upstreams: reaching a model's servers (where routing goes).

* ``routes``: ``Route``, a model's upstreams: routing (least_busy, round_robin, cache_aware), failover and marking down, and sending a
  request on a slot;
* ``slots``: each upstream's ``max_in_flight`` slots and the queue of requests waiting for one;
* ``fair_queue``: that queue's order (SPEC 14): a request's ``Claim`` (org, weight, priority), weighted
  round robin between orgs, first come, first served within one;
* ``deadlines``: a model's ``first_byte_timeout`` (fail over) and ``request_timeout`` (give up);
* ``client``: the gateway's HTTP/1.1 client for the model servers' POSTs;
* ``connections``: its kept-alive connections, one pool per origin;
* ``responses``: ``UpstreamResponse``, one answer as the relays read it (status, headers, the body as
  it arrives);
* ``load_readers``: the servers' own load (llama.cpp, vLLM, SGLang) read off the request path by
  ``LoadPoller``, one task per origin (SPEC 13's ``load_poll``);
* ``affinity``: ``cache_aware`` routing's rules: a request's affinity key, the upstreams' order per
  key (rendezvous hashing), the bounded-load choice;
* ``token_counts``: the prompt and cached tokens each upstream reported, by model (its prompt-cache
  hit rate), for ``/metrics`` and the inspector.

Below the request's path (setup.cfg: the ``proxy_layers`` contract): may import only
``request_record`` and ``request_observers`` of proxy/, besides the kernel; knows nothing of the
relays or the tenancy. Used by the request's path (``gateway``, ``fallbacks``, ``forward``, ...) and
the endpoints.
"""
