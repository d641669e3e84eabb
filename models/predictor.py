"""``Predictor``: a loaded model and everything a server asks of it.

* :meth:`Predictor.conform` (uint8 image -> the card's channels and size, still uint8) and
  :meth:`Predictor.prepare` (conform, then scale to [0, 1] and normalise with the card's mean/std),
  with ``torchvision.transforms.v2``.
* :meth:`Predictor.forward` runs prepared inputs and returns CPU tensors (evaluation, tests);
  :meth:`Predictor.run` is the serving forward pass: a list of request inputs (uint8 pixels,
  normalised on the device in one op, or prepared float32) -> device tensors.
* Every documented pairing works on every device: ``score(forward(x))``,
  ``score_columns(run(parts), options)`` and ``score_columns(forward(x), options)``. The decision
  methods take members wherever they live (CPU or the predictor's device) and compute on the
  predictor's device; their answers are host values (NumPy / JSON-ready).
* :meth:`Predictor.options` resolves a request's options into a hashable
  :class:`~models.serving.ScoreOptions` (the single place the default ``abstain_k`` is chosen);
  :meth:`Predictor.score_columns` computes the served decision on the device and copies one packed
  block back (:class:`~models.serving.ScoreColumns`); :meth:`Predictor.score` gives JSON-ready rows.
  On CUDA the decision is one Triton kernel (:func:`models.kernels.decision.fused_decide`), checked
  against :func:`models.serving.decide` when the predictor is built; elsewhere it is ``decide``
  (compiled by :meth:`Predictor.compile`).

One answer, one distribution (:func:`models.uncertainty.scoring.answer_members`): for VGN models the
prediction, label, probabilities, VGMU/SNR, abstain and TU/AU/EU all come from the gated members
``q`` (the mixture trained with the NLL, Section 3.1), for other models from ``p``.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from models.checkpoint import ModelCard, load_checkpoint
from models.data import normalise_uint8
from models.device import resolve_device
from models.ensembles import EnsembleOutput
from models.nets.fold import fold_batchnorm
from models.prepare import Canonical, Finding, PrepareMode, default_prepare, prepare_image
from models.serving import (
    DEFAULT_TOP_K,
    FIXED_COLUMNS,
    ScoreColumns,
    ScoreOptions,
    compile_decide,
    decide,
    resolve_options,
)

__all__ = ["Predictor", "bucket_sizes", "default_device"]

#: ``(members (B, M, C), abstain_k, top_k) -> packed (B, 7 + 2n) float64``, see :func:`decide`.
Decide = Callable[[Tensor, float, int], Tensor]


def default_device() -> torch.device:
    """CUDA when a GPU is present, else the CPU (:func:`models.device.resolve_device`)."""
    return resolve_device()


def bucket_sizes(max_batch: int) -> tuple[int, ...]:
    """The power-of-two batch buckets a compiled predictor runs for batches up to ``max_batch``:
    ``1, 2, 4, …`` up to the first power of two ``>= max_batch``."""
    out = [1]
    while out[-1] < max_batch:
        out.append(out[-1] * 2)
    return tuple(out)


class Predictor:
    """A loaded, verified model plus its card; safe to call from several threads for inference.

    Compiled (:meth:`compile`), calls into compiled code (the forward pass, and the decision where
    it is torch's) take turns: code from ``torch.compile`` is not thread-safe (a guard miss would
    recompile on two threads at once). The fused decision kernel (CUDA) and the copy back to the
    host are outside that turn, so with two serving threads one launches its batch while the other
    waits for its copy.
    """

    def __init__(self, module: nn.Module, card: ModelCard, device: torch.device) -> None:
        self.module = module.eval()
        self.card = card
        # As a tensor on it reports it ("cuda" -> "cuda:0"): what the members computed here
        # compare equal to, so score_columns moves only members that live elsewhere.
        self.device = torch.empty(0, device=device).device
        self._mean = list(card.mean)
        self._std = list(card.std)
        self._decide: Decide = decide
        self._fused = False
        if device.type == "cuda":
            fused = fused_decision(device, card.num_classes, self._output_members())
            if fused is not None:
                self._decide, self._fused = fused, True
        self._compiled = False
        self._compiled_turn = threading.Lock()
        self._staging = threading.local()  # per serving thread: a pinned input buffer on CUDA

    @classmethod
    def from_dir(cls, model_dir: str | Path, device: str | torch.device | None = None) -> Predictor:
        """Load and verify ``model_dir`` (see :func:`models.checkpoint.load_checkpoint`)."""
        dev = resolve_device(device)
        if dev.type == "cuda":
            # Full float32 convolutions and matmuls (cuDNN allows TF32 by default): a GPU answers
            # what the CPU answers, to float32 round-off, so thresholds calibrated anywhere hold.
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
        module, card = load_checkpoint(model_dir, dev)
        # BatchNorm folded into the layer before it (models.nets.fold): one pass less over every
        # activation map; answers agree to float32 round-off.
        fold_batchnorm(module.eval())
        if dev.type == "cpu":
            # oneDNN's NHWC convolution kernels: the default model's forward pass is 1.4-2.4x
            # faster on one thread than with NCHW weights (docs/benchmarks.md, "Forward pass on
            # CPU"). Only 4-d weights change layout; inputs stay NCHW (the convolution follows the
            # weight's format), and answers agree with NCHW to float32 round-off (~1e-6). Only the
            # 4-d weights: a deep ensemble's stacked members are 5-d, which channels_last (and so
            # ``Module.to(memory_format=...)``) refuses. ``Tensor.to``, not ``.contiguous``: a
            # one-channel convolution's weight already counts as channels_last-contiguous, and
            # ``.contiguous`` kept its NCHW strides, which made the first convolution run NCHW
            # (the default model's batch of 32 took 1.4x as long; benchmarks.ab caught it).
            with torch.no_grad():
                for param in module.parameters():
                    if param.dim() == 4:
                        param.data = param.data.to(memory_format=torch.channels_last)
        return cls(module, card, dev)

    def _output_members(self) -> int:
        """``M`` of the module's output ``(B, M, C)`` (MC-dropout LLE: samples × heads), from one
        forward pass of a blank image."""
        c, (h, w) = self.card.in_channels, self.card.input_size
        with torch.inference_mode():
            return int(self.module(torch.zeros((1, c, h, w), device=self.device)).p.shape[1])

    @property
    def name(self) -> str:
        return self.card.name

    @property
    def version(self) -> str:
        return self.card.version

    @property
    def class_names(self) -> list[str]:
        return self.card.class_names

    @property
    def prepare_mode(self) -> PrepareMode:
        """How an image becomes this model's input unless told otherwise
        (:func:`models.prepare.default_prepare`: ``mnist`` for 1×28×28 digit models)."""
        return default_prepare(self.card.in_channels, self.card.input_size)

    def read(self, image: Tensor, prepare: PrepareMode | None = None) -> Canonical:
        """uint8 ``(C, H, W)`` -> :class:`models.prepare.Canonical`: uint8 ``(Cin, H', W')``, not
        normalised, and what its preparation found (``prepare``, default :attr:`prepare_mode`).

        What a server's front end does per image before the batch is normalised on the device
        (:meth:`run`); see :func:`models.prepare.prepare_image`.
        """
        mode = prepare or self.prepare_mode
        return prepare_image(image, mode, self.card.in_channels, tuple(self.card.input_size))

    def conform(self, image: Tensor, prepare: PrepareMode | None = None) -> Tensor:
        """uint8 ``(C, H, W)`` -> uint8 ``(Cin, H', W')``: :meth:`read`'s image."""
        return self.read(image, prepare).image

    def prepare(self, image: Tensor, prepare: PrepareMode | None = None) -> Tensor:
        """uint8 ``(C, H, W)`` (C in 1, 3, 4; or ``(H, W)``) -> float ``(Cin, H', W')`` model input."""
        return normalise_uint8(self.conform(image, prepare), self._mean, self._std)

    def forward(self, x: Tensor) -> EnsembleOutput:
        """``x`` (B, Cin, H', W') -> ``EnsembleOutput`` of CPU tensors ``(B, M, C)``."""
        with torch.inference_mode():
            out = self.module(x.to(self.device, non_blocking=True))
            return EnsembleOutput(
                out.p.float().cpu(), None if out.q is None else out.q.float().cpu()
            )

    def run(self, parts: Sequence[Tensor | np.ndarray]) -> EnsembleOutput:
        """The serving forward pass: request inputs in order -> ``EnsembleOutput`` on the device.

        Each part is ``(n, Cin, H', W')``, a CPU tensor or a NumPy array: uint8 pixels from
        :meth:`conform` (normalised here, in one batched op on the device) or float32
        already-prepared inputs. uint8 parts are gathered by one ``np.concatenate`` (one call for
        the whole batch, not a torch call per request) into a host buffer that is pinned and
        reused on CUDA, and cross to the device as one copy (a quarter of the bytes of float32).
        Compiled, the batch is padded to its power-of-two bucket in that buffer.
        """
        with torch.inference_mode():
            arrays = [p.numpy() if isinstance(p, Tensor) else p for p in parts]  # views, no copy
            n = sum(int(a.shape[0]) for a in arrays)
            # Compiled: pad to a power-of-two bucket, so one graph serves every size up to it.
            rows = 1 << (n - 1).bit_length() if self._compiled and n & (n - 1) else n
            if all(a.dtype == np.uint8 for a in arrays):
                x = self._normalise(self._stage(arrays, rows))
            else:
                x = torch.cat(
                    [
                        self._normalise(self._stage([a], a.shape[0]))
                        if a.dtype == np.uint8
                        else self._to_device(torch.from_numpy(a).float())
                        for a in arrays
                    ]
                )
                if rows > n:
                    x = torch.cat((x, x.new_zeros((rows - n, *x.shape[1:]))))
            with self._turn():
                out = self.module(x)
            if rows == n:
                return out
            return EnsembleOutput(out.p[:n], None if out.q is None else out.q[:n])

    def _stage(self, arrays: list[np.ndarray], rows: int) -> Tensor:
        """uint8 arrays ``(n_i, Cin, H, W)`` -> one ``(rows, Cin, H, W)`` uint8 tensor on the device
        (``rows >= Σ n_i``; rows past the inputs hold whatever the buffer held: padding whose
        answers are dropped).

        On CUDA the rows are gathered into a pinned buffer of this thread's (grown to a power of
        two, reused), copied without blocking; the next batch on the thread waits for that copy
        (a CUDA event) before it writes the buffer again.
        """
        n = sum(int(a.shape[0]) for a in arrays)
        shape = (rows, *arrays[0].shape[1:])
        if self.device.type != "cuda":
            if len(arrays) == 1 and rows == n:
                return torch.from_numpy(arrays[0]).to(self.device)
            out = np.empty(shape, np.uint8)
            np.concatenate(arrays, out=out[:n])
            return torch.from_numpy(out).to(self.device)  # a no-op on the CPU
        nbytes = math.prod(shape)
        staging = getattr(self._staging, "buffer", None)
        if staging is None or staging.numel() < nbytes:
            staging = torch.empty(
                1 << (nbytes - 1).bit_length(), dtype=torch.uint8, pin_memory=True
            )
            self._staging.buffer, self._staging.copied = staging, None
        elif self._staging.copied is not None:
            self._staging.copied.synchronize()  # the last batch's copy out of this buffer is done
        host = staging[:nbytes].view(shape)
        np.concatenate(arrays, out=host.numpy()[:n])
        x = host.to(self.device, non_blocking=True)  # on the device's current stream
        copied = self._staging.copied or torch.cuda.Event()
        copied.record(torch.cuda.current_stream(self.device))
        self._staging.copied = copied
        return x

    def _turn(self) -> contextlib.AbstractContextManager[Any]:
        """Exclusive use of the compiled code (see the class docstring); nothing when eager."""
        return self._compiled_turn if self._compiled else contextlib.nullcontext()

    def _to_device(self, x: Tensor) -> Tensor:
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device)

    def _normalise(self, x: Tensor) -> Tensor:
        """uint8 ``(B, Cin, H, W)`` on the device -> normalised float32, batched.

        The same :func:`models.data.normalise_uint8` as :meth:`prepare` (bit-identical results).
        """
        return normalise_uint8(x, self._mean, self._std)

    def options(
        self,
        *,
        abstain_k: float | None = None,
        vgmu_on: str | None = None,
        top_k: int = DEFAULT_TOP_K,
        default_abstain_k: float | None = None,
    ) -> ScoreOptions:
        """Request options for this model (:func:`models.serving.resolve_options` with the card's
        gate and calibration). Raises ``ValueError`` for ``vgmu_on="q"`` on a model without a gate.
        """
        card = self.card
        return resolve_options(
            model=card.name,
            vgn=card.vgn,
            calibrated_k={m: card.abstain_k_for(m) for m in ("p", "q")},
            num_classes=card.num_classes,
            abstain_k=abstain_k,
            vgmu_on=vgmu_on,
            top_k=top_k,
            default_abstain_k=default_abstain_k,
        )

    def score_columns(self, out: EnsembleOutput, options: ScoreOptions) -> ScoreColumns:
        """The served decision for a batch's output, computed on this predictor's device, one copy to
        the host.

        ``out`` may live on the host (:meth:`forward`) or on the device (:meth:`run`): members on
        another device are moved here first (a no-op for :meth:`run`'s output), so the fused CUDA
        kernel never sees a CPU tensor (issue 26: ``score(forward(x))`` raised on CUDA).
        """
        members = out.q if options.members == "q" else out.p
        if members is None:
            raise ValueError("vgmu_on='q' needs a VGN model")
        if members.device != self.device:
            members = members.to(self.device)
        # The fused kernel is plain Triton (thread-safe); only compiled torch code takes turns.
        turn = contextlib.nullcontext() if self._fused else self._turn()
        with torch.inference_mode(), turn:
            packed = self._decide(members.float(), options.abstain_k, options.top_k)
        return ScoreColumns.from_tensor(packed)  # the copy back: outside the turn

    def compile(self, warm_up: tuple[int, ...] = (1,)) -> bool:
        """Compile the forward pass and the decision with ``torch.compile`` (fused kernels).

        Batches are padded to power-of-two buckets (:meth:`run`, :func:`models.serving.compile_decide`):
        the forward pass is compiled with automatic dynamic batch sizes (a few compilations cover
        every bucket), the decision once per bucket (unless it is already the fused kernel).
        Compiles now for the ``warm_up`` batch sizes (see :func:`bucket_sizes`); falls back to
        eager execution, with a warning, when compilation fails. Returns whether it compiled.
        """
        import torch._dynamo

        eager_module, eager_decide = self.module, self._decide
        try:
            for name in ("recompile_limit", "cache_size_limit"):  # renamed in torch 2.6
                if hasattr(torch._dynamo.config, name):
                    setattr(
                        torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name))
                    )
            # Inductor's fused kernels, without CUDA graphs: torch's graph trees keep their state
            # per thread, and a server compiles on a loader thread and serves on its compute
            # thread (on an H100, mode="reduce-overhead" failed to compile on a worker thread).
            self.module = torch.compile(eager_module)
            if not self._fused:
                self._decide = compile_decide(bucketed=True)
            self._compiled = True
            c, h, w = self.card.in_channels, *self.card.input_size
            for n in warm_up:
                x = torch.zeros((n, c, h, w), dtype=torch.uint8)
                self.score_columns(self.run([x]), self.options())
            return True
        except Exception as exc:  # noqa: BLE001 - any backend failure means "run eagerly"
            warnings.warn(f"torch.compile failed, running eagerly: {exc}", stacklevel=2)
            self.module, self._decide, self._compiled = eager_module, eager_decide, False
            return False

    def score(
        self,
        out: EnsembleOutput,
        *,
        abstain_k: float | None = None,
        vgmu_on: str | None = None,
        top_k: int = DEFAULT_TOP_K,
    ) -> list[dict[str, Any]]:
        """One dict per row: ``prediction, label, probabilities [{label, probability}], vgmu, snr,
        tu, au, eu, abstain, abstain_k`` — all of one member set, so ``probabilities[0]`` is the
        predicted class."""
        opts = self.options(abstain_k=abstain_k, vgmu_on=vgmu_on, top_k=top_k)
        return self.score_columns(out, opts).records(self.card.class_names, opts.abstain_k)

    def predict(
        self,
        images: Sequence[Tensor],
        *,
        prepare: PrepareMode | None = None,
        abstain_k: float | None = None,
        vgmu_on: str | None = None,
        top_k: int = DEFAULT_TOP_K,
    ) -> list[dict[str, Any]]:
        """Decoded uint8 images ``(C, H, W)`` → one answer each, as the server gives it: each image
        read under ``prepare`` (:meth:`read`), forwarded and scored (:meth:`score`); an image with
        no digit to read (:class:`models.prepare.Finding` other than ``ok``) abstains, and every
        answer says what its reading found (``input_check``)."""
        if not images:
            return []
        read = [self.read(image, prepare) for image in images]
        x = normalise_uint8(torch.stack([r.image for r in read]), self._mean, self._std)
        opts = self.options(abstain_k=abstain_k, vgmu_on=vgmu_on, top_k=top_k)
        findings = np.array([int(r.finding) for r in read])
        columns = self.score_columns(self.forward(x), opts).abstaining(findings != Finding.ok)
        return columns.records(self.card.class_names, opts.abstain_k, findings)


