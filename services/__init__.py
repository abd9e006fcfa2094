"""Process entrypoints: the CLI, the runtime that runs actors, benchmarks."""
