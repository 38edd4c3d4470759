"""The tenancy: who may call the gateway, and the orgs and keys it serves.

* ``auth``: ``KeyRing``, an API key (``Authorization: Bearer``, or ``x-api-key``) to its key entry;
* ``batch_credential``: ``BatchCredential``, the credential of this process's Batch API runner, resolved
  to the batch's key at batch priority;
* ``key_ring``: ``Tenants``, the config's and the store's orgs and keys, merged in memory;
* ``views``: the org and key objects of the admin API, ``GET /v1/key`` and the ``orgs`` / ``keys``
  commands;
* ``changes``: the rules of changing orgs, keys and grants at runtime, shared by the admin API and
  the org API (ops: the operator's changes, or one org's by its admin keys), the inspector and the
  commands (cli).

Below the request's path (setup.cfg: the ``proxy_layers`` contract): may import only
``request_record`` and ``request_observers`` of proxy/ (it needs neither today), besides the kernel
and ``store``; knows nothing of the relays or the upstreams. Used by ``gateway``, ``rules``, the
endpoints, and by ops and cli.
"""
