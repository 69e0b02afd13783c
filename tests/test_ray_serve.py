"""Scale-out on Ray Serve: two replicas of the tiny model's engine behind Ray Serve's proxy on
this machine answer the OpenAI routes (plain and streamed) with the generator's own greedy
answer, and requests reach both replicas (each has its own process and engine)."""

import json
import socket
import time

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (the ray extra; make setup installs it)")
httpx = pytest.importorskip("httpx", reason="httpx is not installed (the test extra)")

from specrt.runtime.generator import Generator  # noqa: E402
from specrt.server.limits import ServerLimits  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_server(tiny_artifacts):
    import ray
    from ray import serve

    from specrt.server.ray import APP_NAME, ray_application

    engine = tiny_artifacts / "engines" / "ort-cpu"

    def make_service():  # runs in each replica's process (pickled by value: a nested function)
        from specrt.engines.ort import OrtOptions
        from specrt.server import CompletionService

        gen = Generator.from_engine(engine, options=OrtOptions(intra_op_threads=1))
        return CompletionService(gen, "tiny", ServerLimits(max_batch=2))

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(ray_application(make_service, 2, 1, 10), name=APP_NAME, route_prefix="/", blocking=False)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_answer_the_openai_routes(ray_server, tiny_artifacts):
    gen = Generator.from_engine(tiny_artifacts / "engines" / "ort-cpu")
    expected = gen.decode(gen.generate_ids([gen.tokenizer.encode("w5 w6 w7")], 12)[0].token_ids)
    body = {"prompt": "w5 w6 w7", "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{ray_server}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected
    streamed = httpx.post(f"{ray_server}/v1/completions", json={**body, "stream": True}, timeout=60).text
    events = [e[len("data: ") :] for e in streamed.split("\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == expected
    assert httpx.post(f"{ray_server}/v1/completions", json={"prompt": ""}, timeout=60).status_code == 400
    pids, t_end = set(), time.monotonic() + 30
    while len(pids) < 2 and time.monotonic() < t_end:  # the proxy spreads requests over the replicas
        pids.add(httpx.get(f"{ray_server}/health", timeout=30).json()["pid"])
    assert len(pids) == 2, "every request reached the same replica"


def test_serve_ray_without_ray_says_how_to_install_it(tiny_artifacts, monkeypatch):
    """Where Ray Serve is not installed, `serve --ray` is one line naming the extra to install
    (checked before any engine loads)."""
    import sys

    from click.testing import CliRunner

    from specrt.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    r = CliRunner().invoke(main, ["serve", "--artifacts", str(tiny_artifacts), "--ray", "--port", str(free_port())])
    assert r.exit_code != 0 and "pip install 'specrt[ray]'" in r.output and "Traceback" not in r.output
