"""SQLite: the store of one gateway process, one file (``[storage] path``) in WAL mode.

* ``ledger``: ``SQLiteLedger``, the ``Ledger`` of one process: group commit, the file that cannot be
  written (down, refusals, retries), the stop, reads of one row;
* ``loop_commits``: ``LoopCommits``, rows committed on the event loop's own thread, the writer
  thread as fallback;
* ``inserts``: the INSERT statements and their parameters, and the row journal replayed at start-up;
* ``schema``: the file's table, made ready and proved writable (``prepare_file``), the connection the
  loop commits on, read-only reads from another process (``read_rows``);
* ``reopen``: a -wal, -shm or database file deleted under the gateway: the rows saved and the files
  opened anew, with the other connections of the process (``FileUser``);
* ``spend_rollup``: ``usage_daily``, the rollup of the rows by day, org, key and model, and the
  triggers that keep it in step;
* ``checkpoint``: ``Checkpointer``, WAL checkpoints off the commit path;
* ``inspector_reader``: ``SQLiteReader``, the inspector's own connection to the file, which fills the
  inspector's tables (``kilnproxy.store.inspector_tables``) as it reads them.

May import: the store's root modules (``ledger``, ``batches``, ``row_journal``, ``inspector_tables``)
and the kernel; not ``postgres``, ``tenancy``, ``books`` or ``reads`` (setup.cfg's store_layers).
"""
