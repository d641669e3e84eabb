"""The range of ``abstain_k`` (a margin in standard deviations; the paper, §3): the one definition
that :mod:`models.uncertainty.margin`, the settings, the request schemas and V2 import.

Outside :mod:`models.uncertainty` on purpose: that package imports torch, and ``vge serve`` reads
this range while it validates its settings, before it spawns the engine (2 s sooner on the 2-core
box; tests/test_layout.py checks that the settings import no torch).
"""

#: The smallest ``abstain_k``: a margin of 0 standard deviations defers only ties.
ABSTAIN_K_MIN = 0.0
#: Largest ``abstain_k`` anyone needs: a sample's critical value ``κ = (p̄1 − p̄2)/(s1 + s2)`` is at
#: most ``1/(2ε) = 5e7`` (spreads include ε), so every calibrated ``k`` lies below this bound and the
#: API accepts all of them.
ABSTAIN_K_MAX = 1e9
