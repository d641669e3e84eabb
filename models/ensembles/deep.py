"""Deep ensemble (DE): M independently initialised networks, executed vectorised.

The members' parameters and buffers are stacked along a leading member axis with
``torch.func.stack_module_state`` and the network is run once per call through
``torch.func.functional_call`` under ``torch.func.vmap`` (``randomness="different"`` so every member
draws its own dropout masks). There is no Python loop over members at inference, and BatchNorm
running statistics stay per member because the buffers are stacked too. A sequential loop
(:meth:`DeepEnsemble.forward_sequential`) is kept for equivalence tests and the benchmark.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, stack_module_state, vmap

from .base import Ensemble


def _key(name: str) -> str:
    return name.replace(".", "__")


class DeepEnsemble(Ensemble):
    """``x (B, Cin, H, W) -> EnsembleOutput(p (B, M, C), q (B, M, C) | None)``.

    ``make_member`` builds one full network (backbone + head) mapping images to logits (B, C);
    it is called ``members`` times, so each member gets its own random initialisation.
    """

    kind = "de"

    def __init__(
        self,
        make_member: Callable[[], nn.Module],
        num_classes: int,
        members: int,
        vgn: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if members < 1:
            raise ValueError(f"members must be >= 1, got {members}")
        nets = [make_member() for _ in range(members)]
        params, buffers = stack_module_state(nets)  # name -> (M, ...)
        self._names_p = list(params)
        self._names_b = list(buffers)
        self.params = nn.ParameterDict({_key(n): nn.Parameter(t) for n, t in params.items()})
        for n, t in buffers.items():
            self.register_buffer(f"buf__{_key(n)}", t)
        # A stateless template for functional_call; kept out of the module tree (not registered)
        # so it is neither saved nor moved: every tensor is supplied at call time.
        base = copy.deepcopy(nets[0]).to("meta")
        object.__setattr__(self, "_template", base)
        self.vgn = vgn
        self.members = members
        self.num_classes = num_classes

    def train(self, mode: bool = True) -> DeepEnsemble:  # keep the template's mode in sync
        super().train(mode)
        self._template.train(mode)
        return self

    def _stacked(self) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        params = {n: self.params[_key(n)] for n in self._names_p}
        buffers = {n: getattr(self, f"buf__{_key(n)}") for n in self._names_b}
        return params, buffers

    def member_logits(self, x: Tensor) -> Tensor:
        """Vectorised member logits (B, M, C)."""
        params, buffers = self._stacked()
        template = self._template

        def one(p: dict[str, Tensor], b: dict[str, Tensor], inp: Tensor) -> Tensor:
            return functional_call(template, (p, b), (inp,))

        logits = vmap(one, in_dims=(0, 0, None), randomness="different")(params, buffers, x)
        return logits.transpose(0, 1)  # (M, B, C) -> (B, M, C)

    def forward_sequential(self, x: Tensor) -> Tensor:
        """Reference implementation: a Python loop over members -> logits (B, M, C)."""
        params, buffers = self._stacked()
        outs = [
            functional_call(
                self._template,
                ({n: t[m] for n, t in params.items()}, {n: t[m] for n, t in buffers.items()}),
                (x,),
            )
            for m in range(self.members)
        ]
        return torch.stack(outs, dim=1)

    def member_log_probs(self, x: Tensor) -> Tensor:
        """Member log-probabilities (B, M, C)."""
        return torch.log_softmax(self.member_logits(x), dim=-1)
