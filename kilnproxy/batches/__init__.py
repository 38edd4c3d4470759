"""The Batch API (SPEC 14): ``/v1/files``, ``/v1/batches``, and the runner that runs batches' lines.

* ``files_api``, ``batches_api``: the endpoints (OpenAI's, so the ``openai`` SDKs' ``files`` and
  ``batches`` work unchanged);
* ``objects``: the file and batch objects, list pages, the API's errors;
* ``service``: ``BatchService``, what the endpoints and the runner share (the store's files, batches
  and lines), and its app key;
* ``input_check``: a batch's input checked before any line runs;
* ``runner``: ``BatchRunner``, the replica's runner (leases, slots, its counts);
* ``job``: ``BatchJob``, one batch run (its lines, retries, cancel, expiry, the end);
* ``line_sender``: a line sent through the whole request path, to this process's own listener;
* ``outcomes``: a line's output or error line, the output and error files;
* ``install``: the Batch API in the app (routes, start and stop, the listening address).

Between ops and the proxy (setup.cfg's ``layers``): may import ``proxy``, ``store`` and the kernel;
the web app installs it, ops and the inspector read it.
"""
