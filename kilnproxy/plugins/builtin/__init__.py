"""Built-in features, written as plugins on the public hooks (see ``DEFAULT_PLUGINS``).

* ``pricing``: the response rules of a non-streamed answer (``transform_response``): the catalog's
  model id and ``usage.cost``;
* ``upstream_body``: the body rules (``rewrite_request``): the upstream's model id and, on a streamed
  completion, ``stream_options.include_usage`` forced so that every stream is metered.
"""
