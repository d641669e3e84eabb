"""vge-serve's interfaces: the FastAPI microservice (HTTP, batching, jobs, metrics) and the `vge` CLI.

No math lives here: everything numerical is a call into :mod:`models`.
"""
