"""Peer servers for side-by-side benchmarks (never runtime dependencies of vge-serve)."""
