"""Storage: the tables' documented schema, checked on every write and read (`schema`), and atomic writes
(`storage`)."""
