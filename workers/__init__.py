"""Worker entry points and the example tools used by the tests and the demo."""
