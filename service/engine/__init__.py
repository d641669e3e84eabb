"""The engine process (one, spawned by the supervisor): batching across front ends, the predictor
on the device, the served model and its history, training jobs, drift monitoring.

Imports :mod:`service.common` and :mod:`models`, never :mod:`service.frontend` (no web app here).
"""
