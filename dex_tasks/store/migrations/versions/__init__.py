"""The revisions, oldest first: 0001 is the first release's schema."""
