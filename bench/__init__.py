"""The benchmark apparatus of wan-sage: harness, tools, records and their tests. Not part of the pack.

Run a tool from the repository root as ``python -m bench.<tool>``; bench/README.md lists them."""
