"""The ``kilnproxy`` command (``python -m kilnproxy``) and its sub-commands.

* ``main``: the parser, ``serve`` and the small sub-commands;
* ``settings_text``: ``check-config``'s lines saying where each setting came from (file, environment,
  default), no secret printed;
* ``fixtures``: ``record``, ``replay`` and ``mock-upstream --replay``;
* ``usage``, ``import_ledger``, ``reload``: reading the ledger, copying it to PostgreSQL, reloading;
* ``tenancy``, ``tenancy_text``: ``orgs`` and ``keys``, runtime orgs, keys and grants in the store;
* ``demo``: the built-in demo's config.

May import: any part of kilnproxy. Nothing imports it but ``kilnproxy.__main__``.
"""
