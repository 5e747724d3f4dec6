"""The first release's schema, for the migration tests (nothing here is imported by them)."""
