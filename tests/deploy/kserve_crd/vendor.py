"""Vendor a KServe CRD's ``openAPIV3Schema`` for tests/deploy/test_k8s_manifests.py.

    python tests/deploy/kserve_crd/vendor.py CRD.yaml OUT.json.gz

Reads a CRD YAML from KServe's repository (``config/crd/full/serving.kserve.io_*.yaml`` at a
release tag), keeps the served storage version's ``openAPIV3Schema`` with its ``description``
fields removed (they change nothing a validator checks, and are most of the bytes), and writes
it as gzipped JSON with the CRD's group, kind and version beside it. Run once per KServe
release the manifests target; the tests never download anything.
"""

from __future__ import annotations

import gzip
import json
import sys
from typing import Any

import yaml


def strip_descriptions(node: Any) -> Any:
    """``node`` without ``description`` keys (a property *named* description is kept)."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "description" and isinstance(value, str):
                continue
            if key == "properties" and isinstance(value, dict):
                out[key] = {k: strip_descriptions(v) for k, v in value.items()}
            else:
                out[key] = strip_descriptions(value)
        return out
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def main(src: str, dst: str, source: str) -> None:
    """Write ``src``'s storage version schema to ``dst`` (``source``: where it came from)."""
    with open(src, encoding="utf-8") as f:
        crd = yaml.safe_load(f)
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    doc = {
        "source": source,
        "group": crd["spec"]["group"],
        "kind": crd["spec"]["names"]["kind"],
        "version": version["name"],
        "openAPIV3Schema": strip_descriptions(version["schema"]["openAPIV3Schema"]),
    }
    with gzip.open(dst, "wt", encoding="utf-8") as f:
        json.dump(doc, f, separators=(",", ":"), sort_keys=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else sys.argv[1])
