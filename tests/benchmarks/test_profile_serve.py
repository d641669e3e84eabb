"""benchmarks/profile_serve.py: py-spy's raw samples summarised per process of the tree."""

from __future__ import annotations

from pathlib import Path

from benchmarks.profile_serve import summarise

SUP = 'process 10:"python -m service.cli.serve"'
ENGINE = 'process 11:"python -c from multiprocessing.spawn import spawn_main; spawn_main()"'
FRONT = 'process 12:"python -m service.cli.serve"'


def test_summarise_names_roles_counts_busy_cores_and_drops_waiting(tmp_path: Path) -> None:
    raw = tmp_path / "samples.txt"
    raw.write_text(
        "\n".join(
            [
                f"{SUP};{ENGINE};spawn_main (multiprocessing/spawn.py:122);"
                "Batcher._compute (service/engine/batcher.py:274);Module._call_impl (torch/nn/m.py:1) 30",
                f"{SUP};{ENGINE};Engine._infer (service/engine/engine.py:254) 10",
                f"{SUP};{ENGINE};EpollSelector.select (selectors.py:468) 500",  # idle: left out
                f"{SUP};{FRONT};RequestResponseCycle.run_asgi (uvicorn/h.py:422) 20",
            ]
        )
        + "\n"
    )
    lines = summarise(raw, seconds=1, rate=100).splitlines()
    assert lines[0] == "engine 11: 0.40 cores busy"
    assert "75.0%  Batcher._compute (service/engine/batcher.py:274)" in lines[1]
    assert not any("spawn_main" in line or "select" in line for line in lines)
    front = lines.index("front end 12: 0.20 cores busy")
    assert "100.0%  RequestResponseCycle.run_asgi" in lines[front + 1]
    # Innermost frames: where the engine's time went, not the frames it passed through.
    leaves = lines[lines.index("  where the samples were (innermost frame):") + 1 : front]
    assert [line.split("%")[0].strip() for line in leaves] == ["75.0", "25.0"]
    assert "Module._call_impl" in leaves[0] and "Engine._infer" in leaves[1]


def test_cpu_per_request_divides_each_threads_cpu_by_the_requests() -> None:
    from benchmarks.profile_serve import cpu_per_request

    before = {("engine 11", 11): 1.0, ("engine 11", 15): 2.0, ("front end 12", 12): 0.5}
    after = {("engine 11", 11): 1.2, ("engine 11", 15): 2.5, ("front end 12", 12): 1.1,
             ("front end 12", 19): 0.0}  # fmt: skip
    lines = cpu_per_request(before, after, requests=1000).splitlines()
    assert lines == [
        "engine 11 main thread: 200 µs of CPU per request",
        "engine 11 thread 15: 500 µs of CPU per request",
        "front end 12 main thread: 600 µs of CPU per request",
    ]


def test_front_end_samples_go_to_the_part_of_their_innermost_named_frame(tmp_path: Path) -> None:
    from benchmarks.profile_serve import front_end_parts

    route = "predict (service/frontend/routes/predict.py:140)"
    raw = tmp_path / "samples.txt"
    raw.write_text(
        "\n".join(
            [
                # JSON encoded inside the route is JSON's; the route's own line is the route's
                f"{SUP};{FRONT};{route};JSONEncoder.encode (json/encoder.py:200) 30",
                f"{SUP};{FRONT};{route} 10",
                # the send under uvicorn's cycle is the send, not HTTP; a C leaf counts too
                f"{SUP};{FRONT};RequestResponseCycle.send (uvicorn/h.py:9);"
                "_Transport.write (service/frontend/http_protocol.py:104);write 40",
                f"{SUP};{FRONT};{route};gc_collect_main 10",
                f"{SUP};{FRONT};something (elsewhere.py:1) 10",
                f"{SUP};{ENGINE};spawn_main (multiprocessing/spawn.py:122) 99",  # not a front end
                f'{SUP};process 13:"python -c from multiprocessing.resource_tracker import main;'
                'main(8)";main (multiprocessing/resource_tracker.py:1);read 50',  # nor this
            ]
        )
        + "\n"
    )
    lines = front_end_parts(raw, {"front end 12": 500.0}).splitlines()
    assert lines[0] == "front end 12: samples by part of the request path"
    assert [line.split("µs  ")[-1] for line in lines[1:]] == [
        "response send (syscall; loopback delivers to the client)",
        "JSON encoding",
        "cyclic GC",
        "other",
        "request path (route, pipeline, options)",
    ]
    assert lines[1].split() == ["40.0%", "~200", "µs", "response", "send", "(syscall;", "loopback",
                                "delivers", "to", "the", "client)"]  # fmt: skip
    assert not any("engine" in line or "13" in line for line in lines)
