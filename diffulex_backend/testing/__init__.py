"""Helpers for tests, benchmarks and tools that the engine itself never imports: random-weight checkpoints."""
