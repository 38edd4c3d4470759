"""Runtime tenancy in the store: orgs, keys and credit grants made while the gateway runs, on either store.

* ``orgs_keys``: ``TenancyStore``, the reads and writes of orgs, keys, grants and audit events;
* ``sql``: the two databases behind one small interface (``SQLiteDb``, ``PostgresDb``) and the
  SQLite file's tenancy schema (``migrate_sqlite``; PostgreSQL's is a schema version);
* ``key_usage``: a key's usage in its current period: the period's bounds, and the query that sums it;
* ``validation``: strict checks of the bodies that change orgs, keys and grants, as pure functions;
* ``watch``: a running gateway told of changes within a second (NOTIFY, or a counter in the file).

May import: the kernel only; nothing else of the store (``postgres`` and ``books`` import it).
"""
