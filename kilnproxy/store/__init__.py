"""The stores: the usage ledger, admission state and runtime tenancy, on SQLite or PostgreSQL."""
