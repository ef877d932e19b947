"""Test helpers shared by the test files and the benches: one copy of each, importable without pytest.

`cli` runs the CLI as a subprocess, `serve` starts a real `serve` on loopback, `ws` speaks the /ws
protocol frame by frame, `wait` polls for a condition, `net` finds free ports, `kernel` opens an
in-process `Server`, `certs` writes a throwaway TLS certificate.
"""
