"""A front-end process (N, forked by the supervisor): HTTP (FastAPI on uvicorn), V2 gRPC, decoding
uploads into shared memory, the engine client, and encoding responses.

Imports :mod:`service.common` and :mod:`models`, never :mod:`service.engine`.
"""
