"""`vge score` end to end, including its error paths: as a real subprocess where the process
matters (the first test, a reader that goes away), in this process elsewhere (:mod:`tests.cli`)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from models.uncertainty import score_ensemble
from tests.cli import run_vge

KEYS = [
    "prediction",
    "abstain",
    "vgmu",
    "snr",
    "tu",
    "au",
    "eu",
    "mutual_information",
    "epkl",
    "epjs",
    "epce",
]
A4_P0 = [[0.8, 0.15, 0.05], [0.7, 0.2, 0.1], [0.6, 0.25, 0.15]]
A3_Q0 = [[0.9, 0.1, 0.0], [0.6, 0.3, 0.1], [0.6, 0.2, 0.2]]


def vge(*args: str) -> subprocess.CompletedProcess[str]:
    """The real command, as a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_scores_npy_as_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "probs.npy"
    np.save(path, np.array([A4_P0, A3_Q0], dtype=np.float32))
    done = vge("score", str(path), "--gate-k", "2", "--abstain-k", "3.4")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [list(r) for r in rows] == [KEYS, KEYS]
    assert round(rows[1]["eu"], 3) == 0.045  # SI: A3 Q0 gated at k = 2 (the default answer: q)
    raw = vge("score", str(path), "--gate-k", "2", "--abstain-k", "3.4", "--vgmu-on", "p")
    rows = [json.loads(line) for line in raw.stdout.splitlines()]
    assert round(rows[1]["eu"], 3) == 0.070  # SI: A3 Q0 ungated
    assert rows[0]["abstain"] is True  # on p: 0.7 − 3.4·0.1 < 0.2 + 3.4·0.05
    assert rows[0]["prediction"] == 0


def test_npz_and_vgmu_on_q_match_the_library(tmp_path: Path) -> None:
    probs = np.array([A3_Q0], dtype=np.float64)
    path = tmp_path / "probs.npz"
    np.savez(path, probs=probs)
    done = run_vge("score", str(path), "--gate-k", "1", "--vgmu-on", "q")
    assert done.returncode == 0, done.stderr
    import torch

    expected = score_ensemble(torch.from_numpy(probs), gate_k=1.0, vgmu_on="q").to_records()[0]
    got = json.loads(done.stdout)
    assert got == pytest.approx(expected)


@pytest.mark.parametrize(
    ("make", "args", "message"),
    [
        (lambda p: None, [], "no such file"),
        (lambda p: p.write_text("not numpy"), [], "not a readable"),
        (lambda p: np.save(p, np.ones((2, 3))), [], "shape (B, M, C)"),
        (lambda p: np.save(p, np.full((1, 2, 2), 0.3)), [], "sum to 1"),
        (
            lambda p: np.save(p, np.full((1, 2, 2), 0.5)),
            ["--gate-k", "0"],
            "gate_k must be in [0.001, 10000]",
        ),
        (
            lambda p: np.save(p, np.full((1, 2, 2), 0.5)),
            ["--gate-k", "1e5"],
            "gate_k must be in [0.001, 10000]",
        ),
        (
            lambda p: np.save(p, np.full((1, 2, 2), 0.5)),
            ["--abstain-k", "x"],
            "invalid float value",
        ),
        (  # as /v1/score: the same range
            lambda p: np.save(p, np.full((1, 2, 2), 0.5)),
            ["--abstain-k", "inf"],
            "abstain_k must be a number in [0, 1e+09]",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, make, args: list[str], message: str
) -> None:
    path = tmp_path / "bad.npy"
    make(path)
    done = run_vge("score", str(path), *args)
    assert done.returncode == 2
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert "Traceback" not in done.stderr


def test_npz_without_probs_key(tmp_path: Path) -> None:
    path = tmp_path / "x.npz"
    np.savez(path, other=np.ones(3))
    done = run_vge("score", str(path))
    assert done.returncode == 2 and "no array named 'probs'" in done.stderr


def _object_npz(path: Path) -> None:
    np.savez(path, probs=np.array([{"a": 1}], dtype=object))


def _not_npy_npz(path: Path) -> None:
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr("probs.npy", b"not an array")


def _corrupt_npz(path: Path) -> None:
    np.savez(path, probs=np.full((4, 2, 2), 0.5))
    data = bytearray(path.read_bytes())
    data[data.index(b"\x93NUMPY") + 200] ^= 0xFF  # a byte of the array: the member's CRC fails
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "make,message",
    [(_object_npz, "'probs' cannot be read"), (_not_npy_npz, "'probs' is not a .npy array"),
     (_corrupt_npz, "'probs' cannot be read")],
)  # fmt: skip
def test_an_unreadable_npz_member_is_one_line_and_exit_2(
    tmp_path: Path, make, message: str
) -> None:
    """An object array, a member that is not .npy, a member that fails its CRC: each a traceback
    and exit 1 before."""
    path = tmp_path / "bad.npz"
    make(path)
    done = run_vge("score", str(path))
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_damaged_files_are_one_line_and_exit_2(tmp_path: Path) -> None:
    """One byte flipped at a time through a compressed .npz and through an .npy header: each file
    is scored (exit 0: the byte changed only values) or refused in one line (exit 2) — no
    traceback (zlib.error and tokenize.TokenError escaped before)."""
    packed = tmp_path / "c.npz"
    np.savez_compressed(packed, probs=np.random.default_rng(0).dirichlet(np.ones(4), (30, 3)))
    plain = tmp_path / "a.npy"
    np.save(plain, np.full((3, 2, 2), 0.5))
    refused = 0
    for source, positions in ((packed, range(60, 260, 20)), (plain, range(8, 70, 6))):
        raw = source.read_bytes()
        for pos in positions:
            damaged = bytearray(raw)
            damaged[pos] ^= 0xFF
            path = tmp_path / f"d{pos}{source.suffix}"
            path.write_bytes(bytes(damaged))
            done = run_vge("score", str(path))
            assert done.returncode in (0, 2) and "Traceback" not in done.stderr, done.stderr
            assert done.returncode == 0 or len(done.stderr.strip().splitlines()) == 1
            refused += done.returncode == 2
    assert refused >= 5  # most of these are unreadable, and said so


def test_a_reader_that_goes_away_is_no_traceback(tmp_path: Path) -> None:
    """``vge score big.npy | head -1``: a BrokenPipeError traceback before."""
    path = tmp_path / "big.npy"
    np.save(path, np.full((20_000, 2, 2), 0.5))
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "score", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().startswith(b'{"prediction"')
    proc.stdout.close()  # the reader goes away
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and b"Traceback" not in err, err


def test_long_double_input_is_scored_as_float64(tmp_path: Path) -> None:
    """A float128 array (NumPy's long double) was a traceback: torch has no such type."""
    wide, plain = tmp_path / "wide.npy", tmp_path / "plain.npy"
    np.save(wide, np.array([A4_P0, A3_Q0], dtype=np.longdouble))
    np.save(plain, np.array([A4_P0, A3_Q0], dtype=np.float64))
    a = vge("score", str(wide), "--gate-k", "2", "--abstain-k", "3.4")
    b = vge("score", str(plain), "--gate-k", "2", "--abstain-k", "3.4")
    assert a.returncode == 0 and not a.stderr, a.stderr
    assert a.stdout == b.stdout
