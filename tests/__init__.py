"""The test suite: a folder per area (docs/testing.md), the shared helpers in tests/helpers/."""
