"""The Open Inference Protocol (KServe V2) over gRPC, for ``tritonclient.grpc`` and other stock clients.

Enabled with ``VGE_GRPC_PORT`` (needs ``pip install 'vge-serve[grpc]'``: the protocol's generated
stubs ship with ``tritonclient[grpc]``). Every front end serves it on the same port
(``SO_REUSEPORT``: the kernel spreads connections, as for HTTP) and answers through the same path
as ``POST /v2/models/{name}/infer``: the same input checks (``images`` UINT8 pixels or ``input``
FP32), the same engine, the same outputs as raw little-endian tensors (``raw_output_contents``).
Implemented: ServerLive, ServerReady, ServerMetadata, ModelReady, ModelMetadata, ModelInfer, and
the Triton extensions stock tools call: ModelConfig, ModelStatistics, RepositoryIndex (the same
answers as the HTTP routes, from :mod:`service.frontend.v2_core`); RepositoryModelLoad/Unload are
FAILED_PRECONDITION naming POST /v1/models/promote. The other Triton-only RPCs (shared memory,
trace, log settings) answer UNIMPLEMENTED with a message, not a traceback in the log.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from service.common import errors
from service.common.process import host_port
from service.frontend.deps import ServiceState
from service.frontend.pipeline import Pixels, infer
from service.frontend.routes.health import is_ready
from service.frontend.v2_core import (
    DTYPES,
    OUTPUTS,
    SERVER_EXTENSIONS,
    check_input_spec,
    check_outputs,
    check_parameters,
    model_config_dict,
    model_metadata_dict,
    model_statistics,
    output_tensors,
    repository_control,
    repository_index,
    versioned_model,
)


async def abort(context: Any, exc: BaseException) -> None:
    """End the call with ``exc`` as a gRPC status: a
    :class:`~service.common.errors.ServiceError`'s ``grpc_status`` (its row of the error table,
    by ``isinstance``: a subclass answers its base's row unless it overrides it) with its
    message; anything else is ``INTERNAL`` with no detail, as HTTP's 500."""
    import grpc

    if isinstance(exc, errors.ServiceError):
        await context.abort(getattr(grpc.StatusCode, exc.grpc_status), exc.message)
    else:
        await context.abort(grpc.StatusCode.INTERNAL, "internal server error")


def _model(state: ServiceState, request: Any) -> Any:
    """The model a ModelReady/ModelMetadata request names, at its version when it names one (a
    version this server does not serve is NOT_FOUND, as on the REST routes)."""
    if request.version:
        return versioned_model(state, request.name, request.version)
    return state.model(request.name)


def _param(p: Any) -> Any:
    kind = p.WhichOneof("parameter_choice")
    return None if kind is None else getattr(p, kind)


def _input_array(request: Any, max_images: int) -> tuple[np.ndarray, str]:
    """The request's one input tensor as a NumPy array, checked like the HTTP route's."""
    if len(request.inputs) != 1:
        raise errors.BadInput("inputs must hold exactly one tensor: the image batch")
    spec = request.inputs[0]
    dtype, shape = spec.datatype, [int(s) for s in spec.shape]
    count = check_input_spec(spec.name, dtype, shape, max_images)
    if request.raw_input_contents:
        if len(request.raw_input_contents) != 1:  # one per input, and there is one input
            raise errors.BadInput(
                f"raw_input_contents holds {len(request.raw_input_contents)} entries for 1 input"
            )
        raw = request.raw_input_contents[0]
        if len(raw) != count * DTYPES[dtype].itemsize:
            raise errors.BadInput(f"raw input of {len(raw)} bytes does not match {shape} {dtype}")
        arr = np.frombuffer(raw, dtype=DTYPES[dtype])
    else:
        values = spec.contents.uint_contents if dtype == "UINT8" else spec.contents.fp32_contents
        if len(values) != count:
            raise errors.BadInput(f"input has {len(values)} elements, shape {shape} needs {count}")
        if dtype == "UINT8" and any(v > 255 for v in values):
            raise errors.BadInput("UINT8 input data must be integers in [0, 255]")
        arr = np.asarray(values, dtype=DTYPES[dtype])
    if dtype == "FP32" and not np.isfinite(arr).all():
        raise errors.BadInput("FP32 input contains NaN or infinity")
    return arr.reshape(shape), dtype


