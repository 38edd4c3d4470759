"""The store: where usage rows, admission state and spending live.

Folders, one per kind of store and one for what both hold at runtime:

* ``sqlite/``: ``SQLiteLedger``, the store of one gateway process (one file in WAL mode);
* ``postgres/``: ``PostgresStore``, the store that several replicas share: ledger and admission,
  its versioned schema (``postgres/migrations/``), replica liveness and the spool;
* ``tenancy/``: orgs, keys and credit grants made at runtime, on either store;
* ``batch_api/``: the Batch API's files, batches and their lines, on either store.

Modules beside them, which both stores use:

* ``ledger``: the ``Ledger`` interface the request path writes rows through, and
  ``store_unavailable``, the one 503 a store answers with;
* ``limits``, ``minute_windows``: admission (the ``Admission`` interface, in-flight slots, credit and
  key-limit holds, per-minute windows) and credits;
* ``batches``: group commit by a writer task (``Batches``, ``GroupCommitted``);
* ``row_journal``: the row of a request served alone, appended to a file before its commit;
* ``inspector_tables``: the inspector's tables and SQL (pages of requests, usage buckets), both stores;
* ``reads``: the ledger as the commands read it (either store);
* ``spend``: the spend query (usage summed by day, model, key and org), its SQL on either store, its
  answer and CSV;
* ``books``: each org's spending and holds as the store has them, and the store opened by a command.

Inside, each imports only what is below it (setup.cfg's ``store_layers``): ``books``, then
``reads``, then ``postgres``, then ``batch_api``, then ``sqlite`` and ``tenancy`` (neither imports the other), then
the modules above (``limits`` over ``minute_windows``).

The store knows rows, not requests. May import: the kernel only.
"""
