"""What both processes run: the engine ↔ front end wire (:mod:`~service.common.wire`,
:mod:`~service.common.shm`, :mod:`~service.common.model_info`), errors, settings, metrics, the
database and the review store (each process opens its own), image codecs and process helpers.

Nothing here imports :mod:`service.engine`, :mod:`service.frontend` or the supervisor.
"""
