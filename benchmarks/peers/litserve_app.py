"""The same model behind LitServe, answering exactly what ``POST /v1/predict`` answers.

    python -m benchmarks.peers.litserve_app --port 8001 [--workers 1] [--api-servers 1]

Multipart ``images`` files in, ``{"model", "model_version", "results": [...]}`` out, with the same
library calls as vge-serve (torchvision decode, ``Predictor.prepare``/``forward``/``score``), so the
comparison is of the serving stacks, not of the math. Benchmark-only (``pip install litserve``).
"""

import argparse
from typing import Any

import litserve as ls
import torch
from torchvision.io import ImageReadMode, decode_image


class VGEAPI(ls.LitAPI):
    """LitServe API wrapping :class:`models.predictor.Predictor`."""

    def setup(self, device: str) -> None:
        from benchmarks.peers import model_dir
        from models.predictor import Predictor

        torch.set_num_threads(1)
        self.predictor = Predictor.from_dir(model_dir(), device=device)

    def decode_request(self, request, **kwargs):  # noqa: ANN001, ANN201 - LitServe reads the annotations
        files = request.getlist("images")
        images = []
        for f in files:
            data = f.file.read() if hasattr(f, "file") else f
            img = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                               mode=ImageReadMode.UNCHANGED)  # fmt: skip
            images.append(self.predictor.prepare(img))
        return torch.stack(images)

    def predict(self, x: torch.Tensor, **kwargs: Any) -> list[dict[str, Any]]:
        return self.predictor.score(self.predictor.forward(x), top_k=5)

    def encode_response(self, output, **kwargs):  # noqa: ANN001, ANN201
        card = self.predictor.card
        return {"model": card.name, "model_version": card.version, "results": output}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--workers", type=int, default=1, help="workers_per_device")
    parser.add_argument("--api-servers", type=int, default=None, help="num_api_servers")
    parser.add_argument(
        "--accelerator", default="auto", help="LitServe's: auto (GPU when present), cpu, cuda"
    )
    args = parser.parse_args()
    server = ls.LitServer(
        VGEAPI(api_path="/v1/predict"),
        accelerator=args.accelerator,
        workers_per_device=args.workers,
    )
    server.run(host="127.0.0.1", port=args.port, num_api_servers=args.api_servers,
               generate_client_file=False)  # fmt: skip


if __name__ == "__main__":
    main()
