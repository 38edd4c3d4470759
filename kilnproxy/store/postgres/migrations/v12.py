"""Version 12 of the PostgreSQL schema: the runtime orgs' and keys' ``priority`` and ``weight`` (SPEC 14, fair queues).

``kiln_runtime_orgs`` gains ``priority`` (``interactive`` or ``batch``, NOT NULL,
default ``interactive``) and ``weight`` (above 0, NOT NULL, default 1);
``kiln_keys`` the same two, NULL (the key takes its org's). The same text as
SQLite's second version (``kilnproxy.store.tenancy.sql.TENANCY_SHARES``). A
column added with a constant default rewrites no row.
"""

from ...tenancy.sql import TENANCY_SHARES

V12 = TENANCY_SHARES
