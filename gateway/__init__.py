"""The channel gateway: the child process that carries chat platforms to agents (DESIGN §8).

It talks to the server only through the public protocol client; nothing here imports the rest of
the server. Today this package holds the platform-independent core: the ledger and routes
(`db`, `ledger`, `routing`), the turn envelope (`envelope`), reply splitting (`split`), the per-chat
rate limiter (`ratelimit`) and the stdio control protocol (`stdio`).
"""
