"""Which errors PostgreSQL answers say that the database cannot take statements now, rather than
that one statement failed (read by the PostgreSQL store, and by the admin API without loading asyncpg).

An error's SQLSTATE class says it: a batch's data (22), a constraint (23), a deadlock or a
serialization failure (40) are the statement's own; every other class is the database's state:
read-only (25), a full disk or too many connections (53), a lock or statement timeout (55, 57),
a password or a table gone (28, 42), an I/O error (58).
"""

from __future__ import annotations

STATEMENT_ERROR_CLASSES = ("22", "23", "40")


def database_state(sqlstate: str | None) -> bool:
    """Whether an error of SQLSTATE ``sqlstate`` is the database's state rather than the statement's."""
    return (sqlstate or "")[:2] not in STATEMENT_ERROR_CLASSES
