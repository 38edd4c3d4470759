"""Version 6 of the PostgreSQL schema: a settlement reads only the rows it settles.

``kiln_settle`` looks for ``replica_lost`` rows among the incoming ids (such a
row is replaced by the real one). No index led to them: PostgreSQL found them
by reading all of ``usage_events`` (``error_code = 'replica_lost'``, joined to
the batch by hashing), at every settlement, so that a settlement's time grew
with the table: 0.24 ms at 200 rows, 0.47 ms at 5,000, 2.9 ms at 20,000
(one row, fsync off). A partial index of those rows only (they are rare: a
replica died with requests in flight) makes the search a look into a nearly
empty index. Built in the migration's transaction (one pass over the table,
during which settlements wait for it, as they wait for any lock, up to
``lock_timeout``, then spool their rows). No function changes: replicas of
the release before use it as they are during a rolling upgrade.
"""

V6 = """
CREATE INDEX usage_events_replica_lost ON usage_events (id) WHERE error_code = 'replica_lost';
"""
