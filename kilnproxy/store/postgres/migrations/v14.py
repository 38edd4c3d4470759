"""Version 14 of the PostgreSQL schema: a key's ``role`` (SPEC 15, an org's own admins).

``kiln_keys`` gains ``role``, ``'admin'`` or ``'member'``; every key made
before is a member. An admin key may also call the org API (``/v1/org``) for
its own org. The index on ``(org, role)`` serves the count of an org's admin
keys that a change by an org admin makes (its org's last active admin key is
kept). Adding a column with a constant default rewrites no row. The SQL is the
SQLite file's (``kilnproxy.store.tenancy.sql.KEY_ROLE``).

No function reads ``kiln_keys``: a replica of the release before, during a
rolling upgrade, keeps working (it names its columns) and makes members.
"""

from ...tenancy.sql import KEY_ROLE

V14 = KEY_ROLE