def fused_decision(device: torch.device, num_classes: int, num_members: int) -> Decide | None:
    """The fused decision kernel for a model on ``device``, or None where it does not apply.

    None off CUDA, without Triton, or beyond the kernel's class limit; also, with a warning, when the
    kernel fails to build or disagrees with :func:`models.serving.decide` on a probe batch of this
    model's shape (:func:`decision_probe`; checked once, here: a server then runs the torch
    decision rather than stop).
    """
    from models.kernels import decision as kernel

    probe = decision_probe(num_classes, num_members).to(device)
    if not kernel.supports(probe):
        return None
    top_k = min(num_classes, 5)
    try:
        agree = decisions_agree(
            kernel.fused_decide(probe, 1.0, top_k), decide(probe, 1.0, top_k), top_k
        )
    except Exception as exc:  # noqa: BLE001 - any build or launch failure means "use torch"
        warnings.warn(f"fused decision kernel unavailable, using torch: {exc}", stacklevel=2)
        return None
    if not agree:
        warnings.warn(
            "fused decision kernel disagrees with models.serving.decide; using torch", stacklevel=2
        )
        return None
    return kernel.fused_decide


def decision_probe(num_classes: int, num_members: int) -> Tensor:
    """Member probabilities ``(8, M, C)`` whose class means are well apart: distinct logits per
    class (0 to 4, shuffled) plus small member noise, so the order of the mean is the same in any
    float32 summation order and a correct kernel cannot fail :func:`decisions_agree` on a near-tie."""
    g = torch.Generator().manual_seed(0)
    logits = torch.linspace(0.0, 4.0, num_classes)[torch.randperm(num_classes, generator=g)]
    noise = 0.1 * torch.randn((8, num_members, num_classes), generator=g)
    return torch.softmax(logits + noise, dim=-1)


def decisions_agree(got: Tensor, want: Tensor, top_k: int) -> bool:
    """Two packed decision blocks (:func:`models.serving.decide`) agree: the same predictions,
    abstentions and top-``k`` classes, and scores equal to float32 round-off."""
    f = len(FIXED_COLUMNS)
    return (
        got.shape == want.shape
        and torch.equal(got[:, :2], want[:, :2])
        and torch.equal(got[:, f : f + top_k], want[:, f : f + top_k])
        and bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5))
    )
