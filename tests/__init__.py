"""The test suite; `tests.support` holds what tests and benches share (production code never imports it)."""
