"""The repository's tools, one module each, run from the repository root as `python -m tools.NAME` (tools/bench:
`python -m tools.bench`); test fixtures live with the tests, not here."""
