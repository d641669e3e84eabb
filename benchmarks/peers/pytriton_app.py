"""The same model behind NVIDIA PyTriton 0.7 (Triton Inference Server), for side-by-side benchmarks.

    /tmp/pytriton-venv/bin/python -m benchmarks.peers.pytriton_app --http-port 8002 \\
        --grpc-port 8003 --metrics-port 8004

Input ``images``: BYTES ``[B, 1]`` (the encoded PNGs); output ``result``: BYTES ``[B, 1]``, each
the JSON of one ``/v1/predict`` result. Triton's dynamic batcher gathers requests (max batch 64).
Runs in its own Python 3.11 venv with ``numpy<2`` and ``nvidia-pytriton`` (plus torch,
torchvision, safetensors, pydantic); every address is bound to 127.0.0.1. Benchmark-only.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig
from torchvision.io import ImageReadMode, decode_image

from benchmarks.peers import model_dir
from models.predictor import Predictor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http-port", type=int, default=8002)
    parser.add_argument("--grpc-port", type=int, default=8003)
    parser.add_argument("--metrics-port", type=int, default=8004)
    args = parser.parse_args()
    torch.set_num_threads(1)
    predictor = Predictor.from_dir(model_dir(), device="cpu")

    @batch
    def infer(images: np.ndarray) -> dict[str, np.ndarray]:
        x = torch.stack([
            predictor.prepare(decode_image(torch.frombuffer(bytearray(row[0]), dtype=torch.uint8),
                                           mode=ImageReadMode.UNCHANGED)) for row in images
        ])  # fmt: skip
        rows = predictor.score(predictor.forward(x), top_k=5)
        return {"result": np.array([[json.dumps(r).encode()] for r in rows], dtype=object)}

    config = TritonConfig(
        http_address="127.0.0.1", http_port=args.http_port,
        grpc_address="127.0.0.1", grpc_port=args.grpc_port,
        metrics_address="127.0.0.1", metrics_port=args.metrics_port,
    )  # fmt: skip
    with Triton(config=config) as triton:
        triton.bind(
            model_name="vge",
            infer_func=infer,
            inputs=[Tensor(name="images", dtype=bytes, shape=(1,))],
            outputs=[Tensor(name="result", dtype=bytes, shape=(1,))],
            config=ModelConfig(max_batch_size=64, batcher=DynamicBatcher()),
        )
        triton.serve()


if __name__ == "__main__":
    main()
