"""The store: where usage rows, admission state and spending live.

* ``ledger``: the ``Ledger`` interface the request path writes rows through;
* ``sqlite``: ``SQLiteLedger``, the store of one gateway process;
* ``postgres``, ``postgres_schema`` (+ ``postgres_v2``, ``postgres_v3``), ``replicas``,
  ``spool``: the store that several replicas share, its versioned schema, replica
  liveness and the rows kept locally while PostgreSQL is out of reach;
* ``limits``, ``minute_windows``: admission (in-flight slots, credit and key-limit holds,
  per-minute windows) and credits;
* ``batches``, ``loop_commits``, ``checkpoint``: group commit (by a writer task, or on the event
  loop's thread for SQLite) and SQLite's background checkpoints;
* ``reads``: the ledger as the commands read it;
* ``tenancy``, ``tenancy_sql``, ``key_usage``, ``tenancy_validation``: orgs, keys and
  credit grants made at runtime, on either store, and the admin bodies' checks;
* ``tenancy_watch``: a running gateway told of changes within a second (NOTIFY, or a counter);
* ``tenancy_books``: each org's spending and holds as the store has them, and the store
  opened by a command.

The store knows rows, not requests. May import: the kernel only.
"""
