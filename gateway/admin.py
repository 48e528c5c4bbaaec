"""AdminService: operators' calls (LoRA adapters), and the gateway's token check that keeps
them to holders of the internal token.

The gateway holds two kinds of token (common/security.py): the public ones its clients send
(--auth-token-file) and the internal one only pagewire's own services hold, which it sends to
its backends (--backend-auth-token-file). GenerationService takes a public token; AdminService
only the internal one, so a client of the public API cannot change what the gateway serves.
When the gateway has public tokens but no internal one, AdminService refuses every call; with
no token at all (a development set-up), both are open.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from common.security import TokenAuthInterceptor
from gateway import refusals
from gateway.adapters import AdapterAdmin, AdapterError
from protos import gateway_pb2, gateway_pb2_grpc

log = logging.getLogger(__name__)

ADMIN_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["AdminService"]
_ADMIN_PREFIX = f"/{ADMIN_SERVICE.full_name}/"


class AdminServicer(gateway_pb2_grpc.AdminServiceServicer):
    """LoRA adapter loads and unloads, through the gateway's AdapterAdmin (the HTTP API's
    /v1/load_lora_adapter and /v1/unload_lora_adapter call it too)."""

    def __init__(self, admin: AdapterAdmin) -> None:
        self._admin = admin

    def LoadLoraAdapter(self, request: gateway_pb2.LoadLoraAdapterRequest,
                        context: grpc.ServicerContext) -> gateway_pb2.LoadLoraAdapterResponse:
        try:
            adapter = self._admin.load(request.lora_name, request.lora_path)
        except AdapterError as error:
            _refuse(context, error)
        return gateway_pb2.LoadLoraAdapterResponse(adapter=gateway_pb2.LoraAdapter(
            name=adapter.name, path=adapter.path, rank=adapter.rank))

    def UnloadLoraAdapter(self, request: gateway_pb2.UnloadLoraAdapterRequest,
                          context: grpc.ServicerContext
                          ) -> gateway_pb2.UnloadLoraAdapterResponse:
        try:
            self._admin.unload(request.lora_name)
        except AdapterError as error:
            _refuse(context, error)
        return gateway_pb2.UnloadLoraAdapterResponse()


def _refuse(context: grpc.ServicerContext, error: AdapterError) -> None:
    refusals.record("grpc", error.code_name, "lora_adapter", context.peer(), error.message)
    context.abort(getattr(grpc.StatusCode, error.code_name), error.message)


class GatewayAuth(grpc.ServerInterceptor):
    """Public tokens for every service but AdminService, the internal token for that one."""

    def __init__(self, public: Sequence[str], internal: str,
                 on_refusal: Callable[[str, str], None] | None = None) -> None:
        self._public = TokenAuthInterceptor(public, on_refusal) if public else None
        # No internal token while public ones are set: an interceptor that accepts no token.
        self._admin = (TokenAuthInterceptor([internal] if internal else [], on_refusal)
                       if internal or public else None)
        if public and not internal:
            log.warning("AdminService refuses every call: the gateway has public tokens but "
                        "no internal one (--backend-auth-token-file)")

    @property
    def checks_tokens(self) -> bool:
        return self._public is not None or self._admin is not None

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          details: grpc.HandlerCallDetails) -> Any:
        check = self._admin if details.method.startswith(_ADMIN_PREFIX) else self._public
        if check is None:
            return continuation(details)
        return check.intercept_service(continuation, details)