def make_servicer(state: ServiceState) -> Any:
    """A ``GRPCInferenceServiceServicer`` answering through ``state``'s engine connection."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    class Servicer(pb_grpc.GRPCInferenceServiceServicer):
        async def ServerLive(self, request: Any, context: Any) -> Any:  # noqa: N802
            return pb.ServerLiveResponse(live=True)

        async def ServerReady(self, request: Any, context: Any) -> Any:  # noqa: N802
            return pb.ServerReadyResponse(ready=is_ready(state)[0])

        async def ServerMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
            from importlib.metadata import version

            return pb.ServerMetadataResponse(
                name="vge-serve", version=version("vge-serve"), extensions=SERVER_EXTENSIONS
            )

        async def ModelReady(self, request: Any, context: Any) -> Any:  # noqa: N802
            try:
                _model(state, request)
            except errors.ServiceError as exc:
                await abort(context, exc)
            return pb.ModelReadyResponse(ready=is_ready(state)[0])

        async def ModelMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
            try:
                meta = model_metadata_dict(_model(state, request))
            except errors.ServiceError as exc:
                await abort(context, exc)
            tensor = pb.ModelMetadataResponse.TensorMetadata
            return pb.ModelMetadataResponse(
                name=meta["name"],
                versions=meta["versions"],
                platform=meta["platform"],
                inputs=[
                    tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"])
                    for t in meta["inputs"]
                ],  # fmt: skip
                outputs=[
                    tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"])
                    for t in meta["outputs"]
                ],  # fmt: skip
            )

        async def ModelConfig(self, request: Any, context: Any) -> Any:  # noqa: N802
            """Triton's model configuration (the dict the HTTP ``/config`` route answers)."""
            from google.protobuf import json_format
            from tritonclient.grpc import model_config_pb2

            try:
                config = model_config_dict(_model(state, request), state.settings)
            except errors.ServiceError as exc:
                await abort(context, exc)
            return pb.ModelConfigResponse(
                config=json_format.ParseDict(config, model_config_pb2.ModelConfig())
            )

        async def ModelStatistics(self, request: Any, context: Any) -> Any:  # noqa: N802
            """Triton's statistics; no name: every served model (this server serves one)."""
            from google.protobuf import json_format

            try:
                model = _model(state, request) if request.name else state.model()
                stats = await asyncio.to_thread(model_statistics, state, model)
            except errors.ServiceError as exc:
                await abort(context, exc)
            return json_format.ParseDict({"model_stats": [stats]}, pb.ModelStatisticsResponse())

        async def RepositoryIndex(self, request: Any, context: Any) -> Any:  # noqa: N802
            """The served model and the loadable ones (``v2_core.repository_index``)."""
            index = await asyncio.to_thread(repository_index, state, bool(request.ready))
            entry = pb.RepositoryIndexResponse.ModelIndex
            return pb.RepositoryIndexResponse(models=[entry(**m) for m in index])

        async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:  # noqa: N802
            await abort(context, repository_control("load"))

        async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:  # noqa: N802
            await abort(context, repository_control("unload"))

        async def ModelInfer(self, request: Any, context: Any) -> Any:  # noqa: N802
            """V2 gRPC's adapter over the one scoring path (service.frontend.pipeline.infer)."""
            try:
                with state.engine.arrival() as arrival:  # as ServingMiddleware does
                    arrival.start()  # the request is whole: gRPC hands it over complete
                    model = state.model(request.model_name)
                    if request.model_version and request.model_version != model.version:
                        raise errors.NotFound(
                            f"model {model.name!r} has no version {request.model_version!r}"
                        )
                    params = check_parameters({k: _param(v) for k, v in request.parameters.items()})
                    names = check_outputs([o.name for o in request.outputs])
                    arr, dtype = _input_array(request, state.settings.max_images)
                    metadata = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
                    answer = await infer(state, params.call(model, Pixels(arr, dtype), metadata))
            except Exception as exc:  # noqa: BLE001 - every failure is a gRPC status
                await abort(context, exc)
            tensors = output_tensors(answer.columns, len(model.class_names))
            out = pb.ModelInferResponse(
                model_name=model.name, model_version=model.version, id=request.id
            )
            for key, value in answer.review.items():  # review_status, review_id
                out.parameters[key].string_param = value
            for n in names:
                t = tensors[n]
                out.outputs.add(name=n, datatype=OUTPUTS[n], shape=list(t.shape))
                out.raw_output_contents.append(np.ascontiguousarray(t).tobytes())
            return out

    async def _unsupported(self: Any, request: Any, context: Any) -> Any:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "not supported by vge-serve (no shared memory, trace or log settings)",
        )

    # The base class's stubs raise NotImplementedError, which grpc logs with a traceback: every
    # RPC this server does not implement answers UNIMPLEMENTED with a message instead.
    for rpc in dir(pb_grpc.GRPCInferenceServiceServicer):
        if rpc[0].isupper() and rpc not in Servicer.__dict__:
            setattr(Servicer, rpc, _unsupported)
    return Servicer()


async def start_grpc(state: ServiceState) -> Any:
    """Start the gRPC server of this front end on ``VGE_GRPC_PORT`` (shared via SO_REUSEPORT)."""
    try:
        import grpc
        from tritonclient.grpc import service_pb2_grpc as pb_grpc
    except ImportError as exc:
        raise RuntimeError(
            "VGE_GRPC_PORT is set but gRPC support is not installed: pip install 'vge-serve[grpc]'"
        ) from exc
    from service.frontend.grpc_limits import CallDeadline, server_options

    settings = (
        state.settings
    )  # limits: no client holds the server (service/frontend/grpc_limits.py)
    server = grpc.aio.server(
        options=server_options(settings),
        maximum_concurrent_rpcs=settings.grpc_max_concurrent_rpcs,
        interceptors=[CallDeadline(settings.grpc_call_timeout_s)],
    )
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(make_servicer(state), server)
    server.add_insecure_port(host_port(settings.host, settings.grpc_port))  # IPv6 bracketed
    await server.start()
    return server
