"""The Batch API's files and batches in the store (SPEC 14), on either store.

* ``tables``: the tables of files, their chunks, batches and their lines (one text for both
  stores), made ready in the SQLite file at open (PostgreSQL's: a schema version); ``BatchDb``,
  the SQLite file on a connection of the Batch API's own;
* ``files``: ``FileStore``, files written and read in chunks of ``CHUNK_BYTES`` (a file is never held
  whole in memory), each its org's;
* ``batch_rows``: ``BatchStore``, batches created, listed, cancelled and moved through their statuses;
  the lease that lets one runner at a time run a batch;
* ``batch_lines``: ``LineStore``, a batch's lines: stored once checked, taken to run, their outcomes
  recorded with the batch's counts, the output and error files written from them.

Runs its queries through the tenancy's two databases (``kilnproxy.store.tenancy.sql``: ``SQLiteDb``,
``PostgresDb``). May import ``tenancy`` and the kernel; ``postgres`` imports ``tables`` (its
migration).
"""
