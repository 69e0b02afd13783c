"""Scale-out on Ray Serve: replicas of the engine behind one HTTP address, same OpenAI routes.

    specrt serve --ray --replicas 2 --artifacts artifacts/SmolLM2-135M-Instruct --draft suffix

Each replica is a Ray actor that loads its own engine (and draft) from the artifacts and runs the
same app as `specrt serve` (server.create_app over a CompletionService with its own continuous
batch); Ray Serve's HTTP proxy takes the requests and routes each to a replica, preferring the
less loaded of two it samples (its default router), and cancels the request on the replica when
the client disconnects. Ray is used rather than a hand-written router because it already does the
parts a deployment needs: replica health checks and restarts, routing by queue length, a cluster
of many machines with the same code.

Per replica, `max_ongoing_requests` is its batch slots plus its waiting line, so the replica's own
admission (and its 503) stays in charge and Ray's proxy only spreads the load. Each replica asks
Ray for `cpus_per_replica` CPUs; its ONNX Runtime threads are set to match by the CLI, so two
replicas on two cores do not fight over both.

Across machines (`--ray-address` of a running cluster, `ray start --head` on one node and
`ray start --address HEAD:6379` on the others), every node that may host a replica needs the
artifacts at the same path (a shared filesystem, or a copy: each replica checks the files' hashes
against the manifest when it loads, so a damaged or partial copy fails that replica loudly rather
than serving wrong answers) and, for TensorRT engines, a GPU of the compute capability the engine
was built for (the manifest's check runs on the node that loads it). GET /metrics and /stats are
per replica (each request reaches one): scrape each replica or use Ray's own metrics for totals.

ray is imported only here, and only when `--ray` is asked for (the `ray` extra).
"""

from __future__ import annotations

from typing import Callable

from specrt.server.app import create_app
from specrt.server.service import CompletionService

APP_NAME = "specrt"


def ray_application(
    make_service: Callable[[], CompletionService], replicas: int, cpus_per_replica: float, max_ongoing_requests: int
):
    """The Ray Serve application: `replicas` copies of the OpenAI app, each building its own
    service (and so its own engine) with `make_service` when Ray starts it."""
    from ray import serve

    def build():
        return create_app(make_service())

    deployment = serve.deployment(
        name=APP_NAME,
        num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus_per_replica},
        max_ongoing_requests=max_ongoing_requests,
    )(serve.ingress(build)())
    return deployment.bind()


def serve_ray(
    make_service: Callable[[], CompletionService],
    replicas: int,
    host: str,
    port: int,
    cpus_per_replica: float,
    max_ongoing_requests: int,
    address: str | None = None,
    blocking: bool = True,
) -> None:
    """Start (or join, with `address`) a Ray cluster and run the replicas behind Ray Serve's
    proxy on host:port; with blocking=True, until interrupted."""
    import signal

    import ray
    from ray import serve

    def stop(*_):  # SIGTERM (a process manager, a benchmark) ends it like Ctrl-C: Ray is shut down
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second one must not cut the shutdown short
        raise KeyboardInterrupt

    ray.init(address=address, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    try:
        serve.start(http_options={"host": host, "port": port})
        app = ray_application(make_service, replicas, cpus_per_replica, max_ongoing_requests)
        if not blocking:
            serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
            return
        signal.signal(signal.SIGTERM, stop)
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    except BaseException:
        shutdown(address)
        raise
    shutdown(address)  # blocking: the server was stopped


def shutdown(address: str | None = None) -> None:
    """Stop serving: on a cluster this process started, stop the cluster (its processes go with
    it; Serve's graceful shutdown is not waited for: nothing else uses it); on a cluster it
    joined, remove only this application and disconnect."""
    import ray
    from ray import serve

    if address is not None:
        serve.delete(APP_NAME)
    ray.shutdown()
