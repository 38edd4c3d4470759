"""The PostgreSQL schema's versions after the first, each the SQL that takes a database from the
version before to its own (``kilnproxy.store.postgres.schema.MIGRATIONS``); never edited once released.

* ``v2``: runtime tenancy (orgs, keys, grants), keys' limits, per-minute limits;
* ``v3``: fallbacks across models (``requested_model``);
* ``v4``: a cheaper settlement (per-minute entries settled in ``kiln_settle``), the same behaviour;
* ``v5``: a key's per-minute entries let go once out of the window;
* ``v6``: a settlement reads only the rows it settles;
* ``v7``: a reap never waits for a hold a settlement is deleting;
* ``v8``: a settlement and an admission take per-minute entries in one order;
* ``v9``: a per-minute window's tokens summed as a NUMERIC;
* ``v10``: a reap takes per-minute entries in the order of their ids too;
* ``v11``: the usage row's ``upstream`` (routing across upstreams);
* ``v12``: the runtime orgs' and keys' ``priority`` and ``weight`` (fair queues);
* ``v13``: the Batch API's tables and the usage row's ``batch_id``;
* ``v14``: a key's ``role`` (an org's own admins);
* ``v15``: ``usage_daily``, the spend query's rollup, and its triggers.

May import: ``kilnproxy.store.tenancy`` (the tenancy tables ``v2`` creates), ``kilnproxy.store.batch_api``
(the Batch API's tables ``v13`` creates) and the kernel; nothing else of the store.
"""
