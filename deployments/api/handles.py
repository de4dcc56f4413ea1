"""Handles between replicas: Serve's gRPC transport where this Ray has it.

By default a handle call passes its arguments and every streamed item through Ray's object
protocol (an object reference per item, resolved by the caller's core worker). Serve's
gRPC transport sends them inline over one channel per pair of replicas instead: less time
per call and a lower TTFT under load, for the same throughput (BENCHMARKS.md, "Designs shipped": event
loops and handles).
"""

from ray.serve.handle import DeploymentHandle


def over_grpc(handle: DeploymentHandle) -> DeploymentHandle:
    """The same handle, sending requests and responses over gRPC where Ray supports it."""
    try:
        return handle.options(_by_reference=False)
    except TypeError:  # a Ray without the option: Ray's object protocol, which also works
        return handle
