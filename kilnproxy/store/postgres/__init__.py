"""PostgreSQL: the store several replicas share (``[storage] url``), ledger and admission in one.

* ``store``: ``PostgresStore``, its life cycle (open, close), reachability (down, up again, the
  log), reads that see this replica's every ended response;
* ``admission``: ``Admitting``, admission in one round trip (``kiln_admit``) and a fallback's hold;
* ``settlement``: ``Settling``, rows from ``submit`` to settled (``kiln_settle``), journaled or
  spooled, and the NOTIFY of committed rows for the inspectors;
* ``connection``: every statement's bounds, what a database out of reach raises (``down_error``),
  the URL without its password, ``?`` placeholders numbered;
* ``pinned``: ``Pinned``, the admitter's and the writer's own connections;
* ``replicas``: ``Heartbeat``, replica liveness, and the holds of dead replicas reaped;
* ``org_locks``: ``OrgLocks``, orgs whose row another session keeps locked, set aside alone;
* ``sqlstates``: which PostgreSQL errors mean the database cannot take statements now (no asyncpg);
* ``spool``: ``Spool``, the rows kept in a local SQLite file while PostgreSQL is out of reach;
* ``spool_flush``: the spooled rows settled, oldest first, once PostgreSQL answers;
* ``schema``: the versioned schema (``kiln_schema``), created and migrated at start-up
  (``migrate``), with version 1 in full;
* ``migrations/``: versions 2 to 10, one module each.

May import: ``sqlite`` (the spool's file: its table and INSERT), ``tenancy`` and ``batch_api`` (their
tables, in a migration), the store's root modules and the kernel; not ``books`` or ``reads`` (setup.cfg's
store_layers).
"""
