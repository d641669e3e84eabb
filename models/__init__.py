"""vge-serve's ML package: the Variance-Gated Ensembles method, networks, training and evaluation.

Nothing in here knows about HTTP; the `service` package calls into it.
"""
